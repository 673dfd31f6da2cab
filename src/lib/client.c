/* The client handle: host resolution, JSON round trips, small helpers. */
#include "internal.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "common/b64.h"
#include "common/util.h"

const char *
warren_version (void)
{
  return WARREN_VERSION;
}

bool
warren_id_valid (const char *id)
{
  return id && wr_id_valid (id, strnlen (id, WR_ID_MAX + 1));
}

static int
parse_host (wl_host_t *out, const char *host, warren_error_t *err)
{
  if (strncmp (host, "unix:", 5) == 0 || host[0] == '/')
    {
      const char *p = host[0] == '/' ? host : host + 5;
      if (strncmp (p, "//", 2) == 0)
        p += 2; /* unix:///path */
      if (*p == '\0')
        return wl_error (err, 0, WARREN_E_INVALID, 0, "empty socket path in host '%s'", host);
      out->unix_path = strdup (p);
      out->host_header = strdup ("localhost");
      if (asprintf (&out->name, "unix:%s", p) < 0)
        out->name = NULL;
      if (!out->unix_path || !out->host_header || !out->name)
        return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "host");
      return 0;
    }
  const char *rest;
  if (strncmp (host, "http://", 7) == 0)
    rest = host + 7;
  else if (strncmp (host, "tcp:", 4) == 0)
    rest = host + 4; /* the daemon's --listen syntax */
  else if (strncmp (host, "https://", 8) == 0)
    return wl_error (err, 0, WARREN_E_UNSUPPORTED, 0,
                     "https is not supported by libwarren ('%s'); use a TLS proxy", host);
  else
    return wl_error (err, 0, WARREN_E_INVALID, 0,
                     "bad host '%s': expected unix:/path/sock or http://host:port", host);
  size_t n = strcspn (rest, "/");
  if (rest[n] == '/' && rest[n + 1] != '\0')
    return wl_error (err, 0, WARREN_E_INVALID, 0, "bad host '%s': no path allowed", host);
  _cleanup_free_ char *hp = strndup (rest, n);
  if (hp == NULL)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "host");
  char *h = hp, *port = NULL;
  if (h[0] == '[')
    {
      char *close = strchr (h, ']');
      if (close == NULL || (close[1] != '\0' && close[1] != ':'))
        return wl_error (err, 0, WARREN_E_INVALID, 0, "bad host '%s'", host);
      *close = '\0';
      port = close[1] == ':' ? close + 2 : NULL;
      h++;
    }
  else
    {
      char *colon = strrchr (h, ':');
      if (colon)
        {
          *colon = '\0';
          port = colon + 1;
        }
    }
  if (*h == '\0')
    return wl_error (err, 0, WARREN_E_INVALID, 0, "bad host '%s': empty host name", host);
  if (port == NULL || *port == '\0')
    port = "80";
  char *end;
  long pn = strtol (port, &end, 10);
  if (*end != '\0' || pn <= 0 || pn > 65535)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "bad host '%s': bad port", host);
  bool v6 = strchr (h, ':') != NULL;
  out->tcp_host = strdup (h);
  out->tcp_port = strdup (port);
  if (asprintf (&out->host_header, v6 ? "[%s]:%s" : "%s:%s", h, port) < 0)
    out->host_header = NULL;
  if (asprintf (&out->name, "http://%s", out->host_header ? out->host_header : "") < 0)
    out->name = NULL;
  if (!out->tcp_host || !out->tcp_port || !out->host_header || !out->name)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "host");
  return 0;
}

void
wl_hosts_free (wl_host_t *hosts, size_t n)
{
  for (size_t i = 0; hosts && i < n; i++)
    {
      free (hosts[i].name);
      free (hosts[i].unix_path);
      free (hosts[i].tcp_host);
      free (hosts[i].tcp_port);
      free (hosts[i].host_header);
    }
  free (hosts);
}

int
wl_hosts_parse (const char *spec, wl_host_t **ret, size_t *ret_n, warren_error_t *err)
{
  size_t n = 1;
  for (const char *p = spec; *p; p++)
    n += *p == ',';
  if (n > WL_MAX_HOSTS)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "more than %d hosts in '%.200s'", WL_MAX_HOSTS,
                     spec);
  wl_host_t *hosts = calloc (n, sizeof *hosts);
  if (hosts == NULL)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "host");
  const char *p = spec;
  for (size_t i = 0; i < n; i++)
    {
      size_t len = strcspn (p, ",");
      const char *b = p, *e = p + len;
      while (b < e && (*b == ' ' || *b == '\t'))
        b++;
      while (e > b && (e[-1] == ' ' || e[-1] == '\t'))
        e--;
      _cleanup_free_ char *one = strndup (b, (size_t)(e - b));
      int r = one == NULL    ? wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "host")
              : *one == '\0' ? wl_error (err, 0, WARREN_E_INVALID, 0,
                                         "empty entry in host list '%.200s'", spec)
                             : parse_host (&hosts[i], one, err);
      if (r < 0)
        {
          wl_hosts_free (hosts, n);
          return r;
        }
      p += len + (p[len] == ',');
    }
  *ret = hosts;
  *ret_n = n;
  return 0;
}

void
wl_use_host (warren_client_t *c, size_t i)
{
  if (c->fd >= 0 && i != c->cur)
    warren_client_disconnect (c);
  c->cur = i;
  c->host = c->hosts[i].name;
  c->unix_path = c->hosts[i].unix_path;
  c->tcp_host = c->hosts[i].tcp_host;
  c->tcp_port = c->hosts[i].tcp_port;
  c->host_header = c->hosts[i].host_header;
}

warren_client_t *
warren_client_new (const char *host, const char *token, warren_error_t *err)
{
  warren_client_t *c = calloc (1, sizeof *c);
  if (c == NULL)
    {
      wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "client");
      return NULL;
    }
  c->fd = -1;
  c->timeout_ms = WL_DEFAULT_TIMEOUT_MS;
  _cleanup_free_ char *dflt = NULL;
  if (host == NULL || *host == '\0')
    host = getenv ("WARREN_HOST");
  if (host == NULL || *host == '\0')
    {
      const char *root = getenv ("WARREN_ROOT");
      if (asprintf (&dflt, "unix:%s/warrend.sock", root && *root ? root : "/var/lib/warren") < 0)
        dflt = NULL;
      host = dflt;
    }
  if (token == NULL)
    token = getenv ("WARREN_TOKEN");
  c->rbuf = malloc (WL_RBUF_SIZE);
  if (host == NULL || c->rbuf == NULL)
    {
      wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "client");
      warren_client_free (c);
      return NULL;
    }
  if (wl_hosts_parse (host, &c->hosts, &c->nhosts, err) < 0)
    {
      warren_client_free (c);
      return NULL;
    }
  wl_use_host (c, 0);
  if (token && *token)
    {
      c->token = strdup (token);
      if (c->token == NULL)
        {
          wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "client");
          warren_client_free (c);
          return NULL;
        }
    }
  return c;
}

void
warren_client_free (warren_client_t *c)
{
  if (c == NULL)
    return;
  warren_client_disconnect (c);
  wl_hosts_free (c->hosts, c->nhosts);
  if (c->token)
    explicit_bzero (c->token, strlen (c->token));
  free (c->token);
  free (c->rbuf);
  free (c);
}

const char *
warren_client_host (const warren_client_t *c)
{
  return c->host;
}

void
warren_client_set_timeout (warren_client_t *c, int timeout_ms)
{
  c->timeout_ms = timeout_ms < 0 ? 0 : timeout_ms;
}

void
warren_client_set_cancel_flag (warren_client_t *c, const volatile sig_atomic_t *flag)
{
  c->cancel = flag;
}

void
warren_client_disconnect (warren_client_t *c)
{
  if (c->fd >= 0)
    close (c->fd);
  c->fd = -1;
  c->rpos = c->rlen = 0;
}

int
wl_stream_begin (warren_client_t *c, const char *target, const json_t *req, int timeout_ms,
                 const char *what, wl_response_t *resp, warren_error_t *err)
{
  _cleanup_ (json_decrefp) json_t *body = json_copy ((json_t *)req);
  if (body == NULL || json_object_set_new (body, "stream", json_true ()) < 0)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "%s", what);
  _cleanup_free_ char *text = json_dumps (body, JSON_COMPACT);
  if (text == NULL)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "%s is not serializable JSON", what);
  wl_request_t hreq = { .method = "POST",
                        .target = target,
                        .content_type = "application/json",
                        .body = text,
                        .body_fd = -1,
                        .body_len = strlen (text),
                        .timeout_ms = timeout_ms };
  return wl_http_request (c, &hreq, resp, err);
}

/* Every create carries an idempotency key, the caller's ("idempotency_key"
 * in the body) or a random one, so that a create sent again through another
 * gateway after a lost connection never makes a second sandbox. */
static const char *
create_idem_key (const char *method, const char *target, const json_t *body, char key[static 40])
{
  if (strcmp (method, "POST") != 0 || strcmp (target, "/v1/sandboxes") != 0)
    return NULL;
  const char *given = json_string_value (json_object_get (body, "idempotency_key"));
  if (given)
    {
      /* the gateway rejects a malformed key; it must not reach the header */
      size_t n = strlen (given);
      bool ok = n > 0 && n <= 128;
      for (size_t i = 0; ok && i < n; i++)
        ok = isalnum ((unsigned char)given[i]) || strchr ("._:-", given[i]);
      return ok ? given : NULL;
    }
  memcpy (key, "wl-", 3);
  if (wr_random_hex (key + 3, 32) < 0)
    return NULL; /* no key: the create is not replayed */
  return key;
}

int
wl_json_call (warren_client_t *c, const char *method, const char *target, const json_t *body,
              int timeout_ms, json_t **ret, warren_error_t *err)
{
  _cleanup_free_ char *text = NULL;
  if (body)
    {
      text = json_dumps (body, JSON_COMPACT);
      if (text == NULL)
        return wl_error (err, 0, WARREN_E_INVALID, 0, "request body is not serializable JSON");
    }
  char key[40];
  wl_request_t req = {
    .method = method,
    .target = target,
    .content_type = "application/json",
    .body = text,
    .body_fd = -1,
    .body_len = text ? strlen (text) : 0,
    .timeout_ms = timeout_ms,
    .idem_key = create_idem_key (method, target, body, key),
  };
  req.idem_auto = req.idem_key == key;
  wl_response_t resp;
  int hr = wl_http_request (c, &req, &resp, err);
  if (hr < 0)
    return hr;
  if (resp.status < 200 || resp.status >= 300)
    {
      wl_http_end (c, &resp);
      return wl_error (err, 0, WARREN_E_PROTOCOL, resp.status, "unexpected HTTP %d from %s",
                       resp.status, c->host);
    }
  _cleanup_free_ char *data = NULL;
  size_t len = 0;
  int r = wl_http_read_all (c, &resp, WL_JSON_MAX, &data, &len, err);
  wl_http_end (c, &resp);
  if (r < 0)
    return r;
  if (ret == NULL)
    return 0;
  size_t i = 0;
  while (i < len && (data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t'))
    i++;
  if (i == len)
    {
      *ret = json_object ();
      return 0;
    }
  json_error_t jerr;
  json_t *j = json_loadb (data, len, JSON_ALLOW_NUL, &jerr);
  if (j == NULL)
    return wl_error (err, 0, WARREN_E_PROTOCOL, resp.status, "invalid JSON from %s: %s", c->host,
                     jerr.text);
  *ret = j;
  return 0;
}

int
warren_request (warren_client_t *c, const char *method, const char *path, const json_t *body,
                json_t **ret, warren_error_t *err)
{
  if (method == NULL || path == NULL || path[0] != '/' || strpbrk (path, " \r\n\t")
      || strpbrk (method, " \r\n\t/:"))
    return wl_error (err, 0, WARREN_E_INVALID, 0, "bad method or path");
  return wl_json_call (c, method, path, body, 0, ret, err);
}

char *
warren_base64_encode (const void *data, size_t len, size_t *ret_len)
{
  size_t n = wr_b64_encoded_len (len);
  char *out = malloc (n + 1);
  if (out == NULL)
    return NULL;
  wr_b64_encode (data, len, out);
  if (ret_len)
    *ret_len = n;
  return out;
}

int
warren_base64_decode (const char *s, size_t len, void **ret, size_t *ret_len)
{
  _cleanup_free_ char *out = malloc (3 * (len / 4) + 4);
  if (out == NULL)
    return -ENOMEM;
  long n = wr_b64_decode (s, len, out);
  if (n < 0)
    return -EINVAL;
  out[n] = '\0';
  *ret = TAKE_PTR (out);
  if (ret_len)
    *ret_len = (size_t)n;
  return 0;
}

int
warren_result_status (const json_t *result)
{
  if (json_is_true (json_object_get (result, "timed_out")))
    return 124;
  json_int_t sig = json_integer_value (json_object_get (result, "signal"));
  json_int_t code = json_integer_value (json_object_get (result, "exit_code"));
  if (sig > 0 && sig < 128)
    return 128 + (int)sig;
  if (code < 0 || code > 255)
    return 255;
  return (int)code;
}

int
warren_result_bytes (const json_t *result, const char *key, void **ret, size_t *ret_len,
                     warren_error_t *err)
{
  json_t *v = json_object_get (result, key);
  if (v == NULL || json_is_null (v))
    {
      char *empty = calloc (1, 1);
      if (empty == NULL)
        return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "output");
      *ret = empty;
      *ret_len = 0;
      return 0;
    }
  if (!json_is_string (v))
    return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "'%s' is not a string", key);
  char enc_key[64];
  snprintf (enc_key, sizeof enc_key, "%s_encoding", key);
  const char *enc = json_string_value (json_object_get (result, enc_key));
  const char *s = json_string_value (v);
  size_t len = json_string_length (v);
  if (enc && strcmp (enc, "base64") == 0)
    {
      if (warren_base64_decode (s, len, ret, ret_len) < 0)
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "'%s' is not valid base64", key);
      return 0;
    }
  if (enc && *enc && strcmp (enc, "utf-8") != 0 && strcmp (enc, "utf8") != 0)
    return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "unknown encoding '%.32s' of '%s'", enc, key);
  char *copy = malloc (len + 1);
  if (copy == NULL)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "output");
  memcpy (copy, s, len);
  copy[len] = '\0';
  *ret = copy;
  *ret_len = len;
  return 0;
}

int
warren_json_set_bytes (json_t *obj, const char *key, const void *data, size_t len,
                       warren_error_t *err)
{
  char enc_key[64];
  if (snprintf (enc_key, sizeof enc_key, "%s_encoding", key) >= (int)sizeof enc_key)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "key too long");
  json_t *v;
  bool b64 = !wr_utf8_valid (data, len);
  if (!b64)
    v = json_stringn (data, len);
  else
    {
      size_t n;
      _cleanup_free_ char *enc = warren_base64_encode (data, len, &n);
      v = enc ? json_stringn (enc, n) : NULL;
    }
  if (v == NULL || json_object_set_new (obj, key, v) < 0)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "setting '%s'", key);
  if (b64)
    json_object_set_new (obj, enc_key, json_string ("base64"));
  else
    json_object_del (obj, enc_key);
  return 0;
}

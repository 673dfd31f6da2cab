/* etcd v3 over its JSON gateway (etcd.h). One short HTTP/1.1 connection per
 * unary call: the callers are a registration thread and a quota thread doing
 * a few calls a second, and a fresh connection is what makes failover to the
 * next member trivial. Watches keep their connection and read the chunked
 * NDJSON stream the gateway sends. */
#include "cluster/etcd.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <pthread.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "common/b64.h"
#include "common/util.h"

struct endpoint
{
  char host[256];
  char port[8];
  bool tls; /* https:// */
};

/* TLS to etcd (wr_etcd_tls): one client context for the process. An https
 * endpoint without wr_etcd_tls gets the system's CAs and no client cert. */
static SSL_CTX *tls_ctx;
static pthread_mutex_t tls_mu = PTHREAD_MUTEX_INITIALIZER;

static int
tls_error (wr_err_t *err, const char *what, const char *file)
{
  char buf[200] = "";
  unsigned long e = ERR_get_error ();
  if (e)
    ERR_error_string_n (e, buf, sizeof buf);
  ERR_clear_error ();
  return wr_error (err, 0, WR_E_INVALID, "etcd TLS: %s%s%s: %s", what, file ? " " : "",
                   file ? file : "", buf[0] ? buf : "failed");
}

int
wr_etcd_tls (const char *cacert, const char *cert, const char *key, wr_err_t *err)
{
  if (key && !cert)
    return wr_error (err, 0, WR_E_INVALID, "etcd TLS: a key without a certificate");
  SSL_CTX *ctx = SSL_CTX_new (TLS_client_method ());
  if (ctx == NULL)
    return tls_error (err, "context", NULL);
  SSL_CTX_set_min_proto_version (ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify (ctx, SSL_VERIFY_PEER, NULL);
  int ok = cacert ? SSL_CTX_load_verify_locations (ctx, cacert, NULL)
                  : SSL_CTX_set_default_verify_paths (ctx);
  if (ok != 1)
    {
      SSL_CTX_free (ctx);
      return tls_error (err, "CA certificates", cacert);
    }
  if (cert
      && (SSL_CTX_use_certificate_chain_file (ctx, cert) != 1
          || SSL_CTX_use_PrivateKey_file (ctx, key ? key : cert, SSL_FILETYPE_PEM) != 1
          || SSL_CTX_check_private_key (ctx) != 1))
    {
      SSL_CTX_free (ctx);
      return tls_error (err, "client certificate and key", cert);
    }
  pthread_mutex_lock (&tls_mu);
  SSL_CTX_free (tls_ctx);
  tls_ctx = ctx;
  pthread_mutex_unlock (&tls_mu);
  return 0;
}

static SSL_CTX *
tls_context (void)
{
  pthread_mutex_lock (&tls_mu);
  if (tls_ctx == NULL)
    {
      wr_err_t err;
      pthread_mutex_unlock (&tls_mu);
      if (wr_etcd_tls (NULL, NULL, NULL, &err) < 0)
        return NULL;
      pthread_mutex_lock (&tls_mu);
    }
  SSL_CTX *c = tls_ctx;
  SSL_CTX_up_ref (c);
  pthread_mutex_unlock (&tls_mu);
  return c;
}

struct wr_etcd
{
  struct endpoint *eps;
  size_t n;
  atomic_uint cur; /* the endpoint that answered last */
  int timeout_ms;
};

#define MAX_BODY (64u << 20)

int
wr_etcd_new (const char *urls, int timeout_ms, struct wr_etcd **ret, wr_err_t *err)
{
  if (urls == NULL || *urls == '\0')
    return wr_error (err, 0, WR_E_INVALID, "no etcd endpoints");
  struct wr_etcd *e = calloc (1, sizeof *e);
  if (e == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "etcd client");
  e->timeout_ms = timeout_ms > 0 ? timeout_ms : 3000;
  _cleanup_free_ char *copy = strdup (urls);
  char *save = NULL;
  for (char *u = strtok_r (copy, ",", &save); u; u = strtok_r (NULL, ",", &save))
    {
      bool tls = strncmp (u, "https://", 8) == 0;
      if (!tls && strncmp (u, "http://", 7) != 0)
        {
          wr_etcd_free (e);
          return wr_error (err, 0, WR_E_INVALID,
                           "etcd endpoint %.200s: want http://HOST:PORT or https://HOST:PORT", u);
        }
      u += tls ? 8 : 7;
      char *slash = strchr (u, '/');
      if (slash)
        *slash = '\0';
      char *colon = strrchr (u, ':');
      struct endpoint ep = { 0 };
      if (colon == NULL || colon == u || strlen (colon + 1) >= sizeof ep.port
          || (size_t)(colon - u) >= sizeof ep.host)
        {
          wr_etcd_free (e);
          return wr_error (err, 0, WR_E_INVALID, "etcd endpoint %.200s: want HOST:PORT", u);
        }
      memcpy (ep.host, u, colon - u);
      snprintf (ep.port, sizeof ep.port, "%s", colon + 1);
      ep.tls = tls;
      struct endpoint *n = realloc (e->eps, (e->n + 1) * sizeof *n);
      if (n == NULL)
        {
          wr_etcd_free (e);
          return wr_error (err, ENOMEM, WR_E_INTERNAL, "etcd client");
        }
      e->eps = n;
      e->eps[e->n++] = ep;
    }
  if (e->n == 0)
    {
      wr_etcd_free (e);
      return wr_error (err, 0, WR_E_INVALID, "no etcd endpoints");
    }
  *ret = e;
  return 0;
}

void
wr_etcd_free (struct wr_etcd *e)
{
  if (e == NULL)
    return;
  free (e->eps);
  free (e);
}

/* ---- a minimal blocking HTTP/1.1 client with deadlines ---- */

struct conn
{
  int fd;
  SSL *ssl;             /* https endpoints */
  char tls_err[160];    /* why the handshake failed */
  bool got_any;         /* a byte of the answer arrived */
  uint64_t deadline_ms; /* 0: none (watch streams) */
  const volatile bool *stop;
  char buf[16384];
  size_t off, len;
};

static int
wait_fd (struct conn *c, short ev)
{
  for (;;)
    {
      int ms = 500;
      if (c->deadline_ms)
        {
          uint64_t now = wr_now_ms ();
          if (now >= c->deadline_ms)
            return -ETIMEDOUT;
          if (c->deadline_ms - now < (uint64_t)ms)
            ms = (int)(c->deadline_ms - now);
        }
      if (c->stop && *c->stop)
        return -ECANCELED;
      struct pollfd p = { .fd = c->fd, .events = ev };
      int r = poll (&p, 1, ms);
      if (r > 0)
        return 0;
      if (r < 0 && errno != EINTR)
        return -errno;
    }
}

/* Wait for what an SSL call asked for; 1 to call it again, < 0 to give up. */
static int
tls_wait (struct conn *c, int ret)
{
  switch (SSL_get_error (c->ssl, ret))
    {
    case SSL_ERROR_WANT_READ:
      return wait_fd (c, POLLIN) < 0 ? -ETIMEDOUT : 1;
    case SSL_ERROR_WANT_WRITE:
      return wait_fd (c, POLLOUT) < 0 ? -ETIMEDOUT : 1;
    case SSL_ERROR_ZERO_RETURN:
      return -ECONNRESET;
    case SSL_ERROR_SYSCALL:
      return errno == EINTR ? 1 : errno ? -errno : -ECONNRESET;
    default:
      {
        unsigned long e = ERR_peek_error ();
        if (e && c->tls_err[0] == '\0')
          {
            char b[120];
            ERR_error_string_n (e, b, sizeof b);
            snprintf (c->tls_err, sizeof c->tls_err, "TLS: %s", b);
          }
        ERR_clear_error ();
        return -EPROTO;
      }
    }
}

/* The handshake, verifying the member's certificate against the CAs and its
 * name (or address) against the endpoint's host. */
static int
tls_open (struct conn *c, const struct endpoint *ep)
{
  SSL_CTX *ctx = tls_context ();
  if (ctx == NULL)
    return -ENOMEM;
  c->ssl = SSL_new (ctx);
  SSL_CTX_free (ctx);
  if (c->ssl == NULL || SSL_set_fd (c->ssl, c->fd) != 1)
    return -ENOMEM;
  unsigned char addr[16];
  if (inet_pton (AF_INET, ep->host, addr) == 1 || inet_pton (AF_INET6, ep->host, addr) == 1)
    X509_VERIFY_PARAM_set1_ip_asc (SSL_get0_param (c->ssl), ep->host);
  else
    {
      SSL_set_tlsext_host_name (c->ssl, ep->host);
      SSL_set1_host (c->ssl, ep->host);
    }
  for (;;)
    {
      int r = SSL_connect (c->ssl);
      if (r == 1)
        return 0;
      long v = SSL_get_verify_result (c->ssl);
      unsigned long e = ERR_peek_error ();
      int w = tls_wait (c, r);
      if (w > 0)
        continue;
      if (v != X509_V_OK)
        snprintf (c->tls_err, sizeof c->tls_err, "TLS: certificate: %s",
                  X509_verify_cert_error_string (v));
      else if (e)
        {
          char b[120];
          ERR_error_string_n (e, b, sizeof b);
          snprintf (c->tls_err, sizeof c->tls_err, "TLS handshake: %s", b);
        }
      ERR_clear_error ();
      return w;
    }
}

/* The member closed the connection while we wrote: under TLS 1.3 a refused
 * client certificate shows only after the handshake, as an alert that may
 * still wait in the socket. Read it, so the error says why. */
static void
tls_closed (struct conn *c)
{
  if (c->tls_err[0])
    return;
  char b[1];
  int r = SSL_read (c->ssl, b, 1);
  unsigned long e = r <= 0 ? ERR_peek_error () : 0;
  if (e)
    {
      char m[120];
      ERR_error_string_n (e, m, sizeof m);
      snprintf (c->tls_err, sizeof c->tls_err, "TLS: %s", m);
    }
  else
    snprintf (c->tls_err, sizeof c->tls_err,
              "TLS: the member closed the connection after the handshake (did it refuse the "
              "client certificate?)");
  ERR_clear_error ();
}

static void
conn_close (struct conn *c)
{
  if (c->ssl)
    {
      SSL_free (c->ssl);
      c->ssl = NULL;
    }
  if (c->fd >= 0)
    close (c->fd);
  c->fd = -1;
}

/* What went wrong with c, for the error message. */
static const char *
conn_error (const struct conn *c, int r)
{
  return c->tls_err[0] ? c->tls_err : strerror (-r);
}

static int
conn_open (struct conn *c, const struct endpoint *ep)
{
  struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *ai = NULL;
  int r = getaddrinfo (ep->host, ep->port, &hints, &ai);
  if (r != 0)
    return -EHOSTUNREACH;
  c->fd = socket (ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (c->fd < 0)
    {
      freeaddrinfo (ai);
      return -errno;
    }
  int one = 1;
  setsockopt (c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  r = connect (c->fd, ai->ai_addr, ai->ai_addrlen);
  freeaddrinfo (ai);
  if (r < 0 && errno != EINPROGRESS)
    return -errno;
  if (r < 0)
    {
      if ((r = wait_fd (c, POLLOUT)) < 0)
        return r;
      int so = 0;
      socklen_t sl = sizeof so;
      getsockopt (c->fd, SOL_SOCKET, SO_ERROR, &so, &sl);
      if (so)
        return -so;
    }
  return ep->tls ? tls_open (c, ep) : 0;
}

static int
conn_send (struct conn *c, const char *p, size_t n)
{
  while (n)
    {
      if (c->ssl)
        {
          int w = SSL_write (c->ssl, p, (int)(n < INT32_MAX ? n : INT32_MAX));
          if (w > 0)
            {
              p += w;
              n -= (size_t)w;
              continue;
            }
          int r = tls_wait (c, w);
          if (r == -EPIPE || r == -ECONNRESET)
            tls_closed (c);
          if (r < 0)
            return r;
          continue;
        }
      ssize_t w = send (c->fd, p, n, MSG_NOSIGNAL);
      if (w < 0 && (errno == EAGAIN || errno == EINTR))
        {
          int r = wait_fd (c, POLLOUT);
          if (r < 0)
            return r;
          continue;
        }
      if (w < 0)
        return -errno;
      p += w;
      n -= (size_t)w;
    }
  return 0;
}

/* Make at least one byte available in the buffer. */
static int
conn_fill (struct conn *c)
{
  if (c->off < c->len)
    return 0;
  c->off = c->len = 0;
  for (;;)
    {
      if (c->ssl)
        {
          int r = SSL_read (c->ssl, c->buf, (int)sizeof c->buf);
          if (r > 0)
            {
              c->len = (size_t)r;
              c->got_any = true;
              return 0;
            }
          int w = tls_wait (c, r);
          if ((w == -EPIPE || w == -ECONNRESET) && !c->got_any)
            tls_closed (c);
          if (w < 0)
            return w;
          continue;
        }
      ssize_t r = recv (c->fd, c->buf, sizeof c->buf, 0);
      if (r > 0)
        {
          c->len = (size_t)r;
          return 0;
        }
      if (r == 0)
        return -ECONNRESET;
      if (errno != EAGAIN && errno != EINTR)
        return -errno;
      int w = wait_fd (c, POLLIN);
      if (w < 0)
        return w;
    }
}

static int
conn_line (struct conn *c, char *line, size_t max)
{
  size_t n = 0;
  for (;;)
    {
      int r = conn_fill (c);
      if (r < 0)
        return r;
      char ch = c->buf[c->off++];
      if (ch == '\n')
        break;
      if (n + 1 >= max)
        return -EPROTO;
      line[n++] = ch;
    }
  if (n && line[n - 1] == '\r')
    n--;
  line[n] = '\0';
  return 0;
}

typedef int (*sink_fn) (void *ud, const char *data, size_t len);

static int
conn_read_n (struct conn *c, size_t n, sink_fn sink, void *ud)
{
  while (n)
    {
      int r = conn_fill (c);
      if (r < 0)
        return r;
      size_t k = c->len - c->off < n ? c->len - c->off : n;
      r = sink (ud, c->buf + c->off, k);
      if (r != 0)
        return r;
      c->off += k;
      n -= k;
    }
  return 0;
}

/* Send a POST and read the status and headers; the body follows through
 * read_body. */
static int
http_begin (struct conn *c, const struct endpoint *ep, const char *path, const char *body,
            int *ret_status, long long *ret_clen, bool *ret_chunked)
{
  int r = conn_open (c, ep);
  if (r < 0)
    return r;
  size_t blen = strlen (body);
  char head[1024];
  int hn = snprintf (head, sizeof head,
                     "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n",
                     path, ep->host, ep->port, blen);
  if ((r = conn_send (c, head, (size_t)hn)) < 0 || (r = conn_send (c, body, blen)) < 0)
    return r;
  char line[1024];
  if ((r = conn_line (c, line, sizeof line)) < 0)
    return r;
  if (strncmp (line, "HTTP/1.", 7) != 0 || strlen (line) < 12)
    return -EPROTO;
  *ret_status = atoi (line + 9);
  *ret_clen = -1;
  *ret_chunked = false;
  for (;;)
    {
      if ((r = conn_line (c, line, sizeof line)) < 0)
        return r;
      if (line[0] == '\0')
        break;
      if (strncasecmp (line, "content-length:", 15) == 0)
        *ret_clen = atoll (line + 15);
      else if (strncasecmp (line, "transfer-encoding:", 18) == 0 && strcasestr (line, "chunked"))
        *ret_chunked = true;
    }
  return 0;
}

static int
read_body (struct conn *c, long long clen, bool chunked, sink_fn sink, void *ud)
{
  if (!chunked)
    {
      if (clen < 0)
        return -EPROTO; /* we always ask for a fresh connection; the gateway sends one of the two */
      return conn_read_n (c, (size_t)clen, sink, ud);
    }
  for (;;)
    {
      char line[64];
      int r = conn_line (c, line, sizeof line);
      if (r < 0)
        return r;
      unsigned long n = strtoul (line, NULL, 16);
      if (n == 0)
        return 0;
      if ((r = conn_read_n (c, n, sink, ud)) != 0)
        return r;
      if ((r = conn_line (c, line, sizeof line)) < 0)
        return r;
    }
}

struct buf
{
  char *p;
  size_t len, cap;
};

static int
buf_sink (void *ud, const char *data, size_t len)
{
  struct buf *b = ud;
  if (b->len + len + 1 > MAX_BODY)
    return -EFBIG;
  if (b->len + len + 1 > b->cap)
    {
      size_t cap = b->cap ? b->cap : 4096;
      while (cap < b->len + len + 1)
        cap *= 2;
      char *n = realloc (b->p, cap);
      if (n == NULL)
        return -ENOMEM;
      b->p = n;
      b->cap = cap;
    }
  memcpy (b->p + b->len, data, len);
  b->len += len;
  b->p[b->len] = '\0';
  return 0;
}

int
wr_etcd_call (struct wr_etcd *e, const char *path, const json_t *body, json_t **ret, wr_err_t *err)
{
  _cleanup_free_ char *text = json_dumps (body, JSON_COMPACT);
  if (text == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "etcd %s: encoding the request", path);
  unsigned start = atomic_load (&e->cur);
  char last[256] = "no endpoint tried";
  for (size_t k = 0; k < e->n; k++)
    {
      unsigned i = (start + k) % e->n;
      struct conn c = { .fd = -1, .deadline_ms = wr_now_ms () + (uint64_t)e->timeout_ms };
      int status = 0;
      long long clen;
      bool chunked;
      struct buf b = { 0 };
      int r = http_begin (&c, &e->eps[i], path, text, &status, &clen, &chunked);
      if (r == 0)
        r = read_body (&c, clen, chunked, buf_sink, &b);
      if (r < 0)
        snprintf (last, sizeof last, "%s:%s: %s", e->eps[i].host, e->eps[i].port,
                  conn_error (&c, r));
      conn_close (&c);
      if (r < 0)
        {
          free (b.p);
          continue;
        }
      json_error_t je;
      json_t *j = b.p ? json_loads (b.p, 0, &je) : NULL;
      free (b.p);
      if (status >= 500 || j == NULL)
        {
          /* no leader, a timed out proposal, a member shutting down: another may answer */
          const char *m = json_string_value (json_object_get (j, "error"));
          snprintf (last, sizeof last, "%s:%s: HTTP %d %.160s", e->eps[i].host, e->eps[i].port,
                    status, m ? m : "");
          json_decref (j);
          continue;
        }
      atomic_store (&e->cur, i);
      if (status >= 400)
        {
          const char *m = json_string_value (json_object_get (j, "error"));
          int rr = wr_error (err, 0, status == 404 ? WR_E_NOT_FOUND : WR_E_INVALID,
                             "etcd %s: HTTP %d %.200s", path, status, m ? m : "");
          json_decref (j);
          return rr;
        }
      *ret = j;
      return 0;
    }
  return wr_error (err, 0, WR_E_UNAVAILABLE, "etcd %s: no member answered (last: %s)", path, last);
}

/* ---- key/value helpers ---- */

json_t *
wr_etcd_b64 (const char *s, size_t len)
{
  char *out = malloc (wr_b64_encoded_len (len) + 1);
  if (out == NULL)
    return NULL;
  wr_b64_encode (s, len, out);
  json_t *j = json_string (out);
  free (out);
  return j;
}

json_t *
wr_etcd_prefix_end (const char *prefix)
{
  size_t n = strlen (prefix);
  _cleanup_free_ char *end = strdup (prefix);
  if (end == NULL || n == 0)
    return wr_etcd_b64 ("\0", 1);
  end[n - 1]++;
  return wr_etcd_b64 (end, n);
}

static char *
b64_decode_str (const char *in)
{
  if (in == NULL)
    return strdup ("");
  size_t n = strlen (in);
  char *out = malloc (3 * (n / 4) + 4);
  if (out == NULL)
    return NULL;
  long k = wr_b64_decode (in, n, out);
  if (k < 0)
    {
      free (out);
      return NULL;
    }
  out[k] = '\0';
  return out;
}

static int64_t
json_i64 (const json_t *j)
{
  /* the gateway writes int64 as strings */
  if (json_is_string (j))
    return strtoll (json_string_value (j), NULL, 10);
  if (json_is_integer (j))
    return json_integer_value (j);
  return 0;
}

static json_t *
s64 (int64_t v)
{
  char b[32];
  snprintf (b, sizeof b, "%lld", (long long)v);
  return json_string (b);
}

/* wr_etcd_call with a body it consumes; the answer is dropped when ret is NULL. */
static int
call_take (struct wr_etcd *e, const char *path, json_t *body, json_t **ret, wr_err_t *err)
{
  json_t *resp = NULL;
  int r = body ? wr_etcd_call (e, path, body, &resp, err)
               : wr_error (err, ENOMEM, WR_E_INTERNAL, "etcd %s: building the request", path);
  json_decref (body);
  if (r == 0 && ret)
    *ret = resp;
  else
    json_decref (resp);
  return r;
}

int
wr_etcd_put (struct wr_etcd *e, const char *key, const char *val, int64_t lease, wr_err_t *err)
{
  json_t *body = json_pack ("{s:o,s:o}", "key", wr_etcd_b64 (key, strlen (key)), "value",
                            wr_etcd_b64 (val, strlen (val)));
  if (lease)
    json_object_set_new (body, "lease", s64 (lease));
  return call_take (e, "/v3/kv/put", body, NULL, err);
}

int
wr_etcd_delete (struct wr_etcd *e, const char *key, wr_err_t *err)
{
  return call_take (e, "/v3/kv/deleterange",
                    json_pack ("{s:o}", "key", wr_etcd_b64 (key, strlen (key))), NULL, err);
}

static json_t *
decode_kvs (const json_t *kvs)
{
  json_t *out = json_array ();
  size_t i;
  json_t *kv;
  json_array_foreach (kvs, i, kv)
  {
    _cleanup_free_ char *k = b64_decode_str (json_string_value (json_object_get (kv, "key")));
    _cleanup_free_ char *v = b64_decode_str (json_string_value (json_object_get (kv, "value")));
    json_t *key = k ? json_string (k) : NULL, *val = v ? json_string (v) : NULL;
    if (key == NULL || val == NULL)
      {
        json_decref (key);
        json_decref (val);
        continue; /* not ours: Warren writes UTF-8 keys and JSON values */
      }
    json_array_append_new (out,
                           json_pack ("{s:o,s:o,s:I}", "key", key, "value", val, "mod_revision",
                                      (json_int_t)json_i64 (json_object_get (kv, "mod_revision"))));
  }
  return out;
}

int
wr_etcd_get (struct wr_etcd *e, const char *key, char **ret_val, int64_t *ret_mod_rev,
             wr_err_t *err)
{
  json_t *body = json_pack ("{s:o}", "key", wr_etcd_b64 (key, strlen (key)));
  json_t *resp = NULL;
  int r = wr_etcd_call (e, "/v3/kv/range", body, &resp, err);
  json_decref (body);
  if (r < 0)
    return r;
  json_t *kvs = decode_kvs (json_object_get (resp, "kvs"));
  json_decref (resp);
  json_t *kv = json_array_get (kvs, 0);
  if (kv == NULL)
    {
      json_decref (kvs);
      return 0;
    }
  if (ret_val)
    *ret_val = strdup (json_string_value (json_object_get (kv, "value")));
  if (ret_mod_rev)
    *ret_mod_rev = json_integer_value (json_object_get (kv, "mod_revision"));
  json_decref (kvs);
  return 1;
}

int
wr_etcd_get_prefix (struct wr_etcd *e, const char *prefix, json_t **ret, int64_t *ret_rev,
                    wr_err_t *err)
{
  json_t *body = json_pack ("{s:o,s:o}", "key", wr_etcd_b64 (prefix, strlen (prefix)), "range_end",
                            wr_etcd_prefix_end (prefix));
  json_t *resp = NULL;
  int r = wr_etcd_call (e, "/v3/kv/range", body, &resp, err);
  json_decref (body);
  if (r < 0)
    return r;
  *ret = decode_kvs (json_object_get (resp, "kvs"));
  if (ret_rev)
    *ret_rev = json_i64 (json_object_get (json_object_get (resp, "header"), "revision"));
  json_decref (resp);
  return 0;
}

int
wr_etcd_cas (struct wr_etcd *e, const char *key, int64_t mod_rev, const char *val, int64_t lease,
             wr_err_t *err)
{
  json_t *k = wr_etcd_b64 (key, strlen (key));
  json_t *put = json_pack ("{s:O,s:o}", "key", k, "value", wr_etcd_b64 (val, strlen (val)));
  if (lease)
    json_object_set_new (put, "lease", s64 (lease));
  /* mod_revision 0 compares equal only for a key that does not exist */
  json_t *body
      = json_pack ("{s:[{s:O,s:s,s:s,s:o}],s:[{s:o}]}", "compare", "key", k, "target", "MOD",
                   "result", "EQUAL", "mod_revision", s64 (mod_rev), "success", "request_put", put);
  json_decref (k);
  json_t *resp = NULL;
  int r = wr_etcd_call (e, "/v3/kv/txn", body, &resp, err);
  json_decref (body);
  if (r < 0)
    return r;
  bool ok = json_is_true (json_object_get (resp, "succeeded"));
  json_decref (resp);
  return ok ? 1 : 0;
}

int
wr_etcd_lease_grant (struct wr_etcd *e, int64_t ttl_s, int64_t *ret_id, wr_err_t *err)
{
  json_t *resp = NULL;
  int r = call_take (e, "/v3/lease/grant", json_pack ("{s:o}", "TTL", s64 (ttl_s)), &resp, err);
  if (r < 0)
    return r;
  *ret_id = json_i64 (json_object_get (resp, "ID"));
  json_decref (resp);
  if (*ret_id == 0)
    return wr_error (err, 0, WR_E_UNAVAILABLE, "etcd lease grant: no lease id");
  return 0;
}

int
wr_etcd_lease_keepalive (struct wr_etcd *e, int64_t id, int64_t *ret_ttl, wr_err_t *err)
{
  json_t *resp = NULL;
  int r = call_take (e, "/v3/lease/keepalive", json_pack ("{s:o}", "ID", s64 (id)), &resp, err);
  if (r < 0)
    return r;
  /* a streaming RPC: one {"result": ...} per request; TTL absent = expired */
  json_t *res = json_object_get (resp, "result");
  *ret_ttl = json_i64 (json_object_get (res ? res : resp, "TTL"));
  json_decref (resp);
  return 0;
}

int
wr_etcd_lease_revoke (struct wr_etcd *e, int64_t id, wr_err_t *err)
{
  return call_take (e, "/v3/kv/lease/revoke", json_pack ("{s:o}", "ID", s64 (id)), NULL, err);
}

/* ---- watch: a chunked stream of {"result": {...}} lines ---- */

struct watch_ctx
{
  struct buf line;
  wr_etcd_watch_cb cb;
  void *ud;
  bool stopped;
  bool canceled;
};

static int
watch_line (struct watch_ctx *w, const char *text)
{
  json_t *j = json_loads (text, 0, NULL);
  if (j == NULL)
    return 0;
  json_t *res = json_object_get (j, "result");
  if (res == NULL || json_is_true (json_object_get (res, "canceled")))
    {
      /* an error object or a canceled watch (e.g. compacted revision) */
      w->canceled = true;
      json_decref (j);
      return -EPROTO;
    }
  size_t i;
  json_t *ev;
  json_array_foreach (json_object_get (res, "events"), i, ev)
  {
    json_t *kv = json_object_get (ev, "kv");
    bool del = json_is_string (json_object_get (ev, "type"))
               && strcmp (json_string_value (json_object_get (ev, "type")), "DELETE") == 0;
    _cleanup_free_ char *k = b64_decode_str (json_string_value (json_object_get (kv, "key")));
    _cleanup_free_ char *v
        = del ? NULL : b64_decode_str (json_string_value (json_object_get (kv, "value")));
    if (k == NULL)
      continue;
    if (w->cb (w->ud, k, v, json_i64 (json_object_get (kv, "mod_revision"))) != 0)
      {
        w->stopped = true;
        json_decref (j);
        return 1;
      }
  }
  json_decref (j);
  return 0;
}

static int
watch_sink (void *ud, const char *data, size_t len)
{
  struct watch_ctx *w = ud;
  for (size_t i = 0; i < len; i++)
    {
      if (data[i] != '\n')
        {
          int r = buf_sink (&w->line, data + i, 1);
          if (r < 0)
            return r;
          continue;
        }
      if (w->line.len)
        {
          int r = watch_line (w, w->line.p);
          w->line.len = 0;
          if (r != 0)
            return r;
        }
    }
  return 0;
}

int
wr_etcd_watch (struct wr_etcd *e, const char *prefix, int64_t start_rev, wr_etcd_watch_cb cb,
               void *ud, const volatile bool *stop, wr_err_t *err)
{
  json_t *cr = json_pack ("{s:o,s:o}", "key", wr_etcd_b64 (prefix, strlen (prefix)), "range_end",
                          wr_etcd_prefix_end (prefix));
  if (start_rev > 0)
    json_object_set_new (cr, "start_revision", s64 (start_rev));
  json_t *body = json_pack ("{s:o}", "create_request", cr);
  _cleanup_free_ char *text = json_dumps (body, JSON_COMPACT);
  json_decref (body);
  unsigned start = atomic_load (&e->cur);
  char last[256] = "";
  for (size_t k = 0; k < e->n; k++)
    {
      unsigned i = (start + k) % e->n;
      struct conn c
          = { .fd = -1, .deadline_ms = wr_now_ms () + (uint64_t)e->timeout_ms, .stop = stop };
      int status = 0;
      long long clen;
      bool chunked;
      int r = http_begin (&c, &e->eps[i], "/v3/watch", text, &status, &clen, &chunked);
      if (r < 0 || status != 200 || !chunked)
        {
          snprintf (last, sizeof last, "%s:%s: %s", e->eps[i].host, e->eps[i].port,
                    r < 0 ? conn_error (&c, r) : "bad answer");
          conn_close (&c);
          if (r == -ECANCELED)
            return 0;
          continue;
        }
      atomic_store (&e->cur, i);
      c.deadline_ms = 0; /* a watch is quiet until something changes */
      struct watch_ctx w = { .cb = cb, .ud = ud };
      r = read_body (&c, clen, chunked, watch_sink, &w);
      conn_close (&c);
      free (w.line.p);
      if (w.stopped || r == -ECANCELED)
        return 0;
      return wr_error (err, r < 0 ? -r : 0, WR_E_UNAVAILABLE, "etcd watch %s:%s ended",
                       e->eps[i].host, e->eps[i].port);
    }
  return wr_error (err, 0, WR_E_UNAVAILABLE, "etcd watch: no member answered (last: %s)", last);
}

/* The API calls of docs/api.md, one function each. */
#include "internal.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "common/util.h"

#define PATH_MAX_LEN 4096

static int
check_id (const char *id, warren_error_t *err)
{
  if (!warren_id_valid (id))
    return wl_error (err, 0, WARREN_E_INVALID, 0, "invalid sandbox id '%.64s%s'",
                     id ? id : "(null)", id && strlen (id) > 64 ? "..." : "");
  return 0;
}

static int
check_ref (const char *what, const char *ref, warren_error_t *err)
{
  if (ref == NULL || *ref == '\0' || strlen (ref) > 1024)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "invalid %s", what);
  return 0;
}

/* Take obj[key] as an array (new reference), consuming obj. */
static json_t *
take_array (warren_client_t *c, json_t *obj, const char *key, warren_error_t *err)
{
  json_t *a = json_object_get (obj, key);
  if (!json_is_array (a))
    {
      json_decref (obj);
      wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response from %s has no '%s' array", c->host, key);
      return NULL;
    }
  json_incref (a);
  json_decref (obj);
  return a;
}

static json_t *
call_json (warren_client_t *c, const char *method, const char *target, const json_t *body,
           int timeout_ms, warren_error_t *err)
{
  json_t *ret = NULL;
  if (wl_json_call (c, method, target, body, timeout_ms, &ret, err) < 0)
    return NULL;
  return ret;
}

static int
slow_timeout (warren_client_t *c)
{
  return c->timeout_ms == 0 || c->timeout_ms > WL_SLOW_TIMEOUT_MS ? c->timeout_ms
                                                                  : WL_SLOW_TIMEOUT_MS;
}

/* An exec may legitimately run for its whole timeout_s: wait that long plus
 * a margin for the daemon to kill and report. */
static int
exec_timeout (warren_client_t *c, const json_t *req)
{
  if (c->timeout_ms == 0)
    return 0;
  json_t *t = json_object_get (req, "timeout_s");
  double s = json_is_number (t) ? json_number_value (t) : 600;
  if (!(s > 0) || s > 86400)
    s = 86400;
  double ms = s * 1000 + 30000;
  return ms > c->timeout_ms ? (int)ms : c->timeout_ms;
}

json_t *
warren_sandbox_create (warren_client_t *c, const json_t *req, warren_error_t *err)
{
  if (req && !json_is_object (req))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "sandbox request must be a JSON object");
      return NULL;
    }
  _cleanup_ (json_decrefp) json_t *empty = req ? NULL : json_object ();
  /* Creation may wait for an image to be mounted or a VM to boot. */
  return call_json (c, "POST", "/v1/sandboxes", req ? req : empty, slow_timeout (c), err);
}

json_t *
warren_sandbox_list (warren_client_t *c, warren_error_t *err)
{
  json_t *j = call_json (c, "GET", "/v1/sandboxes", NULL, 0, err);
  return j ? take_array (c, j, "sandboxes", err) : NULL;
}

static json_t *
sandbox_op (warren_client_t *c, const char *method, const char *id, const char *suffix,
            const json_t *body, int timeout_ms, warren_error_t *err)
{
  if (check_id (id, err) < 0)
    return NULL;
  char target[256];
  snprintf (target, sizeof target, "/v1/sandboxes/%s%s", id, suffix);
  return call_json (c, method, target, body, timeout_ms, err);
}

json_t *
warren_sandbox_get (warren_client_t *c, const char *id, warren_error_t *err)
{
  return sandbox_op (c, "GET", id, "", NULL, 0, err);
}

int
warren_sandbox_delete (warren_client_t *c, const char *id, warren_error_t *err)
{
  json_t *j = sandbox_op (c, "DELETE", id, "", NULL, 0, err);
  if (j == NULL)
    return -1;
  json_decref (j);
  return 0;
}

json_t *
warren_sandbox_pause (warren_client_t *c, const char *id, warren_error_t *err)
{
  return sandbox_op (c, "POST", id, "/pause", NULL, 0, err);
}

json_t *
warren_sandbox_resume (warren_client_t *c, const char *id, warren_error_t *err)
{
  return sandbox_op (c, "POST", id, "/resume", NULL, 0, err);
}

json_t *
warren_sandbox_set_network (warren_client_t *c, const char *id, const json_t *network,
                            warren_error_t *err)
{
  json_t *body = json_pack ("{s:O}", "network", (json_t *)network);
  json_t *j = body ? sandbox_op (c, "PATCH", id, "", body, 0, err) : NULL;
  json_decref (body);
  return j;
}

json_t *
warren_sandbox_log (warren_client_t *c, const char *id, warren_error_t *err)
{
  return sandbox_op (c, "GET", id, "/log", NULL, 0, err);
}

json_t *
warren_sandbox_replay (warren_client_t *c, const char *id, const char *until, warren_error_t *err)
{
  _cleanup_ (json_decrefp) json_t *body = json_object ();
  if (until)
    {
      json_t *u = json_string (until);
      if (u == NULL || *until == '\0')
        {
          json_decref (u);
          wl_error (err, 0, WARREN_E_INVALID, 0, "the step id must be non-empty UTF-8");
          return NULL;
        }
      json_object_set_new (body, "until", u);
    }
  /* re-runs commands: as slow as they were */
  return sandbox_op (c, "POST", id, "/replay", body, slow_timeout (c), err);
}

json_t *
warren_sandbox_pack (warren_client_t *c, const char *id, const char *name, warren_error_t *err)
{
  if (check_ref ("image name", name, err) < 0)
    return NULL;
  _cleanup_ (json_decrefp) json_t *body = json_pack ("{s:s}", "name", name);
  if (body == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image name is not valid UTF-8");
      return NULL;
    }
  return sandbox_op (c, "POST", id, "/pack", body, slow_timeout (c), err);
}

json_t *
warren_exec (warren_client_t *c, const char *id, const json_t *req, warren_error_t *err)
{
  if (!json_is_object (req))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "exec request must be a JSON object");
      return NULL;
    }
  return sandbox_op (c, "POST", id, "/exec", req, exec_timeout (c, req), err);
}

json_t *
warren_call (warren_client_t *c, const json_t *req, warren_error_t *err)
{
  if (!json_is_object (req))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "call request must be a JSON object");
      return NULL;
    }
  return call_json (c, "POST", "/v1/calls", req, exec_timeout (c, req), err);
}

/* Hand one stream event's bytes to the callback. */
static int
emit_event (warren_client_t *c, json_t *ev, warren_output_fn fn, void *ud, warren_error_t *err)
{
  const char *stream = json_string_value (json_object_get (ev, "stream"));
  int which = stream && strcmp (stream, "stdout") == 0   ? WARREN_STDOUT
              : stream && strcmp (stream, "stderr") == 0 ? WARREN_STDERR
                                                         : 0;
  if (which == 0)
    return 0; /* a stream we do not know: newer daemon, ignore */
  _cleanup_free_ void *data = NULL;
  size_t len = 0;
  if (warren_result_bytes (ev, "data", &data, &len, err) < 0)
    return -1;
  if (len > 0 && fn && fn (ud, which, data, len) != 0)
    return wl_error (err, 0, WARREN_E_CANCELLED, 0, "exec output consumer stopped the stream");
  return 0;
}

static int
emit_result_output (warren_client_t *c, json_t *res, warren_output_fn fn, void *ud,
                    warren_error_t *err)
{
  static const struct
  {
    const char *key;
    int which;
  } s[] = { { "stdout", WARREN_STDOUT }, { "stderr", WARREN_STDERR } };
  for (size_t i = 0; i < WR_ARRAY_SIZE (s); i++)
    {
      _cleanup_free_ void *data = NULL;
      size_t len = 0;
      if (warren_result_bytes (res, s[i].key, &data, &len, err) < 0)
        return -1;
      if (len > 0 && fn && fn (ud, s[i].which, data, len) != 0)
        return wl_error (err, 0, WARREN_E_CANCELLED, 0, "exec output consumer stopped");
      char enc[32];
      snprintf (enc, sizeof enc, "%s_encoding", s[i].key);
      json_object_del (res, s[i].key);
      json_object_del (res, enc);
    }
  return 0;
}

#define NDJSON_LINE_MAX (256u << 20)

struct stream_ctx
{
  warren_client_t *c;
  warren_output_fn fn;
  void *ud;
  json_t *result;
};

/* One exec stream event: output -> fn, an error event -> err, the last
 * object with an exit_code is the result. */
static int
stream_line (const char *line, size_t l, void *data, warren_error_t *err)
{
  struct stream_ctx *ctx = data;
  json_error_t jerr;
  json_t *ev = json_loadb (line, l, 0, &jerr);
  if (!json_is_object (ev))
    {
      json_decref (ev);
      return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "invalid stream event from %s", ctx->c->host);
    }
  json_t *e = json_object_get (ev, "error");
  if (json_object_get (ev, "stream"))
    {
      int r = emit_event (ctx->c, ev, ctx->fn, ctx->ud, err);
      json_decref (ev);
      return r < 0 ? -1 : 0;
    }
  if (json_is_object (e) && !json_object_get (ev, "exit_code"))
    {
      const char *code = json_string_value (json_object_get (e, "code"));
      const char *msg = json_string_value (json_object_get (e, "message"));
      wl_error (err, 0, code ? code : WARREN_E_INTERNAL, 0, "%s", msg ? msg : "exec failed");
      json_decref (ev);
      return -1;
    }
  if (json_object_get (ev, "exit_code"))
    {
      json_decref (ctx->result);
      ctx->result = ev;
    }
  else
    json_decref (ev);
  return 0;
}

json_t *
warren_exec_stream (warren_client_t *c, const char *id, const json_t *req, warren_output_fn fn,
                    void *userdata, warren_error_t *err)
{
  if (check_id (id, err) < 0)
    return NULL;
  if (!json_is_object (req))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "exec request must be a JSON object");
      return NULL;
    }
  char target[256];
  snprintf (target, sizeof target, "/v1/sandboxes/%s/exec?stream=1", id);
  wl_response_t resp;
  if (wl_stream_begin (c, target, req, exec_timeout (c, req), "exec request", &resp, err) < 0)
    return NULL;
  if (!strcasestr (resp.content_type, "ndjson"))
    {
      /* A daemon that answered with the buffered result: still deliver it. */
      _cleanup_free_ char *all = NULL;
      size_t alen = 0;
      int r = wl_http_read_all (c, &resp, WL_JSON_MAX, &all, &alen, err);
      wl_http_end (c, &resp);
      if (r < 0)
        return NULL;
      json_t *res = json_loadb (all, alen, 0, NULL);
      if (!json_is_object (res))
        {
          json_decref (res);
          wl_error (err, 0, WARREN_E_PROTOCOL, resp.status, "invalid exec result from %s", c->host);
          return NULL;
        }
      if (emit_result_output (c, res, fn, userdata, err) < 0)
        {
          json_decref (res);
          return NULL;
        }
      return res;
    }

  struct stream_ctx ctx = { .c = c, .fn = fn, .ud = userdata };
  int failed = wl_http_read_lines (c, &resp, true, NDJSON_LINE_MAX, stream_line, &ctx, err) < 0;
  json_t *result = ctx.result;
  wl_http_end (c, &resp); /* drops the connection unless the body was consumed */
  if (failed)
    {
      json_decref (result);
      return NULL;
    }
  if (result == NULL)
    wl_error (err, 0, WARREN_E_PROTOCOL, 0, "exec stream from %s ended without a result", c->host);
  return result;
}

/* /v1/sandboxes/ID/files?path=P plus extra query. */
static char *
files_target (const char *id, const char *path, const char *extra, warren_error_t *err)
{
  if (check_id (id, err) < 0)
    return NULL;
  if (path == NULL || *path == '\0' || strlen (path) > PATH_MAX_LEN)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "invalid sandbox path");
      return NULL;
    }
  _cleanup_free_ char *enc = wl_urlencode (path);
  char *t = NULL;
  if (enc == NULL || asprintf (&t, "/v1/sandboxes/%s/files?path=%s%s", id, enc, extra) < 0)
    {
      wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");
      return NULL;
    }
  return t;
}

static int
put_body (warren_client_t *c, const char *id, const char *path, const void *data, int fd, off_t off,
          uint64_t len, int mode, unsigned flags, warren_error_t *err)
{
  char extra[64] = "";
  if (mode >= 0)
    snprintf (extra, sizeof extra, "&mode=0%o", (unsigned)mode & 07777);
  if (flags & WARREN_PUT_APPEND)
    strcat (extra, "&append=1");
  _cleanup_free_ char *target = files_target (id, path, extra, err);
  if (target == NULL)
    return -1;
  wl_request_t req = { .method = "PUT",
                       .target = target,
                       .content_type = "application/octet-stream",
                       .body = data,
                       .body_fd = fd,
                       .body_off = off,
                       .body_len = len,
                       .timeout_ms = slow_timeout (c) };
  wl_response_t resp;
  int hr = wl_http_request (c, &req, &resp, err);
  if (hr < 0)
    return hr;
  _cleanup_free_ char *ignored = NULL;
  int r = wl_http_read_all (c, &resp, WL_ERROR_BODY_MAX, &ignored, NULL, err);
  wl_http_end (c, &resp);
  return r;
}

int
warren_file_put (warren_client_t *c, const char *id, const char *path, const void *data, size_t len,
                 int mode, unsigned flags, warren_error_t *err)
{
  if (data == NULL && len > 0)
    return wl_error (err, 0, WARREN_E_INVALID, 0, "no data");
  return put_body (c, id, path, len ? data : NULL, -1, 0, len, mode, flags, err);
}

int
warren_file_put_fd (warren_client_t *c, const char *id, const char *path, int fd, int mode,
                    unsigned flags, warren_error_t *err)
{
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wl_error (err, errno, WARREN_E_IO, 0, "fstat");
  if (S_ISREG (st.st_mode))
    {
      off_t off = lseek (fd, 0, SEEK_CUR);
      if (off < 0)
        off = 0;
      uint64_t len = st.st_size > off ? (uint64_t)(st.st_size - off) : 0;
      return put_body (c, id, path, NULL, len ? fd : -1, off, len, mode, flags, err);
    }
  if (S_ISDIR (st.st_mode))
    return wl_error (err, EISDIR, WARREN_E_IO, 0, "upload source");
  /* A pipe has no length and cannot be rewound for a retry: spool it. */
  _cleanup_close_ int spool = memfd_create ("warren-upload", MFD_CLOEXEC);
  if (spool < 0)
    return wl_error (err, errno, WARREN_E_IO, 0, "memfd_create");
  char buf[65536];
  uint64_t total = 0;
  for (;;)
    {
      ssize_t n = read (fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return wl_error (err, errno, WARREN_E_IO, 0, "reading the upload");
      if (n == 0)
        break;
      int r = wr_write_all (spool, buf, (size_t)n);
      if (r < 0)
        return wl_error (err, -r, WARREN_E_IO, 0, "spooling the upload");
      total += (uint64_t)n;
    }
  return put_body (c, id, path, NULL, total ? spool : -1, 0, total, mode, flags, err);
}

/* GET the file's content: the response head, a >= 400 answer turned into err. */
static int
files_get_begin (warren_client_t *c, const char *id, const char *path, wl_response_t *resp,
                 warren_error_t *err)
{
  _cleanup_free_ char *target = files_target (id, path, "", err);
  if (target == NULL)
    return -1;
  wl_request_t req
      = { .method = "GET", .target = target, .body_fd = -1, .timeout_ms = slow_timeout (c) };
  return wl_http_request (c, &req, resp, err);
}

int
warren_file_get_fd (warren_client_t *c, const char *id, const char *path, int fd,
                    uint64_t *ret_size, warren_error_t *err)
{
  wl_response_t resp;
  int b = files_get_begin (c, id, path, &resp, err);
  if (b < 0)
    return b;
  char buf[65536];
  uint64_t total = 0;
  int r = 0;
  for (;;)
    {
      ssize_t n = wl_http_read (c, &resp, buf, sizeof buf, err);
      if (n < 0)
        {
          r = -1;
          break;
        }
      if (n == 0)
        break;
      int w = wr_write_all (fd, buf, (size_t)n);
      if (w < 0)
        {
          r = wl_error (err, -w, WARREN_E_IO, 0, "writing %s", path);
          break;
        }
      total += (uint64_t)n;
    }
  wl_http_end (c, &resp);
  if (r == 0 && ret_size)
    *ret_size = total;
  return r;
}

int
warren_file_get (warren_client_t *c, const char *id, const char *path, void **ret, size_t *ret_len,
                 size_t max, warren_error_t *err)
{
  wl_response_t resp;
  int b = files_get_begin (c, id, path, &resp, err);
  if (b < 0)
    return b;
  char *data = NULL;
  int r = wl_http_read_all (c, &resp, max, &data, ret_len, err);
  wl_http_end (c, &resp);
  if (r < 0)
    return r;
  *ret = data;
  return 0;
}

json_t *
warren_file_stat (warren_client_t *c, const char *id, const char *path, warren_error_t *err)
{
  _cleanup_free_ char *target = files_target (id, path, "&op=stat", err);
  return target ? call_json (c, "GET", target, NULL, 0, err) : NULL;
}

json_t *
warren_file_list (warren_client_t *c, const char *id, const char *path, warren_error_t *err)
{
  _cleanup_free_ char *target = files_target (id, path, "&op=list", err);
  json_t *j = target ? call_json (c, "GET", target, NULL, 0, err) : NULL;
  return j ? take_array (c, j, "entries", err) : NULL;
}

int
warren_file_mkdir (warren_client_t *c, const char *id, const char *path, bool parents,
                   warren_error_t *err)
{
  _cleanup_free_ char *target
      = files_target (id, path, parents ? "&op=mkdir&parents=1" : "&op=mkdir", err);
  if (target == NULL)
    return -1;
  return wl_json_call (c, "POST", target, NULL, 0, NULL, err);
}

int
warren_file_remove (warren_client_t *c, const char *id, const char *path, bool recursive,
                    warren_error_t *err)
{
  _cleanup_free_ char *target = files_target (id, path, recursive ? "&recursive=1" : "", err);
  if (target == NULL)
    return -1;
  return wl_json_call (c, "DELETE", target, NULL, 0, NULL, err);
}

json_t *
warren_image_import (warren_client_t *c, const char *name, const char *path, warren_error_t *err)
{
  if (check_ref ("image name", name, err) < 0 || check_ref ("import path", path, err) < 0)
    return NULL;
  _cleanup_ (json_decrefp) json_t *body = json_pack ("{s:s,s:s}", "name", name, "path", path);
  if (body == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image name or path is not valid UTF-8");
      return NULL;
    }
  return call_json (c, "POST", "/v1/images/import", body, slow_timeout (c), err);
}

json_t *
warren_image_list (warren_client_t *c, warren_error_t *err)
{
  json_t *j = call_json (c, "GET", "/v1/images", NULL, 0, err);
  return j ? take_array (c, j, "images", err) : NULL;
}

static char *
ref_target (const char *prefix, const char *ref, warren_error_t *err)
{
  if (check_ref ("image reference", ref, err) < 0)
    return NULL;
  _cleanup_free_ char *enc = wl_urlencode (ref);
  char *t = NULL;
  if (enc == NULL || asprintf (&t, "%s%s", prefix, enc) < 0)
    {
      wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");
      return NULL;
    }
  return t;
}

json_t *
warren_image_inspect (warren_client_t *c, const char *ref, warren_error_t *err)
{
  _cleanup_free_ char *target = ref_target ("/v1/images/", ref, err);
  return target ? call_json (c, "GET", target, NULL, 0, err) : NULL;
}

int
warren_image_rm (warren_client_t *c, const char *ref, warren_error_t *err)
{
  _cleanup_free_ char *target = ref_target ("/v1/images/", ref, err);
  if (target == NULL)
    return -1;
  return wl_json_call (c, "DELETE", target, NULL, 0, NULL, err);
}

json_t *
warren_healthz (warren_client_t *c, warren_error_t *err)
{
  return call_json (c, "GET", "/healthz", NULL, 0, err);
}

char *
warren_metrics (warren_client_t *c, warren_error_t *err)
{
  wl_request_t req = { .method = "GET", .target = "/metrics", .body_fd = -1 };
  wl_response_t resp;
  if (wl_http_request (c, &req, &resp, err) < 0)
    return NULL;
  char *text = NULL;
  int r = wl_http_read_all (c, &resp, 64u << 20, &text, NULL, err);
  wl_http_end (c, &resp);
  return r < 0 ? NULL : text;
}

json_t *
warren_pools_get (warren_client_t *c, warren_error_t *err)
{
  return call_json (c, "GET", "/v1/pools", NULL, 0, err);
}

json_t *
warren_pool_set (warren_client_t *c, const char *image, unsigned size, warren_error_t *err)
{
  _cleanup_free_ char *target = ref_target ("/v1/pools/", image, err);
  if (target == NULL)
    return NULL;
  _cleanup_ (json_decrefp) json_t *body = json_pack ("{s:I}", "size", (json_int_t)size);
  return call_json (c, "PUT", target, body, 0, err);
}

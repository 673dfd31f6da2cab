/* libwarren: image operations with progress (pull, build, import, pack), tag, gc. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#include "common/util.h"

#define PROGRESS_LINE_MAX (16u << 20)

static int
op_timeout (warren_client_t *c)
{
  return c->timeout_ms == 0 || c->timeout_ms > WL_SLOW_TIMEOUT_MS ? c->timeout_ms
                                                                  : WL_SLOW_TIMEOUT_MS;
}

/* Handle one NDJSON line: progress -> fn, error -> err, anything else is the result. */
struct progress_ctx
{
  warren_client_t *c;
  warren_progress_fn fn;
  void *ud;
  json_t *result;
};

static int
progress_line (const char *line, size_t l, void *data, warren_error_t *err)
{
  struct progress_ctx *ctx = data;
  warren_client_t *c = ctx->c;
  warren_progress_fn fn = ctx->fn;
  void *ud = ctx->ud;
  json_t **result = &ctx->result;
  json_t *ev = json_loadb (line, l, 0, NULL);
  if (!json_is_object (ev))
    {
      json_decref (ev);
      return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "invalid progress line from %s", c->host);
    }
  json_t *e = json_object_get (ev, "error");
  const char *what = json_string_value (json_object_get (ev, "progress"));
  if (what)
    {
      if (fn)
        fn (ud, what, (uint64_t)json_integer_value (json_object_get (ev, "done")),
            (uint64_t)json_integer_value (json_object_get (ev, "total")));
      json_decref (ev);
      return 0;
    }
  if (json_is_object (e))
    {
      const char *code = json_string_value (json_object_get (e, "code"));
      const char *msg = json_string_value (json_object_get (e, "message"));
      wl_error (err, 0, code ? code : WARREN_E_INTERNAL, 0, "%s", msg ? msg : "failed");
      json_decref (ev);
      return -1;
    }
  json_decref (*result);
  *result = ev;
  return 0;
}

json_t *
warren_image_op (warren_client_t *c, const char *target, const json_t *req, warren_progress_fn fn,
                 void *ud, warren_error_t *err)
{
  if (target == NULL || target[0] != '/' || !json_is_object (req))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image request must be a JSON object");
      return NULL;
    }
  wl_response_t resp;
  if (wl_stream_begin (c, target, req, op_timeout (c), "request", &resp, err) < 0)
    return NULL;
  struct progress_ctx ctx = { .c = c, .fn = fn, .ud = ud };
  bool ndjson = strcasestr (resp.content_type, "ndjson") != NULL;
  int failed
      = wl_http_read_lines (c, &resp, ndjson, PROGRESS_LINE_MAX - 1, progress_line, &ctx, err) < 0;
  json_t *result = ctx.result;
  wl_http_end (c, &resp);
  if (failed)
    {
      json_decref (result);
      return NULL;
    }
  if (result == NULL)
    wl_error (err, 0, WARREN_E_PROTOCOL, 0, "%s ended without a result", target);
  return result;
}

static bool
str_ok (const char *what, const char *s, warren_error_t *err)
{
  if (s == NULL || s[0] == '\0' || strlen (s) > 4096)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "%s is required", what);
      return false;
    }
  return true;
}

json_t *
warren_image_import_progress (warren_client_t *c, const char *name, const char *path,
                              warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!str_ok ("image name", name, err) || !str_ok ("import path", path, err))
    return NULL;
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s,s:s}", "name", name, "path", path);
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image name or path is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/import", b, fn, ud, err);
}

json_t *
warren_image_pull (warren_client_t *c, const char *ref, const char *name, bool insecure,
                   warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!str_ok ("registry reference", ref, err))
    return NULL;
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s,s:b}", "ref", ref, "insecure", insecure);
  if (b && name)
    json_object_set_new (b, "name", json_string (name));
  if (b == NULL || (name && json_object_get (b, "name") == NULL))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "reference or name is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/pull", b, fn, ud, err);
}

json_t *
warren_image_build (warren_client_t *c, const char *name, const char *spec, const char *context,
                    warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!str_ok ("image name", name, err) || spec == NULL)
    {
      if (spec == NULL)
        wl_error (err, 0, WARREN_E_INVALID, 0, "build spec is required");
      return NULL;
    }
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s,s:s}", "name", name, "spec", spec);
  if (b && context)
    json_object_set_new (b, "context", json_string (context));
  if (b == NULL || (context && json_object_get (b, "context") == NULL))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "name, spec or context is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/build", b, fn, ud, err);
}

json_t *
warren_sandbox_pack_progress (warren_client_t *c, const char *id, const char *name,
                              warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!warren_id_valid (id))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "invalid sandbox id");
      return NULL;
    }
  if (!str_ok ("image name", name, err))
    return NULL;
  char target[256];
  snprintf (target, sizeof target, "/v1/sandboxes/%s/pack", id);
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s}", "name", name);
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image name is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, target, b, fn, ud, err);
}

json_t *
warren_image_tag (warren_client_t *c, const char *src, const char *dst, warren_error_t *err)
{
  if (!str_ok ("source image", src, err) || !str_ok ("new name", dst, err))
    return NULL;
  _cleanup_free_ char *enc = wl_urlencode (src);
  char *target = NULL;
  if (enc == NULL || asprintf (&target, "/v1/images/%s/tag", enc) < 0)
    {
      wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");
      return NULL;
    }
  _cleanup_free_ char *t = target;
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s}", "name", dst);
  json_t *ret = NULL;
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "name is not valid UTF-8");
      return NULL;
    }
  if (wl_json_call (c, "POST", t, b, 0, &ret, err) < 0)
    return NULL;
  return ret;
}

json_t *
warren_image_gc (warren_client_t *c, warren_error_t *err)
{
  json_t *ret = NULL;
  if (wl_json_call (c, "POST", "/v1/images/gc", NULL, op_timeout (c), &ret, err) < 0)
    return NULL;
  return ret;
}

/* libwarren: image operations with progress (pull, build, import, pack), tag, gc,
 * and uploads (import and build from local files over TCP). */
#include "internal.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <archive.h>
#include <archive_entry.h>

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
warren_image_push (warren_client_t *c, const char *ref, const char *target, bool insecure,
                   warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!str_ok ("image reference", ref, err) || !str_ok ("registry reference", target, err))
    return NULL;
  _cleanup_ (json_decrefp) json_t *b
      = json_pack ("{s:s,s:s,s:b}", "ref", ref, "target", target, "insecure", insecure);
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "reference or target is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/push", b, fn, ud, err);
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

/* ---- uploads (docs/api.md, Uploads) ----
 * A client that does not share the daemon's filesystem hands it a file
 * through /v1/uploads in chunks of at most UPLOAD_CHUNK bytes (evhttp holds
 * a whole request body in memory), each sent with its offset; a chunk the
 * daemon already has (416) or a broken connection resumes from the size the
 * daemon reports. Chunks go as PUT, which the daemon takes like PATCH: PUT
 * passes every HTTP stack and is replayed on a stale keep-alive connection. */

#define UPLOAD_CHUNK (8u << 20)
#define UPLOAD_RESUMES 5

static int
upload_size (warren_client_t *c, const char *id, uint64_t *ret, warren_error_t *err)
{
  char target[96];
  snprintf (target, sizeof target, "/v1/uploads/%s", id);
  json_t *j = NULL;
  if (wl_json_call (c, "GET", target, NULL, 0, &j, err) < 0)
    return -1;
  json_t *sv = json_object_get (j, "size");
  int r = json_is_integer (sv) && json_integer_value (sv) >= 0
              ? 0
              : wl_error (err, 0, WARREN_E_PROTOCOL, 0, "upload %s: no size from %s", id, c->host);
  if (r == 0)
    *ret = (uint64_t)json_integer_value (sv);
  json_decref (j);
  return r;
}

/* One chunk at off; 0 and the daemon's new size in *size, 1 when the
 * daemon has another size (416: *size is unknown, ask), < 0 on error. */
static int
upload_chunk (warren_client_t *c, const char *id, int fd, uint64_t off, uint64_t n, uint64_t *size,
              warren_error_t *err)
{
  char target[128];
  snprintf (target, sizeof target, "/v1/uploads/%s?offset=%llu", id, (unsigned long long)off);
  wl_request_t rq = {
    .method = "PUT",
    .target = target,
    .content_type = "application/octet-stream",
    .body_fd = fd,
    .body_off = (off_t)off,
    .body_len = n,
    .timeout_ms = op_timeout (c),
  };
  wl_response_t resp;
  if (wl_http_begin (c, &rq, &resp, err) < 0)
    return -1;
  if (resp.status == 416)
    {
      warren_error_t ignored;
      _cleanup_free_ char *body = NULL;
      size_t len;
      wl_http_read_all (c, &resp, WL_ERROR_BODY_MAX, &body, &len, &ignored);
      wl_http_end (c, &resp);
      return 1;
    }
  if (resp.status >= 400)
    return wl_http_error (c, &resp, err);
  _cleanup_free_ char *body = NULL;
  size_t len = 0;
  int r = wl_http_read_all (c, &resp, WL_JSON_MAX, &body, &len, err);
  wl_http_end (c, &resp);
  if (r < 0)
    return r;
  json_t *j = json_loadb (body, len, 0, NULL);
  json_t *sv = json_object_get (j, "size");
  r = json_is_integer (sv) ? 0
                           : wl_error (err, 0, WARREN_E_PROTOCOL, resp.status,
                                       "upload %s: no size in the answer from %s", id, c->host);
  if (r == 0)
    *size = (uint64_t)json_integer_value (sv);
  json_decref (j);
  return r;
}

int
warren_upload_fd (warren_client_t *c, int fd, warren_progress_fn fn, void *ud, char ret_id[33],
                  warren_error_t *err)
{
  struct stat st;
  if (fstat (fd, &st) < 0 || !S_ISREG (st.st_mode))
    return wl_error (err, errno, WARREN_E_IO, 0, "an upload is read from a regular file");
  uint64_t total = (uint64_t)st.st_size;
  _cleanup_ (json_decrefp) json_t *req = json_pack ("{s:I}", "size", (json_int_t)total);
  json_t *created = NULL;
  if (wl_json_call (c, "POST", "/v1/uploads", req, 0, &created, err) < 0)
    return -1;
  const char *id = json_string_value (json_object_get (created, "id"));
  if (id == NULL || strlen (id) != 32)
    {
      json_decref (created);
      return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "no upload id from %s", c->host);
    }
  char uid[33];
  snprintf (uid, sizeof uid, "%s", id);
  json_decref (created);
  uint64_t off = 0;
  unsigned resumes = 0;
  if (fn)
    fn (ud, "upload", 0, total);
  while (off < total)
    {
      uint64_t n = total - off < UPLOAD_CHUNK ? total - off : UPLOAD_CHUNK, size = 0;
      int r = upload_chunk (c, uid, fd, off, n, &size, err);
      if (r == 0)
        off = size;
      else if ((r > 0 || err == NULL || err->status == 0) && resumes++ < UPLOAD_RESUMES
               && upload_size (c, uid, &size, err) == 0)
        off = size; /* resume where the daemon is */
      else
        {
          char target[96];
          snprintf (target, sizeof target, "/v1/uploads/%s", uid);
          warren_error_t ignored;
          wl_json_call (c, "DELETE", target, NULL, 0, NULL, &ignored);
          return r > 0 ? wl_error (err, 0, WARREN_E_PROTOCOL, 416,
                                   "upload %s: the daemon keeps refusing offset %llu", uid,
                                   (unsigned long long)off)
                       : -1;
        }
      if (off > total)
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                         "upload %s: the daemon holds %llu bytes of %llu", uid,
                         (unsigned long long)off, (unsigned long long)total);
      if (fn)
        fn (ud, "upload", off, total);
    }
  memcpy (ret_id, uid, 33);
  return 0;
}

/* An unnamed temporary file (the tar of a directory). */
static int
tmpfile_fd (warren_error_t *err)
{
  const char *dir = getenv ("TMPDIR");
  if (dir == NULL || dir[0] != '/')
    dir = "/tmp";
  int fd = open (dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0)
    {
      char tmpl[4096];
      snprintf (tmpl, sizeof tmpl, "%s/warren-upload-XXXXXX", dir);
      fd = mkostemp (tmpl, O_CLOEXEC);
      if (fd >= 0)
        unlink (tmpl);
    }
  if (fd < 0)
    return wl_error (err, errno, WARREN_E_IO, 0, "temporary file in %s", dir);
  return fd;
}

static void
archive_freep (struct archive **a)
{
  if (*a)
    archive_free (*a); /* reader or writer */
}

/* Write dir (not following symlinks) as a pax tar to fd, names relative
 * to dir ("./a/b"), owners and modes as they are. */
static int
tar_dir (const char *dir, int fd, warren_error_t *err)
{
  char root[4096];
  snprintf (root, sizeof root, "%s", dir);
  size_t rl = strlen (root);
  while (rl > 1 && root[rl - 1] == '/')
    root[--rl] = '\0';
  _cleanup_ (archive_freep) struct archive *disk = archive_read_disk_new ();
  _cleanup_ (archive_freep) struct archive *out = archive_write_new ();
  if (disk == NULL || out == NULL)
    return wl_error (err, ENOMEM, WARREN_E_IO, 0, "tar %s", dir);
  archive_read_disk_set_symlink_physical (disk);
  archive_read_disk_set_behavior (disk, ARCHIVE_READDISK_NO_TRAVERSE_MOUNTS);
  if (archive_write_set_format_pax_restricted (out) != ARCHIVE_OK
      || archive_write_open_fd (out, fd) != ARCHIVE_OK
      || archive_read_disk_open (disk, root) != ARCHIVE_OK)
    return wl_error (err, 0, WARREN_E_IO, 0, "tar %s: %s", dir,
                     archive_error_string (disk) ? archive_error_string (disk)
                                                 : archive_error_string (out));
  char buf[65536];
  for (;;)
    {
      struct archive_entry *e = archive_entry_new ();
      int r = archive_read_next_header2 (disk, e);
      if (r == ARCHIVE_EOF)
        {
          archive_entry_free (e);
          break;
        }
      if (r < ARCHIVE_WARN)
        {
          archive_entry_free (e);
          return wl_error (err, 0, WARREN_E_IO, 0, "tar %s: %s", dir, archive_error_string (disk));
        }
      archive_read_disk_descend (disk);
      const char *p = archive_entry_pathname (e);
      const char *rel = p && strncmp (p, root, rl) == 0 ? p + rl : NULL;
      if (rel && strcmp (root, "/") == 0)
        rel = p; /* "/" is its own prefix */
      while (rel && *rel == '/')
        rel++;
      if (rel == NULL || *rel == '\0')
        {
          archive_entry_free (e); /* the directory itself */
          continue;
        }
      char name[8192];
      snprintf (name, sizeof name, "./%s", rel);
      archive_entry_copy_pathname (e, name);
      r = archive_write_header (out, e);
      bool data = r >= ARCHIVE_WARN && archive_entry_filetype (e) == AE_IFREG
                  && archive_entry_size (e) > 0;
      archive_entry_free (e);
      if (r < ARCHIVE_WARN)
        return wl_error (err, 0, WARREN_E_IO, 0, "tar %s: %s", dir, archive_error_string (out));
      for (ssize_t n; data && (n = archive_read_data (disk, buf, sizeof buf)) != 0;)
        if (n < 0 || archive_write_data (out, buf, (size_t)n) < 0)
          return wl_error (err, 0, WARREN_E_IO, 0, "tar %s: %s: %s", dir, name,
                           n < 0 ? archive_error_string (disk) : archive_error_string (out));
    }
  if (archive_write_close (out) != ARCHIVE_OK)
    return wl_error (err, 0, WARREN_E_IO, 0, "tar %s: %s", dir, archive_error_string (out));
  return 0;
}

int
warren_upload_path (warren_client_t *c, const char *path, warren_progress_fn fn, void *ud,
                    char ret_id[33], warren_error_t *err)
{
  if (!str_ok ("upload path", path, err))
    return -1;
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  struct stat st;
  if (fd < 0 || fstat (fd, &st) < 0)
    return wl_error (err, errno, WARREN_E_IO, 0, "cannot open %s", path);
  if (S_ISDIR (st.st_mode))
    {
      close (fd);
      fd = tmpfile_fd (err);
      if (fd < 0)
        return -1;
      if (fn)
        fn (ud, "tar", 0, 1);
      if (tar_dir (path, fd, err) < 0)
        return -1;
      if (fn)
        fn (ud, "tar", 1, 1);
    }
  else if (!S_ISREG (st.st_mode))
    return wl_error (err, 0, WARREN_E_INVALID, 0, "%s is neither a file nor a directory", path);
  return warren_upload_fd (c, fd, fn, ud, ret_id, err);
}

json_t *
warren_image_import_upload (warren_client_t *c, const char *name, const char *path,
                            warren_progress_fn fn, void *ud, warren_error_t *err)
{
  if (!str_ok ("image name", name, err))
    return NULL;
  char id[33];
  if (warren_upload_path (c, path, fn, ud, id, err) < 0)
    return NULL;
  _cleanup_ (json_decrefp) json_t *b = json_pack ("{s:s,s:s}", "name", name, "upload", id);
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "image name is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/import", b, fn, ud, err);
}

json_t *
warren_image_build_upload (warren_client_t *c, const char *name, const char *spec,
                           const char *context, warren_progress_fn fn, void *ud,
                           warren_error_t *err)
{
  if (!str_ok ("image name", name, err) || !str_ok ("build context", context, err))
    return NULL;
  if (spec == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "build spec is required");
      return NULL;
    }
  char id[33];
  if (warren_upload_path (c, context, fn, ud, id, err) < 0)
    return NULL;
  _cleanup_ (json_decrefp) json_t *b
      = json_pack ("{s:s,s:s,s:s}", "name", name, "spec", spec, "context_upload", id);
  if (b == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "name or spec is not valid UTF-8");
      return NULL;
    }
  return warren_image_op (c, "/v1/images/build", b, fn, ud, err);
}

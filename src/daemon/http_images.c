/* /v1/images routes: list, inspect, remove, tag, gc, and the long ones
 * (import, pull, build) on worker threads with optional NDJSON progress. */
#include "daemon/daemon.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>

#include "backend/vm.h"
#include "common/util.h"
#include "daemon/http_util.h"
#include "daemon/images.h"
#include "daemon/uploads.h"

json_t *
wrd_image_json (const struct wr_image *img)
{
  json_t *layers = json_array ();
  for (size_t i = 0; i < img->n_layers; i++)
    json_array_append_new (layers, json_string (img->layers[i]));
  return json_pack ("{s:s,s:s,s:o,s:O,s:I}", "name", img->name, "digest", img->digest, "layers",
                    layers, "config", img->config ? img->config : json_null (), "size",
                    (json_int_t)img->size);
}

/* ---- progress streams ---- */

struct wrd_stream
{
  struct evhttp_request *req;
  bool stream;
  struct event *flush_ev;
  pthread_mutex_t lock;
  struct evbuffer *pending; /* lines written by workers, sent by the loop */
  char last_what[32];
  int last_pct;
};

static void
stream_flush (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct wrd_stream *st = arg;
  pthread_mutex_lock (&st->lock);
  if (evbuffer_get_length (st->pending) > 0)
    evhttp_send_reply_chunk (st->req, st->pending); /* drains pending */
  pthread_mutex_unlock (&st->lock);
}

struct wrd_stream *
wrd_stream_new (struct wrd *d, struct evhttp_request *req, bool stream)
{
  struct wrd_stream *st = calloc (1, sizeof *st);
  if (st == NULL)
    return NULL;
  st->req = req;
  st->stream = stream;
  st->last_pct = -1;
  pthread_mutex_init (&st->lock, NULL);
  if (stream)
    {
      st->pending = evbuffer_new ();
      st->flush_ev = event_new (d->base, -1, 0, stream_flush, st);
      evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                         "application/x-ndjson");
      evhttp_send_reply_start (req, 200, "OK");
    }
  return st;
}

void
wrd_stream_progress (void *ud, const char *what, uint64_t done, uint64_t total)
{
  struct wrd_stream *st = ud;
  if (st == NULL || !st->stream)
    return;
  pthread_mutex_lock (&st->lock);
  int pct = total ? (int)(done * 100 / total) : 0;
  /* one line per step and per percent, not per buffer */
  if (strncmp (st->last_what, what, sizeof st->last_what - 1) != 0 || pct != st->last_pct
      || done == total)
    {
      snprintf (st->last_what, sizeof st->last_what, "%s", what);
      st->last_pct = pct;
      json_t *j = json_pack ("{s:s,s:I,s:I}", "progress", what, "done", (json_int_t)done, "total",
                             (json_int_t)total);
      char *text = j ? json_dumps (j, JSON_COMPACT) : NULL;
      if (text)
        evbuffer_add_printf (st->pending, "%s\n", text);
      free (text);
      json_decref (j);
      event_active (st->flush_ev, EV_TIMEOUT, 0);
    }
  pthread_mutex_unlock (&st->lock);
}

void
wrd_stream_finish (struct wrd_stream *st, int r, const wr_err_t *err, json_t *result, int status)
{
  if (st == NULL)
    {
      json_decref (result);
      return;
    }
  if (!st->stream)
    {
      if (r < 0)
        wrd_reply_error (st->req, err);
      else
        wrd_reply_json (st->req, status, result);
    }
  else
    {
      json_t *line
          = r < 0 ? json_pack ("{s:{s:s,s:s}}", "error", "code", err->code, "message", err->msg)
                  : result;
      if (r < 0)
        json_decref (result);
      char *text = line ? json_dumps (line, JSON_COMPACT) : NULL;
      json_decref (line);
      pthread_mutex_lock (&st->lock);
      evbuffer_add_printf (st->pending, "%s\n", text ? text : "{}");
      evhttp_send_reply_chunk (st->req, st->pending);
      pthread_mutex_unlock (&st->lock);
      free (text);
      evhttp_send_reply_end (st->req);
      event_free (st->flush_ev);
      evbuffer_free (st->pending);
    }
  pthread_mutex_destroy (&st->lock);
  free (st);
}

/* ---- import and pull (worker threads) ---- */

struct image_job
{
  struct wrd *d;
  struct wrd_stream *st;
  bool pull, push, insecure;
  char ref[640];
  char target[640]; /* push */
  json_t *pushed;
  char name[256];
  char path[4096];
  int upload_fd; /* an upload being consumed (path is /proc/self/fd/N), or -1 */
  struct wr_image *img;
  wr_err_t err;
  int r;
};

static void
image_work (void *arg)
{
  struct image_job *j = arg;
  if (j->push)
    j->r = wr_image_push (j->d->store, j->ref, j->target, j->insecure, wrd_stream_progress, j->st,
                          &j->pushed, &j->err);
  else if (j->pull)
    j->r = wr_image_pull (j->d->store, j->ref, j->name[0] ? j->name : NULL, j->insecure,
                          wrd_stream_progress, j->st, &j->img, &j->err);
  else if ((j->r = wr_vm_disk_sniff (j->path, (char[8]){ 0 }, &j->err)) == 0)
    j->r = wr_image_import_any (j->d->store, j->name, j->path, wrd_stream_progress, j->st, &j->img,
                                &j->err);
  else if (j->r > 0) /* a bootable VM disk (docs/vm.md) */
    j->r = wr_vm_disk_import (j->d->store, j->name, j->path, &j->img, &j->err);
}

static void
image_done (void *arg)
{
  struct image_job *j = arg;
  json_t *result = j->push ? j->pushed : j->r == 0 ? wrd_image_json (j->img) : NULL;
  wrd_stream_finish (j->st, j->r, &j->err, j->r == 0 ? result : NULL, j->push ? 200 : 201);
  wr_image_free (j->img);
  if (j->upload_fd >= 0)
    close (j->upload_fd);
  free (j);
}

static void
start_job (struct wrd *d, struct evhttp_request *req, struct image_job *j, bool stream)
{
  j->d = d;
  j->st = wrd_stream_new (d, req, stream);
  if (j->st == NULL || wrd_job_run (d, image_work, image_done, j) < 0)
    {
      wr_error (&j->err, 0, WR_E_INTERNAL, "cannot start the image worker");
      if (j->st)
        wrd_stream_finish (j->st, -1, &j->err, NULL, 0);
      else
        wrd_reply_error (req, &j->err);
      if (j->upload_fd >= 0)
        close (j->upload_fd);
      free (j);
    }
}

static bool
stream_flag (json_t *body, bool *ret)
{
  json_t *sv = json_object_get (body, "stream");
  if (sv && !json_is_boolean (sv) && !json_is_null (sv))
    return false;
  *ret = json_is_true (sv);
  return true;
}

/* "path" names a file or directory on the daemon's host (unix socket
 * clients); "upload" an upload (/v1/uploads), consumed here whatever the
 * outcome. The store reads sources by path: an upload is handed over as
 * /proc/self/fd/N of the fd taken from the table, never by a name. */
static void
handle_import (struct wrd *d, struct evhttp_request *req, json_t *body)
{
  const char *name = json_string_value (json_object_get (body, "name"));
  const char *path = json_string_value (json_object_get (body, "path"));
  json_t *uv = json_object_get (body, "upload");
  const char *upload = json_string_value (uv);
  bool stream;
  if (name == NULL || !wr_ref_valid (name) || strchr (name, '@') || strlen (name) >= 256
      || (uv && !json_is_null (uv) && upload == NULL) || (path == NULL) == (upload == NULL)
      || (path && (path[0] != '/' || strlen (path) >= 4096)) || !stream_flag (body, &stream))
    {
      wrd_reply_error_code (req, WR_E_INVALID,
                            "field \"name\" (NAME[:TAG]) and one of \"path\" (an absolute path "
                            "on the daemon's host) or \"upload\" (an upload id) are required; "
                            "\"stream\" is a boolean");
      return;
    }
  struct image_job *j = calloc (1, sizeof *j);
  if (j == NULL)
    {
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  j->upload_fd = -1;
  if (upload && wrd_upload_take (d, req, upload, &j->upload_fd, &j->err) < 0)
    {
      wrd_reply_error (req, &j->err);
      free (j);
      return;
    }
  snprintf (j->name, sizeof j->name, "%s", name);
  if (upload)
    snprintf (j->path, sizeof j->path, "/proc/self/fd/%d", j->upload_fd);
  else
    snprintf (j->path, sizeof j->path, "%s", path);
  start_job (d, req, j, stream);
}

static void
handle_pull (struct wrd *d, struct evhttp_request *req, json_t *body)
{
  const char *ref = json_string_value (json_object_get (body, "ref"));
  json_t *nv = json_object_get (body, "name");
  const char *name = json_string_value (nv);
  json_t *iv = json_object_get (body, "insecure");
  bool stream;
  if (ref == NULL || strlen (ref) >= 600 || (nv && !json_is_null (nv) && name == NULL)
      || (name && (!wr_ref_valid (name) || strchr (name, '@') || strlen (name) >= 256))
      || (iv && !json_is_boolean (iv)) || !stream_flag (body, &stream))
    {
      wrd_reply_error_code (req, WR_E_INVALID,
                            "field \"ref\" (HOST[:PORT]/REPO[:TAG|@DIGEST]) is required; \"name\" "
                            "is NAME[:TAG]; \"insecure\" and \"stream\" are booleans");
      return;
    }
  struct image_job *j = calloc (1, sizeof *j);
  if (j == NULL)
    {
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  j->pull = true;
  j->upload_fd = -1;
  j->insecure = json_is_true (iv);
  snprintf (j->ref, sizeof j->ref, "%s", ref);
  if (name)
    snprintf (j->name, sizeof j->name, "%s", name);
  start_job (d, req, j, stream);
}

/* POST /v1/images/push {"ref","target","insecure"?,"stream"?} */
static void
handle_push (struct wrd *d, struct evhttp_request *req, json_t *body)
{
  const char *ref = json_string_value (json_object_get (body, "ref"));
  const char *target = json_string_value (json_object_get (body, "target"));
  json_t *iv = json_object_get (body, "insecure");
  bool stream;
  if (ref == NULL || target == NULL || strlen (ref) >= 600 || strlen (target) >= 600
      || (iv && !json_is_boolean (iv)) || !stream_flag (body, &stream))
    {
      wrd_reply_error_code (req, WR_E_INVALID,
                            "fields \"ref\" (a stored image) and \"target\" "
                            "(HOST[:PORT]/REPO[:TAG]) are required; \"insecure\" and \"stream\" "
                            "are booleans");
      return;
    }
  struct image_job *j = calloc (1, sizeof *j);
  if (j == NULL)
    {
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  j->push = true;
  j->upload_fd = -1;
  j->insecure = json_is_true (iv);
  snprintf (j->ref, sizeof j->ref, "%s", ref);
  snprintf (j->target, sizeof j->target, "%s", target);
  start_job (d, req, j, stream);
}

void
wrd_http_images (struct wrd *d, struct evhttp_request *req, const char *rest,
                 struct evkeyvalq *q WR_UNUSED)
{
  wr_err_t err;
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (rest == NULL && m == EVHTTP_REQ_GET)
    {
      json_t *list;
      if (wr_image_list (d->store, &list, &err) < 0)
        wrd_reply_error (req, &err);
      else
        wrd_reply_json (req, 200, json_pack ("{s:o}", "images", list));
      return;
    }
  if (rest && m == EVHTTP_REQ_POST
      && (strcmp (rest, "import") == 0 || strcmp (rest, "pull") == 0 || strcmp (rest, "push") == 0
          || strcmp (rest, "gc") == 0))
    {
      json_t *body;
      if (wrd_read_json_body (req, strcmp (rest, "gc") != 0, &body, &err) < 0)
        {
          wrd_reply_error (req, &err);
          return;
        }
      if (strcmp (rest, "import") == 0)
        handle_import (d, req, body);
      else if (strcmp (rest, "pull") == 0)
        handle_pull (d, req, body);
      else if (strcmp (rest, "push") == 0)
        handle_push (d, req, body);
      else
        {
          json_t *before = NULL, *after = NULL;
          wr_store_describe (d->store, &before, NULL);
          if (wr_store_gc (d->store, &err) < 0)
            wrd_reply_error (req, &err);
          else
            {
              wr_store_describe (d->store, &after, NULL);
              json_int_t lb = json_integer_value (json_object_get (before, "layers"));
              json_int_t la = json_integer_value (json_object_get (after, "layers"));
              json_int_t ib = json_integer_value (json_object_get (before, "images"));
              json_int_t ia = json_integer_value (json_object_get (after, "images"));
              wrd_reply_json (req, 200,
                              json_pack ("{s:I,s:I,s:I,s:I}", "removed_layers", lb - la,
                                         "removed_images", ib - ia, "layers", la, "images", ia));
            }
          json_decref (before);
          json_decref (after);
        }
      json_decref (body);
      return;
    }
  if (rest && m == EVHTTP_REQ_POST && strcmp (rest, "build") == 0)
    {
      wrd_http_image_build (d, req);
      return;
    }
  size_t rl = rest ? strlen (rest) : 0;
  if (rest && m == EVHTTP_REQ_POST && rl > 4 && strcmp (rest + rl - 4, "/tag") == 0)
    {
      json_t *body;
      if (wrd_read_json_body (req, true, &body, &err) < 0)
        {
          wrd_reply_error (req, &err);
          return;
        }
      char enc[1024];
      snprintf (enc, sizeof enc, "%.*s", (int)(rl - 4), rest);
      char *src = evhttp_uridecode (enc, 0, NULL);
      const char *dst = json_string_value (json_object_get (body, "name"));
      struct wr_image *img = NULL;
      if (dst == NULL)
        wrd_reply_error_code (req, WR_E_INVALID, "field \"name\" (NAME[:TAG]) is required");
      else if (wr_image_tag (d->store, src, dst, &img, &err) < 0)
        wrd_reply_error (req, &err);
      else
        wrd_reply_json (req, 201, wrd_image_json (img));
      wr_image_free (img);
      free (src);
      json_decref (body);
      return;
    }
  if (rest && (m == EVHTTP_REQ_GET || m == EVHTTP_REQ_DELETE))
    {
      char *ref = evhttp_uridecode (rest, 0, NULL);
      struct wr_image *img = NULL;
      int r = m == EVHTTP_REQ_GET ? wr_image_resolve (d->store, ref, &img, &err)
                                  : wr_image_remove (d->store, ref, &err);
      free (ref);
      if (r < 0)
        wrd_reply_error (req, &err);
      else if (img)
        {
          wrd_reply_json (req, 200, wrd_image_json (img));
          wr_image_free (img);
        }
      else
        wrd_reply_empty (req, 204);
      return;
    }
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

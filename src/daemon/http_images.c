/* /v1/images routes: list, inspect, import (on a worker thread), remove. */
#include "daemon/daemon.h"

#include <stdio.h>
#include <string.h>
#include <event2/http.h>

#include "common/util.h"
#include "daemon/http_util.h"

/* ---- images (imports run on a worker thread) ---- */

struct import_job
{
  struct wrd *d;
  struct evhttp_request *req;
  char ref[256];
  char path[4096];
  struct wr_image *img;
  wr_err_t err;
  int r;
};

static json_t *
image_json (struct wr_image *img)
{
  json_t *layers = json_array ();
  for (size_t i = 0; i < img->n_layers; i++)
    json_array_append_new (layers, json_string (img->layers[i]));
  return json_pack ("{s:s,s:s,s:o,s:O}", "name", img->name, "digest", img->digest, "layers", layers,
                    "config", img->config ? img->config : json_null ());
}

static void
import_work (void *arg)
{
  struct import_job *j = arg;
  j->r = wr_image_import (j->d->store, j->ref, j->path, &j->img, &j->err);
}

static void
import_done (void *arg)
{
  struct import_job *j = arg;
  if (j->r < 0)
    wrd_reply_error (j->req, &j->err);
  else
    {
      wrd_reply_json (j->req, 201, image_json (j->img));
      wr_image_free (j->img);
    }
  free (j);
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
  if (rest && strcmp (rest, "import") == 0 && m == EVHTTP_REQ_POST)
    {
      json_t *body;
      if (wrd_read_json_body (req, true, &body, &err) < 0)
        {
          wrd_reply_error (req, &err);
          return;
        }
      const char *name = json_string_value (json_object_get (body, "name"));
      const char *path = json_string_value (json_object_get (body, "path"));
      if (name == NULL || !wr_ref_valid (name) || path == NULL || path[0] != '/'
          || strlen (path) >= 4096)
        {
          json_decref (body);
          wrd_reply_error_code (req, WR_E_INVALID,
                                "fields \"name\" (an image reference) and \"path\" (an absolute "
                                "path on the daemon's host) are required");
          return;
        }
      struct import_job *j = calloc (1, sizeof *j);
      j->d = d;
      j->req = req;
      snprintf (j->ref, sizeof j->ref, "%s", name);
      snprintf (j->path, sizeof j->path, "%s", path);
      json_decref (body);
      if (wrd_job_run (d, import_work, import_done, j) < 0)
        {
          free (j);
          wrd_reply_error_code (req, WR_E_INTERNAL, "cannot start the import worker");
        }
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
          wrd_reply_json (req, 200, image_json (img));
          wr_image_free (img);
        }
      else
        wrd_reply_empty (req, 204);
      return;
    }
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

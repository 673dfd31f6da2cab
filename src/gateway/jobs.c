/* Jobs across nodes (docs/cluster.md, "Jobs"): a sandbox created with
 * "job": NAME carries the label warren.job=NAME on its node; pausing the job
 * asks every node for its list and pauses each of the job's sandboxes. The
 * state lives on the nodes (frozen cgroups, registry), so it survives
 * gateway and node restarts. Any exec or file request to a paused sandbox
 * resumes it first. */
#include "gateway/gateway.h"

#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>

#include "common/util.h"

#define LABEL_JOB "warren.job"

/* ---- resume on use ---- */

struct resume_retry
{
  struct gw_node *node;
  enum evhttp_cmd_type method;
  char *uri;
  char id[65];
  struct evbuffer *saved; /* the request's body, for the second try */
};

static void
rr_free (void *arg)
{
  struct resume_retry *rr = arg;
  if (rr->saved)
    evbuffer_free (rr->saved);
  free (rr->uri);
  free (rr);
}

static void
resumed (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct resume_retry *rr = ud;
  if (status == 200)
    {
      gw_forward (g, rr->node, req, rr->method, rr->uri, rr->saved, NULL, NULL);
      rr->saved = NULL;
    }
  else if (status == 0)
    gw_reply_error (req, 503, "unavailable", "node %s unreachable", rr->node->name);
  else
    {
      evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                         "application/json");
      evhttp_send_reply (req, status, NULL, body);
    }
  rr_free (rr);
}

static void
paused (struct gw *g, struct evhttp_request *req, int status WR_UNUSED,
        struct evbuffer *body WR_UNUSED, void *ud)
{
  struct resume_retry *rr = ud;
  char uri[128];
  snprintf (uri, sizeof uri, "/v1/sandboxes/%s/resume", rr->id);
  gw_forward (g, rr->node, req, EVHTTP_REQ_POST, uri, evbuffer_new (), resumed, rr);
}

void
gw_route_resuming (struct gw *g, struct gw_node *n, struct evhttp_request *req,
                   enum evhttp_cmd_type method, const char *uri, const char *id)
{
  struct resume_retry *rr = calloc (1, sizeof *rr);
  if (rr == NULL)
    {
      gw_forward (g, n, req, method, uri, NULL, NULL, NULL);
      return;
    }
  rr->node = n;
  rr->method = method;
  rr->uri = strdup (uri);
  snprintf (rr->id, sizeof rr->id, "%s", id);
  /* a copy: the original body moves into the first try */
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  rr->saved = evbuffer_new ();
  size_t len = evbuffer_get_length (in);
  if (len)
    evbuffer_add (rr->saved, evbuffer_pullup (in, -1), len);
  gw_forward_resuming (g, n, req, method, uri, paused, rr, rr_free);
}

/* ---- POST /v1/jobs/{job}/pause|resume ---- */

struct job_req
{
  struct gw *g;
  struct evhttp_request *req;
  char job[65];
  char project[65];
  bool pause;
  size_t pending;
  json_t *ids;
  unsigned ok, failed;
};

static void
job_reply (struct job_req *j)
{
  gw_reply_json (j->req, 200,
                 json_pack ("{s:s,s:s,s:I,s:I}", "job", j->job, "action",
                            j->pause ? "pause" : "resume", "sandboxes", (json_int_t)j->ok, "failed",
                            (json_int_t)j->failed));
  json_decref (j->ids);
  free (j);
}

static void
op_done (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct job_req *j = ud;
  /* 409: already in that state */
  if (status == 200 || status == 409)
    j->ok++;
  else
    j->failed++;
  if (--j->pending == 0)
    job_reply (j);
}

static void
list_done (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct job_req *j = ud;
  json_t *l = status == 200 && body ? json_loadb ((const char *)evbuffer_pullup (body, -1),
                                                  evbuffer_get_length (body), 0, NULL)
                                    : NULL;
  size_t i;
  json_t *s;
  json_array_foreach (json_object_get (l, "sandboxes"), i, s)
  {
    json_t *labels = json_object_get (s, "labels");
    const char *job = json_string_value (json_object_get (labels, LABEL_JOB));
    const char *p = json_string_value (json_object_get (labels, WR_LABEL_PROJECT));
    if (job && strcmp (job, j->job) == 0
        && (j->project[0] == '\0' || (p && strcmp (p, j->project) == 0)))
      json_array_append (j->ids, json_object_get (s, "id"));
  }
  json_decref (l);
  if (--j->pending)
    return;
  /* every list is in: one pause/resume per sandbox, in parallel */
  size_t n = json_array_size (j->ids);
  if (n == 0)
    {
      job_reply (j);
      return;
    }
  /* one more while this loop runs: op_done may be called before
   * gw_forward returns (a node without a usable address), and the last one
   * would free j under the loop */
  j->pending = n + 1;
  json_t *id;
  json_array_foreach (j->ids, i, id)
  {
    char node[WR_NODE_NAME_MAX + 1], uri[128];
    const char *sid = json_string_value (id);
    pthread_mutex_lock (&g->mu);
    struct gw_node *nd = wr_id_node (sid, node, sizeof node) ? gw_node_find (g, node) : NULL;
    pthread_mutex_unlock (&g->mu);
    if (nd == NULL)
      {
        op_done (g, req, 0, NULL, j);
        continue;
      }
    snprintf (uri, sizeof uri, "/v1/sandboxes/%s/%s", sid, j->pause ? "pause" : "resume");
    gw_forward (g, nd, req, EVHTTP_REQ_POST, uri, evbuffer_new (), op_done, j);
  }
  if (--j->pending == 0)
    job_reply (j);
}

void
gw_jobs (struct gw *g, struct evhttp_request *req, const char *rest, const char *project)
{
  const char *slash = rest ? strchr (rest, '/') : NULL;
  if (evhttp_request_get_command (req) != EVHTTP_REQ_POST || slash == NULL
      || (strcmp (slash, "/pause") != 0 && strcmp (slash, "/resume") != 0) || slash - rest == 0
      || slash - rest > 64)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "no such route (POST /v1/jobs/NAME/pause|resume)");
      return;
    }
  struct gw_node *targets[GW_MAX_NODES];
  size_t n = gw_present_nodes (g, targets);
  struct job_req *j = calloc (1, sizeof *j);
  if (j == NULL)
    {
      gw_reply_error (req, 500, WR_E_INTERNAL, "out of memory");
      return;
    }
  j->g = g;
  j->req = req;
  memcpy (j->job, rest, slash - rest);
  snprintf (j->project, sizeof j->project, "%s", project ? project : "");
  j->pause = strcmp (slash, "/pause") == 0;
  j->ids = json_array ();
  j->pending = n;
  if (n == 0)
    {
      job_reply (j);
      return;
    }
  for (size_t i = 0; i < n; i++)
    gw_forward (g, targets[i], req, EVHTTP_REQ_GET, "/v1/sandboxes", evbuffer_new (), list_done, j);
}

/* The gateway's HTTP API: the node API (docs/api.md) plus the cluster
 * routes (docs/cluster.md). Creates are placed, sandbox requests are routed
 * by the node named in the id, lists are merged from every node. */
#include "gateway/gateway.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "common/httpd.h"
#include "common/util.h"

void
gw_reply_json (struct evhttp_request *req, int status, json_t *j)
{
  char *text = json_dumps (j, JSON_COMPACT);
  json_decref (j);
  struct evbuffer *b = evbuffer_new ();
  if (text)
    evbuffer_add (b, text, strlen (text));
  free (text);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, NULL, b);
  evbuffer_free (b);
}

void
gw_reply_error (struct evhttp_request *req, int status, const char *code, const char *fmt, ...)
{
  char msg[512];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  /* the platform failed, not the caller's task: say so (issue 10) */
  bool infra = status >= 500 || wr_code_is_infra (code); /* err.c: one table */
  gw_reply_json (req, status,
                 json_pack ("{s:{s:s,s:s},s:b}", "error", "code", code, "message", msg,
                            "infra_failure", infra));
}

static void
reply_buffer (struct evhttp_request *req, int status, struct evbuffer *body)
{
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, NULL, body);
}

static json_t *
body_json (struct evbuffer *b)
{
  size_t n = b ? evbuffer_get_length (b) : 0;
  if (n == 0)
    return NULL;
  return json_loadb ((const char *)evbuffer_pullup (b, -1), n, 0, NULL);
}

/* ---- who is asking ---- */

enum who
{
  WHO_NONE,
  WHO_ADMIN,
  WHO_PROJECT,
};

/* Who presents this Authorization value (not NUL-terminated)? */
static enum who
who_of (struct gw *g, const char *value, size_t len, struct gw_project **ret_p)
{
  *ret_p = NULL;
  if (wr_bearer_matches (value, len, g->token))
    return WHO_ADMIN;
  char tok[256];
  if (len < 7 + 4 || len - 7 >= sizeof tok || strncmp (value, "Bearer wrp_", 11) != 0)
    return WHO_NONE;
  memcpy (tok, value + 7, len - 7);
  tok[len - 7] = '\0';
  pthread_mutex_lock (&g->mu);
  struct gw_project *p = gw_project_by_token (g, tok);
  pthread_mutex_unlock (&g->mu);
  explicit_bzero (tok, sizeof tok);
  *ret_p = p;
  return p ? WHO_PROJECT : WHO_NONE;
}

static enum who
authenticate (struct gw *g, struct evhttp_request *req, struct gw_project **ret_p)
{
  const char *h = evhttp_find_header (evhttp_request_get_input_headers (req), "Authorization");
  *ret_p = NULL;
  return h ? who_of (g, h, strlen (h), ret_p) : WHO_NONE;
}

/* ---- create: quota, placement, forward, retry elsewhere if the node is gone ---- */

struct create_req
{
  struct gw *g;
  struct evhttp_request *req;
  json_t *body;
  char backend[16];
  char image[300]; /* normalised NAME:TAG, "" when none or by digest */
  long long mem;
  json_t *want_labels;
  struct gw_project *proj;
  struct gw_node *failed;
  int attempts;
  char idem[129];         /* idempotency key, "" when none */
  bool claimed;           /* the key is ours in etcd: its outcome must be settled */
  struct gw_node *placed; /* the node picked before the claim */
};

static void
create_free (struct create_req *c)
{
  json_decref (c->body);
  json_decref (c->want_labels);
  free (c);
}

static void create_place (struct create_req *c);
static void create_start (struct create_req *c);

/* ---- idempotency keys: a retried create (another gateway, a timeout, a
 * gateway killed mid-create) never makes two sandboxes. The create is
 * placed first, then the key is claimed in etcd with the node it goes to
 * (idem.c: under this gateway's session lease until the outcome is known),
 * and the sandbox is labelled warren.idem=KEY. A create that finds the key
 * taken answers with the first attempt's sandbox, found on its node, or 409
 * while that attempt is in flight; one whose first attempt lost its gateway
 * looks on that attempt's node and otherwise creates there. Only creates
 * that carry a key pay the etcd round trip. ---- */

#define LABEL_IDEM "warren.idem"

struct claim
{
  struct gw *g;
  struct create_req *c;
  struct gw_idem idem;
  int r;
  char *settle_id; /* settle: the sandbox made, NULL when the create failed */
  bool settle;
  struct event *done;
};

static void *
claim_main (void *arg)
{
  struct claim *cl = arg;
  if (cl->settle)
    {
      gw_idem_settle (cl->g, cl->idem.key, cl->idem.node, cl->settle_id);
      free (cl->settle_id);
      free (cl);
      return NULL;
    }
  wr_err_t err;
  cl->r = gw_idem_claim (cl->g, &cl->idem, &err);
  event_active (cl->done, EV_TIMEOUT, 0);
  return NULL;
}

/* Record the outcome of a claimed create on node NODE, off the loop. */
static void
idem_settle (struct gw *g, struct create_req *c, const char *node, const char *id)
{
  struct claim *cl = calloc (1, sizeof *cl);
  pthread_t t;
  if (cl == NULL)
    return;
  cl->g = g;
  cl->settle = true;
  cl->settle_id = id ? strdup (id) : NULL;
  snprintf (cl->idem.key, sizeof cl->idem.key, "%s", c->idem);
  snprintf (cl->idem.node, sizeof cl->idem.node, "%s", node ?: "");
  if (pthread_create (&t, NULL, claim_main, cl) != 0)
    {
      free (cl->settle_id);
      free (cl);
    }
  else
    pthread_detach (t);
}

struct idem_find
{
  struct create_req *c;
  struct gw_node *node; /* ORPHAN: create here when nothing is found */
  json_t *found;
};

static void create_send (struct create_req *c, struct gw_node *n);

static void
idem_found (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct idem_find *f = ud;
  struct create_req *c = f->c;
  json_t *l = status == 200 ? body_json (body) : NULL;
  if (json_object_get (l, "id"))
    f->found = json_incref (l); /* GET /v1/sandboxes/ID */
  size_t i;
  json_t *s;
  json_array_foreach (json_object_get (l, "sandboxes"), i, s)
  {
    const char *k = json_string_value (json_object_get (json_object_get (s, "labels"), LABEL_IDEM));
    if (k && strcmp (k, c->idem) == 0 && f->found == NULL)
      f->found = json_incref (s);
  }
  json_decref (l);
  if (f->found == NULL && f->node)
    {
      /* the earlier attempt made nothing there yet: this one takes its place */
      create_send (c, f->node);
      free (f);
      return;
    }
  if (c->proj)
    gw_quota_done (g, c->proj, c->mem, false);
  if (f->found)
    {
      if (f->node)
        idem_settle (g, c, f->node->name, json_string_value (json_object_get (f->found, "id")));
      gw_reply_json (req, 200, f->found); /* the sandbox the first create made */
    }
  else
    gw_reply_error (req, 409, WR_E_CONFLICT,
                    "a create with idempotency key %s is still in progress; retry", c->idem);
  create_free (c);
  free (f);
}

static void
claim_done (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct claim *cl = arg;
  struct gw *g = cl->g;
  struct create_req *c = cl->c;
  struct gw_idem idem = cl->idem;
  int r = cl->r;
  event_free (cl->done);
  free (cl);
  pthread_mutex_lock (&g->mu);
  struct gw_node *n = gw_node_find (g, idem.node);
  bool present = n && n->present && n->port;
  pthread_mutex_unlock (&g->mu);
  if (r < 0)
    {
      if (c->proj)
        gw_quota_done (g, c->proj, c->mem, false);
      gw_reply_error (c->req, 503, "control_plane_unavailable",
                      "cannot record idempotency key %s in etcd", c->idem);
      create_free (c);
      return;
    }
  if (idem.result == GW_IDEM_CLAIMED)
    {
      c->claimed = true;
      create_send (c, c->placed);
      return;
    }
  struct idem_find *f = calloc (1, sizeof *f);
  if (f == NULL)
    {
      if (c->proj)
        gw_quota_done (g, c->proj, c->mem, false);
      gw_reply_error (c->req, 500, WR_E_INTERNAL, "out of memory");
      create_free (c);
      return;
    }
  f->c = c;
  if (idem.result == GW_IDEM_ORPHAN)
    {
      c->claimed = true;
      if (!present)
        {
          /* the earlier attempt's node is gone, and its sandbox with it */
          free (f);
          create_send (c, c->placed);
          return;
        }
      f->node = n; /* look there first, create there otherwise */
    }
  if (!present)
    {
      idem_found (g, c->req, 0, NULL, f);
      return;
    }
  char uri[128];
  if (idem.id[0])
    snprintf (uri, sizeof uri, "/v1/sandboxes/%s", idem.id);
  else
    snprintf (uri, sizeof uri, "/v1/sandboxes");
  gw_forward (g, n, c->req, EVHTTP_REQ_GET, uri, evbuffer_new (), idem_found, f);
}

/* Claim the key for a create placed on c->placed, off the loop. */
static void
idem_claim (struct gw *g, struct create_req *c)
{
  struct claim *cl = calloc (1, sizeof *cl);
  pthread_t t;
  if (cl == NULL)
    {
      if (c->proj)
        gw_quota_done (g, c->proj, c->mem, false);
      gw_reply_error (c->req, 500, WR_E_INTERNAL, "out of memory");
      create_free (c);
      return;
    }
  cl->g = g;
  cl->c = c;
  snprintf (cl->idem.key, sizeof cl->idem.key, "%s", c->idem);
  snprintf (cl->idem.node, sizeof cl->idem.node, "%s", c->placed->name);
  cl->done = event_new (g->base, -1, 0, claim_done, cl);
  if (pthread_create (&t, NULL, claim_main, cl) != 0)
    {
      cl->r = -1;
      event_active (cl->done, EV_TIMEOUT, 0);
      return;
    }
  pthread_detach (t);
}

static void
create_answered (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body,
                 void *ud)
{
  struct create_req *c = ud;
  if ((status == 0 || status == 503) && c->attempts < 3)
    {
      /* that node is gone or shutting down: the sandbox was not made there */
      g->m.create_retries++;
      size_t bl = body ? evbuffer_get_length (body) : 0;
      fprintf (stderr, "warren-gateway: create on %s answered %d %.*s; trying another node\n",
               json_string_value (json_object_get (c->body, "__node")), status,
               (int)(bl < 300 ? bl : 300), bl ? (const char *)evbuffer_pullup (body, -1) : "");
      pthread_mutex_lock (&g->mu);
      c->failed = gw_node_find (g, json_string_value (json_object_get (c->body, "__node")));
      pthread_mutex_unlock (&g->mu);
      create_place (c);
      return;
    }
  if (status == 201)
    g->m.creates++;
  else
    g->m.create_failures++;
  if (c->proj)
    gw_quota_done (g, c->proj, c->mem, status == 201);
  if (c->claimed)
    {
      json_t *j = status == 201 ? body_json (body) : NULL;
      idem_settle (g, c, json_string_value (json_object_get (c->body, "__node")),
                   json_string_value (json_object_get (j, "id")));
      json_decref (j);
    }
  if (status == 0)
    gw_reply_error (req, 503, "unavailable", "no node answered the create");
  else
    reply_buffer (req, status, body);
  create_free (c);
}

static void
create_send (struct create_req *c, struct gw_node *n)
{
  json_object_set_new (c->body, "__node", json_string (n->name));
  json_t *send = json_copy (c->body);
  json_object_del (send, "__node");
  char *text = json_dumps (send, JSON_COMPACT);
  json_decref (send);
  struct evbuffer *b = evbuffer_new ();
  evbuffer_add (b, text, strlen (text));
  free (text);
  gw_forward (c->g, n, c->req, EVHTTP_REQ_POST, "/v1/sandboxes", b, create_answered, c);
}

static void
create_place (struct create_req *c)
{
  struct gw *g = c->g;
  c->attempts++;
  /* priority: projects of priority 0 leave --priority-headroom MB free on
   * every node for higher priorities and the admin (docs/cluster.md) */
  long long headroom = c->proj && c->proj->priority <= 0 ? g->priority_headroom_mb : 0;
  struct gw_node *n = gw_place (g, c->backend, c->mem + headroom, c->want_labels,
                                c->image[0] ? c->image : NULL, c->failed);
  if (n == NULL)
    {
      if (c->proj)
        gw_quota_done (g, c->proj, c->mem, false);
      if (c->claimed)
        idem_settle (g, c, NULL, NULL);
      pthread_mutex_lock (&g->mu);
      bool synced = g->synced;
      pthread_mutex_unlock (&g->mu);
      if (!synced)
        gw_reply_error (c->req, 503, "control_plane_unavailable",
                        "the gateway has not read the cluster state from etcd yet");
      else
        gw_reply_error (c->req, 503, "unavailable",
                        "no node can take a %s sandbox of %lld MB%s (ready, not drained, labels)",
                        c->backend, c->mem, c->want_labels ? " with these labels" : "");
      create_free (c);
      return;
    }
  if (c->idem[0] && !c->claimed)
    {
      c->placed = n;
      idem_claim (g, c); /* then create_send */
      return;
    }
  create_send (c, n);
}

static void
create_quota (struct gw *g, bool ok, const char *why, void *ud)
{
  struct create_req *c = ud;
  if (!ok)
    {
      bool cp = why && strstr (why, "control plane unavailable");
      gw_reply_error (c->req, cp ? 503 : 429, cp ? "control_plane_unavailable" : WR_E_EXHAUSTED,
                      "%s", why ? why : "quota exhausted");
      create_free (c);
      return;
    }
  create_place (c);
}

/* [A-Za-z0-9] plus the characters in extra, 1..max long. */
static bool
name_chars_ok (const char *s, size_t max, const char *extra)
{
  size_t n = s ? strlen (s) : 0;
  bool ok = n > 0 && n <= max;
  for (size_t i = 0; ok && i < n; i++)
    ok = (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')
         || (s[i] >= '0' && s[i] <= '9') || strchr (extra, s[i]);
  return ok;
}

/* labels[k] = v on a create body (labels created when absent). */
static void
set_label (json_t *body, const char *k, const char *v)
{
  json_t *labels = json_object_get (body, "labels");
  if (!json_is_object (labels))
    json_object_set_new (body, "labels", labels = json_object ());
  json_object_set_new (labels, k, json_string (v));
}

static void
handle_create (struct gw *g, struct evhttp_request *req, struct gw_project *proj)
{
  if (!gw_control_plane_ok (g))
    {
      /* placement and quotas need the cluster's current state: refuse at once */
      gw_reply_error (req, 503, "control_plane_unavailable",
                      "etcd has not answered a quorum read for over 3 s; running sandboxes keep "
                      "working, creates are refused");
      return;
    }
  json_t *body = body_json (evhttp_request_get_input_buffer (req));
  if (body == NULL)
    body = json_object ();
  if (!json_is_object (body))
    {
      json_decref (body);
      gw_reply_error (req, 400, WR_E_INVALID, "the body must be a JSON object");
      return;
    }
  struct create_req *c = calloc (1, sizeof *c);
  if (c == NULL)
    {
      json_decref (body);
      gw_reply_error (req, 500, WR_E_INTERNAL, "out of memory");
      return;
    }
  c->g = g;
  c->req = req;
  c->body = body;
  json_t *v = json_object_get (body, "backend");
  snprintf (c->backend, sizeof c->backend, "%s",
            json_is_string (v) ? json_string_value (v) : "container");
  v = json_object_get (body, "image");
  const char *img = json_string_value (v);
  if (img && strlen (img) < 256 && strchr (img, '@') == NULL)
    {
      /* the nodes publish NAME:TAG */
      const char *slash = strrchr (img, '/');
      bool tagged = strchr (slash ? slash : img, ':') != NULL;
      snprintf (c->image, sizeof c->image, "%s%s", img, tagged ? "" : ":latest");
    }
  v = json_object_get (body, "memory_mb");
  c->mem = json_is_integer (v) ? json_integer_value (v) : 1024;
  if (c->mem <= 0)
    {
      create_free (c);
      gw_reply_error (req, 400, WR_E_INVALID, "field \"memory_mb\" must be a positive integer");
      return;
    }
  v = json_object_get (body, "node_labels");
  if (v && !json_is_object (v))
    {
      create_free (c);
      gw_reply_error (req, 400, WR_E_INVALID, "field \"node_labels\" must be an object");
      return;
    }
  c->want_labels = json_incref (v);
  json_object_del (body, "node_labels");
  v = json_object_get (body, "job");
  if (v)
    {
      const char *job = json_string_value (v);
      if (!name_chars_ok (job, 64, "._-"))
        {
          create_free (c);
          gw_reply_error (req, 400, WR_E_INVALID, "field \"job\" must be [A-Za-z0-9._-]{1,64}");
          return;
        }
      /* the node keeps it as a label: pause/resume find the job's sandboxes by it */
      set_label (body, "warren.job", job);
    }
  json_object_del (body, "__node");
  if (proj)
    {
      set_label (body, WR_LABEL_PROJECT, proj->name);
      json_object_set_new (body, "memory_mb", json_integer (c->mem));
      c->proj = proj;
    }
  const char *key = json_string_value (json_object_get (body, "idempotency_key"));
  if (key == NULL)
    key = evhttp_find_header (evhttp_request_get_input_headers (req), "Idempotency-Key");
  if (key)
    {
      if (!name_chars_ok (key, sizeof c->idem - 1, "._:-"))
        {
          create_free (c);
          gw_reply_error (req, 400, WR_E_INVALID, "idempotency key must be [A-Za-z0-9._:-]{1,128}");
          return;
        }
      snprintf (c->idem, sizeof c->idem, "%s", key);
      json_object_del (body, "idempotency_key"); /* frees key */
      set_label (body, LABEL_IDEM, c->idem);     /* key died with the field */
    }
  create_start (c);
}

static void
create_start (struct create_req *c)
{
  if (c->proj)
    gw_quota_take (c->g, c->proj, c->mem, create_quota, c);
  else
    create_place (c);
}

/* ---- GET /v1/sandboxes: every node's list, merged ----
 *
 * Sandboxes the cluster declared lost are listed as such: those of a node
 * that came back after its lease expired (made before its lost_at), and
 * those a gone node held when this gateway last listed it. Nodes that did
 * not answer are named, so a client knows the list is partial. */

struct list_req
{
  struct evhttp_request *req;
  json_t *all;
  const char *project; /* only this project's sandboxes */
  size_t pending;
  json_t *unreachable, *lost;
  struct list_part
  {
    struct list_req *l;
    struct gw_node *node;
    double lost_at; /* the node's, when it came back after being declared lost */
  } * parts;
};

static bool
list_wants (const struct list_req *l, const json_t *s)
{
  const char *p
      = json_string_value (json_object_get (json_object_get (s, "labels"), WR_LABEL_PROJECT));
  return l->project == NULL || (p && strcmp (p, l->project) == 0);
}

/* s as the cluster reports it: lost since lost_at */
static json_t *
as_lost (const json_t *s, double lost_at)
{
  json_t *c = json_copy ((json_t *)s);
  json_object_set_new (c, "state", json_string ("lost"));
  if (lost_at > 0)
    json_object_set_new (c, "lost_at", json_real (lost_at));
  json_object_set_new (c, "infra_failure", json_true ());
  return c;
}

static void
list_reply (struct list_req *l)
{
  json_t *r = json_pack ("{s:o}", "sandboxes", l->all);
  if (json_array_size (l->unreachable))
    json_object_set (r, "nodes_unreachable", l->unreachable);
  if (json_array_size (l->lost))
    json_object_set (r, "nodes_lost", l->lost);
  json_decref (l->unreachable);
  json_decref (l->lost);
  gw_reply_json (l->req, 200, r);
  free (l->parts);
  free (l);
}

static void
list_part (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct list_part *part = ud;
  struct list_req *l = part->l;
  json_t *j = status == 200 ? body_json (body) : NULL;
  json_t *list = json_object_get (j, "sandboxes");
  if (json_is_array (list))
    {
      /* kept for when the node is gone (loop only) */
      json_decref (part->node->last_list);
      part->node->last_list = json_incref (list);
    }
  else
    json_array_append_new (l->unreachable, json_string (part->node->name));
  size_t i;
  json_t *s;
  json_array_foreach (list, i, s)
  {
    if (!list_wants (l, s))
      continue;
    double created = json_number_value (json_object_get (s, "created_at"));
    if (part->lost_at > 0 && created > 0 && created < part->lost_at)
      json_array_append_new (l->all, as_lost (s, part->lost_at));
    else
      json_array_append (l->all, s);
  }
  json_decref (j);
  if (--l->pending == 0)
    list_reply (l);
}

static void
handle_list (struct gw *g, struct evhttp_request *req, struct gw_project *proj)
{
  struct gw_node *targets[GW_MAX_NODES], *gone[GW_MAX_NODES];
  size_t n = gw_present_nodes (g, targets), ngone = gw_lost_nodes (g, gone);
  struct list_req *l = calloc (1, sizeof *l);
  if (l)
    l->parts = calloc (n ? n : 1, sizeof *l->parts);
  if (l == NULL || l->parts == NULL)
    {
      free (l);
      gw_reply_error (req, 500, WR_E_INTERNAL, "out of memory");
      return;
    }
  l->req = req;
  l->all = json_array ();
  l->unreachable = json_array ();
  l->lost = json_array ();
  l->project = proj ? proj->name : NULL;
  for (size_t i = 0; i < ngone; i++)
    {
      json_array_append_new (l->lost, json_string (gone[i]->name));
      size_t k;
      json_t *s;
      json_array_foreach (gone[i]->last_list, k, s) if (list_wants (l, s))
          json_array_append_new (l->all, as_lost (s, 0));
    }
  if (n == 0)
    {
      list_reply (l);
      return;
    }
  l->pending = n;
  for (size_t i = 0; i < n; i++)
    {
      struct list_part *part = &l->parts[i];
      part->l = l;
      part->node = targets[i];
      pthread_mutex_lock (&g->mu);
      part->lost_at = json_number_value (json_object_get (targets[i]->status, "lost_at"));
      pthread_mutex_unlock (&g->mu);
      gw_forward (g, targets[i], req, EVHTTP_REQ_GET, "/v1/sandboxes", evbuffer_new (), list_part,
                  part);
    }
}

/* ---- GET /v1/images: every node's images, merged by name with the nodes
 * that hold each ---- */

struct images_part
{
  struct images_req *all;
  char node[WR_NODE_NAME_MAX + 1];
};

struct images_req
{
  json_t *by_name; /* name -> image + "nodes" */
  size_t pending;
  struct images_part parts[]; /* one per node asked */
};

static void
images_part (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct images_part *part = ud;
  struct images_req *all = part->all;
  json_t *j = status == 200 ? body_json (body) : NULL;
  size_t i;
  json_t *img;
  json_array_foreach (json_object_get (j, "images"), i, img)
  {
    const char *name = json_string_value (json_object_get (img, "name"));
    if (name == NULL)
      continue;
    json_t *have = json_object_get (all->by_name, name);
    if (have == NULL)
      {
        have = json_deep_copy (img);
        json_object_set_new (have, "nodes", json_array ());
        json_object_set_new (all->by_name, name, have);
      }
    json_array_append_new (json_object_get (have, "nodes"), json_string (part->node));
  }
  json_decref (j);
  if (--all->pending)
    return;
  json_t *list = json_array ();
  const char *k;
  json_t *v;
  json_object_foreach (all->by_name, k, v) json_array_append (list, v);
  json_decref (all->by_name);
  free (all);
  gw_reply_json (req, 200, json_pack ("{s:o}", "images", list));
}

static void
handle_images (struct gw *g, struct evhttp_request *req)
{
  struct gw_node *targets[GW_MAX_NODES];
  size_t n = gw_present_nodes (g, targets);
  struct images_req *all = calloc (1, sizeof *all + n * sizeof all->parts[0]);
  if (n == 0 || all == NULL)
    {
      free (all);
      gw_reply_json (req, 200, json_pack ("{s:[]}", "images"));
      return;
    }
  all->by_name = json_object ();
  all->pending = n;
  for (size_t i = 0; i < n; i++)
    {
      struct images_part *part = &all->parts[i];
      part->all = all;
      snprintf (part->node, sizeof part->node, "%s", targets[i]->name);
      gw_forward (g, targets[i], req, EVHTTP_REQ_GET, "/v1/images", evbuffer_new (), images_part,
                  part);
    }
}

/* ---- DELETE: look the sandbox up first when projects exist, to credit its quota ---- */

struct delete_req
{
  struct gw_node *node;
  char uri[128];
  struct gw_project *proj;   /* the sandbox's project */
  struct gw_project *caller; /* the token's project, if any */
  long long mem;
};

static void
delete_answered (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body,
                 void *ud)
{
  struct delete_req *dr = ud;
  if (status == 204 && dr->proj)
    gw_quota_put (g, dr->proj, dr->mem);
  if (status == 0)
    gw_reply_error (req, 503, "unavailable", "node %s unreachable", dr->node->name);
  else if (status == 204)
    evhttp_send_reply (req, 204, "No Content", NULL);
  else
    reply_buffer (req, status, body);
  free (dr);
}

static void
delete_looked_up (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body,
                  void *ud)
{
  struct delete_req *dr = ud;
  if (status != 200)
    {
      delete_answered (g, req, status, body, dr);
      return;
    }
  json_t *j = body_json (body);
  const char *p
      = json_string_value (json_object_get (json_object_get (j, "labels"), WR_LABEL_PROJECT));
  if (p)
    {
      pthread_mutex_lock (&g->mu);
      dr->proj = gw_project_find (g, p);
      pthread_mutex_unlock (&g->mu);
      dr->mem = json_integer_value (json_object_get (j, "memory_mb"));
    }
  json_decref (j);
  if (dr->caller && dr->proj != dr->caller)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "no such sandbox in project %s", dr->caller->name);
      free (dr);
      return;
    }
  gw_forward (g, dr->node, req, EVHTTP_REQ_DELETE, dr->uri, evbuffer_new (), delete_answered, dr);
}

/* ---- /v1/sandboxes/{id}...: routed by the node in the id ---- */

static void
dispatch (struct gw *g, struct gw_node *n, struct evhttp_request *req, const char *id,
          const char *sub)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  const char *uri = evhttp_request_get_uri (req);
  if (strcmp (sub, "exec") == 0 || strcmp (sub, "files") == 0)
    gw_route_resuming (g, n, req, m, uri, id);
  else
    gw_forward (g, n, req, m, uri, NULL, NULL, NULL);
}

/* A node that was declared lost and came back keeps its sandboxes, but the
 * cluster told their clients node_lost: they are reported lost, not
 * silently resurrected (issue 10). Sandboxes made after its return work. */
struct lost_check
{
  struct gw_node *node;
  double lost_at;
  char id[65];
  char sub[16];
};

static void
lost_checked (struct gw *g, struct evhttp_request *req, int status, struct evbuffer *body, void *ud)
{
  struct lost_check *lc = ud;
  json_t *j = status == 200 ? body_json (body) : NULL;
  double created = json_number_value (json_object_get (j, "created_at"));
  if (j && created > 0 && created < lc->lost_at)
    {
      g->m.node_lost++;
      if (lc->sub[0] == '\0' && evhttp_request_get_command (req) == EVHTTP_REQ_GET)
        {
          json_object_set_new (j, "state", json_string ("lost"));
          json_object_set_new (j, "lost_at", json_real (lc->lost_at));
          json_object_set_new (j, "infra_failure", json_true ());
          gw_reply_json (req, 200, json_incref (j));
        }
      else
        gw_reply_error (req, 410, "node_lost",
                        "sandbox %s was declared lost when node %s's lease expired; the node came "
                        "back, the sandbox is not resumed: delete it",
                        lc->id, lc->node->name);
    }
  else
    dispatch (g, lc->node, req, lc->id, lc->sub);
  json_decref (j);
  free (lc);
}

static void
handle_sandbox (struct gw *g, struct evhttp_request *req, const char *rest,
                struct gw_project *caller)
{
  char id[65], node[WR_NODE_NAME_MAX + 1];
  const char *slash = strchr (rest, '/');
  size_t idlen = slash ? (size_t)(slash - rest) : strlen (rest);
  if (idlen == 0 || idlen >= sizeof id)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "malformed sandbox id");
      return;
    }
  memcpy (id, rest, idlen);
  id[idlen] = '\0';
  if (!wr_id_node (id, node, sizeof node))
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "sandbox %s: not a cluster sandbox id", id);
      return;
    }
  pthread_mutex_lock (&g->mu);
  struct gw_node *n = gw_node_find (g, node);
  bool known = n && n->status, present = n && n->present;
  bool any_projects = g->n_projects > 0;
  pthread_mutex_unlock (&g->mu);
  if (!known)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "sandbox %s: no node %s in the cluster", id, node);
      return;
    }
  if (!present)
    {
      g->m.node_lost++;
      gw_reply_error (req, 503, "node_lost",
                      "sandbox %s: node %s left the cluster (its lease expired)", id, node);
      return;
    }
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (m == EVHTTP_REQ_DELETE && (slash == NULL || slash[1] == '\0') && any_projects)
    {
      struct delete_req *dr = calloc (1, sizeof *dr);
      if (dr == NULL)
        {
          gw_reply_error (req, 500, WR_E_INTERNAL, "out of memory");
          return;
        }
      dr->node = n;
      dr->caller = caller;
      snprintf (dr->uri, sizeof dr->uri, "/v1/sandboxes/%s", id);
      gw_forward (g, n, req, EVHTTP_REQ_GET, dr->uri, evbuffer_new (), delete_looked_up, dr);
      return;
    }
  const char *sub = slash ? slash + 1 : "";
  pthread_mutex_lock (&g->mu);
  double lost_at = json_number_value (json_object_get (n->status, "lost_at"));
  pthread_mutex_unlock (&g->mu);
  if (lost_at > 0 && m != EVHTTP_REQ_DELETE)
    {
      /* the node came back after the cluster declared it lost: look first */
      struct lost_check *lc = calloc (1, sizeof *lc);
      if (lc == NULL)
        {
          gw_reply_error (req, 500, WR_E_INTERNAL, "out of memory");
          return;
        }
      lc->node = n;
      lc->lost_at = lost_at;
      snprintf (lc->id, sizeof lc->id, "%s", id);
      snprintf (lc->sub, sizeof lc->sub, "%.15s", sub);
      char look[128];
      snprintf (look, sizeof look, "/v1/sandboxes/%s", id);
      gw_forward (g, n, req, EVHTTP_REQ_GET, look, evbuffer_new (), lost_checked, lc);
      return;
    }
  dispatch (g, n, req, id, sub);
}

/* ---- uploads: an upload lives on one node, which names itself in the id
 * ("NODE-" + 32 hex, as sandbox ids); the imports and builds that consume
 * one go to that node ---- */

/* The node of an upload id: 32 characters, "NODE-" and hex digits. */
static struct gw_node *
upload_node (struct gw *g, struct evhttp_request *req, const char *id)
{
  char node[WR_NODE_NAME_MAX + 1];
  const char *dash = id ? strrchr (id, '-') : NULL;
  size_t k = dash ? (size_t)(dash - id) : 0;
  bool ok = dash && strlen (id) == 32 && k < sizeof node
            && strspn (dash + 1, "0123456789abcdef") == 31 - k;
  if (ok)
    {
      memcpy (node, id, k);
      node[k] = '\0';
      ok = wr_node_name_valid (node);
    }
  if (!ok)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "no upload %.64s: not a cluster upload id",
                      id ? id : "");
      return NULL;
    }
  pthread_mutex_lock (&g->mu);
  struct gw_node *nd = gw_node_find (g, node);
  bool known = nd && nd->status, present = nd && nd->present;
  pthread_mutex_unlock (&g->mu);
  if (!known)
    gw_reply_error (req, 404, WR_E_NOT_FOUND, "no upload %s: no node %s in the cluster", id, node);
  else if (!present)
    {
      g->m.node_lost++;
      gw_reply_error (req, 503, "node_lost", "upload %s: node %s left the cluster", id, node);
    }
  return known && present ? nd : NULL;
}

/* Uploads belong to the client that made them (the node keys them by this
 * header from a gateway): the admin, or a project. */
static void
set_owner (struct evhttp_request *req, struct gw_project *proj)
{
  char owner[128];
  snprintf (owner, sizeof owner, "%s%s", proj ? "project:" : "admin", proj ? proj->name : "");
  evhttp_add_header (evhttp_request_get_input_headers (req), "Warren-Owner", owner);
}

static void
handle_uploads (struct gw *g, struct evhttp_request *req, const char *rest, struct gw_project *proj)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  set_owner (req, proj);
  if (rest == NULL && m == EVHTTP_REQ_POST)
    {
      /* any node that takes images will do: the usual placement */
      struct gw_node *n = gw_place (g, "container", 0, NULL, NULL, NULL);
      if (n == NULL)
        gw_reply_error (req, 503, "unavailable", "no ready node takes uploads");
      else
        gw_forward (g, n, req, m, evhttp_request_get_uri (req), NULL, NULL, NULL);
      return;
    }
  if (rest == NULL)
    {
      gw_reply_error (req, 501, WR_E_UNSUPPORTED,
                      "listing uploads is not served by the gateway; GET /v1/uploads/ID works");
      return;
    }
  struct gw_node *n = upload_node (g, req, rest);
  if (n)
    gw_forward (g, n, req, m, evhttp_request_get_uri (req), NULL, NULL, NULL);
}

/* POST /v1/images/import {"upload"} and /v1/images/build {"context_upload"}:
 * to the upload's node, where the image then is. */
static void
handle_image_upload (struct gw *g, struct evhttp_request *req, const char *field,
                     struct gw_project *proj)
{
  set_owner (req, proj);
  json_t *body = body_json (evhttp_request_get_input_buffer (req));
  const char *id = json_string_value (json_object_get (body, field));
  if (id == NULL)
    gw_reply_error (req, 501, WR_E_UNSUPPORTED,
                    "through a gateway an image comes from an upload (\"%s\": ID); address a "
                    "node for paths on it",
                    field);
  else
    {
      struct gw_node *n = upload_node (g, req, id);
      if (n)
        gw_forward (g, n, req, EVHTTP_REQ_POST, evhttp_request_get_uri (req), NULL, NULL, NULL);
    }
  json_decref (body);
}

/* POST /v1/calls: stateless, so any node with fncall pools will do; the
 * nodes holding the image first, power of two among them. */
static void
handle_call (struct gw *g, struct evhttp_request *req)
{
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  json_t *body = body_json (in);
  const char *img = json_string_value (json_object_get (body, "image"));
  char image[300] = "";
  if (img && strlen (img) < 256 && strchr (img, '@') == NULL)
    {
      const char *slash = strrchr (img, '/');
      snprintf (image, sizeof image, "%s%s", img,
                strchr (slash ? slash : img, ':') ? "" : ":latest");
    }
  json_decref (body);
  struct gw_node *n = gw_place (g, "fncall", 0, NULL, image[0] ? image : NULL, NULL);
  if (n == NULL)
    {
      gw_reply_error (req, 503, "unavailable", "no ready node offers fncall");
      return;
    }
  gw_forward (g, n, req, EVHTTP_REQ_POST, "/v1/calls", NULL, NULL, NULL);
}

static void
handle_nodes (struct gw *g, struct evhttp_request *req, const char *rest)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (rest == NULL && m == EVHTTP_REQ_GET)
    {
      gw_reply_json (req, 200, gw_nodes_json (g));
      return;
    }
  char name[64];
  const char *slash = rest ? strchr (rest, '/') : NULL;
  if (m != EVHTTP_REQ_POST || slash == NULL || (size_t)(slash - rest) >= sizeof name
      || (strcmp (slash, "/drain") != 0 && strcmp (slash, "/undrain") != 0))
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "no such route");
      return;
    }
  memcpy (name, rest, slash - rest);
  name[slash - rest] = '\0';
  if (!wr_node_name_valid (name))
    {
      gw_reply_error (req, 400, WR_E_INVALID, "malformed node name");
      return;
    }
  pthread_mutex_lock (&g->mu);
  struct gw_node *n = gw_node_find (g, name);
  bool known = n && n->status;
  pthread_mutex_unlock (&g->mu);
  if (!known)
    {
      gw_reply_error (req, 404, WR_E_NOT_FOUND, "no node %s in the cluster", name);
      return;
    }
  bool drain = strcmp (slash, "/drain") == 0;
  char key[128];
  snprintf (key, sizeof key, "%s%s", WR_KEY_DRAIN, name);
  wr_err_t err;
  /* an admin call, rare: one blocking etcd write on the loop */
  int r = drain ? wr_etcd_put (g->etcd, key, "1", 0, &err) : wr_etcd_delete (g->etcd, key, &err);
  if (r < 0)
    {
      gw_reply_error (req, 503, "control_plane_unavailable", "%s", err.msg);
      return;
    }
  /* our own view follows at once; the watch confirms it */
  pthread_mutex_lock (&g->mu);
  n->drained = drain;
  pthread_mutex_unlock (&g->mu);
  gw_reply_json (req, 200, json_pack ("{s:s,s:b}", "name", name, "drained", drain));
}

static void
gw_metrics_reply (struct gw *g, struct evhttp_request *req)
{
  struct evbuffer *b = evbuffer_new ();
  const struct
  {
    const char *name, *help;
    uint64_t v;
  } c[] = {
    { "requests_total", "HTTP requests served.", g->m.requests },
    { "creates_total", "Sandboxes created through this gateway.", g->m.creates },
    { "create_failures_total", "Creates that failed (any status but 201).", g->m.create_failures },
    { "create_retries_total", "Creates sent to another node after one did not answer.",
      g->m.create_retries },
    { "node_lost_total", "Requests refused because the sandbox's node left.", g->m.node_lost },
    { "quota_txns_total", "etcd transactions on quota counters (reserve or return a chunk).",
      g->m.quota_txns },
    { "quota_conflicts_total", "Quota transactions another gateway won first.",
      g->m.quota_conflicts },
    { "idempotency_claims_total", "etcd writes for idempotency keys.", g->m.idem_claims },
    { "quota_reconciled_total", "Quota counters lowered by this gateway's reconciler.",
      atomic_load (&g->reconcile_fixes) },
  };
  for (size_t i = 0; i < WR_ARRAY_SIZE (c); i++)
    evbuffer_add_printf (b,
                         "# HELP warren_gateway_%s %s\n# TYPE warren_gateway_%s counter\n"
                         "warren_gateway_%s %llu\n",
                         c[i].name, c[i].help, c[i].name, c[i].name, (unsigned long long)c[i].v);
  evbuffer_add_printf (b, "# HELP warren_gateway_nodes Nodes this gateway knows, by state.\n"
                          "# TYPE warren_gateway_nodes gauge\n");
  size_t ready = 0, drained = 0, lost = 0;
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_nodes; i++)
    if (g->nodes[i]->status)
      {
        if (!g->nodes[i]->present)
          lost++;
        else if (g->nodes[i]->drained)
          drained++;
        else
          ready++;
      }
  pthread_mutex_unlock (&g->mu);
  evbuffer_add_printf (b,
                       "warren_gateway_nodes{state=\"ready\"} %zu\n"
                       "warren_gateway_nodes{state=\"drained\"} %zu\n"
                       "warren_gateway_nodes{state=\"lost\"} %zu\n",
                       ready, drained, lost);
  evbuffer_add_printf (b,
                       "# HELP warren_http_connections Open TCP connections counted against the "
                       "limit.\n# TYPE warren_http_connections gauge\nwarren_http_connections %u\n"
                       "# HELP warren_http_refused_total TCP connections closed before routing, "
                       "by reason.\n# TYPE warren_http_refused_total counter\n"
                       "warren_http_refused_total{reason=\"unauthorized\"} %llu\n"
                       "warren_http_refused_total{reason=\"too_many_connections\"} %llu\n"
                       "warren_http_refused_total{reason=\"timeout\"} %llu\n",
                       g->http_conns, (unsigned long long)g->http_unauthorized,
                       (unsigned long long)g->http_busy, (unsigned long long)g->http_timeouts);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                     "text/plain; version=0.0.4");
  evhttp_send_reply (req, 200, "OK", b);
  evbuffer_free (b);
}

static void
route (struct evhttp_request *req, void *arg)
{
  struct gw *g = arg;
  struct gw_project *proj = NULL;
  gw_nodelay (evhttp_request_get_connection (req));
  g->m.requests++;
  enum who who = authenticate (g, req, &proj);
  if (who == WHO_NONE)
    {
      gw_reply_error (req, 401, WR_E_UNAUTHORIZED, "a valid bearer token is required");
      return;
    }
  const char *path = evhttp_uri_get_path (evhttp_request_get_evhttp_uri (req));
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (path == NULL)
    path = "/";
  /* only the gateway names an upload's owner to a node (set_owner) */
  evhttp_remove_header (evhttp_request_get_input_headers (req), "Warren-Owner");
  if (strcmp (path, "/healthz") == 0)
    {
      size_t ready = 0;
      pthread_mutex_lock (&g->mu);
      for (size_t i = 0; i < g->n_nodes; i++)
        ready += g->nodes[i]->present && !g->nodes[i]->drained;
      bool synced = g->synced;
      pthread_mutex_unlock (&g->mu);
      gw_reply_json (req, 200,
                     json_pack ("{s:s,s:s,s:I,s:b,s:s,s:s}", "status", "ok", "role", "gateway",
                                "nodes_ready", (json_int_t)ready, "synced", synced, "control_plane",
                                gw_control_plane_ok (g) ? "ok" : "unavailable", "version",
                                WARREN_VERSION));
    }
  else if (strcmp (path, "/metrics") == 0)
    gw_metrics_reply (g, req);
  else if (strcmp (path, "/v1/sandboxes") == 0 && m == EVHTTP_REQ_POST)
    handle_create (g, req, proj);
  else if (strcmp (path, "/v1/sandboxes") == 0 && m == EVHTTP_REQ_GET)
    handle_list (g, req, proj);
  else if (strncmp (path, "/v1/sandboxes/", 14) == 0)
    handle_sandbox (g, req, path + 14, proj);
  else if (strcmp (path, "/v1/images") == 0 && m == EVHTTP_REQ_GET)
    handle_images (g, req);
  else if (strcmp (path, "/v1/calls") == 0 && m == EVHTTP_REQ_POST)
    handle_call (g, req);
  else if (strcmp (path, "/v1/uploads") == 0 || strncmp (path, "/v1/uploads/", 12) == 0)
    handle_uploads (g, req, path[11] ? path + 12 : NULL, proj);
  else if (strcmp (path, "/v1/images/import") == 0 && m == EVHTTP_REQ_POST)
    handle_image_upload (g, req, "upload", proj);
  else if (strcmp (path, "/v1/images/build") == 0 && m == EVHTTP_REQ_POST)
    handle_image_upload (g, req, "context_upload", proj);
  else if (strncmp (path, "/v1/jobs/", 9) == 0)
    gw_jobs (g, req, path + 9, proj ? proj->name : NULL);
  else if (who != WHO_ADMIN
           && (strncmp (path, "/v1/nodes", 9) == 0 || strncmp (path, "/v1/projects", 12) == 0))
    gw_reply_error (req, 401, WR_E_UNAUTHORIZED, "this route needs the gateway's admin token");
  else if (strcmp (path, "/v1/nodes") == 0)
    handle_nodes (g, req, NULL);
  else if (strncmp (path, "/v1/nodes/", 10) == 0)
    handle_nodes (g, req, path + 10);
  else if (strcmp (path, "/v1/projects") == 0 && m == EVHTTP_REQ_POST)
    gw_projects_create (g, req);
  else if (strcmp (path, "/v1/projects") == 0 && m == EVHTTP_REQ_GET)
    gw_reply_json (req, 200, gw_projects_json (g));
  else
    gw_reply_error (req, 501, WR_E_UNSUPPORTED,
                    "%s is not served by the gateway yet; address a node directly", path);
}

/* The connection's first request is checked on its headers (common/httpd.c):
 * an unauthenticated client cannot make the gateway read a body. */
static bool
header_authorized (void *arg, const char *value, size_t len)
{
  struct gw_project *p;
  return who_of (arg, value, len, &p) != WHO_NONE;
}

static void
refused (struct evhttp_request *req, int status, const char *code, const char *msg, void *arg)
{
  struct gw *g = arg;
  g->m.requests++;
  gw_reply_error (req, status, code, "%s", msg);
}

int
gw_http_listen (struct gw *g, const char *spec, wr_err_t *err)
{
  if (g->httpd == NULL)
    {
      struct wr_httpd_config cfg = {
        .max_connections = g->http_limits.max_connections,
        .header_timeout_s = g->http_limits.header_timeout_s,
        .idle_timeout_s = g->http_limits.idle_timeout_s,
        .max_body = (64u << 20) + 4096,
        .authorized = header_authorized,
        .route = route,
        .refused = refused,
        .arg = g,
        .unauthorized = &g->http_unauthorized,
        .busy = &g->http_busy,
        .timeouts = &g->http_timeouts,
        .connections = &g->http_conns,
      };
      if (wr_httpd_new (g->base, &cfg, &g->httpd, err) < 0)
        return -1;
    }
  return wr_httpd_bind (g->httpd, spec, err);
}

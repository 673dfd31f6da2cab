/* warren-gateway --listen-compat: SandboxFusion's and E2B's APIs for a
 * whole cluster (docs/compat.md, docs/e2b.md, docs/cluster.md "Compat APIs").
 *
 * The gateway does not run these layers itself: every node started with
 * --listen-compat serves both on one port and publishes it in its status
 * (compat_port), and the gateway forwards there.
 *  - SandboxFusion (/run_code, /run_jupyter) is stateless: each request goes
 *    to a node picked by the normal placement (power of two choices among
 *    the ready nodes with a compat port); fncall pools are per node.
 *  - E2B's sandbox creates are placed the same way; every other E2B request
 *    names its sandbox, in the path (/sandboxes/ID...) or in the
 *    E2b-Sandbox-Id header (the envd API), and the id names its node.
 *    Lists are merged from every node.
 * Like the nodes' compat listeners, this one has no authentication: keep it
 * on a network you trust. Requests to nodes carry the node token. */
#include "gateway/gateway.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include "common/util.h"

#define COMPAT_MAX_BODY (64u << 20)

struct gw_compat
{
  struct evhttp *http;
  /* Per node (same index as g->nodes): a shadow node addressed at its
   * compat port, so gw_forward's connection pools serve it as any node. */
  struct gw_node *shadow[GW_MAX_NODES];
};

static void
reply_detail (struct evhttp_request *req, int status, const char *detail)
{
  gw_reply_json (req, status, json_pack ("{s:s}", "detail", detail));
}

/* E2B's error shape: {"code": STATUS, "message"}. */
static void reply_e2b (struct evhttp_request *req, int status, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));
static void
reply_e2b (struct evhttp_request *req, int status, const char *fmt, ...)
{
  char msg[400];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  gw_reply_json (req, status, json_pack ("{s:i,s:s}", "code", status, "message", msg));
}

/* The node's compat endpoint (NULL when it has none). Loop only. */
static struct gw_node *
shadow_of (struct gw *g, struct gw_node *n)
{
  struct gw_compat *c = g->compat;
  size_t i;
  pthread_mutex_lock (&g->mu);
  for (i = 0; i < g->n_nodes && g->nodes[i] != n; i++)
    ;
  bool ok = i < g->n_nodes && n->compat_port > 0;
  struct gw_node *s = ok ? c->shadow[i] : NULL;
  if (ok && s == NULL && (s = calloc (1, sizeof *s)))
    {
      snprintf (s->name, sizeof s->name, "%s", n->name);
      c->shadow[i] = s;
    }
  if (ok && s)
    {
      /* conn_get compares these with its pooled connections' address */
      snprintf (s->host, sizeof s->host, "%s", n->host);
      s->port = n->compat_port;
      s->present = n->present;
    }
  pthread_mutex_unlock (&g->mu);
  return ok ? s : NULL;
}

/* SandboxFusion requests and E2B creates: any ready node with a compat port. */
static void
forward_placed (struct gw *g, struct evhttp_request *req, bool e2b)
{
  struct gw_node *n = gw_place (g, GW_COMPAT, 0, NULL, NULL, NULL);
  if (n && !e2b && n->pending)
    n->pending--; /* a run makes no sandbox: no count for a status to settle */
  struct gw_node *s = n ? shadow_of (g, n) : NULL;
  if (s == NULL)
    {
      if (e2b)
        reply_e2b (req, 503, "no ready node serves the compat APIs (warrend --listen-compat)");
      else
        reply_detail (req, 503, "no ready node serves the compat APIs (warrend --listen-compat)");
      return;
    }
  gw_forward (g, s, req, evhttp_request_get_command (req), evhttp_request_get_uri (req), NULL, NULL,
              NULL);
}

/* Everything about one E2B sandbox: to the node its id names. */
static void
forward_by_id (struct gw *g, struct evhttp_request *req, const char *id)
{
  char node[WR_NODE_NAME_MAX + 1];
  if (!wr_id_node (id, node, sizeof node))
    {
      reply_e2b (req, 404, "sandbox %s not found (not a cluster sandbox id)", id);
      return;
    }
  pthread_mutex_lock (&g->mu);
  struct gw_node *n = gw_node_find (g, node);
  bool known = n && n->status, present = n && n->present;
  pthread_mutex_unlock (&g->mu);
  if (!known)
    {
      reply_e2b (req, 404, "sandbox %s not found (no node %s in the cluster)", id, node);
      return;
    }
  struct gw_node *s = present ? shadow_of (g, n) : NULL;
  if (s == NULL)
    {
      g->m.node_lost += !present;
      reply_e2b (req, 503, "sandbox %s: node %s %s", id, node,
                 present ? "serves no compat API" : "left the cluster (its lease expired)");
      return;
    }
  gw_forward (g, s, req, evhttp_request_get_command (req), evhttp_request_get_uri (req), NULL, NULL,
              NULL);
}

/* ---- GET /sandboxes, /v2/sandboxes: every node's list, merged ---- */

struct list_req
{
  struct evhttp_request *req;
  json_t *all;
  unsigned waiting;
};

static void
list_answered (struct gw *g WR_UNUSED, struct evhttp_request *req, int status,
               struct evbuffer *body, void *ud)
{
  struct list_req *l = ud;
  size_t n = body ? evbuffer_get_length (body) : 0;
  json_t *a = status == 200 && n ? json_loadb ((const char *)evbuffer_pullup (body, -1), n, 0, NULL)
                                 : NULL;
  if (json_is_array (a))
    json_array_extend (l->all, a); /* a node that does not answer is left out */
  json_decref (a);
  if (--l->waiting)
    return;
  gw_reply_json (req, 200, l->all);
  free (l);
}

static void
handle_list (struct gw *g, struct evhttp_request *req)
{
  static struct gw_node *nodes[GW_MAX_NODES];
  size_t nn = gw_present_nodes (g, nodes), k = 0;
  for (size_t i = 0; i < nn; i++)
    if ((nodes[k] = shadow_of (g, nodes[i])))
      k++;
  struct list_req *l = calloc (1, sizeof *l);
  if (l == NULL)
    {
      reply_e2b (req, 500, "out of memory");
      return;
    }
  l->req = req;
  l->all = json_array ();
  if (k == 0)
    {
      list_answered (g, req, 0, NULL, l);
      return;
    }
  l->waiting = (unsigned)k;
  const char *uri = evhttp_request_get_uri (req);
  for (size_t i = 0; i < k; i++)
    gw_forward (g, nodes[i], req, EVHTTP_REQ_GET, uri, evbuffer_new (), list_answered, l);
}

/* ---- routing ---- */

/* The sandbox of an envd request: the E2b-Sandbox-Id header (the SDK's
 * E2B_SANDBOX_URL mode). E2B's Host: PORT-ID.DOMAIN scheme would need a
 * wildcard DNS name per gateway and is not routed here. */
static bool
envd_id (struct evhttp_request *req, char id[65])
{
  const char *v = evhttp_find_header (evhttp_request_get_input_headers (req), "E2b-Sandbox-Id");
  if (v == NULL || v[0] == '\0')
    return false;
  snprintf (id, 65, "%.64s", v);
  return true;
}

static void
compat_route (struct evhttp_request *req, void *arg)
{
  struct gw *g = arg;
  g->m.requests++;
  gw_nodelay (evhttp_request_get_connection (req));
  const char *uri = evhttp_request_get_uri (req);
  size_t plen = strcspn (uri, "?#");
  char path[512];
  if (plen >= sizeof path)
    {
      reply_detail (req, 404, "Not Found");
      return;
    }
  memcpy (path, uri, plen);
  path[plen] = '\0';
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  char id[65];
  if (strcmp (path, "/v1/ping") == 0 && m == EVHTTP_REQ_GET)
    {
      struct evbuffer *b = evbuffer_new ();
      evbuffer_add_printf (b, "\"pong\"");
      evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                         "application/json");
      evhttp_send_reply (req, 200, "OK", b);
      evbuffer_free (b);
    }
  else if (strcmp (path, "/run_code") == 0 || strcmp (path, "/run_jupyter") == 0)
    {
      if (m == EVHTTP_REQ_POST)
        forward_placed (g, req, false);
      else
        reply_detail (req, 405, "Method Not Allowed");
    }
  else if (envd_id (req, id))
    forward_by_id (g, req, id); /* envd: process, filesystem, /files, /health */
  else if (strcmp (path, "/health") == 0)
    evhttp_send_reply (req, 204, "No Content", NULL);
  else if ((strcmp (path, "/sandboxes") == 0 || strcmp (path, "/v2/sandboxes") == 0)
           && m == EVHTTP_REQ_POST)
    forward_placed (g, req, true);
  else if ((strcmp (path, "/sandboxes") == 0 || strcmp (path, "/v2/sandboxes") == 0)
           && m == EVHTTP_REQ_GET)
    handle_list (g, req);
  else if (strncmp (path, "/sandboxes/", 11) == 0 || strncmp (path, "/v2/sandboxes/", 14) == 0)
    {
      const char *rest = path + (path[1] == 'v' ? 14 : 11);
      size_t n = strcspn (rest, "/");
      if (n == 0 || n > 64)
        {
          reply_e2b (req, 404, "malformed sandbox id");
          return;
        }
      snprintf (id, sizeof id, "%.*s", (int)n, rest);
      forward_by_id (g, req, id);
    }
  else
    reply_detail (req, 404, "Not Found");
}

int
gw_compat_listen (struct gw *g, const char *spec, wr_err_t *err)
{
  const char *p = strncmp (spec, "tcp:", 4) == 0 ? spec + 4 : spec;
  char host[256] = "127.0.0.1"; /* without an address: loopback, as warrend's */
  const char *colon = strrchr (p, ':');
  if (colon)
    snprintf (host, sizeof host, "%.*s", (int)(colon - p), p);
  const char *ps = colon ? colon + 1 : p;
  char *end;
  long port = strtol (ps, &end, 10);
  if (*ps == '\0' || *end || port < 0 || port > 65535 || host[0] == '\0')
    return wr_error (err, 0, WR_E_INVALID, "--listen-compat wants tcp:ADDR:PORT, got %s", spec);
  if (g->compat == NULL)
    {
      struct gw_compat *c = calloc (1, sizeof *c);
      if (c == NULL || (c->http = evhttp_new (g->base)) == NULL)
        {
          free (c);
          return wr_error (err, ENOMEM, WR_E_INTERNAL, "evhttp_new");
        }
      evhttp_set_gencb (c->http, compat_route, g);
      evhttp_set_max_body_size (c->http, COMPAT_MAX_BODY);
      evhttp_set_allowed_methods (c->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD
                                               | EVHTTP_REQ_DELETE | EVHTTP_REQ_PUT);
      /* a run may take an hour; idle keep-alive connections close after this */
      evhttp_set_timeout (c->http, 3600);
      g->compat = c;
    }
  if (evhttp_bind_socket_with_handle (g->compat->http, host, (ev_uint16_t)port) == NULL)
    return wr_error (err, errno, WR_E_INTERNAL, "--listen-compat: bind %s", spec);
  return 0;
}

void
gw_compat_free (struct gw *g)
{
  struct gw_compat *c = g->compat;
  if (c == NULL)
    return;
  evhttp_free (c->http);
  for (size_t i = 0; i < GW_MAX_NODES; i++)
    if (c->shadow[i])
      {
        while (c->shadow[i]->n_idle)
          evhttp_connection_free (c->shadow[i]->idle[--c->shadow[i]->n_idle]);
        free (c->shadow[i]);
      }
  free (c);
  g->compat = NULL;
}

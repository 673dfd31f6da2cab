/* Forwarding to nodes with libevent's HTTP client. Each node has a small
 * pool of keep-alive connections (an evhttp_connection runs one request at
 * a time). A chunked answer (exec streams, image progress) is relayed chunk
 * by chunk as it arrives; anything else is buffered and sent with its
 * length. A client that goes away mid-request cancels the node request,
 * which closes that connection: the node then kills a running command the
 * same way it does for a direct client. */
#include "gateway/gateway.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>

#include "common/util.h"

struct fwd
{
  struct gw *g;
  struct gw_node *node;
  struct evhttp_request *client;
  struct evhttp_connection *client_conn;
  struct evhttp_request *out;
  struct evhttp_connection *conn;
  struct evbuffer *body;
  gw_fwd_hook hook;
  void *ud;
  enum evhttp_cmd_type method;
  char *uri;
  bool reused; /* conn came from the idle pool: the node may have closed it meanwhile */
  bool streaming;
  bool client_gone;
  bool out_done;
  bool lost;             /* cancelled because the node's lease expired */
  bool hung_up;          /* the client's socket closed while we waited (hangup) */
  struct event *hangup;  /* EV_CLOSED on the client's socket */
  gw_fwd_hook on_paused; /* a 409 "is paused" goes here instead of to the client */
  void *paused_ud;
  void (*paused_free) (void *);
  struct fwd *inflight_prev, *inflight_next;
};

static struct fwd *forward (struct gw *g, struct gw_node *n, struct evhttp_request *client,
                            enum evhttp_cmd_type method, const char *uri, struct evbuffer *body,
                            gw_fwd_hook hook, void *ud, bool fresh);

static void
conn_free_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  evhttp_connection_free (arg);
}

/* Never free a connection from inside one of its own callbacks. */
static void
conn_release (struct gw *g, struct gw_node *n, struct evhttp_connection *c)
{
  if (n->n_idle < GW_IDLE_MAX && strcmp (n->conn_host, n->host) == 0 && n->conn_port == n->port)
    n->idle[n->n_idle++] = c;
  else
    event_base_once (g->base, -1, EV_TIMEOUT, conn_free_cb, c, &(struct timeval){ 0, 0 });
}

static struct evhttp_connection *
conn_get (struct gw *g, struct gw_node *n, bool fresh, bool *ret_reused)
{
  pthread_mutex_lock (&g->mu);
  char host[256];
  snprintf (host, sizeof host, "%s", n->host);
  int port = n->port;
  pthread_mutex_unlock (&g->mu);
  if (strcmp (host, n->conn_host) != 0 || port != n->conn_port)
    {
      /* the node came back elsewhere: old connections point at the wrong place */
      while (n->n_idle)
        event_base_once (g->base, -1, EV_TIMEOUT, conn_free_cb, n->idle[--n->n_idle],
                         &(struct timeval){ 0, 0 });
      snprintf (n->conn_host, sizeof n->conn_host, "%s", host);
      n->conn_port = port;
    }
  *ret_reused = n->n_idle > 0 && !fresh;
  if (*ret_reused)
    return n->idle[--n->n_idle];
  if (port <= 0)
    return NULL;
  struct evhttp_connection *c = evhttp_connection_base_new (g->base, NULL, host, (uint16_t)port);
  if (c == NULL)
    return NULL;
  evhttp_connection_set_retries (c, 0);
  /* execs may run for a day; a dead node is noticed by its connection
   * closing, or by its lease expiring */
  evhttp_connection_set_timeout (c, 2 * 86400);
  return c;
}

/* Request headers of the compat APIs (compat.c) a node must see too. */
static const char *const pass_headers[] = {
  "E2b-Sandbox-Id",
  "Connect-Timeout-Ms",
  "Connect-Protocol-Version",
};

/* Small requests and answers in several writes: without this, Nagle and
 * delayed ACKs add ~40 ms to a round trip. A socket libevent (re)created
 * gets it on its first use after connecting. */
void
gw_nodelay (struct evhttp_connection *c)
{
  struct bufferevent *bev = c ? evhttp_connection_get_bufferevent (c) : NULL;
  evutil_socket_t fd = bev ? bufferevent_getfd (bev) : -1;
  int one = 1;
  if (fd >= 0)
    {
      setsockopt (fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      /* a long-lived connection leaves quick-ACK mode: a peer that sends its
       * answer in two segments with Nagle on then waits for our delayed ACK */
      setsockopt (fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
    }
}

void
gw_nodes_free_conns (struct gw *g)
{
  for (size_t i = 0; i < g->n_nodes; i++)
    {
      while (g->nodes[i]->n_idle)
        evhttp_connection_free (g->nodes[i]->idle[--g->nodes[i]->n_idle]);
      json_decref (g->nodes[i]->last_list); /* the loop's too */
      g->nodes[i]->last_list = NULL;
    }
}

static void
fwd_free (struct fwd *f)
{
  if (f->inflight_prev)
    f->inflight_prev->inflight_next = f->inflight_next;
  else if (f->node->inflight == f)
    f->node->inflight = f->inflight_next;
  if (f->inflight_next)
    f->inflight_next->inflight_prev = f->inflight_prev;
  if (f->client_conn && !f->client_gone)
    evhttp_connection_set_closecb (f->client_conn, NULL, NULL);
  if (f->hangup)
    event_free (f->hangup);
  if (f->body)
    evbuffer_free (f->body);
  free (f->uri);
  if (f->paused_free)
    f->paused_free (f->paused_ud);
  free (f);
}

static void
copy_header (struct evhttp_request *from, struct evhttp_request *to, const char *name)
{
  const char *v = evhttp_find_header (evhttp_request_get_input_headers (from), name);
  if (v)
    evhttp_add_header (evhttp_request_get_output_headers (to), name, v);
}

static void
copy_header_in (struct evhttp_request *from, struct evkeyvalq *to, const char *name)
{
  const char *v = evhttp_find_header (evhttp_request_get_input_headers (from), name);
  if (v)
    evhttp_add_header (to, name, v);
}

static void
unreachable (struct fwd *f)
{
  if (f->lost && !f->streaming && !f->hook)
    {
      gw_reply_error (f->client, 503, "node_lost",
                      "node %s left the cluster (its lease expired) while this request waited",
                      f->node->name);
      return;
    }
  if (f->hook)
    {
      f->hook (f->g, f->client, 0, NULL, f->ud);
      return;
    }
  if (f->streaming)
    {
      /* the status line is gone already: end the stream with an error line */
      struct evbuffer *b = evbuffer_new ();
      evbuffer_add_printf (b,
                           "{\"error\":{\"code\":\"%s\",\"message\":\"node %s: connection "
                           "lost\"},\"infra_failure\":true}\n",
                           f->lost ? "node_lost" : "unavailable", f->node->name);
      evhttp_send_reply_chunk (f->client, b);
      evbuffer_free (b);
      evhttp_send_reply_end (f->client);
      return;
    }
  pthread_mutex_lock (&f->g->mu);
  bool stopping = f->node->stopping;
  pthread_mutex_unlock (&f->g->mu);
  if (stopping)
    gw_reply_error (f->client, 503, "unavailable",
                    "node %s is restarting (its daemon stopped; its sandboxes come back with it, "
                    "or are declared lost when its lease expires): retry",
                    f->node->name);
  else
    gw_reply_error (f->client, 503, "unavailable", "node %s (%s:%d) unreachable", f->node->name,
                    f->node->conn_host, f->node->conn_port);
}

static void
out_done (struct evhttp_request *out, void *arg)
{
  struct fwd *f = arg;
  f->out_done = true;
  if (f->client_gone)
    return; /* client_closed_cb cancelled us and finishes */
  int status = out ? evhttp_request_get_response_code (out) : 0;
  if (status == 0 && f->reused && !f->streaming && !f->lost
      && (f->method == EVHTTP_REQ_GET || f->method == EVHTTP_REQ_HEAD
          || f->method == EVHTTP_REQ_DELETE))
    {
      /* a kept-alive connection the node had just closed: once more on a new one */
      event_base_once (f->g->base, -1, EV_TIMEOUT, conn_free_cb, f->conn,
                       &(struct timeval){ 0, 0 });
      if (f->client_conn)
        evhttp_connection_set_closecb (f->client_conn, NULL, NULL);
      f->client_conn = NULL;
      forward (f->g, f->node, f->client, f->method, f->uri, evbuffer_new (), f->hook, f->ud, true);
      fwd_free (f);
      return;
    }
  conn_release (f->g, f->node, f->conn);
  if (status == 0)
    unreachable (f);
  else if (f->streaming)
    evhttp_send_reply_end (f->client);
  else
    {
      struct evbuffer *in = evhttp_request_get_input_buffer (out);
      evbuffer_add_buffer (f->body, in);
      if (f->hook)
        f->hook (f->g, f->client, status, f->body, f->ud);
      else if (f->on_paused && status == 409
               && evbuffer_search (f->body, "is paused", 9, NULL).pos >= 0)
        {
          f->paused_free = NULL; /* the hook owns paused_ud now */
          f->on_paused (f->g, f->client, status, f->body, f->paused_ud);
        }
      else
        {
          copy_header (out, f->client, "Content-Type");
          /* an upload's answers (daemon/uploads.c) */
          copy_header (out, f->client, "Location");
          copy_header (out, f->client, "Range");
          copy_header (out, f->client, "Upload-Offset");
          evhttp_send_reply (f->client, status, evhttp_request_get_response_code_line (out),
                             f->body);
        }
    }
  fwd_free (f);
}

static int
out_header (struct evhttp_request *out, void *arg)
{
  struct fwd *f = arg;
  gw_nodelay (f->conn);
  if (f->client_gone || f->hook)
    return 0;
  if (f->on_paused && evhttp_request_get_response_code (out) == 409)
    return 0; /* buffered: out_done decides */
  const char *te = evhttp_find_header (evhttp_request_get_input_headers (out), "Transfer-Encoding");
  if (te && strcasestr (te, "chunked"))
    {
      f->streaming = true;
      copy_header (out, f->client, "Content-Type");
      evhttp_send_reply_start (f->client, evhttp_request_get_response_code (out),
                               evhttp_request_get_response_code_line (out));
    }
  return 0;
}

static void
out_chunk (struct evhttp_request *out, void *arg)
{
  struct fwd *f = arg;
  struct evbuffer *in = evhttp_request_get_input_buffer (out);
  if (f->client_gone)
    evbuffer_drain (in, evbuffer_get_length (in));
  else if (f->streaming)
    evhttp_send_reply_chunk (f->client, in);
  else
    evbuffer_add_buffer (f->body, in);
}

static void
cancel_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct fwd *f = arg;
  if (!f->out_done)
    {
      /* resets the node connection: the node sees its client go away */
      evhttp_cancel_request (f->out);
      conn_release (f->g, f->node, f->conn);
    }
  else if (f->conn)
    conn_release (f->g, f->node, f->conn);
  if (f->hung_up)
    {
      /* evhttp still holds the connection (it does not read it while we
       * answer): free it, and the request with it; nobody reads an answer */
      evhttp_connection_free (f->client_conn);
      f->client_conn = NULL;
      fwd_free (f);
      return;
    }
  /* the client request is detached from its dead connection; replying frees it */
  if (f->streaming)
    evhttp_send_reply_end (f->client);
  else
    evhttp_send_reply (f->client, 499, "Client Closed Request", NULL);
  f->client_conn = NULL;
  fwd_free (f);
}

static void
client_closed (struct evhttp_connection *c WR_UNUSED, void *arg)
{
  struct fwd *f = arg;
  if (f->client_gone || f->out_done)
    return;
  f->client_gone = true;
  if (f->hangup)
    event_del (f->hangup);
  event_base_once (f->g->base, -1, EV_TIMEOUT, cancel_cb, f, &(struct timeval){ 0, 0 });
}

/* evhttp does not read a connection while it answers it, so the close
 * callback fires only when an answer is written: a client that hangs up
 * during a long buffered request (a call, a SandboxFusion run) is seen by
 * its socket's close (EPOLLRDHUP) instead, and the node request is
 * cancelled as for a closed connection. */
static void
client_hangup (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct fwd *f = arg;
  if (f->client_gone || f->out_done || f->client_conn == NULL)
    return;
  evhttp_connection_set_closecb (f->client_conn, NULL, NULL);
  f->hung_up = true;
  client_closed (f->client_conn, f);
}

void
gw_forward (struct gw *g, struct gw_node *n, struct evhttp_request *client,
            enum evhttp_cmd_type method, const char *uri, struct evbuffer *body, gw_fwd_hook hook,
            void *ud)
{
  forward (g, n, client, method, uri, body, hook, ud, false);
}

static struct fwd *
forward (struct gw *g, struct gw_node *n, struct evhttp_request *client,
         enum evhttp_cmd_type method, const char *uri, struct evbuffer *body, gw_fwd_hook hook,
         void *ud, bool fresh)
{
  struct fwd *f = calloc (1, sizeof *f);
  bool reused = false;
  struct evhttp_connection *conn = f ? conn_get (g, n, fresh, &reused) : NULL;
  if (conn == NULL)
    {
      free (f);
      if (body)
        evbuffer_free (body);
      if (hook)
        hook (g, client, 0, NULL, ud);
      else
        gw_reply_error (client, 503, "unavailable", "node %s has no usable address", n->name);
      return NULL;
    }
  *f = (struct fwd){ .g = g,
                     .node = n,
                     .client = client,
                     .conn = conn,
                     .hook = hook,
                     .ud = ud,
                     .method = method,
                     .uri = strdup (uri),
                     .reused = reused };
  f->body = evbuffer_new ();
  struct evhttp_request *out = evhttp_request_new (out_done, f);
  f->out = out;
  evhttp_request_set_header_cb (out, out_header);
  evhttp_request_set_chunked_cb (out, out_chunk);
  struct evkeyvalq *h = evhttp_request_get_output_headers (out);
  char hostport[300], auth[300];
  snprintf (hostport, sizeof hostport, "%s:%d", n->conn_host, n->conn_port);
  snprintf (auth, sizeof auth, "Bearer %s", g->node_token);
  evhttp_add_header (h, "Host", hostport);
  evhttp_add_header (h, "Authorization", auth);
  const char *ct = evhttp_find_header (evhttp_request_get_input_headers (client), "Content-Type");
  if (ct)
    evhttp_add_header (h, "Content-Type", ct);
  for (size_t i = 0; i < WR_ARRAY_SIZE (pass_headers); i++)
    copy_header_in (client, h, pass_headers[i]);
  /* an upload's owner (routes.c set_owner; a client's own is removed) */
  const char *owner
      = evhttp_find_header (evhttp_request_get_input_headers (client), "Warren-Owner");
  if (owner)
    evhttp_add_header (h, "Warren-Owner", owner);
  struct evbuffer *ob = evhttp_request_get_output_buffer (out);
  if (body)
    {
      evbuffer_add_buffer (ob, body);
      evbuffer_free (body);
    }
  else
    evbuffer_add_buffer (ob, evhttp_request_get_input_buffer (client));
  if (hook == NULL)
    {
      f->client_conn = evhttp_request_get_connection (client);
      if (f->client_conn)
        {
          evhttp_connection_set_closecb (f->client_conn, client_closed, f);
          struct bufferevent *cb = evhttp_connection_get_bufferevent (f->client_conn);
          int cfd = cb ? bufferevent_getfd (cb) : -1;
          if (cfd >= 0 && (f->hangup = event_new (g->base, cfd, EV_CLOSED, client_hangup, f)))
            event_add (f->hangup, NULL);
        }
    }
  gw_nodelay (conn);
  f->inflight_next = n->inflight;
  if (n->inflight)
    n->inflight->inflight_prev = f;
  n->inflight = f;
  char target[2048]; /* the node's advertised path first (the watch thread writes it) */
  pthread_mutex_lock (&g->mu);
  snprintf (target, sizeof target, "%s%s", n->path, uri);
  pthread_mutex_unlock (&g->mu);
  if (evhttp_make_request (conn, out, method, target) < 0)
    {
      /* libevent freed out */
      f->out_done = true;
      conn_release (g, n, conn);
      unreachable (f);
      fwd_free (f);
      return NULL;
    }
  return f;
}

void
gw_forward_resuming (struct gw *g, struct gw_node *n, struct evhttp_request *client,
                     enum evhttp_cmd_type method, const char *uri, gw_fwd_hook on_paused, void *ud,
                     void (*ud_free) (void *))
{
  struct fwd *f = forward (g, n, client, method, uri, NULL, NULL, NULL, false);
  if (f == NULL)
    {
      ud_free (ud);
      return;
    }
  f->on_paused = on_paused;
  f->paused_ud = ud;
  f->paused_free = ud_free;
}

void
gw_fail_lost (struct gw *g)
{
  pthread_mutex_lock (&g->mu);
  size_t n_nodes = g->n_nodes;
  pthread_mutex_unlock (&g->mu);
  for (size_t i = 0; i < n_nodes; i++)
    {
      struct gw_node *n = g->nodes[i];
      if (n->inflight == NULL)
        continue;
      pthread_mutex_lock (&g->mu);
      bool present = n->present;
      pthread_mutex_unlock (&g->mu);
      if (present)
        continue;
      /* each cancel finishes its request at once (out_done with NULL) and unlinks it */
      struct fwd *next;
      for (struct fwd *f = n->inflight; f; f = next)
        {
          next = f->inflight_next;
          if (f->lost || f->client_gone || f->out_done)
            continue;
          f->lost = true;
          evhttp_cancel_request (f->out);
          if (!f->out_done)
            {
              /* libevent dropped it without a callback: finish it here */
              f->out_done = true;
              event_base_once (g->base, -1, EV_TIMEOUT, conn_free_cb, f->conn,
                               &(struct timeval){ 0, 0 });
              unreachable (f);
              fwd_free (f);
            }
        }
    }
}

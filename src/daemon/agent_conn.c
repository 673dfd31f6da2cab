#include "agent_conn.h"

#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>

#include "common/proto.h"
#include "common/util.h"

#include <errno.h>
#include <unistd.h>

struct pending
{
  uint32_t stream;
  struct agent_ops ops;
  void *ud;
  size_t data, max_data; /* bytes delivered to on_data so far, and allowed */
  /* agent_cancel'ed: its callbacks are gone, but the agent still runs it
   * until its EXIT/RESULT/ERROR, and a shed connection would orphan it
   * (close its stdin): the connection is not idle until then */
  bool cancelled;
  struct event *idle; /* agent_set_idle_timeout: fires when the agent is silent */
  unsigned idle_ms;
  struct agent_conn *conn;
  struct pending *next;
};

struct agent_conn
{
  struct bufferevent *bev; /* NULL while shed */
  agent_lost_cb lost;
  void *ud;
  uint32_t next_stream;
  bool ready;
  bool heard; /* any frame yet (a boot's HELLO, a restored clone's PONG) */
  bool dead;
  bool shed;                    /* closed while idle; reopened by reconnect on the next request */
  unsigned holds;               /* agent_conn_hold */
  struct pending *pending;      /* few concurrent requests per sandbox: a list is enough */
  agent_reconnect_cb reconnect; /* NULL: never shed */
  agent_probe_cb probe;
  /* in the open list (most recently used first) or, while shed, the shed list */
  struct agent_conn *prev, *next;
};

/* The node's agent connections (docs/operations.md, "Limits"): the open
 * ones in LRU order, the shed ones for the death sweep, the budget. */
#define SWEEP_S 2               /* a shed agent's death is noticed within this */
#define SWEEP_THOROUGH_EVERY 64 /* one shed agent in this many is probed thoroughly a sweep */
static struct
{
  struct event_base *base;
  struct agent_conn *open_head, *open_tail, *shed_head;
  size_t n_open, n_shed;
  unsigned budget; /* open connections kept; 0: no limit */
  unsigned depth;  /* inside a connection's callbacks: shedding waits for the loop */
  unsigned sweep_round;
  uint64_t sheds, reconnects;
  struct event *enforce_ev, *sweep_ev;
} g;

static void
list_unlink (struct agent_conn *c)
{
  struct agent_conn **head = c->shed ? &g.shed_head : &g.open_head;
  if (c->prev)
    c->prev->next = c->next;
  else if (*head == c)
    *head = c->next;
  else
    return; /* in no list */
  if (c->next)
    c->next->prev = c->prev;
  else if (!c->shed)
    g.open_tail = c->prev;
  if (c->shed)
    g.n_shed--;
  else
    g.n_open--;
  c->prev = c->next = NULL;
}

static void
list_push (struct agent_conn *c)
{
  struct agent_conn **head = c->shed ? &g.shed_head : &g.open_head;
  c->prev = NULL;
  c->next = *head;
  if (*head)
    (*head)->prev = c;
  else if (!c->shed)
    g.open_tail = c;
  *head = c;
  if (c->shed)
    g.n_shed++;
  else
    g.n_open++;
}

static struct pending *
find_pending (struct agent_conn *c, uint32_t stream, struct pending ***ret_link)
{
  for (struct pending **l = &c->pending; *l; l = &(*l)->next)
    if ((*l)->stream == stream)
      {
        if (ret_link)
          *ret_link = l;
        return *l;
      }
  return NULL;
}

static void
pending_free (struct pending *p)
{
  if (p && p->idle)
    event_free (p->idle);
  free (p);
}

static struct pending *
unlink_pending (struct agent_conn *c, uint32_t stream)
{
  struct pending **link;
  struct pending *p = find_pending (c, stream, &link);
  if (p)
    *link = p->next;
  return p;
}

static void
fail_all (struct agent_conn *c, const char *msg)
{
  struct pending *p;
  while ((p = c->pending) != NULL)
    {
      c->pending = p->next;
      if (!p->cancelled && p->ops.on_error)
        p->ops.on_error (p->ud, "gone", msg);
      pending_free (p);
    }
}

static void
conn_lost (struct agent_conn *c, const char *msg)
{
  if (c->dead)
    return;
  list_unlink (c);
  c->dead = true;
  if (c->bev)
    bufferevent_disable (c->bev, EV_READ | EV_WRITE);
  fail_all (c, msg);
  if (c->lost)
    c->lost (c->ud);
}

/* The agent is not trusted (a VM guest is root and owns it): nothing it
 * sends may grow the daemon's memory beyond a bound. */
static void
dispatch (struct agent_conn *c, const struct wr_frame *f)
{
  c->heard = true;
  if (f->stream == 0)
    {
      if (f->type == WR_MSG_HELLO)
        c->ready = true;
      /* An agent that pings without reading its PONGs would queue them
       * here without end: answer only while the queue is short. */
      else if (f->type == WR_MSG_PING && agent_outq (c) < WRD_AGENT_PONG_QUEUE)
        agent_send (c, 0, WR_MSG_PONG, f->payload, f->len);
      return;
    }
  struct pending *p = find_pending (c, f->stream, NULL);
  if (p == NULL)
    return; /* unknown stream: drop */
  if (p->cancelled)
    {
      /* its frames are dropped; its end makes the connection idle again */
      if (f->type == WR_MSG_EXIT || f->type == WR_MSG_RESULT || f->type == WR_MSG_ERROR)
        pending_free (unlink_pending (c, f->stream));
      return;
    }
  if (p->idle)
    {
      struct timeval tv = { p->idle_ms / 1000, (p->idle_ms % 1000) * 1000 };
      evtimer_add (p->idle, &tv); /* it spoke: the silence starts again */
    }
  switch (f->type)
    {
    case WR_MSG_STDOUT:
    case WR_MSG_STDERR:
    case WR_MSG_DATA:
      {
        if (f->len > p->max_data - p->data)
          {
            conn_lost (c, "the sandbox agent sent more data than requested");
            return;
          }
        p->data += f->len;
        if (p->ops.on_data)
          p->ops.on_data (p->ud, f->type, f->payload, f->len);
        return;
      }
    case WR_MSG_EXIT:
    case WR_MSG_RESULT:
    case WR_MSG_ERROR:
      break;
    default:
      return;
    }
  json_error_t jerr;
  json_t *j = json_loadb ((const char *)f->payload, f->len, 0, &jerr);
  if (!json_is_object (j))
    {
      /* the request's end is garbage: the agent is broken or hostile */
      json_decref (j);
      conn_lost (c, "malformed reply from the sandbox agent");
      return;
    }
  p = unlink_pending (c, f->stream);
  if (f->type == WR_MSG_ERROR)
    {
      const char *code = json_string_value (json_object_get (j, "code"));
      const char *msg = json_string_value (json_object_get (j, "message"));
      /* codes travel to HTTP clients: only well-formed ones */
      if (code == NULL || strlen (code) > 32
          || strspn (code, "abcdefghijklmnopqrstuvwxyz_") != strlen (code))
        code = "internal";
      if (p->ops.on_error)
        p->ops.on_error (p->ud, code, msg ? msg : "error from the sandbox agent");
    }
  else if (p->ops.on_done)
    p->ops.on_done (p->ud, j);
  json_decref (j);
  pending_free (p);
}

static void read_frames (struct agent_conn *c, struct evbuffer *in);
static void enforce_soon (void);

static void
read_cb (struct bufferevent *bev, void *arg)
{
  struct agent_conn *c = arg;
  g.depth++;
  read_frames (c, bufferevent_get_input (bev));
  g.depth--;
  if (g.budget && g.n_open > g.budget)
    enforce_soon (); /* a request may have ended: its connection may go now */
}

static void
read_frames (struct agent_conn *c, struct evbuffer *in)
{
  for (;;)
    {
      uint8_t hdr[WR_FRAME_HDR];
      if (evbuffer_copyout (in, hdr, sizeof hdr) < (ev_ssize_t)sizeof hdr)
        return;
      struct wr_frame f;
      uint32_t len = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16
                     | (uint32_t)hdr[3] << 24;
      if (len > WR_FRAME_MAX)
        {
          conn_lost (c, "protocol error from the sandbox agent");
          return;
        }
      if (evbuffer_get_length (in) < WR_FRAME_HDR + (size_t)len)
        return;
      uint8_t *buf = evbuffer_pullup (in, WR_FRAME_HDR + len);
      int n = wr_frame_parse (buf, WR_FRAME_HDR + len, &f);
      if (n <= 0)
        {
          conn_lost (c, "protocol error from the sandbox agent");
          return;
        }
      dispatch (c, &f);
      if (c->dead)
        return;
      evbuffer_drain (in, (size_t)n);
    }
}

static void
event_cb (struct bufferevent *bev, short what, void *arg)
{
  struct agent_conn *c = arg;
  g.depth++;
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
    conn_lost (c, "the sandbox agent is gone");
  g.depth--;
}

static int
conn_attach (struct agent_conn *c, int fd)
{
  c->bev = bufferevent_socket_new (g.base, fd, BEV_OPT_CLOSE_ON_FREE);
  if (c->bev == NULL)
    return -ENOMEM;
  /* read_cb consumes every whole frame, so at most one frame waits here */
  bufferevent_setwatermark (c->bev, EV_READ, 0, WR_FRAME_HDR + WR_FRAME_MAX);
  bufferevent_setcb (c->bev, read_cb, NULL, event_cb, c);
  bufferevent_enable (c->bev, c->holds ? EV_WRITE : EV_READ | EV_WRITE);
  return 0;
}

struct agent_conn *
agent_conn_new (struct event_base *base, int fd, agent_lost_cb lost, void *ud)
{
  struct agent_conn *c = calloc (1, sizeof *c);
  if (c == NULL)
    return NULL;
  g.base = base;
  if (conn_attach (c, fd) < 0)
    {
      free (c);
      return NULL;
    }
  c->lost = lost;
  c->ud = ud;
  c->next_stream = 1;
  list_push (c);
  return c;
}

void
agent_conn_free (struct agent_conn *c)
{
  if (c == NULL)
    return;
  list_unlink (c);
  c->lost = NULL;
  c->dead = true;
  fail_all (c, "the sandbox was destroyed");
  if (c->bev)
    bufferevent_free (c->bev);
  free (c);
}

/* ---- shedding idle connections (docs/operations.md, "Limits") ---- */

static bool
conn_idle (struct agent_conn *c)
{
  return c->reconnect && !c->dead && !c->shed && c->pending == NULL && c->holds == 0
         && evbuffer_get_length (bufferevent_get_output (c->bev)) == 0;
}

static void
conn_shed (struct agent_conn *c)
{
  list_unlink (c);
  /* closed now, not when libevent's finalizers run the loop: a restarted
   * daemon sheds while adopting, before its loop runs */
  evutil_socket_t fd = bufferevent_getfd (c->bev);
  bufferevent_setfd (c->bev, -1);
  if (fd >= 0)
    close (fd); /* the agent forgets this connection */
  bufferevent_free (c->bev);
  c->bev = NULL;
  c->ready = false;
  c->shed = true;
  list_push (c);
  g.sheds++;
}

/* Close idle connections, least recently used first, until the open ones
 * fit the budget again (or none left is idle). */
static void
enforce (void)
{
  for (struct agent_conn *c = g.open_tail, *prev; c && g.n_open > g.budget; c = prev)
    {
      prev = c->prev;
      if (conn_idle (c))
        conn_shed (c);
    }
}

static void
enforce_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  if (g.budget)
    enforce ();
}

/* From the loop, never under a caller's feet: inside a connection's
 * callbacks that very connection may look idle (its request just ended),
 * and a connection reopened for a request has not sent it yet. */
static void
enforce_soon (void)
{
  if (g.enforce_ev == NULL && (g.enforce_ev = event_new (g.base, -1, 0, enforce_cb, NULL)) == NULL)
    return;
  event_active (g.enforce_ev, EV_TIMEOUT, 0);
}

/* A shed connection has no socket whose EOF tells of its agent's death:
 * every SWEEP_S the owner's probe looks at each shed agent (a cheap one,
 * and a thorough one for a rotating share). See docs/operations.md for
 * why a sweep rather than a per-sandbox descriptor or an event. */
static void
sweep_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  /* and whatever became idle without a frame to read (a hold released, a
   * queue drained) goes now */
  if (g.budget && g.n_open > g.budget)
    enforce ();
  unsigned i = g.sweep_round++;
  for (struct agent_conn *c = g.shed_head, *next; c; c = next, i++)
    {
      next = c->next;
      if (c->probe && c->probe (c->ud, i % SWEEP_THOROUGH_EVERY == 0) == 0)
        conn_lost (c, "the sandbox agent is gone");
    }
}

static void
sweep_arm (void)
{
  if (g.sweep_ev)
    return;
  g.sweep_ev = event_new (g.base, -1, EV_PERSIST, sweep_cb, NULL);
  struct timeval tv = { SWEEP_S, 0 };
  if (g.sweep_ev)
    event_add (g.sweep_ev, &tv);
}

void
agent_conn_reconnectable (struct agent_conn *c, agent_reconnect_cb reconnect, agent_probe_cb probe)
{
  if (c == NULL)
    return;
  c->reconnect = reconnect;
  c->probe = probe;
  sweep_arm ();
  /* now when we can: a restarted daemon adopts every sandbox before its
   * loop runs, and must not hold a socket for each meanwhile */
  if (g.budget && g.n_open > g.budget)
    {
      if (g.depth == 0)
        enforce ();
      else
        enforce_soon ();
    }
}

/* The next request on a shed connection opens it again: a new socket to
 * the agent's listener, which replaces the connection it had (it has none). */
static int
conn_reopen (struct agent_conn *c)
{
  if (c->dead)
    return -EPIPE;
  if (!c->shed)
    return 0;
  int fd = c->reconnect (c->ud);
  if (fd < 0)
    {
      /* refused: gone, unless the probe finds the agent alive (a full
       * backlog of a frozen agent), then only this request fails */
      if (c->probe == NULL || c->probe (c->ud, true) == 0)
        conn_lost (c, "the sandbox agent is gone");
      return fd;
    }
  list_unlink (c);
  c->shed = false;
  if (conn_attach (c, fd) < 0)
    {
      close (fd);
      c->shed = true;
      list_push (c);
      return -ENOMEM;
    }
  list_push (c);
  g.reconnects++;
  if (g.budget && g.n_open > g.budget)
    enforce_soon ();
  return 0;
}

/* most recently used first */
static void
conn_touch (struct agent_conn *c)
{
  if (c->prev == NULL)
    return;
  list_unlink (c);
  list_push (c);
}

void
agent_conns_set_budget (unsigned budget)
{
  g.budget = budget;
  if (budget && g.base && g.n_open > budget && g.depth == 0)
    enforce ();
}

void
agent_conns_stats (struct agent_conns_stats *ret)
{
  ret->budget = g.budget;
  ret->open = g.n_open;
  ret->shed = g.n_shed;
  ret->sheds = g.sheds;
  ret->reconnects = g.reconnects;
}

bool
agent_conn_alive (struct agent_conn *c)
{
  return c && !c->dead;
}

bool
agent_conn_heard (struct agent_conn *c)
{
  return c && c->heard;
}

void
agent_conn_fail (struct agent_conn *c, const char *msg)
{
  if (c)
    conn_lost (c, msg);
}

bool
agent_conn_ready (struct agent_conn *c)
{
  return c && c->ready;
}

int
agent_send (struct agent_conn *c, uint32_t stream, uint8_t type, const void *data, size_t len)
{
  int r = conn_reopen (c);
  if (r < 0)
    return r;
  struct evbuffer *out = bufferevent_get_output (c->bev);
  const uint8_t *p = data;
  do
    {
      uint32_t n = len > WR_FRAME_MAX ? WR_FRAME_MAX : (uint32_t)len;
      uint8_t hdr[WR_FRAME_HDR];
      wr_frame_hdr_encode (hdr, n, stream, type);
      if (evbuffer_add (out, hdr, sizeof hdr) < 0 || (n && evbuffer_add (out, p, n) < 0))
        return -ENOMEM;
      p += n;
      len -= n;
    }
  while (len > 0);
  return 0;
}

/* What an honest agent may send for a request: an exec's caps (the agent
 * forwards exactly up to them; 1 MiB each when absent, docs/protocol.md), a
 * read's max_bytes. */
static size_t
request_data_limit (uint8_t type, json_t *body)
{
  if (type == WR_MSG_EXEC)
    {
      size_t sum = 0;
      static const char *const caps[] = { "stdout_cap", "stderr_cap" };
      for (int i = 0; i < 2; i++)
        {
          json_t *v = json_object_get (body, caps[i]);
          json_int_t n = v ? json_integer_value (v) : 1 << 20;
          if (n < 0 || (uint64_t)n > SIZE_MAX - sum)
            return SIZE_MAX;
          sum += (size_t)n;
        }
      return sum;
    }
  json_int_t max = json_integer_value (json_object_get (body, "max_bytes"));
  return max > 0 && (uint64_t)max < WRD_AGENT_DATA_MAX ? (size_t)max : WRD_AGENT_DATA_MAX;
}

uint32_t
agent_request (struct agent_conn *c, uint8_t type, json_t *body, const struct agent_ops *ops,
               void *ud)
{
  if (c == NULL || conn_reopen (c) < 0)
    return 0;
  conn_touch (c);
  _cleanup_free_ char *text = json_dumps (body, JSON_COMPACT);
  if (text == NULL)
    return 0;
  struct pending *p = calloc (1, sizeof *p);
  if (p == NULL)
    return 0;
  p->stream = c->next_stream++;
  if (c->next_stream == 0)
    c->next_stream = 1;
  p->ops = *ops;
  p->ud = ud;
  p->max_data = request_data_limit (type, body);
  if (agent_send (c, p->stream, type, text, strlen (text)) < 0)
    {
      free (p);
      return 0;
    }
  p->next = c->pending;
  c->pending = p;
  return p->stream;
}

void
agent_set_data_limit (struct agent_conn *c, uint32_t stream, size_t max)
{
  struct pending *p = c ? find_pending (c, stream, NULL) : NULL;
  if (p)
    p->max_data = max;
}

static void
idle_fired (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct pending *p = arg;
  struct agent_ops ops = p->ops;
  char msg[128];
  snprintf (msg, sizeof msg, "the sandbox agent sent nothing on this request for %u s",
            p->idle_ms / 1000);
  agent_cancel (p->conn, p->stream); /* kept until the agent ends it */
  if (ops.on_error)
    ops.on_error (p->ud, "timeout", msg);
}

void
agent_set_idle_timeout (struct agent_conn *c, uint32_t stream, unsigned ms)
{
  struct pending *p = c ? find_pending (c, stream, NULL) : NULL;
  if (p == NULL || p->cancelled || g.base == NULL)
    return;
  if (p->idle == NULL && (p->idle = evtimer_new (g.base, idle_fired, p)) == NULL)
    return;
  p->idle_ms = ms;
  p->conn = c;
  struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };
  evtimer_add (p->idle, &tv);
}

void
agent_cancel (struct agent_conn *c, uint32_t stream)
{
  struct pending *p = c ? find_pending (c, stream, NULL) : NULL;
  if (p == NULL)
    return;
  p->cancelled = true;
  memset (&p->ops, 0, sizeof p->ops);
  if (p->idle)
    evtimer_del (p->idle);
  p->max_data = SIZE_MAX;
}

void
agent_conn_hold (struct agent_conn *c, bool hold)
{
  if (c == NULL)
    return;
  if (hold && c->holds++ == 0 && c->bev)
    bufferevent_disable (c->bev, EV_READ);
  else if (!hold && c->holds && --c->holds == 0 && !c->dead && c->bev)
    bufferevent_enable (c->bev, EV_READ);
}

size_t
agent_outq (struct agent_conn *c)
{
  return c->bev ? evbuffer_get_length (bufferevent_get_output (c->bev)) : 0;
}

#include "agent_conn.h"

#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>

#include "common/proto.h"
#include "common/util.h"

struct pending
{
  uint32_t stream;
  struct agent_ops ops;
  void *ud;
  size_t data, max_data; /* bytes delivered to on_data so far, and allowed */
  struct pending *next;
};

struct agent_conn
{
  struct bufferevent *bev;
  agent_lost_cb lost;
  void *ud;
  uint32_t next_stream;
  bool ready;
  bool dead;
  unsigned holds;          /* agent_conn_hold */
  struct pending *pending; /* few concurrent requests per sandbox: a list is enough */
};

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
      if (p->ops.on_error)
        p->ops.on_error (p->ud, "gone", msg);
      free (p);
    }
}

static void
conn_lost (struct agent_conn *c, const char *msg)
{
  if (c->dead)
    return;
  c->dead = true;
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
    return; /* cancelled request: drop */
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
  free (p);
}

static void
read_cb (struct bufferevent *bev, void *arg)
{
  struct agent_conn *c = arg;
  struct evbuffer *in = bufferevent_get_input (bev);
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
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
    conn_lost (c, "the sandbox agent is gone");
}

struct agent_conn *
agent_conn_new (struct event_base *base, int fd, agent_lost_cb lost, void *ud)
{
  struct agent_conn *c = calloc (1, sizeof *c);
  if (c == NULL)
    return NULL;
  c->bev = bufferevent_socket_new (base, fd, BEV_OPT_CLOSE_ON_FREE);
  if (c->bev == NULL)
    {
      free (c);
      return NULL;
    }
  c->lost = lost;
  c->ud = ud;
  c->next_stream = 1;
  /* read_cb consumes every whole frame, so at most one frame waits here */
  bufferevent_setwatermark (c->bev, EV_READ, 0, WR_FRAME_HDR + WR_FRAME_MAX);
  bufferevent_setcb (c->bev, read_cb, NULL, event_cb, c);
  bufferevent_enable (c->bev, EV_READ | EV_WRITE);
  return c;
}

void
agent_conn_free (struct agent_conn *c)
{
  if (c == NULL)
    return;
  c->lost = NULL;
  c->dead = true;
  fail_all (c, "the sandbox was destroyed");
  bufferevent_free (c->bev);
  free (c);
}

bool
agent_conn_alive (struct agent_conn *c)
{
  return c && !c->dead;
}

bool
agent_conn_ready (struct agent_conn *c)
{
  return c && c->ready;
}

int
agent_send (struct agent_conn *c, uint32_t stream, uint8_t type, const void *data, size_t len)
{
  if (c->dead)
    return -EPIPE;
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
  if (c == NULL || c->dead)
    return 0;
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

void
agent_cancel (struct agent_conn *c, uint32_t stream)
{
  if (c == NULL)
    return;
  free (unlink_pending (c, stream));
}

void
agent_conn_hold (struct agent_conn *c, bool hold)
{
  if (c == NULL)
    return;
  if (hold && c->holds++ == 0)
    bufferevent_disable (c->bev, EV_READ);
  else if (!hold && c->holds && --c->holds == 0 && !c->dead)
    bufferevent_enable (c->bev, EV_READ);
}

size_t
agent_outq (struct agent_conn *c)
{
  return evbuffer_get_length (bufferevent_get_output (c->bev));
}

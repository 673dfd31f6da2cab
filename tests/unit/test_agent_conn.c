/* The daemon's side of the agent protocol (src/daemon/agent_conn.c) against
 * a hostile agent: a forked child writes frames into a socketpair, the test
 * runs the daemon's event loop on the other end. The agent is not trusted
 * (a VM guest is root and owns it): PING floods, output beyond what was
 * asked for and garbage must leave the daemon's memory bounded, and anything
 * that breaks the protocol closes the connection (the sandbox is lost,
 * nothing else). */
#include "daemon/agent_conn.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <event2/event.h>
#include <event2/util.h>

#include "common/proto.h"
#include "tap.h"

struct req
{
  bool done, failed;
  size_t data;
  char code[64];
};

static void
on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  (void)type;
  (void)data;
  ((struct req *)ud)->data += len;
}

static void
on_done (void *ud, json_t *res)
{
  (void)res;
  ((struct req *)ud)->done = true;
}

static void
on_error (void *ud, const char *code, const char *msg)
{
  (void)msg;
  struct req *r = ud;
  r->failed = true;
  snprintf (r->code, sizeof r->code, "%s", code);
}

static void
on_lost (void *ud)
{
  *(bool *)ud = true;
}

static const struct agent_ops ops = { on_data, on_done, on_error };

/* A fake agent: the child runs fn on its end of the socketpair, never reads
 * from it, and exits when the parent closes the pipe. */
struct peer
{
  pid_t pid;
  int hold; /* parent's end of the pipe keeping the child alive */
};

static void
frame (int fd, uint32_t stream, uint8_t type, const void *p, uint32_t len)
{
  if (wr_frame_write (fd, stream, type, p, len) < 0)
    _exit (0); /* the daemon closed the connection: expected in some tests */
}

static struct peer
peer_start (int fd_child, int fd_parent, void (*fn) (int fd))
{
  int pp[2];
  if (pipe (pp) < 0)
    abort ();
  struct peer p = { fork (), pp[1] };
  if (p.pid == 0)
    {
      close (fd_parent);
      close (pp[1]);
      signal (SIGPIPE, SIG_IGN);
      frame (fd_child, 0, WR_MSG_HELLO, "{\"version\":1}", 13);
      fn (fd_child);
      char c;
      while (read (pp[0], &c, 1) < 0)
        ;
      _exit (0);
    }
  close (pp[0]);
  close (fd_child);
  return p;
}

static void
peer_stop (struct peer *p)
{
  close (p->hold);
  kill (p->pid, SIGKILL);
  waitpid (p->pid, NULL, 0);
}

static void
give_up (evutil_socket_t fd, short what, void *arg)
{
  (void)fd;
  (void)what;
  *(bool *)arg = true;
}

/* Run the loop until *a or *b, or 60 s. */
static void
run_until (struct event_base *base, bool *a, bool *b)
{
  bool late = false;
  struct event *t = evtimer_new (base, give_up, &late);
  struct timeval tv = { 60, 0 };
  evtimer_add (t, &tv);
  while (!*a && !*b && !late)
    event_base_loop (base, EVLOOP_ONCE);
  event_free (t);
}

struct rig
{
  struct event_base *base;
  struct agent_conn *c;
  struct peer peer;
  bool lost;
  struct req r;
  uint32_t sid;
};

static void
rig_start (struct rig *g, void (*fn) (int fd))
{
  memset (g, 0, sizeof *g);
  int sv[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    abort ();
  g->base = event_base_new ();
  evutil_make_socket_nonblocking (sv[0]);
  g->c = agent_conn_new (g->base, sv[0], on_lost, &g->lost);
  json_t *body = json_pack ("{s:[s]}", "cmd", "true");
  g->sid = agent_request (g->c, WR_MSG_EXEC, body, &ops, &g->r);
  json_decref (body);
  g->peer = peer_start (sv[1], sv[0], fn);
}

static void
rig_stop (struct rig *g)
{
  peer_stop (&g->peer);
  agent_conn_free (g->c);
  event_base_free (g->base);
}

/* 20000 PINGs of 4 KiB (80 MiB of PONGs) while never reading, then EXIT. */
static void
ping_flood (int fd)
{
  static char pay[4096];
  for (int i = 0; i < 20000; i++)
    frame (fd, 0, WR_MSG_PING, pay, sizeof pay);
  frame (fd, 1, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
}

static void
test_ping_flood (void)
{
  struct rig g;
  rig_start (&g, ping_flood);
  run_until (g.base, &g.r.done, &g.lost);
  size_t q = agent_conn_alive (g.c) ? agent_outq (g.c) : 0;
  TAP_OK (g.r.done && !g.lost, "a PING flood is survived (the request still completes)");
  TAP_LE_INT (q, WRD_AGENT_PONG_QUEUE + WR_FRAME_HDR + 4096 + 256,
              "PONGs queued for an agent that does not read stay bounded (%zu bytes)", q);
  rig_stop (&g);
}

/* 2 MiB of STDOUT for a request allowed 1 MiB. */
static void
too_much_output (int fd)
{
  static char pay[64 << 10];
  for (int i = 0; i < 32; i++)
    frame (fd, 1, WR_MSG_STDOUT, pay, sizeof pay);
  frame (fd, 1, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
}

static void
test_output_over_limit (void)
{
  struct rig g;
  rig_start (&g, too_much_output);
  agent_set_data_limit (g.c, g.sid, 1 << 20);
  run_until (g.base, &g.r.failed, &g.r.done);
  TAP_OK (g.r.failed && TAP_C_EQ_STR (g.r.code, "gone") && !g.r.done,
          "output beyond the request's limit fails the request");
  TAP_LE_INT (g.r.data, (1u << 20), "no more than the limit was delivered (%zu bytes)", g.r.data);
  TAP_OK (g.lost && !agent_conn_alive (g.c), "and closes the agent's connection");
  rig_stop (&g);
}

/* 3 MiB of STDOUT for an EXEC that asked for the default caps (1 MiB each). */
static void
over_default_caps (int fd)
{
  static char pay[64 << 10];
  for (int i = 0; i < 48; i++)
    frame (fd, 1, WR_MSG_STDOUT, pay, sizeof pay);
  frame (fd, 1, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
}

static void
test_output_default_limit (void)
{
  struct rig g;
  rig_start (&g, over_default_caps);
  run_until (g.base, &g.r.failed, &g.r.done);
  TAP_OK (g.r.failed && g.lost && TAP_C_LE (g.r.data, (2u << 20)),
          "an EXEC is cut at its own caps (1 MiB + 1 MiB by default; %zu bytes delivered)",
          g.r.data);
  rig_stop (&g);
}

static void
bad_header (int fd)
{
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, WR_FRAME_MAX + 1, 1, WR_MSG_STDOUT);
  if (write (fd, hdr, sizeof hdr) < 0)
    _exit (0);
}

static void
bad_type (int fd)
{
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, 0, 1, WR_MSG_STDOUT);
  hdr[8] = 200;
  if (write (fd, hdr, sizeof hdr) < 0)
    _exit (0);
}

static void
garbage_exit (int fd)
{
  /* frames for streams nobody asked for are dropped, not fatal */
  frame (fd, 77, WR_MSG_STDOUT, "x", 1);
  frame (fd, 0, WR_MSG_STDOUT, "x", 1);
  frame (fd, 1, WR_MSG_EXIT, "\x01not json", 9);
}

static void
garbage_error_code (int fd)
{
  const char *e = "{\"code\":\"<script>\",\"message\":\"m\"}";
  frame (fd, 1, WR_MSG_ERROR, e, (uint32_t)strlen (e));
}

static void
test_garbage (void)
{
  struct
  {
    void (*fn) (int);
    const char *what;
  } cases[] = {
    { bad_header, "a frame longer than WR_FRAME_MAX" },
    { bad_type, "a frame of an unknown type" },
    { garbage_exit, "an EXIT that is not a JSON object" },
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    {
      struct rig g;
      rig_start (&g, cases[i].fn);
      run_until (g.base, &g.lost, &g.r.done);
      TAP_OK (g.lost && g.r.failed && !g.r.done && !agent_conn_alive (g.c),
              "%s closes the connection and fails the request", cases[i].what);
      rig_stop (&g);
    }
  struct rig g;
  rig_start (&g, garbage_error_code);
  run_until (g.base, &g.r.failed, &g.lost);
  TAP_OK (g.r.failed && TAP_C_EQ_STR (g.r.code, "internal"),
          "an ERROR with a malformed code reaches the request as \"internal\" (got %s)", g.r.code);
  rig_stop (&g);
}

/* Shedding (docs/operations.md "Limits"): with a budget of one open
 * connection, the least recently used idle one is closed and reopened by
 * the next request; a cancelled request keeps its connection open until
 * the agent ends it; a shed agent's death is found by the probe. The test
 * plays the agents on the other ends of socketpairs. */
struct shed_agent
{
  int peer;   /* the agent's end of the current connection */
  bool alive; /* what the probe answers */
  bool lost;
  unsigned reconnects;
};

static int
shed_reconnect (void *ud)
{
  struct shed_agent *a = ud;
  int sv[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) < 0)
    return -1;
  if (a->peer >= 0)
    close (a->peer);
  a->peer = sv[1];
  a->reconnects++;
  return sv[0];
}

static int
shed_probe (void *ud, bool thorough)
{
  (void)thorough;
  return ((struct shed_agent *)ud)->alive;
}

static void
shed_lost (void *ud)
{
  ((struct shed_agent *)ud)->lost = true;
}

/* the connection's agent end saw EOF: the daemon closed it */
static bool
peer_closed (int fd)
{
  char buf[4096];
  ssize_t n;
  while ((n = read (fd, buf, sizeof buf)) > 0)
    ;
  return n == 0;
}

static void
test_shedding (void)
{
  struct event_base *base = event_base_new ();
  struct shed_agent a[2] = { { .peer = -1, .alive = true }, { .peer = -1, .alive = true } };
  struct agent_conn *c[2];
  agent_conns_set_budget (1);
  for (int i = 0; i < 2; i++)
    {
      int fd = shed_reconnect (&a[i]);
      a[i].reconnects = 0;
      c[i] = agent_conn_new (base, fd, shed_lost, &a[i]);
      agent_conn_reconnectable (c[i], shed_reconnect, shed_probe);
    }
  struct agent_conns_stats st;
  agent_conns_stats (&st);
  TAP_OK (st.open == 1 && st.shed == 1, "over the budget the older idle connection is shed");
  TAP_OK (peer_closed (a[0].peer) && agent_conn_alive (c[0]), "its socket is closed, it lives");

  /* a request reopens it; its end lets the other (now older) one go */
  struct req r = { 0 };
  json_t *body = json_pack ("{s:[s]}", "cmd", "true");
  uint32_t sid = agent_request (c[0], WR_MSG_EXEC, body, &ops, &r);
  TAP_OK (sid > 0 && a[0].reconnects == 1, "the next request reconnects");
  wr_frame_write (a[0].peer, sid, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
  bool never = false;
  run_until (base, &r.done, &never);
  event_base_loop (base, EVLOOP_NONBLOCK); /* the deferred shedding */
  TAP_OK (r.done && peer_closed (a[1].peer), "answered; the least recently used went");

  /* a cancelled request still runs in the agent: not idle until its end */
  struct req r1 = { 0 };
  uint32_t sid1 = agent_request (c[1], WR_MSG_EXEC, body, &ops, &r1);
  agent_cancel (c[1], sid1);
  event_base_loop (base, EVLOOP_NONBLOCK);
  agent_conns_stats (&st);
  TAP_OK (sid1 > 0 && peer_closed (a[0].peer) && !peer_closed (a[1].peer),
          "a cancelled request keeps its connection; the idle one goes");
  wr_frame_write (a[1].peer, sid1, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
  event_base_loop (base, EVLOOP_NONBLOCK);
  TAP_OK (!r1.done && !r1.failed, "its end calls nothing");
  json_decref (body);

  /* the shed agent dies: the sweep finds it without a socket */
  a[0].alive = false;
  run_until (base, &a[0].lost, &never);
  TAP_OK (a[0].lost && !agent_conn_alive (c[0]) && !a[1].lost, "a shed agent's death is found");
  for (int i = 0; i < 2; i++)
    {
      agent_conn_free (c[i]);
      close (a[i].peer);
    }
  agent_conns_set_budget (0);
  /* the base stays: the sweep's timer was armed on it */
}

/* says nothing on its request */
static void
silent (int fd)
{
  (void)fd;
}

/* 30 DATA frames 100 ms apart (3 s in all), then the end */
static void
trickle (int fd)
{
  for (int i = 0; i < 30; i++)
    {
      usleep (100 * 1000);
      frame (fd, 1, WR_MSG_STDOUT, "x", 1);
    }
  frame (fd, 1, WR_MSG_EXIT, "{\"exit_code\":0}", 15);
}

static void
test_idle_timeout (void)
{
  struct rig g;
  rig_start (&g, silent);
  agent_set_idle_timeout (g.c, g.sid, 300);
  run_until (g.base, &g.r.failed, &g.r.done);
  TAP_OK (g.r.failed && TAP_C_EQ_STR (g.r.code, "timeout") && !g.r.done,
          "a request its agent never answers fails with \"timeout\"");
  TAP_OK (!g.lost && agent_conn_alive (g.c), "the connection stays (the request is cancelled)");
  rig_stop (&g);

  /* each frame starts the silence again: 3 s of output 100 ms apart under
   * a 2 s idle timeout completes */
  rig_start (&g, trickle);
  agent_set_idle_timeout (g.c, g.sid, 2000);
  run_until (g.base, &g.r.failed, &g.r.done);
  TAP_OK (g.r.done && !g.r.failed && g.r.data == 30,
          "a request whose agent keeps talking is not timed out (%zu bytes)", g.r.data);
  rig_stop (&g);
}

int
main (void)
{
  signal (SIGPIPE, SIG_IGN);
  test_ping_flood ();
  test_output_over_limit ();
  test_output_default_limit ();
  test_garbage ();
  test_shedding ();
  test_idle_timeout ();
  return TAP_DONE ();
}

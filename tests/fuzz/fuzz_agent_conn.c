/* The daemon's agent connection reader (src/daemon/agent_conn.c): bytes
 * from a hostile agent (a VM guest owns its agent) arrive on a socket while
 * three requests are pending; callbacks re-enter the connection the way the
 * daemon's handlers do (cancel from on_data, a new request from on_done). */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/proto.h"
#include "daemon/agent_conn.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

struct req
{
  struct agent_conn *c;
  uint32_t stream;
  bool finished;
  size_t bytes;
};

static void on_data (void *ud, uint8_t type, const uint8_t *p, size_t len);
static void on_done (void *ud, json_t *result);
static void on_error (void *ud, const char *code, const char *message);
static const struct agent_ops ops
    = { .on_data = on_data, .on_done = on_done, .on_error = on_error };

static void
on_data (void *ud, uint8_t type, const uint8_t *p, size_t len)
{
  struct req *r = ud;
  if (len && p[0] == 0)
    memset ((uint8_t *)p, 0xaa, len); /* callers may scribble on what they get */
  r->bytes += len;
  if (r->bytes > 4096 && !r->finished) /* over its cap: the handler gives up */
    {
      agent_cancel (r->c, r->stream);
      r->finished = true;
    }
}

static void
on_done (void *ud, json_t *result)
{
  struct req *r = ud;
  r->finished = true;
  char *s = json_dumps (result, JSON_COMPACT);
  free (s);
  if (json_object_get (result, "again"))
    {
      json_t *body = json_pack ("{s:s}", "op", "stat");
      r->finished = false;
      r->stream = agent_request (r->c, WR_MSG_FILE, body, &ops, r);
      r->finished = r->stream == 0;
      json_decref (body);
    }
}

static void
on_error (void *ud, const char *code, const char *message)
{
  struct req *r = ud;
  if (code == NULL || message == NULL)
    abort ();
  (void)strlen (code);
  (void)strlen (message);
  r->finished = true;
}

static void
lost (void *ud)
{
  *(bool *)ud = true;
}

static void
drain (int fd)
{
  char buf[65536];
  while (read (fd, buf, sizeof buf) > 0)
    ;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  static struct event_base *base;
  if (base == NULL)
    base = event_base_new ();
  int sv[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
    abort ();
  bool gone = false;
  struct agent_conn *c = agent_conn_new (base, sv[0], lost, &gone);
  struct req reqs[3] = { { .c = c }, { .c = c }, { .c = c } };
  json_t *body = json_pack ("{s:[s],s:i}", "cmd", "true", "timeout_ms", 1000);
  for (int i = 0; i < 3; i++)
    reqs[i].stream = agent_request (c, i == 1 ? WR_MSG_FILE : WR_MSG_EXEC, body, &ops, &reqs[i]);
  json_decref (body);
  agent_cancel (c, reqs[2].stream); /* a cancelled stream still gets frames */
  reqs[2].finished = true;

  size_t off = 0;
  for (int spins = 0; spins < 10000 && !gone; spins++)
    {
      if (off < size)
        {
          ssize_t n = write (sv[1], data + off, size - off);
          if (n > 0)
            off += (size_t)n;
          if (off == size)
            shutdown (sv[1], SHUT_WR);
        }
      else if (size == 0 && spins == 0)
        shutdown (sv[1], SHUT_WR);
      event_base_loop (base, EVLOOP_NONBLOCK);
      drain (sv[1]);
      if (off == size && spins > 2 && !agent_conn_alive (c))
        break;
    }
  agent_conn_free (c);
  for (int i = 0; i < 3; i++)
    if (!reqs[i].finished && reqs[i].stream == 0)
      abort (); /* a request that never started has no callbacks */
  event_base_loop (base, EVLOOP_NONBLOCK);
  close (sv[1]);
  return 0;
}

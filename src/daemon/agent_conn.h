/* Daemon side of the agent protocol (src/common/proto.h): one connection per
 * sandbox on the daemon's event loop, many concurrent requests multiplexed
 * by stream id. Backends hand over a connected fd; this code is the same for
 * containers, fncall zygotes and VMs.
 *
 * A connection its owner can reopen (agent_conn_reconnectable) is closed
 * ("shed") while idle once more are open than the node's budget
 * (agent_conns_set_budget), least recently used first, and reopened by the
 * next request: an idle sandbox then holds no daemon descriptor. Its
 * agent's death is found by the owner's probe, every few seconds. */
#ifndef WRD_AGENT_CONN_H
#define WRD_AGENT_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <event2/event.h>
#include <jansson.h>

struct agent_conn;

/* Callbacks of one request. Exactly one of on_done / on_error is called,
 * once, unless the request is cancelled with agent_cancel. */
struct agent_ops
{
  /* STDOUT/STDERR (exec) or DATA (file read) bytes */
  void (*on_data) (void *ud, uint8_t type, const uint8_t *data, size_t len);
  /* EXIT (exec) or RESULT (file) JSON; borrowed */
  void (*on_done) (void *ud, json_t *result);
  /* ERROR from the agent, or connection loss (code "gone") */
  void (*on_error) (void *ud, const char *code, const char *message);
};

/* Bounds on what an agent can make the daemon hold (docs/protocol.md). */
#define WRD_AGENT_DATA_MAX ((size_t)64 << 20)   /* a FILE request, unless max_bytes says less */
#define WRD_AGENT_PONG_QUEUE ((size_t)64 << 10) /* PINGs are answered below this queue */

/* Called when the connection is lost: the agent died or closed it, or broke
 * the protocol (bad frame, malformed reply, more data than asked for). */
typedef void (*agent_lost_cb) (void *ud);

/* Open a new socket to the agent (its fd, or < 0). */
typedef int (*agent_reconnect_cb) (void *ud);
/* Is the agent still alive: 1 yes (or unknown), 0 no. A thorough probe
 * may cost a /proc read, a cheap one only syscalls without descriptors. */
typedef int (*agent_probe_cb) (void *ud, bool thorough);

struct agent_conn *agent_conn_new (struct event_base *base, int fd, agent_lost_cb lost, void *ud);
/* Fails every pending request with "gone" (without calling lost) and frees. */
void agent_conn_free (struct agent_conn *c);
/* The connection may be shed while idle (no request in flight, cancelled
 * ones included until their end, no hold, nothing queued). */
void agent_conn_reconnectable (struct agent_conn *c, agent_reconnect_cb reconnect,
                               agent_probe_cb probe);
/* Open connections kept before idle ones are shed; 0: no limit. */
void agent_conns_set_budget (unsigned budget);
struct agent_conns_stats
{
  unsigned budget;
  size_t open, shed;
  uint64_t sheds, reconnects;
};
void agent_conns_stats (struct agent_conns_stats *ret);
/* Alive, shed or not (a shed connection is reopened by the next request). */
bool agent_conn_alive (struct agent_conn *c);
bool agent_conn_ready (struct agent_conn *c); /* HELLO received */
bool agent_conn_heard (struct agent_conn *c); /* any frame received */
/* The connection is given up: every request on it fails with msg (as "gone")
 * and the lost callback runs, as when the agent's socket closes. */
void agent_conn_fail (struct agent_conn *c, const char *msg);

/* Start a request (EXEC or FILE) with a JSON body; returns the stream id (>0)
 * or 0 when the connection is down. */
uint32_t agent_request (struct agent_conn *c, uint8_t type, json_t *body,
                        const struct agent_ops *ops, void *ud);
/* Send raw frames on a stream (STDIN, DATA, SIGNAL payloads). Large data is
 * split into frames. An empty payload is sent as one empty frame. */
int agent_send (struct agent_conn *c, uint32_t stream, uint8_t type, const void *data, size_t len);
/* The most bytes a request's on_data may receive. The agent is not trusted:
 * one byte more closes the connection. The default follows from the
 * request: an EXEC's stdout_cap + stderr_cap, a FILE read's max_bytes, else
 * WRD_AGENT_DATA_MAX. */
void agent_set_data_limit (struct agent_conn *c, uint32_t stream, size_t max);
/* Fail a request whose agent sends nothing on it for ms: on_error gets
 * "timeout" and the request is cancelled (a hung or hostile guest agent
 * cannot hold a client's request forever). Any frame on the stream starts
 * the silence again; call it again to restart it after the daemon's own
 * sending (an upload the agent answers only at its end). */
void agent_set_idle_timeout (struct agent_conn *c, uint32_t stream, unsigned ms);
/* Forget a request: its callbacks are never called again (the
 * connection stays busy until the agent ends the request). */
void agent_cancel (struct agent_conn *c, uint32_t stream);
/* Stop (hold) or resume reading from the agent, counted: a request whose
 * client is slower than the agent holds the connection until the client
 * caught up, so the agent, not the daemon, waits (backpressure). */
void agent_conn_hold (struct agent_conn *c, bool hold);
/* Bytes queued towards the agent (for backpressure on uploads). */
size_t agent_outq (struct agent_conn *c);

#endif

/* The framed protocol between warrend and warren-agent (docs/protocol.md).
 *
 * One byte stream (a unix socket for containers and fncall, virtio-serial or
 * vsock for VMs) carries frames:
 *
 *   u32 len     payload length in bytes, little endian, <= WR_FRAME_MAX
 *   u32 stream  request id chosen by the daemon; 0 is the control stream
 *   u8  type    enum wr_msg
 *   u8  pad[3]  zero
 *   payload     len bytes: JSON text for control messages, raw bytes for data
 *
 * Many requests run at once, each on its own stream id; frames of different
 * streams interleave freely. The agent never initiates a stream: it answers. */
#ifndef WR_PROTO_H
#define WR_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define WR_PROTO_VERSION 1
#define WR_FRAME_HDR 12
#define WR_FRAME_MAX (1u << 20) /* 1 MiB payload cap per frame */

enum wr_msg
{
  /* agent -> daemon, stream 0, sent once per connection:
   * {"version":1,"agent":"warren-agent","pid":N,"resolver":"openat2|walk"} */
  WR_MSG_HELLO = 1,
  /* daemon -> agent: start a process. JSON:
   *   {"cmd":["argv0",...]} or {"shell":"string run by /bin/sh -c"},
   *   "env":["K=V",...] (or {"K":"V"}), "cwd":"/dir", "timeout_ms":N (0 = none),
   *   "stdout_cap":N, "stderr_cap":N (bytes forwarded; rest drained),
   *   "stdin":bool (true: STDIN frames follow, else /dev/null),
   *   "tty":bool (stdout+stderr on one pty; STDERR frames never sent),
   *   "rows":N, "cols":N (pty window size, default 24x80),
   *   "user":"name" (run as that account of the sandbox's /etc/passwd)
   * answered by STDOUT/STDERR frames, then exactly one EXIT or ERROR. */
  WR_MSG_EXEC = 2,
  /* daemon -> agent: bytes for the process's stdin; empty payload = EOF */
  WR_MSG_STDIN = 3,
  /* daemon -> agent: {"signal":N} delivered to the exec's process group
   * (SIGKILL also kills every process of the exec's session);
   * {"rows":N,"cols":N} resizes a tty exec's terminal. */
  WR_MSG_SIGNAL = 4,
  /* agent -> daemon: output bytes of an exec */
  WR_MSG_STDOUT = 5,
  WR_MSG_STDERR = 6,
  /* agent -> daemon: the exec finished. JSON:
   *   {"exit_code":N (-1 if killed by a signal), "signal":N (0 if none), "timed_out":bool,
   *    "stdout_truncated":bool, "stderr_truncated":bool, "duration_ms":N,
   *    "usage":{"cpu_user_ms":N,"cpu_system_ms":N,"max_rss_kb":N},
   *    "error":"message" (only when the command could not be started;
   *                       exit_code is then 127 or 126) } */
  WR_MSG_EXIT = 7,
  /* daemon -> agent: a file operation. JSON {"op":..., "path":...}:
   *   read   {"max_bytes":N}         -> DATA frames, then RESULT (stat + "truncated")
   *   write  {"mode":N,"append":bool} then DATA frames from the daemon,
   *                                     empty DATA = end -> RESULT {"size":N}
   *   stat   {}                      -> RESULT stat object (lstat; symlinks add "target")
   *   list   {}                      -> RESULT {"entries":[stat objects with "name"],
   *                                             "truncated":bool}
   *   mkdir  {"parents":bool,"mode":N} -> RESULT {}
   *   (write and mkdir take "user":"name": what they create is theirs;
   *    stat and list take "names":true: stat objects add "user","group")
   *   remove {"recursive":bool}      -> RESULT {}
   *   watch  {"recursive":bool,"entry":bool} -> DATA {"ready":true}, then DATA
   *          {"events":[{"name","type":"create|write|remove|rename|chmod","entry"}]}
   *          until the daemon sends any DATA frame -> RESULT {}
   *   export {"scrub":bool} (path "/") -> DATA frames: the guest's writable layer as a
   *          pax tar (whiteouts as OCI .wh. entries), then RESULT
   *          {"entries","bytes","skipped","scrubbed","frozen"} (VM guests; docs/protocol.md)
   *   apply {} (path "/")          then DATA frames of a tar (".wh." removals), empty
   *                                     DATA = end -> RESULT {"entries","frozen"}
   * stat object: {"name","type":"file|dir|symlink|other","size","mode","mtime","uid","gid"}
   *   (a non-UTF-8 name is base64 with "name_encoding":"base64")
   * Paths are resolved inside the sandbox root: ".." and symlinks never leave it. */
  WR_MSG_FILE = 8,
  /* file content chunk, either direction; empty payload ends a write */
  WR_MSG_DATA = 9,
  /* agent -> daemon: success of a FILE op, JSON as above */
  WR_MSG_RESULT = 10,
  /* agent -> daemon: failure of a request. JSON
   *   {"code":"not_found|invalid_argument|...","message":"...","errno":N} */
  WR_MSG_ERROR = 11,
  /* liveness, either direction, stream 0; payload echoed back in PONG */
  WR_MSG_PING = 12,
  WR_MSG_PONG = 13,
  /* daemon -> agent, stream 0, no answer: limits the agent enforces on the
   * processes it starts, where it owns a cgroup tree (VM guests):
   *   {"pids_max":N,"memory_bytes":N,"cpu_quota_us":N,"cpu_period_us":N}
   * (0 or absent = unlimited). Frames are ordered: every later EXEC runs
   * under them. The agent's HELLO says "cgroup":true when it can. */
  WR_MSG_LIMITS = 14,
  WR_MSG_LAST = WR_MSG_LIMITS,
};

struct wr_frame
{
  uint32_t len;
  uint32_t stream;
  uint8_t type;
  const uint8_t *payload; /* points into the caller's buffer */
};

/* Encode a header into out[WR_FRAME_HDR]. */
void wr_frame_hdr_encode (uint8_t out[WR_FRAME_HDR], uint32_t len, uint32_t stream, uint8_t type);

/* Try to parse one frame from buf[0..avail). Returns:
 *   > 0  bytes consumed, *f filled (payload points into buf)
 *   0    need more bytes
 *   < 0  -EPROTO (bad header: len > WR_FRAME_MAX, unknown type, non-zero pad) */
int wr_frame_parse (const uint8_t *buf, size_t avail, struct wr_frame *f);

/* Blocking helper for simple peers (the agent, tests): write header+payload. */
int wr_frame_write (int fd, uint32_t stream, uint8_t type, const void *payload, uint32_t len);

const char *wr_msg_name (uint8_t type);

#endif

/* warren-agent driven over its framed protocol (src/common/proto.h) from the
 * outside: the agent runs on the host with --conn-fd on a socketpair (and
 * --root for file operations), so host /bin/sh, /bin/echo... are used. */
#include "common/proto.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <archive.h>
#include <archive_entry.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include "tap.h"

static char agent_bin[PATH_MAX];
static const char *agent_upper; /* --upper DIR for the next agent_start */

static uint64_t
now_ms (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void
msleep (int ms)
{
  struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };
  nanosleep (&ts, NULL);
}

/* ---- the agent process ---- */

struct agent
{
  pid_t pid;
  int fd;
};

static struct agent
agent_start (const char *root, bool no_openat2, int listen_fd, bool with_conn)
{
  int sv[2] = { -1, -1 };
  if (with_conn && socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
    abort ();
  pid_t pid = fork ();
  if (pid == 0)
    {
      prctl (PR_SET_PDEATHSIG, SIGKILL); /* no agent outlives a crashed test */
      int c = with_conn ? fcntl (sv[1], F_DUPFD, 100) : -1;
      int l = listen_fd >= 0 ? fcntl (listen_fd, F_DUPFD, 100) : -1;
      const char *args[12];
      int n = 0;
      args[n++] = agent_bin;
      if (c >= 0)
        {
          dup2 (c, 4);
          args[n++] = "--conn-fd";
          args[n++] = "4";
        }
      if (l >= 0)
        {
          dup2 (l, 3);
          args[n++] = "--listen-fd";
          args[n++] = "3";
        }
      if (root)
        {
          args[n++] = "--root";
          args[n++] = root;
        }
      if (no_openat2)
        args[n++] = "--no-openat2";
      if (agent_upper)
        {
          args[n++] = "--upper";
          args[n++] = agent_upper;
        }
      args[n] = NULL;
      execv (agent_bin, (char **)args);
      _exit (127);
    }
  if (with_conn)
    close (sv[1]);
  return (struct agent){ pid, sv[0] };
}

static void
agent_stop (struct agent *a)
{
  if (a->fd >= 0)
    close (a->fd);
  kill (a->pid, SIGKILL);
  waitpid (a->pid, NULL, 0);
}

/* ---- frames ---- */

struct frame
{
  uint32_t stream, len;
  uint8_t type;
  char *data; /* NUL terminated */
};

static int
read_full (int fd, void *buf, size_t len, uint64_t deadline)
{
  size_t got = 0;
  while (got < len)
    {
      int64_t left = (int64_t)(deadline - now_ms ());
      if (left <= 0)
        return -1;
      struct pollfd p = { fd, POLLIN, 0 };
      if (poll (&p, 1, (int)left) <= 0)
        continue;
      ssize_t n = read (fd, (char *)buf + got, len - got);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0)
        return 0;
      got += (size_t)n;
    }
  return 1;
}

/* 1 frame, 0 EOF, -1 timeout */
static int
recv_frame (int fd, struct frame *f, int timeout_ms)
{
  uint8_t hdr[WR_FRAME_HDR];
  uint64_t deadline = now_ms () + (uint64_t)timeout_ms;
  int r = read_full (fd, hdr, sizeof hdr, deadline);
  if (r <= 0)
    return r;
  f->len = hdr[0] | hdr[1] << 8 | hdr[2] << 16 | (uint32_t)hdr[3] << 24;
  f->stream = hdr[4] | hdr[5] << 8 | hdr[6] << 16 | (uint32_t)hdr[7] << 24;
  f->type = hdr[8];
  if (f->len > WR_FRAME_MAX)
    return -1;
  f->data = malloc (f->len + 1);
  r = read_full (fd, f->data, f->len, deadline + 5000);
  if (r <= 0)
    {
      free (f->data);
      return r;
    }
  f->data[f->len] = '\0';
  return 1;
}

static void
send_json (int fd, uint32_t stream, uint8_t type, const char *json)
{
  wr_frame_write (fd, stream, type, json, (uint32_t)strlen (json));
}

static uint32_t next_stream = 1;

/* ---- exec helper ---- */

struct result
{
  json_t *exit, *error;
  char *out, *err;
  size_t out_len, err_len;
  int out_frames;
};

static void
result_free (struct result *r)
{
  json_decref (r->exit);
  json_decref (r->error);
  free (r->out);
  free (r->err);
  memset (r, 0, sizeof *r);
}

static void
append (char **buf, size_t *len, const char *d, size_t n)
{
  *buf = realloc (*buf, *len + n + 1);
  memcpy (*buf + *len, d, n);
  *len += n;
  (*buf)[*len] = '\0';
}

/* Collect frames of stream until EXIT/ERROR; 0 on success. */
static int
collect (int fd, uint32_t stream, struct result *r, int timeout_ms)
{
  uint64_t deadline = now_ms () + (uint64_t)timeout_ms;
  if (!r->out)
    append (&r->out, &r->out_len, "", 0);
  if (!r->err)
    append (&r->err, &r->err_len, "", 0);
  for (;;)
    {
      struct frame f;
      int64_t left = (int64_t)(deadline - now_ms ());
      if (left <= 0 || recv_frame (fd, &f, (int)left) <= 0)
        return -1;
      if (f.stream != stream)
        {
          free (f.data);
          continue;
        }
      if (f.type == WR_MSG_STDOUT)
        {
          append (&r->out, &r->out_len, f.data, f.len);
          r->out_frames++;
        }
      else if (f.type == WR_MSG_STDERR)
        append (&r->err, &r->err_len, f.data, f.len);
      else if (f.type == WR_MSG_EXIT || f.type == WR_MSG_ERROR)
        {
          json_t *j = json_loads (f.data, 0, NULL);
          if (f.type == WR_MSG_EXIT)
            r->exit = j;
          else
            r->error = j;
          free (f.data);
          return 0;
        }
      free (f.data);
    }
}

static int
run (struct agent *a, const char *json, struct result *r, int timeout_ms)
{
  memset (r, 0, sizeof *r);
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, json);
  return collect (a->fd, s, r, timeout_ms);
}

static json_int_t
jint (json_t *o, const char *key)
{
  return json_integer_value (json_object_get (o, key));
}

static const char *
jstr (json_t *o, const char *key)
{
  const char *s = json_string_value (json_object_get (o, key));
  return s ? s : "";
}

static bool
jtrue (json_t *o, const char *key)
{
  return json_is_true (json_object_get (o, key));
}

static bool
ping (struct agent *a, const char *payload)
{
  wr_frame_write (a->fd, 0, WR_MSG_PING, payload, (uint32_t)strlen (payload));
  struct frame f;
  for (;;)
    {
      if (recv_frame (a->fd, &f, 3000) <= 0)
        return false;
      bool ok = f.type == WR_MSG_PONG && f.stream == 0 && strcmp (f.data, payload) == 0;
      free (f.data);
      if (ok)
        return true;
    }
}

static long
proc_status_kb (pid_t pid, const char *key)
{
  char path[64], line[256];
  snprintf (path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *fp = fopen (path, "re");
  long v = -1;
  size_t kl = strlen (key);
  while (fp && fgets (line, sizeof line, fp))
    if (strncmp (line, key, kl) == 0 && line[kl] == ':')
      v = atol (line + kl + 1);
  if (fp)
    fclose (fp);
  return v;
}

static bool
pid_gone (pid_t pid, int wait_ms)
{
  uint64_t end = now_ms () + (uint64_t)wait_ms;
  do
    {
      char path[64], buf[512];
      snprintf (path, sizeof path, "/proc/%d/stat", (int)pid);
      int fd = open (path, O_RDONLY);
      if (fd < 0)
        return true;
      ssize_t n = read (fd, buf, sizeof buf - 1);
      close (fd);
      if (n > 0)
        {
          buf[n] = 0;
          char *p = strrchr (buf, ')');
          if (p && (p[2] == 'Z' || p[2] == 'X'))
            {
              msleep (20); /* zombie: must be reaped by the agent soon */
              continue;
            }
        }
      msleep (20);
    }
  while (now_ms () < end);
  return false;
}

/* ---- exec tests ---- */

static void
test_hello (struct agent *a)
{
  struct frame f;
  int r = recv_frame (a->fd, &f, 5000);
  if (!TAP_OK (TAP_C_EQ (r, 1) && TAP_C_EQ (f.type, WR_MSG_HELLO) && TAP_C_EQ (f.stream, 0),
               "HELLO frame on stream 0"))
    return;
  json_t *j = json_loads (f.data, 0, NULL);
  TAP_OK (TAP_C_EQ (jint (j, "version"), 1) && TAP_C_EQ_STR (jstr (j, "agent"), "warren-agent")
              && TAP_C_EQ (jint (j, "pid"), a->pid),
          "HELLO fields: %s", f.data);
  json_decref (j);
  free (f.data);
}

static void
test_exec_basic (struct agent *a)
{
  struct result r;
  run (a, "{\"cmd\":[\"/bin/echo\",\"hello\",\"world\"]}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0)
              && TAP_C_EQ_STR (r.out, "hello world\n"),
          "echo: stdout and exit 0");
  TAP_OK (r.exit && json_is_object (json_object_get (r.exit, "usage"))
              && TAP_C_GT (jint (json_object_get (r.exit, "usage"), "max_rss_kb"), 0)
              && json_is_integer (json_object_get (r.exit, "duration_ms")),
          "EXIT carries usage and duration");
  result_free (&r);

  run (a, "{\"cmd\":[\"echo\",\"via-path\"]}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ_STR (r.out, "via-path\n"), "argv0 searched in PATH");
  result_free (&r);

  run (a, "{\"shell\":\"echo out; echo err >&2; exit 3\"}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 3) && TAP_C_EQ_STR (r.out, "out\n")
              && TAP_C_EQ_STR (r.err, "err\n"),
          "shell: exit code 3, stdout and stderr separated");
  result_free (&r);

  run (a, "{\"cmd\":[\"/usr/bin/env\"],\"env\":[\"A=1\",\"B=two words\"]}", &r, 5000);
  TAP_OK (r.exit && strcmp (r.out, "A=1\nB=two words\n") == 0, "env exactly as given: %s", r.out);
  result_free (&r);

  run (a, "{\"cmd\":[\"/usr/bin/env\"]}", &r, 5000);
  TAP_OK (r.exit
              && TAP_C_HAS_STR (
                  r.out, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n")
              && TAP_C_HAS_STR (r.out, "HOME=/root\n") && TAP_C_HAS_STR (r.out, "TERM=xterm\n"),
          "default env");
  result_free (&r);

  run (a, "{\"shell\":\"pwd\",\"cwd\":\"/tmp\"}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ_STR (r.out, "/tmp\n"), "cwd");
  result_free (&r);

  run (a, "{\"shell\":\"pwd\",\"cwd\":\"/nonexistent-dir-xyz\"}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 127)
              && TAP_C_HAS_STR (jstr (r.exit, "error"), "chdir")
              && TAP_C_HAS_STR (jstr (r.exit, "error"), "No such file"),
          "missing cwd: 127 and a clear error (%s)", r.exit ? jstr (r.exit, "error") : "");
  result_free (&r);

  run (a, "{\"cmd\":[\"nonexistent-cmd-xyz\"]}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 127)
              && TAP_C_EQ_STR (jstr (r.exit, "error"),
                               "exec \"nonexistent-cmd-xyz\": No such file or directory"),
          "command not found: 127 (%s)", r.exit ? jstr (r.exit, "error") : "");
  result_free (&r);

  char nx[PATH_MAX], tool[PATH_MAX + 8], req[PATH_MAX + 100];
  if (!tap_mkdtemp (nx, sizeof nx, "wr-agent-nx"))
    abort ();
  snprintf (tool, sizeof tool, "%s/tool", nx);
  FILE *fp = fopen (tool, "w");
  fputs ("#!/bin/sh\necho should-not-run\n", fp);
  fclose (fp);
  chmod (tool, 0644);
  snprintf (req, sizeof req, "{\"cmd\":[\"%s\"]}", tool);
  run (a, req, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 126)
              && TAP_C_HAS_STR (jstr (r.exit, "error"), "denied") && TAP_C_EQ (r.out_len, 0),
          "not executable: 126 (%s)", r.exit ? jstr (r.exit, "error") : "");
  result_free (&r);
  snprintf (req, sizeof req, "{\"cmd\":[\"tool\"],\"env\":[\"PATH=%s\"]}", nx);
  run (a, req, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 126)
              && TAP_C_HAS_STR (jstr (r.exit, "error"), "denied"),
          "PATH search finds only a non-executable: 126 (%s)",
          r.exit ? jstr (r.exit, "error") : "");
  result_free (&r);
  chmod (tool, 0755);
  run (a, req, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0)
              && TAP_C_EQ_STR (r.out, "should-not-run\n"),
          "PATH search uses the exec's PATH");
  result_free (&r);
  unlink (tool);
  rmdir (nx);

  run (a, "{\"shell\":\"kill -TERM $$\"}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "signal"), 15)
              && TAP_C_EQ (jint (r.exit, "exit_code"), -1),
          "child gets default signal dispositions back (SIGTERM kills it)");
  result_free (&r);

  run (a, "{\"cmd\":[\"/bin/cat\"]}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_EQ (r.out_len, 0),
          "no stdin: /dev/null");
  result_free (&r);
}

static void
test_exec_errors (struct agent *a)
{
  struct result r;
  run (a, "{\"cmd\":[\"/bin/echo\"", &r, 5000);
  TAP_OK (r.error && TAP_C_EQ_STR (jstr (r.error, "code"), "invalid_argument"),
          "malformed JSON -> ERROR invalid_argument");
  result_free (&r);
  run (a, "{\"cmd\":[\"/bin/echo\"],\"shell\":\"x\"}", &r, 5000);
  TAP_OK (r.error != NULL, "cmd and shell together -> ERROR");
  result_free (&r);
  run (a, "{\"cmd\":[]}", &r, 5000);
  TAP_OK (r.error != NULL, "empty cmd -> ERROR");
  result_free (&r);
  run (a, "{\"cmd\":[\"/bin/echo\",\"a\\u0000b\"]}", &r, 5000);
  TAP_OK (r.error != NULL, "NUL in argv -> ERROR");
  result_free (&r);
  run (a, "{\"cmd\":[\"/bin/true\"],\"timeout_ms\":-5}", &r, 5000);
  TAP_OK (r.error != NULL, "negative timeout -> ERROR");
  result_free (&r);

  memset (&r, 0, sizeof r);
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_FILE, "{\"op\":\"frobnicate\",\"path\":\"/\"}");
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.error && TAP_C_EQ_STR (jstr (r.error, "code"), "invalid_argument"),
          "unknown op -> ERROR");
  result_free (&r);

  /* duplicate stream id of a live request */
  s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/bin/sleep\",\"0.5\"]}");
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/bin/true\"]}");
  memset (&r, 0, sizeof r);
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.error && TAP_C_EQ_STR (jstr (r.error, "code"), "conflict"),
          "duplicate stream -> conflict");
  result_free (&r);
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0),
          "the original request still completes");
  result_free (&r);
  TAP_OK (ping (a, "still-up"), "connection survives bad requests");
}

static void
test_stdin (struct agent *a)
{
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/bin/cat\"],\"stdin\":true}");
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "abc", 3);
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "def\n", 4);
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "", 0);
  struct result r = { 0 };
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_EQ_STR (r.out, "abcdef\n"),
          "stdin frames then EOF");
  result_free (&r);

  /* 3 MiB through stdin, bigger than any pipe buffer */
  s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/usr/bin/wc\",\"-c\"],\"stdin\":true}");
  static char chunk[1 << 20];
  memset (chunk, 'x', sizeof chunk);
  for (int i = 0; i < 3; i++)
    wr_frame_write (a->fd, s, WR_MSG_STDIN, chunk, sizeof chunk);
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "", 0);
  collect (a->fd, s, &r, 10000);
  TAP_OK (r.exit && TAP_C_EQ (atol (r.out), 3 << 20), "3 MiB of stdin arrives intact (%s)", r.out);
  result_free (&r);

  /* a process that never reads stdin: the data is discarded when it exits */
  s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/bin/true\"],\"stdin\":true}");
  wr_frame_write (a->fd, s, WR_MSG_STDIN, chunk, sizeof chunk);
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0),
          "unread stdin does not block completion");
  result_free (&r);
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "late", 4); /* after EXIT: ignored */
  TAP_OK (ping (a, "after-late-stdin"), "late STDIN is ignored");
}

static void
test_timeout_tree (struct agent *a)
{
  struct result r;
  uint64_t t0 = now_ms ();
  /* The background sleep, and a python child that moved to its own process
   * group, must both die with the exec. */
  run (a,
       "{\"shell\":\"sleep 100 & echo $!; python3 -c 'import os,time; os.setpgid(0,0); "
       "print(os.getpid(), flush=True); time.sleep(100)' & sleep 100\",\"timeout_ms\":700}",
       &r, 10000);
  uint64_t took = now_ms () - t0;
  TAP_OK (r.exit && jtrue (r.exit, "timed_out") && TAP_C_EQ (jint (r.exit, "signal"), 9)
              && TAP_C_EQ (jint (r.exit, "exit_code"), -1),
          "timeout: timed_out, signal 9, exit -1");
  TAP_OK (TAP_C_GE (took, 650) && TAP_C_LT (took, 5000), "timeout fired on time (%llu ms)",
          (unsigned long long)took);
  pid_t bg = 0, other = 0;
  if (r.out)
    sscanf (r.out, "%d %d", &bg, &other);
  TAP_OK (TAP_C_GT (bg, 0) && pid_gone (bg, 2000), "background sleep %d killed", (int)bg);
  TAP_OK (TAP_C_GT (other, 0) && pid_gone (other, 2000),
          "process in another pgrp of the session %d killed", (int)other);
  result_free (&r);
}

static void
test_signal (struct agent *a)
{
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"shell\":\"echo started; exec sleep 100\"}");
  struct frame f;
  int ok = recv_frame (a->fd, &f, 5000);
  TAP_OK (TAP_C_EQ (ok, 1) && TAP_C_EQ (f.type, WR_MSG_STDOUT)
              && TAP_C_EQ_STR (f.data, "started\n"),
          "output streams before exit");
  if (ok == 1)
    free (f.data);
  send_json (a->fd, s, WR_MSG_SIGNAL, "{\"signal\":15}");
  struct result r = { 0 };
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "signal"), 15) && !jtrue (r.exit, "timed_out"),
          "SIGNAL 15 delivered to the process group");
  result_free (&r);
}

static void
test_output_cap (struct agent *a)
{
  struct result r;
  run (a, "{\"cmd\":[\"yes\"],\"stdout_cap\":100000,\"timeout_ms\":1000}", &r, 10000);
  TAP_OK (r.exit && TAP_C_EQ (r.out_len, 100000) && jtrue (r.exit, "stdout_truncated")
              && !jtrue (r.exit, "stderr_truncated") && jtrue (r.exit, "timed_out"),
          "yes with a cap: exactly 100000 bytes, truncated, ends by timeout (%zu)", r.out_len);
  result_free (&r);
  long hwm = proc_status_kb (a->pid, "VmHWM");
  TAP_OK (TAP_C_GT (hwm, 0) && TAP_C_LT (hwm, 16 * 1024),
          "agent memory stays bounded (VmHWM %ld kB)", hwm);

  /* Backpressure: 30 MB of output while we do not read must not be buffered. */
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC,
             "{\"cmd\":[\"head\",\"-c\",\"30000000\",\"/dev/zero\"],\"stdout_cap\":40000000}");
  msleep (1500);
  hwm = proc_status_kb (a->pid, "VmHWM");
  TAP_OK (TAP_C_GT (hwm, 0) && TAP_C_LT (hwm, 20 * 1024),
          "reader stalled: agent does not buffer (VmHWM %ld kB)", hwm);
  memset (&r, 0, sizeof r);
  collect (a->fd, s, &r, 30000);
  TAP_OK (r.exit && TAP_C_EQ (r.out_len, 30000000) && !jtrue (r.exit, "stdout_truncated"),
          "all 30 MB delivered after the stall (%zu)", r.out_len);
  result_free (&r);

  run (a, "{\"shell\":\"echo 12345678901234567890\",\"stdout_cap\":0}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (r.out_len, 0) && jtrue (r.exit, "stdout_truncated"),
          "cap 0 forwards nothing");
  result_free (&r);
}

static void
test_concurrent (struct agent *a)
{
  uint32_t s1 = next_stream++, s2 = next_stream++;
  send_json (a->fd, s1, WR_MSG_EXEC, "{\"shell\":\"sleep 0.4; echo slow\"}");
  send_json (a->fd, s2, WR_MSG_EXEC, "{\"shell\":\"echo fast\"}");
  int order[2], n = 0;
  char out1[64] = "", out2[64] = "";
  uint64_t deadline = now_ms () + 5000;
  while (n < 2 && now_ms () < deadline)
    {
      struct frame f;
      if (recv_frame (a->fd, &f, 5000) <= 0)
        break;
      if (f.type == WR_MSG_STDOUT)
        strncat (f.stream == s1 ? out1 : out2, f.data, 30);
      if (f.type == WR_MSG_EXIT)
        order[n++] = (int)f.stream;
      free (f.data);
    }
  TAP_OK (TAP_C_EQ (n, 2) && TAP_C_EQ (order[0], (int)s2) && TAP_C_EQ (order[1], (int)s1),
          "concurrent execs: the fast one finishes first");
  TAP_OK (TAP_C_EQ_STR (out1, "slow\n") && TAP_C_EQ_STR (out2, "fast\n"),
          "output frames carry the right stream ids");
}

static void
test_background_no_wait (struct agent *a)
{
  struct result r;
  uint64_t t0 = now_ms ();
  run (a, "{\"shell\":\"sleep 3 & echo $!\"}", &r, 5000);
  uint64_t took = now_ms () - t0;
  TAP_OK (r.exit && TAP_C_LT (took, 1500),
          "EXIT does not wait for a background child holding the pipe (%llu ms)",
          (unsigned long long)took);
  pid_t bg = r.out ? atoi (r.out) : 0;
  result_free (&r);
  if (bg > 0)
    kill (bg, SIGKILL);
  TAP_OK (TAP_C_GT (bg, 0) && pid_gone (bg, 2000), "orphans are reaped (no zombie left)");
}

static void
test_tty (struct agent *a)
{
  if (access ("/dev/ptmx", R_OK | W_OK) != 0)
    {
      TAP_SKIP ("no /dev/ptmx", "tty");
      return;
    }
  struct result r;
  run (a, "{\"shell\":\"tty; echo hi >&2\",\"tty\":true}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_HAS_STR (r.out, "/dev/pts/")
              && TAP_C_HAS_STR (r.out, "hi") && TAP_C_EQ (r.err_len, 0),
          "tty: one stream, stdout is a pty (%s)", r.out ? r.out : "");
  result_free (&r);
  if (r.error)
    return;
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC, "{\"cmd\":[\"/bin/cat\"],\"tty\":true,\"stdin\":true}");
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "ping\n", 5);
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "", 0);
  memset (&r, 0, sizeof r);
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_HAS_STR (r.out, "ping"),
          "tty stdin and EOF (^D)");
  result_free (&r);
  /* a SIGNAL frame with rows/cols resizes the terminal; frames are ordered,
   * so the shell reads its line after the resize */
  s = next_stream++;
  send_json (a->fd, s, WR_MSG_EXEC,
             "{\"shell\":\"read x; stty size\",\"tty\":true,\"stdin\":true,\"rows\":24,"
             "\"cols\":80}");
  send_json (a->fd, s, WR_MSG_SIGNAL, "{\"rows\":30,\"cols\":100}");
  wr_frame_write (a->fd, s, WR_MSG_STDIN, "\n", 1);
  memset (&r, 0, sizeof r);
  collect (a->fd, s, &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_HAS_STR (r.out, "30 100"),
          "tty resize: SIGNAL {rows, cols} sets the window size");
  result_free (&r);
}

static void
test_exec_user (struct agent *a)
{
  struct result r;
  run (a, "{\"shell\":\"id -u; id -g; id -G\",\"user\":\"nobody\"}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ (jint (r.exit, "exit_code"), 0) && TAP_C_HAS_STR (r.out, "65534\n"),
          "exec \"user\": runs as the account (%s)", r.out ? r.out : "");
  result_free (&r);
  run (a, "{\"cmd\":[\"true\"],\"user\":\"no-such-user-here\"}", &r, 5000);
  TAP_OK (r.error && TAP_C_EQ_STR (jstr (r.error, "code"), "invalid_argument"),
          "exec \"user\": an unknown account is invalid_argument");
  result_free (&r);
}

static void
test_pid1_duties (struct agent *a)
{
  kill (a->pid, SIGTERM);
  kill (a->pid, SIGINT);
  kill (a->pid, SIGHUP);
  msleep (100);
  TAP_OK (ping (a, "alive"), "SIGTERM/SIGINT/SIGHUP are ignored");
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/status", (int)a->pid);
  struct stat st;
  /* not dumpable: /proc/PID files become root-owned; we are root, so check
   * the flag via prctl-visible effect: the agent's fds are not inherited */
  (void)st;
  struct result r;
  run (a, "{\"shell\":\"ls /proc/self/fd | wc -l\"}", &r, 5000);
  /* 0,1,2 and the directory ls reads: the agent's sockets must not leak */
  TAP_OK (r.exit && TAP_C_LE (atoi (r.out), 4), "no agent fd leaks into the child (%d fds)",
          atoi (r.out));
  result_free (&r);
}

/* ---- file tests ---- */

struct fres
{
  json_t *result, *error;
  char *data;
  size_t len;
};

static void
fres_free (struct fres *f)
{
  json_decref (f->result);
  json_decref (f->error);
  free (f->data);
  memset (f, 0, sizeof *f);
}

static struct fres
file_op (struct agent *a, const char *json, const void *wdata, size_t wlen)
{
  struct fres res = { 0 };
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_FILE, json);
  if (wdata)
    {
      size_t off = 0;
      while (off < wlen)
        {
          size_t n = wlen - off > 300000 ? 300000 : wlen - off;
          wr_frame_write (a->fd, s, WR_MSG_DATA, (const char *)wdata + off, (uint32_t)n);
          off += n;
        }
      wr_frame_write (a->fd, s, WR_MSG_DATA, "", 0);
    }
  append (&res.data, &res.len, "", 0);
  for (;;)
    {
      struct frame f;
      if (recv_frame (a->fd, &f, 10000) <= 0)
        return res;
      if (f.stream != s)
        {
          free (f.data);
          continue;
        }
      if (f.type == WR_MSG_DATA)
        append (&res.data, &res.len, f.data, f.len);
      else if (f.type == WR_MSG_RESULT || f.type == WR_MSG_ERROR)
        {
          *(f.type == WR_MSG_RESULT ? &res.result : &res.error) = json_loads (f.data, 0, NULL);
          free (f.data);
          return res;
        }
      free (f.data);
    }
}

static struct fres
fop (struct agent *a, const char *fmt, ...)
{
  char buf[8192];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (buf, sizeof buf, fmt, ap);
  va_end (ap);
  return file_op (a, buf, NULL, 0);
}

static bool
is_err (struct fres *f, const char *code)
{
  return f->result == NULL && f->error && strcmp (jstr (f->error, "code"), code) == 0;
}

static bool
exists_at (const char *dir, const char *rel)
{
  char p[PATH_MAX];
  snprintf (p, sizeof p, "%s/%s", dir, rel);
  struct stat st;
  return lstat (p, &st) == 0;
}

static void
test_files (struct agent *a, const char *root, const char *outside, const char *mode)
{
  struct fres f;
  char p[PATH_MAX];

  f = file_op (a, "{\"op\":\"write\",\"path\":\"/a.txt\",\"mode\":384}", "hello", 5);
  TAP_OK (f.result && TAP_C_EQ (jint (f.result, "size"), 5), "[%s] write -> size", mode);
  fres_free (&f);
  snprintf (p, sizeof p, "%s/a.txt", root);
  struct stat st;
  TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_size, 5)
              && TAP_C_EQ ((st.st_mode & 0777), 0600),
          "[%s] written inside the root with mode 0600", mode);

  f = file_op (a, "{\"op\":\"write\",\"path\":\"/a.txt\",\"append\":true}", " world", 6);
  TAP_OK (f.result && TAP_C_EQ (jint (f.result, "size"), 11), "[%s] append", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"read\",\"path\":\"/a.txt\"}");
  TAP_OK (f.result && TAP_C_EQ_STR (f.data, "hello world") && TAP_C_EQ (jint (f.result, "size"), 11)
              && TAP_C_EQ_STR (jstr (f.result, "type"), "file")
              && TAP_C_EQ_STR (jstr (f.result, "name"), "a.txt"),
          "[%s] read -> DATA then RESULT stat", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"read\",\"path\":\"/a.txt\",\"max_bytes\":4}");
  TAP_OK (f.result && TAP_C_EQ_STR (f.data, "hell") && jtrue (f.result, "truncated"),
          "[%s] read max_bytes", mode);
  fres_free (&f);

  /* multi-frame content */
  size_t big = 3 * 1000 * 1000 + 17;
  char *bd = malloc (big);
  for (size_t i = 0; i < big; i++)
    bd[i] = (char)(i * 7 + i / 1000);
  f = file_op (a, "{\"op\":\"write\",\"path\":\"/big.bin\"}", bd, big);
  TAP_OK (f.result && TAP_C_EQ ((size_t)jint (f.result, "size"), big), "[%s] 3 MB write", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/big.bin\"}");
  TAP_OK (f.result && TAP_C_EQ (f.len, big) && TAP_C_EQ_MEM (f.data, big, bd, big),
          "[%s] 3 MB read back intact", mode);
  fres_free (&f);
  free (bd);

  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/d1/d2/d3\",\"parents\":true}");
  TAP_OK (f.result && exists_at (root, "d1/d2/d3"), "[%s] mkdir parents", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/d1/d2/d3\",\"parents\":true}");
  TAP_OK (f.result != NULL, "[%s] mkdir parents on an existing dir is fine", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/d1\"}");
  TAP_OK (is_err (&f, "conflict"), "[%s] mkdir existing -> conflict", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/nope/x\"}");
  TAP_OK (is_err (&f, "not_found"), "[%s] mkdir without parent -> not_found", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"stat\",\"path\":\"/d1\"}");
  TAP_OK (f.result && TAP_C_EQ_STR (jstr (f.result, "type"), "dir")
              && TAP_C_EQ_STR (jstr (f.result, "name"), "d1")
              && json_is_integer (json_object_get (f.result, "mtime")),
          "[%s] stat dir", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"stat\",\"path\":\"/missing\"}");
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (jint (f.error, "errno"), ENOENT),
          "[%s] stat missing -> not_found, errno", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"list\",\"path\":\"/\"}");
  json_t *ents = f.result ? json_object_get (f.result, "entries") : NULL;
  bool saw_a = false, saw_d = false;
  size_t i;
  json_t *e;
  json_array_foreach (ents, i, e)
  {
    saw_a |= strcmp (jstr (e, "name"), "a.txt") == 0 && jint (e, "size") == 11;
    saw_d |= strcmp (jstr (e, "name"), "d1") == 0 && strcmp (jstr (e, "type"), "dir") == 0;
  }
  TAP_OK (saw_a && saw_d, "[%s] list", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"read\",\"path\":\"/d1\"}");
  TAP_OK (is_err (&f, "invalid_argument")
              && TAP_C_HAS_STR (jstr (f.error, "message"), "is a directory"),
          "[%s] read a directory -> invalid_argument", mode);
  fres_free (&f);

  f = fop (a, "{\"op\":\"remove\",\"path\":\"/d1\"}");
  TAP_OK (is_err (&f, "conflict"), "[%s] non-recursive remove of a full dir -> conflict", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"remove\",\"path\":\"/d1\",\"recursive\":true}");
  TAP_OK (f.result && !exists_at (root, "d1"), "[%s] recursive remove", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"remove\",\"path\":\"/a.txt\"}");
  TAP_OK (f.result && !exists_at (root, "a.txt"), "[%s] remove file", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"remove\",\"path\":\"/\",\"recursive\":true}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] remove / refused", mode);
  fres_free (&f);

  /* bad paths */
  f = fop (a, "{\"op\":\"stat\",\"path\":\"relative/x\"}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] relative path refused", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"stat\",\"path\":\"\"}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] empty path refused", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"stat\",\"path\":\"/a\\u0000b\"}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] NUL in path refused", mode);
  fres_free (&f);
  char longp[5000];
  memset (longp, 'a', sizeof longp);
  longp[0] = '/';
  longp[sizeof longp - 1] = 0;
  f = fop (a, "{\"op\":\"stat\",\"path\":\"%s\"}", longp);
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] path over 4096 bytes refused", mode);
  fres_free (&f);

  /* ---- traversal ---- */
  char secret[PATH_MAX];
  snprintf (secret, sizeof secret, "%s/secret", outside);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/../../../..%s\"}", secret);
  TAP_OK (is_err (&f, "not_found"), "[%s] \"..\" cannot climb out of the root", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/../../etc/passwd\"}");
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (f.len, 0), "[%s] ../../etc/passwd stays inside",
          mode);
  fres_free (&f);

  snprintf (p, sizeof p, "%s/etclink", root);
  symlink ("/etc", p);
  snprintf (p, sizeof p, "%s/evil", root);
  symlink (outside, p);
  snprintf (p, sizeof p, "%s/up", root);
  symlink ("../../../../../..", p);
  snprintf (p, sizeof p, "%s/leak", root);
  symlink (secret, p);

  f = fop (a, "{\"op\":\"read\",\"path\":\"/etclink/passwd\"}");
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (f.len, 0),
          "[%s] symlink to /etc resolves inside root", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/evil/secret\"}");
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (f.len, 0),
          "[%s] absolute symlink out: no host file", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/up%s\"}", secret);
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (f.len, 0),
          "[%s] relative ../.. symlink: no host file", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/leak\"}");
  TAP_OK (is_err (&f, "not_found") && TAP_C_EQ (f.len, 0), "[%s] final symlink to a host file",
          mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"list\",\"path\":\"/up\"}");
  ents = f.result ? json_object_get (f.result, "entries") : NULL;
  bool saw_up = false;
  json_array_foreach (ents, i, e) saw_up |= strcmp (jstr (e, "name"), "up") == 0;
  TAP_OK (saw_up, "[%s] list via ../.. symlink lists the root itself", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"stat\",\"path\":\"/leak\"}");
  TAP_OK (f.result && TAP_C_EQ_STR (jstr (f.result, "type"), "symlink")
              && TAP_C_EQ_STR (jstr (f.result, "target"), secret),
          "[%s] stat does not follow the final symlink", mode);
  fres_free (&f);

  f = file_op (a, "{\"op\":\"write\",\"path\":\"/evil/pwned\"}", "x", 1);
  TAP_OK (!exists_at (outside, "pwned"), "[%s] write through symlink dir does not reach host",
          mode);
  TAP_OK (is_err (&f, "not_found"), "[%s] ... and fails (target dir absent in root)", mode);
  fres_free (&f);
  /* once the target exists inside the root, the write lands there */
  snprintf (p, sizeof p, "mkdir -p '%s/%s'", root, outside);
  if (system (p) != 0)
    abort ();
  f = file_op (a, "{\"op\":\"write\",\"path\":\"/evil/pwned\"}", "x", 1);
  snprintf (p, sizeof p, "%s%s", root, outside);
  TAP_OK (f.result && exists_at (p, "pwned") && !exists_at (outside, "pwned"),
          "[%s] write through symlink lands inside the root", mode);
  fres_free (&f);
  f = file_op (a, "{\"op\":\"write\",\"path\":\"/leak\"}", "overwritten", 11);
  TAP_OK (is_err (&f, "invalid_argument") && TAP_C_EQ (stat (secret, &st), 0)
              && TAP_C_EQ (st.st_size, 6),
          "[%s] write to a final symlink refused, host file untouched", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/up/made-via-up\"}");
  TAP_OK (f.result && exists_at (root, "made-via-up"), "[%s] mkdir via ../.. symlink stays in root",
          mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"read\",\"path\":\"/proc/self/root%s\"}", secret);
  TAP_OK (is_err (&f, "not_found"), "[%s] /proc-style magic path resolves inside root", mode);
  fres_free (&f);

  /* recursive remove of a dir holding a symlink to the host must not follow */
  snprintf (p, sizeof p, "%s/rmdir", root);
  mkdir (p, 0755);
  snprintf (p, sizeof p, "%s/rmdir/out", root);
  symlink (outside, p);
  f = fop (a, "{\"op\":\"remove\",\"path\":\"/rmdir\",\"recursive\":true}");
  TAP_OK (f.result && !exists_at (root, "rmdir") && TAP_C_EQ (stat (secret, &st), 0),
          "[%s] recursive remove does not follow symlinks", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"remove\",\"path\":\"/evil\",\"recursive\":true}");
  TAP_OK (f.result && TAP_C_EQ (stat (secret, &st), 0) && !exists_at (root, "evil"),
          "[%s] removing a symlink removes only the link", mode);
  fres_free (&f);

  /* cleanup for the next mode */
  snprintf (p, sizeof p, "rm -rf '%s'/* '%s'/.[!.]* 2>/dev/null; true", root, root);
  if (system (p) != 0)
    abort ();
}

/* ---- connections ---- */

static int
unix_listen (char *path, size_t sz)
{
  snprintf (path, sz, "/tmp/wr-agent-test-%d.sock", (int)getpid ());
  unlink (path);
  int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  snprintf (sa.sun_path, sizeof sa.sun_path, "%s", path);
  if (bind (fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen (fd, 4) < 0)
    abort ();
  return fd;
}

static int
unix_connect (const char *path)
{
  int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  snprintf (sa.sun_path, sizeof sa.sun_path, "%s", path);
  if (connect (fd, (struct sockaddr *)&sa, sizeof sa) < 0)
    abort ();
  return fd;
}

static bool
got_hello (int fd)
{
  struct frame f;
  if (recv_frame (fd, &f, 5000) != 1)
    return false;
  bool ok = f.type == WR_MSG_HELLO;
  free (f.data);
  return ok;
}

static void
test_connections (void)
{
  char path[108];
  int lfd = unix_listen (path, sizeof path);
  struct agent a = agent_start (NULL, false, lfd, true);
  TAP_OK (got_hello (a.fd), "conn-fd: HELLO");

  /* an exec in flight when the connection is replaced is orphaned */
  send_json (a.fd, 99, WR_MSG_EXEC, "{\"shell\":\"sleep 0.3; echo orphan-output\"}");
  msleep (50);
  int c2 = unix_connect (path);
  TAP_OK (got_hello (c2), "listen-fd: a new connection gets HELLO");
  struct frame f;
  TAP_EQ (recv_frame (a.fd, &f, 3000), 0, "the new connection replaces the old one (EOF)");
  close (a.fd);
  a.fd = c2;
  msleep (500);
  TAP_OK (ping (&a, "p2"), "PING on the new connection");
  /* nothing of stream 99 may appear on the new connection */
  wr_frame_write (a.fd, 0, WR_MSG_PING, "x", 1);
  bool leak = false;
  while (recv_frame (a.fd, &f, 1000) == 1)
    {
      leak |= f.stream == 99;
      bool pong = f.type == WR_MSG_PONG;
      free (f.data);
      if (pong)
        break;
    }
  TAP_OK (!leak, "orphaned exec output is not sent to the new connection");

  /* malformed frame header -> the agent closes the connection */
  uint8_t bad[WR_FRAME_HDR];
  wr_frame_hdr_encode (bad, 0, 1, WR_MSG_PING);
  bad[10] = 7; /* non-zero pad */
  if (write (a.fd, bad, sizeof bad) != sizeof bad)
    abort ();
  TAP_EQ (recv_frame (a.fd, &f, 3000), 0, "malformed frame header -> disconnect");
  close (a.fd);
  uint8_t huge[WR_FRAME_HDR];
  a.fd = unix_connect (path);
  TAP_OK (got_hello (a.fd), "agent accepts again after a bad frame");
  wr_frame_hdr_encode (huge, WR_FRAME_MAX + 1, 1, WR_MSG_EXEC);
  if (write (a.fd, huge, sizeof huge) != sizeof huge)
    abort ();
  TAP_EQ (recv_frame (a.fd, &f, 3000), 0, "oversized frame -> disconnect");
  close (a.fd);
  a.fd = unix_connect (path);
  TAP_OK (got_hello (a.fd), "reconnect after oversized frame");
  struct result r;
  run (&a, "{\"cmd\":[\"/bin/echo\",\"again\"]}", &r, 5000);
  TAP_OK (r.exit && TAP_C_EQ_STR (r.out, "again\n"), "exec works on the reconnected channel");
  result_free (&r);

  /* daemon gone entirely: agent keeps running, listen socket still works */
  close (a.fd);
  msleep (100);
  TAP_EQ (waitpid (a.pid, NULL, WNOHANG), 0, "agent survives the daemon going away");
  a.fd = unix_connect (path);
  TAP_OK (got_hello (a.fd), "and accepts the restarted daemon");
  agent_stop (&a);
  close (lfd);
  unlink (path);
}

/* Events of a watch stream until one named want of type arrives (events
 * that arrived in the same batch are kept for the next call); true if it
 * did, and *saw_bad when an event name starting with bad came first. */
static json_t *watch_seen;

static bool
watch_until (struct agent *a, uint32_t s, const char *want, const char *type, const char *bad,
             bool *saw_bad, json_t **ret_event)
{
  uint64_t deadline = now_ms () + 10000;
  if (watch_seen == NULL)
    watch_seen = json_array ();
  for (;;)
    {
      size_t i;
      json_t *ev;
      json_array_foreach (watch_seen, i, ev)
      {
        const char *name = jstr (ev, "name");
        if (bad && strncmp (name, bad, strlen (bad)) == 0)
          *saw_bad = true;
        if (strcmp (name, want) == 0 && strcmp (jstr (ev, "type"), type) == 0)
          {
            if (ret_event)
              *ret_event = json_incref (ev);
            json_array_remove (watch_seen, i);
            return true;
          }
      }
      struct frame f;
      int64_t left = (int64_t)(deadline - now_ms ());
      if (left <= 0 || recv_frame (a->fd, &f, (int)left) <= 0)
        return false;
      json_t *j = f.stream == s && f.type == WR_MSG_DATA ? json_loads (f.data, 0, NULL) : NULL;
      free (f.data);
      json_array_extend (watch_seen, json_object_get (j, "events"));
      json_decref (j);
    }
}

static void
host_write (const char *root, const char *rel, const char *data)
{
  char p[PATH_MAX];
  snprintf (p, sizeof p, "%s/%s", root, rel);
  FILE *fp = fopen (p, "w");
  if (fp)
    {
      fputs (data, fp);
      fclose (fp);
    }
}

static void
test_watch (struct agent *a, const char *root, const char *outside, const char *mode)
{
  char p[PATH_MAX], q[PATH_MAX];
  struct fres f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/w/sub\",\"parents\":true}");
  fres_free (&f);
  snprintf (p, sizeof p, "%s/w/out", root);
  if (symlink (outside, p) < 0)
    abort ();
  uint32_t s = next_stream++;
  send_json (a->fd, s, WR_MSG_FILE,
             "{\"op\":\"watch\",\"path\":\"/w\",\"recursive\":true,\"entry\":true}");
  struct frame fr;
  json_t *ready = NULL;
  if (recv_frame (a->fd, &fr, 5000) == 1)
    {
      ready = fr.stream == s && fr.type == WR_MSG_DATA ? json_loads (fr.data, 0, NULL) : NULL;
      free (fr.data);
    }
  TAP_OK (ready && jtrue (ready, "ready"), "[%s] watch: ready once the watches are in place", mode);
  json_decref (ready);

  bool bad = false;
  json_t *ev = NULL;
  host_write (root, "w/sub/f.txt", "one");
  TAP_OK (watch_until (a, s, "sub/f.txt", "write", NULL, NULL, &ev)
              && TAP_C_EQ_STR (jstr (json_object_get (ev, "entry"), "type"), "file")
              && TAP_C_EQ (jint (json_object_get (ev, "entry"), "size"), 3),
          "[%s] watch: a write below the directory (recursive), with its entry", mode);
  json_decref (ev);
  snprintf (p, sizeof p, "%s/w/new", root);
  mkdir (p, 0755);
  TAP_OK (watch_until (a, s, "new", "create", NULL, NULL, NULL), "[%s] watch: a new directory",
          mode);
  host_write (root, "w/new/g", "x");
  TAP_OK (watch_until (a, s, "new/g", "create", NULL, NULL, NULL),
          "[%s] watch: a directory created later is watched too", mode);
  snprintf (p, sizeof p, "%s/w/new/g", root);
  snprintf (q, sizeof q, "%s/w/new/h", root);
  rename (p, q);
  TAP_OK (watch_until (a, s, "new/g", "rename", NULL, NULL, NULL)
              && watch_until (a, s, "new/h", "create", NULL, NULL, NULL),
          "[%s] watch: rename is RENAME of the old name, CREATE of the new", mode);
  chmod (q, 0600);
  unlink (q);
  TAP_OK (watch_until (a, s, "new/h", "chmod", NULL, NULL, NULL)
              && watch_until (a, s, "new/h", "remove", NULL, NULL, NULL),
          "[%s] watch: chmod and remove", mode);
  /* a symlink to a directory outside the root is never descended into */
  host_write (outside, "leak", "x");
  host_write (root, "w/marker", "x");
  TAP_OK (watch_until (a, s, "marker", "create", "out/", &bad, NULL) && !bad,
          "[%s] watch: nothing outside the root is watched through a symlink", mode);
  wr_frame_write (a->fd, s, WR_MSG_DATA, "", 0);
  json_t *end = NULL;
  for (int i = 0; i < 50 && end == NULL; i++)
    {
      if (recv_frame (a->fd, &fr, 5000) != 1)
        break;
      if (fr.stream == s && fr.type != WR_MSG_DATA)
        end = json_pack ("{s:i}", "type", fr.type);
      free (fr.data);
    }
  TAP_OK (end && TAP_C_EQ (jint (end, "type"), WR_MSG_RESULT), "[%s] watch: DATA ends it (RESULT)",
          mode);
  json_decref (end);
  json_decref (watch_seen);
  watch_seen = NULL;
  f = fop (a, "{\"op\":\"watch\",\"path\":\"/w/sub/f.txt\"}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] watch of a file: invalid_argument", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"watch\",\"path\":\"/nope\"}");
  TAP_OK (is_err (&f, "not_found"), "[%s] watch of a missing directory: not_found", mode);
  fres_free (&f);
  TAP_OK (ping (a, "after-watch"), "[%s] agent alive after the watches", mode);
}

/* FILE "user" (owner of what is created) and "names", from the accounts
 * of the root (its etc/passwd and etc/group, not the host's) */
static void
test_file_owner (struct agent *a, const char *root, const char *mode)
{
  char p[PATH_MAX];
  snprintf (p, sizeof p, "%s/etc", root);
  mkdir (p, 0755);
  host_write (root, "etc/passwd",
              "root:x:0:0::/root:/bin/sh\nalice:x:1234:1235::/home/a:/bin/sh\n");
  host_write (root, "etc/group", "root:x:0:\nstaff:x:1235:\n");
  struct fres f = file_op (a, "{\"op\":\"write\",\"path\":\"/own/x\",\"user\":\"alice\"}", "x", 1);
  TAP_OK (is_err (&f, "not_found"), "[%s] write: no parents made", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"mkdir\",\"path\":\"/own/sub\",\"parents\":true,\"user\":\"alice\"}");
  fres_free (&f);
  f = file_op (a, "{\"op\":\"write\",\"path\":\"/own/sub/x\",\"user\":\"alice\"}", "x", 1);
  fres_free (&f);
  struct stat st1, st2, st3;
  snprintf (p, sizeof p, "%s/own", root);
  int r1 = lstat (p, &st1);
  snprintf (p, sizeof p, "%s/own/sub/x", root);
  int r2 = lstat (p, &st2);
  snprintf (p, sizeof p, "%s/etc", root);
  int r3 = lstat (p, &st3);
  TAP_OK (TAP_C_EQ (r1, 0) && TAP_C_EQ (r2, 0) && TAP_C_EQ (r3, 0) && TAP_C_EQ (st1.st_uid, 1234)
              && TAP_C_EQ (st1.st_gid, 1235) && TAP_C_EQ (st2.st_uid, 1234)
              && TAP_C_EQ (st3.st_uid, 0),
          "[%s] mkdir/write \"user\": what they create is the account's, nothing else", mode);
  f = fop (a, "{\"op\":\"stat\",\"path\":\"/own/sub/x\",\"names\":true}");
  TAP_OK (f.result && TAP_C_EQ_STR (jstr (f.result, "user"), "alice")
              && TAP_C_EQ_STR (jstr (f.result, "group"), "staff"),
          "[%s] stat \"names\": the owner's names from the root's accounts", mode);
  fres_free (&f);
  f = fop (a, "{\"op\":\"write\",\"path\":\"/own/y\",\"user\":\"bob\"}");
  TAP_OK (is_err (&f, "invalid_argument"), "[%s] write \"user\": unknown account", mode);
  fres_free (&f);
}

static void
file_suite (bool no_openat2)
{
  char root[PATH_MAX], outside[PATH_MAX];
  if (!tap_mkdtemp (root, sizeof root, "wr-agent-root")
      || !tap_mkdtemp (outside, sizeof outside, "wr-agent-out"))
    abort ();
  char p[PATH_MAX];
  snprintf (p, sizeof p, "%s/secret", outside);
  FILE *fp = fopen (p, "w");
  fputs ("SECRET", fp);
  fclose (fp);
  struct agent a = agent_start (root, no_openat2, -1, true);
  struct frame f;
  if (recv_frame (a.fd, &f, 5000) == 1)
    {
      json_t *j = json_loads (f.data, 0, NULL);
      const char *want = no_openat2 ? "walk" : "openat2";
      TAP_EQ_STR (jstr (j, "resolver"), want, "resolver is %s", want);
      json_decref (j);
      free (f.data);
    }
  test_files (&a, root, outside, no_openat2 ? "walk" : "openat2");
  test_watch (&a, root, outside, no_openat2 ? "walk" : "openat2");
  test_file_owner (&a, root, no_openat2 ? "walk" : "openat2");
  agent_stop (&a);
  snprintf (p, sizeof p, "rm -rf '%s' '%s'", root, outside);
  if (system (p) != 0)
    abort ();
}

/* ---- FILE "export": a writable layer as a pax stream (src/agent/upper.c) ---- */

struct tar_entry
{
  char name[512], link[512];
  int type; /* AE_IF* */
  int64_t size;
  bool hardlink, xattr;
  unsigned char md[16];
  uint64_t sum;
};

static size_t
tar_list (const char *data, size_t len, struct tar_entry *v, size_t max)
{
  struct archive *a = archive_read_new ();
  archive_read_support_format_tar (a);
  size_t n = 0;
  if (archive_read_open_memory (a, data, len) != ARCHIVE_OK)
    {
      archive_read_free (a);
      return 0;
    }
  struct archive_entry *e;
  while (n < max && archive_read_next_header (a, &e) == ARCHIVE_OK)
    {
      struct tar_entry *t = &v[n++];
      memset (t, 0, sizeof *t);
      snprintf (t->name, sizeof t->name, "%s", archive_entry_pathname (e));
      t->type = (int)archive_entry_filetype (e);
      t->size = archive_entry_size (e);
      const char *l = archive_entry_hardlink (e);
      t->hardlink = l != NULL;
      if (l == NULL)
        l = archive_entry_symlink (e);
      snprintf (t->link, sizeof t->link, "%s", l ? l : "");
      const char *xn;
      const void *xv;
      size_t xl;
      archive_entry_xattr_reset (e);
      while (archive_entry_xattr_next (e, &xn, &xv, &xl) == ARCHIVE_OK)
        t->xattr = t->xattr || (strcmp (xn, "user.k") == 0 && xl == 1 && memcmp (xv, "v", 1) == 0);
      char buf[65536];
      la_ssize_t got;
      while ((got = archive_read_data (a, buf, sizeof buf)) > 0)
        for (la_ssize_t i = 0; i < got; i++)
          t->sum = t->sum * 31 + (unsigned char)buf[i];
    }
  archive_read_free (a);
  return n;
}

static const struct tar_entry *
tar_find (const struct tar_entry *v, size_t n, const char *name)
{
  for (size_t i = 0; i < n; i++)
    if (strcmp (v[i].name, name) == 0)
      return &v[i];
  return NULL;
}

static void
test_export (void)
{
  char dir[] = "/tmp/wr-export-XXXXXX";
  if (mkdtemp (dir) == NULL)
    abort ();
  char p[PATH_MAX], longdir[300];
  snprintf (p, sizeof p, "%s/f", dir);
  FILE *f = fopen (p, "w");
  fputs ("hello", f);
  fclose (f);
  chmod (p, 0640);
  char p2[PATH_MAX];
  snprintf (p2, sizeof p2, "%s/x", dir);
  f = fopen (p2, "w");
  fputs ("hello", f);
  fclose (f);
  bool user_xattrs = setxattr (p2, "user.k", "v", 1, 0) == 0;
  snprintf (p2, sizeof p2, "%s/hl", dir);
  link (p, p2);
  snprintf (p2, sizeof p2, "%s/sym", dir);
  symlink ("f", p2);
  snprintf (p2, sizeof p2, "%s/sub", dir);
  mkdir (p2, 0755);
  bool opaque = setxattr (p2, "user.overlay.opaque", "y", 1, 0) == 0;
  setxattr (p2, "user.overlay.origin", "x", 1, 0); /* bookkeeping: stays behind */
  snprintf (p2, sizeof p2, "%s/sub/g", dir);
  close (open (p2, O_WRONLY | O_CREAT, 0644));
  snprintf (p2, sizeof p2, "%s/gone", dir);
  bool whiteout = mknod (p2, S_IFCHR | 0600, makedev (0, 0)) == 0;
  snprintf (p2, sizeof p2, "%s/fifo", dir);
  mkfifo (p2, 0600);
  memset (longdir, 'd', 150);
  longdir[150] = '\0';
  snprintf (p2, sizeof p2, "%s/%s", dir, longdir);
  mkdir (p2, 0755);
  snprintf (p2, sizeof p2, "%s/%s/long", dir, longdir);
  close (open (p2, O_WRONLY | O_CREAT, 0644));
  /* many chunks, so the stat below arrives while the export still runs */
  snprintf (p2, sizeof p2, "%s/big", dir);
  size_t big = (6u << 20) + 123;
  char *bd = malloc (big);
  uint64_t want_sum = 0;
  for (size_t i = 0; i < big; i++)
    {
      bd[i] = (char)(i * 7 + i / 4096);
      want_sum = want_sum * 31 + (unsigned char)bd[i];
    }
  int bfd = open (p2, O_WRONLY | O_CREAT, 0600);
  (void)!write (bfd, bd, big);
  close (bfd);
  free (bd);

  agent_upper = dir;
  struct agent a = agent_start (NULL, false, -1, true);
  agent_upper = NULL;
  struct frame hello;
  if (recv_frame (a.fd, &hello, 5000) == 1)
    free (hello.data);
  uint32_t s = next_stream++, s2 = next_stream++;
  send_json (a.fd, s, WR_MSG_FILE, "{\"op\":\"export\",\"path\":\"/\"}");
  send_json (a.fd, s2, WR_MSG_FILE, "{\"op\":\"stat\",\"path\":\"/\"}");
  char *data = NULL;
  size_t len = 0;
  append (&data, &len, "", 0);
  json_t *result = NULL, *error = NULL;
  bool stat_after = false, stat_early = false;
  for (;;)
    {
      struct frame fr;
      if (recv_frame (a.fd, &fr, 20000) <= 0)
        break;
      if (fr.stream == s2 && fr.type == WR_MSG_RESULT)
        {
          stat_after = result != NULL;
          stat_early = result == NULL;
        }
      else if (fr.stream == s && fr.type == WR_MSG_DATA)
        append (&data, &len, fr.data, fr.len);
      else if (fr.stream == s && (fr.type == WR_MSG_RESULT || fr.type == WR_MSG_ERROR))
        *(fr.type == WR_MSG_RESULT ? &result : &error) = json_loads (fr.data, 0, NULL);
      free (fr.data);
      if ((result || error) && (stat_after || stat_early))
        break;
    }
  TAP_OK (result && !error, "export: RESULT (error: %s)", error ? jstr (error, "message") : "-");
  TAP_OK (stat_after && !stat_early, "export: a request sent during it is answered after it");
  TAP_OK (len % 512 == 0 && len > big, "export: %zu bytes of tar", len);
  static struct tar_entry v[64];
  size_t n = tar_list (data, len, v, 64);
  const struct tar_entry *t;
  TAP_OK ((t = tar_find (v, n, "./")) && t->type == AE_IFDIR, "export: the root entry");
  TAP_OK ((t = tar_find (v, n, "x")) && t->type == AE_IFREG && t->size == 5
              && (t->xattr || !user_xattrs),
          "export: a file with its user xattr");
  TAP_OK ((t = tar_find (v, n, "hl")) && t->hardlink && strcmp (t->link, "f") == 0
              ? true
              : ((t = tar_find (v, n, "f")) && t->hardlink && strcmp (t->link, "hl") == 0),
          "export: a hard link as a link entry");
  TAP_OK ((t = tar_find (v, n, "sym")) && t->type == AE_IFLNK && strcmp (t->link, "f") == 0,
          "export: a symlink");
  TAP_OK (tar_find (v, n, "sub/") && tar_find (v, n, "sub/g"), "export: a directory and its file");
  TAP_OK (!opaque || tar_find (v, n, "sub/.wh..wh..opq"), "export: an opaque dir as .wh..wh..opq");
  TAP_OK (!whiteout || (tar_find (v, n, ".wh.gone") && !tar_find (v, n, "gone")),
          "export: a whiteout as .wh.NAME");
  TAP_OK (!tar_find (v, n, "fifo"), "export: a fifo is left out");
  snprintf (p2, sizeof p2, "%s/long", longdir);
  TAP_OK (tar_find (v, n, p2) != NULL, "export: a 155-byte path (pax)");
  TAP_OK ((t = tar_find (v, n, "big")) && t->size == (int64_t)big && t->sum == want_sum,
          "export: %zu bytes of file data intact", big);
  TAP_OK (result && jint (result, "entries") == (json_int_t)n - (opaque ? 0 : 0)
              && jint (result, "skipped") == 1
              && !json_is_true (json_object_get (result, "frozen")),
          "export: RESULT counts entries (%lld of %zu) and the skipped fifo",
          result ? (long long)jint (result, "entries") : -1, n);
  struct fres fe = fop (&a, "{\"op\":\"export\",\"path\":\"/etc\"}");
  TAP_OK (is_err (&fe, "invalid_argument"), "export: only of /");
  fres_free (&fe);
  /* the daemon's bound: an honest agent stops short of it and says why */
  fe = fop (&a, "{\"op\":\"export\",\"path\":\"/\",\"max_bytes\":1000000}");
  TAP_OK (is_err (&fe, "payload_too_large") && fe.len < 1000000
              && strstr (jstr (fe.error, "message"), "sparse"),
          "export: max_bytes refused before it is passed (%zu bytes sent: %s)", fe.len,
          fe.error ? jstr (fe.error, "message") : "-");
  fres_free (&fe);
  fe = fop (&a, "{\"op\":\"stat\",\"path\":\"/\"}");
  TAP_OK (fe.result != NULL, "export: the agent serves requests after a refused export");
  fres_free (&fe);
  json_decref (result);
  json_decref (error);
  free (data);
  agent_stop (&a);
  /* an agent without --upper (not a VM guest): a clear refusal */
  a = agent_start (NULL, false, -1, true);
  if (recv_frame (a.fd, &hello, 5000) == 1)
    free (hello.data);
  fe = fop (&a, "{\"op\":\"export\",\"path\":\"/\"}");
  TAP_OK (is_err (&fe, "unsupported") && strstr (jstr (fe.error, "message"), "wupper"),
          "export: no writable layer disk is 'unsupported' (%s)",
          fe.error ? jstr (fe.error, "message") : "-");
  fres_free (&fe);
  agent_stop (&a);
  char cmd[PATH_MAX + 16];
  snprintf (cmd, sizeof cmd, "rm -rf %s", dir);
  (void)!system (cmd);
}

/* ---- FILE "apply": a restore in place (src/agent/apply.c) ---- */

static void
tar_add (struct archive *w, const char *path, mode_t mode, unsigned uid, const char *data,
         const char *link)
{
  struct archive_entry *e = archive_entry_new ();
  archive_entry_set_pathname (e, path);
  archive_entry_set_mode (e, mode);
  archive_entry_set_uid (e, uid);
  archive_entry_set_gid (e, uid);
  archive_entry_set_mtime (e, 1000000000, 0);
  archive_entry_set_size (e, data ? (la_int64_t)strlen (data) : 0);
  if (link)
    archive_entry_set_symlink (e, link);
  archive_write_header (w, e);
  if (data)
    archive_write_data (w, data, strlen (data));
  archive_entry_free (e);
}

static bool
file_is (const char *dir, const char *rel, const char *want)
{
  char p[PATH_MAX], buf[64] = "";
  snprintf (p, sizeof p, "%s/%s", dir, rel);
  int fd = open (p, O_RDONLY | O_NOFOLLOW);
  if (fd < 0)
    return false;
  ssize_t n = read (fd, buf, sizeof buf - 1);
  close (fd);
  buf[n > 0 ? n : 0] = '\0';
  return strcmp (buf, want) == 0;
}

static void
test_apply (void)
{
  char dir[] = "/tmp/wr-apply-XXXXXX";
  if (mkdtemp (dir) == NULL)
    abort ();
  char cmd[PATH_MAX * 2];
  snprintf (cmd, sizeof cmd,
            "cd %s && echo old > keep && echo x > gone && mkdir -p olddir/sub wasdir"
            " && echo y > olddir/sub/f && echo z > wasdir/f",
            dir);
  (void)!system (cmd);
  char longname[200];
  memset (longname, 'n', 150);
  strcpy (longname + 150, "/deep");
  size_t cap = 1 << 20, used = 0;
  char *tar = malloc (cap);
  struct archive *w = archive_write_new ();
  archive_write_set_format_pax_restricted (w);
  archive_write_open_memory (w, tar, cap, &used);
  tar_add (w, ".wh.gone", S_IFREG | 0600, 0, NULL, NULL);
  tar_add (w, ".wh.olddir", S_IFREG | 0600, 0, NULL, NULL);
  tar_add (w, ".wh.nothere", S_IFREG | 0600, 0, NULL, NULL);
  tar_add (w, "newdir", S_IFDIR | 0750, 1234, NULL, NULL);
  tar_add (w, "newdir/f", S_IFREG | 0600, 1234, "abc", NULL);
  tar_add (w, "keep", S_IFREG | 0644, 0, "new", NULL);
  tar_add (w, "ln", S_IFLNK | 0777, 0, NULL, "keep");
  tar_add (w, "wasdir", S_IFREG | 0644, 0, "file now", NULL);
  tar_add (w, longname, S_IFREG | 0644, 0, NULL, NULL); /* parent missing: left out */
  tar_add (w, "ok-dir-for-long", S_IFDIR | 0755, 0, NULL, NULL);
  archive_write_close (w);
  archive_write_free (w);

  struct agent a = agent_start (dir, false, -1, true);
  struct frame hello;
  if (recv_frame (a.fd, &hello, 5000) == 1)
    free (hello.data);
  uint32_t s = next_stream++, s2 = next_stream++;
  send_json (a.fd, s, WR_MSG_FILE, "{\"op\":\"apply\",\"path\":\"/\"}");
  /* odd-sized frames: headers and data cut anywhere */
  size_t off = 0;
  bool sent_stat = false;
  while (off < used)
    {
      size_t n = used - off < 700 ? used - off : 700;
      wr_frame_write (a.fd, s, WR_MSG_DATA, tar + off, (uint32_t)n);
      off += n;
      if (!sent_stat)
        {
          /* held until the apply ends: it sees the restored tree */
          send_json (a.fd, s2, WR_MSG_FILE, "{\"op\":\"stat\",\"path\":\"/keep\"}");
          sent_stat = true;
        }
    }
  wr_frame_write (a.fd, s, WR_MSG_DATA, "", 0);
  json_t *result = NULL, *error = NULL, *st = NULL;
  bool stat_first = false;
  while (!((result || error) && st))
    {
      struct frame fr;
      if (recv_frame (a.fd, &fr, 10000) <= 0)
        break;
      if (fr.stream == s && (fr.type == WR_MSG_RESULT || fr.type == WR_MSG_ERROR))
        *(fr.type == WR_MSG_RESULT ? &result : &error) = json_loads (fr.data, 0, NULL);
      else if (fr.stream == s2 && fr.type == WR_MSG_RESULT)
        {
          st = json_loads (fr.data, 0, NULL);
          stat_first = result == NULL && error == NULL;
        }
      free (fr.data);
    }
  TAP_OK (result && !error, "apply: RESULT (%s)", error ? jstr (error, "message") : "ok");
  TAP_OK (st && !stat_first && jint (st, "size") == 3,
          "apply: a request sent during it is answered after it, on the restored tree");
  char p[PATH_MAX];
  struct stat sb;
  snprintf (p, sizeof p, "%s/gone", dir);
  bool gone = lstat (p, &sb) < 0;
  snprintf (p, sizeof p, "%s/olddir", dir);
  TAP_OK (gone && lstat (p, &sb) < 0, "apply: .wh. entries remove files and whole directories");
  snprintf (p, sizeof p, "%s/newdir/f", dir);
  TAP_OK (file_is (dir, "newdir/f", "abc") && lstat (p, &sb) == 0 && sb.st_uid == 1234
              && (sb.st_mode & 07777) == 0600,
          "apply: a new file with its owner and mode");
  snprintf (p, sizeof p, "%s/newdir", dir);
  TAP_OK (lstat (p, &sb) == 0 && S_ISDIR (sb.st_mode) && (sb.st_mode & 07777) == 0750
              && sb.st_uid == 1234,
          "apply: a new directory with its owner and mode");
  TAP_OK (file_is (dir, "keep", "new"), "apply: a file replaced");
  char target[64] = "";
  snprintf (p, sizeof p, "%s/ln", dir);
  (void)!readlink (p, target, sizeof target - 1);
  TAP_OK (strcmp (target, "keep") == 0, "apply: a symlink");
  TAP_OK (file_is (dir, "wasdir", "file now"), "apply: a directory replaced by a file");
  snprintf (p, sizeof p, "%s/ok-dir-for-long", dir);
  TAP_OK (lstat (p, &sb) == 0 && S_ISDIR (sb.st_mode),
          "apply: entries after a long (pax) path whose parent is missing");
  json_decref (result);
  json_decref (error);
  json_decref (st);
  agent_stop (&a);
  free (tar);
  snprintf (cmd, sizeof cmd, "rm -rf %s", dir);
  (void)!system (cmd);
}

int
main (void)
{
  alarm (240);
  signal (SIGPIPE, SIG_IGN);
  const char *env = getenv ("WARREN_AGENT");
  const char *build = getenv ("WARREN_BUILD");
  if (env)
    snprintf (agent_bin, sizeof agent_bin, "%s", env);
  else if (build)
    snprintf (agent_bin, sizeof agent_bin, "%s/bin/warren-agent", build);
  else
    {
      char self[PATH_MAX - 64];
      ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 1);
      self[n > 0 ? n : 0] = 0;
      char *slash = strrchr (self, '/');
      if (slash)
        *slash = 0;
      snprintf (agent_bin, sizeof agent_bin, "%s/../bin/warren-agent", self);
    }
  if (access (agent_bin, X_OK) != 0)
    {
      TAP_OK (0, "agent binary %s missing", agent_bin);
      return TAP_DONE ();
    }

  struct agent a = agent_start (NULL, false, -1, true);
  test_hello (&a);
  TAP_OK (ping (&a, "hello-ping"), "PING -> PONG with the same payload");
  test_exec_basic (&a);
  test_exec_errors (&a);
  test_stdin (&a);
  test_signal (&a);
  test_concurrent (&a);
  test_background_no_wait (&a);
  test_timeout_tree (&a);
  test_output_cap (&a);
  test_tty (&a);
  test_exec_user (&a);
  test_pid1_duties (&a);
  agent_stop (&a);

  file_suite (false);
  file_suite (true);
  test_connections ();
  test_export ();
  test_apply ();

  return TAP_DONE ();
}

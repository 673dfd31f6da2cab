/* EXEC requests: posix_spawn a process in its own session, stream its output
 * with caps and backpressure, feed its stdin, enforce its timeout, and report
 * exit status and usage once it has been reaped. */
#include "agent/agent.h"
#include "agent/zygote.h"
#include "common/proto.h"
#include "common/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <termios.h>

#define container_of(p, type, member) ((type *)((char *)(p)-offsetof (type, member)))

#define DEFAULT_CAP (1u << 20)
#define MAX_ARGS 65536

struct exec;

struct out_pipe
{
  struct ag_watch w;
  struct exec *e;
  uint8_t type;
  uint64_t cap, sent;
  bool truncated;
  bool eof;
};

struct exec
{
  struct ag_req r;
  pid_t pid;
  bool tty;
  bool timed_out;
  struct out_pipe out[2];
  struct ag_watch in; /* stdin pipe (or a dup of the pty master) */
  uint8_t *inbuf;
  size_t in_len, in_off;
  bool in_eof;
  uint64_t start_ns, deadline_ms;
  struct ag_exec_cg cg; /* VM guests: the exec's own cgroup */
  struct ag_call call;  /* fncall: ids, limits, scratch; swept after exit */
};

static bool output_paused;

/* Signals PID 1 ignores; children get them back at their defaults. */
static const int ignored_signals[] = { SIGHUP,  SIGINT,  SIGQUIT, SIGPIPE, SIGALRM, SIGTERM,
                                       SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU };

/* ---- output ---- */

/* One read; true when data came (more may follow). */
static bool
out_read (struct out_pipe *o)
{
  static uint8_t buf[AG_CHUNK];
  if (o->w.fd < 0 || o->eof)
    return false;
  ssize_t n = read (o->w.fd, buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN))
    return false;
  if (n <= 0)
    {
      /* EOF, or EIO from a pty master once the slave side is gone. The
       * master stays open until the process is reaped: closing it hangs
       * up the tty and would SIGHUP a process that is about to exit. */
      o->eof = true;
      ag_watch_set (&o->w, 0);
      return false;
    }
  size_t fwd = 0;
  if (o->sent < o->cap)
    fwd = o->cap - o->sent < (uint64_t)n ? (size_t)(o->cap - o->sent) : (size_t)n;
  if (fwd < (size_t)n)
    o->truncated = true;
  if (fwd > 0 && !o->e->r.orphan)
    ag_send (o->e->r.stream, o->type, buf, fwd);
  o->sent += fwd;
  return true;
}

static void
out_cb (struct ag_watch *w, uint32_t events)
{
  out_read (container_of (w, struct out_pipe, w));
}

void
ag_exec_pause_output (bool pause)
{
  output_paused = pause;
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->kind == AG_REQ_EXEC)
      {
        struct exec *e = (struct exec *)r;
        for (int i = 0; i < 2; i++)
          if (e->out[i].w.fd >= 0 && !e->out[i].eof)
            ag_watch_set (&e->out[i].w, pause ? 0 : EPOLLIN);
      }
}

/* ---- stdin ---- */

static void
in_close (struct exec *e)
{
  ag.stdin_bytes -= e->in_len - e->in_off;
  free (e->inbuf);
  e->inbuf = NULL;
  e->in_len = e->in_off = 0;
  e->in_eof = true;
  ag_watch_close (&e->in);
}

static void
in_flush (struct exec *e)
{
  while (e->in_off < e->in_len)
    {
      ssize_t n = write (e->in.fd, e->inbuf + e->in_off, e->in_len - e->in_off);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0 && errno == EAGAIN)
        {
          ag_watch_set (&e->in, EPOLLOUT);
          return;
        }
      if (n < 0)
        {
          in_close (e); /* EPIPE: the process closed its stdin */
          return;
        }
      e->in_off += (size_t)n;
      ag.stdin_bytes -= (size_t)n;
    }
  free (e->inbuf);
  e->inbuf = NULL;
  e->in_len = e->in_off = 0;
  if (e->in_eof)
    {
      if (e->tty)
        {
          /* A pty has no half close: VEOF makes a canonical-mode read return 0. */
          char eof = 4;
          if (write (e->in.fd, &eof, 1) < 0)
            {
            }
        }
      in_close (e);
    }
  else
    ag_watch_set (&e->in, 0);
}

static void
in_cb (struct ag_watch *w, uint32_t events)
{
  struct exec *e = container_of (w, struct exec, in);
  if (e->in.fd >= 0)
    in_flush (e);
}

void
ag_exec_stdin (struct ag_req *r, const uint8_t *data, size_t len)
{
  if (r->kind != AG_REQ_EXEC)
    return;
  struct exec *e = (struct exec *)r;
  if (e->in.fd < 0 || e->in_eof)
    return; /* no stdin pipe, or already closed: discard */
  if (len == 0)
    e->in_eof = true;
  else
    {
      if (e->in_off > 0)
        {
          memmove (e->inbuf, e->inbuf + e->in_off, e->in_len - e->in_off);
          e->in_len -= e->in_off;
          e->in_off = 0;
        }
      uint8_t *nb = realloc (e->inbuf, e->in_len + len);
      if (nb == NULL)
        {
          in_close (e);
          return;
        }
      e->inbuf = nb;
      memcpy (e->inbuf + e->in_len, data, len);
      e->in_len += len;
      ag.stdin_bytes += len;
    }
  if (e->in.events == 0)
    in_flush (e);
}

/* ---- lifecycle ---- */

static void
exec_free (struct exec *e)
{
  ag_req_unlink (&e->r);
  ag_watch_close (&e->out[0].w);
  ag_watch_close (&e->out[1].w);
  in_close (e);
  ag_cg_exec_release (&e->cg);
  ag_defer_free (e);
}

void
ag_exec_orphan (struct ag_req *r)
{
  struct exec *e = (struct exec *)r;
  r->orphan = true;
  in_close (e); /* nobody can feed it anymore */
}

static json_t *
exit_json (int exit_code, int sig, bool timed_out, bool out_trunc, bool err_trunc,
           uint64_t duration_ms, const struct rusage *ru)
{
  json_int_t user = 0, sys = 0, rss = 0;
  if (ru)
    {
      user = (json_int_t)ru->ru_utime.tv_sec * 1000 + ru->ru_utime.tv_usec / 1000;
      sys = (json_int_t)ru->ru_stime.tv_sec * 1000 + ru->ru_stime.tv_usec / 1000;
      rss = ru->ru_maxrss;
    }
  return json_pack ("{s:i,s:i,s:b,s:b,s:b,s:I,s:{s:I,s:I,s:I}}", "exit_code", exit_code, "signal",
                    sig, "timed_out", timed_out, "stdout_truncated", out_trunc, "stderr_truncated",
                    err_trunc, "duration_ms", (json_int_t)duration_ms, "usage", "cpu_user_ms", user,
                    "cpu_system_ms", sys, "max_rss_kb", rss);
}

void
ag_exec_reaped (pid_t pid, int status, const struct rusage *ru)
{
  struct exec *e = NULL;
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->kind == AG_REQ_EXEC && ((struct exec *)r)->pid == pid)
      {
        e = (struct exec *)r;
        break;
      }
  if (e == NULL)
    return; /* an orphaned grandchild: reaping it was the point */
  /* Take what is already in the pipes but do not wait for EOF: background
   * children may hold the write ends forever. */
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 32 && out_read (&e->out[i]); k++)
      ;
  if (e->call.on)
    ag_call_cleanup (&e->call); /* before EXIT: the next call must find it clean */
  if (!e->r.orphan)
    {
      int code = WIFEXITED (status) ? WEXITSTATUS (status) : -1;
      int sig = WIFSIGNALED (status) ? WTERMSIG (status) : 0;
      uint64_t dur = (wr_now_ns () - e->start_ns) / 1000000;
      json_t *j
          = exit_json (code, sig, e->timed_out, e->out[0].truncated, e->out[1].truncated, dur, ru);
      /* only where the agent can tell: the daemon asks the backend otherwise */
      int oom = ag_cg_exec_oom (&e->cg);
      if (oom >= 0)
        json_object_set_new (json_object_get (j, "usage"), "oom_killed", json_boolean (oom));
      ag_send_json (e->r.stream, WR_MSG_EXIT, j);
    }
  exec_free (e);
}

void
ag_kill_session (pid_t sid)
{
  pid_t self = getpid ();
  for (int pass = 0; pass < 8; pass++)
    {
      _cleanup_closedir_ DIR *d = opendir ("/proc");
      if (d == NULL)
        return;
      int found = 0;
      struct dirent *de;
      while ((de = readdir (d)) != NULL)
        {
          char *end;
          long pid = strtol (de->d_name, &end, 10);
          if (*end || pid <= 0 || pid == self)
            continue;
          char path[64], buf[512];
          snprintf (path, sizeof path, "%ld/stat", pid);
          _cleanup_close_ int fd = openat (dirfd (d), path, O_RDONLY | O_CLOEXEC);
          if (fd < 0)
            continue;
          ssize_t n = read (fd, buf, sizeof buf - 1);
          if (n <= 0)
            continue;
          buf[n] = '\0';
          /* comm may contain anything, ")" included: parse after the last one */
          char *p = strrchr (buf, ')');
          char state;
          int ppid, pgrp, session;
          if (p == NULL || sscanf (p + 1, " %c %d %d %d", &state, &ppid, &pgrp, &session) != 4)
            continue;
          if (session == sid && state != 'Z' && state != 'X')
            {
              kill ((pid_t)pid, SIGKILL);
              found++;
            }
        }
      if (!found)
        return;
    }
}

int
ag_exec_timeouts (uint64_t now_ms)
{
  int next = -1;
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    {
      if (r->kind != AG_REQ_EXEC)
        continue;
      struct exec *e = (struct exec *)r;
      if (e->deadline_ms == 0 || e->timed_out)
        continue;
      if (now_ms >= e->deadline_ms)
        {
          e->timed_out = true;
          ag_cg_exec_kill (&e->cg);
          kill (-e->pid, SIGKILL);
          ag_kill_session (e->pid);
          continue;
        }
      uint64_t left = e->deadline_ms - now_ms;
      if (next < 0 || left < (uint64_t)next)
        next = left > INT_MAX ? INT_MAX : (int)left;
    }
  return next;
}

void
ag_exec_signal (struct ag_req *r, const uint8_t *data, size_t len)
{
  if (r->kind != AG_REQ_EXEC)
    return;
  struct exec *e = (struct exec *)r;
  json_t *j = json_loadb ((const char *)data, len, 0, NULL);
  json_t *v = json_object_get (j, "signal");
  json_t *rows = json_object_get (j, "rows"), *cols = json_object_get (j, "cols");
  /* {"rows","cols"} without "signal": resize the pty; the kernel sends
   * SIGWINCH to its foreground process group */
  if (v == NULL && e->tty && e->out[0].w.fd >= 0 && json_is_integer (rows) && json_is_integer (cols)
      && json_integer_value (rows) > 0 && json_integer_value (rows) <= 65535
      && json_integer_value (cols) > 0 && json_integer_value (cols) <= 65535)
    {
      struct winsize ws = { .ws_row = (unsigned short)json_integer_value (rows),
                            .ws_col = (unsigned short)json_integer_value (cols) };
      ioctl (e->out[0].w.fd, TIOCSWINSZ, &ws);
    }
  /* A bad SIGNAL is ignored: an ERROR would end a stream that is still live. */
  if (json_is_integer (v) && json_integer_value (v) > 0 && json_integer_value (v) < NSIG)
    {
      int sig = (int)json_integer_value (v);
      if (sig == SIGKILL)
        ag_cg_exec_kill (&e->cg);
      kill (-e->pid, sig);
      if (sig == SIGKILL)
        ag_kill_session (e->pid);
    }
  json_decref (j);
}

/* ---- spawn ---- */

struct strv
{
  char **v;
  size_t n, cap;
};

static void
strv_free (struct strv *s)
{
  for (size_t i = 0; i < s->n; i++)
    free (s->v[i]);
  free (s->v);
}

static int
strv_push (struct strv *s, const char *str, size_t len)
{
  if (s->n + 2 > MAX_ARGS)
    return -E2BIG;
  if (s->n + 2 > s->cap)
    {
      size_t cap = s->cap ? s->cap * 2 : 8;
      char **nv = realloc (s->v, cap * sizeof *nv);
      if (nv == NULL)
        return -ENOMEM;
      s->v = nv;
      s->cap = cap;
    }
  if ((s->v[s->n] = strndup (str, len)) == NULL)
    return -ENOMEM;
  s->n++;
  s->v[s->n] = NULL;
  return 0;
}

static int
get_json_str (json_t *v, const char *what, const char **ret, wr_err_t *err)
{
  if (!json_is_string (v))
    return wr_error (err, EINVAL, WR_E_INVALID, "%s must be a string", what);
  if (strlen (json_string_value (v)) != json_string_length (v))
    return wr_error (err, EINVAL, WR_E_INVALID, "%s contains a NUL byte", what);
  *ret = json_string_value (v);
  return 0;
}

struct spec
{
  struct strv argv, env;
  const char *cwd;
  uint64_t timeout_ms, caps[2];
  bool want_stdin, tty, has_user;
  unsigned short rows, cols;
  struct ag_user user; /* "user": run as this account of the sandbox */
};

static int
get_u64 (json_t *body, const char *key, uint64_t def, uint64_t max, uint64_t *ret, wr_err_t *err)
{
  json_t *v = json_object_get (body, key);
  if (v == NULL || json_is_null (v))
    *ret = def;
  else if (!json_is_integer (v) || json_integer_value (v) < 0
           || (uint64_t)json_integer_value (v) > max)
    return wr_error (err, EINVAL, WR_E_INVALID, "\"%s\" must be an integer in [0, %llu]", key,
                     (unsigned long long)max);
  else
    *ret = (uint64_t)json_integer_value (v);
  return 0;
}

static int
get_flag (json_t *body, const char *key, bool *ret, wr_err_t *err)
{
  json_t *v = json_object_get (body, key);
  if (v == NULL || json_is_null (v))
    *ret = false;
  else if (!json_is_boolean (v))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"%s\" must be a boolean", key);
  else
    *ret = json_is_true (v);
  return 0;
}

static int
parse_spec (json_t *body, struct spec *s, wr_err_t *err)
{
  json_t *cmd = json_object_get (body, "cmd"), *shell = json_object_get (body, "shell");
  const char *str;
  if ((cmd == NULL) == (shell == NULL))
    return wr_error (err, EINVAL, WR_E_INVALID, "exactly one of \"cmd\" and \"shell\" is required");
  if (cmd)
    {
      if (!json_is_array (cmd) || json_array_size (cmd) == 0)
        return wr_error (err, EINVAL, WR_E_INVALID, "\"cmd\" must be a non-empty array of strings");
      size_t i;
      json_t *v;
      json_array_foreach (cmd, i, v)
      {
        if (get_json_str (v, "\"cmd\" element", &str, err) < 0)
          return -EINVAL;
        if (strv_push (&s->argv, str, strlen (str)) < 0)
          return wr_error (err, E2BIG, WR_E_INVALID, "\"cmd\" too long");
      }
      if (s->argv.v[0][0] == '\0')
        return wr_error (err, EINVAL, WR_E_INVALID, "\"cmd\"[0] is empty");
    }
  else
    {
      if (get_json_str (shell, "\"shell\"", &str, err) < 0)
        return -EINVAL;
      if (strv_push (&s->argv, "/bin/sh", 7) < 0 || strv_push (&s->argv, "-c", 2) < 0
          || strv_push (&s->argv, str, strlen (str)) < 0)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }

  json_t *env = json_object_get (body, "env");
  if (env == NULL || json_is_null (env))
    {
      static const char *defenv[] = { "PATH=" WR_DEFAULT_PATH, "HOME=/root", "TERM=xterm" };
      for (size_t i = 0; i < WR_ARRAY_SIZE (defenv); i++)
        if (strv_push (&s->env, defenv[i], strlen (defenv[i])) < 0)
          return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }
  else if (json_is_array (env))
    {
      size_t i;
      json_t *v;
      json_array_foreach (env, i, v)
      {
        if (get_json_str (v, "\"env\" element", &str, err) < 0)
          return -EINVAL;
        if (strchr (str, '=') == NULL || str[0] == '=')
          return wr_error (err, EINVAL, WR_E_INVALID, "\"env\" element \"%s\" is not K=V", str);
        if (strv_push (&s->env, str, strlen (str)) < 0)
          return wr_error (err, E2BIG, WR_E_INVALID, "\"env\" too long");
      }
    }
  else if (json_is_object (env))
    {
      const char *k;
      json_t *v;
      json_object_foreach (env, k, v)
      {
        if (get_json_str (v, "\"env\" value", &str, err) < 0)
          return -EINVAL;
        if (k[0] == '\0' || strchr (k, '='))
          return wr_error (err, EINVAL, WR_E_INVALID, "bad \"env\" name \"%s\"", k);
        _cleanup_free_ char *kv = NULL;
        if (asprintf (&kv, "%s=%s", k, str) < 0)
          return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
        if (strv_push (&s->env, kv, strlen (kv)) < 0)
          return wr_error (err, E2BIG, WR_E_INVALID, "\"env\" too long");
      }
    }
  else
    return wr_error (err, EINVAL, WR_E_INVALID, "\"env\" must be an array of \"K=V\" strings");

  json_t *cwd = json_object_get (body, "cwd");
  if (cwd && !json_is_null (cwd))
    {
      if (get_json_str (cwd, "\"cwd\"", &s->cwd, err) < 0)
        return -EINVAL;
      if (s->cwd[0] == '\0')
        return wr_error (err, EINVAL, WR_E_INVALID, "\"cwd\" is empty");
    }
  uint64_t rows, cols;
  if (get_u64 (body, "timeout_ms", 0, UINT32_MAX * 1000ull, &s->timeout_ms, err) < 0
      || get_u64 (body, "stdout_cap", DEFAULT_CAP, INT64_MAX, &s->caps[0], err) < 0
      || get_u64 (body, "stderr_cap", DEFAULT_CAP, INT64_MAX, &s->caps[1], err) < 0
      || get_u64 (body, "rows", 24, 65535, &rows, err) < 0
      || get_u64 (body, "cols", 80, 65535, &cols, err) < 0
      || get_flag (body, "stdin", &s->want_stdin, err) < 0
      || get_flag (body, "tty", &s->tty, err) < 0
      || ag_user_of (body, &s->user, &s->has_user, err) < 0)
    return -EINVAL;
  s->rows = (unsigned short)rows;
  s->cols = (unsigned short)cols;
  return 0;
}

/* execvp-like lookup, but in the PATH the process will get. */
static int
search_path (const char *pathvar, const char *name, int cwdfd, char *ret, size_t retsz)
{
  int e = ENOENT;
  const char *p = pathvar;
  for (;;)
    {
      const char *end = strchrnul (p, ':');
      int n = snprintf (ret, retsz, "%.*s%s%s", (int)(end - p), p, end == p ? "" : "/", name);
      if (n > 0 && (size_t)n < retsz)
        {
          struct stat st;
          if (fstatat (cwdfd, ret, &st, 0) == 0)
            {
              if (S_ISREG (st.st_mode) && faccessat (cwdfd, ret, X_OK, AT_EACCESS) == 0)
                return 0;
              e = EACCES;
            }
        }
      if (*end == '\0')
        return -e;
      p = end + 1;
    }
}

static void
send_exec_failure (uint32_t stream, int errnum, const char *fmt, ...)
{
  char msg[700];
  va_list ap;
  va_start (ap, fmt);
  int n = vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  if (n >= 0 && (size_t)n < sizeof msg)
    snprintf (msg + n, sizeof msg - (size_t)n, ": %s", strerror (errnum));
  int code = errnum == ENOENT || errnum == ENOTDIR ? 127 : 126;
  json_t *j = exit_json (code, 0, false, false, false, 0, NULL);
  json_object_set_new (j, "error", ag_json_lossy (msg, strlen (msg)));
  ag_send_json (stream, WR_MSG_EXIT, j);
}

/* Pipe with the agent's end non-blocking and the child's end blocking. */
static int
agent_pipe (int fds[2], int agent_end)
{
  if (pipe2 (fds, O_CLOEXEC) < 0)
    return -errno;
  int fl = fcntl (fds[agent_end], F_GETFL);
  fcntl (fds[agent_end], F_SETFL, fl | O_NONBLOCK);
  return 0;
}

static int
open_pty (int *ret_master, char *slave, size_t slavesz, unsigned short rows, unsigned short cols)
{
  _cleanup_close_ int m = open ("/dev/ptmx", O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
  if (m < 0)
    return -errno;
  int unlock = 0;
  unsigned int n;
  if (ioctl (m, TIOCSPTLCK, &unlock) < 0 || ioctl (m, TIOCGPTN, &n) < 0)
    return -errno;
  struct winsize ws = { .ws_row = rows, .ws_col = cols };
  ioctl (m, TIOCSWINSZ, &ws);
  snprintf (slave, slavesz, "/dev/pts/%u", n);
  *ret_master = TAKE_FD (m);
  return 0;
}

/* posix_spawn's work by hand, for a child that must join the exec's
 * cgroup before it runs anything of the task's (a fork bomb must never
 * start in the agent's cgroup). Like glibc's posix_spawn: clone with
 * CLONE_VM | CLONE_VFORK on a stack of its own, so no page table is copied
 * and we resume once the child has exec'd (or failed). Returns 0 or an
 * errno value. */
struct spawn_ctx
{
  const struct ag_exec_cg *cg;
  const char *file;
  char **argv, **envp;
  int cwdfd;
  const char *slave;
  const int *fds;
  const sigset_t *dfl;
  const struct ag_user *user; /* NULL: stay root */
  int err;                    /* set by the child when it fails before or at execve */
};

static int
spawn_child (void *arg)
{
  struct spawn_ctx *c = arg;
  int e = -ag_cg_exec_join (c->cg);
  if (e == 0)
    {
      struct sigaction sa = { .sa_handler = SIG_DFL };
      for (int sig = 1; sig < NSIG; sig++)
        if (sigismember (c->dfl, sig) == 1)
          sigaction (sig, &sa, NULL);
      sigset_t none;
      sigemptyset (&none);
      sigprocmask (SIG_SETMASK, &none, NULL);
      if (setsid () < 0 || (c->cwdfd >= 0 && fchdir (c->cwdfd) < 0))
        e = errno;
    }
  if (e == 0 && c->slave)
    {
      int t = open (c->slave, O_RDWR); /* after setsid: the controlling tty */
      if (t < 0 || dup2 (t, 0) < 0 || dup2 (t, 1) < 0 || dup2 (t, 2) < 0)
        e = errno;
      else if (t > 2)
        close (t);
    }
  else if (e == 0)
    for (int i = 0; i < 3 && e == 0; i++)
      if (dup2 (c->fds[i], i) < 0)
        e = errno;
  /* the account last (the tty is opened as root): raw syscalls, as
   * glibc's own spawn child does, since this child shares our memory */
  if (e == 0 && c->user
      && (syscall (SYS_setgroups, c->user->n_groups, c->user->groups) < 0
          || syscall (SYS_setresgid, c->user->gid, c->user->gid, c->user->gid) < 0
          || syscall (SYS_setresuid, c->user->uid, c->user->uid, c->user->uid) < 0))
    e = errno;
  if (e == 0)
    {
      execve (c->file, c->argv, c->envp);
      e = errno;
    }
  c->err = e ? e : EIO;
  _exit (127);
}

static int
spawn_in_cgroup (const struct ag_exec_cg *c, const char *file, char **argv, char **envp, int cwdfd,
                 const char *slave, const int fds[3], const sigset_t *dfl,
                 const struct ag_user *user, pid_t *ret_pid)
{
  /* one child at a time (CLONE_VFORK) and a single-threaded agent: one
   * stack serves every spawn; only the pages it touches are ever mapped */
  static uint8_t stack[64 << 10] __attribute__ ((aligned (16)));
  struct spawn_ctx ctx = { .cg = c,
                           .file = file,
                           .argv = argv,
                           .envp = envp,
                           .cwdfd = cwdfd,
                           .slave = slave,
                           .fds = fds,
                           .dfl = dfl,
                           .user = user };
  pid_t pid = clone (spawn_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &ctx);
  if (pid < 0)
    return errno;
  if (ctx.err)
    return ctx.err; /* the child exits 127 and is reaped as an orphan */
  *ret_pid = pid;
  return 0;
}

void
ag_exec_start (uint32_t stream, json_t *body)
{
  wr_err_t err = { 0 };
  _cleanup_ (strv_free) struct strv argv = { 0 }, env = { 0 };
  struct spec s = { 0 };
  int r = parse_spec (body, &s, &err);
  argv = s.argv;
  env = s.env;
  struct ag_call call;
  if (r == 0 && (r = ag_call_parse (body, &call, &err)) == 0 && call.on)
    {
      if (s.tty || s.has_user)
        r = wr_error (&err, EINVAL, WR_E_INVALID,
                      "\"call\" mixes with neither \"tty\" nor \"user\"");
      else if ((r = ag_call_prepare (&call, &err)) == 0)
        s.cwd = call.scratch;
    }
  if (r < 0)
    {
      ag_send_error (stream, &err);
      return;
    }

  _cleanup_close_ int cwdfd = -1;
  if (s.cwd)
    {
      cwdfd = open (s.cwd, O_PATH | O_DIRECTORY | O_CLOEXEC);
      if (cwdfd < 0)
        {
          send_exec_failure (stream, errno, "chdir \"%s\"", s.cwd);
          return;
        }
    }

  const char *file = argv.v[0];
  char found[PATH_MAX];
  if (strchr (file, '/') == NULL)
    {
      const char *pathvar = WR_DEFAULT_PATH;
      for (size_t i = 0; i < env.n; i++)
        if (strncmp (env.v[i], "PATH=", 5) == 0)
          pathvar = env.v[i] + 5;
      r = search_path (pathvar, file, cwdfd >= 0 ? cwdfd : AT_FDCWD, found, sizeof found);
      if (r < 0)
        {
          send_exec_failure (stream, -r, "exec \"%s\"", file);
          return;
        }
      file = found;
    }

  _cleanup_close_ int in_r = -1, in_w = -1, out_r = -1, out_w = -1, err_r = -1, err_w = -1,
                      master = -1;
  char slave[64];
  r = 0;
  if (s.tty)
    {
      r = open_pty (&master, slave, sizeof slave, s.rows, s.cols);
      if (r < 0)
        {
          ag_send_errorf (stream, -r, WR_E_UNSUPPORTED, "tty: open /dev/ptmx");
          return;
        }
      if (s.want_stdin && (in_w = fcntl (master, F_DUPFD_CLOEXEC, 3)) < 0)
        r = -errno;
    }
  else
    {
      int p[2];
      if (r == 0 && (r = agent_pipe (p, 0)) == 0)
        out_r = p[0], out_w = p[1];
      if (r == 0 && (r = agent_pipe (p, 0)) == 0)
        err_r = p[0], err_w = p[1];
      if (r == 0 && (s.want_stdin || ag.devnull < 0) && (r = agent_pipe (p, 1)) == 0)
        {
          in_r = p[0], in_w = p[1];
          if (!s.want_stdin)
            {
              close (in_w); /* no /dev/null: an empty pipe reads as EOF too */
              in_w = -1;
            }
        }
    }
  if (r < 0)
    {
      ag_send_errorf (stream, -r, WR_E_EXHAUSTED, "pipe");
      return;
    }

  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init (&fa);
  posix_spawnattr_init (&attr);
  sigset_t none, dfl;
  sigemptyset (&none);
  sigemptyset (&dfl);
  for (size_t i = 0; i < WR_ARRAY_SIZE (ignored_signals); i++)
    sigaddset (&dfl, ignored_signals[i]);
  sigaddset (&dfl, SIGCHLD);
  posix_spawnattr_setflags (&attr,
                            POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setsigmask (&attr, &none);
  posix_spawnattr_setsigdefault (&attr, &dfl);
  if (cwdfd >= 0)
    posix_spawn_file_actions_addfchdir_np (&fa, cwdfd);
  if (s.tty)
    {
      /* Opened after setsid without O_NOCTTY: becomes the controlling tty. */
      posix_spawn_file_actions_addopen (&fa, 0, slave, O_RDWR, 0);
      posix_spawn_file_actions_adddup2 (&fa, 0, 1);
      posix_spawn_file_actions_adddup2 (&fa, 0, 2);
    }
  else
    {
      posix_spawn_file_actions_adddup2 (&fa, in_r >= 0 ? in_r : ag.devnull, 0);
      posix_spawn_file_actions_adddup2 (&fa, out_w, 1);
      posix_spawn_file_actions_adddup2 (&fa, err_w, 2);
    }
  pid_t pid;
  struct ag_exec_cg ecg = { .dir_fd = -1 };
  if (!call.on && ag_cg_enabled () && (r = ag_cg_exec_create (stream, &ecg)) < 0)
    {
      posix_spawn_file_actions_destroy (&fa);
      posix_spawnattr_destroy (&attr);
      ag_send_errorf (stream, -r, WR_E_EXHAUSTED, "exec cgroup");
      return;
    }
  uint64_t start = wr_now_ns ();
  if (ecg.dir_fd >= 0 || s.has_user)
    {
      /* posix_spawn cannot change the account: the clone path can */
      int fds[3] = { in_r >= 0 ? in_r : ag.devnull, out_w, err_w };
      r = spawn_in_cgroup (&ecg, file, argv.v, env.v, cwdfd, s.tty ? slave : NULL, fds, &dfl,
                           s.has_user ? &s.user : NULL, &pid);
    }
  else if (call.on)
    {
      int fds[3] = { in_r >= 0 ? in_r : ag.devnull, out_w, err_w };
      pid = ag_call_spawn (&call, file, argv.v, env.v, fds);
      r = pid < 0 ? (int)-pid : 0;
      if (r)
        ag_call_cleanup (&call);
    }
  else
    r = posix_spawn (&pid, file, &fa, &attr, argv.v, env.v);
  posix_spawn_file_actions_destroy (&fa);
  posix_spawnattr_destroy (&attr);
  if (r != 0)
    {
      ag_cg_exec_release (&ecg);
      send_exec_failure (stream, r, "exec \"%s\"", argv.v[0]);
      return;
    }

  struct exec *e = calloc (1, sizeof *e);
  if (e == NULL)
    {
      ag_cg_exec_kill (&ecg);
      ag_cg_exec_release (&ecg);
      kill (pid, SIGKILL); /* reaped by the SIGCHLD loop like any orphan */
      ag_send_errorf (stream, ENOMEM, WR_E_INTERNAL, "out of memory");
      return;
    }
  e->r.stream = stream;
  e->r.kind = AG_REQ_EXEC;
  e->pid = pid;
  e->tty = s.tty;
  e->call = call;
  e->cg = ecg;
  e->start_ns = start;
  if (s.timeout_ms)
    e->deadline_ms = start / 1000000 + s.timeout_ms;
  int outs[2] = { s.tty ? TAKE_FD (master) : TAKE_FD (out_r), TAKE_FD (err_r) };
  for (int i = 0; i < 2; i++)
    {
      struct out_pipe *o = &e->out[i];
      o->w.fn = out_cb;
      o->w.fd = outs[i];
      o->e = e;
      o->type = i == 0 ? WR_MSG_STDOUT : WR_MSG_STDERR;
      o->cap = s.caps[i];
      if (o->w.fd >= 0 && !output_paused)
        ag_watch_set (&o->w, EPOLLIN);
    }
  e->in.fn = in_cb;
  e->in.fd = TAKE_FD (in_w);
  e->in_eof = e->in.fd < 0;
  ag_req_link (&e->r);
}

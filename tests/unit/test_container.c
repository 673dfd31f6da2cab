/* Container backend tests (docs/containers.md). Runs as root; builds a
 * busybox rootfs, starts sandboxes with the real warren-agent and checks
 * isolation, limits, cleanup and speed through the agent protocol. */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <linux/nsfs.h>
#include <poll.h>
#include <stdarg.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <linux/magic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/child.h"
#include "backend/container.h"
#include "backend/pool.h"
#include "common/proto.h"
#include "common/util.h"
#include "tap.h"

static char tmp[256], rootfs[300], lower[300], state_root[300], agent[4096];
static const char *lowerdir;
static struct wr_runtime *rt;
static uint32_t next_stream = 1;

struct out
{
  char *stdout_buf, *stderr_buf;
  size_t out_len, err_len;
  int exit_code, sig;
  bool timed_out, got_exit;
};

static void
out_free (struct out *o)
{
  free (o->stdout_buf);
  free (o->stderr_buf);
  memset (o, 0, sizeof *o);
}

/* Read one frame (blocking with timeout) into a malloc'd payload. */
static int
read_frame (int fd, struct wr_frame *f, uint8_t **payload, int timeout_ms)
{
  static uint8_t buf[WR_FRAME_MAX + WR_FRAME_HDR];
  static size_t have;
  for (;;)
    {
      int r = wr_frame_parse (buf, have, f);
      if (r < 0)
        return r;
      if (r > 0)
        {
          *payload = malloc (f->len + 1);
          memcpy (*payload, f->payload, f->len);
          (*payload)[f->len] = 0;
          memmove (buf, buf + r, have - (size_t)r);
          have -= (size_t)r;
          return 0;
        }
      struct pollfd p = { .fd = fd, .events = POLLIN };
      if (poll (&p, 1, timeout_ms) <= 0)
        return -ETIMEDOUT;
      ssize_t n = read (fd, buf + have, sizeof buf - have);
      if (n == 0)
        return -EPIPE;
      if (n < 0)
        {
          if (errno == EAGAIN || errno == EINTR)
            continue;
          return -errno;
        }
      have += (size_t)n;
    }
}

static void
append (char **b, size_t *len, const void *p, size_t n)
{
  *b = realloc (*b, *len + n + 1);
  memcpy (*b + *len, p, n);
  *len += n;
  (*b)[*len] = 0;
}

/* Run argv in the sandbox through the agent protocol. */
static int
run (int fd, struct out *o, int timeout_ms, const char *const *argv)
{
  memset (o, 0, sizeof *o);
  o->stdout_buf = calloc (1, 1);
  o->stderr_buf = calloc (1, 1);
  json_t *cmd = json_array ();
  for (int i = 0; argv[i]; i++)
    json_array_append_new (cmd, json_string (argv[i]));
  json_t *req = json_pack ("{s:o,s:i}", "cmd", cmd, "timeout_ms", timeout_ms);
  char *txt = json_dumps (req, JSON_COMPACT);
  json_decref (req);
  uint32_t stream = next_stream++;
  int r = wr_frame_write (fd, stream, WR_MSG_EXEC, txt, (uint32_t)strlen (txt));
  free (txt);
  if (r < 0)
    return r;
  for (;;)
    {
      struct wr_frame f;
      uint8_t *p = NULL;
      r = read_frame (fd, &f, &p, timeout_ms + 5000);
      if (r < 0)
        return r;
      if (f.stream != stream)
        {
          free (p);
          continue;
        }
      if (f.type == WR_MSG_STDOUT)
        append (&o->stdout_buf, &o->out_len, p, f.len);
      else if (f.type == WR_MSG_STDERR)
        append (&o->stderr_buf, &o->err_len, p, f.len);
      else if (f.type == WR_MSG_EXIT || f.type == WR_MSG_ERROR)
        {
          json_t *j = json_loads ((char *)p, 0, NULL);
          o->exit_code = j ? (int)json_integer_value (json_object_get (j, "exit_code")) : -1;
          o->sig = j ? (int)json_integer_value (json_object_get (j, "signal")) : 0;
          o->timed_out = j && json_is_true (json_object_get (j, "timed_out"));
          o->got_exit = f.type == WR_MSG_EXIT;
          if (f.type == WR_MSG_ERROR)
            append (&o->stderr_buf, &o->err_len, p, f.len);
          json_decref (j);
          free (p);
          return 0;
        }
      free (p);
    }
}

/* Command timeouts and waits only catch a hang: CI is a loaded 2-core VM
 * (under ASan too), where a short command can take seconds. */
#define WAIT_MS 60000
#define RUN(fd, o, ...) run ((fd), (o), WAIT_MS, (const char *const[]){ __VA_ARGS__, NULL })

static int
read_hello (int fd)
{
  struct wr_frame f;
  uint8_t *p = NULL;
  int r = read_frame (fd, &f, &p, WAIT_MS);
  if (r < 0)
    return r;
  r = f.type == WR_MSG_HELLO && f.stream == 0 && strstr ((char *)p, "\"version\"") ? 0 : -EPROTO;
  free (p);
  return r;
}

static void
make_rootfs (void)
{
  char path[600];
  snprintf (path, sizeof path, "%s/bin", rootfs);
  wr_mkdir_p (path, 0755);
  snprintf (path, sizeof path, "cp /bin/busybox %s/bin/busybox", rootfs);
  if (system (path) != 0)
    exit (2);
  FILE *l = popen ("/bin/busybox --list", "r");
  char name[128];
  while (l && fgets (name, sizeof name, l))
    {
      name[strcspn (name, "\n")] = 0;
      if (!name[0] || strcmp (name, "busybox") == 0)
        continue;
      snprintf (path, sizeof path, "%s/bin/%s", rootfs, name);
      symlink ("busybox", path);
    }
  if (l)
    pclose (l);
  snprintf (path, sizeof path, "%s/data/sub", rootfs);
  wr_mkdir_p (path, 0755);
  snprintf (path, sizeof path, "%s/data/sub/file", rootfs);
  int fd = open (path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
  close (fd);
  snprintf (path, sizeof path, "%s/etc", rootfs);
  mkdir (path, 0755);
  snprintf (path, sizeof path, "%s/etc/passwd", rootfs);
  FILE *pw = fopen (path, "w");
  fputs ("root:x:0:0:root:/root:/bin/sh\n", pw);
  fclose (pw);
}

static int
spec_create (const char *id, struct wr_container_spec *spec, char *sdir, size_t sdir_len,
             struct wr_container *c, wr_err_t *err)
{
  snprintf (sdir, sdir_len, "%s/%s", state_root, id);
  mkdir (sdir, 0700);
  static const char *lowers[1];
  lowers[0] = lowerdir;
  spec->id = id;
  spec->state_dir = sdir;
  spec->lowerdirs = lowers;
  spec->n_lowerdirs = 1;
  return wr_container_create (rt, spec, c, err);
}

static char cgname[32] = "warren";

static bool __attribute__ ((format (printf, 1, 2))) path_exists (const char *fmt, ...)
{
  char p[512];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (p, sizeof p, fmt, ap);
  va_end (ap);
  return access (p, F_OK) == 0;
}

static bool
cgroups_gone (const char *id)
{
  return !path_exists ("/sys/fs/cgroup/unified/%s/%s", cgname, id)
         && !path_exists ("/sys/fs/cgroup/memory/%s/%s", cgname, id)
         && !path_exists ("/sys/fs/cgroup/pids/%s/%s", cgname, id)
         && !path_exists ("/sys/fs/cgroup/cpu/%s/%s", cgname, id)
         && !path_exists ("/sys/fs/cgroup/%s/%s", cgname, id);
}

static int
count_mounts (void)
{
  FILE *f = fopen ("/proc/self/mountinfo", "r");
  int n = 0, ch;
  while ((ch = fgetc (f)) != EOF)
    n += ch == '\n';
  fclose (f);
  return n;
}

static void
test_main_sandbox (void)
{
  wr_err_t err = { 0 };
  struct wr_container_spec spec = { .memory_mb = 64, .disk_mb = 16, .pids_max = 64 };
  struct wr_container c;
  char sdir[512];
  int mounts_before = count_mounts ();
  int r = spec_create ("t-main", &spec, sdir, sizeof sdir, &c, &err);
  TAP_EQ (r, 0, "create sandbox (%s)", r ? err.msg : "ok");
  if (r)
    return;
  TAP_OK (TAP_C_GT (c.pid, 0) && TAP_C_GE (c.pidfd, 0) && TAP_C_GE (c.agent_fd, 0)
              && TAP_C_GT (c.start_time, 0),
          "handles filled");
  TAP_OK ((fcntl (c.agent_fd, F_GETFL) & O_NONBLOCK) && (fcntl (c.agent_fd, F_GETFD) & FD_CLOEXEC),
          "agent_fd is O_NONBLOCK|O_CLOEXEC");
  r = read_hello (c.agent_fd);
  TAP_EQ (r, 0, "agent sends HELLO");
  TAP_EQ (count_mounts (), mounts_before, "no mount added to the host namespace");

  struct out o;
  r = RUN (c.agent_fd, &o, "/bin/busybox", "id");
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (o.exit_code, 0) && strncmp (o.stdout_buf, "uid=0", 5) == 0,
          "id: uid 0 (%s)", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/cat", "/proc/self/uid_map");
  unsigned a = 1, b = 0, n = 0;
  sscanf (o.stdout_buf, "%u %u %u", &a, &b, &n);
  TAP_OK (TAP_C_EQ (a, 0) && TAP_C_GE (b, WR_UID_RANGE_START) && TAP_C_EQ (b % WR_UID_BLOCK, 0)
              && TAP_C_EQ (b, c.uid_base) && TAP_C_EQ (n, WR_UID_BLOCK),
          "uid_map 0 -> own block %u x %u", b, n);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/ls", "/");
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_HAS_STR (o.stdout_buf, "bin")
              && !strstr (o.stdout_buf, "work") && !strstr (o.stdout_buf, "home")
              && !strstr (o.stdout_buf, "usr"),
          "ls / shows only the image: %s", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "cat /proc/self/mountinfo | grep -c ' / / '; stat /work");
  TAP_NE (o.exit_code, 0, "no host path reachable (stat /work fails)");
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/hostname");
  TAP_EQ_STR (o.stdout_buf, "t-main\n", "hostname is the id (%s)", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "echo x > /proc/sys/kernel/hostname");
  TAP_NE (o.exit_code, 0, "/proc/sys is read-only (%s)", o.stderr_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "touch /sys/x; echo 1 > /sys/kernel/profiling");
  TAP_NE (o.exit_code, 0, "/sys is read-only");
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/ls", "/sys/class/net");
  TAP_EQ_STR (o.stdout_buf, "lo\n", "net: only lo (%s)", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/cat", "/sys/class/net/lo/operstate");
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_HAS_STR (o.stdout_buf, "unknown"), "lo is up (%s)",
          o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/mount", "-t", "tmpfs", "x", "/tmp");
  TAP_OK (TAP_C_NE (o.exit_code, 0)
              && (TAP_C_HAS_STR (o.stderr_buf, "not permitted")
                  || TAP_C_HAS_STR (o.stderr_buf, "permission denied")),
          "mount fails: %s", o.stderr_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/unshare", "-U", "/bin/true");
  TAP_OK (TAP_C_NE (o.exit_code, 0) && TAP_C_HAS_STR (o.stderr_buf, "not permitted"),
          "unshare -U fails: %s", o.stderr_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c",
       "grep -E '^Cap(Bnd|Eff)|NoNewPrivs|Seccomp:' /proc/self/status");
  TAP_OK (TAP_C_HAS_STR (o.stdout_buf, "CapBnd:\t00000000a80425fb")
              && TAP_C_HAS_STR (o.stdout_buf, "NoNewPrivs:\t1")
              && TAP_C_HAS_STR (o.stdout_buf, "Seccomp:\t2"),
          "caps = docker default, no_new_privs, seccomp filter");
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c",
       "ls -ld /tmp /dev/null /dev/pts/ptmx /dev/shm && echo hi > /dev/null && test -c "
       "/dev/urandom");
  TAP_EQ (o.exit_code, 0, "/tmp and /dev nodes present (%s%s)", o.stdout_buf, o.stderr_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "ls -ln /bin/busybox | awk '{print $3}'");
  TAP_DIAG ("lower files owned by uid %s", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c",
       "rm /data/sub/file && rm -r /data/sub && mkdir /data/sub && ls -A /data/sub | wc -l");
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_EQ_STR (o.stdout_buf, "0\n"),
          "overlay whiteout + opaque dir work (%s%s)", o.stdout_buf, o.stderr_buf);
  out_free (&o);

  /* disk: writing past disk_mb gives ENOSPC inside */
  RUN (c.agent_fd, &o, "/bin/dd", "if=/dev/zero", "of=/big", "bs=1M", "count=64");
  TAP_OK (TAP_C_NE (o.exit_code, 0) && TAP_C_HAS_STR (o.stderr_buf, "No space left"),
          "disk full -> ENOSPC: %s", o.stderr_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/rm", "/big");
  out_free (&o);

  /* pids: a fork bomb stops at pids.max */
  RUN (c.agent_fd, &o, "/bin/sh", "-c",
       "i=0; while [ $i -lt 200 ]; do sleep 1000 & i=$((i+1)); done 2>/dev/null; echo started");
  struct wr_container_stats st;
  r = wr_container_stats (rt, &c, &st, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_GT (st.pids, 0) && TAP_C_LE (st.pids, 64),
          "fork bomb contained: %llu pids", (unsigned long long)st.pids);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "kill -9 $(pidof sleep) 2>/dev/null; true");
  out_free (&o);

  /* memory: a 200 MiB allocation under a 64 MiB limit is OOM-killed inside */
  RUN (c.agent_fd, &o, "/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1");
  r = wr_container_stats (rt, &c, &st, &err);
  TAP_OK (TAP_C_EQ (o.sig, 9) || TAP_C_EQ (o.exit_code, 137),
          "memory bomb killed (signal %d exit %d)", o.sig, o.exit_code);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_GE (st.oom_kills, 1) && TAP_C_GT (st.memory_bytes, 0),
          "stats: oom_kills=%llu memory=%llu cpu_ns=%llu", (unsigned long long)st.oom_kills,
          (unsigned long long)st.memory_bytes, (unsigned long long)st.cpu_usage_ns);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/true");
  TAP_EQ (o.exit_code, 0, "agent survives the OOM kill");
  out_free (&o);

  /* freeze / thaw */
  r = wr_container_freeze (rt, &c, true, &err);
  char buf[64] = "";
  char fzp[256];
  snprintf (fzp, sizeof fzp, "/sys/fs/cgroup/unified/%s/t-main/cgroup.freeze", cgname);
  int fd = open (fzp, O_RDONLY);
  if (fd >= 0)
    {
      read (fd, buf, sizeof buf - 1);
      close (fd);
    }
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (buf[0], '1'), "freeze");
  r = wr_container_freeze (rt, &c, false, &err);
  RUN (c.agent_fd, &o, "/bin/true");
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (o.exit_code, 0), "thaw: exec works again");
  out_free (&o);

  /* adopt after a "daemon restart": drop our connection and reconnect */
  pid_t pid = c.pid;
  uint64_t stime = c.start_time;
  close (c.agent_fd);
  close (c.pidfd);
  struct wr_container c2;
  r = wr_container_adopt (rt, "t-main", pid, stime + 1, sdir, &c2, &err);
  TAP_LT_INT (r, 0, "adopt with a wrong start time fails");
  r = wr_container_adopt (rt, "t-main", pid, stime, sdir, &c2, &err);
  TAP_EQ (r, 0, "adopt (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      r = read_hello (c2.agent_fd);
      TAP_EQ (r, 0, "HELLO after reconnect");
      RUN (c2.agent_fd, &o, "/bin/echo", "again");
      TAP_EQ_STR (o.stdout_buf, "again\n", "exec after adopt");
      out_free (&o);
    }
  else
    {
      c2 = c;
      c2.agent_fd = c2.pidfd = -1;
    }

  r = wr_container_destroy (rt, &c2, sdir, &err);
  TAP_EQ (r, 0, "destroy (%s)", r ? err.msg : "ok");
  waitpid (pid, NULL, WNOHANG);
  TAP_OK (cgroups_gone ("t-main"), "no cgroup dir left");
  TAP_OK (TAP_C_LT (kill (pid, 0), 0) && TAP_C_EQ (errno, ESRCH), "agent process gone");
  TAP_OK (!path_exists ("%s/agent.sock", sdir), "agent.sock removed");
  TAP_EQ (count_mounts (), mounts_before, "no mounts left");
  r = wr_container_destroy (rt, &c2, sdir, &err);
  TAP_EQ (r, 0, "destroy is idempotent");
  rmdir (sdir);
}

static void
test_reap_without_pid (void)
{
  wr_err_t err = { 0 };
  struct wr_container_spec spec = { .net_host = true, .hostname = "named-host" };
  struct wr_container c;
  char sdir[512];
  int r = spec_create ("t-orphan", &spec, sdir, sizeof sdir, &c, &err);
  TAP_EQ (r, 0, "create net_host sandbox (%s)", r ? err.msg : "ok");
  if (r)
    return;
  read_hello (c.agent_fd);
  struct out o;
  RUN (c.agent_fd, &o, "/bin/hostname");
  TAP_EQ_STR (o.stdout_buf, "named-host\n", "spec hostname used");
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "sleep 100 & sleep 100 & touch /sys/x; echo $?");
  TAP_EQ_STR (o.stdout_buf, "1\n", "net_host: /sys read-only rbind");
  out_free (&o);
  struct wr_container lost = { .pid = 0, .pidfd = -1, .agent_fd = -1 };
  snprintf (lost.id, sizeof lost.id, "t-orphan");
  close (c.agent_fd);
  r = wr_container_destroy (rt, &lost, sdir, &err);
  TAP_EQ (r, 0, "destroy with pid 0 via the cgroup (%s)", r ? err.msg : "ok");
  /* the agent is the zygote's child (or ours, exec'd): its pidfd tells */
  struct pollfd pf = { .fd = c.pidfd, .events = POLLIN };
  TAP_EQ (poll (&pf, 1, 10000), 1, "agent was killed");
  siginfo_t si;
  waitid ((idtype_t)P_PIDFD, (id_t)c.pidfd, &si, WEXITED | WNOHANG); /* if ours */
  close (c.pidfd);
  TAP_OK (cgroups_gone ("t-orphan"), "cgroups removed");
  rmdir (sdir);
}

/* "PPid:" of /proc/PID/status; -1 if gone */
static pid_t
ppid_of (pid_t pid)
{
  char path[64], line[256];
  snprintf (path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen (path, "re");
  if (f == NULL)
    return -1;
  pid_t pp = -1;
  while (fgets (line, sizeof line, f))
    if (sscanf (line, "PPid: %d", &pp) == 1)
      break;
  fclose (f);
  return pp;
}

/* "fd:target " for each of pid's fds from its setup (0-8), targets without
 * their [inode] or path: what kind of fd each is; "high" when any is above
 * 63 (where the zygote keeps its own) */
static char *
fd_list (pid_t pid)
{
  char *out = calloc (1, 4096), path[64], t[256];
  size_t len = 0;
  for (int fd = 0; fd <= WR_AGENT_CGROUP_FD && out; fd++)
    {
      snprintf (path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
      ssize_t n = readlink (path, t, sizeof t - 1);
      if (n < 0)
        continue;
      t[n] = 0;
      t[strcspn (t, ":[")] = 0;
      if (t[0] == '/')
        strcpy (t, "/");
      len += (size_t)snprintf (out + len, 4096 - len, "%d:%s ", fd, t);
    }
  for (int fd = 64; fd < 1024 && out; fd++)
    {
      snprintf (path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
      if (access (path, F_OK) == 0)
        {
          strcat (out, "high");
          break;
        }
    }
  return out;
}

/* the state letter of /proc/PID/stat, 0 if gone */
static char
proc_state (pid_t pid)
{
  char path[64], buf[512];
  snprintf (path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen (path, "re");
  if (f == NULL)
    return 0;
  size_t n = fread (buf, 1, sizeof buf - 1, f);
  fclose (f);
  buf[n] = 0;
  char *p = strrchr (buf, ')');
  return p && p[1] == ' ' ? p[2] : 0;
}

static bool
same_file (const char *a, const char *b)
{
  struct stat x, y;
  return stat (a, &x) == 0 && stat (b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* The sandbox's agent is forked by the agent zygote (docs/containers.md
 * "Agent zygote"), a new zygote replaces a killed one, and without one the
 * exec'd agent (the fallback) is a child of the creating process. */
static void
test_zygote (void)
{
  wr_err_t err = { 0 };
  struct wr_zygote_stats st0, st;
  wr_zygote_stats (rt, &st0);
  TAP_OK (st0.enabled, "agent zygote enabled by default");
  struct wr_container_spec spec = { .memory_mb = 64, .time_ns = true, .uptime_s = 1000 };
  struct wr_container c;
  char sdir[512], path[64], exe[64];
  int r = spec_create ("t-zyg", &spec, sdir, sizeof sdir, &c, &err);
  TAP_EQ (r, 0, "create through the zygote (%s)", r ? err.msg : "ok");
  if (r)
    return;
  wr_zygote_stats (rt, &st);
  TAP_OK (TAP_C_GT (st.pid, 0) && TAP_C_EQ (st.forks, st0.forks + 1),
          "the zygote runs (pid %d) and counted the fork (%" PRIu64 ")", (int)st.pid, st.forks);
  TAP_EQ (ppid_of (c.pid), st.pid, "the agent's parent is the zygote");
  snprintf (path, sizeof path, "/proc/%d/comm", (int)st.pid);
  _cleanup_free_ char *comm = NULL;
  wr_read_file_at (AT_FDCWD, path, &comm, NULL, 64);
  TAP_EQ_STR (comm ? comm : "", "warren-zygote\n", "the zygote's name");
  snprintf (exe, sizeof exe, "/proc/%d/exe", (int)c.pid);
  TAP_OK (same_file (exe, agent), "the agent's exe is warren-agent");
  TAP_EQ (read_hello (c.agent_fd), 0, "agent sends HELLO");
  struct out o;
  RUN (c.agent_fd, &o, "/bin/sh", "-c",
       "echo $$; grep -c . /proc/self/status >/dev/null; cut -d' ' -f1 /proc/uptime; "
       "grep -E '^(Seccomp|CapEff|NoNewPrivs):' /proc/1/status");
  int self_pid = 0;
  double up = 0;
  sscanf (o.stdout_buf ? o.stdout_buf : "", "%d %lf", &self_pid, &up);
  long upi = (long)up;
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_GT (self_pid, 1) && TAP_C_GE (upi, 1000)
              && TAP_C_LT (upi, 1600),
          "a shell runs; the time namespace took (uptime %.1f)", up);
  TAP_OK (TAP_C_HAS_STR (o.stdout_buf, "Seccomp:\t2")
              && TAP_C_HAS_STR (o.stdout_buf, "NoNewPrivs:\t1")
              && TAP_C_HAS_STR (o.stdout_buf, "CapEff:\t00000000a80425fb"),
          "pid 1: seccomp filter, no_new_privs, Docker's capabilities (%s)", o.stdout_buf);
  out_free (&o);
  _cleanup_free_ char *zygote_fds = fd_list (c.pid);
  /* the agent socket on /dev/shm where that is a tmpfs (the state root here
   * is not one) */
  struct statfs sf;
  bool shm_tmpfs = statfs ("/dev/shm", &sf) == 0 && sf.f_type == TMPFS_MAGIC;
  TAP_OK (!shm_tmpfs
              || (TAP_C_GE (rt->sock_dir_fd, 0) && path_exists ("%s/t-zyg", rt->sock_dir)
                  && !path_exists ("%s/agent.sock", sdir)),
          "agent socket in %s/", rt->sock_dir);
  TAP_EQ (wr_container_destroy (rt, &c, sdir, &err), 0, "destroy (%s)", err.msg);
  TAP_OK (!path_exists ("%s/t-zyg", rt->sock_dir), "destroy removed the agent socket");

  /* a dead zygote is replaced at the next create (a create racing with its
   * death fails: the request may have reached it) */
  if (st.pid <= 0) /* kill (0, ...) would take our process group along */
    return;
  kill (st.pid, SIGKILL);
  for (int i = 0; i < 5000 && proc_state (st.pid) != 'Z' && proc_state (st.pid) != 0; i++)
    usleep (1000);
  r = spec_create ("t-zyg", &spec, sdir, sizeof sdir, &c, &err);
  TAP_EQ (r, 0, "create after the zygote was killed (%s)", r ? err.msg : "ok");
  struct wr_zygote_stats st2;
  wr_zygote_stats (rt, &st2);
  TAP_OK (TAP_C_NE (st2.pid, st.pid) && TAP_C_EQ (st2.starts, st.starts + 1)
              && TAP_C_EQ (ppid_of (c.pid), st2.pid),
          "a new zygote (pid %d) forked it", (int)st2.pid);
  if (r == 0)
    {
      read_hello (c.agent_fd);
      RUN (c.agent_fd, &o, "/bin/true");
      TAP_EQ (o.exit_code, 0, "exec works");
      out_free (&o);
      wr_container_destroy (rt, &c, sdir, &err);
    }

  /* the fallback: the CLONE_VM child execs the agent */
  struct wr_zygote *z = rt->zygote;
  rt->zygote = NULL;
  r = spec_create ("t-zyg", &spec, sdir, sizeof sdir, &c, &err);
  rt->zygote = z;
  TAP_EQ (r, 0, "create without the zygote (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      TAP_EQ (ppid_of (c.pid), getpid (), "the exec'd agent is our child");
      read_hello (c.agent_fd);
      _cleanup_free_ char *exec_fds = fd_list (c.pid);
      TAP_EQ_STR (zygote_fds, exec_fds, "the agent holds the same fds either way (%s)", exec_fds);
      RUN (c.agent_fd, &o, "/bin/sh", "-c", "cut -d' ' -f1 /proc/uptime");
      upi = o.stdout_buf ? atol (o.stdout_buf) : 0;
      TAP_OK (TAP_C_GE (upi, 1000) && TAP_C_LT (upi, 1600), "exec'd: time namespace (%ld)", upi);
      out_free (&o);
      wr_container_destroy (rt, &c, sdir, &err);
    }
  rmdir (sdir);
}

static void
test_bad_input (void)
{
  wr_err_t err = { 0 };
  struct wr_container c;
  char sdir[512];
  struct wr_container_spec spec = { 0 };
  int r = spec_create ("../x", &spec, sdir, sizeof sdir, &c, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID), "invalid id rejected");
  const char *bad[] = { "/tmp/a,upperdir=/etc" };
  spec = (struct wr_container_spec){
    .id = "t-bad", .state_dir = state_root, .lowerdirs = bad, .n_lowerdirs = 1
  };
  r = wr_container_create (rt, &spec, &c, &err);
  TAP_LT_INT (r, 0, "layer path with overlay syntax is not parsed as options");
  spec = (struct wr_container_spec){ .hostname = "a b" };
  r = spec_create ("t-bad", &spec, sdir, sizeof sdir, &c, &err);
  TAP_LT_INT (r, 0, "bad hostname rejected");
  const char *missing[] = { "/nonexistent-layer" };
  spec = (struct wr_container_spec){
    .id = "t-bad", .state_dir = sdir, .lowerdirs = missing, .n_lowerdirs = 1
  };
  r = wr_container_create (rt, &spec, &c, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "nonexistent-layer") && cgroups_gone ("t-bad")
              && !path_exists ("%s/run/l/t-bad", state_root)
              && !path_exists ("%s/agent.sock", sdir),
          "setup failure reported and cleaned up (%s)", err.msg);
  rmdir (sdir);
}

static int
cmp_u64 (const void *a, const void *b)
{
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void
test_loop (int iters, bool net_host)
{
  wr_err_t err = { 0 };
  uint64_t *create = calloc ((size_t)iters, 8), *destroy = calloc ((size_t)iters, 8);
  int fails = 0;
  char sdir[512];
  uint64_t t0 = wr_now_ns ();
  for (int i = 0; i < iters; i++)
    {
      struct wr_container_spec spec = { .memory_mb = 256, .net_host = net_host };
      struct wr_container c;
      uint64_t a = wr_now_ns ();
      if (spec_create ("t-loop", &spec, sdir, sizeof sdir, &c, &err) < 0)
        {
          fails++;
          continue;
        }
      uint64_t b = wr_now_ns ();
      if (wr_container_destroy (rt, &c, sdir, &err) < 0)
        fails++;
      destroy[i] = wr_now_ns () - b;
      create[i] = b - a;
    }
  uint64_t total = wr_now_ns () - t0;
  qsort (create, (size_t)iters, 8, cmp_u64);
  qsort (destroy, (size_t)iters, 8, cmp_u64);
  TAP_DIAG ("%s: %d x create+destroy: %.2f ms/iter (create p50 %.2f p90 %.2f, destroy p50 %.2f p90 "
            "%.2f)",
            net_host ? "net_host" : "own netns", iters, total / 1e6 / iters,
            create[iters / 2] / 1e6, create[iters * 9 / 10] / 1e6, destroy[iters / 2] / 1e6,
            destroy[iters * 9 / 10] / 1e6);
  TAP_EQ (fails, 0, "%d create+destroy, %d failures (%s)", iters, fails, fails ? err.msg : "");
  TAP_OK (cgroups_gone ("t-loop"), "loop left no cgroup");
  rmdir (sdir);
  free (create);
  free (destroy);
}

/* A sandbox with its own network gets a netns the pool made ahead: owned
 * by the host's user namespace, loopback up, its read-only sysfs attached
 * at /sys. Without a pool, clone3 makes one owned by the sandbox. */
static void
test_netns_pool (void)
{
  wr_err_t err = { 0 };
  unsigned ready = 0;
  uint64_t taken0 = 0, taken1 = 0, missed = 0;
  for (int i = 0; i < 3000 && ready == 0; i++) /* generous: the machine is shared */
    {
      wr_netns_pool_stats (rt->netns_pool, &ready, &taken0, &missed);
      if (ready == 0)
        usleep (10000);
    }
  TAP_GT_INT ((int)ready, 0, "netns pool filled (%u ready)", ready);
  struct wr_container_spec spec = { .memory_mb = 64, .disk_mb = 16 };
  struct wr_container c;
  char sdir[512];
  int r = spec_create ("t-netns", &spec, sdir, sizeof sdir, &c, &err);
  TAP_EQ (r, 0, "create with a pooled netns (%s)", r ? err.msg : "ok");
  if (r)
    return;
  read_hello (c.agent_fd);
  wr_netns_pool_stats (rt->netns_pool, &ready, &taken1, &missed);
  TAP_EQ ((int)(taken1 - taken0), 1, "the create took a pooled netns");
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/ns/net", (int)c.pid);
  _cleanup_close_ int ns = open (path, O_RDONLY | O_CLOEXEC);
  _cleanup_close_ int owner = ns >= 0 ? ioctl (ns, NS_GET_USERNS) : -1;
  struct stat so, si;
  TAP_OK (owner >= 0 && fstat (owner, &so) == 0 && stat ("/proc/self/ns/user", &si) == 0
              && so.st_ino == si.st_ino,
          "the netns belongs to the host's user namespace, not the sandbox's");
  struct out o;
  RUN (c.agent_fd, &o, "/bin/ls", "/sys/class/net");
  TAP_EQ_STR (o.stdout_buf, "lo\n", "pooled netns: only lo in /sys (%s)", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/cat", "/sys/class/net/lo/operstate");
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_HAS_STR (o.stdout_buf, "unknown"),
          "pooled netns: lo is up (%s)", o.stdout_buf);
  out_free (&o);
  RUN (c.agent_fd, &o, "/bin/sh", "-c", "touch /sys/x || grep -c ' /sys ro,' /proc/self/mountinfo");
  TAP_EQ_STR (o.stdout_buf, "1\n", "pooled netns: /sys read-only (%s)", o.stdout_buf);
  out_free (&o);
  TAP_EQ (wr_container_destroy (rt, &c, sdir, &err), 0, "destroy (%s)", err.msg);
  rmdir (sdir);

  /* without a pool (disabled, or empty): a netns of its own, made by clone3 */
  struct wr_netns_pool *pool = rt->netns_pool;
  rt->netns_pool = NULL;
  r = spec_create ("t-netns", &spec, sdir, sizeof sdir, &c, &err);
  rt->netns_pool = pool;
  TAP_EQ (r, 0, "create without the pool (%s)", r ? err.msg : "ok");
  if (r)
    return;
  read_hello (c.agent_fd);
  snprintf (path, sizeof path, "/proc/%d/ns/net", (int)c.pid);
  _cleanup_close_ int ns2 = open (path, O_RDONLY | O_CLOEXEC);
  _cleanup_close_ int owner2 = ns2 >= 0 ? ioctl (ns2, NS_GET_USERNS) : -1;
  snprintf (path, sizeof path, "/proc/%d/ns/user", (int)c.pid);
  TAP_OK (owner2 >= 0 && fstat (owner2, &so) == 0 && stat (path, &si) == 0
              && so.st_ino == si.st_ino,
          "own netns: it belongs to the sandbox's user namespace");
  RUN (c.agent_fd, &o, "/bin/cat", "/sys/class/net/lo/operstate");
  TAP_OK (TAP_C_EQ (o.exit_code, 0) && TAP_C_HAS_STR (o.stdout_buf, "unknown"),
          "own netns: lo is up (%s)", o.stdout_buf);
  out_free (&o);
  TAP_EQ (wr_container_destroy (rt, &c, sdir, &err), 0, "destroy (%s)", err.msg);
  rmdir (sdir);
}

/* The idmapped layer mounts are attached at the child stack slot's mount
 * points, which stay for the next create: no mkdir/rmdir (an inode
 * allocation each) per layer and sandbox. */
static void
test_layer_mount_points_reused (void)
{
  wr_err_t err = { 0 };
  char sdir[512], slot0[600], old[600];
  snprintf (slot0, sizeof slot0, "%s/run/l/0/0", state_root);
  snprintf (old, sizeof old, "%s/run/l/t-lm", state_root);
  ino_t ino[2] = { 0, 0 };
  int ok = 0;
  for (int i = 0; i < 2; i++)
    {
      struct wr_container_spec spec = { .memory_mb = 64, .disk_mb = 16 };
      struct wr_container c;
      if (spec_create ("t-lm", &spec, sdir, sizeof sdir, &c, &err) < 0)
        continue;
      struct stat st;
      if (stat (slot0, &st) == 0)
        ino[i] = st.st_ino;
      ok += access (old, F_OK) < 0;
      ok += wr_container_destroy (rt, &c, sdir, &err) == 0;
    }
  TAP_EQ (ok, 4, "two creates, no per-sandbox layer dir (%s)", err.msg);
  TAP_OK (ino[0] != 0 && ino[0] == ino[1], "slot 0's layer mount point kept and reused");
  rmdir (sdir);
}

int
main (int argc, char **argv)
{
  if (geteuid () != 0)
    {
      TAP_SKIP ("needs root", "container tests");
      return TAP_DONE ();
    }
  alarm (600);
  const char *b = getenv ("WARREN_BUILD");
  if (b)
    snprintf (agent, sizeof agent, "%s/bin/warren-agent", b);
  else
    {
      char self[2048];
      ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 1);
      self[n > 0 ? n : 0] = 0;
      char *s = strrchr (self, '/');
      if (s)
        *s = 0;
      snprintf (agent, sizeof agent, "%s/../bin/warren-agent", self);
    }
  if (access (agent, X_OK) < 0)
    {
      TAP_OK (0, "agent binary %s missing", agent);
      return TAP_DONE ();
    }
  wr_err_t err = { 0 };
  int pr = wr_runtime_private_mountns (&err);
  TAP_EQ (pr, 0, "private mount namespace (%s)", err.msg);
  if (!tap_mkdtemp (tmp, sizeof tmp, "wr-ctr"))
    return 2;
  snprintf (rootfs, sizeof rootfs, "%s/rootfs", tmp);
  snprintf (lower, sizeof lower, "%s/lower", tmp);
  snprintf (state_root, sizeof state_root, "%s/state", tmp);
  mkdir (lower, 0755);
  mkdir (state_root, 0700);
  make_rootfs ();

  struct wr_runtime_config cfg
      = { .root = state_root, .agent_path = agent, .uid_base = 100000, .uid_count = 65536 };
  int r = wr_runtime_new (&cfg, &rt, &err);
  if (r == 0)
    snprintf (cgname, sizeof cgname, "%s", wr_runtime_cgroup_name (rt));
  TAP_EQ (r, 0, "runtime: %s", r ? err.msg : wr_runtime_describe (rt));
  if (r)
    return TAP_DONE ();
  /* plain layer dirs: create idmaps them for each sandbox's own uid block */
  TAP_LT_INT (wr_runtime_userns_fd (rt), 0, "no shared user namespace");
  lowerdir = rootfs;

  test_bad_input ();
  test_zygote ();
  test_main_sandbox ();
  test_reap_without_pid ();
  test_layer_mount_points_reused ();
  test_netns_pool ();
  int iters = argc > 1 ? atoi (argv[1]) : 200;
  test_loop (iters > 0 ? iters : 200, false);
  test_loop (iters > 0 ? iters / 4 + 1 : 50, true);

  umount2 (lower, MNT_DETACH);
  wr_runtime_free (rt);
  bool parents_gone = !path_exists ("/sys/fs/cgroup/unified/%s", cgname)
                      && !path_exists ("/sys/fs/cgroup/memory/%s", cgname);
  TAP_OK (parents_gone, "runtime_free removed the warren parents");
  TAP_OK (!path_exists ("%s/run/l", state_root), "runtime_free removed the layer mount points");
  TAP_OK (!path_exists ("/dev/shm/%s", cgname), "runtime_free removed the agent sockets' dir");
  char cmd[400];
  snprintf (cmd, sizeof cmd, "rm -rf %s", tmp);
  system (cmd);
  return TAP_DONE ();
}

/* The agent's own cgroup tree, where it is init of a VM guest and the guest
 * kernel is all ours (docs/vm.md "Limits inside the guest"):
 *
 *   /sys/fs/cgroup            cgroup2, controllers cpu memory pids enabled
 *     agent/                  the agent itself, cpu.weight 10000
 *     tasks/                  pids.max, memory.max, cpu.max of the sandbox
 *       e<stream>-<n>/        one per exec: killed whole (cgroup.kill) at its
 *                             timeout or on SIGKILL, whatever its processes
 *                             did to their session; its memory.events says
 *                             whether the exec was OOM-killed
 *
 * The limits bound the task processes, never the agent: a fork bomb, a
 * memory bomb or an output flood in the guest leaves the agent answering.
 * Everything here is best effort: without cgroup2 in the guest kernel the
 * agent runs execs as before (session kill, no in-guest limits) and says so
 * in HELLO ("cgroup":false).
 *
 * In a container the daemon delegates the sandbox's own cgroup2 dir instead
 * (--cgroup-fd; its limits are the host's business): the agent only makes
 * the per-exec children, for the kill, and keeps empty ones for reuse (a
 * mkdir + rmdir per exec costs more than it must on a slow kernel). */
#include "agent/agent.h"
#include "common/util.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <linux/magic.h>

#define CG_ROOT "/sys/fs/cgroup"
/* exec cgroups whose main process is gone but that may still hold
 * background processes: removed once empty */
#define CG_MAX_LINGER 4096
#define CG_MAX_SPARE 16

static struct
{
  int tasks_fd;  /* O_PATH dir of tasks/, -1 when the agent owns no tree */
  bool own_tree; /* tasks/ is ours (a VM guest), not a delegated container dir */
  unsigned long seq;
  char *linger[CG_MAX_LINGER];
  size_t n_linger;
  char *spare[CG_MAX_SPARE]; /* empty exec cgroups, ready for reuse */
  size_t n_spare;
} cg = { .tasks_fd = -1 };

static long long oom_kills (int dir_fd);

bool
ag_cg_enabled (void)
{
  return cg.tasks_fd >= 0;
}

static int
write_at (int dirfd, const char *file, const char *val)
{
  _cleanup_close_ int fd = openat (dirfd, file, O_WRONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  size_t len = strlen (val);
  ssize_t n = write (fd, val, len);
  if (n < 0)
    return -errno;
  return (size_t)n == len ? 0 : -EIO;
}

int
ag_cg_init (void)
{
  struct statfs sf;
  if (statfs (CG_ROOT, &sf) < 0 || sf.f_type != CGROUP2_SUPER_MAGIC)
    {
      if (mount ("cgroup2", CG_ROOT, "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        return -errno;
    }
  _cleanup_close_ int root = open (CG_ROOT, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (root < 0)
    return -errno;
  int r = write_at (root, "cgroup.subtree_control", "+cpu +memory +pids");
  if (r < 0)
    r = write_at (root, "cgroup.subtree_control", "+memory +pids");
  if (r < 0)
    return r;
  if ((mkdirat (root, "agent", 0755) < 0 && errno != EEXIST)
      || (mkdirat (root, "tasks", 0755) < 0 && errno != EEXIST))
    return -errno;
  _cleanup_close_ int agent = openat (root, "agent", O_PATH | O_DIRECTORY | O_CLOEXEC);
  int tasks = openat (root, "tasks", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (agent < 0 || tasks < 0)
    {
      r = -errno;
      if (tasks >= 0)
        close (tasks);
      return r;
    }
  /* the agent first when the tasks spin (no cpu controller: still fine) */
  write_at (agent, "cpu.weight", "10000");
  char pid[32];
  snprintf (pid, sizeof pid, "%d", (int)getpid ());
  if ((r = write_at (agent, "cgroup.procs", pid)) < 0
      || (r = write_at (tasks, "cgroup.subtree_control", "+memory +pids")) < 0)
    {
      close (tasks);
      return r;
    }
  cg.tasks_fd = tasks;
  cg.own_tree = true;
  return 0;
}

int
ag_cg_init_delegated (int fd)
{
  /* the child cgroup for the first exec proves we may: ours, and writable */
  if (mkdirat (fd, "probe", 0755) < 0 && errno != EEXIST)
    return -errno;
  unlinkat (fd, "probe", AT_REMOVEDIR);
  int f = fcntl (fd, F_DUPFD_CLOEXEC, 3);
  if (f < 0)
    return -errno;
  close (fd);
  cg.tasks_fd = f;
  return 0;
}

/* "max" for 0, else the number */
static void
fmt_limit (char *out, size_t len, uint64_t v)
{
  if (v == 0)
    snprintf (out, len, "max");
  else
    snprintf (out, len, "%llu", (unsigned long long)v);
}

static uint64_t
json_u64 (json_t *o, const char *key)
{
  json_t *v = json_object_get (o, key);
  return json_is_integer (v) && json_integer_value (v) > 0 ? (uint64_t)json_integer_value (v) : 0;
}

void
ag_cg_limits (const uint8_t *payload, size_t len)
{
  if (cg.tasks_fd < 0)
    return;
  json_t *j = json_loadb ((const char *)payload, len, 0, NULL);
  if (!json_is_object (j))
    {
      json_decref (j);
      return;
    }
  char v[64];
  fmt_limit (v, sizeof v, json_u64 (j, "pids_max"));
  write_at (cg.tasks_fd, "pids.max", v);
  uint64_t mem = json_u64 (j, "memory_bytes");
  fmt_limit (v, sizeof v, mem);
  write_at (cg.tasks_fd, "memory.max", v);
  /* no swap in the guest, but be explicit: the limit is RAM */
  write_at (cg.tasks_fd, "memory.swap.max", "0");
  uint64_t quota = json_u64 (j, "cpu_quota_us"), period = json_u64 (j, "cpu_period_us");
  if (quota && period)
    snprintf (v, sizeof v, "%llu %llu", (unsigned long long)quota, (unsigned long long)period);
  else
    snprintf (v, sizeof v, "max 100000");
  write_at (cg.tasks_fd, "cpu.max", v);
  json_decref (j);
}

static bool
populated (const char *name)
{
  char path[64], buf[256];
  snprintf (path, sizeof path, "%s/cgroup.events", name);
  _cleanup_close_ int fd = openat (cg.tasks_fd, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return false;
  ssize_t n = read (fd, buf, sizeof buf - 1);
  if (n <= 0)
    return true;
  buf[n] = '\0';
  return strstr (buf, "populated 1") != NULL;
}

/* An empty exec cgroup: kept for reuse, else removed. Takes name. */
static void
retire (char *name)
{
  if (cg.n_spare < CG_MAX_SPARE && !populated (name))
    {
      cg.spare[cg.n_spare++] = name;
      return;
    }
  if (unlinkat (cg.tasks_fd, name, AT_REMOVEDIR) == 0 || errno == ENOENT)
    {
      free (name);
      return;
    }
  if (cg.n_linger < CG_MAX_LINGER)
    cg.linger[cg.n_linger++] = name;
  else
    free (name); /* forgotten: removed with the sandbox */
}

static void
linger_sweep (void)
{
  size_t k = 0;
  for (size_t i = 0; i < cg.n_linger; i++)
    {
      char *name = cg.linger[i];
      if (populated (name))
        cg.linger[k++] = name;
      else if (cg.n_spare < CG_MAX_SPARE)
        cg.spare[cg.n_spare++] = name;
      else if (unlinkat (cg.tasks_fd, name, AT_REMOVEDIR) == 0 || errno == ENOENT)
        free (name);
      else
        cg.linger[k++] = name;
    }
  cg.n_linger = k;
}

int
ag_cg_exec_create (uint32_t stream, struct ag_exec_cg *ret)
{
  ret->dir_fd = -1;
  ret->name[0] = '\0';
  if (cg.tasks_fd < 0)
    return 0;
  linger_sweep ();
  if (cg.n_spare > 0)
    {
      char *name = cg.spare[--cg.n_spare];
      snprintf (ret->name, sizeof ret->name, "%s", name);
      free (name);
    }
  else
    snprintf (ret->name, sizeof ret->name, "e%lu", ++cg.seq);
  if (mkdirat (cg.tasks_fd, ret->name, 0755) < 0 && errno != EEXIST)
    {
      int r = -errno;
      ret->name[0] = '\0';
      return r;
    }
  ret->dir_fd = openat (cg.tasks_fd, ret->name, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (ret->dir_fd < 0)
    {
      int r = -errno;
      unlinkat (cg.tasks_fd, ret->name, AT_REMOVEDIR);
      ret->name[0] = '\0';
      return r;
    }
  ret->oom_base = oom_kills (ret->dir_fd); /* a reused cgroup keeps its count */
  return 0;
}

/* In the forked child, before exec: join the exec's cgroup. */
int
ag_cg_exec_join (const struct ag_exec_cg *c)
{
  if (c->dir_fd < 0)
    return 0;
  return write_at (c->dir_fd, "cgroup.procs", "0");
}

void
ag_cg_exec_kill (const struct ag_exec_cg *c)
{
  if (c->dir_fd >= 0)
    write_at (c->dir_fd, "cgroup.kill", "1");
}

/* memory.events oom_kill of an exec cgroup; -1 without a memory controller */
static long long
oom_kills (int dir_fd)
{
  _cleanup_close_ int fd = openat (dir_fd, "memory.events", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -1;
  char buf[512];
  ssize_t n = read (fd, buf, sizeof buf - 1);
  if (n <= 0)
    return -1;
  buf[n] = '\0';
  const char *p = strstr (buf, "oom_kill ");
  return p ? (long long)strtoull (p + 9, NULL, 10) : -1;
}

int
ag_cg_exec_oom (const struct ag_exec_cg *c)
{
  if (c->dir_fd < 0 || c->oom_base < 0)
    return -1; /* no memory controller here: the host's cgroups know */
  return oom_kills (c->dir_fd) > c->oom_base;
}

void
ag_cg_exec_release (struct ag_exec_cg *c)
{
  if (c->dir_fd < 0)
    return;
  close (c->dir_fd);
  c->dir_fd = -1;
  /* background processes of the exec keep running (as in a container)
   * and keep their cgroup; it is reused or removed once empty */
  char *s = strdup (c->name);
  if (s)
    retire (s);
  else
    unlinkat (cg.tasks_fd, c->name, AT_REMOVEDIR);
  c->name[0] = '\0';
}

int
ag_cg_freeze (bool frozen)
{
  /* a delegated container dir holds the agent itself: never frozen here */
  if (cg.tasks_fd < 0 || !cg.own_tree)
    return 0;
  int r = write_at (cg.tasks_fd, "cgroup.freeze", frozen ? "1" : "0");
  if (r < 0 || !frozen)
    return r;
  /* frozen once every task left the kernel (a task in uninterruptible
   * sleep delays it); 2 s at most, then the export goes on unfrozen */
  for (int i = 0; i < 2000; i++)
    {
      char buf[256];
      _cleanup_close_ int fd = openat (cg.tasks_fd, "cgroup.events", O_RDONLY | O_CLOEXEC);
      ssize_t n = fd >= 0 ? read (fd, buf, sizeof buf - 1) : -1;
      if (n <= 0)
        break;
      buf[n] = '\0';
      if (strstr (buf, "frozen 1"))
        return 1;
      usleep (1000);
    }
  write_at (cg.tasks_fd, "cgroup.freeze", "0");
  return 0;
}

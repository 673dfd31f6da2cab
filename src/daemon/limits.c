/* Node limits, budgeted at start (docs/operations.md, "Limits"): the
 * kernel limits that stand between warrend and many idle sandboxes are
 * raised where that is safe, read where it is not, and turned into one
 * number, the sandboxes this node can hold; a create beyond it is refused
 * at once (429), never half-built. */
#include "daemon/daemon.h"
#include "daemon/log.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "backend/backend.h"
#include "common/util.h"

/* What one idle container sandbox takes of each limit (measured, see
 * docs/performance.md "Density"): no daemon descriptor once its agent
 * socket is shed (agent_conn.h; the pidfd is dropped while idle, and held
 * again only while its exit is reaped), one otherwise; its agent
 * is one process, an exec adds more; one memory cgroup; one namespace of
 * each kind; about 0.7 MiB of kernel memory. */
#define FDS_PER_SANDBOX 1
#define PIDS_PER_SANDBOX 2
#define MIB_PER_SANDBOX 1
/* Descriptors kept free for clients, image jobs, the registry and creates
 * in flight, so that the listeners never meet EMFILE. */
#define FD_RESERVE 4096
#define WANT_NOFILE (1u << 20)
#define WANT_PID_MAX 4194304 /* the kernel's ceiling on 64-bit */
#define MEMCG_ID_MAX 65535   /* memory cgroup ids are 16 bits */

static long long
read_ll (const char *path)
{
  _cleanup_free_ char *s = NULL;
  if (wr_read_file_at (AT_FDCWD, path, &s, NULL, 4096) < 0)
    return -1;
  return strtoll (s, NULL, 10);
}

static void
write_ll (const char *path, long long v)
{
  FILE *f = fopen (path, "we");
  if (f == NULL)
    return;
  fprintf (f, "%lld\n", v);
  fclose (f);
}

/* kB of a /proc/meminfo field, -1 if absent */
static long long
meminfo_kb (const char *field)
{
  _cleanup_free_ char *s = NULL;
  if (wr_read_file_at (AT_FDCWD, "/proc/meminfo", &s, NULL, 1 << 16) < 0)
    return -1;
  size_t lf = strlen (field);
  for (char *p = s; p && *p; p = strchr (p, '\n'), p = p ? p + 1 : NULL)
    if (strncmp (p, field, lf) == 0 && p[lf] == ':')
      return strtoll (p + lf + 1, NULL, 10);
  return -1;
}

/* num_cgroups of the memory controller in /proc/cgroups, -1 if unknown */
static long long
memcg_in_use (void)
{
  _cleanup_free_ char *s = NULL;
  if (wr_read_file_at (AT_FDCWD, "/proc/cgroups", &s, NULL, 1 << 16) < 0)
    return -1;
  char *p = strstr (s, "\nmemory\t");
  unsigned h, n;
  if (p == NULL || sscanf (p + 8, "%u %u", &h, &n) != 2)
    return -1;
  return n;
}

/* open agent connections kept (--agent-conns); 0: every one, as before */
static unsigned agent_conns;
static bool agent_conns_never_shed;

static long long
nofile_now (void)
{
  struct rlimit rl = { 0, 0 };
  getrlimit (RLIMIT_NOFILE, &rl);
  return rl.rlim_cur == RLIM_INFINITY ? WANT_NOFILE : (long long)rl.rlim_cur;
}

/* Descriptors are budgeted by what is held: agent connections in use, up
 * to the budget, and the reserve. By default the budget is what the
 * reserve leaves, so a node below its descriptor limit keeps every
 * connection, and one near it sheds idle ones (least recently used). */
static void
agent_conns_budget (long long configured)
{
  const char *env = getenv ("WARREN_AGENT_CONNS"); /* the flag's environment spelling */
  char *end;
  long long v;
  if (configured == 0 && env && *env && (v = strtoll (env, &end, 10), *end == '\0') && v >= -1)
    configured = v;
  long long fit = nofile_now () - FD_RESERVE;
  if (fit < 16)
    fit = 16;
  if (configured < 0)
    {
      agent_conns_never_shed = true;
      agent_conns = 0;
    }
  else if (configured == 0 || configured > fit)
    {
      if (configured > fit)
        wrd_log (WRD_LOG_WARN, "--agent-conns %lld: only %lld fit beside the reserve", configured,
                 fit);
      agent_conns = (unsigned)fit;
    }
  else
    agent_conns = (unsigned)configured;
  agent_conns_set_budget (agent_conns);
}

void
wrd_limits_raise (long long agent_conns_configured)
{
  /* Descriptors: the hard limit may sit below what many sandboxes need
   * (a unit's LimitNOFILE=20000 stopped one node near 10,000); root may
   * raise it up to fs.nr_open, and fs.nr_open itself. */
  long long nr_open = read_ll ("/proc/sys/fs/nr_open");
  if (nr_open > 0 && nr_open < WANT_NOFILE)
    {
      write_ll ("/proc/sys/fs/nr_open", WANT_NOFILE);
      nr_open = read_ll ("/proc/sys/fs/nr_open");
    }
  struct rlimit rl;
  if (getrlimit (RLIMIT_NOFILE, &rl) == 0)
    {
      rlim_t want = nr_open > 0 ? (rlim_t)nr_open : rl.rlim_max;
      if (want > WANT_NOFILE)
        want = WANT_NOFILE;
      struct rlimit up
          = { want > rl.rlim_max ? want : rl.rlim_max, want > rl.rlim_max ? want : rl.rlim_max };
      if (setrlimit (RLIMIT_NOFILE, &up) < 0)
        {
          rl.rlim_cur = rl.rlim_max;
          setrlimit (RLIMIT_NOFILE, &rl);
        }
    }
  /* pid_max: every sandbox is at least one process; the default 32768 of a
   * small machine would be a cliff near 16,000 sandboxes. */
  long long pid_max = read_ll ("/proc/sys/kernel/pid_max");
  if (pid_max > 0 && pid_max < WANT_PID_MAX)
    write_ll ("/proc/sys/kernel/pid_max", WANT_PID_MAX);
  agent_conns_budget (agent_conns_configured);
}

struct limit
{
  const char *name;
  long long value; /* sandboxes this limit allows; < 0: unknown */
};

void
wrd_limits_budget (struct wrd *d, unsigned configured)
{
  long long nofile = nofile_now ();
  long long pid_max = read_ll ("/proc/sys/kernel/pid_max");
  long long threads_max = read_ll ("/proc/sys/kernel/threads-max");
  long long pids = pid_max > 0 && threads_max > 0 && threads_max < pid_max ? threads_max : pid_max;
  long long memcg = memcg_in_use ();
  long long userns = read_ll ("/proc/sys/user/max_user_namespaces");
  long long netns = read_ll ("/proc/sys/user/max_net_namespaces");
  long long mntns = read_ll ("/proc/sys/user/max_mnt_namespaces");
  long long pidns = read_ll ("/proc/sys/user/max_pid_namespaces");
  long long avail_kb = meminfo_kb ("MemAvailable");
  long long total_kb = meminfo_kb ("MemTotal");
  /* memory kept free for the daemon, page cache and execs */
  long long reserve_kb = total_kb > 0 ? total_kb / 20 : 0;
  if (reserve_kb < (256 << 10))
    reserve_kb = 256 << 10;
  d->mem_reserve_kb = reserve_kb;
  unsigned uid_blocks = d->rt ? d->rt->uid_blocks : 0u;
  struct limit lims[] = {
    /* with shedding, idle sandboxes hold none: descriptors bound the
     * connections in use, not the sandboxes */
    { "descriptors", agent_conns_never_shed ? (nofile - FD_RESERVE) / FDS_PER_SANDBOX : -1 },
    { "pids", pids > 0 ? (pids - 4096) / PIDS_PER_SANDBOX : -1 },
    { "memory cgroup ids", memcg >= 0 ? MEMCG_ID_MAX - memcg - 1024 : -1 },
    { "user namespaces", userns > 0 ? userns - 1024 : -1 },
    { "network namespaces", netns > 0 ? netns - 1024 : -1 },
    { "mount namespaces", mntns > 0 ? mntns - 1024 : -1 },
    { "pid namespaces", pidns > 0 ? pidns - 1024 : -1 },
    { "uid blocks", uid_blocks ? (long long)uid_blocks : -1 },
    { "memory", avail_kb > 0
                    ? (avail_kb - reserve_kb + (long long)d->count * MIB_PER_SANDBOX * 1024)
                          / (MIB_PER_SANDBOX * 1024)
                    : -1 },
  };
  long long cap = 1ll << 30;
  const char *by = "none";
  for (size_t i = 0; i < WR_ARRAY_SIZE (lims); i++)
    if (lims[i].value >= 0 && lims[i].value < cap)
      {
        cap = lims[i].value;
        by = lims[i].name;
      }
  if (cap < 1)
    cap = 1;
  d->kernel_max_sandboxes = (unsigned)cap;
  d->kernel_max_by = by;
  if (configured == 0)
    {
      const char *s = getenv ("WARREN_MAX_SANDBOXES"); /* the older spelling */
      char *end;
      if (s && *s && (configured = (unsigned)strtoul (s, &end, 10), *end == '\0'))
        ;
      else
        configured = 0;
    }
  d->max_sandboxes = configured;
  wrd_log (WRD_LOG_INFO,
           "limits: nofile %lld%s, pid_max %lld, threads-max %lld, memory cgroups in use %lld of "
           "%d, user/net/mnt/pid namespaces %lld/%lld/%lld/%lld, uid blocks %u, MemAvailable "
           "%lld MiB (reserve %lld MiB), keys.maxkeys %lld (per sandbox uid), "
           "inotify.max_user_instances %lld",
           nofile,
           nofile < WANT_NOFILE ? " (the hard limit: raising it needs CAP_SYS_RESOURCE)" : "",
           pid_max, threads_max, memcg, MEMCG_ID_MAX, userns, netns, mntns, pidns, uid_blocks,
           avail_kb >> 10, reserve_kb >> 10, read_ll ("/proc/sys/kernel/keys/maxkeys"),
           read_ll ("/proc/sys/fs/inotify/max_user_instances"));
  if (agent_conns_never_shed)
    wrd_log (WRD_LOG_INFO,
             "descriptors: every agent connection kept open (--agent-conns -1): one per "
             "sandbox, %d kept free",
             FD_RESERVE);
  else
    wrd_log (WRD_LOG_INFO,
             "descriptors: up to %u agent connections kept open (--agent-conns), %d kept free; "
             "idle sandboxes beyond them hold none",
             agent_conns, FD_RESERVE);
  if (configured)
    wrd_log (WRD_LOG_INFO, "capacity: %u sandboxes (limited by %s), --max-sandboxes %u",
             d->kernel_max_sandboxes, by, configured);
  else
    wrd_log (WRD_LOG_INFO, "capacity: %u sandboxes (limited by %s)", d->kernel_max_sandboxes, by);
}

/* MemAvailable, read at most every 100 ms: a create costs no /proc read */
static long long
avail_kb_cached (struct wrd *d)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC_COARSE, &ts);
  double now = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
  if (now - d->mem_checked_at >= 0.1)
    {
      d->mem_avail_kb = meminfo_kb ("MemAvailable");
      d->mem_checked_at = now;
    }
  return d->mem_avail_kb;
}

int
wrd_limits_admit (struct wrd *d, size_t client_held, wr_err_t *err)
{
  if (d->max_sandboxes && client_held >= d->max_sandboxes)
    return wr_error (err, 0, WR_E_EXHAUSTED,
                     "this node holds its maximum of %u sandboxes (--max-sandboxes); retry later",
                     d->max_sandboxes);
  size_t held = d->count + d->n_reaping + d->creating;
  if (d->kernel_max_sandboxes && held >= d->kernel_max_sandboxes)
    return wr_error (err, 0, WR_E_EXHAUSTED,
                     "this node is at its capacity of %u sandboxes (limited by %s); retry later",
                     d->kernel_max_sandboxes, d->kernel_max_by);
  long long avail = avail_kb_cached (d);
  if (avail >= 0 && avail < d->mem_reserve_kb)
    return wr_error (err, 0, WR_E_UNAVAILABLE,
                     "this node is low on memory (%lld MiB available, %lld kept free); retry "
                     "later",
                     avail >> 10, d->mem_reserve_kb >> 10);
  return 0;
}

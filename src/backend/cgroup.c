/* cgroups for sandboxes: v2, v1 and the hybrid layout (docs/containers.md).
 *
 * The layout is detected from /proc/self/mountinfo and cgroup.controllers,
 * never from the kernel version. Every hierarchy we use gets a `warren`
 * parent; a sandbox is a child named by its id. */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "../common/util.h"
#include "backend.h"

static const char *const v1_names[WR_V1_N] = { "memory", "pids", "cpu", "freezer", "cpuacct" };

/* mountinfo: "36 25 0:32 / /sys/fs/cgroup/memory rw,... - cgroup cgroup rw,memory" */
int
wr_cg_mounts (bool (*fn) (const char *mnt, const char *fstype, char *opts, void *ud), void *ud,
              wr_err_t *err)
{
  _cleanup_fclose_ FILE *f = fopen ("/proc/self/mountinfo", "re");
  if (f == NULL)
    return wr_sys_error (err, "open /proc/self/mountinfo");
  _cleanup_free_ char *line = NULL;
  size_t cap = 0;
  while (getline (&line, &cap, f) > 0)
    {
      char *sep = strstr (line, " - ");
      char root[4096], mnt[4096], fstype[64], src[64], opts[1024];
      if (sep == NULL || sscanf (line, "%*s %*s %*s %4095s %4095s", root, mnt) != 2
          || sscanf (sep + 3, "%63s %63s %1023s", fstype, src, opts) != 3)
        continue;
      /* A cgroup mount of a subtree (root != "/") is somebody else's view;
       * escaped characters (\\040) are not worth unescaping. */
      if ((strcmp (fstype, "cgroup") != 0 && strcmp (fstype, "cgroup2") != 0)
          || strcmp (root, "/") != 0 || strlen (mnt) >= 200 || strchr (mnt, '\\'))
        continue;
      if (fn (mnt, fstype, opts, ud))
        break;
    }
  return 0;
}

struct layout_scan
{
  char *v2;
  char (*v1)[256];
};

static bool
layout_mount (const char *mnt, const char *fstype, char *opts, void *ud)
{
  struct layout_scan *l = ud;
  if (strcmp (fstype, "cgroup2") == 0)
    {
      if (l->v2[0] == '\0')
        memcpy (l->v2, mnt, strlen (mnt) + 1);
      return false;
    }
  char *save = NULL;
  for (char *o = strtok_r (opts, ",", &save); o; o = strtok_r (NULL, ",", &save))
    for (int i = 0; i < WR_V1_N; i++)
      if (strcmp (o, v1_names[i]) == 0 && l->v1[i][0] == '\0')
        memcpy (l->v1[i], mnt, strlen (mnt) + 1);
  return false;
}

static int
parse_mountinfo (char v2[256], char v1[WR_V1_N][256], wr_err_t *err)
{
  struct layout_scan l = { v2, v1 };
  return wr_cg_mounts (layout_mount, &l, err);
}

static bool
word_in (const char *list, const char *w)
{
  size_t n = strlen (w);
  for (const char *p = list; (p = strstr (p, w)) != NULL; p += n)
    if ((p == list || p[-1] == ' ' || p[-1] == '\n')
        && (p[n] == '\0' || p[n] == ' ' || p[n] == '\n'))
      return true;
  return false;
}

static int
open_parent (const char *mnt, const char *name, char path[256], wr_err_t *err)
{
  snprintf (path, 256, "%s/%s", mnt, name);
  if (mkdir (path, 0755) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s", path);
  int fd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return wr_sys_error (err, "open %s", path);
  return fd;
}

static int set_qos (int dfd, bool v2, bool best_effort, wr_err_t *err);

/* The pool (docs/containers.md, "Pooled v1 cgroups"): a released
 * sandbox's v1 groups are renamed to pool_<n> in the same parent (v1
 * allows a rename within one parent; v2 allows none) and the next create
 * renames them to its id instead of a mkdir. A new memory cgroup costs a
 * shrinker slot per memcg-aware shrinker and one going offline walks every
 * list_lru on the host under cgroup_mutex (docs/performance.md,
 * "Density"): in steady state neither happens. A slot is one released
 * sandbox: the controllers whose pool_<n> dir exists (mask). The name
 * cannot be a sandbox id (wr_id_valid: no '_'). */
#define POOL_CAP_DEFAULT 1024
/* What a released group may still have charged to be pooled: page cache of
 * the image's files its tenant faulted first (1.7 MiB for an idle busybox
 * sandbox), charged from then on to the next tenant as if it had faulted
 * them. memory.force_empty would take 1.3 to 5.4 ms (more than the offline
 * it saves) and evict cache the next sandbox reads again; a group holding
 * more is removed (rmdir moves its charges to the parent, nothing read). */
#define POOL_MAX_LEFTOVER (8u << 20)

static int read_procs (int dfd, pid_t *pids, int max);
static uint64_t read_key (int dfd, const char *name, const char *key);
static void pause_us (long us);
static uint64_t read_u64 (int dfd, const char *name);

struct wr_cg_pool
{
  pthread_mutex_t lock;
  unsigned cap, n, next;
  struct pool_slot
  {
    unsigned num, mask;
  } * slot;
};

static unsigned
pool_cap (void)
{
  const char *e = getenv ("WARREN_CGROUP_POOL");
  if (e == NULL || *e == '\0')
    return POOL_CAP_DEFAULT;
  char *end;
  unsigned long v = strtoul (e, &end, 10);
  return *end == '\0' && v <= 1u << 20 ? (unsigned)v : POOL_CAP_DEFAULT;
}

/* pool_<n> dirs in the v1 parents: none of ours yet at init (a crashed
 * daemon's, or a previous run's that did not drain), all of ours at fini.
 * Removed: they hold no task, and a leftover of unknown history is not
 * worth its reuse. */
static void
pool_rmdir_all (struct wr_cgroups *cg)
{
  for (int i = 0; i < WR_V1_N; i++)
    {
      if (cg->v1_fd[i] < 0)
        continue;
      int d = openat (cg->v1_fd[i], ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      _cleanup_closedir_ DIR *dir = d >= 0 ? fdopendir (d) : NULL;
      if (dir == NULL)
        {
          if (d >= 0)
            close (d);
          continue;
        }
      struct dirent *de;
      while ((de = readdir (dir)) != NULL)
        if (de->d_type == DT_DIR && strncmp (de->d_name, "pool_", 5) == 0)
          unlinkat (cg->v1_fd[i], de->d_name, AT_REMOVEDIR);
    }
}

static void
pool_init (struct wr_cgroups *cg)
{
  if (cg->layout == WR_CG_V2)
    return; /* cgroup2 refuses rename: no pool (docs/containers.md) */
  pool_rmdir_all (cg);
  unsigned cap = pool_cap ();
  if (cap == 0)
    return;
  struct wr_cg_pool *p = calloc (1, sizeof *p);
  if (p == NULL || (p->slot = calloc (cap, sizeof *p->slot)) == NULL)
    {
      free (p);
      return; /* no pool: mkdir/rmdir as without one */
    }
  pthread_mutex_init (&p->lock, NULL);
  p->cap = cap;
  cg->pool = p;
}

static void
pool_fini (struct wr_cgroups *cg)
{
  if (cg->pool == NULL)
    return;
  pool_rmdir_all (cg);
  pthread_mutex_destroy (&cg->pool->lock);
  free (cg->pool->slot);
  free (cg->pool);
  cg->pool = NULL;
}

/* Take a pooled slot: its dirs renamed to id; returns the mask of the
 * controllers that got one (0: pool empty, mkdir them all). A best-effort
 * sandbox's cpu group lives in another parent: the pooled one goes. */
static unsigned
pool_take (struct wr_cgroups *cg, const char *id, bool be_cpu)
{
  struct wr_cg_pool *p = cg->pool;
  if (p == NULL)
    return 0;
  pthread_mutex_lock (&p->lock);
  struct pool_slot sl = { 0, 0 };
  if (p->n > 0)
    sl = p->slot[--p->n];
  pthread_mutex_unlock (&p->lock);
  unsigned got = 0;
  char name[32];
  snprintf (name, sizeof name, "pool_%u", sl.num);
  for (int i = 0; i < WR_V1_N; i++)
    {
      if (!(sl.mask & (1u << i)))
        continue;
      if (i == WR_V1_CPU && be_cpu)
        unlinkat (cg->v1_fd[i], name, AT_REMOVEDIR);
      /* ENOENT: another process's init removed it (pool_rmdir_all) */
      else if (renameat (cg->v1_fd[i], name, cg->v1_fd[i], id) == 0)
        got |= 1u << i;
    }
  return got;
}

/* Pool a released sandbox's v1 groups, when the pool has room and the
 * groups are fit for another tenant: no task left (a stuck release is
 * never pooled), no child group, no OOM kill counted (memory.oom_control's
 * oom_kill cannot be reset, and the next tenant's stats must start at 0:
 * such a rare group is removed instead). The callers rmdir what is left. */
static void
pool_put (struct wr_cgroups *cg, const char *id)
{
  struct wr_cg_pool *p = cg->pool;
  if (p == NULL)
    return;
  int mfd = cg->v1_fd[WR_V1_MEMORY];
  _cleanup_close_ int m = mfd >= 0 ? openat (mfd, id, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
  if (m < 0)
    return;
  /* the last exiting task can take a moment to leave (as rmdir's EBUSY) */
  pid_t pid;
  for (long delay = 50, waited = 0;; delay *= 2)
    {
      int n = read_procs (m, &pid, 1);
      if (n == 0)
        break;
      if (n < 0 || waited > 2000000)
        return;
      pause_us (delay);
      waited += delay;
    }
  struct stat st;
  if (fstat (m, &st) < 0 || st.st_nlink > 2 || read_key (m, "memory.oom_control", "oom_kill") > 0
      || read_u64 (m, "memory.usage_in_bytes") > POOL_MAX_LEFTOVER)
    return;
  for (int i = 0; i < WR_V1_N; i++)
    if (i != WR_V1_MEMORY && cg->v1_fd[i] >= 0)
      {
        _cleanup_close_ int c = openat (cg->v1_fd[i], id, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (c >= 0 && (read_procs (c, &pid, 1) != 0 || fstat (c, &st) < 0 || st.st_nlink > 2))
          return;
      }
  /* renamed under the lock: a create that finds the group gone from under
   * its old id (the daemon's release is asynchronous) finds it in the pool
   * (a few renames, microseconds, against the ms of a memcg offline) */
  pthread_mutex_lock (&p->lock);
  if (p->n < p->cap)
    {
      struct pool_slot sl = { p->next++, 0 };
      char name[32];
      snprintf (name, sizeof name, "pool_%u", sl.num);
      for (int i = 0; i < WR_V1_N; i++)
        if (cg->v1_fd[i] >= 0 && renameat (cg->v1_fd[i], id, cg->v1_fd[i], name) == 0)
          sl.mask |= 1u << i;
      if (sl.mask & (1u << WR_V1_MEMORY))
        p->slot[p->n++] = sl;
      else /* no memory group to reuse: not worth a slot */
        for (int i = 0; i < WR_V1_N; i++)
          if (sl.mask & (1u << i))
            unlinkat (cg->v1_fd[i], name, AT_REMOVEDIR);
    }
  pthread_mutex_unlock (&p->lock);
}

/* CPU QoS (docs/performance.md, "CPU QoS"): best-effort sandboxes' cpu
 * groups go under NAME.best-effort, a sibling of the parent made an idle
 * entity (cpu.idle 1; cpu.weight 1 / cpu.shares 2 without it). Under the
 * parent, next to the latency sandboxes, the burners' CPU time was charged
 * to the parent's own entity at the top level: once they had used the
 * parent's fair share there, a latency sandbox's wakeup waited behind every
 * other runnable task on the host, tens of ms (perf sched: the latency
 * agent runnable for 58 ms while the CPU went to burners and a host task in
 * turns). An idle top-level entity is preempted by any wakeup at that level
 * and the latency parent keeps none of its debt. */
static int
be_parent (const char *mnt, const char *name, bool v2, char path[256], wr_err_t *err)
{
  char be[128];
  snprintf (be, sizeof be, "%s.best-effort", name);
  _cleanup_close_ int fd = open_parent (mnt, be, path, err);
  if (fd < 0)
    return fd;
  int r;
  if (v2 && (r = wr_write_file_at (fd, "cgroup.subtree_control", "+memory +pids +cpu")) < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "enable controllers in %s", path);
  if ((r = set_qos (fd, v2, true, err)) < 0)
    return r;
  return TAKE_FD (fd);
}

int
wr_cg_init (struct wr_cgroups *cg, const char *name, wr_err_t *err)
{
  char v2[256] = "", v1[WR_V1_N][256] = { { 0 } };
  memset (cg, 0, sizeof *cg);
  cg->v2_fd = cg->be_v2_fd = cg->be_cpu_fd = -1;
  for (int i = 0; i < WR_V1_N; i++)
    cg->v1_fd[i] = -1;
  int r = parse_mountinfo (v2, v1, err);
  if (r < 0)
    return r;

  _cleanup_free_ char *ctrls = NULL;
  if (v2[0])
    {
      _cleanup_close_ int rootfd = open (v2, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (rootfd < 0 || wr_read_file_at (rootfd, "cgroup.controllers", &ctrls, NULL, 4096) < 0)
        return wr_sys_error (err, "read %s/cgroup.controllers", v2);
      bool all = word_in (ctrls, "memory") && word_in (ctrls, "pids") && word_in (ctrls, "cpu");
      if (all)
        {
          /* Pure v2 (or v2 owning every controller we need). */
          cg->layout = WR_CG_V2;
          cg->v2_limits = true;
          r = wr_write_file_at (rootfd, "cgroup.subtree_control", "+memory +pids +cpu");
          if (r < 0)
            return wr_error (err, -r, WR_E_INTERNAL, "enable controllers in %s", v2);
        }
      else if (v1[WR_V1_MEMORY][0] && v1[WR_V1_PIDS][0])
        cg->layout = WR_CG_HYBRID;
      else
        return wr_error (err, ENOTSUP, WR_E_UNSUPPORTED,
                         "cgroup2 at %s lacks memory/pids/cpu and no v1 controllers either", v2);
      r = open_parent (v2, name, cg->v2_path, err);
      if (r < 0)
        return r;
      cg->v2_fd = r;
      if (cg->v2_limits)
        {
          r = wr_write_file_at (cg->v2_fd, "cgroup.subtree_control", "+memory +pids +cpu");
          if (r < 0)
            return wr_error (err, -r, WR_E_INTERNAL, "enable controllers in %s", cg->v2_path);
        }
    }
  else if (v1[WR_V1_MEMORY][0] && v1[WR_V1_PIDS][0] && v1[WR_V1_FREEZER][0])
    cg->layout = WR_CG_V1;
  else
    return wr_error (err, ENOTSUP, WR_E_UNSUPPORTED, "no usable cgroup hierarchy");

  if (cg->layout != WR_CG_V2)
    for (int i = 0; i < WR_V1_N; i++)
      {
        /* hybrid: freezer/cpuacct are replaced by v2 cgroup.freeze and cpu.stat */
        if (cg->layout == WR_CG_HYBRID && (i == WR_V1_FREEZER || i == WR_V1_CPUACCT))
          continue;
        if (v1[i][0] == '\0')
          continue;
        /* cpu,cpuacct co-mounted: one directory serves both */
        if (i == WR_V1_CPUACCT && strcmp (v1[i], v1[WR_V1_CPU]) == 0)
          continue;
        r = open_parent (v1[i], name, cg->v1_path[i], err);
        if (r < 0)
          return r;
        cg->v1_fd[i] = r;
      }
  if (cg->v2_limits)
    {
      if ((r = be_parent (v2, name, true, cg->be_v2_path, err)) < 0)
        return r;
      cg->be_v2_fd = r;
    }
  else if (cg->v1_fd[WR_V1_CPU] >= 0)
    {
      if ((r = be_parent (v1[WR_V1_CPU], name, false, cg->be_cpu_path, err)) < 0)
        return r;
      cg->be_cpu_fd = r;
    }
  pool_init (cg);
  return 0;
}

void
wr_cg_fini (struct wr_cgroups *cg)
{
  pool_fini (cg);
  /* Remove the empty `warren` parents; fails harmlessly while sandboxes live. */
  int *be_fd[] = { &cg->be_v2_fd, &cg->be_cpu_fd };
  const char *be_path[] = { cg->be_v2_path, cg->be_cpu_path };
  for (size_t i = 0; i < WR_ARRAY_SIZE (be_fd); i++)
    if (*be_fd[i] >= 0)
      {
        close (*be_fd[i]);
        rmdir (be_path[i]);
        *be_fd[i] = -1;
      }
  if (cg->v2_fd >= 0)
    {
      close (cg->v2_fd);
      rmdir (cg->v2_path);
      cg->v2_fd = -1;
    }
  for (int i = 0; i < WR_V1_N; i++)
    if (cg->v1_fd[i] >= 0)
      {
        close (cg->v1_fd[i]);
        rmdir (cg->v1_path[i]);
        cg->v1_fd[i] = -1;
      }
}

void
wr_cg_sandbox_close (struct wr_cg_sandbox *s)
{
  if (s->v2_fd >= 0)
    close (s->v2_fd);
  s->v2_fd = -1;
  for (int i = 0; i < WR_V1_N; i++)
    {
      if (s->v1_fd[i] >= 0)
        close (s->v1_fd[i]);
      s->v1_fd[i] = -1;
    }
}

static int
mk_open (int parent, const char *id, bool create)
{
  if (parent < 0)
    return -1;
  if (create && mkdirat (parent, id, 0755) < 0 && errno != EEXIST)
    return -errno - 1000000;
  int fd = openat (parent, id, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  return fd < 0 ? -errno - 1000000 : fd;
}

static int
knob (int dfd, const char *name, const char *val, wr_err_t *err)
{
  int r = wr_write_file_at (dfd, name, val);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "write %s=%s", name, val);
  return 0;
}

/* knob, skipped when the file holds val already: a CPU quota write
 * (tg_set_cfs_bandwidth) walks every task group on the host, so with
 * thousands of sandboxes alive it cost ~0.2 ms per create; a pooled group
 * usually has the quota its next tenant asks for. */
static int
knob_if_changed (int dfd, const char *name, const char *val, wr_err_t *err)
{
  _cleanup_free_ char *cur = NULL;
  size_t len = 0;
  if (wr_read_file_at (dfd, name, &cur, &len, 64) == 0)
    {
      while (len > 0 && (cur[len - 1] == '\n' || cur[len - 1] == ' '))
        len--;
      if (len == strlen (val) && memcmp (cur, val, len) == 0)
        return 0;
    }
  return knob (dfd, name, val, err);
}

/* CPU QoS (docs/performance.md, "CPU QoS"): a best-effort sandbox's group
 * (and the parent of them all, be_parent) is an idle entity (cpu.idle,
 * kernel >= 5.15, v1 and v2), or where the kernel lacks it the lowest
 * weight (cpu.weight 1, cpu.shares 2). Always written, so a reused cgroup
 * never keeps another sandbox's class. The kernel refuses a weight while
 * the group is idle: idle goes first. */
static int
set_qos (int dfd, bool v2, bool best_effort, wr_err_t *err)
{
  if (dfd < 0)
    return 0;
  bool has_idle = faccessat (dfd, "cpu.idle", F_OK, 0) == 0;
  int r = has_idle ? knob (dfd, "cpu.idle", best_effort ? "1" : "0", err) : 0;
  if (r < 0 || (has_idle && best_effort))
    return r;
  if (v2)
    return knob (dfd, "cpu.weight", best_effort ? "1" : "100", err);
  return knob (dfd, "cpu.shares", best_effort ? "2" : "1024", err);
}

/* v1 swap while running: where memsw exists its limit (== the memory
 * limit) already keeps memory + swap within bounds; without it (no swap
 * accounting) a running sandbox must not reach the host's swap (warrend's
 * zram is host-wide), so swappiness 0, raised to 100 only while paused
 * (wr_cg_reclaim). Always written: a reused cgroup keeps nothing. */
static int
v1_swappiness (int m, bool paused, wr_err_t *err)
{
  if (m < 0 || faccessat (m, "memory.swappiness", F_OK, 0) < 0)
    return 0;
  bool memsw = faccessat (m, "memory.memsw.limit_in_bytes", F_OK, 0) == 0;
  return knob (m, "memory.swappiness", paused ? "100" : memsw ? "60" : "0", err);
}

/* A pooled group's counters start again at 0 for its next tenant: the
 * peaks and fail counts (written 0: reset), CPU time, a freezer left
 * frozen. memory.oom_control's oom_kill cannot be reset: pool_put never
 * pools a group that has one. Limits are all rewritten by the caller.
 * Best effort: a counter file this kernel lacks is skipped. */
static void
reset_counters (struct wr_cg_sandbox *s, unsigned reused)
{
  static const char *const mem[] = {
    "memory.max_usage_in_bytes",          "memory.failcnt",
    "memory.memsw.max_usage_in_bytes",    "memory.memsw.failcnt",
    "memory.kmem.max_usage_in_bytes",     "memory.kmem.failcnt",
    "memory.kmem.tcp.max_usage_in_bytes", "memory.kmem.tcp.failcnt",
  };
  for (size_t i = 0; i < WR_ARRAY_SIZE (mem); i++)
    wr_write_file_at (s->v1_fd[WR_V1_MEMORY], mem[i], "0");
  /* cpuacct: its own hierarchy or co-mounted with cpu */
  if (reused & (1u << WR_V1_CPUACCT))
    wr_write_file_at (s->v1_fd[WR_V1_CPUACCT], "cpuacct.usage", "0");
  if ((reused & (1u << WR_V1_CPU))
      && faccessat (s->v1_fd[WR_V1_CPU], "cpuacct.usage", F_OK, 0) == 0)
    wr_write_file_at (s->v1_fd[WR_V1_CPU], "cpuacct.usage", "0");
  if (reused & (1u << WR_V1_FREEZER))
    wr_write_file_at (s->v1_fd[WR_V1_FREEZER], "freezer.state", "THAWED");
}

int
wr_cg_create (struct wr_cgroups *cg, const char *id, const struct wr_cg_limits *lim,
              struct wr_cg_sandbox *s, wr_err_t *err)
{
  char buf[64];
  int r;
  s->v2_fd = -1;
  for (int i = 0; i < WR_V1_N; i++)
    s->v1_fd[i] = -1;
  bool be_v2 = lim->best_effort && cg->be_v2_fd >= 0;
  /* the v1 groups a released sandbox left, renamed to id (pool_take) */
  unsigned reused = cg->v2_limits ? 0 : pool_take (cg, id, lim->best_effort && cg->be_cpu_fd >= 0);
  if (cg->v2_fd >= 0)
    {
      r = mk_open (be_v2 ? cg->be_v2_fd : cg->v2_fd, id, true);
      if (r < -1)
        return wr_error (err, -(r + 1000000), WR_E_INTERNAL, "cgroup %s/%s",
                         be_v2 ? cg->be_v2_path : cg->v2_path, id);
      s->v2_fd = r;
    }
  for (int i = 0; i < WR_V1_N; i++)
    if (cg->v1_fd[i] >= 0)
      {
        bool be = i == WR_V1_CPU && lim->best_effort && cg->be_cpu_fd >= 0;
        r = mk_open (be ? cg->be_cpu_fd : cg->v1_fd[i], id, true);
        if (r < -1)
          {
            wr_cg_sandbox_close (s);
            return wr_error (err, -(r + 1000000), WR_E_INTERNAL, "cgroup %s/%s",
                             be ? cg->be_cpu_path : cg->v1_path[i], id);
          }
        s->v1_fd[i] = r;
      }

  uint64_t pids = lim->pids_max ? lim->pids_max : 1024;
  if (cg->v2_limits)
    {
      if (lim->memory_bytes)
        {
          snprintf (buf, sizeof buf, "%" PRIu64, lim->memory_bytes);
          if ((r = knob (s->v2_fd, "memory.max", buf, err)) < 0)
            goto fail;
          /* no swap: a memory bomb is OOM-killed instead of thrashing the node */
          if (faccessat (s->v2_fd, "memory.swap.max", F_OK, 0) == 0
              && (r = knob (s->v2_fd, "memory.swap.max", "0", err)) < 0)
            goto fail;
        }
      snprintf (buf, sizeof buf, "%" PRIu64, pids);
      if ((r = knob (s->v2_fd, "pids.max", buf, err)) < 0)
        goto fail;
      if (lim->cpus > 0)
        {
          snprintf (buf, sizeof buf, "%" PRIu64 " 100000", (uint64_t)(lim->cpus * 100000 + 0.5));
          if ((r = knob (s->v2_fd, "cpu.max", buf, err)) < 0)
            goto fail;
        }
      if ((r = set_qos (s->v2_fd, true, lim->best_effort, err)) < 0)
        goto fail;
      return 0;
    }
  int m = s->v1_fd[WR_V1_MEMORY];
  bool was_pooled = reused & (1u << WR_V1_MEMORY);
  if (was_pooled)
    reset_counters (s, reused);
  if (lim->memory_bytes || was_pooled)
    {
      snprintf (buf, sizeof buf, "%" PRIu64, lim->memory_bytes);
      if (lim->memory_bytes == 0)
        snprintf (buf, sizeof buf, "-1");
      /* memsw exists only with swap accounting; limit == mem limit means no
       * swap. The kernel keeps memsw >= memory at every write: a pooled
       * group's old memsw limit is lifted first. */
      bool memsw = faccessat (m, "memory.memsw.limit_in_bytes", F_OK, 0) == 0;
      if (memsw && was_pooled && (r = knob (m, "memory.memsw.limit_in_bytes", "-1", err)) < 0)
        goto fail;
      if ((r = knob (m, "memory.limit_in_bytes", buf, err)) < 0)
        goto fail;
      if (memsw && (r = knob (m, "memory.memsw.limit_in_bytes", buf, err)) < 0)
        goto fail;
    }
  if ((r = v1_swappiness (m, false, err)) < 0)
    goto fail;
  snprintf (buf, sizeof buf, "%" PRIu64, pids);
  if ((r = knob (s->v1_fd[WR_V1_PIDS], "pids.max", buf, err)) < 0)
    goto fail;
  if (s->v1_fd[WR_V1_CPU] >= 0)
    {
      /* always set so a reused (pooled/leftover) cgroup never keeps an old quota */
      if (lim->cpus > 0)
        snprintf (buf, sizeof buf, "%" PRIu64, (uint64_t)(lim->cpus * 100000 + 0.5));
      else
        snprintf (buf, sizeof buf, "-1");
      if ((r = knob_if_changed (s->v1_fd[WR_V1_CPU], "cpu.cfs_quota_us", buf, err)) < 0)
        goto fail;
    }
  if ((r = set_qos (s->v1_fd[WR_V1_CPU], false, lim->best_effort, err)) < 0)
    goto fail;
  return 0;
fail:
  wr_cg_sandbox_close (s);
  wr_cg_remove (cg, id, NULL);
  return r;
}

int
wr_cg_open (struct wr_cgroups *cg, const char *id, struct wr_cg_sandbox *s)
{
  int n = 0;
  /* a best-effort sandbox's group is under the idle sibling (wr_cg_init) */
  s->v2_fd = mk_open (cg->v2_fd, id, false);
  if (s->v2_fd < 0)
    s->v2_fd = mk_open (cg->be_v2_fd, id, false);
  if (s->v2_fd < -1)
    s->v2_fd = -1;
  n += s->v2_fd >= 0;
  for (int i = 0; i < WR_V1_N; i++)
    {
      s->v1_fd[i] = mk_open (cg->v1_fd[i], id, false);
      if (s->v1_fd[i] < 0 && i == WR_V1_CPU)
        s->v1_fd[i] = mk_open (cg->be_cpu_fd, id, false);
      if (s->v1_fd[i] < -1)
        s->v1_fd[i] = -1;
      n += s->v1_fd[i] >= 0;
    }
  return n;
}

int
wr_cg_attach_v1 (struct wr_cgroups *cg, struct wr_cg_sandbox *s, pid_t pid, wr_err_t *err)
{
  char buf[32];
  snprintf (buf, sizeof buf, "%d", (int)pid);
  for (int i = 0; i < WR_V1_N; i++)
    if (s->v1_fd[i] >= 0)
      {
        int r = wr_write_file_at (s->v1_fd[i], "cgroup.procs", buf);
        if (r < 0)
          return wr_error (err, -r, WR_E_INTERNAL, "join %s cgroup", v1_names[i]);
      }
  return 0;
}

/* Read cgroup.procs; returns number of pids (up to max stored), or -errno. */
static int
read_procs (int dfd, pid_t *pids, int max)
{
  _cleanup_free_ char *buf = NULL;
  int r = wr_read_file_at (dfd, "cgroup.procs", &buf, NULL, 1 << 22);
  if (r < 0)
    return r;
  int n = 0;
  for (char *p = buf; *p;)
    {
      char *end;
      long v = strtol (p, &end, 10);
      if (end == p)
        break;
      if (n < max)
        pids[n] = (pid_t)v;
      n++;
      p = end;
      while (*p == '\n')
        p++;
    }
  return n;
}

/* read_procs of a v2 sandbox cgroup and of the per-exec children its agent
 * made in it (delegated, depth 1): the pids of the whole subtree. */
static int
read_procs_subtree (int dfd, pid_t *pids, int max)
{
  int n = read_procs (dfd, pids, max);
  if (n < 0)
    return n;
  int d = openat (dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  _cleanup_closedir_ DIR *dir = d >= 0 ? fdopendir (d) : NULL;
  if (dir == NULL)
    {
      if (d >= 0)
        close (d);
      return n;
    }
  struct dirent *de;
  while ((de = readdir (dir)) != NULL)
    {
      if (de->d_type != DT_DIR || de->d_name[0] == '.')
        continue;
      _cleanup_close_ int c = openat (dfd, de->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      int k = c >= 0 ? read_procs (c, pids + (n < max ? n : max), n < max ? max - n : 0) : 0;
      if (k > 0)
        n += k;
    }
  return n;
}

int
wr_cg_pids (struct wr_cgroups *cg WR_UNUSED, struct wr_cg_sandbox *s, pid_t *pids, int max)
{
  int track = s->v2_fd >= 0 ? s->v2_fd : s->v1_fd[WR_V1_MEMORY];
  if (track < 0)
    return 0;
  int n = track == s->v2_fd ? read_procs_subtree (track, pids, max) : read_procs (track, pids, max);
  return n < 0 ? 0 : n;
}

/* rmdir the children of a delegated v2 sandbox cgroup (empty by now) */
static void
remove_children (int parent, const char *id)
{
  int d = openat (parent, id, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  _cleanup_closedir_ DIR *dir = d >= 0 ? fdopendir (d) : NULL;
  if (dir == NULL)
    {
      if (d >= 0)
        close (d);
      return;
    }
  struct dirent *de;
  while ((de = readdir (dir)) != NULL)
    if (de->d_type == DT_DIR && de->d_name[0] != '.')
      unlinkat (dirfd (dir), de->d_name, AT_REMOVEDIR);
}

static void
pause_us (long us)
{
  struct timespec ts = { 0, us * 1000 };
  nanosleep (&ts, NULL);
}

int
wr_cg_kill (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err)
{
  /* The v2 cgroup (when any) holds every process: it is either the one we
   * cloned into or, on pure v2, the only one. */
  int track = s->v2_fd >= 0               ? s->v2_fd
              : s->v1_fd[WR_V1_PIDS] >= 0 ? s->v1_fd[WR_V1_PIDS]
                                          : s->v1_fd[WR_V1_MEMORY];
  if (track < 0)
    return 0;
  /* cgroup.kill kills atomically, forks included; one write is enough. */
  bool killed = s->v2_fd >= 0 && wr_write_file_at (s->v2_fd, "cgroup.kill", "1") == 0;
  int freezer = s->v2_fd >= 0 ? -1 : s->v1_fd[WR_V1_FREEZER];
  pid_t pids[256];
  uint64_t deadline = wr_now_ns () + 5000000000ull;
  for (long delay = 20;; delay = delay < 10000 ? delay * 2 : delay)
    {
      int n = track == s->v2_fd ? read_procs_subtree (track, pids, (int)WR_ARRAY_SIZE (pids))
                                : read_procs (track, pids, (int)WR_ARRAY_SIZE (pids));
      if (n == -ENOENT || n == -ENODEV || n == 0)
        return 0;
      if (n < 0)
        return wr_error (err, -n, WR_E_INTERNAL, "read cgroup.procs");
      if (!killed)
        {
          /* No cgroup.kill: freeze so nothing forks while we kill, then thaw so
           * SIGKILL is delivered; repeat until empty. */
          if (freezer >= 0)
            wr_write_file_at (freezer, "freezer.state", "FROZEN");
          else if (s->v2_fd >= 0)
            wr_write_file_at (s->v2_fd, "cgroup.freeze", "1");
          n = track == s->v2_fd ? read_procs_subtree (track, pids, (int)WR_ARRAY_SIZE (pids))
                                : read_procs (track, pids, (int)WR_ARRAY_SIZE (pids));
          for (int i = 0; i < n && i < (int)WR_ARRAY_SIZE (pids); i++)
            kill (pids[i], SIGKILL);
          if (freezer >= 0)
            wr_write_file_at (freezer, "freezer.state", "THAWED");
          else if (s->v2_fd >= 0)
            wr_write_file_at (s->v2_fd, "cgroup.freeze", "0");
        }
      if (wr_now_ns () > deadline)
        return wr_error (err, EBUSY, WR_E_INTERNAL, "processes survive in the sandbox cgroup");
      pause_us (delay);
    }
}

int
wr_cg_freeze (struct wr_cgroups *cg, struct wr_cg_sandbox *s, bool frozen, wr_err_t *err)
{
  int r;
  if (s->v2_fd >= 0)
    r = wr_write_file_at (s->v2_fd, "cgroup.freeze", frozen ? "1" : "0");
  else if (s->v1_fd[WR_V1_FREEZER] >= 0)
    r = wr_write_file_at (s->v1_fd[WR_V1_FREEZER], "freezer.state", frozen ? "FROZEN" : "THAWED");
  else
    return wr_error (err, ENOTSUP, WR_E_UNSUPPORTED, "no freezer for this sandbox");
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "freeze");
  return 0;
}

int
wr_cg_wait_frozen (struct wr_cgroups *cg WR_UNUSED, struct wr_cg_sandbox *s, int timeout_ms)
{
  /* v2: cgroup.events says "frozen 1"; v1: freezer.state reads FROZEN
   * (FREEZING while a task has not stopped yet) */
  for (int waited = 0;; waited++)
    {
      _cleanup_free_ char *buf = NULL;
      bool done;
      if (s->v2_fd >= 0)
        done = wr_read_file_at (s->v2_fd, "cgroup.events", &buf, NULL, 4096) >= 0
               && strstr (buf, "frozen 1") != NULL;
      else if (s->v1_fd[WR_V1_FREEZER] >= 0)
        done = wr_read_file_at (s->v1_fd[WR_V1_FREEZER], "freezer.state", &buf, NULL, 64) >= 0
               && strncmp (buf, "FROZEN", 6) == 0;
      else
        return -ENOTSUP;
      if (done)
        return 0;
      if (waited >= timeout_ms)
        return -ETIMEDOUT;
      usleep (1000);
    }
}

/* Pause (docs/containers.md, "Pause"): with the sandbox frozen, push what
 * its cgroup charges (anonymous memory, tmpfs, page cache) out: to swap
 * where there is some (zram, warrend --zram-size), dropped where clean.
 * v2: memory.reclaim of everything, with the swap the sandbox is otherwise
 * denied (memory.swap.max 0) let through while it is paused. v1:
 * memory.force_empty, which reclaims with swap until the group is empty or
 * makes no more progress, tasks or not, with swappiness 100 while paused;
 * memsw (memory + swap) stays what it was, so its limit is no obstacle.
 * Neither fails because something stayed (unreclaimable kernel memory, no
 * swap): the caller measures. wr_cg_reclaim_begin lets the swap in (a
 * knob write, on the caller's side of a resume); wr_cg_reclaim runs the
 * rounds (seconds for hundreds of MB: on a worker thread, warrend) and
 * stops early once *stop is set or the group is no longer frozen. */
int
wr_cg_reclaim_begin (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err)
{
  bool v2 = cg->v2_limits && s->v2_fd >= 0;
  int m = v2 ? s->v2_fd : s->v1_fd[WR_V1_MEMORY];
  if (m < 0)
    return wr_error (err, ENOTSUP, WR_E_UNSUPPORTED, "no memory cgroup for this sandbox");
  if (v2)
    return faccessat (m, "memory.swap.max", F_OK, 0) == 0 ? knob (m, "memory.swap.max", "max", err)
                                                          : 0;
  return v1_swappiness (m, true, err);
}

int
wr_cg_reclaim (struct wr_cgroups *cg, struct wr_cg_sandbox *s, const atomic_bool *stop,
               wr_err_t *err)
{
  int r;
  bool v2 = cg->v2_limits && s->v2_fd >= 0;
  int m = v2 ? s->v2_fd : s->v1_fd[WR_V1_MEMORY];
  const char *usage = v2 ? "memory.current" : "memory.usage_in_bytes";
  if (m < 0)
    return wr_error (err, ENOTSUP, WR_E_UNSUPPORTED, "no memory cgroup for this sandbox");
  uint64_t cur = read_u64 (m, usage);
  for (int round = 0; round < 8 && cur > (1u << 20); round++)
    {
      /* resumed (or being destroyed) meanwhile: a running sandbox's memory
       * is not pushed out (its swap is denied again anyway) */
      if ((stop && atomic_load (stop)) || wr_cg_wait_frozen (cg, s, 0) == -ETIMEDOUT)
        break;
      /* Reclaim sizes the LRU lists from the memcg's rstat counters, which
       * the kernel flushes lazily (every 2 s or so): right after a working
       * set was written the active anon list still reads as empty, nothing
       * is deactivated and every pass gives up having freed ~5 %. Reading
       * memory.stat flushes them (memory.force_empty by hand "worked" only
       * because whoever ran it had looked at memory.stat first). */
      _cleanup_free_ char *stat = NULL;
      wr_read_file_at (m, "memory.stat", &stat, NULL, 1 << 16);
      char buf[32];
      snprintf (buf, sizeof buf, "%" PRIu64, cur);
      r = wr_write_file_at (m, v2 ? "memory.reclaim" : "memory.force_empty", v2 ? buf : "0");
      /* EAGAIN (v2): less than asked could be reclaimed, the expected end;
       * EINTR: a signal for the caller cut a pass short, go again */
      if (r < 0 && r != -EAGAIN && r != -EBUSY && r != -EINTR)
        return wr_error (err, -r, WR_E_INTERNAL, "write %s",
                         v2 ? "memory.reclaim" : "memory.force_empty");
      uint64_t now = read_u64 (m, usage);
      if (now >= cur && r != -EINTR) /* nothing freed: nothing more to get */
        break;
      cur = now;
    }
  return 0;
}

/* Resume: new swap-outs denied again (v2 swap.max 0, v1 swappiness as at
 * create); what was swapped comes back as it is touched or prefetched. */
int
wr_cg_unreclaim (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err)
{
  _cleanup_free_ char *max = NULL;
  if (!cg->v2_limits)
    return v1_swappiness (s->v1_fd[WR_V1_MEMORY], false, err);
  if (!cg->v2_limits || s->v2_fd < 0 || faccessat (s->v2_fd, "memory.swap.max", F_OK, 0) < 0
      || wr_read_file_at (s->v2_fd, "memory.max", &max, NULL, 64) < 0
      || strncmp (max, "max", 3) == 0)
    return 0;
  return knob (s->v2_fd, "memory.swap.max", "0", err);
}

static uint64_t
read_u64 (int dfd, const char *name)
{
  _cleanup_free_ char *b = NULL;
  if (dfd < 0 || wr_read_file_at (dfd, name, &b, NULL, 64) < 0)
    return 0;
  return strtoull (b, NULL, 10);
}

/* "key value" lines: value of key, 0 when absent. */
static uint64_t
read_key (int dfd, const char *name, const char *key)
{
  _cleanup_free_ char *b = NULL;
  if (dfd < 0 || wr_read_file_at (dfd, name, &b, NULL, 1 << 16) < 0)
    return 0;
  size_t kl = strlen (key);
  for (char *p = b; p && *p; p = strchr (p, '\n') ? strchr (p, '\n') + 1 : NULL)
    if (strncmp (p, key, kl) == 0 && p[kl] == ' ')
      return strtoull (p + kl + 1, NULL, 10);
  return 0;
}

int
wr_cg_stats (struct wr_cgroups *cg, struct wr_cg_sandbox *s, struct wr_container_stats *ret,
             wr_err_t *err)
{
  memset (ret, 0, sizeof *ret);
  if (cg->v2_limits)
    {
      ret->memory_bytes = read_u64 (s->v2_fd, "memory.current");
      ret->memory_peak_bytes = read_u64 (s->v2_fd, "memory.peak");
      ret->oom_kills = read_key (s->v2_fd, "memory.events", "oom_kill");
      ret->pids = read_u64 (s->v2_fd, "pids.current");
    }
  else
    {
      int m = s->v1_fd[WR_V1_MEMORY];
      ret->memory_bytes = read_u64 (m, "memory.usage_in_bytes");
      ret->memory_peak_bytes = read_u64 (m, "memory.max_usage_in_bytes");
      ret->oom_kills = read_key (m, "memory.oom_control", "oom_kill");
      ret->pids = read_u64 (s->v1_fd[WR_V1_PIDS], "pids.current");
    }
  if (s->v2_fd >= 0)
    ret->cpu_usage_ns = read_key (s->v2_fd, "cpu.stat", "usage_usec") * 1000;
  else
    {
      int a = s->v1_fd[WR_V1_CPUACCT] >= 0 ? s->v1_fd[WR_V1_CPUACCT] : s->v1_fd[WR_V1_CPU];
      ret->cpu_usage_ns = read_u64 (a, "cpuacct.usage");
    }
  return 0;
}

int
wr_cg_remove (struct wr_cgroups *cg, const char *id, wr_err_t *err)
{
  /* v2 parents first (they may hold the agent's per-exec children), then
   * v1; either QoS class (wr_cg_init) */
  int fds[3 + WR_V1_N];
  const char *paths[3 + WR_V1_N];
  fds[0] = cg->v2_fd, paths[0] = cg->v2_path;
  fds[1] = cg->be_v2_fd, paths[1] = cg->be_v2_path;
  fds[2] = cg->be_cpu_fd, paths[2] = cg->be_cpu_path;
  for (int i = 0; i < WR_V1_N; i++)
    fds[3 + i] = cg->v1_fd[i], paths[3 + i] = cg->v1_path[i];
  int ret = 0;
  pool_put (cg, id); /* what it pooled is gone from under id: ENOENT below */
  for (size_t i = 0; i < WR_ARRAY_SIZE (fds); i++)
    {
      if (fds[i] < 0)
        continue;
      /* EBUSY while the last exiting task is still being released */
      for (long delay = 50, waited = 0;; delay *= 2)
        {
          if (i < 2)
            remove_children (fds[i], id);
          if (unlinkat (fds[i], id, AT_REMOVEDIR) == 0 || errno == ENOENT)
            break;
          if (errno != EBUSY || waited > 2000000)
            {
              ret = wr_sys_error (err, "rmdir cgroup %s/%s", paths[i], id);
              break;
            }
          pause_us (delay);
          waited += delay;
        }
    }
  return ret;
}

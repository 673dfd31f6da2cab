/* Reference measurements for `warren bench` (see bench_floor.h). */
#include "cli/bench_floor.h"

#include <assert.h>
#include <elf.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"

extern char **environ;

#define WR_BENCH_WARMUP 3
#define WR_BENCH_CMD_TIMEOUT_MS 10000

/* Nearest-rank percentile of a sorted array. */
static double
percentile (const double *sorted, size_t n, double p)
{
  if (n == 0)
    return 0;
  size_t rank = (size_t)ceil (p / 100.0 * (double)n);
  if (rank < 1)
    rank = 1;
  if (rank > n)
    rank = n;
  return sorted[rank - 1];
}

void
wr_bench_stats_compute (double *lat_ms, size_t n, double wall_s, unsigned concurrency,
                        wr_bench_stats_t *ret)
{
  memset (ret, 0, sizeof *ret);
  ret->count = n;
  ret->concurrency = concurrency;
  ret->wall_s = wall_s;
  if (n == 0)
    return;
  qsort (lat_ms, n, sizeof *lat_ms, wr_bench_cmp_double);
  double sum = 0;
  for (size_t i = 0; i < n; i++)
    sum += lat_ms[i];
  ret->mean_ms = sum / (double)n;
  ret->min_ms = lat_ms[0];
  ret->max_ms = lat_ms[n - 1];
  ret->p50_ms = percentile (lat_ms, n, 50);
  ret->p90_ms = percentile (lat_ms, n, 90);
  ret->p99_ms = percentile (lat_ms, n, 99);
  ret->rate_per_s = wall_s > 0 ? (double)n / wall_s : 0;
}

static double
round3 (double v)
{
  return round (v * 1000.0) / 1000.0;
}

int
wr_bench_cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

json_t *
wr_bench_range_json (double *v, size_t n, double *ret_median)
{
  if (n > 0)
    qsort (v, n, sizeof *v, wr_bench_cmp_double);
  double med = n ? (v[(n - 1) / 2] + v[n / 2]) / 2 : 0;
  if (ret_median)
    *ret_median = med;
  if (n == 0)
    return json_null ();
  return json_pack ("{s:f, s:f, s:f}", "median", round (med * 1000) / 1000, "min",
                    round (v[0] * 1000) / 1000, "max", round (v[n - 1] * 1000) / 1000);
}

json_t *
wr_bench_stats_json (const wr_bench_stats_t *s)
{
  return json_pack ("{s:I, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "count",
                    (json_int_t)s->count, "concurrency", (int)s->concurrency, "rate_per_s",
                    round3 (s->rate_per_s), "p50_ms", round3 (s->p50_ms), "p90_ms",
                    round3 (s->p90_ms), "p99_ms", round3 (s->p99_ms), "mean_ms",
                    round3 (s->mean_ms), "min_ms", round3 (s->min_ms), "max_ms", round3 (s->max_ms),
                    "wall_s", round3 (s->wall_s));
}

json_t *
wr_bench_steps_json (const wr_bench_sample_t *s)
{
  if (s->n_steps == 0)
    return NULL;
  json_t *o = json_object ();
  for (size_t i = 0; i < s->n_steps && o; i++)
    json_object_set_new (o, s->step_name[i], json_real (round (s->step_mean_ms[i] * 1e4) / 1e4));
  return o;
}

/* ---- rootfs ---------------------------------------------------------- */

/* A dynamically linked busybox would not run inside a rootfs without libc. */
static int
elf_is_static (int fd)
{
  Elf64_Ehdr eh;
  if (pread (fd, &eh, sizeof eh, 0) != (ssize_t)sizeof eh)
    return 0;
  if (memcmp (eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64
      || eh.e_phentsize != sizeof (Elf64_Phdr) || eh.e_phnum > 256)
    return 0;
  for (unsigned i = 0; i < eh.e_phnum; i++)
    {
      Elf64_Phdr ph;
      if (pread (fd, &ph, sizeof ph, (off_t)(eh.e_phoff + i * sizeof ph)) != (ssize_t)sizeof ph)
        return 0;
      if (ph.p_type == PT_INTERP)
        return 0;
    }
  return 1;
}

int
wr_bench_rootfs_check (const char *dir, wr_err_t *err)
{
  if (dir[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "rootfs %s: must be an absolute path", dir);
  /* The path goes into overlay's comma/colon separated option string. */
  if (strpbrk (dir, ",:\\\n") != NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "rootfs %s: ',', ':' and '\\' are not allowed",
                     dir);
  _cleanup_close_ int dfd = open (dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    return wr_sys_error (err, "open rootfs %s", dir);
  struct stat st;
  if (fstatat (dfd, "bin/true", &st, 0) < 0 || !S_ISREG (st.st_mode))
    return wr_error (err, errno ? errno : ENOENT, WR_E_INVALID, "rootfs %s: no bin/true", dir);
  if (fstatat (dfd, "bin/busybox", &st, 0) < 0 || !S_ISREG (st.st_mode))
    return wr_error (err, errno ? errno : ENOENT, WR_E_INVALID, "rootfs %s: no bin/busybox", dir);
  if (fstatat (dfd, "proc", &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISDIR (st.st_mode))
    return wr_error (err, errno ? errno : ENOENT, WR_E_INVALID, "rootfs %s: no proc/", dir);
  return 0;
}

static int
copy_file_at (int src, int dfd, const char *name, mode_t mode, wr_err_t *err)
{
  struct stat st;
  if (fstat (src, &st) < 0)
    return wr_sys_error (err, "fstat busybox");
  char tmp[64];
  snprintf (tmp, sizeof tmp, ".%s.tmp%d", name, (int)getpid ());
  _cleanup_close_ int out = openat (dfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (out < 0)
    return wr_sys_error (err, "create %s", tmp);
  off_t off = 0;
  while (off < st.st_size)
    {
      ssize_t k = sendfile (out, src, &off, (size_t)(st.st_size - off));
      if (k < 0 && errno == EINTR)
        continue;
      if (k <= 0)
        {
          int e = k < 0 ? errno : EIO;
          unlinkat (dfd, tmp, 0);
          return wr_error (err, e, WR_E_INTERNAL, "copy busybox");
        }
    }
  if (fchmod (out, mode) < 0 || renameat (dfd, tmp, dfd, name) < 0)
    {
      int e = errno;
      unlinkat (dfd, tmp, 0);
      return wr_error (err, e, WR_E_INTERNAL, "install bin/%s", name);
    }
  return 0;
}

int
wr_bench_rootfs_prepare (const char *dir, wr_err_t *err)
{
  if (dir[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "rootfs %s: must be an absolute path", dir);
  if (wr_mkdir_p (dir, 0755) < 0)
    return wr_sys_error (err, "mkdir %s", dir);
  _cleanup_close_ int dfd = open (dir, O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    return wr_sys_error (err, "open %s", dir);
  static const char *const dirs[] = { "bin", "proc", "dev", "sys", "tmp", "etc", "root" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (dirs); i++)
    if (mkdirat (dfd, dirs[i], 0755) < 0 && errno != EEXIST)
      return wr_sys_error (err, "mkdir %s/%s", dir, dirs[i]);
  _cleanup_close_ int bin = openat (dfd, "bin", O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (bin < 0)
    return wr_sys_error (err, "open %s/bin", dir);

  struct stat st;
  if (fstatat (bin, "busybox", &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG (st.st_mode))
    {
      static const char *const candidates[]
          = { "/bin/busybox", "/usr/bin/busybox", "/usr/lib/busybox/busybox" };
      _cleanup_close_ int src = -1;
      for (size_t i = 0; i < WR_ARRAY_SIZE (candidates) && src < 0; i++)
        {
          src = open (candidates[i], O_RDONLY | O_CLOEXEC);
          if (src >= 0 && !elf_is_static (src))
            {
              close (src);
              src = -1;
            }
        }
      if (src < 0)
        return wr_error (err, ENOENT, WR_E_UNSUPPORTED,
                         "no static busybox on the host (install busybox-static)");
      if (copy_file_at (src, bin, "busybox", 0755, err) < 0)
        return -EIO;
    }
  /* Relative links so they resolve inside the rootfs and on the host alike. */
  static const char *const applets[] = { "true", "sh" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (applets); i++)
    if (symlinkat ("busybox", bin, applets[i]) < 0 && errno != EEXIST)
      return wr_sys_error (err, "symlink bin/%s", applets[i]);
  return wr_bench_rootfs_check (dir, err);
}

/* ---- bare container floor --------------------------------------------- */

/* Step timestamps: clone returns in the child, then one per setup step. */
static const char *const floor_step_names[] = {
  "clone", "make_private", "mount_tmpfs", "mkdir_upper_work_merged", "mount_overlay",
  "chdir", "mount_proc",   "pivot_root",  "umount_old_root",
};
#define FLOOR_TS (WR_ARRAY_SIZE (floor_step_names))

struct floor_child
{
  const char *scratch, *upper, *work, *merged, *ovl_opts;
  char *const *argv;
  /* CLONE_VM only: wr_now_ns() (vDSO, no syscall) after each step. */
  uint64_t ts[FLOOR_TS];
  /* Written by the child (shared memory with CLONE_VM) when a step fails. */
  const char *volatile failed_step;
  volatile int failed_errno;
};

/* With CLONE_VM|CLONE_VFORK (as posix_spawn does) this runs on its own stack
 * in the parent's address space, so nothing is copied or COW-faulted: only
 * raw syscall wrappers, no allocation. */
/* In a cloned child: run one setup step, or record which one failed (and
 * errno) in the caller's struct `a` and exit. */
#define STEP(name, call)                                                                           \
  do                                                                                               \
    {                                                                                              \
      if ((call) < 0)                                                                              \
        {                                                                                          \
          a->failed_errno = errno;                                                                 \
          a->failed_step = (name);                                                                 \
          _exit (127);                                                                             \
        }                                                                                          \
    }                                                                                              \
  while (0)

static int
floor_child_fn (void *p)
{
  struct floor_child *a = p;
  size_t k = 0;
  a->ts[k++] = wr_now_ns ();
#define MARK() (a->ts[k++] = wr_now_ns ())
  STEP ("make / private", mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
  MARK ();
  STEP ("mount tmpfs", mount ("tmpfs", a->scratch, "tmpfs", 0, "mode=0700"));
  MARK ();
  STEP ("mkdir upper", mkdir (a->upper, 0755));
  STEP ("mkdir work", mkdir (a->work, 0755));
  STEP ("mkdir merged", mkdir (a->merged, 0755));
  MARK ();
  STEP ("mount overlay", mount ("overlay", a->merged, "overlay", 0, a->ovl_opts));
  MARK ();
  STEP ("chdir merged", chdir (a->merged));
  MARK ();
  STEP ("mount proc", mount ("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  MARK ();
  STEP ("pivot_root", syscall (SYS_pivot_root, ".", "."));
  MARK ();
  STEP ("umount old root", umount2 (".", MNT_DETACH));
  MARK ();
  STEP ("execve /bin/true", execve ("/bin/true", a->argv, environ));
#undef MARK
  return 127;
}

static int
floor_container (const char *rootfs, const char *scratch, int share_vm, wr_bench_sample_t *s,
                 wr_err_t *err)
{
  if (wr_bench_rootfs_check (rootfs, err) < 0)
    return -EINVAL;
  if (scratch[0] != '/' || strpbrk (scratch, ",:\\\n") != NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "scratch %s: bad path", scratch);

  _cleanup_free_ char *upper = NULL, *work = NULL, *merged = NULL, *opts = NULL;
  if (asprintf (&upper, "%s/u", scratch) < 0 || asprintf (&work, "%s/w", scratch) < 0
      || asprintf (&merged, "%s/m", scratch) < 0
      || asprintf (&opts, "lowerdir=%s,upperdir=%s/u,workdir=%s/w", rootfs, scratch, scratch) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "asprintf");

  const size_t stack_size = 64 * 1024;
  void *stack = mmap (NULL, stack_size, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED)
    return wr_sys_error (err, "mmap child stack");

  char *argv[] = { (char *)"true", NULL };
  struct floor_child a = {
    .scratch = scratch,
    .upper = upper,
    .work = work,
    .merged = merged,
    .ovl_opts = opts,
    .argv = argv,
  };
  int flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | SIGCHLD;
  if (share_vm)
    flags |= CLONE_VM | CLONE_VFORK;
  /* Without CLONE_VM a failed step is only visible as exit status 127. */
  int r = 0;
  uint64_t start = 0;
  double step_sum_ns[FLOOR_TS + 1] = { 0 };
  s->note = share_vm ? NULL : "fork-style clone without CLONE_VM";
  s->n_steps = 0;
  for (size_t i = 0; i < s->n + WR_BENCH_WARMUP; i++)
    {
      if (i == WR_BENCH_WARMUP)
        start = wr_now_ns ();
      a.failed_step = NULL;
      uint64_t t0 = wr_now_ns ();
      pid_t pid = clone (floor_child_fn, (char *)stack + stack_size, flags, &a);
      if (pid < 0)
        {
          r = wr_sys_error (err, "clone (pid, mount, uts, ipc namespaces)");
          break;
        }
      int status;
      while (waitpid (pid, &status, 0) < 0)
        if (errno != EINTR)
          {
            r = wr_sys_error (err, "waitpid");
            goto out;
          }
      uint64_t t1 = wr_now_ns ();
      if (a.failed_step)
        {
          r = wr_error (err, a.failed_errno, WR_E_INTERNAL, "bare container: %s", a.failed_step);
          break;
        }
      if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
        {
          r = wr_error (err, 0, WR_E_INTERNAL,
                        "bare container: /bin/true exited with status 0x%x (a setup step failed)",
                        status);
          break;
        }
      if (i >= WR_BENCH_WARMUP)
        {
          s->lat_ms[i - WR_BENCH_WARMUP] = (double)(t1 - t0) / 1e6;
          uint64_t prev = t0;
          for (size_t k = 0; k < FLOOR_TS; k++)
            {
              step_sum_ns[k] += (double)(a.ts[k] - prev);
              prev = a.ts[k];
            }
          step_sum_ns[FLOOR_TS] += (double)(t1 - prev);
        }
    }
  s->wall_s = (double)(wr_now_ns () - start) / 1e9;
  if (r == 0 && share_vm && s->n > 0)
    {
      static_assert (FLOOR_TS + 1 <= WR_BENCH_MAX_STEPS, "too many steps");
      for (size_t k = 0; k <= FLOOR_TS; k++)
        {
          s->step_name[k] = k < FLOOR_TS ? floor_step_names[k] : "execve_true_exit_wait";
          s->step_mean_ms[k] = step_sum_ns[k] / (double)s->n / 1e6;
        }
      s->n_steps = FLOOR_TS + 1;
    }
out:
  munmap (stack, stack_size);
  return r;
}

int
wr_bench_floor_container (const char *rootfs, const char *scratch, wr_bench_sample_t *s,
                          wr_err_t *err)
{
  return floor_container (rootfs, scratch, 1, s, err);
}

int
wr_bench_floor_container_fork (const char *rootfs, const char *scratch, wr_bench_sample_t *s,
                               wr_err_t *err)
{
  return floor_container (rootfs, scratch, 0, s, err);
}

/* ---- host posix_spawn -------------------------------------------------- */

int
wr_bench_floor_spawn (const char *rootfs, wr_bench_sample_t *s, wr_err_t *err)
{
  _cleanup_free_ char *path = NULL;
  if (asprintf (&path, "%s/bin/busybox", rootfs) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "asprintf");
  char *argv[] = { (char *)"true", NULL };
  uint64_t start = 0;
  s->note = NULL;
  for (size_t i = 0; i < s->n + WR_BENCH_WARMUP; i++)
    {
      if (i == WR_BENCH_WARMUP)
        start = wr_now_ns ();
      pid_t pid;
      uint64_t t0 = wr_now_ns ();
      int e = posix_spawn (&pid, path, NULL, NULL, argv, environ);
      if (e != 0)
        return wr_error (err, e, WR_E_INTERNAL, "posix_spawn %s", path);
      int status;
      while (waitpid (pid, &status, 0) < 0)
        if (errno != EINTR)
          return wr_sys_error (err, "waitpid");
      uint64_t t1 = wr_now_ns ();
      if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
        return wr_error (err, 0, WR_E_INTERNAL, "%s true: status 0x%x", path, status);
      if (i >= WR_BENCH_WARMUP)
        s->lat_ms[i - WR_BENCH_WARMUP] = (double)(t1 - t0) / 1e6;
    }
  s->wall_s = (double)(wr_now_ns () - start) / 1e9;
  return 0;
}

/* ---- external commands ------------------------------------------------- */

char *
wr_bench_which (const char *name)
{
  const char *path = getenv ("PATH");
  if (!path || !*path)
    path = WR_DEFAULT_PATH;
  _cleanup_free_ char *copy = strdup (path);
  if (!copy)
    return NULL;
  char *save = NULL;
  for (char *d = strtok_r (copy, ":", &save); d; d = strtok_r (NULL, ":", &save))
    {
      char *full = NULL;
      if (d[0] != '/' || asprintf (&full, "%s/%s", d, name) < 0)
        continue;
      struct stat st;
      if (stat (full, &st) == 0 && S_ISREG (st.st_mode) && access (full, X_OK) == 0)
        return full;
      free (full);
    }
  return NULL;
}

/* Last bytes of whatever the command wrote to stderr, on one line. */
static void
stderr_tail (int memfd, char *buf, size_t size)
{
  buf[0] = '\0';
  off_t end = lseek (memfd, 0, SEEK_END);
  if (end <= 0)
    return;
  off_t start = end > (off_t)size - 1 ? end - (off_t)size + 1 : 0;
  ssize_t k = pread (memfd, buf, size - 1, start);
  if (k <= 0)
    return;
  buf[k] = '\0';
  while (k > 0 && (buf[k - 1] == '\n' || buf[k - 1] == ' '))
    buf[--k] = '\0';
  for (ssize_t i = 0; i < k; i++)
    if ((unsigned char)buf[i] < 0x20)
      buf[i] = ' ';
}

struct run_child
{
  char *const *argv;
  int devnull, errfd, hide_cgroup2;
  const char *volatile failed_step;
  volatile int failed_errno;
};

/* posix_spawn with an optional mount namespace prelude; same constraints as
 * floor_child_fn (shared address space). */
static int
run_child_fn (void *p)
{
  struct run_child *a = p;
  STEP ("dup2 stdin", dup2 (a->devnull, 0));
  STEP ("dup2 stdout", dup2 (a->devnull, 1));
  STEP ("dup2 stderr", dup2 (a->errfd, 2));
  if (a->hide_cgroup2)
    {
      STEP ("unshare mount namespace", unshare (CLONE_NEWNS));
      STEP ("make / private", mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
      if (umount2 ("/sys/fs/cgroup/unified", MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
        STEP ("umount /sys/fs/cgroup/unified", -1);
    }
  STEP ("execve", execve (a->argv[0], a->argv, environ));
  return 127;
}

int
wr_bench_run_ex (char *const argv[], int timeout_ms, int hide_cgroup2, wr_err_t *err)
{
  _cleanup_close_ int memfd = memfd_create ("wr-bench-stderr", MFD_CLOEXEC);
  if (memfd < 0)
    return wr_sys_error (err, "memfd_create");
  _cleanup_close_ int devnull = open ("/dev/null", O_RDWR | O_CLOEXEC);
  if (devnull < 0)
    return wr_sys_error (err, "open /dev/null");
  const size_t stack_size = 64 * 1024;
  void *stack = mmap (NULL, stack_size, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED)
    return wr_sys_error (err, "mmap child stack");
  struct run_child a = {
    .argv = argv,
    .devnull = devnull,
    .errfd = memfd,
    .hide_cgroup2 = hide_cgroup2,
  };
  pid_t pid
      = clone (run_child_fn, (char *)stack + stack_size, CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
  int clone_errno = errno;
  munmap (stack, stack_size); /* the child has exec'd or exited (CLONE_VFORK) */
  if (pid < 0)
    return wr_error (err, clone_errno, WR_E_INTERNAL, "clone for %s", argv[0]);

  int status = 0;
  _cleanup_close_ int pidfd = (int)syscall (SYS_pidfd_open, pid, 0);
  if (pidfd >= 0)
    {
      struct pollfd pfd = { .fd = pidfd, .events = POLLIN };
      int pr;
      do
        pr = poll (&pfd, 1, timeout_ms);
      while (pr < 0 && errno == EINTR);
      if (pr == 0)
        {
          kill (pid, SIGKILL);
          waitpid (pid, &status, 0);
          return wr_error (err, ETIMEDOUT, WR_E_TIMEOUT, "%s: no exit after %d ms", argv[0],
                           timeout_ms);
        }
    }
  /* Without pidfds the wait is unbounded: these commands are short. */
  while (waitpid (pid, &status, 0) < 0)
    if (errno != EINTR)
      return wr_sys_error (err, "waitpid %s", argv[0]);
  if (a.failed_step)
    return wr_error (err, a.failed_errno, WR_E_INTERNAL, "spawn %s: %s", argv[0], a.failed_step);
  if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    {
      char tail[300];
      stderr_tail (memfd, tail, sizeof tail);
      return wr_error (err, 0, WR_E_INTERNAL, "%s exited with %s %d%s%s", argv[0],
                       WIFEXITED (status) ? "status" : "signal",
                       WIFEXITED (status) ? WEXITSTATUS (status) : WTERMSIG (status),
                       tail[0] ? ": " : "", tail);
    }
  return status;
}

int
wr_bench_run (char *const argv[], int timeout_ms, wr_err_t *err)
{
  return wr_bench_run_ex (argv, timeout_ms, 0, err);
}

/* ---- crun -------------------------------------------------------------- */

static int
write_crun_config (const char *bundle, const char *rootfs, wr_err_t *err)
{
  /* Same work as the floor: pid/mount/uts/ipc namespaces, /proc, /bin/true;
   * no cgroupsPath or resources. */
  json_t *cfg
      = json_pack ("{s:s, s:{s:b, s:{s:i, s:i}, s:[s], s:[s], s:s, s:b},"
                   " s:{s:s, s:b}, s:s, s:[{s:s, s:s, s:s}],"
                   " s:{s:[{s:s}, {s:s}, {s:s}, {s:s}]}}",
                   "ociVersion", "1.0.2", "process", "terminal", 0, "user", "uid", 0, "gid", 0,
                   "args", "/bin/true", "env", "PATH=/bin", "cwd", "/", "noNewPrivileges", 1,
                   "root", "path", rootfs, "readonly", 1, "hostname", "bench", "mounts",
                   "destination", "/proc", "type", "proc", "source", "proc", "linux", "namespaces",
                   "type", "pid", "type", "mount", "type", "ipc", "type", "uts");
  if (!cfg)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "build config.json");
  _cleanup_free_ char *path = NULL;
  if (asprintf (&path, "%s/config.json", bundle) < 0)
    {
      json_decref (cfg);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "asprintf");
    }
  int r = json_dump_file (cfg, path, JSON_COMPACT);
  json_decref (cfg);
  if (r < 0)
    return wr_error (err, EIO, WR_E_INTERNAL, "write %s", path);
  return 0;
}

int
wr_bench_crun (const char *rootfs, const char *workdir, wr_bench_sample_t *s, wr_err_t *err)
{
  _cleanup_free_ char *crun = wr_bench_which ("crun");
  if (!crun)
    return wr_error (err, ENOENT, WR_E_UNSUPPORTED, "crun not installed");
  if (wr_bench_rootfs_check (rootfs, err) < 0)
    return -EINVAL;
  _cleanup_free_ char *bundle = NULL, *state = NULL, *root_opt = NULL, *bundle_opt = NULL;
  if (asprintf (&bundle, "%s/crun-bundle", workdir) < 0
      || asprintf (&state, "%s/crun-state", workdir) < 0
      || asprintf (&root_opt, "--root=%s", state) < 0
      || asprintf (&bundle_opt, "--bundle=%s", bundle) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "asprintf");
  if ((mkdir (bundle, 0700) < 0 && errno != EEXIST) || (mkdir (state, 0700) < 0 && errno != EEXIST))
    return wr_sys_error (err, "mkdir %s", bundle);
  if (write_crun_config (bundle, rootfs, err) < 0)
    return -EIO;

  char id[64];
  char *argv[] = { crun, root_opt, (char *)"--cgroup-manager=disabled", (char *)"run", bundle_opt,
                   id,   NULL };
  char *del[] = { crun, root_opt, (char *)"delete", (char *)"-f", id, NULL };
  int hide = 0;
  uint64_t start = 0;
  s->note = NULL;
  for (size_t i = 0; i < s->n + WR_BENCH_WARMUP; i++)
    {
      if (i == WR_BENCH_WARMUP)
        start = wr_now_ns ();
      snprintf (id, sizeof id, "wrbench-%d-%zu", (int)getpid (), i);
      uint64_t t0 = wr_now_ns ();
      int r = wr_bench_run_ex (argv, WR_BENCH_CMD_TIMEOUT_MS, hide, err);
      uint64_t t1 = wr_now_ns ();
      if (r < 0)
        {
          /* A killed or failed run may leave its state behind. */
          wr_bench_run_ex (del, WR_BENCH_CMD_TIMEOUT_MS, hide, NULL);
          if (i == 0 && !hide && err && strstr (err->msg, "hybrid"))
            {
              /* Feature detection: retry the first run with cgroup v2 hidden. */
              hide = 1;
              s->note = "crun refuses this hybrid cgroup layout (controllers in cgroup v2): each "
                        "run is spawned in a private mount namespace without "
                        "/sys/fs/cgroup/unified";
              i--;
              continue;
            }
          return r;
        }
      if (i >= WR_BENCH_WARMUP)
        s->lat_ms[i - WR_BENCH_WARMUP] = (double)(t1 - t0) / 1e6;
    }
  s->wall_s = (double)(wr_now_ns () - start) / 1e9;
  return 0;
}

/* ---- bubblewrap ------------------------------------------------------- */

static int
time_command (char *const argv[], wr_bench_sample_t *s, wr_err_t *err)
{
  uint64_t start = 0;
  for (size_t i = 0; i < s->n + WR_BENCH_WARMUP; i++)
    {
      if (i == WR_BENCH_WARMUP)
        start = wr_now_ns ();
      uint64_t t0 = wr_now_ns ();
      if (wr_bench_run (argv, WR_BENCH_CMD_TIMEOUT_MS, err) < 0)
        return -EIO;
      uint64_t t1 = wr_now_ns ();
      if (i >= WR_BENCH_WARMUP)
        s->lat_ms[i - WR_BENCH_WARMUP] = (double)(t1 - t0) / 1e6;
    }
  s->wall_s = (double)(wr_now_ns () - start) / 1e9;
  return 0;
}

int
wr_bench_bwrap (const char *rootfs, wr_bench_sample_t *s, wr_err_t *err)
{
  _cleanup_free_ char *bwrap = wr_bench_which ("bwrap");
  if (!bwrap)
    return wr_error (err, ENOENT, WR_E_UNSUPPORTED, "bwrap not installed");
  if (wr_bench_rootfs_check (rootfs, err) < 0)
    return -EINVAL;
  char *full[] = { bwrap,
                   (char *)"--unshare-all",
                   (char *)"--bind",
                   (char *)rootfs,
                   (char *)"/",
                   (char *)"--proc",
                   (char *)"/proc",
                   (char *)"--dev",
                   (char *)"/dev",
                   (char *)"/bin/true",
                   NULL };
  /* The floor's namespace set, for a bwrap that refuses --unshare-all here. */
  char *narrow[] = { bwrap,
                     (char *)"--unshare-pid",
                     (char *)"--unshare-ipc",
                     (char *)"--unshare-uts",
                     (char *)"--bind",
                     (char *)rootfs,
                     (char *)"/",
                     (char *)"--proc",
                     (char *)"/proc",
                     (char *)"--dev",
                     (char *)"/dev",
                     (char *)"/bin/true",
                     NULL };
  wr_err_t first;
  wr_err_clear (&first);
  s->note = NULL;
  if (wr_bench_run (full, WR_BENCH_CMD_TIMEOUT_MS, &first) >= 0)
    return time_command (full, s, err);
  if (wr_bench_run (narrow, WR_BENCH_CMD_TIMEOUT_MS, NULL) >= 0)
    {
      s->note = "bwrap refused --unshare-all here; measured --unshare-pid/ipc/uts";
      return time_command (narrow, s, err);
    }
  if (err)
    *err = first;
  return -EIO;
}

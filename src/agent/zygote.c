/* fncall calls in the agent (zygote.h, docs/fncall.md). The agent is the
 * zygote of command calls: it spawns with clone(CLONE_VM|CLONE_VFORK) like
 * posix_spawn does (no page copying), but the child also drops to the call
 * uid, sets rlimits and loads a per-call seccomp filter before exec. */
#include "agent/zygote.h"
#include "common/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>

static const struct
{
  const char *name;
  int res;
} limit_names[] = {
  { "cpu_s", RLIMIT_CPU },         { "as_bytes", RLIMIT_AS },   { "nproc", RLIMIT_NPROC },
  { "fsize_bytes", RLIMIT_FSIZE }, { "nofile", RLIMIT_NOFILE }, { "core_bytes", RLIMIT_CORE },
};

#define CLEANUP_WAIT_NS (5ull * 1000000000ull)

/* World-writable places a call uid can leave files in besides its scratch. */
static const char *const tmp_dirs[] = { "/tmp", "/var/tmp", "/dev/shm", "/run/lock" };

int
ag_call_parse (json_t *body, struct ag_call *c, wr_err_t *err)
{
  memset (c, 0, sizeof *c);
  json_t *j = json_object_get (body, "call");
  if (j == NULL || json_is_null (j))
    return 0;
  if (!json_is_object (j))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"call\" must be an object");
  json_t *uid = json_object_get (j, "uid"), *gid = json_object_get (j, "gid");
  /* Never root or the overflow ids: the call uid must own nothing else. */
  if (!json_is_integer (uid) || json_integer_value (uid) < 1000 || json_integer_value (uid) > 65000
      || !json_is_integer (gid) || json_integer_value (gid) < 1000
      || json_integer_value (gid) > 65000)
    return wr_error (err, EINVAL, WR_E_INVALID, "\"call\": uid and gid must be in [1000, 65000]");
  c->uid = (uid_t)json_integer_value (uid);
  c->gid = (gid_t)json_integer_value (gid);
  const char *s = json_string_value (json_object_get (j, "scratch"));
  if (s == NULL || strncmp (s, "/tmp/", 5) != 0 || strlen (s) >= sizeof c->scratch
      || strchr (s + 5, '/') || strcmp (s + 5, ".") == 0 || strcmp (s + 5, "..") == 0
      || s[5] == '\0')
    return wr_error (err, EINVAL, WR_E_INVALID, "\"call\": scratch must be /tmp/NAME");
  snprintf (c->scratch, sizeof c->scratch, "%s", s);
  c->seccomp = json_is_true (json_object_get (j, "seccomp"));
  json_t *lims = json_object_get (j, "rlimits");
  if (lims && !json_is_object (lims))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"call\": rlimits must be an object");
  for (size_t i = 0; i < WR_ARRAY_SIZE (limit_names); i++)
    {
      json_t *v = json_object_get (lims, limit_names[i].name);
      if (v == NULL || json_is_null (v))
        continue;
      if (!json_is_integer (v) || json_integer_value (v) < 0)
        return wr_error (err, EINVAL, WR_E_INVALID, "\"call\": rlimit %s must be >= 0",
                         limit_names[i].name);
      c->lim[c->n_lim].res = limit_names[i].res;
      c->lim[c->n_lim].v = (rlim_t)json_integer_value (v);
      c->n_lim++;
    }
  c->on = true;
  return 0;
}

int
ag_call_prepare (const struct ag_call *c, wr_err_t *err)
{
  if (mkdir ("/tmp", 01777) == 0)
    chmod ("/tmp", 01777);
  if (mkdir (c->scratch, 0700) < 0)
    {
      if (errno != EEXIST)
        return wr_error (err, errno, WR_E_INTERNAL, "mkdir %s", c->scratch);
      wr_rm_rf_at (AT_FDCWD, c->scratch);
      if (mkdir (c->scratch, 0700) < 0)
        return wr_error (err, errno, WR_E_INTERNAL, "mkdir %s", c->scratch);
    }
  if (lchown (c->scratch, c->uid, c->gid) < 0)
    return wr_error (err, errno, WR_E_INTERNAL, "chown %s", c->scratch);
  return 0;
}

/* ---- the per-call seccomp filter ---- */

/* On top of the sandbox-wide filter: no looking into or signalling other
 * processes by handle, no state that outlives the call in the sandbox's IPC
 * namespace, no io_uring (it bypasses this filter). */
static const int call_denied[] = {
  __NR_ptrace,
  __NR_process_vm_readv,
  __NR_process_vm_writev,
  __NR_pidfd_getfd,
  __NR_pidfd_open,
  __NR_io_uring_setup,
  __NR_io_uring_enter,
  __NR_io_uring_register,
  __NR_msgget,
  __NR_semget,
  __NR_shmget,
  __NR_mq_open,
  __NR_personality,
  __NR_chroot,
  __NR_mknodat,
#ifdef __NR_mknod
  __NR_mknod,
#endif
};

#if defined(__x86_64__)
#define CALL_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define CALL_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

#ifdef CALL_AUDIT_ARCH
#define N_DENIED (sizeof call_denied / sizeof call_denied[0])
static struct sock_filter call_filter[5 + 2 * N_DENIED + 1];
static struct sock_fprog call_prog;

static void
build_filter (void)
{
  if (call_prog.len)
    return;
  size_t n = 0;
  struct sock_filter *f = call_filter;
  f[n++] = (struct sock_filter)BPF_STMT (BPF_LD | BPF_W | BPF_ABS,
                                         offsetof (struct seccomp_data, arch));
  f[n++] = (struct sock_filter)BPF_JUMP (BPF_JMP | BPF_JEQ | BPF_K, CALL_AUDIT_ARCH, 1, 0);
  f[n++] = (struct sock_filter)BPF_STMT (BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
  f[n++]
      = (struct sock_filter)BPF_STMT (BPF_LD | BPF_W | BPF_ABS, offsetof (struct seccomp_data, nr));
  for (size_t i = 0; i < N_DENIED; i++)
    {
      f[n++] = (struct sock_filter)BPF_JUMP (BPF_JMP | BPF_JEQ | BPF_K, (unsigned)call_denied[i], 0,
                                             1);
      f[n++] = (struct sock_filter)BPF_STMT (BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    }
  f[n++] = (struct sock_filter)BPF_STMT (BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  call_prog.len = (unsigned short)n;
  call_prog.filter = call_filter;
}
#else
static struct sock_fprog call_prog;
static void
build_filter (void)
{
}
#endif

/* ---- spawn ---- */

struct child_args
{
  const struct ag_call *c;
  const char *file;
  char **argv, **envp;
  const int *fds;
  int err; /* written by the child before _exit: CLONE_VM shares it */
};

static const int reset_signals[] = { SIGHUP,  SIGINT,  SIGQUIT, SIGPIPE, SIGALRM, SIGTERM,
                                     SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU, SIGCHLD };

/* Runs on its own stack in the agent's memory (the agent is suspended until
 * exec or exit): raw system calls only, nothing that allocates or locks. */
static int
child_main (void *arg)
{
  struct child_args *a = arg;
  const struct ag_call *c = a->c;
  for (size_t i = 0; i < WR_ARRAY_SIZE (reset_signals); i++)
    signal (reset_signals[i], SIG_DFL);
  sigset_t none;
  sigemptyset (&none);
  sigprocmask (SIG_SETMASK, &none, NULL);
  if (setsid () < 0)
    goto fail;
  for (int i = 0; i < 3; i++)
    if (a->fds[i] != i && dup2 (a->fds[i], i) < 0)
      goto fail;
    else if (a->fds[i] == i)
      fcntl (i, F_SETFD, 0);
  if (chdir (c->scratch) < 0)
    goto fail;
  /* If the sandbox runs out of memory, the call dies first, not the agent
   * or a zygote. */
  int ofd = open ("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (ofd >= 0)
    {
      if (write (ofd, "1000", 4) < 0)
        {
        }
      close (ofd);
    }
  for (int i = 0; i < c->n_lim; i++)
    {
      struct rlimit rl = { c->lim[i].v, c->lim[i].v };
      /* CPU: the soft limit sends SIGXCPU, the hard one a second later SIGKILL */
      if (c->lim[i].res == RLIMIT_CPU && rl.rlim_max != RLIM_INFINITY)
        rl.rlim_max = rl.rlim_cur + 1;
      if (setrlimit (c->lim[i].res, &rl) < 0)
        goto fail;
    }
  /* raw calls: glibc's wrappers would try to sync threads we do not own */
  if (syscall (__NR_setgroups, 0, NULL) < 0 || syscall (__NR_setresgid, c->gid, c->gid, c->gid) < 0
      || syscall (__NR_setresuid, c->uid, c->uid, c->uid) < 0)
    goto fail;
  if (prctl (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
    goto fail;
  if (c->seccomp && call_prog.len
      && syscall (__NR_seccomp, SECCOMP_SET_MODE_FILTER, 0, &call_prog) < 0)
    goto fail;
  execve (a->file, a->argv, a->envp);
fail:
  a->err = errno ? errno : EIO;
  _exit (127);
}

pid_t
ag_call_spawn (const struct ag_call *c, const char *file, char **argv, char **envp,
               const int fds[3])
{
  static char stack[64 << 10] __attribute__ ((aligned (16)));
  if (c->seccomp)
    build_filter ();
  struct child_args a = { .c = c, .file = file, .argv = argv, .envp = envp, .fds = fds, .err = 0 };
  /* Block signals so no agent handler runs on the child's stack. */
  sigset_t all, old;
  sigfillset (&all);
  sigprocmask (SIG_SETMASK, &all, &old);
  pid_t pid = clone (child_main, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
  int e = errno;
  sigprocmask (SIG_SETMASK, &old, NULL);
  if (pid < 0)
    return -e;
  if (a.err)
    {
      /* exec failed: reap it here so the agent never reports it twice */
      while (waitpid (pid, NULL, 0) < 0 && errno == EINTR)
        ;
      return -a.err;
    }
  return pid;
}

/* ---- cleanup ---- */

/* Zombies keep their /proc entry until the agent's SIGCHLD loop reaps them;
 * they are dead already. */
static bool
is_zombie (int procfd, const char *pid)
{
  char path[64], buf[512];
  snprintf (path, sizeof path, "%s/stat", pid);
  _cleanup_close_ int fd = openat (procfd, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return true; /* gone */
  ssize_t n = read (fd, buf, sizeof buf - 1);
  if (n <= 0)
    return true;
  buf[n] = '\0';
  char *p = strrchr (buf, ')');
  return p == NULL || p[1] == '\0' || p[2] == 'Z' || p[2] == 'X';
}

static int
kill_uid (uid_t uid)
{
  _cleanup_closedir_ DIR *d = opendir ("/proc");
  if (d == NULL)
    return 0;
  int found = 0;
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      if (de->d_name[0] < '1' || de->d_name[0] > '9')
        continue;
      struct stat st;
      if (fstatat (dirfd (d), de->d_name, &st, 0) < 0 || st.st_uid != uid)
        continue;
      char *end;
      long pid = strtol (de->d_name, &end, 10);
      if (*end != '\0' || is_zombie (dirfd (d), de->d_name))
        continue;
      if (kill ((pid_t)pid, SIGKILL) == 0)
        found++;
    }
  return found;
}

static void
rm_owned (const char *dir, uid_t uid)
{
  _cleanup_closedir_ DIR *d = opendir (dir);
  if (d == NULL)
    return;
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
        continue;
      struct stat st;
      if (fstatat (dirfd (d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_uid == uid)
        wr_rm_rf_at (dirfd (d), de->d_name);
    }
}

void
ag_call_cleanup (const struct ag_call *c)
{
  /* Repeat until a pass finds no living process: catches forks that raced
   * the previous pass (a killed process cannot fork again), and waits for
   * the killed ones to die: a process SIGKILLed but not yet scheduled is
   * still running, and the next call on this sandbox would see it. Bounded,
   * so that a process stuck in the kernel cannot hold the agent forever. */
  uint64_t deadline = wr_now_ns () + CLEANUP_WAIT_NS;
  long wait_ns = 20000;
  while (kill_uid (c->uid) > 0 && wr_now_ns () < deadline)
    {
      struct timespec ts = { 0, wait_ns };
      nanosleep (&ts, NULL);
      if (wait_ns < 5000000)
        wait_ns *= 2;
    }
  wr_rm_rf_at (AT_FDCWD, c->scratch);
  for (size_t i = 0; i < WR_ARRAY_SIZE (tmp_dirs); i++)
    rm_owned (tmp_dirs[i], c->uid);
}

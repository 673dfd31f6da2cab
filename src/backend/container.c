/* Sandbox lifecycle: one clone3 with every namespace, an overlay root on a
 * size-capped tmpfs upper, pivot_root, dropped capabilities, seccomp, then
 * execveat of the agent (docs/containers.md).
 *
 * The child is created with CLONE_VM on a stack owned by the runtime: no
 * page tables are copied and nothing is COW-faulted, which is where a plain
 * fork of the daemon spends its time. The price is discipline: the child
 * shares the daemon's memory while the daemon keeps running, so it only
 * reads the prepared child_ctx and uses raw syscalls (wr_raw*, no errno, no
 * libc state) until execveat replaces its address space. */
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "../common/limits.h" /* WR_MAX_LAYERS: one limit, store to backends */
#include "../common/util.h"
#include "backend.h"
#include "child.h"
#include "pool.h"
#include "syscalls.h"

#define DEFAULT_DISK_MB 1024
#define AGENT_SOCK "agent.sock"

/* Docker's default capability set. */
static const int keep_caps[] = {
  CAP_CHOWN,   CAP_DAC_OVERRIDE, CAP_FSETID,           CAP_FOWNER,
  CAP_MKNOD,   CAP_NET_RAW,      CAP_SETGID,           CAP_SETUID,
  CAP_SETFCAP, CAP_SETPCAP,      CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT,
  CAP_KILL,    CAP_AUDIT_WRITE,
};

static pthread_once_t dev_template_once = PTHREAD_ONCE_INIT;

/* ---------------------------------------------------------------- parent */

bool
wr_valid_id (const char *id)
{
  return id && wr_id_valid (id, strlen (id)); /* the one rule (common/util.c) */
}

static bool
valid_hostname (const char *h)
{
  size_t n = strlen (h);
  if (n == 0 || n > 64)
    return false;
  for (size_t i = 0; i < n; i++)
    if (!((h[i] >= 'a' && h[i] <= 'z') || (h[i] >= 'A' && h[i] <= 'Z')
          || (h[i] >= '0' && h[i] <= '9') || h[i] == '-' || h[i] == '.'))
      return false;
  return true;
}

/* sockaddr for state_dir/agent.sock; via /proc/self/fd when the path is too long */
static int
agent_addr (const char *state_dir, int dirfd, struct sockaddr_un *sa, socklen_t *len)
{
  memset (sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int n = snprintf (sa->sun_path, sizeof sa->sun_path, "%s/" AGENT_SOCK, state_dir);
  if (n < 0 || (size_t)n >= sizeof sa->sun_path)
    {
      if (dirfd < 0)
        return -ENAMETOOLONG;
      n = snprintf (sa->sun_path, sizeof sa->sun_path, "/proc/self/fd/%d/" AGENT_SOCK, dirfd);
    }
  *len = (socklen_t)(offsetof (struct sockaddr_un, sun_path) + (size_t)n + 1);
  return 0;
}

/* Where a sandbox's agent socket lives: <rt->sock_dir>/<id> on the
 * runtime's tmpfs dir when it has one (runtime.c: binding a socket on this
 * host's journal-less ext4 allocated an inode, ~3% of create+destroy), else
 * <state_dir>/agent.sock. */
struct sock_loc
{
  int dfd;
  char name[80];
};

static void
sock_loc (struct wr_runtime *rt, const char *id, int state_dirfd, struct sock_loc *l)
{
  l->dfd = rt->sock_dir_fd >= 0 ? rt->sock_dir_fd : state_dirfd;
  snprintf (l->name, sizeof l->name, "%s", rt->sock_dir_fd >= 0 ? id : AGENT_SOCK);
}

static int
sock_addr (struct wr_runtime *rt, const char *id, const char *state_dir, int dirfd,
           struct sockaddr_un *sa, socklen_t *len)
{
  if (rt->sock_dir_fd < 0)
    return agent_addr (state_dir, dirfd, sa, len);
  memset (sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int n = snprintf (sa->sun_path, sizeof sa->sun_path, "%s/%s", rt->sock_dir, id);
  if (n < 0 || (size_t)n >= sizeof sa->sun_path)
    return -ENAMETOOLONG;
  *len = (socklen_t)(offsetof (struct sockaddr_un, sun_path) + (size_t)n + 1);
  return 0;
}

int
wr_read_start_time (pid_t pid, uint64_t *ret)
{
  char path[64], buf[1024];
  snprintf (path, sizeof path, "/proc/%d/stat", (int)pid);
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  ssize_t n = read (fd, buf, sizeof buf - 1);
  if (n <= 0)
    return n < 0 ? -errno : -EIO;
  buf[n] = '\0';
  /* comm may contain spaces and parens: fields restart after the last ')' */
  char *p = strrchr (buf, ')');
  if (p == NULL)
    return -EIO;
  p += 2; /* field 3 (state) */
  for (int field = 3; field < 22; field++)
    {
      p = strchr (p, ' ');
      if (p == NULL)
        return -EIO;
      p++;
    }
  *ret = strtoull (p, NULL, 10);
  return 0;
}

int
wr_pidfd_if_ours (pid_t pid, uint64_t start_time)
{
  if (pid <= 0)
    return -1;
  uint64_t st;
  int fd = wr_sys_pidfd_open (pid, 0);
  if (fd >= 0 && start_time && wr_read_start_time (pid, &st) == 0 && st == start_time)
    return fd;
  if (fd >= 0)
    close (fd);
  return -1;
}

int
wr_container_pidfd (struct wr_container *c)
{
  if (c->pidfd < 0)
    c->pidfd = wr_pidfd_if_ours (c->pid, c->start_time);
  return c->pidfd;
}

void
wr_container_drop_pidfd (struct wr_container *c)
{
  /* pid + start time find the very process again (wr_container_pidfd): an
   * idle sandbox costs the daemon one descriptor, its agent socket */
  if (c->pidfd >= 0 && c->pid > 0 && c->start_time)
    {
      close (c->pidfd);
      c->pidfd = -1;
    }
}

int
wr_adopt_open (const char *what, const char *id, pid_t pid, uint64_t start_time,
               const char *state_dir, int *ret_pidfd, int *ret_dirfd, wr_err_t *err)
{
  if (!wr_valid_id (id) || pid <= 0 || state_dir == NULL || state_dir[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid adopt request");
  _cleanup_close_ int pidfd = wr_sys_pidfd_open (pid, 0);
  if (pidfd < 0)
    return wr_error (err, errno, WR_E_GONE, "%s %s pid %d", what, id, (int)pid);
  /* checked after pidfd_open: the pidfd now pins this very process */
  uint64_t st = 0;
  if (wr_read_start_time (pid, &st) < 0 || st != start_time)
    return wr_error (err, ESRCH, WR_E_GONE, "%s %s: pid %d is another process", what, id, (int)pid);
  int dirfd = open (state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return wr_sys_error (err, "open %s", state_dir);
  *ret_dirfd = dirfd;
  *ret_pidfd = TAKE_FD (pidfd);
  return 0;
}

void
wr_container_fill (struct wr_container *ret, const char *id, pid_t pid, int pidfd,
                   uint64_t start_time, int agent_fd)
{
  memset (ret, 0, sizeof *ret);
  ret->pid = pid;
  ret->pidfd = pidfd;
  ret->start_time = start_time;
  ret->agent_fd = agent_fd;
  snprintf (ret->id, sizeof ret->id, "%s", id);
}

static void
reap (int pidfd)
{
  siginfo_t si;
  if (waitid ((idtype_t)P_PIDFD, (id_t)pidfd, &si, WEXITED | __WALL) < 0 && errno == ECHILD)
    {
      /* not our child (adopted after a restart): wait for the exit itself */
      struct pollfd p = { .fd = pidfd, .events = POLLIN };
      while (poll (&p, 1, 5000) < 0 && errno == EINTR)
        ;
    }
}

void
wr_kill_reap (int pidfd)
{
  if (pidfd < 0)
    return;
  wr_sys_pidfd_send_signal (pidfd, SIGKILL);
  reap (pidfd);
}

int
wr_sandbox_kill (struct wr_runtime *rt, struct wr_container *c, wr_err_t *err)
{
  int pidfd = c->pidfd;
  if (pidfd < 0) /* only trust a bare pid when its start time proves it is ours */
    pidfd = wr_pidfd_if_ours (c->pid, c->start_time);
  struct wr_cg_sandbox cgs;
  wr_cg_open (&rt->cg, c->id, &cgs);
  int r = wr_cg_kill (&rt->cg, &cgs, err);
  wr_cg_sandbox_close (&cgs);
  /* the agent outside its cgroup (failed attach) still dies */
  wr_kill_reap (pidfd);
  if (pidfd >= 0)
    close (pidfd);
  c->pidfd = -1;
  c->pid = 0;
  if (c->agent_fd >= 0)
    close (c->agent_fd);
  c->agent_fd = -1;
  return r;
}

int
wr_stack_acquire (struct wr_runtime *rt)
{
  pthread_mutex_lock (&rt->lock);
  for (;;)
    {
      for (int i = 0; i < WR_CHILD_STACKS; i++)
        if (!rt->stack_busy[i])
          {
            rt->stack_busy[i] = true;
            pthread_mutex_unlock (&rt->lock);
            return i;
          }
      pthread_cond_wait (&rt->stack_free, &rt->lock);
    }
}

void
wr_stack_release (struct wr_runtime *rt, int slot)
{
  pthread_mutex_lock (&rt->lock);
  rt->stack_busy[slot] = false;
  pthread_cond_signal (&rt->stack_free);
  pthread_mutex_unlock (&rt->lock);
}

/* The sandbox's layers: an idmapped clone of every (plain) layer mount,
 * mapped through the sandbox's own user namespace, attached at
 * ROOT/run/l/<slot>/<i> in the daemon's mount namespace only until the child
 * has copied them into its own. They share the layer's superblock, so the
 * page cache stays shared between sandboxes. The mount points belong to the
 * child stack slot (one create at a time uses it) and stay for the next
 * create: a mkdir and rmdir per layer and sandbox cost an inode allocation
 * each, which on a journal-less ext4 scans for recently deleted inodes
 * (~10% of the daemon's create+destroy time, perf). */
struct layer_mounts
{
  char *buf;                      /* the paths, one allocation */
  const char *dir[WR_MAX_LAYERS]; /* top-most first, as overlayfs wants them */
  size_t n, mounted;
};

static int
layer_mounts_prepare (struct wr_runtime *rt, const struct wr_container_spec *spec, int slot,
                      struct layer_mounts *lm, wr_err_t *err)
{
  size_t each = strlen (rt->root) + 32;
  lm->buf = malloc (each * spec->n_lowerdirs);
  if (lm->buf == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "layer mounts");
  for (size_t i = 0; i < spec->n_lowerdirs; i++)
    {
      char *d = lm->buf + i * each;
      snprintf (d, each, "%s/run/l/%d/%zu", rt->root, slot, i);
      if (mkdir (d, 0700) < 0 && errno != EEXIST)
        {
          int r = wr_mkdir_p (d, 0700);
          if (r < 0)
            return wr_error (err, -r, WR_E_INTERNAL, "mkdir %s", d);
        }
      lm->dir[i] = d;
      lm->n = i + 1;
    }
  return 0;
}

static int
layer_mounts_make (const struct wr_container_spec *spec, pid_t pid, struct layer_mounts *lm,
                   wr_err_t *err)
{
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/ns/user", (int)pid);
  _cleanup_close_ int userns = open (path, O_RDONLY | O_CLOEXEC);
  if (userns < 0)
    return wr_sys_error (err, "open %s", path);
  for (size_t i = 0; i < lm->n; i++)
    {
      int r = wr_idmap_mount (userns, spec->lowerdirs[i], lm->dir[i], err);
      if (r < 0)
        return r;
      lm->mounted = i + 1;
    }
  return 0;
}

/* Detach them again: the sandbox holds its own copies. The mount points
 * stay for the slot's next create (wr_runtime_free removes them). */
static void
layer_mounts_clear (struct layer_mounts *lm)
{
  for (size_t i = 0; i < lm->mounted; i++)
    umount2 (lm->dir[i], MNT_DETACH);
  free (lm->buf);
  memset (lm, 0, sizeof *lm);
}

/* clone3 with our euid set to the block's root: the kernel makes the
 * creator's euid the owner of a new user namespace, and charges every
 * per-user count of the processes inside (inotify instances, user
 * namespaces, RLIMIT_NPROC, ...) to the owner at each level above. Created
 * by the daemon's root, they were all charged to host uid 0. Only this
 * thread's credentials change (raw syscalls, not libc's all-threads
 * setresuid); NO_SETUID_FIXUP keeps our capabilities (CLONE_INTO_CGROUP
 * needs them) and fsuid stays 0. */
static long
clone_as (uid_t owner, int securebits, struct wr_clone_args *ca, struct wr_runtime *rt, int slot,
          struct wr_child_ctx *ctx)
{
  /* an euid change also makes the whole process non-dumpable (core dumps,
   * ptrace, /proc ownership): put that back afterwards */
  int dumpable = prctl (PR_GET_DUMPABLE, 0, 0, 0, 0);
  if (prctl (PR_SET_SECUREBITS, securebits | SECBIT_NO_SETUID_FIXUP, 0, 0, 0) < 0)
    return -errno;
  if (syscall (SYS_setresuid, -1, owner, -1) < 0)
    {
      long e = -errno;
      prctl (PR_SET_SECUREBITS, securebits, 0, 0, 0);
      return e;
    }
  syscall (SYS_setfsuid, 0);
  long pid;
#if WR_HAVE_CLONE3_RUN
  ca->flags |= CLONE_VM;
  ca->stack = (uint64_t)(uintptr_t)rt->stack[slot];
  ca->stack_size = rt->stack_size;
  pid = wr_clone3_run (ca, wr_child_main, ctx);
#else
  (void)rt;
  (void)slot;
  /* no trampoline for this architecture: a COW child (slower, same code) */
  pid = syscall (__NR_clone3, ca, sizeof *ca);
  if (pid == 0)
    _exit (wr_child_main (ctx));
  if (pid < 0)
    pid = -errno;
#endif
  /* a daemon thread left with another euid would be far worse than a crash */
  if (syscall (SYS_setresuid, -1, 0, -1) < 0 || prctl (PR_SET_SECUREBITS, securebits, 0, 0, 0) < 0)
    abort ();
  if (dumpable > 0)
    prctl (PR_SET_DUMPABLE, dumpable, 0, 0, 0);
  return pid;
}

/* The zygote's way to the same child (child.h): the request carries what
 * ctx says, as strings and fds; the zygote clones with ca's namespaces, as
 * owner, and its child runs wr_child_setup and becomes the agent. -ENOSYS:
 * no zygote (use clone_as). */
static long
zygote_clone (struct wr_runtime *rt, const struct wr_clone_args *ca, const struct wr_child_ctx *ctx,
              uid_t owner, const char *timens, int cgroup_fd, int netns_fd, int slot,
              int *ret_pidfd)
{
  if (rt->zygote == NULL)
    return -ENOSYS;
  _cleanup_free_ char *msg = malloc (WR_ZYGOTE_MAX_MSG);
  if (msg == NULL)
    return -ENOSYS;
  struct wr_zygote_req req = {
    .magic = WR_ZYGOTE_MAGIC,
    /* no CLONE_NEWTIME: a forked child would enter it at once, its
     * offsets frozen at zero; the child makes it (wr_child_setup) */
    .ns_flags = ca->flags
                & (CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP
                   | CLONE_NEWNET),
    .owner = owner,
    .securebits = ctx->securebits,
    .cap_last = ctx->cap_last,
    .n_lower = (uint32_t)ctx->n_lower,
    .cap_keep = ctx->cap_keep,
  };
  int fds[WR_ZYGOTE_MAX_FDS] = { ctx->sync_fd, ctx->err_fd, ctx->listen_fd, ctx->conn_fd };
  int nfds = 4;
  if (cgroup_fd >= 0)
    {
      req.flags |= WR_ZY_CGROUP | (ctx->cgroup_fd >= 0 ? WR_ZY_DELEGATE : 0);
      fds[nfds++] = cgroup_fd;
    }
  if (netns_fd >= 0)
    {
      req.flags |= WR_ZY_NETNS;
      fds[nfds++] = netns_fd;
      fds[nfds++] = ctx->sysfs_fd;
    }
  if (ctx->net_host)
    req.flags |= WR_ZY_NET_HOST;
  if (timens)
    req.flags |= WR_ZY_TIMENS;
  size_t len = sizeof req;
  memcpy (msg, &req, sizeof req);
  const char *strs[4 + WR_MAX_LAYERS]
      = { ctx->mnt, ctx->tmpfs_size, ctx->hostname, timens ? timens : "" };
  for (size_t i = 0; i < ctx->n_lower; i++)
    strs[4 + i] = ctx->lowers[i];
  for (size_t i = 0; i < 4 + ctx->n_lower; i++)
    {
      size_t n = strlen (strs[i]) + 1;
      if (len + n > WR_ZYGOTE_MAX_MSG)
        return -ENOSYS; /* the exec'd agent takes any length */
      memcpy (msg + len, strs[i], n);
      len += n;
    }
  return wr_zygote_spawn (rt, slot, msg, len, fds, nfds, ret_pidfd);
}

bool
wr_timens_supported (void)
{
  static int supported = -1;
  if (supported < 0)
    supported = access ("/proc/self/ns/time_for_children", F_OK) == 0;
  return supported;
}

/* /proc/PID/timens_offsets text that makes CLOCK_MONOTONIC and
 * CLOCK_BOOTTIME (so /proc/uptime) read uptime_s plus the time since now.
 * Whole seconds: the kernel wants clock + offset >= 0, which holds for any
 * uptime_s >= 0 as the sub-second part stays. */
static int
timens_offsets_text (uint64_t uptime_s, char *buf, size_t len)
{
  struct timespec mono, boot;
  if (clock_gettime (CLOCK_MONOTONIC, &mono) < 0 || clock_gettime (CLOCK_BOOTTIME, &boot) < 0)
    return -errno;
  int n = snprintf (buf, len, "%d %lld 0\n%d %lld 0\n", CLOCK_MONOTONIC,
                    (long long)uptime_s - (long long)mono.tv_sec, CLOCK_BOOTTIME,
                    (long long)uptime_s - (long long)boot.tv_sec);
  return n < 0 || (size_t)n >= len ? -ENOSPC : n;
}

int
wr_container_create (struct wr_runtime *rt, const struct wr_container_spec *spec,
                     struct wr_container *ret, wr_err_t *err)
{
  if (spec == NULL || !wr_valid_id (spec->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  if (spec->state_dir == NULL || spec->state_dir[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "state_dir must be absolute");
  if (spec->n_lowerdirs == 0 || spec->lowerdirs == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "no layers");
  const char *hostname = spec->hostname ? spec->hostname : spec->id;
  if (!valid_hostname (hostname))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid hostname");
  uint64_t disk_mb = spec->disk_mb ? spec->disk_mb : DEFAULT_DISK_MB;
  if (disk_mb > (1ull << 30) || spec->memory_mb > (1ull << 30) || spec->cpus < 0
      || spec->cpus > 4096 || spec->pids_max > (1ull << 22))
    return wr_error (err, EINVAL, WR_E_INVALID, "limit out of range");

  if (spec->n_lowerdirs > WR_MAX_LAYERS)
    return wr_error (err, E2BIG, WR_E_INVALID, "more than %d layers", WR_MAX_LAYERS);
  for (size_t i = 0; i < spec->n_lowerdirs; i++)
    if (spec->lowerdirs[i] == NULL || spec->lowerdirs[i][0] != '/')
      return wr_error (err, EINVAL, WR_E_INVALID, "layer dirs must be absolute");
  char tmpfs_size[32];
  snprintf (tmpfs_size, sizeof tmpfs_size, "%" PRIu64 "m", disk_mb);
  char timens[96];
  int timens_len = 0;
  if (spec->time_ns && wr_timens_supported ())
    {
      if (spec->uptime_s > WR_MAX_UPTIME_S)
        return wr_error (err, ERANGE, WR_E_INVALID, "uptime out of range");
      timens_len = timens_offsets_text (spec->uptime_s, timens, sizeof timens);
      if (timens_len < 0)
        return wr_error (err, -timens_len, WR_E_INTERNAL, "time namespace offsets");
    }

  _cleanup_close_ int dirfd = open (spec->state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0)
    return wr_sys_error (err, "open state dir %s", spec->state_dir);
  struct sockaddr_un sa;
  socklen_t salen;
  struct sock_loc sl;
  sock_loc (rt, spec->id, dirfd, &sl);
  if (sock_addr (rt, spec->id, spec->state_dir, dirfd, &sa, &salen) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "state dir path too long");

  /* agent sockets: the listener is bound on the host (reconnect after a daemon
   * restart); the socketpair is the first connection, no accept round trip */
  _cleanup_close_ int lfd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0)
    return wr_sys_error (err, "socket");
  unlinkat (sl.dfd, sl.name, 0);
  if (bind (lfd, (struct sockaddr *)&sa, salen) < 0)
    return wr_sys_error (err, "bind %s", sa.sun_path);
  if (fchmodat (sl.dfd, sl.name, 0600, 0) < 0 || listen (lfd, 16) < 0)
    {
      int r = wr_sys_error (err, "listen %s", sa.sun_path);
      unlinkat (sl.dfd, sl.name, 0);
      return r;
    }
  int sp[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
    {
      int r = wr_sys_error (err, "socketpair");
      unlinkat (sl.dfd, sl.name, 0);
      return r;
    }
  _cleanup_close_ int ours = sp[0], theirs = sp[1];
  int syncp[2], errp[2];
  /* a socket, not a pipe: send(MSG_NOSIGNAL) to a dead child must not SIGPIPE */
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, syncp) < 0)
    {
      unlinkat (sl.dfd, sl.name, 0);
      return wr_sys_error (err, "pipe");
    }
  _cleanup_close_ int sync_r = syncp[0], sync_w = syncp[1];
  if (pipe2 (errp, O_CLOEXEC) < 0)
    {
      unlinkat (sl.dfd, sl.name, 0);
      return wr_sys_error (err, "pipe");
    }
  _cleanup_close_ int err_r = errp[0], err_w = errp[1];

  int securebits = prctl (PR_GET_SECUREBITS, 0, 0, 0, 0);
  if (securebits < 0)
    {
      unlinkat (sl.dfd, sl.name, 0);
      return wr_sys_error (err, "PR_GET_SECUREBITS");
    }
  uid_t base;
  int r = wr_uid_block_alloc (rt, spec->id, &base, err);
  if (r < 0)
    {
      unlinkat (sl.dfd, sl.name, 0);
      return r;
    }
  struct layer_mounts lm = { 0 };
  char uid_map[64];
  snprintf (uid_map, sizeof uid_map, "0 %u %u\n", (unsigned)base, WR_UID_BLOCK);

  struct wr_cg_limits lim = { .memory_bytes = spec->memory_mb << 20,
                              .pids_max = spec->pids_max,
                              .cpus = spec->cpus,
                              .best_effort = spec->best_effort };
  struct wr_cg_sandbox cgs;
  r = wr_cg_create (&rt->cg, spec->id, &lim, &cgs, err);
  if (r < 0)
    {
      wr_uid_block_free (rt, spec->id, base);
      unlinkat (sl.dfd, sl.name, 0);
      return r;
    }

  static char arg0[] = "warren-agent", a1[] = "--listen-fd", a2[] = "3", a3[] = "--conn-fd",
              a4[] = "4", a5[] = "--keep-fd", a6[] = "7", a7[] = "--cgroup-fd", a8[] = "8";
  static char e0[] = "PATH=" WR_DEFAULT_PATH, e1[] = "HOME=/root", e2[] = "container=warren";
  static char *const argv[] = { arg0, a1, a2, a3, a4, a5, a6, NULL };
  static char *const argv_cg[] = { arg0, a1, a2, a3, a4, a5, a6, a7, a8, NULL };
  /* Delegate the sandbox's cgroup2 dir to the agent (its root is its block's
   * first id on the host): it may create child cgroups and move its own children
   * between them, within the limits set here and above, which it cannot
   * touch. Bounded so that it cannot spend the kernel's memory on cgroups. */
  bool delegate = cgs.v2_fd >= 0
                  && wr_write_file_at (cgs.v2_fd, "cgroup.max.descendants", "256") == 0
                  && wr_write_file_at (cgs.v2_fd, "cgroup.max.depth", "1") == 0
                  && fchownat (cgs.v2_fd, "", base, base, AT_EMPTY_PATH) == 0
                  && fchownat (cgs.v2_fd, "cgroup.procs", base, base, 0) == 0;
  static char *const envp[] = { e0, e1, e2, NULL };
  uint64_t keep = 0;
  for (size_t i = 0; i < WR_ARRAY_SIZE (keep_caps); i++)
    keep |= 1ull << keep_caps[i];
  struct wr_child_ctx ctx = {
    .sync_fd = sync_r,
    .err_fd = err_w,
    .listen_fd = lfd,
    .conn_fd = theirs,
    .agent_fd = rt->agent_fd,
    .cgroup_fd = delegate ? cgs.v2_fd : -1,
    .net_host = spec->net_host,
    .sysfs_fd = -1,
    .mnt = rt->mnt_dir,
    .n_lower = spec->n_lowerdirs,
    .tmpfs_size = tmpfs_size,
    .hostname = hostname,
    .hostname_len = strlen (hostname),
    .cap_keep = keep,
    .cap_last = rt->cap_last,
    .seccomp = &rt->seccomp,
    .securebits = securebits,
    .argv = delegate ? argv_cg : argv,
    .envp = envp,
  };

  int pidfd = -1;
  struct wr_clone_args ca = {
    /* no CLONE_NEWNS: the child unshares it once its layers are mounted */
    .flags = CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP
             | CLONE_PIDFD | (spec->net_host ? 0 : CLONE_NEWNET),
    .pidfd = (uint64_t)(uintptr_t)&pidfd,
    .exit_signal = SIGCHLD,
  };
  /* A time namespace for the sandbox: with CLONE_VM the child itself stays
   * in ours (its time_for_children is the new one, offsets still writable:
   * we write them below, as host root); the agent enters it at execveat, a
   * new mm switching to time_for_children, and so does everything it
   * spawns, CLONE_VM or not. */
  if (timens_len > 0)
    ca.flags |= CLONE_NEWTIME;
  if (cgs.v2_fd >= 0)
    {
      ca.flags |= CLONE_INTO_CGROUP;
      ca.cgroup = (uint64_t)cgs.v2_fd;
    }

  /* a network namespace made ahead by the pool, joined around clone3 */
  _cleanup_close_ int pooled_netns = -1, pooled_sysfs = -1;
  struct wr_netns_pool *netns_pool = spec->netns_pool ? spec->netns_pool : rt->netns_pool;
  if (!spec->net_host && wr_netns_pool_take (netns_pool, &pooled_netns, &pooled_sysfs) == 0)
    {
      ca.flags &= ~(uint64_t)CLONE_NEWNET;
      ctx.sysfs_fd = pooled_sysfs;
    }
  pthread_once (&dev_template_once, wr_dev_template_make);
  sigset_t all, old;
  sigfillset (&all);
  int slot = wr_stack_acquire (rt);
  /* the slot's mount points: ours until layer_mounts_clear */
  if ((r = layer_mounts_prepare (rt, spec, slot, &lm, err)) < 0)
    {
      layer_mounts_clear (&lm);
      wr_stack_release (rt, slot);
      goto fail_cg;
    }
  ctx.lowers = lm.dir;
  /* the agent zygote forks the agent (it joins the pooled netns itself);
   * without one the CLONE_VM child execs it */
  long pid = zygote_clone (rt, &ca, &ctx, base, timens_len > 0 ? timens : NULL, cgs.v2_fd,
                           pooled_netns, slot, &pidfd);
  bool zygote_child = pid != -ENOSYS;
  if (!zygote_child)
    {
      pthread_sigmask (SIG_SETMASK, &all, &old);
      if (pooled_netns >= 0)
        wr_netns_pool_enter (netns_pool, pooled_netns);
      pid = clone_as (base, securebits, &ca, rt, slot, &ctx);
      if (pooled_netns >= 0)
        wr_netns_pool_leave (netns_pool);
      pthread_sigmask (SIG_SETMASK, &old, NULL);
    }
  if (pid < 0)
    {
      layer_mounts_clear (&lm);
      wr_stack_release (rt, slot);
      r = wr_error (err, (int)-pid, pid == -ENOSYS ? WR_E_UNSUPPORTED : WR_E_INTERNAL, "clone3");
      goto fail_cg;
    }
  /* the child holds its own copies now */
  close (TAKE_FD (sync_r));
  close (TAKE_FD (err_w));
  close (TAKE_FD (theirs));
  close (TAKE_FD (lfd));

  {
    char path[64];
    snprintf (path, sizeof path, "/proc/%ld/uid_map", pid);
    r = wr_write_file_at (AT_FDCWD, path, uid_map);
    if (r == 0)
      {
        snprintf (path, sizeof path, "/proc/%ld/gid_map", pid);
        r = wr_write_file_at (AT_FDCWD, path, uid_map);
      }
    if (r < 0)
      r = wr_error (err, -r, WR_E_INTERNAL, "write id map");
    if (r == 0 && timens_len > 0 && !zygote_child) /* a zygote child writes its own */
      {
        snprintf (path, sizeof path, "/proc/%ld/timens_offsets", pid);
        r = wr_write_file_at (AT_FDCWD, path, timens);
        if (r < 0)
          r = wr_error (err, -r, WR_E_INTERNAL, "write time namespace offsets");
      }
  }
  if (r == 0)
    r = layer_mounts_make (spec, (pid_t)pid, &lm, err);
  if (r == 0)
    r = wr_cg_attach_v1 (&rt->cg, &cgs, (pid_t)pid, err);
  /* best-effort: the agent and everything it starts (the policy is
   * inherited) also yield inside the sandbox's group */
  if (r == 0 && spec->best_effort)
    {
      struct sched_param prm = { 0 };
      if (sched_setscheduler ((pid_t)pid, SCHED_IDLE, &prm) < 0)
        r = wr_sys_error (err, "SCHED_IDLE");
    }
  bool released = false;
  if (r == 0)
    {
      /* EPIPE: the child failed before waiting; its report is in err_r */
      released = send (sync_w, "x", 1, MSG_NOSIGNAL) == 1 || errno == EPIPE || errno == ECONNRESET;
      if (!released)
        r = wr_sys_error (err, "release child");
    }
  close (TAKE_FD (sync_w));
  struct wr_child_err ce = { 0, 0 };
  ssize_t got = 0;
  if (released)
    {
      got = wr_read_all (err_r, &ce, sizeof ce);
      if (got != 0)
        r = wr_error (err, got == (ssize_t)sizeof ce ? ce.errnum : EIO, WR_E_INTERNAL,
                      "sandbox setup: %s",
                      got == (ssize_t)sizeof ce && ce.step > 0
                              && ce.step < (int)WR_ARRAY_SIZE (wr_child_step_names)
                          ? wr_child_step_names[ce.step]
                          : "child died");
    }
  else
    {
      /* the child may still run on our stack: kill it before unlocking */
      wr_sys_pidfd_send_signal (pidfd, SIGKILL);
    }
  if (r < 0)
    {
      wr_kill_reap (pidfd);
      if (pidfd >= 0)
        close (pidfd);
      layer_mounts_clear (&lm);
      wr_stack_release (rt, slot);
      goto fail_cg;
    }
  layer_mounts_clear (&lm);
  wr_stack_release (rt, slot);

  uint64_t st = 0;
  wr_read_start_time ((pid_t)pid, &st);
  if (fcntl (ours, F_SETFL, O_NONBLOCK) < 0)
    {
      r = wr_sys_error (err, "O_NONBLOCK");
      wr_sys_pidfd_send_signal (pidfd, SIGKILL);
      wr_cg_kill (&rt->cg, &cgs, NULL);
      reap (pidfd);
      close (pidfd);
      goto fail_cg;
    }
  wr_cg_sandbox_close (&cgs);
  wr_container_fill (ret, spec->id, (pid_t)pid, pidfd, st, TAKE_FD (ours));
  ret->uid_base = base;
  return 0;

fail_cg:
  /* the block is free only once no process of the sandbox is left */
  if (wr_cg_kill (&rt->cg, &cgs, NULL) == 0)
    wr_uid_block_free (rt, spec->id, base);
  wr_cg_sandbox_close (&cgs);
  wr_cg_remove (&rt->cg, spec->id, NULL);
  unlinkat (sl.dfd, sl.name, 0);
  return r;
}

int
wr_container_destroy (struct wr_runtime *rt, struct wr_container *c, const char *state_dir,
                      wr_err_t *err)
{
  if (c == NULL || !wr_valid_id (c->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  int r = wr_sandbox_kill (rt, c, err);
  if (r < 0)
    return r; /* processes may be left: the uid block stays claimed */
  wr_uid_block_free (rt, c->id, c->uid_base);
  c->uid_base = 0;
  r = wr_cg_remove (&rt->cg, c->id, err);
  if (rt->sock_dir_fd >= 0 && unlinkat (rt->sock_dir_fd, c->id, 0) < 0 && errno != ENOENT && r == 0)
    r = wr_sys_error (err, "unlink %s/%s", rt->sock_dir, c->id);
  if (state_dir) /* where it was before, and is without the tmpfs dir */
    {
      _cleanup_close_ int dfd = open (state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
      if (dfd >= 0 && unlinkat (dfd, AGENT_SOCK, 0) < 0 && errno != ENOENT && r == 0)
        r = wr_sys_error (err, "unlink %s/" AGENT_SOCK, state_dir);
    }
  return r;
}

int
wr_container_agent_connect (struct wr_runtime *rt, const char *id, const char *state_dir, int dirfd,
                            wr_err_t *err)
{
  _cleanup_close_ int own_dirfd = -1;
  struct sockaddr_un sa;
  socklen_t salen;
  _cleanup_close_ int fd = -1;
  /* the runtime's tmpfs dir first, then the state dir (a sandbox made by a
   * daemon without the tmpfs dir) */
  for (int where = rt->sock_dir_fd >= 0 ? 0 : 1; where < 2; where++)
    {
      int r = where == 0 ? sock_addr (rt, id, state_dir, dirfd, &sa, &salen)
                         : agent_addr (state_dir, dirfd, &sa, &salen);
      if (r == -ENAMETOOLONG && where == 1 && dirfd < 0
          && (own_dirfd = open (state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC)) >= 0)
        r = agent_addr (state_dir, dirfd = own_dirfd, &sa, &salen);
      if (r < 0)
        return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "state dir path too long");
      if (fd >= 0)
        close (TAKE_FD (fd));
      fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0)
        return wr_sys_error (err, "socket");
      if (connect (fd, (struct sockaddr *)&sa, salen) == 0 || errno == EINPROGRESS)
        return TAKE_FD (fd);
      if (where == 1 || (errno != ENOENT && errno != ECONNREFUSED))
        return wr_error (err, errno, WR_E_UNAVAILABLE, "connect %s", sa.sun_path);
    }
  return wr_error (err, ENOENT, WR_E_UNAVAILABLE, "no agent socket");
}

int
wr_container_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uint64_t start_time,
                    const char *state_dir, struct wr_container *ret, wr_err_t *err)
{
  _cleanup_close_ int pidfd = -1, dirfd = -1;
  int r = wr_adopt_open ("sandbox", id, pid, start_time, state_dir, &pidfd, &dirfd, err);
  if (r < 0)
    return r;
  _cleanup_close_ int fd = wr_container_agent_connect (rt, id, state_dir, dirfd, err);
  if (fd < 0)
    return fd;
  uid_t base;
  if ((r = wr_uid_block_adopt (rt, id, pid, &base, err)) < 0)
    return r;
  wr_container_fill (ret, id, pid, TAKE_FD (pidfd), start_time, TAKE_FD (fd));
  ret->uid_base = base;
  return 0;
}

int
wr_container_freeze (struct wr_runtime *rt, struct wr_container *c, bool frozen, wr_err_t *err)
{
  if (c == NULL || !wr_valid_id (c->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  struct wr_cg_sandbox cgs;
  if (wr_cg_open (&rt->cg, c->id, &cgs) == 0)
    return wr_error (err, ENOENT, WR_E_GONE, "sandbox %s has no cgroup", c->id);
  int r = wr_cg_freeze (&rt->cg, &cgs, frozen, err);
  wr_cg_sandbox_close (&cgs);
  return r;
}

/* process_madvise over every private writable mapping of pid (its
 * anonymous memory: heap, stacks, private copies), through a pidfd so a
 * reused pid is never touched. MADV_PAGEOUT (pause) reclaims those pages
 * at once, into swap where there is some, whatever the LRU thinks of them;
 * MADV_WILLNEED (resume) reads them back so the first requests after a
 * resume do not fault them in page by page. Best effort: a process that
 * exits meanwhile or a kernel without process_madvise is skipped. */
static void
madvise_pid (pid_t pid, int advice)
{
  _cleanup_close_ int pidfd = (int)syscall (SYS_pidfd_open, pid, 0);
  if (pidfd < 0)
    return;
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/maps", (int)pid);
  FILE *f = fopen (path, "re");
  if (f == NULL)
    return;
  struct iovec iov[64]; /* <= UIO_MAXIOV */
  size_t n = 0;
  char line[512];
  while (fgets (line, sizeof line, f))
    {
      unsigned long lo, hi;
      char perms[8];
      if (sscanf (line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || perms[1] != 'w' || perms[3] != 'p')
        continue;
      iov[n++] = (struct iovec){ (void *)lo, hi - lo };
      if (n == WR_ARRAY_SIZE (iov))
        {
          syscall (SYS_process_madvise, pidfd, iov, n, advice, 0);
          n = 0;
        }
    }
  if (n)
    syscall (SYS_process_madvise, pidfd, iov, n, advice, 0);
  fclose (f);
}

static void
madvise_sandbox (struct wr_runtime *rt, struct wr_cg_sandbox *cgs, int advice,
                 const atomic_bool *stop)
{
  pid_t pids[256];
  int n = wr_cg_pids (&rt->cg, cgs, pids, (int)WR_ARRAY_SIZE (pids));
  for (int i = 0; i < n && i < (int)WR_ARRAY_SIZE (pids) && !(stop && atomic_load (stop)); i++)
    madvise_pid (pids[i], advice);
}

int
wr_container_pause (struct wr_runtime *rt, struct wr_container *c, bool pause,
                    struct wr_pause_stats *ret, wr_err_t *err)
{
  if (c == NULL || !wr_valid_id (c->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  struct wr_cg_sandbox cgs;
  if (wr_cg_open (&rt->cg, c->id, &cgs) == 0)
    return wr_error (err, ENOENT, WR_E_GONE, "sandbox %s has no cgroup", c->id);
  struct wr_pause_stats st = { 0 };
  struct wr_container_stats cs;
  if (wr_cg_stats (&rt->cg, &cgs, &cs, NULL) == 0)
    st.memory_before_bytes = cs.memory_bytes;
  uint64_t t0 = wr_now_ns ();
  int r = 0;
  if (pause)
    {
      /* the swap goes in here, before any resume can take it away again;
       * the reclaim itself is wr_container_reclaim's */
      r = wr_cg_freeze (&rt->cg, &cgs, true, err);
      if (r == 0 && wr_cg_reclaim_begin (&rt->cg, &cgs, err) < 0)
        {
          wr_cg_freeze (&rt->cg, &cgs, false, NULL);
          r = -1;
        }
      st.freeze_ns = wr_now_ns () - t0;
    }
  else
    {
      r = wr_cg_unreclaim (&rt->cg, &cgs, err);
      if (r == 0)
        madvise_sandbox (rt, &cgs, MADV_WILLNEED, NULL);
      st.reclaim_ns = wr_now_ns () - t0;
      t0 = wr_now_ns ();
      if (r == 0)
        r = wr_cg_freeze (&rt->cg, &cgs, false, err);
      st.freeze_ns = wr_now_ns () - t0;
    }
  if (wr_cg_stats (&rt->cg, &cgs, &cs, NULL) == 0)
    st.memory_after_bytes = cs.memory_bytes;
  wr_cg_sandbox_close (&cgs);
  if (ret)
    *ret = st;
  return r < 0 ? r : 0;
}

int
wr_container_reclaim (struct wr_runtime *rt, const char *id, const atomic_bool *stop,
                      struct wr_pause_stats *st)
{
  if (!wr_valid_id (id))
    return -EINVAL;
  struct wr_cg_sandbox cgs;
  if (wr_cg_open (&rt->cg, id, &cgs) == 0)
    return -ENOENT;
  /* frozen means stopped: no task faults pages back in (or holds them
   * isolated) while they are reclaimed; a task stuck in the kernel past
   * the wait only costs what it holds */
  uint64_t t0 = wr_now_ns ();
  for (int ms = 0; ms < 2000 && !atomic_load (stop); ms++)
    if (wr_cg_wait_frozen (&rt->cg, &cgs, 0) != -ETIMEDOUT)
      break;
    else
      usleep (1000);
  st->freeze_ns += wr_now_ns () - t0;
  t0 = wr_now_ns ();
  /* processes' anonymous memory first, whatever its LRU age, then the
   * cgroup's reclaim for the rest (tmpfs, page cache, what madvise could
   * not reach) */
  madvise_sandbox (rt, &cgs, MADV_PAGEOUT, stop);
  int r = wr_cg_reclaim (&rt->cg, &cgs, stop, NULL);
  st->reclaim_ns = wr_now_ns () - t0;
  struct wr_container_stats cs;
  if (wr_cg_stats (&rt->cg, &cgs, &cs, NULL) == 0)
    st->memory_after_bytes = cs.memory_bytes;
  wr_cg_sandbox_close (&cgs);
  return r < 0 ? r : 0;
}

int
wr_container_stats (struct wr_runtime *rt, struct wr_container *c, struct wr_container_stats *ret,
                    wr_err_t *err)
{
  if (c == NULL || !wr_valid_id (c->id))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid sandbox id");
  struct wr_cg_sandbox cgs;
  if (wr_cg_open (&rt->cg, c->id, &cgs) == 0)
    return wr_error (err, ENOENT, WR_E_GONE, "sandbox %s has no cgroup", c->id);
  int r = wr_cg_stats (&rt->cg, &cgs, ret, err);
  wr_cg_sandbox_close (&cgs);
  return r;
}

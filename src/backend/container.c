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

/* Masked in /proc like Docker does (harmless to skip when absent). Already
 * protected by the user namespace; masking also hides the information. */
static const char *const proc_masks[] = {
  "proc/kcore",       "proc/keys",          "proc/timer_list",
  "proc/sched_debug", "proc/sysrq-trigger", "proc/latency_stats",
};

static const struct
{
  const char *name;
  unsigned major, minor;
} dev_nodes[] = {
  { "null", 1, 3 },   { "zero", 1, 5 },    { "full", 1, 7 },
  { "random", 1, 8 }, { "urandom", 1, 9 }, { "tty", 5, 0 },
};

/* The sandbox's device nodes come from a detached tmpfs that host root makes
 * once per process (a tmpfs mounted in the sandbox's user namespace cannot
 * hold usable devices). Binds of the host's devtmpfs would show its mount
 * options, sized from the host's memory, in the sandbox's mountinfo. The
 * child clones single nodes out of it (open_tree of a detached mount);
 * without it, or where the kernel refuses that clone (EINVAL), it binds the
 * host's nodes. Read by the CLONE_VM child: set before the first clone,
 * never changed after. */
static int dev_template_fd = -1;
static char dev_template_path[32]; /* "/proc/self/fd/N/" */
static pthread_once_t dev_template_once = PTHREAD_ONCE_INIT;

static void
dev_template_make (void)
{
  _cleanup_close_ int fs = (int)syscall (__NR_fsopen, "tmpfs", FSOPEN_CLOEXEC);
  if (fs < 0 || syscall (__NR_fsconfig, fs, FSCONFIG_SET_STRING, "size", "4k", 0) < 0
      || syscall (__NR_fsconfig, fs, FSCONFIG_SET_STRING, "nr_inodes", "16", 0) < 0
      || syscall (__NR_fsconfig, fs, FSCONFIG_SET_STRING, "mode", "0755", 0) < 0
      || syscall (__NR_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
    return;
  _cleanup_close_ int m
      = (int)syscall (__NR_fsmount, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC);
  if (m < 0)
    return;
  for (size_t i = 0; i < WR_ARRAY_SIZE (dev_nodes); i++)
    if (mknodat (m, dev_nodes[i].name, S_IFCHR | 0666,
                 makedev (dev_nodes[i].major, dev_nodes[i].minor))
            < 0
        || fchmodat (m, dev_nodes[i].name, 0666, 0) < 0)
      return;
  dev_template_fd = TAKE_FD (m);
  snprintf (dev_template_path, sizeof dev_template_path, "/proc/self/fd/%d/", dev_template_fd);
}

/* Mount device node `name` of the template (or the host's) on dst. A plain
 * bind of the node's path through our copy of the template fd first: the
 * kernel lets a bind copy from a detached mount, and no detached tree of our
 * own is made. The open_tree clone (older kernels refuse that bind) is an
 * anonymous mount namespace per node, and closing its fd waits for an
 * expedited RCU grace period: 12 per sandbox were ~4% of the daemon's
 * create+destroy time (perf). */
static long
c_dev_node (const char *name, const char *dst)
{
  if (dev_template_fd >= 0)
    {
      char src[64];
      size_t lp = strlen (dev_template_path), ln = strlen (name);
      if (lp + ln < sizeof src)
        {
          memcpy (src, dev_template_path, lp);
          memcpy (src + lp, name, ln + 1);
          long r = wr_raw5 (__NR_mount, src, dst, NULL, MS_BIND, NULL);
          if (r != -EINVAL)
            return r;
        }
      long t = wr_raw3 (__NR_open_tree, dev_template_fd, name, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
      if (t >= 0)
        {
          long r = wr_raw5 (__NR_move_mount, t, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH);
          wr_raw1 (__NR_close, t);
          return r;
        }
      if (t != -EINVAL)
        return t;
    }
  char src[32] = "/dev/";
  size_t len = strlen (name);
  if (len > sizeof src - 6)
    return -ENAMETOOLONG;
  memcpy (src + 5, name, len + 1);
  return wr_raw5 (__NR_mount, src, dst, NULL, MS_BIND, NULL);
}

enum child_step
{
  ST_SYNC = 1,
  ST_CGROUPNS,
  ST_IDS,
  ST_HOSTNAME,
  ST_FDS,
  ST_TMPFS,
  ST_OVERLAY,
  ST_PROC,
  ST_DEV,
  ST_SYS,
  ST_NET,
  ST_PIVOT,
  ST_CAPS,
  ST_SECCOMP,
  ST_EXEC,
};
static const char *const step_names[] = {
  "",
  "wait for parent",
  "cgroup namespace",
  "set ids",
  "sethostname",
  "arrange fds",
  "mount upper tmpfs",
  "mount overlay",
  "mount /proc",
  "populate /dev",
  "mount /sys",
  "loopback up",
  "pivot_root",
  "drop capabilities",
  "seccomp",
  "execveat agent",
};

struct child_ctx
{
  int sync_fd, err_fd, listen_fd, conn_fd, agent_fd;
  int cgroup_fd; /* the sandbox's cgroup2 dir, -1 if none */
  bool net_host;
  int sysfs_fd; /* a pooled netns (pool.c): its sysfs, made by the pool; -1: own netns */
  const char *mnt;
  const char *const *lowers;
  size_t n_lower;
  const char *tmpfs_size;
  const char *hostname;
  size_t hostname_len;
  uint64_t cap_keep;
  int cap_last;
  const struct sock_fprog *seccomp;
  int securebits; /* the daemon's: the parent raised NO_SETUID_FIXUP around clone */
  char *const *argv;
  char *const *envp;
};

struct child_err
{
  int step;
  int errnum;
};

static int
child_fail (int err_fd, int step, long r)
{
  struct child_err e = { step, (int)-r };
  wr_raw3 (__NR_write, err_fd, &e, sizeof e);
  return 127;
}

#define TRY(step, expr)                                                                            \
  do                                                                                               \
    {                                                                                              \
      long _r = (expr);                                                                            \
      if (_r < 0)                                                                                  \
        return child_fail (err_fd, (step), _r);                                                    \
    }                                                                                              \
  while (0)

/* mkdir that tolerates an existing entry (the image may ship the dir). */
static long
c_mkdir (const char *p, int mode)
{
  long r = wr_raw3 (__NR_mkdirat, AT_FDCWD, p, mode);
  return r == -EEXIST ? 0 : r;
}

static long
c_mount (const char *src, const char *dst, const char *fs, unsigned long fl, const void *data)
{
  return wr_raw5 (__NR_mount, src, dst, fs, fl, data);
}

/* Hand a layer to overlayfs as the string "/proc/self/fd/N": the kernel
 * resolves it through our fd (no walk through daemon directories) and keeps
 * the string as the layer's name in the mount options, which the sandbox
 * reads in /proc/self/mountinfo. FSCONFIG_SET_FD (6.13+) would record the
 * layer's d_path instead, i.e. the daemon's store path. */
static long
set_layer_fd_path (long fsfd, const char *key, int fd)
{
  char path[32] = "/proc/self/fd/", digits[12];
  int n = 0;
  do
    digits[n++] = (char)('0' + fd % 10);
  while ((fd /= 10) > 0 && n < 11);
  size_t off = 14;
  while (n > 0)
    path[off++] = digits[--n];
  path[off] = 0;
  return wr_raw5 (__NR_fsconfig, fsfd, FSCONFIG_SET_STRING, key, path, 0);
}

static int
child_main (void *arg)
{
  const struct child_ctx *c = arg;
  int err_fd = c->err_fd;
  char b;
  /* wait until the parent wrote our id maps, made our idmapped layer mounts
   * and joined the v1 cgroups */
  long n = wr_raw3 (__NR_read, c->sync_fd, &b, 1);
  if (n != 1)
    return child_fail (err_fd, ST_SYNC, n < 0 ? n : -EPIPE);
  /* Our mount namespace is made only now, so that it copies the idmapped
   * layer mounts the parent has just made for our uid block (they need our
   * user namespace, which clone created). A cgroup namespace rooted at the
   * sandbox's own cgroups: the one clone made is rooted where we were then:
   * the v2 group (CLONE_INTO_CGROUP), but the daemon's v1 groups, which the
   * parent has only now moved us out of; /proc/self/cgroup would show the
   * host's hierarchy and the daemon's group name. */
  TRY (ST_CGROUPNS, wr_raw1 (__NR_unshare, CLONE_NEWNS | CLONE_NEWCGROUP));
  /* Open the layers and the mount point while our fsuid is still host root
   * (they live under the daemon's 0700 root). Paths are walked here, in our
   * own mount namespace, because overlayfs only accepts layers that are
   * mounts of the caller's namespace. */
  int lower_fds[WR_MAX_LAYERS];
  for (size_t i = 0; i < c->n_lower; i++)
    {
      long fd = wr_raw4 (__NR_openat, AT_FDCWD, c->lowers[i], O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
      TRY (ST_OVERLAY, fd);
      lower_fds[i] = (int)fd;
    }
  long mnt_fd = wr_raw4 (__NR_openat, AT_FDCWD, c->mnt, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
  TRY (ST_OVERLAY, mnt_fd);

  /* the parent's NO_SETUID_FIXUP must not reach the sandbox: a uid change
   * there has to drop capabilities as usual */
  TRY (ST_IDS, wr_raw2 (__NR_prctl, PR_SET_SECUREBITS, c->securebits));
  TRY (ST_IDS, wr_raw3 (__NR_setresgid, 0, 0, 0));
  /* drop the daemon's supplementary groups (host gid 0 would stay effective) */
  TRY (ST_IDS, wr_raw2 (__NR_setgroups, 0, NULL));
  TRY (ST_IDS, wr_raw3 (__NR_setresuid, 0, 0, 0));
  TRY (ST_HOSTNAME, wr_raw2 (__NR_sethostname, c->hostname, c->hostname_len));

  /* root: a size-capped tmpfs upper and the overlay, both built as detached
   * mounts with the new mount API: every layer, the upper and the mount point
   * arrive as fds opened by the daemon, so no daemon-private path (0700) has
   * to be walked with the sandbox's unprivileged uid. */
  long t = wr_raw2 (__NR_fsopen, "tmpfs", FSOPEN_CLOEXEC);
  TRY (ST_TMPFS, t);
  TRY (ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_SET_STRING, "size", c->tmpfs_size, 0));
  TRY (ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_SET_STRING, "mode", "0755", 0));
  TRY (ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_CMD_CREATE, NULL, NULL, 0));
  long tm = wr_raw3 (__NR_fsmount, t, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
  TRY (ST_TMPFS, tm);
  TRY (ST_TMPFS, wr_raw3 (__NR_mkdirat, tm, "u", 0755));
  TRY (ST_TMPFS, wr_raw3 (__NR_mkdirat, tm, "w", 0700));
  long u = wr_raw3 (__NR_openat, tm, "u", O_PATH | O_DIRECTORY | O_CLOEXEC);
  long w = wr_raw3 (__NR_openat, tm, "w", O_PATH | O_DIRECTORY | O_CLOEXEC);
  TRY (ST_TMPFS, u);
  TRY (ST_TMPFS, w);
  long o = wr_raw2 (__NR_fsopen, "overlay", FSOPEN_CLOEXEC);
  TRY (ST_OVERLAY, o);
  for (size_t i = 0; i < c->n_lower; i++)
    TRY (ST_OVERLAY, set_layer_fd_path (o, "lowerdir+", lower_fds[i]));
  TRY (ST_OVERLAY, set_layer_fd_path (o, "upperdir", (int)u));
  TRY (ST_OVERLAY, set_layer_fd_path (o, "workdir", (int)w));
  TRY (ST_OVERLAY, wr_raw5 (__NR_fsconfig, o, FSCONFIG_SET_FLAG, "userxattr", NULL, 0));
  TRY (ST_OVERLAY, wr_raw5 (__NR_fsconfig, o, FSCONFIG_CMD_CREATE, NULL, NULL, 0));
  long om = wr_raw3 (__NR_fsmount, o, FSMOUNT_CLOEXEC, 0);
  TRY (ST_OVERLAY, om);
  TRY (ST_OVERLAY, wr_raw5 (__NR_move_mount, om, "", mnt_fd, "",
                            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH));
  TRY (ST_OVERLAY, wr_raw1 (__NR_fchdir, om));

  /* /proc, /dev, /sys before the fds are arranged: the device nodes are
   * cloned from dev_template_fd, which close_range would close */
  wr_raw1 (__NR_umask, 0);
  TRY (ST_PROC, c_mkdir ("proc", 0555));
  TRY (ST_PROC, c_mount ("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  TRY (ST_PROC, c_mount ("proc/sys", "proc/sys", NULL, MS_BIND, NULL));
  TRY (ST_PROC,
       c_mount (NULL, "proc/sys", NULL,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  for (size_t i = 0; i < WR_ARRAY_SIZE (proc_masks); i++)
    {
      long r = c_dev_node ("null", proc_masks[i]);
      if (r < 0 && r != -ENOENT)
        return child_fail (err_fd, ST_PROC, r);
    }

  TRY (ST_DEV, c_mkdir ("dev", 0755));
  TRY (ST_DEV,
       c_mount ("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k,nr_inodes=64"));
  {
    char path[32] = "dev/";
    for (size_t i = 0; i < WR_ARRAY_SIZE (dev_nodes); i++)
      {
        size_t len = strlen (dev_nodes[i].name);
        memcpy (path + 4, dev_nodes[i].name, len + 1);
        TRY (ST_DEV, wr_raw4 (__NR_mknodat, AT_FDCWD, path, S_IFREG | 0666, 0));
        TRY (ST_DEV, c_dev_node (dev_nodes[i].name, path));
      }
  }
  TRY (ST_DEV, wr_raw3 (__NR_mkdirat, AT_FDCWD, "dev/pts", 0755));
  TRY (ST_DEV, c_mount ("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                        "newinstance,ptmxmode=0666,mode=0620"));
  TRY (ST_DEV, wr_raw3 (__NR_symlinkat, "pts/ptmx", AT_FDCWD, "dev/ptmx"));
  TRY (ST_DEV, wr_raw3 (__NR_mkdirat, AT_FDCWD, "dev/shm", 01777));
  TRY (ST_DEV, c_mount ("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                        "mode=1777,size=65536k"));
  TRY (ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd", AT_FDCWD, "dev/fd"));
  TRY (ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/0", AT_FDCWD, "dev/stdin"));
  TRY (ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/1", AT_FDCWD, "dev/stdout"));
  TRY (ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/2", AT_FDCWD, "dev/stderr"));

  TRY (ST_SYS, c_mkdir ("sys", 0555));
  if (c->sysfs_fd >= 0) /* pooled netns: we may not mount its sysfs, the pool did */
    TRY (ST_SYS,
         wr_raw5 (__NR_move_mount, c->sysfs_fd, "", AT_FDCWD, "sys", MOVE_MOUNT_F_EMPTY_PATH));
  else if (!c->net_host)
    TRY (ST_SYS,
         c_mount ("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  else
    {
      /* sysfs of a netns we do not own cannot be mounted: read-only rbind */
      TRY (ST_SYS, c_mount ("/sys", "sys", NULL, MS_BIND | MS_REC, NULL));
      struct mount_attr ro = { .attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                                           | MOUNT_ATTR_NOEXEC };
      TRY (ST_SYS, wr_raw5 (__NR_mount_setattr, AT_FDCWD, "sys", AT_RECURSIVE, &ro, sizeof ro));
      /* the host's cgroup trees came with the bind (every sandbox's groups
       * and stats): cover them, as a fresh sysfs has nothing there either.
       * The bind must be recursive: its submounts are locked to us. */
      long r
          = c_mount ("none", "sys/fs/cgroup", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                     "size=4k,nr_inodes=1,mode=555");
      if (r < 0 && r != -ENOENT)
        return child_fail (err_fd, ST_SYS, r);
    }
  {
    long r = wr_raw3 (__NR_mkdirat, AT_FDCWD, "tmp", 01777);
    if (r < 0 && r != -EEXIST)
      return child_fail (err_fd, ST_SYS, r);
  }

  /* fds: 3 = listen, 4 = conn, 5 = agent binary (cloexec), 6 = error pipe */
  long l = wr_raw3 (__NR_fcntl, c->listen_fd, F_DUPFD_CLOEXEC, 16);
  long k = wr_raw3 (__NR_fcntl, c->conn_fd, F_DUPFD_CLOEXEC, 16);
  long a = wr_raw3 (__NR_fcntl, c->agent_fd, F_DUPFD_CLOEXEC, 16);
  long e = wr_raw3 (__NR_fcntl, err_fd, F_DUPFD_CLOEXEC, 16);
  long up = wr_raw3 (__NR_fcntl, u, F_DUPFD_CLOEXEC, 16);
  if (l < 0 || k < 0 || a < 0 || e < 0 || up < 0)
    return child_fail (err_fd, ST_FDS, -EMFILE);
  TRY (ST_FDS, wr_raw3 (__NR_dup3, e, 6, O_CLOEXEC));
  err_fd = 6;
  TRY (ST_FDS, wr_raw3 (__NR_dup3, l, 3, 0));
  TRY (ST_FDS, wr_raw3 (__NR_dup3, k, 4, 0));
  TRY (ST_FDS, wr_raw3 (__NR_dup3, a, 5, O_CLOEXEC));
  /* 7 = the upper dir (O_PATH), kept by the agent (--keep-fd) so the daemon
   * can reach this detached tmpfs with pidfd_getfd to pack the sandbox */
  TRY (ST_FDS, wr_raw3 (__NR_dup3, up, WR_AGENT_UPPER_FD, 0));
  if (c->cgroup_fd >= 0)
    {
      /* 8 = the sandbox's cgroup2 dir (delegated: the agent's execs get
       * their own child cgroups). Above 8 before the close_range. */
      long g = wr_raw3 (__NR_fcntl, c->cgroup_fd, F_DUPFD_CLOEXEC, 16);
      TRY (ST_FDS, g);
      TRY (ST_FDS, wr_raw3 (__NR_dup3, g, WR_AGENT_CGROUP_FD, 0));
    }
  TRY (ST_FDS, wr_raw3 (__NR_close_range, WR_AGENT_CGROUP_FD + 1, ~0U, 0));
  long nul = wr_raw3 (__NR_openat, AT_FDCWD, "/dev/null", O_RDWR);
  TRY (ST_FDS, nul);
  for (int i = 0; i < 3; i++)
    TRY (ST_FDS, wr_raw3 (__NR_dup3, nul, i, 0));
  wr_raw1 (__NR_close, nul);
  wr_raw1 (__NR_umask, 0);

  if (!c->net_host && c->sysfs_fd < 0) /* a pooled netns has loopback up */
    {
      long s = wr_raw3 (__NR_socket, AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      TRY (ST_NET, s);
      struct ifreq ifr;
      memset (&ifr, 0, sizeof ifr);
      memcpy (ifr.ifr_name, "lo", 3);
      ifr.ifr_flags = IFF_UP | IFF_RUNNING;
      TRY (ST_NET, wr_raw3 (__NR_ioctl, s, SIOCSIFFLAGS, &ifr));
      wr_raw1 (__NR_close, s);
    }

  TRY (ST_PIVOT, wr_raw2 (__NR_pivot_root, ".", "."));
  TRY (ST_PIVOT, wr_raw2 (__NR_umount2, ".", MNT_DETACH));
  TRY (ST_PIVOT, wr_raw1 (__NR_chdir, "/"));

  /* capabilities: bounding set first (needs CAP_SETPCAP, still held), then
   * permitted/effective/inheritable, ambient cleared */
  for (int cap = 0; cap <= c->cap_last; cap++)
    if (!(c->cap_keep >> cap & 1))
      TRY (ST_CAPS, wr_raw2 (__NR_prctl, PR_CAPBSET_DROP, cap));
  TRY (ST_CAPS, wr_raw5 (__NR_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0));
  struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
  struct __user_cap_data_struct data[2];
  for (int i = 0; i < 2; i++)
    {
      uint32_t m = (uint32_t)(c->cap_keep >> (32 * i));
      data[i].effective = data[i].permitted = data[i].inheritable = m;
    }
  TRY (ST_CAPS, wr_raw2 (__NR_capset, &hdr, data));

  /* signals: the daemon's handlers must never run here (shared memory); the
   * parent blocked everything before clone, reset dispositions, then unblock */
  struct
  {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
  } dfl = { SIG_DFL, 0, NULL, 0 };
  for (int sig = 1; sig <= 64; sig++)
    if (sig != SIGKILL && sig != SIGSTOP)
      wr_raw4 (__NR_rt_sigaction, sig, &dfl, NULL, 8);
  uint64_t empty = 0;
  wr_raw4 (__NR_rt_sigprocmask, SIG_SETMASK, &empty, NULL, 8);
  wr_raw1 (__NR_umask, 022);

  TRY (ST_SECCOMP, wr_raw5 (__NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
  TRY (ST_SECCOMP, wr_raw3 (__NR_prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, c->seccomp));
  long r = wr_raw5 (__NR_execveat, 5, "", c->argv, c->envp, AT_EMPTY_PATH);
  return child_fail (err_fd, ST_EXEC, r);
}

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
          struct child_ctx *ctx)
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
  pid = wr_clone3_run (ca, child_main, ctx);
#else
  (void)rt;
  (void)slot;
  /* no trampoline for this architecture: a COW child (slower, same code) */
  pid = syscall (__NR_clone3, ca, sizeof *ca);
  if (pid == 0)
    _exit (child_main (ctx));
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
  if (agent_addr (spec->state_dir, dirfd, &sa, &salen) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "state dir path too long");

  /* agent sockets: the listener is bound on the host (reconnect after a daemon
   * restart); the socketpair is the first connection, no accept round trip */
  _cleanup_close_ int lfd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0)
    return wr_sys_error (err, "socket");
  unlinkat (dirfd, AGENT_SOCK, 0);
  if (bind (lfd, (struct sockaddr *)&sa, salen) < 0)
    return wr_sys_error (err, "bind %s/" AGENT_SOCK, spec->state_dir);
  if (fchmodat (dirfd, AGENT_SOCK, 0600, 0) < 0 || listen (lfd, 16) < 0)
    {
      int r = wr_sys_error (err, "listen %s/" AGENT_SOCK, spec->state_dir);
      unlinkat (dirfd, AGENT_SOCK, 0);
      return r;
    }
  int sp[2];
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
    {
      int r = wr_sys_error (err, "socketpair");
      unlinkat (dirfd, AGENT_SOCK, 0);
      return r;
    }
  _cleanup_close_ int ours = sp[0], theirs = sp[1];
  int syncp[2], errp[2];
  /* a socket, not a pipe: send(MSG_NOSIGNAL) to a dead child must not SIGPIPE */
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, syncp) < 0)
    {
      unlinkat (dirfd, AGENT_SOCK, 0);
      return wr_sys_error (err, "pipe");
    }
  _cleanup_close_ int sync_r = syncp[0], sync_w = syncp[1];
  if (pipe2 (errp, O_CLOEXEC) < 0)
    {
      unlinkat (dirfd, AGENT_SOCK, 0);
      return wr_sys_error (err, "pipe");
    }
  _cleanup_close_ int err_r = errp[0], err_w = errp[1];

  int securebits = prctl (PR_GET_SECUREBITS, 0, 0, 0, 0);
  if (securebits < 0)
    {
      unlinkat (dirfd, AGENT_SOCK, 0);
      return wr_sys_error (err, "PR_GET_SECUREBITS");
    }
  uid_t base;
  int r = wr_uid_block_alloc (rt, spec->id, &base, err);
  if (r < 0)
    {
      unlinkat (dirfd, AGENT_SOCK, 0);
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
      unlinkat (dirfd, AGENT_SOCK, 0);
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
  struct child_ctx ctx = {
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
  pthread_once (&dev_template_once, dev_template_make);
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
  pthread_sigmask (SIG_SETMASK, &all, &old);
  if (pooled_netns >= 0)
    wr_netns_pool_enter (netns_pool, pooled_netns);
  long pid = clone_as (base, securebits, &ca, rt, slot, &ctx);
  if (pooled_netns >= 0)
    wr_netns_pool_leave (netns_pool);
  pthread_sigmask (SIG_SETMASK, &old, NULL);
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
    if (r == 0 && timens_len > 0)
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
  struct child_err ce = { 0, 0 };
  ssize_t got = 0;
  if (released)
    {
      got = wr_read_all (err_r, &ce, sizeof ce);
      if (got != 0)
        r = wr_error (
            err, got == (ssize_t)sizeof ce ? ce.errnum : EIO, WR_E_INTERNAL, "sandbox setup: %s",
            got == (ssize_t)sizeof ce && ce.step > 0 && ce.step < (int)WR_ARRAY_SIZE (step_names)
                ? step_names[ce.step]
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
  unlinkat (dirfd, AGENT_SOCK, 0);
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
  if (state_dir)
    {
      _cleanup_close_ int dfd = open (state_dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
      if (dfd >= 0 && unlinkat (dfd, AGENT_SOCK, 0) < 0 && errno != ENOENT && r == 0)
        r = wr_sys_error (err, "unlink %s/" AGENT_SOCK, state_dir);
    }
  return r;
}

int
wr_container_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uint64_t start_time,
                    const char *state_dir, struct wr_container *ret, wr_err_t *err)
{
  _cleanup_close_ int pidfd = -1, dirfd = -1;
  int r = wr_adopt_open ("sandbox", id, pid, start_time, state_dir, &pidfd, &dirfd, err);
  if (r < 0)
    return r;
  struct sockaddr_un sa;
  socklen_t salen;
  if (agent_addr (state_dir, dirfd, &sa, &salen) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "state dir path too long");
  _cleanup_close_ int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return wr_sys_error (err, "socket");
  if (connect (fd, (struct sockaddr *)&sa, salen) < 0 && errno != EINPROGRESS)
    return wr_error (err, errno, WR_E_UNAVAILABLE, "connect %s/" AGENT_SOCK, state_dir);
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

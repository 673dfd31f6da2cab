/* The sandbox child, from the parent's release to the agent (child.h):
 * namespaces, overlay root on a size-capped tmpfs upper, /proc, /dev, /sys,
 * pivot_root, dropped capabilities, seccomp. It runs either as the daemon's
 * CLONE_VM child (shares the daemon's memory while the daemon keeps running)
 * or as a child forked by the agent zygote: in both it only reads the
 * prepared ctx and uses raw syscalls (wr_raw*, no errno, no libc state). */
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>

#include "../common/util.h"
#include "child.h"
#include "container.h"
#include "syscalls.h"

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

void
wr_dev_template_make (void)
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
}

/* "/proc/self/fd/N" into path (at least 32 bytes); returns its length. */
static size_t
fd_path (char *path, int fd)
{
  char digits[12];
  int n = 0;
  do
    digits[n++] = (char)('0' + fd % 10);
  while ((fd /= 10) > 0 && n < 11);
  memcpy (path, "/proc/self/fd/", 14);
  size_t off = 14;
  while (n > 0)
    path[off++] = digits[--n];
  path[off] = 0;
  return off;
}

/* Bind `name` under the detached mount `fd` on dst; a bind makes no
 * superblock. A plain bind of the path through our fd first: the kernel
 * lets a bind copy from a detached mount, and no detached tree of our own is
 * made. The open_tree clone (older kernels refuse that bind) is an anonymous
 * mount namespace per call, and closing its fd waits for an expedited RCU
 * grace period: 12 per sandbox were ~4% of the daemon's create+destroy time
 * (perf). -EINVAL when the kernel refuses both. */
static long
c_bind_at (int fd, const char *name, const char *dst)
{
  char src[64];
  size_t lp = fd_path (src, fd), ln = strlen (name);
  if (lp + 1 + ln < sizeof src)
    {
      src[lp] = '/';
      memcpy (src + lp + 1, name, ln + 1);
      long r = wr_raw5 (__NR_mount, src, dst, NULL, MS_BIND, NULL);
      if (r != -EINVAL)
        return r;
    }
  long t = wr_raw3 (__NR_open_tree, fd, name, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (t < 0)
    return t;
  long r = wr_raw5 (__NR_move_mount, t, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH);
  wr_raw1 (__NR_close, t);
  return r;
}

/* Mount device node `name` of the template (or, where the kernel refuses to
 * copy from it, the host's) on dst. */
static long
c_dev_node (const char *name, const char *dst)
{
  if (dev_template_fd >= 0)
    {
      long r = c_bind_at (dev_template_fd, name, dst);
      if (r != -EINVAL)
        return r;
    }
  char src[32] = "/dev/";
  size_t len = strlen (name);
  if (len > sizeof src - 6)
    return -ENAMETOOLONG;
  memcpy (src + 5, name, len + 1);
  return wr_raw5 (__NR_mount, src, dst, NULL, MS_BIND, NULL);
}

/* A directory of the upper tmpfs (a sibling of the upper and work dirs,
 * outside what pack, fork and diff read) bound on dst with exactly the
 * flags `attr` (ro, nosuid, nodev, noexec as asked; the bind comes with the
 * tmpfs mount's nosuid,nodev). Where /dev and /dev/shm were tmpfs
 * superblocks of their own: each superblock costs every memory cgroup made
 * after it a shrinker slot, and every memory cgroup going offline a walk of
 * its list_lrus (docs/performance.md "Density"). */
static long
c_bind_upper_dir (int tm, const char *name, const char *dst, uint64_t attr)
{
  long r = c_bind_at (tm, name, dst);
  if (r < 0)
    return r;
  uint64_t all = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
  struct mount_attr a = { .attr_set = attr, .attr_clr = all & ~attr };
  return wr_raw5 (__NR_mount_setattr, AT_FDCWD, dst, 0, &a, sizeof a);
}

const char *const wr_child_step_names[WR_ST_N] = {
  "",
  "wait for parent",
  "enter time namespace",
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

static int
child_fail (int err_fd, int step, long r)
{
  struct wr_child_err e = { step, (int)-r };
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
  char path[32];
  fd_path (path, fd);
  return wr_raw5 (__NR_fsconfig, fsfd, FSCONFIG_SET_STRING, key, path, 0);
}

int
wr_child_setup (const struct wr_child_ctx *c)
{
  int err_fd = c->err_fd;
  char b;
  /* wait until the parent wrote our id maps, made our idmapped layer mounts
   * and joined the v1 cgroups */
  long n = wr_raw3 (__NR_read, c->sync_fd, &b, 1);
  if (n != 1)
    return child_fail (err_fd, WR_ST_SYNC, n < 0 ? n : -EPIPE);
  /* A child of the zygote never execs, and exec is where a CLONE_VM child
   * enters the time namespace clone made for it (a forked one enters it at
   * clone, before anyone could write its offsets): make it here, while we
   * have every capability in our user namespace (its owner) and fsuid is
   * still host root (/proc/self of a non-dumpable process is root's), set
   * its offsets and enter it. */
  if (c->timens_offsets)
    {
      TRY (WR_ST_TIMENS, wr_raw1 (__NR_unshare, CLONE_NEWTIME));
      long o
          = wr_raw4 (__NR_openat, AT_FDCWD, "/proc/self/timens_offsets", O_WRONLY | O_CLOEXEC, 0);
      TRY (WR_ST_TIMENS, o);
      size_t len = strlen (c->timens_offsets);
      long w = wr_raw3 (__NR_write, o, c->timens_offsets, len);
      wr_raw1 (__NR_close, o);
      TRY (WR_ST_TIMENS, w < 0 ? w : (size_t)w == len ? 0 : -EIO);
      long t = wr_raw4 (__NR_openat, AT_FDCWD, "/proc/self/ns/time_for_children",
                        O_RDONLY | O_CLOEXEC, 0);
      TRY (WR_ST_TIMENS, t);
      long s = wr_raw2 (__NR_setns, t, CLONE_NEWTIME);
      wr_raw1 (__NR_close, t);
      TRY (WR_ST_TIMENS, s);
    }
  /* Our mount namespace is made only now, so that it copies the idmapped
   * layer mounts the parent has just made for our uid block (they need our
   * user namespace, which clone created). A cgroup namespace rooted at the
   * sandbox's own cgroups: the one clone made is rooted where we were then:
   * the v2 group (CLONE_INTO_CGROUP), but the daemon's v1 groups, which the
   * parent has only now moved us out of; /proc/self/cgroup would show the
   * host's hierarchy and the daemon's group name. */
  TRY (WR_ST_CGROUPNS, wr_raw1 (__NR_unshare, CLONE_NEWNS | CLONE_NEWCGROUP));
  /* Open the layers and the mount point while our fsuid is still host root
   * (they live under the daemon's 0700 root). Paths are walked here, in our
   * own mount namespace, because overlayfs only accepts layers that are
   * mounts of the caller's namespace. */
  int lower_fds[WR_MAX_LAYERS];
  for (size_t i = 0; i < c->n_lower; i++)
    {
      long fd = wr_raw4 (__NR_openat, AT_FDCWD, c->lowers[i], O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
      TRY (WR_ST_OVERLAY, fd);
      lower_fds[i] = (int)fd;
    }
  long mnt_fd = wr_raw4 (__NR_openat, AT_FDCWD, c->mnt, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
  TRY (WR_ST_OVERLAY, mnt_fd);

  /* the parent's NO_SETUID_FIXUP must not reach the sandbox: a uid change
   * there has to drop capabilities as usual */
  TRY (WR_ST_IDS, wr_raw2 (__NR_prctl, PR_SET_SECUREBITS, c->securebits));
  TRY (WR_ST_IDS, wr_raw3 (__NR_setresgid, 0, 0, 0));
  /* drop the daemon's supplementary groups (host gid 0 would stay effective) */
  TRY (WR_ST_IDS, wr_raw2 (__NR_setgroups, 0, NULL));
  TRY (WR_ST_IDS, wr_raw3 (__NR_setresuid, 0, 0, 0));
  TRY (WR_ST_HOSTNAME, wr_raw2 (__NR_sethostname, c->hostname, c->hostname_len));

  /* root: a size-capped tmpfs upper and the overlay, both built as detached
   * mounts with the new mount API: every layer, the upper and the mount point
   * arrive as fds opened by the daemon, so no daemon-private path (0700) has
   * to be walked with the sandbox's unprivileged uid. */
  long t = wr_raw2 (__NR_fsopen, "tmpfs", FSOPEN_CLOEXEC);
  TRY (WR_ST_TMPFS, t);
  TRY (WR_ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_SET_STRING, "size", c->tmpfs_size, 0));
  TRY (WR_ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_SET_STRING, "mode", "0755", 0));
  TRY (WR_ST_TMPFS, wr_raw5 (__NR_fsconfig, t, FSCONFIG_CMD_CREATE, NULL, NULL, 0));
  long tm = wr_raw3 (__NR_fsmount, t, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
  TRY (WR_ST_TMPFS, tm);
  TRY (WR_ST_TMPFS, wr_raw3 (__NR_mkdirat, tm, "u", 0755));
  TRY (WR_ST_TMPFS, wr_raw3 (__NR_mkdirat, tm, "w", 0700));
  long u = wr_raw3 (__NR_openat, tm, "u", O_PATH | O_DIRECTORY | O_CLOEXEC);
  long w = wr_raw3 (__NR_openat, tm, "w", O_PATH | O_DIRECTORY | O_CLOEXEC);
  TRY (WR_ST_TMPFS, u);
  TRY (WR_ST_TMPFS, w);
  long o = wr_raw2 (__NR_fsopen, "overlay", FSOPEN_CLOEXEC);
  TRY (WR_ST_OVERLAY, o);
  for (size_t i = 0; i < c->n_lower; i++)
    TRY (WR_ST_OVERLAY, set_layer_fd_path (o, "lowerdir+", lower_fds[i]));
  TRY (WR_ST_OVERLAY, set_layer_fd_path (o, "upperdir", (int)u));
  TRY (WR_ST_OVERLAY, set_layer_fd_path (o, "workdir", (int)w));
  TRY (WR_ST_OVERLAY, wr_raw5 (__NR_fsconfig, o, FSCONFIG_SET_FLAG, "userxattr", NULL, 0));
  TRY (WR_ST_OVERLAY, wr_raw5 (__NR_fsconfig, o, FSCONFIG_CMD_CREATE, NULL, NULL, 0));
  long om = wr_raw3 (__NR_fsmount, o, FSMOUNT_CLOEXEC, 0);
  TRY (WR_ST_OVERLAY, om);
  TRY (WR_ST_OVERLAY, wr_raw5 (__NR_move_mount, om, "", mnt_fd, "",
                               MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH));
  TRY (WR_ST_OVERLAY, wr_raw1 (__NR_fchdir, om));

  /* /proc, /dev, /sys before the fds are arranged: the device nodes are
   * cloned from dev_template_fd, which close_range would close */
  wr_raw1 (__NR_umask, 0);
  TRY (WR_ST_PROC, c_mkdir ("proc", 0555));
  TRY (WR_ST_PROC, c_mount ("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  TRY (WR_ST_PROC, c_mount ("proc/sys", "proc/sys", NULL, MS_BIND, NULL));
  TRY (WR_ST_PROC,
       c_mount (NULL, "proc/sys", NULL,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  for (size_t i = 0; i < WR_ARRAY_SIZE (proc_masks); i++)
    {
      long r = c_dev_node ("null", proc_masks[i]);
      if (r < 0 && r != -ENOENT)
        return child_fail (err_fd, WR_ST_PROC, r);
    }

  /* /dev and /dev/shm: directories of the upper tmpfs, under its size cap */
  TRY (WR_ST_DEV, wr_raw3 (__NR_mkdirat, tm, WR_CHILD_DEV_DIR, 0755));
  TRY (WR_ST_DEV, wr_raw3 (__NR_mkdirat, tm, WR_CHILD_SHM_DIR, 01777));
  TRY (WR_ST_DEV, c_mkdir ("dev", 0755));
  TRY (WR_ST_DEV,
       c_bind_upper_dir ((int)tm, WR_CHILD_DEV_DIR, "dev", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC));
  {
    char path[32] = "dev/";
    for (size_t i = 0; i < WR_ARRAY_SIZE (dev_nodes); i++)
      {
        size_t len = strlen (dev_nodes[i].name);
        memcpy (path + 4, dev_nodes[i].name, len + 1);
        TRY (WR_ST_DEV, wr_raw4 (__NR_mknodat, AT_FDCWD, path, S_IFREG | 0666, 0));
        TRY (WR_ST_DEV, c_dev_node (dev_nodes[i].name, path));
      }
  }
  TRY (WR_ST_DEV, wr_raw3 (__NR_mkdirat, AT_FDCWD, "dev/pts", 0755));
  TRY (WR_ST_DEV, c_mount ("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                           "newinstance,ptmxmode=0666,mode=0620"));
  TRY (WR_ST_DEV, wr_raw3 (__NR_symlinkat, "pts/ptmx", AT_FDCWD, "dev/ptmx"));
  TRY (WR_ST_DEV, wr_raw3 (__NR_mkdirat, AT_FDCWD, "dev/shm", 01777));
  TRY (WR_ST_DEV, c_bind_upper_dir ((int)tm, WR_CHILD_SHM_DIR, "dev/shm",
                                    MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC));
  TRY (WR_ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd", AT_FDCWD, "dev/fd"));
  TRY (WR_ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/0", AT_FDCWD, "dev/stdin"));
  TRY (WR_ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/1", AT_FDCWD, "dev/stdout"));
  TRY (WR_ST_DEV, wr_raw3 (__NR_symlinkat, "/proc/self/fd/2", AT_FDCWD, "dev/stderr"));

  TRY (WR_ST_SYS, c_mkdir ("sys", 0555));
  if (c->sysfs_fd >= 0) /* pooled netns: we may not mount its sysfs, the pool did */
    TRY (WR_ST_SYS,
         wr_raw5 (__NR_move_mount, c->sysfs_fd, "", AT_FDCWD, "sys", MOVE_MOUNT_F_EMPTY_PATH));
  else if (!c->net_host)
    TRY (WR_ST_SYS,
         c_mount ("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
  else
    {
      /* sysfs of a netns we do not own cannot be mounted: read-only rbind */
      TRY (WR_ST_SYS, c_mount ("/sys", "sys", NULL, MS_BIND | MS_REC, NULL));
      struct mount_attr ro = { .attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                                           | MOUNT_ATTR_NOEXEC };
      TRY (WR_ST_SYS, wr_raw5 (__NR_mount_setattr, AT_FDCWD, "sys", AT_RECURSIVE, &ro, sizeof ro));
      /* the host's cgroup trees came with the bind (every sandbox's groups
       * and stats): cover them, as a fresh sysfs has nothing there either.
       * The bind must be recursive: its submounts are locked to us. */
      TRY (WR_ST_SYS, wr_raw3 (__NR_mkdirat, tm, WR_CHILD_EMPTY_DIR, 0555));
      long r = c_bind_upper_dir ((int)tm, WR_CHILD_EMPTY_DIR, "sys/fs/cgroup",
                                 MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                                     | MOUNT_ATTR_NOEXEC);
      if (r < 0 && r != -ENOENT)
        return child_fail (err_fd, WR_ST_SYS, r);
    }
  {
    long r = wr_raw3 (__NR_mkdirat, AT_FDCWD, "tmp", 01777);
    if (r < 0 && r != -EEXIST)
      return child_fail (err_fd, WR_ST_SYS, r);
  }

  /* fds: 3 = listen, 4 = conn, 5 = agent binary (cloexec), 6 = error pipe */
  long l = wr_raw3 (__NR_fcntl, c->listen_fd, F_DUPFD_CLOEXEC, 16);
  long k = wr_raw3 (__NR_fcntl, c->conn_fd, F_DUPFD_CLOEXEC, 16);
  /* no agent binary (zygote child): fd 5 stays closed */
  long a = c->agent_fd >= 0 ? wr_raw3 (__NR_fcntl, c->agent_fd, F_DUPFD_CLOEXEC, 16) : 0;
  long e = wr_raw3 (__NR_fcntl, err_fd, F_DUPFD_CLOEXEC, 16);
  long up = wr_raw3 (__NR_fcntl, u, F_DUPFD_CLOEXEC, 16);
  if (l < 0 || k < 0 || a < 0 || e < 0 || up < 0)
    return child_fail (err_fd, WR_ST_FDS, -EMFILE);
  TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, e, WR_CHILD_ERR_FD, O_CLOEXEC));
  err_fd = WR_CHILD_ERR_FD;
  TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, l, 3, 0));
  TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, k, 4, 0));
  if (c->agent_fd >= 0)
    TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, a, 5, O_CLOEXEC));
  else
    wr_raw1 (__NR_close, 5);
  /* 7 = the upper dir (O_PATH), kept by the agent (--keep-fd) so the daemon
   * can reach this detached tmpfs with pidfd_getfd to pack the sandbox */
  TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, up, WR_AGENT_UPPER_FD, 0));
  if (c->cgroup_fd >= 0)
    {
      /* 8 = the sandbox's cgroup2 dir (delegated: the agent's execs get
       * their own child cgroups). Above 8 before the close_range. */
      long g = wr_raw3 (__NR_fcntl, c->cgroup_fd, F_DUPFD_CLOEXEC, 16);
      TRY (WR_ST_FDS, g);
      TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, g, WR_AGENT_CGROUP_FD, 0));
    }
  else
    wr_raw1 (__NR_close, WR_AGENT_CGROUP_FD); /* nothing of the zygote's may stay there */
  TRY (WR_ST_FDS, wr_raw3 (__NR_close_range, WR_AGENT_CGROUP_FD + 1, ~0U, 0));
  long nul = wr_raw3 (__NR_openat, AT_FDCWD, "/dev/null", O_RDWR);
  TRY (WR_ST_FDS, nul);
  for (int i = 0; i < 3; i++)
    TRY (WR_ST_FDS, wr_raw3 (__NR_dup3, nul, i, 0));
  wr_raw1 (__NR_close, nul);
  wr_raw1 (__NR_umask, 0);

  if (!c->net_host && c->sysfs_fd < 0) /* a pooled netns has loopback up */
    {
      long s = wr_raw3 (__NR_socket, AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      TRY (WR_ST_NET, s);
      struct ifreq ifr;
      memset (&ifr, 0, sizeof ifr);
      memcpy (ifr.ifr_name, "lo", 3);
      ifr.ifr_flags = IFF_UP | IFF_RUNNING;
      TRY (WR_ST_NET, wr_raw3 (__NR_ioctl, s, SIOCSIFFLAGS, &ifr));
      wr_raw1 (__NR_close, s);
    }

  TRY (WR_ST_PIVOT, wr_raw2 (__NR_pivot_root, ".", "."));
  TRY (WR_ST_PIVOT, wr_raw2 (__NR_umount2, ".", MNT_DETACH));
  TRY (WR_ST_PIVOT, wr_raw1 (__NR_chdir, "/"));

  /* capabilities: bounding set first (needs CAP_SETPCAP, still held), then
   * permitted/effective/inheritable, ambient cleared */
  for (int cap = 0; cap <= c->cap_last; cap++)
    if (!(c->cap_keep >> cap & 1))
      TRY (WR_ST_CAPS, wr_raw2 (__NR_prctl, PR_CAPBSET_DROP, cap));
  TRY (WR_ST_CAPS, wr_raw5 (__NR_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0));
  struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
  struct __user_cap_data_struct data[2];
  for (int i = 0; i < 2; i++)
    {
      uint32_t m = (uint32_t)(c->cap_keep >> (32 * i));
      data[i].effective = data[i].permitted = data[i].inheritable = m;
    }
  TRY (WR_ST_CAPS, wr_raw2 (__NR_capset, &hdr, data));

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

  TRY (WR_ST_SECCOMP, wr_raw5 (__NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
  TRY (WR_ST_SECCOMP, wr_raw3 (__NR_prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, c->seccomp));
  return 0;
}

int
wr_child_main (void *arg)
{
  const struct wr_child_ctx *c = arg;
  int r = wr_child_setup (c);
  if (r != 0)
    return r;
  long e = wr_raw5 (__NR_execveat, 5, "", c->argv, c->envp, AT_EMPTY_PATH);
  return child_fail (WR_CHILD_ERR_FD, WR_ST_EXEC, e);
}

/* Confined unpacking: archives from outside are parsed by an unprivileged
 * helper, never by the root daemon (docs/images.md, "Confined unpacking").
 *
 * The daemon forks a helper that enters a new user namespace mapping ids
 * 0-65535 to a host range used by nothing else (WARREN_UNPACK_UID_BASE), plus
 * new mount, network, IPC and UTS namespaces. Inside, it is root over that
 * range only: on the host it owns nothing but the staging directory handed
 * to it, and has no capability. It forks the extractor, which chroots into
 * the staging directory, drops to a seccomp allow-list of file system calls
 * and reads the archive from a socket the daemon feeds (and hashes: the
 * digest is the daemon's own, whatever the helper says). The helper then
 * runs mkfs.erofs in the same namespace, so the image records the archive's
 * own ids. The daemon only chowns the finished image back to root and moves
 * it into the store. */
#include "internal.h"

#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "../backend/syscalls.h"
#include "../common/util.h"
#include "sha256.h"

#define HELPER_IDS 65536u
#define HELPER_BASE_DEFAULT 0x70000000u

/* What the extractor reports; everything in it is untrusted. */
struct reply
{
  int r;
  int errnum;
  char code[32];
  char msg[512];
  struct wr_extract_stats stats;
};

/* fd slots in the helper */
enum
{
  FD_IN = 3,    /* archive bytes, from the daemon */
  FD_ROOT = 4,  /* staging directory */
  FD_REPLY = 5, /* struct reply */
  FD_ERR = 6,   /* mkfs.erofs stderr */
  FD_OUT = 7,   /* image file, or -1 */
  FD_SYNC = 8,  /* 'u' when the id maps are written */
  FD_READY = 9, /* 'n' when the namespaces exist */
  FD_COUNT = 7,
};

uint32_t
wr_unpack_uid_base (void)
{
  const char *v = getenv ("WARREN_UNPACK_UID_BASE");
  char *end;
  unsigned long long b = v ? strtoull (v, &end, 10) : 0;
  if (v == NULL || *end || b == 0 || b + HELPER_IDS > UINT32_MAX)
    return HELPER_BASE_DEFAULT;
  return (uint32_t)b;
}

static int
confine_syscalls (void)
{
  /* what extraction (libarchive, the writer in extract.c, malloc) needs;
   * anything else kills the extractor */
  static const int allowed[]
      = { SCMP_SYS (read),
          SCMP_SYS (write),
          SCMP_SYS (pwrite64),
          SCMP_SYS (readv),
          SCMP_SYS (writev),
          SCMP_SYS (lseek),
          SCMP_SYS (openat),
          SCMP_SYS (close),
          SCMP_SYS (fstat),
          SCMP_SYS (newfstatat),
          SCMP_SYS (statx),
          SCMP_SYS (mkdirat),
          SCMP_SYS (mknodat),
          SCMP_SYS (symlinkat),
          SCMP_SYS (linkat),
          SCMP_SYS (unlinkat),
          SCMP_SYS (fchown),
          SCMP_SYS (fchownat),
          SCMP_SYS (fchmod),
          SCMP_SYS (fchmodat),
          SCMP_SYS (fsetxattr),
          SCMP_SYS (utimensat),
          SCMP_SYS (ftruncate),
          SCMP_SYS (getdents64),
          SCMP_SYS (fcntl),
          SCMP_SYS (mmap),
          SCMP_SYS (munmap),
          SCMP_SYS (mremap),
          SCMP_SYS (brk),
          SCMP_SYS (madvise),
          SCMP_SYS (mprotect),
          SCMP_SYS (exit),
          SCMP_SYS (exit_group),
          SCMP_SYS (rt_sigreturn),
          SCMP_SYS (futex),
          SCMP_SYS (clock_gettime),
          SCMP_SYS (gettid),
          SCMP_SYS (getpid),
          SCMP_SYS (getrandom),
          SCMP_SYS (recvfrom),
          SCMP_SYS (sendto),
          SCMP_SYS (rt_sigprocmask),
          SCMP_SYS (sched_yield),
          SCMP_SYS (getuid),
          SCMP_SYS (geteuid),
          SCMP_SYS (getgid),
          SCMP_SYS (getegid),
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
          /* the sanitizer runtime (make SAN=1) asks for its signal stack */
          SCMP_SYS (sigaltstack),
#endif
        };
  scmp_filter_ctx ctx = seccomp_init (SCMP_ACT_KILL_PROCESS);
  if (ctx == NULL)
    return -ENOMEM;
  int r = 0;
  for (size_t i = 0; i < WR_ARRAY_SIZE (allowed) && r == 0; i++)
    if (allowed[i] >= 0)
      r = seccomp_rule_add (ctx, SCMP_ACT_ALLOW, allowed[i], 0);
  if (r == 0)
    r = seccomp_load (ctx);
  seccomp_release (ctx);
  return r;
}

/* The extractor: chrooted into the staging dir, seccomp-confined. */
static void __attribute__ ((noreturn))
extractor (unsigned flags, const struct wr_extract_limits *lim)
{
  struct reply rep = { 0 };
  wr_err_t err = { 0 };
  /* one file can be no larger than the layer may be */
  struct rlimit fsz = { lim->max_bytes ? lim->max_bytes : RLIM_INFINITY,
                        lim->max_bytes ? lim->max_bytes : RLIM_INFINITY };
  struct rlimit nofile = { 64, 64 };
  signal (SIGXFSZ, SIG_IGN);
  if (fchdir (FD_ROOT) < 0 || chroot (".") < 0 || setrlimit (RLIMIT_FSIZE, &fsz) < 0
      || setrlimit (RLIMIT_NOFILE, &nofile) < 0 || prctl (PR_SET_DUMPABLE, 0) < 0
      || prctl (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || confine_syscalls () < 0)
    rep.r = wr_sys_error (&err, "confine the unpack helper");
  else if (flags & WR_UNPACK_SELFTEST)
    {
      int fd = open ("/proc/self/status", O_RDONLY);
      if (fd >= 0)
        rep.r = wr_error (&err, 0, WR_E_INTERNAL, "the helper sees the host's /proc");
      else if (socket (AF_INET, SOCK_STREAM, 0) >= 0 || errno != ENOSYS)
        rep.r = wr_error (&err, 0, WR_E_INTERNAL, "the helper may create sockets");
    }
  else if (flags & WR_UNPACK_PROBE)
    rep.stats.image_archive = wr_tar_is_image_archive (FD_IN, lim);
  else if (flags & WR_UNPACK_DIFF_ID)
    rep.r = wr_tar_sha256 (FD_IN, lim, rep.stats.uncompressed, &err);
  else
    rep.r = wr_tar_extract_ex (FD_IN, FD_ROOT, flags, lim, &rep.stats, &err);
  if (rep.r < 0)
    {
      rep.errnum = err.errnum;
      snprintf (rep.code, sizeof rep.code, "%s", err.code ? err.code : WR_E_INTERNAL);
      snprintf (rep.msg, sizeof rep.msg, "%s", err.msg);
    }
  wr_write_all (FD_REPLY, &rep, sizeof rep);
  _exit (rep.r < 0 ? 1 : 0);
}

/* Exec mkfs.erofs on the tree at /tmp of our mount namespace, writing
 * FD_OUT: it sees the ids of our user namespace, the tree's own. */
static void __attribute__ ((noreturn)) run_mkfs (void)
{
  static char *const envp[] = { "PATH=" WR_DEFAULT_PATH, "LC_ALL=C", NULL };
  char out[32];
  snprintf (out, sizeof out, "/proc/self/fd/%d", FD_OUT);
  char *const argv[] = {
    "mkfs.erofs", "--quiet", "--preserve-mtime", "-U", "00000000-0000-0000-0000-000000000000", out,
    "/tmp",       NULL
  };
  if (chdir ("/") < 0 || dup2 (FD_ERR, 2) < 0)
    _exit (4);
  execvpe (argv[0], argv, envp);
  _exit (5);
}

/* The one byte of the sync socket, and the fd that may come with it. */
static ssize_t
recv_fd (int sock, char *c, int *ret_fd)
{
  union
  {
    struct cmsghdr h;
    char buf[CMSG_SPACE (sizeof (int))];
  } u;
  struct iovec iov = { c, 1 };
  struct msghdr m
      = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
  ssize_t n = recvmsg (sock, &m, MSG_CMSG_CLOEXEC);
  struct cmsghdr *h = n == 1 ? CMSG_FIRSTHDR (&m) : NULL;
  if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
    memcpy (ret_fd, CMSG_DATA (h), sizeof (int));
  return n;
}

/* The helper: namespaces, ids, then the extractor and mkfs.erofs. It is the
 * daemon's own binary run afresh (unpack_entry): the fork of a threaded
 * process only shuffles descriptors and execs, since another thread may
 * have held an allocator or library lock at the fork. */
static void __attribute__ ((noreturn)) helper (unsigned flags, const struct wr_extract_limits *lim)
{
  char c;
  prctl (PR_SET_PDEATHSIG, SIGKILL);
  /* nothing of the daemon's: not even its log */
  int devnull = open ("/dev/null", O_RDWR);
  if (devnull < 0 || dup2 (devnull, 0) < 0 || dup2 (devnull, 1) < 0 || dup2 (devnull, 2) < 0)
    _exit (2);
  close (devnull);
  bool mkfs_only = flags & WR_UNPACK_MKFS;
  /* the cwd follows into the new mount namespace (an fd stays in the old
   * one): mkfs.erofs needs the tree there */
  if (!mkfs_only && fchdir (FD_ROOT) < 0)
    _exit (2);
  int tree = -1;
  if (unshare (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) < 0
      || write (FD_READY, "n", 1) != 1 || recv_fd (FD_SYNC, &c, &tree) != 1
      || setresgid (0, 0, 0) < 0 || setresuid (0, 0, 0) < 0)
    _exit (2);
  close (FD_READY);
  close (FD_SYNC);
  if (mkfs_only)
    {
      /* the daemon's idmapped, read-only clone of the tree: ours to attach
       * in our own mount namespace, where ids are the tree's own */
      struct reply rep = { 0 };
      wr_write_all (FD_REPLY, &rep, sizeof rep);
      close (FD_REPLY);
      close (FD_IN);
      if (tree < 0 || wr_sys_move_mount (tree, "", AT_FDCWD, "/tmp", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        {
          dprintf (FD_ERR, "attach the tree: %s", strerror (tree < 0 ? EBADF : errno));
          _exit (4);
        }
      close (tree);
      run_mkfs ();
    }
  pid_t pid = fork ();
  if (pid < 0)
    _exit (2);
  if (pid == 0)
    {
      prctl (PR_SET_PDEATHSIG, SIGKILL);
      close (FD_ERR);
      if (fcntl (FD_OUT, F_GETFD) >= 0)
        close (FD_OUT);
      extractor (flags, lim);
    }
  close (FD_IN);
  close (FD_REPLY);
  int status;
  while (waitpid (pid, &status, 0) < 0)
    if (errno != EINTR)
      _exit (2);
  if (WIFSIGNALED (status))
    _exit (100 + WTERMSIG (status));
  if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    _exit (3);
  if (fcntl (FD_OUT, F_GETFD) < 0)
    _exit (0); /* extraction only */
  /* mkfs.erofs opens the tree by path, and the daemon's root is not ours
   * to traverse: show the staging directory at /tmp of our mount
   * namespace (nothing propagates back to the daemon's) */
  if (mount (".", "/tmp", NULL, MS_BIND | MS_REC, NULL) < 0)
    _exit (4);
  close (FD_ROOT);
  run_mkfs ();
}

#define HELPER_ENV "WARREN_UNPACK_HELPER"

/* Before main, in every binary that can start the helper: if this process
 * is one, be it. The variable is only ever set in the helper's otherwise
 * empty environment; without the descriptors it expects it fails at once. */
__attribute__ ((constructor)) static void
unpack_entry (void)
{
  const char *v = getenv (HELPER_ENV);
  if (v == NULL)
    return;
  unsigned flags;
  struct wr_extract_limits lim = { 0 };
  if (sscanf (v, "%u,%" SCNu64 ",%" SCNu64 ",%" SCNu32 ",%" SCNu64, &flags, &lim.max_bytes,
              &lim.max_entries, &lim.max_ratio, &lim.ratio_grace)
      != 5)
    _exit (2);
  helper (flags, &lim);
}

static void
close_pair (int p[2])
{
  for (int i = 0; i < 2; i++)
    if (p[i] >= 0)
      close (p[i]);
}

/* Feed src (from its start) to sock, hashing what was sent. */
static int
feed (int src, int sock, char hex[65])
{
  struct wr_sha256 h;
  wr_sha256_init (&h);
  char buf[1 << 16];
  off_t off = 0;
  int r = 0;
  for (;;)
    {
      ssize_t n = pread (src, buf, sizeof buf, off);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        {
          r = -errno;
          break;
        }
      if (n == 0)
        break;
      wr_sha256_update (&h, buf, (size_t)n);
      off += n;
      for (ssize_t done = 0; done < n;)
        {
          ssize_t w = send (sock, buf + done, (size_t)(n - done), MSG_NOSIGNAL);
          if (w < 0 && errno == EINTR)
            continue;
          if (w < 0)
            return 1; /* the extractor stopped reading: its reply says why */
          done += w;
        }
    }
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, hex);
  return r;
}

const char *
wr_unpack_code (const char *c)
{
  static const char *const codes[] = { WR_E_INVALID,  WR_E_TOO_LARGE, WR_E_EXHAUSTED,
                                       WR_E_INTERNAL, WR_E_NOT_FOUND, WR_E_UNSUPPORTED };
  for (size_t i = 0; i < WR_ARRAY_SIZE (codes); i++)
    if (strcmp (c, codes[i]) == 0)
      return codes[i];
  return WR_E_INTERNAL;
}

/* The same work in this process (fuzzing: wr_store_set_unpack_in_process). */
static int
unpack_here (int src, int root_dfd, int out_fd, unsigned flags, const struct wr_extract_limits *lim,
             struct wr_extract_stats *stats, wr_err_t *err)
{
  if (flags & WR_UNPACK_PROBE)
    {
      stats->image_archive = wr_tar_is_image_archive (src, lim);
      return 0;
    }
  if (flags & WR_UNPACK_DIFF_ID)
    return wr_tar_sha256 (src, lim, stats->uncompressed, err);
  if (lseek (src, 0, SEEK_SET) < 0)
    return wr_sys_error (err, "seek");
  int r = wr_tar_extract_ex (src, root_dfd, flags & WR_EXTRACT_OCI_WHITEOUTS, lim, stats, err);
  if (r < 0 || out_fd < 0)
    return r;
  char tree[64], out[64];
  snprintf (tree, sizeof tree, "/proc/self/fd/%d", root_dfd);
  snprintf (out, sizeof out, "/proc/self/fd/%d", out_fd);
  return wr_erofs_build_here (tree, out, err);
}

/* A detached, read-only clone of the tree at tree_dfd whose ids are
 * shifted into the helper's range (the helper's user namespace pid's), so
 * that inside the helper they read as the tree's own. */
static int
idmapped_tree (int tree_dfd, pid_t pid, wr_err_t *err)
{
  char ns[64];
  snprintf (ns, sizeof ns, "/proc/%d/ns/user", (int)pid);
  _cleanup_close_ int userns = open (ns, O_RDONLY | O_CLOEXEC);
  if (userns < 0)
    return wr_sys_error (err, "open %s", ns);
  _cleanup_close_ int t = wr_sys_open_tree (
      tree_dfd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE | AT_EMPTY_PATH);
  if (t < 0)
    return wr_sys_error (err, "clone the tree for mkfs.erofs");
  struct mount_attr attr = { .attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID
                                         | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
                             .userns_fd = (uint64_t)userns };
  if (wr_sys_mount_setattr (t, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0)
    return wr_error (err, errno, errno == EINVAL ? WR_E_UNSUPPORTED : WR_E_INTERNAL,
                     "idmap the tree for the unprivileged mkfs.erofs (its file system needs "
                     "idmapped mounts; import a tarball of it instead)");
  return TAKE_FD (t);
}

/* The sync byte, with fd (if >= 0) attached. */
static ssize_t
send_fd (int sock, int fd)
{
  union
  {
    struct cmsghdr h;
    char buf[CMSG_SPACE (sizeof (int))];
  } u;
  struct iovec iov = { "u", 1 };
  struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };
  if (fd >= 0)
    {
      memset (&u, 0, sizeof u);
      m.msg_control = u.buf;
      m.msg_controllen = sizeof u.buf;
      struct cmsghdr *h = CMSG_FIRSTHDR (&m);
      h->cmsg_level = SOL_SOCKET;
      h->cmsg_type = SCM_RIGHTS;
      h->cmsg_len = CMSG_LEN (sizeof (int));
      memcpy (CMSG_DATA (h), &fd, sizeof (int));
    }
  return sendmsg (sock, &m, MSG_NOSIGNAL);
}

static int confined (int src, int root_dfd, int tree_dfd, int out_fd, unsigned flags,
                     const struct wr_extract_limits *lim, struct wr_extract_stats *stats,
                     wr_err_t *err);

int
wr_unpack (int src, int root_dfd, int out_fd, unsigned flags, const struct wr_extract_limits *lim,
           struct wr_extract_stats *stats, wr_err_t *err)
{
  memset (stats, 0, sizeof *stats);
  if (lim == NULL)
    lim = &wr_extract_defaults;
  if (lim->in_process)
    return unpack_here (src, root_dfd, out_fd, flags, lim, stats, err);
  return confined (src, root_dfd, -1, out_fd, flags & ~WR_UNPACK_MKFS, lim, stats, err);
}

int
wr_unpack_mkfs (int tree_dfd, int out_fd, wr_err_t *err)
{
  struct wr_extract_stats stats;
  memset (&stats, 0, sizeof stats);
  return confined (-1, -1, tree_dfd, out_fd, WR_UNPACK_MKFS, &wr_extract_defaults, &stats, err);
}

static int
confined (int src, int root_dfd, int tree_dfd, int out_fd, unsigned flags,
          const struct wr_extract_limits *lim, struct wr_extract_stats *stats, wr_err_t *err)
{
  uint32_t base = wr_unpack_uid_base ();
  /* the helper owns its staging directory and the image it writes, nothing
   * else */
  if ((root_dfd >= 0 && fchown (root_dfd, base, base) < 0)
      || (out_fd >= 0 && fchown (out_fd, base, base) < 0))
    return wr_sys_error (err, "hand the staging directory to the unpack helper");
  _cleanup_close_ int tree = -1;
  int in[2] = { -1, -1 }, reply[2] = { -1, -1 }, errp[2] = { -1, -1 }, sync[2] = { -1, -1 },
      ready[2] = { -1, -1 };
  int r = 0;
  /* sockets where we write: a helper gone early is EPIPE, not SIGPIPE */
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) < 0 || pipe2 (reply, O_CLOEXEC) < 0
      || pipe2 (errp, O_CLOEXEC) < 0
      || socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sync) < 0
      || pipe2 (ready, O_CLOEXEC) < 0)
    {
      r = wr_sys_error (err, "unpack helper pipes");
      goto out;
    }
  char env[192];
  snprintf (env, sizeof env, HELPER_ENV "=%u,%" PRIu64 ",%" PRIu64 ",%" PRIu32 ",%" PRIu64, flags,
            lim->max_bytes, lim->max_entries, lim->max_ratio, lim->ratio_grace);
  char *const hargv[] = { (char *)"warren-unpack", NULL }, *const henv[] = { env, NULL };
  pid_t pid = fork ();
  if (pid < 0)
    {
      r = wr_sys_error (err, "fork the unpack helper");
      goto out;
    }
  if (pid == 0)
    {
      /* fixed slots; everything else the daemon has open goes */
      int want[FD_COUNT] = { in[1], root_dfd, reply[1], errp[1], out_fd, sync[0], ready[1] };
      int tmp[FD_COUNT];
      for (int i = 0; i < FD_COUNT; i++)
        tmp[i] = want[i] >= 0 ? fcntl (want[i], F_DUPFD, 3 + FD_COUNT) : -1;
      for (int i = 0; i < FD_COUNT; i++)
        if (tmp[i] >= 0 ? dup2 (tmp[i], 3 + i) < 0 : (close (3 + i), 0))
          _exit (2);
      close_range (3 + FD_COUNT, ~0u, 0);
      prctl (PR_SET_PDEATHSIG, SIGKILL);
      execve ("/proc/self/exe", hargv, henv);
      _exit (5);
    }
  close (in[1]);
  close (reply[1]);
  close (errp[1]);
  close (sync[0]);
  close (ready[1]);
  in[1] = reply[1] = errp[1] = sync[0] = ready[1] = -1;
  char c, path[64], map[64];
  snprintf (map, sizeof map, "0 %u %u\n", base, HELPER_IDS);
  bool mapped = read (ready[0], &c, 1) == 1;
  static const char *const files[] = { "uid_map", "setgroups", "gid_map" };
  for (size_t i = 0; mapped && i < WR_ARRAY_SIZE (files); i++)
    {
      snprintf (path, sizeof path, "/proc/%d/%s", (int)pid, files[i]);
      mapped = wr_write_file_at (AT_FDCWD, path, i == 1 ? "deny" : map) == 0;
    }
  if (mapped && tree_dfd >= 0)
    {
      tree = idmapped_tree (tree_dfd, pid, err);
      if (tree < 0)
        {
          r = tree;
          mapped = false;
        }
    }
  if (mapped && send_fd (sync[1], tree) == 1)
    {
      int fr = src >= 0 ? feed (src, in[0], stats->source) : 0;
      if (fr < 0)
        r = wr_error (err, -fr, WR_E_INTERNAL, "read the archive");
    }
  else if (r == 0)
    r = wr_error (err, errno, WR_E_UNSUPPORTED,
                  "cannot start the unpack helper (user namespaces unavailable?)");
  close (in[0]);
  in[0] = -1;
  close (sync[1]);
  sync[1] = -1;
  struct reply rep = { .r = -1 };
  bool have = wr_read_all (reply[0], &rep, sizeof rep) == (ssize_t)sizeof rep;
  char errbuf[512];
  wr_read_tail (errp[0], errbuf, sizeof errbuf);
  int status;
  while (waitpid (pid, &status, 0) < 0)
    if (errno != EINTR)
      {
        status = -1;
        break;
      }
  if (r < 0)
    goto out;
  if (have && rep.r < 0)
    {
      rep.code[sizeof rep.code - 1] = '\0';
      rep.msg[sizeof rep.msg - 1] = '\0';
      r = wr_error (err, rep.errnum > 0 && rep.errnum < 4096 ? rep.errnum : 0,
                    wr_unpack_code (rep.code), "%s", rep.msg);
      /* wr_error appended strerror again: keep the helper's text */
      if (err)
        snprintf (err->msg, sizeof err->msg, "%s", rep.msg);
      goto out;
    }
  if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    {
      int code = WIFEXITED (status) ? WEXITSTATUS (status) : -1;
      int e = strstr (errbuf, "No space") ? ENOSPC : 0;
      if (code > 100)
        r = wr_error (err, 0, WR_E_INVALID, "the unpack helper was killed by signal %d%s",
                      code - 100,
                      code - 100 == SIGSYS ? " (a call outside its seccomp filter)" : "");
      else if (code == 3 || !have)
        r = wr_error (err, 0, WR_E_INTERNAL, "the unpack helper failed (status %d)", code);
      else if ((flags & WR_UNPACK_MKFS) && strstr (errbuf, "Permission denied"))
        r = wr_error (err, EACCES, WR_E_INVALID,
                      "mkfs.erofs, run unprivileged, cannot read part of the tree: a file of "
                      "an id outside 0-65535 (what a sandbox can hold) that is not "
                      "world-readable? (%s)",
                      errbuf);
      else
        r = wr_error (err, e, e ? WR_E_EXHAUSTED : WR_E_INTERNAL, "mkfs.erofs failed (%d): %s",
                      code, errbuf[0] ? errbuf : "no message");
      goto out;
    }
  /* the helper's numbers are only counts and hints; the digest is ours */
  rep.stats.uncompressed[64] = '\0';
  char source[65];
  memcpy (source, stats->source, sizeof source);
  *stats = rep.stats;
  memcpy (stats->source, source, sizeof source);
  if (out_fd >= 0 && (fchown (out_fd, 0, 0) < 0 || fchmod (out_fd, 0600) < 0))
    r = wr_sys_error (err, "take back the image");
out:
  close_pair (in);
  close_pair (reply);
  close_pair (errp);
  close_pair (sync);
  close_pair (ready);
  return r;
}

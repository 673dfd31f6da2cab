/* QEMU's jail (jail.h, docs/vm.md "Jail"). wr_jail_enter and wr_jail_pump
 * run in a child forked from the threaded daemon: raw syscalls and stack
 * buffers only, no malloc, no stdio. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <grp.h>
#include <pwd.h>
#include <limits.h>

#include "jail.h"
#include "syscalls.h"
#include "../image/sha256.h"

#define JAIL_UID_COUNT 65536u
/* far above the subordinate ranges useradd hands out (100000 + 65536 n) and
 * the containers' default 100000; WARREN_VM_UID_BASE moves it */
#define JAIL_UID_BASE_DEFAULT 1879048192u /* 0x70000000 */

static pthread_mutex_t uid_lock = PTHREAD_MUTEX_INITIALIZER;
static struct
{
  char key[80];
  uid_t uid;
} * uids;
static size_t n_uids, cap_uids;

static uid_t
uid_base (void)
{
  const char *e = getenv ("WARREN_VM_UID_BASE");
  if (e && *e)
    {
      char *end;
      unsigned long v = strtoul (e, &end, 10);
      if (*end == '\0' && v >= 1000 && v + JAIL_UID_COUNT < 0xfffffffeul)
        return (uid_t)v;
    }
  return JAIL_UID_BASE_DEFAULT;
}

static bool
uid_used (uid_t u)
{
  for (size_t i = 0; i < n_uids; i++)
    if (uids[i].uid == u)
      return true;
  return false;
}

static int
uid_add (const char *key, uid_t u)
{
  if (n_uids == cap_uids)
    {
      size_t c = cap_uids ? cap_uids * 2 : 64;
      void *n = realloc (uids, c * sizeof *uids);
      if (n == NULL)
        return -ENOMEM;
      uids = n;
      cap_uids = c;
    }
  snprintf (uids[n_uids].key, sizeof uids[n_uids].key, "%s", key);
  uids[n_uids++].uid = u;
  return 0;
}

/* a uid some account or group of the host already has is never used */
static bool
uid_taken_by_host (uid_t u)
{
  struct passwd pw, *pr = NULL;
  struct group gr, *gp = NULL;
  char buf[4096];
  return (getpwuid_r (u, &pw, buf, sizeof buf, &pr) == 0 && pr)
         || (getgrgid_r ((gid_t)u, &gr, buf, sizeof buf, &gp) == 0 && gp);
}

int
wr_jail_uid_get (const char *key, uid_t *ret_uid, wr_err_t *err)
{
  uid_t base = uid_base ();
  char hex[65];
  wr_sha256_hex (key, strlen (key), hex);
  uint32_t off = (uint32_t)strtoul (
                     (char[9]){ hex[0], hex[1], hex[2], hex[3], hex[4], hex[5], hex[6], hex[7], 0 },
                     NULL, 16)
                 % JAIL_UID_COUNT;
  pthread_mutex_lock (&uid_lock);
  int r = -EAGAIN;
  for (uint32_t i = 0; i < JAIL_UID_COUNT; i++)
    {
      uid_t u = base + (off + i) % JAIL_UID_COUNT;
      if (!uid_used (u) && !uid_taken_by_host (u))
        {
          r = uid_add (key, u);
          if (r == 0)
            *ret_uid = u;
          break;
        }
    }
  pthread_mutex_unlock (&uid_lock);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "no free VM uid");
  return 0;
}

void
wr_jail_uid_put (const char *key)
{
  pthread_mutex_lock (&uid_lock);
  for (size_t i = 0; i < n_uids; i++)
    if (strcmp (uids[i].key, key) == 0)
      {
        uids[i] = uids[--n_uids];
        break;
      }
  pthread_mutex_unlock (&uid_lock);
}

void
wr_jail_uid_claim (const char *key, uid_t uid)
{
  pthread_mutex_lock (&uid_lock);
  if (!uid_used (uid))
    uid_add (key, uid);
  pthread_mutex_unlock (&uid_lock);
}

/* ---- in the child ---- */

static size_t
jstrcpy (char *dst, size_t cap, const char *a, const char *b)
{
  size_t la = strlen (a), lb = b ? strlen (b) : 0;
  if (la + lb + 1 > cap)
    return 0;
  memcpy (dst, a, la);
  if (b)
    memcpy (dst + la, b, lb);
  dst[la + lb] = '\0';
  return la + lb;
}

/* mkdir -p of path's parent directories */
static int
mkparents (char *path, size_t skip)
{
  for (char *s = path + skip + 1; *s; s++)
    if (*s == '/')
      {
        *s = '\0';
        int r = mkdir (path, 0755);
        *s = '/';
        if (r < 0 && errno != EEXIST)
          return -errno;
      }
  return 0;
}

/* bind src at root+src; ro or rw; flags added on the remount */
static int
bind_at (const char *root, const char *src, bool rw, unsigned long flags)
{
  char dst[PATH_MAX];
  size_t rl = strlen (root);
  if (jstrcpy (dst, sizeof dst, root, src) == 0)
    return -ENAMETOOLONG;
  struct stat st;
  if (lstat (src, &st) < 0)
    return errno == ENOENT ? 0 : -errno;
  int r = mkparents (dst, rl);
  if (r < 0)
    return r;
  if (S_ISLNK (st.st_mode))
    {
      /* merged-/usr links (/bin -> usr/bin) are recreated, not followed */
      char target[PATH_MAX];
      ssize_t n = readlink (src, target, sizeof target - 1);
      if (n < 0)
        return -errno;
      target[n] = '\0';
      if (symlink (target, dst) < 0 && errno != EEXIST)
        return -errno;
      return 0;
    }
  if (S_ISDIR (st.st_mode))
    {
      if (mkdir (dst, 0755) < 0 && errno != EEXIST)
        return -errno;
    }
  else
    {
      int fd = open (dst, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0 && errno != EEXIST)
        return -errno;
      if (fd >= 0)
        close (fd);
    }
  if (mount (src, dst, NULL, MS_BIND | MS_REC, NULL) < 0)
    return -errno;
  if (mount (NULL, dst, NULL, MS_BIND | MS_REMOUNT | (rw ? 0 : MS_RDONLY) | flags, NULL) < 0)
    return -errno;
  return 0;
}

int
wr_jail_enter (const struct wr_jail *j)
{
  int r;
  if (mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return -errno;
  if (mount ("tmpfs", j->root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=1m") < 0)
    return -errno;
  static const char *const sys[]
      = { "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache" };
  for (size_t i = 0; i < sizeof sys / sizeof *sys; i++)
    if ((r = bind_at (j->root, sys[i], false, MS_NOSUID | MS_NODEV)) < 0)
      return r;
  for (size_t i = 0; i < j->n_ro; i++)
    if ((r = bind_at (j->root, j->ro[i], false, MS_NOSUID | MS_NODEV | MS_NOEXEC)) < 0)
      return r;
  static const char *const devs[] = { "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random" };
  for (size_t i = 0; i < sizeof devs / sizeof *devs; i++)
    if ((r = bind_at (j->root, devs[i], true, MS_NOSUID | MS_NOEXEC)) < 0)
      return r;
  if (j->kvm && (r = bind_at (j->root, "/dev/kvm", true, MS_NOSUID | MS_NOEXEC)) < 0)
    return r;
  if ((r = bind_at (j->root, j->state_dir, true, MS_NOSUID | MS_NODEV | MS_NOEXEC)) < 0)
    return r;
  /* the pid namespace's own proc: only QEMU and its pump */
  char p[PATH_MAX];
  if (jstrcpy (p, sizeof p, j->root, "/proc") == 0)
    return -ENAMETOOLONG;
  if (mkdir (p, 0555) < 0 && errno != EEXIST)
    return -errno;
  if (mount ("proc", p, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
    return -errno;
  if (chdir (j->root) < 0 || syscall (SYS_pivot_root, ".", ".") < 0 || umount2 (".", MNT_DETACH) < 0
      || chdir ("/") < 0)
    return -errno;
  if (mount (NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
    return -errno;
  if (chdir (j->state_dir) < 0)
    return -errno;
  /* no capabilities, in any set, ever again */
  for (int c = 0; c <= 63; c++)
    if (prctl (PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
      return -errno;
  if (setgroups (0, NULL) < 0 || setresgid (j->gid, j->gid, j->gid) < 0
      || setresuid (j->uid, j->uid, j->uid) < 0)
    return -errno;
  if (prctl (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
    return -errno;
  return 0;
}

static void
pump_run (void)
{
  /* fds: 0 console pipe, 1 console.log, 2 stderr pipe, 3 qemu.log */
  static const char capped[] = "\n[warren: log capped at 1 MiB]\n";
  struct pollfd p[2] = { { .fd = 0, .events = POLLIN }, { .fd = 2, .events = POLLIN } };
  size_t written[2] = { 0, 0 };
  int out[2] = { 1, 3 };
  char buf[16384];
  while (p[0].fd >= 0 || p[1].fd >= 0)
    {
      if (poll (p, 2, -1) < 0)
        {
          if (errno == EINTR)
            continue;
          break;
        }
      for (int i = 0; i < 2; i++)
        {
          if (p[i].fd < 0 || p[i].revents == 0)
            continue;
          ssize_t n = read (p[i].fd, buf, sizeof buf);
          if (n < 0 && errno == EINTR)
            continue;
          if (n <= 0)
            {
              p[i].fd = -1;
              continue;
            }
          if (written[i] >= WR_JAIL_LOG_CAP)
            continue; /* drained, not kept: QEMU never blocks on its log */
          size_t m = (size_t)n;
          if (m > WR_JAIL_LOG_CAP - written[i])
            m = WR_JAIL_LOG_CAP - written[i];
          if (write (out[i], buf, m) < 0)
            m = WR_JAIL_LOG_CAP - written[i];
          written[i] += m;
          if (written[i] >= WR_JAIL_LOG_CAP && write (out[i], capped, sizeof capped - 1) < 0)
            {
            }
        }
    }
  _exit (0);
}

int
wr_jail_pump (int con_r, int con_out, int err_r, int err_out)
{
  long pid = syscall (SYS_clone, (long)SIGCHLD, 0L, 0L, 0L, 0L);
  if (pid < 0)
    return -errno;
  if (pid == 0)
    {
      /* same uid as QEMU, but not ptrace-able by it */
      prctl (PR_SET_DUMPABLE, 0, 0, 0, 0);
      prctl (PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
      int fds[4] = { con_r, con_out, err_r, err_out };
      for (int i = 0; i < 4; i++)
        {
          int h = fcntl (fds[i], F_DUPFD, 64);
          if (h < 0)
            _exit (127);
          fds[i] = h;
        }
      for (int i = 0; i < 4; i++)
        if (dup2 (fds[i], i) < 0)
          _exit (127);
      syscall (__NR_close_range, 4u, ~0u, 0u);
      pump_run ();
    }
  close (con_r);
  close (err_r);
  return 0;
}

/* Path resolution confined to a root directory.
 *
 * openat2(RESOLVE_IN_ROOT) is the real mechanism: the kernel treats rootfd as
 * "/" for "..", absolute symlinks and relative symlinks, and refuses magic
 * links (/proc/PID/fd/N). Where openat2 is missing (or filtered by seccomp)
 * walk_open emulates it one component at a time with O_NOFOLLOW, expanding
 * symlinks as text and never letting ".." climb above the root. */
#include "agent/agent.h"
#include "common/util.h"

#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#define MAX_SYMLINKS 40

static int
sys_openat2 (int dirfd, const char *path, struct open_how *how)
{
  return (int)syscall (SYS_openat2, dirfd, path, how, sizeof *how);
}

const char *
ag_errno_code (int errnum)
{
  switch (errnum)
    {
    case ENOENT:
      return WR_E_NOT_FOUND;
    case EEXIST:
    case ENOTEMPTY:
    case EBUSY:
    case ETXTBSY:
      return WR_E_CONFLICT;
    case ELOOP:
    case EXDEV:
    case ENOTDIR:
    case EISDIR:
    case EINVAL:
    case ENAMETOOLONG:
    case EACCES:
    case EPERM:
    case EROFS:
      return WR_E_INVALID;
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
      return WR_E_EXHAUSTED;
    default:
      return WR_E_INTERNAL;
    }
}

int
ag_path_check (const char *path, size_t len, wr_err_t *err)
{
  if (len == 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "empty path");
  if (len > PATH_MAX)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "path longer than %d bytes", PATH_MAX);
  if (strlen (path) != len)
    return wr_error (err, EINVAL, WR_E_INVALID, "path contains a NUL byte");
  if (path[0] != '/')
    return wr_error (err, EINVAL, WR_E_INVALID, "path \"%s\" is not absolute", path);
  return 0;
}

bool
ag_openat2_works (int rootfd)
{
  struct open_how how = { .flags = O_PATH | O_CLOEXEC, .resolve = RESOLVE_IN_ROOT };
  int fd = sys_openat2 (rootfd, ".", &how);
  if (fd < 0)
    return false;
  close (fd);
  return true;
}

/* Splice a symlink target in front of the rest of the path still to walk. */
static int
splice_link (char **walk, const char *target, const char *rest)
{
  size_t tl = strlen (target), rl = strlen (rest);
  char *n = malloc (tl + rl + 2);
  if (n == NULL)
    return -ENOMEM;
  memcpy (n, target, tl);
  n[tl] = '/';
  memcpy (n + tl + 1, rest, rl + 1);
  free (*walk);
  *walk = n;
  return 0;
}

static int
walk_open (int rootfd, const char *path, int flags)
{
  bool follow_last = !(flags & O_NOFOLLOW);
  _cleanup_free_ char *walk = strdup (path);
  _cleanup_close_ int cur = fcntl (rootfd, F_DUPFD_CLOEXEC, 3);
  if (walk == NULL)
    return -ENOMEM;
  if (cur < 0)
    return -errno;
  size_t depth = 0;
  int links = 0;
  const char *p = walk;
  for (;;)
    {
      while (*p == '/')
        p++;
      const char *end = strchrnul (p, '/');
      size_t n = (size_t)(end - p);
      const char *rest = end;
      while (*rest == '/')
        rest++;
      bool last = *rest == '\0';
      char name[NAME_MAX + 1];
      if (n > NAME_MAX)
        return -ENAMETOOLONG;
      memcpy (name, p, n);
      name[n] = '\0';

      if (n == 0 || strcmp (name, ".") == 0 || strcmp (name, "..") == 0)
        {
          if (n == 2 && depth > 0)
            {
              int up = openat (cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
              if (up < 0)
                return -errno;
              close (cur);
              cur = up;
              depth--;
            }
          if (n == 0 || last)
            {
              int fd = openat (cur, ".", (flags & ~O_NOFOLLOW) | O_CLOEXEC);
              return fd < 0 ? -errno : fd;
            }
          p = rest;
          continue;
        }

      /* Open the component itself without following it; O_PATH lets us see
       * symlinks and still use directories as dirfds. */
      int oflags = last ? (flags | O_NOFOLLOW | O_CLOEXEC) : (O_PATH | O_NOFOLLOW | O_CLOEXEC);
      int fd = openat (cur, name, oflags);
      int saved = errno;
      struct stat st;
      bool is_link = false;
      if (fd >= 0)
        {
          if (fstat (fd, &st) < 0)
            {
              saved = errno;
              close (fd);
              return -saved;
            }
          is_link = S_ISLNK (st.st_mode);
        }
      else if (saved == ELOOP || (saved == ENOTDIR && (flags & O_DIRECTORY)))
        {
          /* O_NOFOLLOW refused a symlink: check that is what it was. */
          if (fstatat (cur, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK (st.st_mode))
            is_link = true;
        }
      if (is_link && (!last || follow_last))
        {
          if (fd >= 0)
            close (fd);
          if (++links > MAX_SYMLINKS)
            return -ELOOP;
          char target[PATH_MAX + 1];
          ssize_t tl = readlinkat (cur, name, target, PATH_MAX);
          if (tl < 0)
            return -errno;
          target[tl] = '\0';
          if (target[0] == '/')
            {
              int r = fcntl (rootfd, F_DUPFD_CLOEXEC, 3);
              if (r < 0)
                return -errno;
              close (cur);
              cur = r;
              depth = 0;
            }
          int r = splice_link (&walk, target, rest);
          if (r < 0)
            return r;
          p = walk;
          continue;
        }
      if (fd < 0)
        return -saved;
      if (last)
        return fd;
      if (!S_ISDIR (st.st_mode))
        {
          close (fd);
          return -ENOTDIR;
        }
      close (cur);
      cur = fd;
      depth++;
      p = rest;
    }
}

int
ag_open_in_root (int rootfd, const char *path, int flags, bool use_openat2, wr_err_t *err)
{
  int fd;
  if (use_openat2)
    {
      struct open_how how = {
        .flags = (uint64_t)(flags | O_CLOEXEC),
        .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
      };
      int tries = 0;
      do
        fd = sys_openat2 (rootfd, path, &how);
      while (fd < 0 && (errno == EAGAIN || errno == EINTR) && ++tries < 16);
      if (fd < 0)
        fd = -errno;
    }
  else
    fd = walk_open (rootfd, path, flags);
  if (fd < 0)
    return wr_error (err, -fd, ag_errno_code (-fd), "%s", path);
  return fd;
}

int
ag_open_parent_in_root (int rootfd, const char *path, char *base, bool use_openat2, wr_err_t *err)
{
  size_t len = strlen (path);
  while (len > 1 && path[len - 1] == '/')
    len--;
  size_t slash = len;
  while (slash > 0 && path[slash - 1] != '/')
    slash--;
  size_t bl = len - slash;
  if (bl == 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "%s: not allowed on the root directory", path);
  if (bl > NAME_MAX)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "%s", path);
  memcpy (base, path + slash, bl);
  base[bl] = '\0';
  if (strcmp (base, ".") == 0 || strcmp (base, "..") == 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "%s: last component may not be \"%s\"", path, base);
  _cleanup_free_ char *parent = strndup (path, slash ? slash : 1);
  if (parent == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "strndup");
  int fd = ag_open_in_root (rootfd, parent, O_PATH | O_DIRECTORY, use_openat2, err);
  if (fd < 0)
    return wr_error_wrap (err, "parent of %s", path);
  return fd;
}

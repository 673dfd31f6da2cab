#include "util.h"

#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

int
wr_write_all (int fd, const void *buf, size_t len)
{
  const char *p = buf;
  while (len > 0)
    {
      ssize_t n = write (fd, p, len);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          return -errno;
        }
      p += n;
      len -= (size_t)n;
    }
  return 0;
}

ssize_t
wr_read_all (int fd, void *buf, size_t len)
{
  char *p = buf;
  size_t got = 0;
  while (got < len)
    {
      ssize_t n = read (fd, p + got, len - got);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          return -errno;
        }
      if (n == 0)
        break;
      got += (size_t)n;
    }
  return (ssize_t)got;
}

int
wr_write_file_at (int dirfd, const char *path, const char *data)
{
  _cleanup_close_ int fd = openat (dirfd, path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return -errno;
  ssize_t n = write (fd, data, strlen (data));
  if (n < 0)
    return -errno;
  return 0;
}

int
wr_read_file_at (int dirfd, const char *path, char **ret, size_t *ret_len, size_t max)
{
  _cleanup_close_ int fd = openat (dirfd, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  size_t cap = 4096, len = 0;
  _cleanup_free_ char *buf = malloc (cap + 1);
  if (buf == NULL)
    return -ENOMEM;
  for (;;)
    {
      if (len == cap)
        {
          if (cap >= max)
            return -EFBIG;
          cap *= 2;
          char *nb = realloc (buf, cap + 1);
          if (nb == NULL)
            return -ENOMEM;
          buf = nb;
        }
      ssize_t n = read (fd, buf + len, cap - len);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          return -errno;
        }
      if (n == 0)
        break;
      len += (size_t)n;
    }
  buf[len] = '\0';
  if (ret_len)
    *ret_len = len;
  *ret = TAKE_PTR (buf);
  return 0;
}

int
wr_mkdir_p (const char *path, mode_t mode)
{
  char tmp[4096];
  size_t len = strlen (path);
  if (len == 0 || len >= sizeof tmp)
    return -ENAMETOOLONG;
  memcpy (tmp, path, len + 1);
  for (char *p = tmp + 1; *p; p++)
    if (*p == '/')
      {
        *p = '\0';
        if (mkdir (tmp, mode) < 0 && errno != EEXIST)
          return -errno;
        *p = '/';
      }
  if (mkdir (tmp, mode) < 0 && errno != EEXIST)
    return -errno;
  return 0;
}

static int
rm_rf_children (int dfd, dev_t dev)
{
  DIR *d = fdopendir (dfd);
  if (d == NULL)
    {
      close (dfd);
      return -errno;
    }
  int ret = 0;
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
        continue;
      struct stat st;
      if (fstatat (dirfd (d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        continue;
      if (S_ISDIR (st.st_mode))
        {
          if (st.st_dev != dev)
            {
              ret = -EBUSY; /* a mount point: never cross it */
              continue;
            }
          int cfd = openat (dirfd (d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          if (cfd >= 0)
            {
              int r = rm_rf_children (cfd, dev);
              if (r < 0)
                ret = r;
            }
          if (unlinkat (dirfd (d), de->d_name, AT_REMOVEDIR) < 0 && ret == 0)
            ret = -errno;
        }
      else if (unlinkat (dirfd (d), de->d_name, 0) < 0 && ret == 0)
        ret = -errno;
    }
  closedir (d);
  return ret;
}

int
wr_rm_rf_at (int dirfd, const char *path)
{
  struct stat st;
  if (fstatat (dirfd, path, &st, AT_SYMLINK_NOFOLLOW) < 0)
    return errno == ENOENT ? 0 : -errno;
  if (!S_ISDIR (st.st_mode))
    return unlinkat (dirfd, path, 0) < 0 ? -errno : 0;
  int fd = openat (dirfd, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  int ret = rm_rf_children (fd, st.st_dev);
  if (unlinkat (dirfd, path, AT_REMOVEDIR) < 0 && ret == 0)
    ret = -errno;
  return ret;
}

int
wr_random_hex (char *buf, size_t n)
{
  static const char hex[] = "0123456789abcdef";
  unsigned char raw[64];
  if (n > 2 * sizeof raw)
    return -EINVAL;
  size_t need = (n + 1) / 2;
  if (getrandom (raw, need, 0) != (ssize_t)need)
    return -errno;
  for (size_t i = 0; i < n; i++)
    buf[i] = hex[(raw[i / 2] >> ((i & 1) ? 0 : 4)) & 0xf];
  buf[n] = '\0';
  return 0;
}

bool
wr_id_valid (const char *s, size_t n)
{
  if (s == NULL || n == 0 || n > WR_ID_MAX)
    return false;
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '-'))
      return false;
  return true;
}

int
wr_grow (void *arrp, size_t *cap, size_t need, size_t elem, size_t first)
{
  if (need <= *cap)
    return 0;
  if (elem == 0)
    return -EINVAL;
  if (need > SIZE_MAX / elem)
    return -EOVERFLOW;
  size_t n = *cap == 0 ? first : *cap <= SIZE_MAX / 2 ? *cap * 2 : SIZE_MAX;
  if (n < need)
    n = need;
  if (n > SIZE_MAX / elem)
    n = need; /* doubling would overflow: exactly what was asked */
  /* the pointer is read and written as bytes: arrp may point to any object
   * pointer type, never a void * itself */
  void *old, *nv;
  memcpy (&old, arrp, sizeof old);
  if ((nv = realloc (old, n * elem)) == NULL)
    return -ENOMEM;
  memcpy (arrp, &nv, sizeof nv);
  *cap = n;
  return 0;
}

DIR *
wr_opendir_dup (int dfd)
{
  int dup = fcntl (dfd, F_DUPFD_CLOEXEC, 3);
  if (dup < 0)
    return NULL;
  DIR *d = fdopendir (dup);
  if (d == NULL)
    wr_closep (&dup); /* keeps errno */
  return d;
}

bool
wr_pack_scrubbed (const char *dir, const char *name)
{
  static const char *const history[]
      = { ".bash_history",   ".ash_history", ".sh_history", ".zsh_history",
          ".python_history", ".lesshst",     ".wget-hsts",  ".viminfo" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (history); i++)
    if (strcmp (name, history[i]) == 0)
      return true;
  /* X11 sockets and locks */
  if (strcmp (dir, "tmp") == 0 && strncmp (name, ".X", 2) == 0)
    return true;
  return false;
}

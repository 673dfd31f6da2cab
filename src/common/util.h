/* Cleanup attributes and small helpers shared by every Warren binary. */
#ifndef WR_UTIL_H
#define WR_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>

#include "warren/version.h" /* WARREN_VERSION: the one version string */

/* The PATH a process in a sandbox (or a helper the daemon runs) gets when
 * nothing sets one: Debian's default for root. The one copy. */
#define WR_DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

static inline void
wr_freep (void *p)
{
  free (*(void **)p);
}
static inline void
wr_closep (int *fd)
{
  if (*fd >= 0)
    {
      int saved = errno;
      close (*fd);
      errno = saved;
    }
}
static inline void
wr_fclosep (FILE **f)
{
  if (*f)
    fclose (*f);
}
static inline void
wr_closedirp (DIR **d)
{
  if (*d)
    closedir (*d);
}

#define _cleanup_(f) __attribute__ ((cleanup (f)))
#define _cleanup_free_ _cleanup_ (wr_freep)
#define _cleanup_close_ _cleanup_ (wr_closep)
#define _cleanup_fclose_ _cleanup_ (wr_fclosep)
#define _cleanup_closedir_ _cleanup_ (wr_closedirp)

/* Move ownership out of a cleanup variable. */
#define TAKE_FD(fd)                                                                                \
  ({                                                                                               \
    int _fd = (fd);                                                                                \
    (fd) = -1;                                                                                     \
    _fd;                                                                                           \
  })
#define TAKE_PTR(p)                                                                                \
  ({                                                                                               \
    __typeof__ (p) _p = (p);                                                                       \
    (p) = NULL;                                                                                    \
    _p;                                                                                            \
  })

#define WR_ARRAY_SIZE(a) (sizeof (a) / sizeof ((a)[0]))
#define WR_UNUSED __attribute__ ((unused))

/* Monotonic clock in nanoseconds / milliseconds. */
#include <time.h>
#include <stdint.h>
static inline uint64_t
wr_now_ns (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t
wr_now_ms (void)
{
  return wr_now_ns () / 1000000ull;
}

/* Write/read all bytes, retrying on EINTR and short transfers.
 * Return 0 / bytes read, or -errno. */
int wr_write_all (int fd, const void *buf, size_t len);
ssize_t wr_read_all (int fd, void *buf, size_t len);
/* Write a small string to a file relative to dirfd (e.g. a cgroup knob). */
int wr_write_file_at (int dirfd, const char *path, const char *data);
/* Read a whole small file into a malloc'd NUL terminated buffer. */
int wr_read_file_at (int dirfd, const char *path, char **ret, size_t *ret_len, size_t max);
/* mkdir -p for absolute or relative paths; mode for created dirs. */
int wr_mkdir_p (const char *path, mode_t mode);
/* rm -rf relative to dirfd, not crossing mount points, never following symlinks. */
int wr_rm_rf_at (int dirfd, const char *path);
/* Random lowercase hex string of n chars (n+1 bytes in buf). */
int wr_random_hex (char *buf, size_t n);
/* Make room for need elements of elem bytes in a malloc'd array: arrp is the
 * address of the array pointer (any object pointer type, NULL when empty),
 * *cap its capacity in elements. Grows to first when empty, else by
 * doubling (or straight to need when that is more). 0 when it fits;
 * -EOVERFLOW when need * elem does not fit a size_t, -ENOMEM; on failure the
 * old array and *cap stay as they were. */
int wr_grow (void *arrp, size_t *cap, size_t need, size_t elem, size_t first);
/* A directory stream on a close-on-exec duplicate of dfd: dfd stays the
 * caller's (the duplicate shares its offset). NULL with errno set, and
 * nothing left open, on failure. */
DIR *wr_opendir_dup (int dfd);

/* Sandbox ids are [a-z0-9-]{1,WR_ID_MAX}: the one rule, checked by the
 * daemon's routes, by libwarren (warren_id_valid) and, mirrored, by the
 * Python SDK (warren._common.check_id). s need not be NUL terminated. */
#define WR_ID_MAX 64
bool wr_id_valid (const char *s, size_t n);
/* What a pack leaves out of a layer (docs/images.md, Pack): shell and tool
 * histories anywhere, X11 sockets and locks in /tmp. dir is the entry's
 * directory relative to the root, without slashes at either end ("" for
 * the root itself). */
bool wr_pack_scrubbed (const char *dir, const char *name);

#endif

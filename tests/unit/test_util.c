/* Unit tests for src/common/util.c's shared helpers: wr_grow (the one
 * grow-by-doubling behind the daemon's and the agent's growing arrays) and
 * wr_opendir_dup (a directory stream that leaves the caller's fd alone). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#include "common/util.h"
#include "tap.h"

#if defined(__SANITIZE_ADDRESS__)
/* The failure test asks for more than any allocator gives: ASan must answer
 * NULL as glibc does, not abort the test. */
const char *
__asan_default_options (void)
{
  return "allocator_may_return_null=1";
}
#endif

struct item
{
  uint64_t a, b;
};

static void
test_growth (void)
{
  struct item *v = NULL;
  size_t cap = 0;
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 1, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)8)
              && v != NULL,
          "an empty array grows to the first capacity");
  struct item *before = v;
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 8, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)8)
              && v == before,
          "no reallocation while it fits");

  /* fill one element at a time, as the callers do, and check every
   * element survives each move */
  int ok = 1;
  size_t caps[16], n_caps = 0;
  for (size_t n = 0; n < 1000; n++)
    {
      size_t old = cap;
      ok &= wr_grow (&v, &cap, n + 1, sizeof *v, 8) == 0;
      if (cap != old && n_caps < WR_ARRAY_SIZE (caps))
        caps[n_caps++] = cap;
      v[n] = (struct item){ n, ~n };
    }
  for (size_t n = 0; n < 1000; n++)
    ok &= v[n].a == n && v[n].b == ~n;
  TAP_OK (ok, "1000 appends keep every element");
  TAP_OK (TAP_C_EQ (n_caps, (size_t)7) && TAP_C_EQ (caps[0], (size_t)16)
              && TAP_C_EQ (caps[6], (size_t)1024) && TAP_C_EQ (cap, (size_t)1024),
          "capacity doubles: 8, 16, ... 1024");
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 5000, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)5000)
              && v[999].a == 999,
          "a need beyond the doubled capacity is met exactly");
  free (v);

  char *s = NULL;
  size_t scap = 0;
  TAP_OK (TAP_C_EQ (wr_grow (&s, &scap, 300, 1, 256), 0) && TAP_C_EQ (scap, (size_t)300),
          "a first need beyond the first capacity is met exactly");
  free (s);
}

static void
test_failure (void)
{
  size_t cap = 0;
  uint32_t *v = NULL;
  TAP_EQ (wr_grow (&v, &cap, 4, sizeof *v, 4), 0, "a small array");
  memcpy (v, (uint32_t[]){ 1, 2, 3, 4 }, 4 * sizeof *v);
  uint32_t *before = v;

  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, SIZE_MAX / 2, sizeof *v, 4), -EOVERFLOW)
              && TAP_C_EQ (cap, (size_t)4) && v == before,
          "need * elem past SIZE_MAX: -EOVERFLOW, array and capacity untouched");
  /* 2^63 bytes, more than PTRDIFF_MAX: every allocator refuses, and the
   * size itself does not overflow */
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, (size_t)PTRDIFF_MAX / 4 + 1, sizeof *v, 4), -ENOMEM)
              && TAP_C_EQ (cap, (size_t)4) && v == before,
          "allocation failure: -ENOMEM, array and capacity untouched");
  TAP_OK (v[0] == 1 && v[1] == 2 && v[2] == 3 && v[3] == 4, "the old elements are intact");
  TAP_EQ (wr_grow (&v, &cap, 5, 0, 4), -EINVAL, "elem 0: -EINVAL");
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 5, sizeof *v, 4), 0) && TAP_C_EQ (cap, (size_t)8)
              && v[3] == 4,
          "after a failure the array still grows");
  free (v);
}

static int
count_fds (void)
{
  int n = 0;
  DIR *d = opendir ("/proc/self/fd");
  if (d == NULL)
    return -1;
  while (readdir (d) != NULL)
    n++;
  closedir (d);
  return n;
}

static void
test_opendir_dup (void)
{
  char tmp[PATH_MAX];
  if (!TAP_OK (tap_mkdtemp (tmp, sizeof tmp, "wr-test-util") != NULL, "a temporary directory"))
    return;
  int dfd = open (tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  for (int i = 0; i < 3; i++)
    {
      char name[8];
      snprintf (name, sizeof name, "f%d", i);
      close (openat (dfd, name, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    }
  int fds = count_fds ();
  DIR *d = wr_opendir_dup (dfd);
  int entries = 0;
  struct dirent *de;
  while (d && (de = readdir (d)) != NULL)
    entries += de->d_name[0] == 'f';
  TAP_OK (d != NULL && TAP_C_EQ (entries, 3) && TAP_C_NE (dirfd (d), dfd)
              && TAP_C_GE (fcntl (dirfd (d), F_GETFD), FD_CLOEXEC),
          "reads the directory through a close-on-exec duplicate");
  if (d)
    closedir (d);
  struct stat st;
  TAP_OK (TAP_C_EQ (fstat (dfd, &st), 0) && S_ISDIR (st.st_mode) && TAP_C_EQ (count_fds (), fds),
          "closing the stream leaves the caller's fd open, nothing else");

  int file = openat (dfd, "f0", O_RDONLY | O_CLOEXEC);
  errno = 0;
  TAP_OK (wr_opendir_dup (file) == NULL && TAP_C_EQ (errno, ENOTDIR)
              && TAP_C_EQ (count_fds (), fds + 1),
          "a file: NULL, ENOTDIR, the duplicate closed");
  close (file);
  errno = 0;
  TAP_OK (wr_opendir_dup (-1) == NULL && TAP_C_EQ (errno, EBADF), "a bad fd: NULL, EBADF");

  for (int i = 0; i < 3; i++)
    {
      char name[8];
      snprintf (name, sizeof name, "f%d", i);
      unlinkat (dfd, name, 0);
    }
  close (dfd);
  TAP_EQ (rmdir (tmp), 0, "the temporary directory removed");
}

int
main (void)
{
  test_growth ();
  test_failure ();
  test_opendir_dup ();
  return TAP_DONE ();
}

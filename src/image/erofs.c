/* EROFS images: build with mkfs.erofs, make them reproducible, mount them. */
#include "internal.h"

#include <fcntl.h>
#include <linux/loop.h>
#include <poll.h>
#include <spawn.h>
#include <stdbool.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "../common/util.h"

#define EROFS_SUPER_OFFSET 1024
#define EROFS_MAGIC 0xE0F5E1E2u
#define EROFS_FEATURE_COMPAT_SB_CHKSUM 0x1u

static uint32_t
crc32c (uint32_t crc, const uint8_t *p, size_t len)
{
  while (len--)
    {
      crc ^= *p++;
      for (int k = 0; k < 8; k++)
        crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
    }
  return crc;
}

static uint32_t
le32 (const uint8_t *p)
{
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void
put_le32 (uint8_t *p, uint32_t v)
{
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

/* mkfs.erofs 1.5 always stamps the current time into the superblock (-T and
 * SOURCE_DATE_EPOCH would also overwrite every file's mtime). With
 * --preserve-mtime every inode stores its own mtime, so the build time is
 * informational only: zero it and recompute the superblock crc32c (kernel
 * convention: crc32c(~0) over the rest of block 0, no final xor). */
int
wr_erofs_canonicalize (int fd, wr_err_t *err)
{
  uint8_t blk[4096];
  ssize_t n = pread (fd, blk, sizeof blk, 0);
  if (n < 0)
    return wr_sys_error (err, "read erofs superblock");
  if (n < EROFS_SUPER_OFFSET + 128)
    return wr_error (err, 0, WR_E_INTERNAL, "erofs image too short (%zd bytes)", n);
  uint8_t *sb = blk + EROFS_SUPER_OFFSET;
  if (le32 (sb) != EROFS_MAGIC)
    return wr_error (err, 0, WR_E_INTERNAL, "bad erofs magic 0x%08x", le32 (sb));
  unsigned blkszbits = sb[0x0C];
  if (blkszbits != 12 || n < 4096)
    return wr_error (err, 0, WR_E_INTERNAL, "unexpected erofs block size 2^%u", blkszbits);
  memset (sb + 0x18, 0, 8); /* build_time */
  memset (sb + 0x20, 0, 4); /* build_time_nsec */
  if (le32 (sb + 0x08) & EROFS_FEATURE_COMPAT_SB_CHKSUM)
    {
      put_le32 (sb + 0x04, 0);
      put_le32 (sb + 0x04, crc32c (~0u, sb, 4096 - EROFS_SUPER_OFFSET));
    }
  if (pwrite (fd, blk, 4096, 0) != 4096)
    return wr_sys_error (err, "write erofs superblock");
  return 0;
}

static void
spawn_actions_freep (posix_spawn_file_actions_t **fa)
{
  if (*fa)
    posix_spawn_file_actions_destroy (*fa);
}

/* Read fd to EOF, keeping the last size - 1 bytes in buf as one line
 * (newlines become spaces, trailing blanks go): a tool's error is at the
 * end of what it printed. */
void
wr_read_tail (int fd, char *errbuf, size_t errsz)
{
  size_t len = 0;
  char chunk[1024];
  for (;;)
    {
      ssize_t n = read (fd, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0)
        break;
      /* keep the tail: the error is at the end */
      if ((size_t)n >= errsz - 1)
        {
          memcpy (errbuf, chunk + n - (ssize_t)(errsz - 1), errsz - 1);
          len = errsz - 1;
        }
      else
        {
          if (len + (size_t)n > errsz - 1)
            {
              size_t drop = len + (size_t)n - (errsz - 1);
              memmove (errbuf, errbuf + drop, len - drop);
              len -= drop;
            }
          memcpy (errbuf + len, chunk, (size_t)n);
          len += (size_t)n;
        }
    }
  errbuf[len] = '\0';
  while (len > 0 && (errbuf[len - 1] == '\n' || errbuf[len - 1] == ' '))
    errbuf[--len] = '\0';
  for (size_t i = 0; i < len; i++)
    if (errbuf[i] == '\n')
      errbuf[i] = ' ';
}

/* Run argv with a clean environment; stdout to /dev/null, stderr captured
 * (last bytes kept) into errbuf. Returns the wait status or -errno. */
int
wr_run_capture (char *const argv[], char *errbuf, size_t errsz, wr_err_t *err)
{
  static char *const envp[] = { "PATH=" WR_DEFAULT_PATH, "LC_ALL=C", NULL };
  int pipefd[2];
  if (pipe2 (pipefd, O_CLOEXEC) < 0)
    return wr_sys_error (err, "pipe");
  _cleanup_close_ int rd = pipefd[0];
  _cleanup_close_ int wr = pipefd[1];
  posix_spawn_file_actions_t fa_storage;
  if (posix_spawn_file_actions_init (&fa_storage) != 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "posix_spawn_file_actions_init");
  _cleanup_ (spawn_actions_freep) posix_spawn_file_actions_t *fa = &fa_storage;
  posix_spawn_file_actions_addopen (fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen (fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2 (fa, wr, 2);
  pid_t pid;
  int r = posix_spawnp (&pid, argv[0], fa, NULL, argv, envp);
  if (r != 0)
    return wr_error (err, r, WR_E_UNAVAILABLE, "cannot run %s", argv[0]);
  close (TAKE_FD (wr));
  wr_read_tail (rd, errbuf, errsz);
  int status;
  while (waitpid (pid, &status, 0) < 0)
    if (errno != EINTR)
      return wr_sys_error (err, "waitpid %s", argv[0]);
  return status;
}

int
wr_erofs_build (const char *src_dir, const char *out_path, wr_err_t *err)
{
  /* a tree from a user or a sandbox: read by an unprivileged mkfs.erofs */
  _cleanup_close_ int tree = open (src_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (tree < 0)
    return wr_sys_error (err, "open %s", src_dir);
  _cleanup_close_ int fd
      = open (out_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0)
    return wr_sys_error (err, "create %s", out_path);
  int r = wr_unpack_mkfs (tree, fd, err);
  if (r < 0)
    return r;
  return wr_erofs_seal (fd, out_path, err);
}

int
wr_erofs_build_here (const char *src_dir, const char *out_path, wr_err_t *err)
{
  /* Uncompressed: readers pay no decompression CPU and building is ~2.5x
   * faster; see docs/images.md for the measurements behind the choice. */
  char *const argv[] = { "mkfs.erofs",
                         "--quiet",
                         "--preserve-mtime",
                         "-U",
                         "00000000-0000-0000-0000-000000000000",
                         (char *)out_path,
                         (char *)src_dir,
                         NULL };
  char errbuf[512];
  int status = wr_run_capture (argv, errbuf, sizeof errbuf, err);
  if (status < 0)
    return status;
  if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    {
      /* mkfs.erofs reports ENOSPC as text only; keep the errno when we can */
      int e = strstr (errbuf, "No space") ? ENOSPC : 0;
      if (WIFSIGNALED (status))
        return wr_error (err, e, WR_E_INTERNAL, "mkfs.erofs killed by signal %d: %s",
                         WTERMSIG (status), errbuf);
      return wr_error (err, e, e ? WR_E_EXHAUSTED : WR_E_INTERNAL,
                       "mkfs.erofs failed (exit %d): %s", WEXITSTATUS (status),
                       errbuf[0] ? errbuf : "no message");
    }
  _cleanup_close_ int fd = open (out_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return wr_sys_error (err, "open %s", out_path);
  return wr_erofs_seal (fd, out_path, err);
}

int
wr_erofs_seal (int fd, const char *path, wr_err_t *err)
{
  int r = wr_erofs_canonicalize (fd, err);
  if (r < 0)
    return r;
  if (fsync (fd) < 0)
    return wr_error (err, errno, errno == ENOSPC ? WR_E_EXHAUSTED : WR_E_INTERNAL, "fsync %s",
                     path);
  return 0;
}

static int
loop_attach (const char *image, char *dev, size_t devsz, wr_err_t *err)
{
  _cleanup_close_ int ctl = open ("/dev/loop-control", O_RDWR | O_CLOEXEC);
  if (ctl < 0)
    return wr_sys_error (err, "open /dev/loop-control");
  _cleanup_close_ int backing = open (image, O_RDONLY | O_CLOEXEC);
  if (backing < 0)
    return wr_sys_error (err, "open %s", image);
  /* another process may grab the free device first: retry a few times */
  for (int attempt = 0; attempt < 16; attempt++)
    {
      int nr = ioctl (ctl, LOOP_CTL_GET_FREE);
      if (nr < 0)
        return wr_sys_error (err, "LOOP_CTL_GET_FREE");
      snprintf (dev, devsz, "/dev/loop%d", nr);
      _cleanup_close_ int lfd = open (dev, O_RDONLY | O_CLOEXEC);
      if (lfd < 0)
        return wr_sys_error (err, "open %s", dev);
      struct loop_config cfg = { .fd = (uint32_t)backing };
      cfg.info.lo_flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;
      if (ioctl (lfd, LOOP_CONFIGURE, &cfg) == 0)
        return TAKE_FD (lfd);
      if (errno != EBUSY)
        return wr_sys_error (err, "LOOP_CONFIGURE %s", dev);
    }
  return wr_error (err, EBUSY, WR_E_UNAVAILABLE, "no free loop device");
}

int
wr_erofs_mount (const char *image, const char *dir, int force_loop, wr_err_t *err)
{
  const unsigned long flags = MS_RDONLY | MS_NODEV | MS_NOSUID;
  if (!force_loop)
    {
      if (mount (image, dir, "erofs", flags, NULL) == 0)
        return 0;
      /* ENOTBLK: this kernel has no file-backed EROFS mounts */
      if (errno != ENOTBLK)
        return wr_sys_error (err, "mount erofs %s on %s", image, dir);
    }
  char dev[64];
  _cleanup_close_ int lfd = loop_attach (image, dev, sizeof dev, err);
  if (lfd < 0)
    return lfd;
  /* autoclear: the device detaches when the last user (this mount) goes */
  if (mount (dev, dir, "erofs", flags, NULL) < 0)
    {
      int e = errno;
      ioctl (lfd, LOOP_CLR_FD, 0);
      return wr_error (err, e, WR_E_INTERNAL, "mount erofs %s (%s) on %s", image, dev, dir);
    }
  return 0;
}

/* zram swap set up by warrend (zram.h). No modprobe, mkswap or swapon
 * binaries: the device comes from /sys/class/zram-control/hot_add (so
 * other users' zram devices are never touched), the swap header is written
 * here and swapon(2) is called directly. */
#include "daemon/zram.h"

#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "daemon/log.h"

#define ZRAM_CONTROL "/sys/class/zram-control"

extern char **environ;

/* zram built as a module and not loaded yet: modprobe, when there is one */
static void
try_modprobe (void)
{
  char a0[] = "modprobe", a1[] = "zram", a2[] = "num_devices=0";
  char *argv[] = { a0, a1, a2, NULL };
  pid_t pid;
  if (posix_spawnp (&pid, "modprobe", NULL, NULL, argv, environ) == 0)
    waitpid (pid, NULL, 0);
}

/* The kernel's swap header (include/linux/swap.h, union swap_header):
 * version 1, the last usable page, "SWAPSPACE2" at the end of page 0. */
static int
write_swap_header (int fd, uint64_t size)
{
  long ps = sysconf (_SC_PAGESIZE);
  _cleanup_free_ unsigned char *page = calloc (1, (size_t)ps);
  if (page == NULL)
    return -ENOMEM;
  uint32_t info[3] = { 1, (uint32_t)(size / (uint64_t)ps - 1), 0 };
  memcpy (page + 1024, info, sizeof info);
  wr_random_hex ((char *)page + 1024 + sizeof info, 15); /* a uuid's 16 bytes */
  memcpy (page + ps - 10, "SWAPSPACE2", 10);
  if (pwrite (fd, page, (size_t)ps, 0) != ps || fsync (fd) < 0)
    return -errno;
  return 0;
}

int
wrd_zram_setup (struct wrd_zram *z, const char *root, uint64_t size_mb, int prio, wr_err_t *err)
{
  z->dev = -1;
  z->swap_on = false;
  z->node[0] = '\0';
  if (access (ZRAM_CONTROL "/hot_add", F_OK) < 0)
    try_modprobe ();
  _cleanup_free_ char *num = NULL, *devno = NULL; /* before any goto fail */
  if (wr_read_file_at (AT_FDCWD, ZRAM_CONTROL "/hot_add", &num, NULL, 32) < 0)
    return wr_error (err, errno, WR_E_UNSUPPORTED,
                     "no zram (" ZRAM_CONTROL "/hot_add: %m; a kernel without CONFIG_ZRAM?)");
  z->dev = atoi (num);
  char path[128], buf[32];
  int r;
  snprintf (path, sizeof path, "/sys/block/zram%d/disksize", z->dev);
  snprintf (buf, sizeof buf, "%" PRIu64, size_mb << 20);
  if ((r = wr_write_file_at (AT_FDCWD, path, buf)) < 0)
    {
      r = wr_error (err, -r, WR_E_INTERNAL, "write %s", path);
      goto fail;
    }
  snprintf (path, sizeof path, "/sys/block/zram%d/dev", z->dev);
  unsigned maj, min;
  if (wr_read_file_at (AT_FDCWD, path, &devno, NULL, 32) < 0
      || sscanf (devno, "%u:%u", &maj, &min) != 2)
    {
      r = wr_error (err, errno, WR_E_INTERNAL, "read %s", path);
      goto fail;
    }
  /* our own node: no waiting for udev, and /proc/swaps names the daemon */
  snprintf (z->node, sizeof z->node, "%s/zram-swap", root);
  unlink (z->node);
  if (mknod (z->node, S_IFBLK | 0600, makedev (maj, min)) < 0)
    {
      r = wr_sys_error (err, "mknod %s", z->node);
      z->node[0] = '\0';
      goto fail;
    }
  {
    _cleanup_close_ int fd = open (z->node, O_RDWR | O_CLOEXEC);
    if (fd < 0 || (r = write_swap_header (fd, size_mb << 20)) < 0)
      {
        r = wr_error (err, fd < 0 ? errno : -r, WR_E_INTERNAL, "swap header on %s", z->node);
        goto fail;
      }
  }
  if (swapon (z->node, SWAP_FLAG_PREFER | ((prio << SWAP_FLAG_PRIO_SHIFT) & SWAP_FLAG_PRIO_MASK))
      < 0)
    {
      r = wr_sys_error (err, "swapon %s", z->node);
      goto fail;
    }
  z->swap_on = true;
  return 0;
fail:
  wrd_zram_teardown (z);
  return r;
}

void
wrd_zram_teardown (struct wrd_zram *z)
{
  /* swapoff reads back what is still swapped out (sandboxes left running
   * for the next daemon): it can take a moment, or fail for lack of RAM */
  if (z->swap_on && swapoff (z->node) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "zram: swapoff %s: %m; zram%d left in place", z->node, z->dev);
      return;
    }
  z->swap_on = false;
  if (z->node[0])
    unlink (z->node);
  z->node[0] = '\0';
  if (z->dev >= 0)
    {
      char buf[16];
      snprintf (buf, sizeof buf, "%d", z->dev);
      /* reset first: hot_remove refuses a device that still has a disksize
       * on some kernels */
      char path[64];
      snprintf (path, sizeof path, "/sys/block/zram%d/reset", z->dev);
      wr_write_file_at (AT_FDCWD, path, "1");
      wr_write_file_at (AT_FDCWD, ZRAM_CONTROL "/hot_remove", buf);
    }
  z->dev = -1;
}

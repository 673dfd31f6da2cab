/* Layer and rootfs tarball extraction (src/image/extract.c): any archive
 * (tar, gzip, zstd, xz, bzip2 by magic) unpacked into an empty directory,
 * with the default limits. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"
#include "harness.h"
#include "image/internal.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

static char root[] = "/tmp/warren-fuzz-tar-XXXXXX";
static int root_fd = -1;

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  fuzz_tmpdir (root);
  if ((root_fd = open (root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
    abort ();
  return 0;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  int fd = memfd_create ("fuzz-tar", MFD_CLOEXEC);
  if (fd < 0 || wr_write_all (fd, data, size) < 0 || lseek (fd, 0, SEEK_SET) < 0)
    abort ();
  if (mkdirat (root_fd, "x", 0755) < 0)
    abort ();
  int dfd = openat (root_fd, "x", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    abort ();
  struct wr_extract_stats st;
  wr_err_t err;
  (void)wr_tar_extract (fd, dfd, &st, &err);
  close (dfd);
  close (fd);
  if (wr_rm_rf_at (root_fd, "x") < 0)
    abort ();
  return 0;
}

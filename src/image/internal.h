/* Internals of the image store shared by its files; not a public API. */
#ifndef WR_IMAGE_INTERNAL_H
#define WR_IMAGE_INTERNAL_H

#include <stdint.h>

#include "../common/err.h"

struct wr_extract_stats
{
  uint64_t entries;         /* archive entries seen */
  uint64_t skipped_special; /* device nodes, fifos and sockets not extracted */
  uint64_t skipped_xattrs;  /* xattrs dropped (overlay-private names or unsupported) */
  uint64_t bytes;           /* regular file bytes written */
};

/* Extract the tar archive (plain, gzip, zstd, xz, bzip2: detected by magic)
 * read from archive_fd into the empty directory root_dfd. Never follows a
 * symlink and never writes outside root_dfd; entries with absolute paths or
 * ".." components, hard links leaving the tree and anything passing through
 * a symlink fail with WR_E_INVALID. Leaves a partial tree on failure: the
 * caller removes it. */
int wr_tar_extract (int archive_fd, int root_dfd, struct wr_extract_stats *stats, wr_err_t *err);

/* Build a deterministic EROFS image of src_dir at out_path with mkfs.erofs
 * (uncompressed, fixed UUID, per-file mtimes kept, build time zeroed), then
 * fsync it. Identical trees give byte-identical images. */
int wr_erofs_build (const char *src_dir, const char *out_path, wr_err_t *err);

/* Zero the superblock build time of an EROFS image and fix its checksum. */
int wr_erofs_canonicalize (int fd, wr_err_t *err);

/* Mount the EROFS image file read-only at dir: a file-backed mount when the
 * kernel has them, else a loop device (autoclear). force_loop is for tests. */
int wr_erofs_mount (const char *image, const char *dir, int force_loop, wr_err_t *err);

#endif

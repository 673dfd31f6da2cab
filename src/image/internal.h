/* Internals of the image store shared by its files; not a public API. */
#ifndef WR_IMAGE_INTERNAL_H
#define WR_IMAGE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "../common/err.h"
#include "store.h"

#if defined(__x86_64__)
#define WR_OCI_ARCH "amd64"
#elif defined(__aarch64__)
#define WR_OCI_ARCH "arm64"
#else
#define WR_OCI_ARCH "unknown"
#endif

/* oci.c: commit an OCI image whose layer blobs are open at fds (-1 for a
 * blob already stored, see wr_blob_layer), blobs[i] their digests. */
int wr_oci_commit (struct wr_store *s, const char *ref, json_t *oci_config, const int *fds,
                   const char *const *blobs, size_t n, wr_progress_fn progress, void *ud,
                   struct wr_image **ret, wr_err_t *err);
/* oci.c: an image manifest whose blobs live in dfd/blobs/sha256/. */
int wr_oci_from_manifest_dir (struct wr_store *s, const char *ref, int dfd, json_t *manifest,
                              wr_progress_fn progress, void *ud, struct wr_image **ret,
                              wr_err_t *err);

struct wr_extract_stats
{
  uint64_t entries;         /* archive entries seen */
  uint64_t skipped_special; /* device nodes, fifos and sockets not extracted */
  uint64_t skipped_xattrs;  /* xattrs dropped (overlay-private names or unsupported) */
  uint64_t bytes;           /* regular files' sizes (holes of sparse files included) */
  uint64_t whiteouts;       /* OCI whiteouts converted (WR_EXTRACT_OCI_WHITEOUTS) */
  char source[65];          /* sha256 (hex) of every archive byte, hashed as it was read */
  bool image_archive;       /* WR_UNPACK_PROBE: a docker-save / OCI archive */
  char uncompressed[65];    /* WR_UNPACK_DIFF_ID: sha256 (hex) of the decompressed stream */
};

/* Convert OCI whiteout entries (".wh.NAME" -> 0/0 char device NAME,
 * ".wh..wh..opq" -> user.overlay.opaque=y on its directory): for layers of
 * OCI images, never for plain rootfs tarballs. */
#define WR_EXTRACT_OCI_WHITEOUTS 1u

/* What one extraction may produce (docs/images.md, Limits); 0: no limit.
 * Exceeding one is WR_E_TOO_LARGE, found while writing, not afterwards. */
struct wr_extract_limits
{
  uint64_t max_bytes;   /* sum of regular files' sizes */
  uint64_t max_entries; /* archive entries */
  uint32_t max_ratio;   /* unpacked bytes per archive byte read ... */
  uint64_t ratio_grace; /* ... once more than this was unpacked */
  bool in_process;      /* wr_unpack without the helper: fuzzing only */
};
extern const struct wr_extract_limits wr_extract_defaults;
/* store.c: the store's limits for one layer (image false) or one image
 * archive (image true). */
void wr_store_extract_limits (struct wr_store *s, bool image, struct wr_extract_limits *ret);

/* Extract the tar archive (plain, gzip, zstd, xz, bzip2: detected by magic)
 * read from archive_fd into the empty directory root_dfd. Never follows a
 * symlink and never writes outside root_dfd; entries with absolute paths or
 * ".." components, hard links leaving the tree and anything passing through
 * a symlink fail with WR_E_INVALID. lim NULL: wr_extract_defaults. Leaves a
 * partial tree on failure: the caller removes it. */
int wr_tar_extract (int archive_fd, int root_dfd, struct wr_extract_stats *stats, wr_err_t *err);
int wr_tar_extract_ex (int archive_fd, int root_dfd, unsigned flags,
                       const struct wr_extract_limits *lim, struct wr_extract_stats *stats,
                       wr_err_t *err);

/* Does this tarball hold a docker-save archive or an OCI layout (a
 * manifest.json or oci-layout at its top)? Reads headers only, within lim. */
bool wr_tar_is_image_archive (int fd, const struct wr_extract_limits *lim);

/* SHA-256 of the archive's uncompressed stream (a layer's diff_id), within
 * lim's byte and ratio limits. Reads fd from its start and rewinds it. */
int wr_tar_sha256 (int fd, const struct wr_extract_limits *lim, char hex[65], wr_err_t *err);

/* Build a deterministic EROFS image of src_dir at out_path with mkfs.erofs
 * (uncompressed, fixed UUID, per-file mtimes kept, build time zeroed), then
 * fsync it. Identical trees give byte-identical images. mkfs.erofs runs
 * unprivileged (wr_unpack_mkfs): src_dir's ids must be 0-65535, others
 * read as nobody (65534). */
int wr_erofs_build (const char *src_dir, const char *out_path, wr_err_t *err);
/* The same with mkfs.erofs run by this process (fuzzing only). */
int wr_erofs_build_here (const char *src_dir, const char *out_path, wr_err_t *err);

/* Zero the superblock build time of an EROFS image and fix its checksum. */
int wr_erofs_canonicalize (int fd, wr_err_t *err);
/* Read fd to EOF, keeping its last size - 1 bytes in buf as one line. */
void wr_read_tail (int fd, char *buf, size_t size);
/* Run argv (clean environment, stdout to /dev/null), its stderr's tail in
 * errbuf as by wr_read_tail. Returns the wait status or -1. */
int wr_run_capture (char *const argv[], char *errbuf, size_t errsz, wr_err_t *err);

/* wr_erofs_canonicalize, then fsync (path names it in errors). */
int wr_erofs_seal (int fd, const char *path, wr_err_t *err);

/* wr_unpack modes besides extraction (results in the stats, untrusted:
 * a wrong answer may only fail an import or pick the other import path) */
#define WR_UNPACK_PROBE (1u << 8)   /* wr_tar_is_image_archive */
#define WR_UNPACK_DIFF_ID (1u << 9) /* wr_tar_sha256 */
/* tests: the extractor checks its chroot, then calls socket(2), which its
 * seccomp filter must answer by killing it (SIGSYS) */
#define WR_UNPACK_SELFTEST (1u << 10)
/* wr_unpack_mkfs: no extraction, mkfs.erofs of the daemon's tree only */
#define WR_UNPACK_MKFS (1u << 11)

/* unpack.c: extract the archive src (read from its start) into root_dfd in
 * an unprivileged, seccomp-confined helper (docs/images.md, Confined
 * unpacking); with out_fd >= 0 the helper also writes the EROFS image of
 * the tree there (not yet sealed). stats->source is the sha256 of the bytes
 * the daemon fed the helper. The tree is left owned by the helper's ids. */
int wr_unpack (int src, int root_dfd, int out_fd, unsigned flags,
               const struct wr_extract_limits *lim, struct wr_extract_stats *stats, wr_err_t *err);
/* unpack.c: write the EROFS image of the tree at tree_dfd to out_fd (not
 * yet sealed) with mkfs.erofs in the helper's user namespace, which sees an
 * idmapped read-only clone of the tree: ids 0-65535 as themselves, no host
 * privilege (needs a file system with idmapped mounts). */
int wr_unpack_mkfs (int tree_dfd, int out_fd, wr_err_t *err);
/* the error code a helper reported, if it is one of ours, else internal */
const char *wr_unpack_code (const char *code);
/* first host uid (and gid) of the helper's 65536 ids */
uint32_t wr_unpack_uid_base (void);

/* Mount the EROFS image file read-only at dir: a file-backed mount when the
 * kernel has them, else a loop device (autoclear). force_loop is for tests. */
int wr_erofs_mount (const char *image, const char *dir, int force_loop, wr_err_t *err);

#endif

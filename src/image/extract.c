/* Safe tar extraction with our own openat-based writer.
 *
 * libarchive only parses: every file system change is made relative to a
 * directory fd, walking parents one component at a time with O_NOFOLLOW, so
 * a symlink planted by an earlier entry can never redirect a later write,
 * and no process-wide state (cwd) is touched: imports run in worker threads. */
#include "internal.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include "../common/util.h"
#include "sha256.h"

#define MAX_COMPONENTS 256

struct path
{
  char buf[4096];
  const char *comp[MAX_COMPONENTS];
  size_t n;
};

/* Split an archive path into components. Rejects absolute paths, ".." and
 * over-long paths; drops "." and empty components ("./a//b" -> a, b). */
static int
path_split (const char *what, const char *raw, struct path *p, wr_err_t *err)
{
  if (raw == NULL || raw[0] == '\0')
    return wr_error (err, 0, WR_E_INVALID, "archive %s with an empty path", what);
  if (raw[0] == '/')
    return wr_error (err, 0, WR_E_INVALID, "archive %s '%s' is an absolute path", what, raw);
  size_t len = strlen (raw);
  if (len >= sizeof p->buf)
    return wr_error (err, 0, WR_E_INVALID, "archive %s path too long (%zu bytes)", what, len);
  memcpy (p->buf, raw, len + 1);
  p->n = 0;
  char *save = NULL;
  for (char *c = strtok_r (p->buf, "/", &save); c; c = strtok_r (NULL, "/", &save))
    {
      if (strcmp (c, ".") == 0)
        continue;
      if (strcmp (c, "..") == 0)
        return wr_error (err, 0, WR_E_INVALID, "archive %s '%s' contains a '..' component", what,
                         raw);
      if (strlen (c) > 255)
        return wr_error (err, 0, WR_E_INVALID, "archive %s '%s' has a name over 255 bytes", what,
                         raw);
      if (p->n == MAX_COMPONENTS)
        return wr_error (err, 0, WR_E_INVALID, "archive %s '%s' is nested too deep", what, raw);
      p->comp[p->n++] = c;
    }
  return 0;
}

/* Directory mtimes change while their children are extracted: apply them at
 * the end, in archive order (a later entry for the same dir wins). */
struct dir_time
{
  char *path;
  struct timespec ts[2];
};
struct dir_times
{
  struct dir_time *v;
  size_t n, cap;
};

static int
dir_times_add (struct dir_times *d, const char *path, const struct timespec ts[2])
{
  if (d->n == d->cap)
    {
      size_t cap = d->cap ? d->cap * 2 : 64;
      struct dir_time *nv = realloc (d->v, cap * sizeof *nv);
      if (nv == NULL)
        return -ENOMEM;
      d->v = nv;
      d->cap = cap;
    }
  d->v[d->n].path = strdup (path);
  if (d->v[d->n].path == NULL)
    return -ENOMEM;
  d->v[d->n].ts[0] = ts[0];
  d->v[d->n].ts[1] = ts[1];
  d->n++;
  return 0;
}

static void
dir_times_free (struct dir_times *d)
{
  for (size_t i = 0; i < d->n; i++)
    free (d->v[i].path);
  free (d->v);
}

/* rel = first n components joined by '/' (fits: the source path did) */
static void
path_join (const struct path *p, size_t n, char rel[4096])
{
  size_t off = 0;
  rel[0] = '\0';
  for (size_t i = 0; i < n; i++)
    off += (size_t)snprintf (rel + off, 4096 - off, "%s%s", i ? "/" : "", p->comp[i]);
}

/* Open the directory holding the last component of p (creating missing
 * parents 0755). Fails if any existing component is not a real directory:
 * that is the symlink-traversal check. */
static int
open_parent (int root_dfd, const struct path *p, const char *raw, struct dir_times *dirs,
             wr_err_t *err)
{
  _cleanup_close_ int cur = fcntl (root_dfd, F_DUPFD_CLOEXEC, 3);
  if (cur < 0)
    return wr_sys_error (err, "dup");
  for (size_t i = 0; i + 1 < p->n; i++)
    {
      int fd = openat (cur, p->comp[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0 && errno == ENOENT)
        {
          if (mkdirat (cur, p->comp[i], 0755) < 0 && errno != EEXIST)
            return wr_sys_error (err, "mkdir '%s' for '%s'", p->comp[i], raw);
          /* implicit parents get a fixed time, for reproducible layers */
          if (dirs)
            {
              static const struct timespec zero[2];
              char rel[4096];
              path_join (p, i + 1, rel);
              if (dir_times_add (dirs, rel, zero) < 0)
                return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
            }
          fd = openat (cur, p->comp[i], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
      if (fd < 0)
        {
          if (errno == ELOOP || errno == ENOTDIR)
            return wr_error (err, 0, WR_E_INVALID,
                             "archive entry '%s' passes through '%s', which is not a directory "
                             "(symlinks are never followed during extraction)",
                             raw, p->comp[i]);
          return wr_sys_error (err, "open '%s' for '%s'", p->comp[i], raw);
        }
      close (cur);
      cur = fd;
    }
  return TAKE_FD (cur);
}

/* Make room for a new entry called name in dfd: later archive entries
 * replace earlier ones, as tar does. keep_dir: an existing directory stays. */
static int
clear_slot (int dfd, const char *name, bool keep_dir, const char *raw, wr_err_t *err)
{
  struct stat st;
  if (fstatat (dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
    return errno == ENOENT ? 0 : wr_sys_error (err, "stat '%s'", raw);
  if (S_ISDIR (st.st_mode))
    {
      if (keep_dir)
        return 1;
      int r = wr_rm_rf_at (dfd, name);
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "replace directory '%s'", raw);
      return 0;
    }
  if (unlinkat (dfd, name, 0) < 0)
    return wr_sys_error (err, "replace '%s'", raw);
  return 0;
}

static bool
xattr_allowed (const char *name)
{
  /* overlayfs interprets these on lower layers (opaque dirs, redirects,
   * metacopy): an image must not be able to forge them. */
  return strncmp (name, "trusted.overlay.", 16) != 0 && strncmp (name, "user.overlay.", 13) != 0;
}

static int
apply_meta (int fd, struct archive_entry *e, struct wr_extract_stats *stats, const char *raw,
            wr_err_t *err)
{
  la_int64_t uid = archive_entry_uid (e), gid = archive_entry_gid (e);
  if (uid < 0 || uid >= UINT32_MAX || gid < 0 || gid >= UINT32_MAX)
    return wr_error (err, 0, WR_E_INVALID, "archive entry '%s' has an invalid owner %lld:%lld", raw,
                     (long long)uid, (long long)gid);
  if (fchown (fd, (uid_t)uid, (gid_t)gid) < 0)
    return wr_sys_error (err, "chown '%s'", raw);
  /* after chown, which clears set-id bits */
  if (fchmod (fd, archive_entry_perm (e) & 07777) < 0)
    return wr_sys_error (err, "chmod '%s'", raw);
  const char *name;
  const void *value;
  size_t size;
  archive_entry_xattr_reset (e);
  while (archive_entry_xattr_next (e, &name, &value, &size) == ARCHIVE_OK)
    {
      if (name == NULL || !xattr_allowed (name) || fsetxattr (fd, name, value, size, 0) < 0)
        stats->skipped_xattrs++;
    }
  return 0;
}

static void
entry_times (struct archive_entry *e, struct timespec ts[2])
{
  ts[1].tv_sec = archive_entry_mtime_is_set (e) ? archive_entry_mtime (e) : 0;
  ts[1].tv_nsec = archive_entry_mtime_is_set (e) ? archive_entry_mtime_nsec (e) : 0;
  ts[0] = ts[1];
}

static int
dir_times_apply (int root_dfd, struct dir_times *d, wr_err_t *err)
{
  for (size_t i = 0; i < d->n; i++)
    {
      struct path p = { .n = 0 };
      if (d->v[i].path[0])
        {
          int r = path_split ("directory", d->v[i].path, &p, err);
          if (r < 0)
            return r;
        }
      _cleanup_close_ int fd = -1;
      if (p.n == 0)
        fd = fcntl (root_dfd, F_DUPFD_CLOEXEC, 3);
      else
        {
          _cleanup_close_ int pfd = open_parent (root_dfd, &p, d->v[i].path, NULL, err);
          if (pfd < 0)
            return pfd;
          fd = openat (pfd, p.comp[p.n - 1], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
      /* a later entry may have replaced the directory: nothing to do */
      if (fd < 0)
        continue;
      if (futimens (fd, d->v[i].ts) < 0)
        return wr_sys_error (err, "set times of '%s'", d->v[i].path);
    }
  return 0;
}

/* One extraction: the archive, its limits, and the bytes it unpacked so
 * far (the sizes files end up with, holes included: a sparse entry costs
 * what mkfs.erofs will read). */
struct xctx
{
  struct archive *a;
  unsigned flags;
  const struct wr_extract_limits *lim;
  struct dir_times *dirs;
  struct wr_extract_stats *stats;
};

/* A bomb is stopped while it is being written: past lim->max_bytes, or once
 * it has unpacked more than lim->max_ratio times the archive bytes read. */
static bool
over_ratio (const struct wr_extract_limits *l, struct archive *a, uint64_t unpacked)
{
  if (!l->max_ratio || unpacked <= l->ratio_grace)
    return false;
  la_int64_t in = archive_filter_bytes (a, -1);
  return in <= 0 || unpacked / l->max_ratio > (uint64_t)in;
}

static int
check_growth (struct xctx *x, uint64_t unpacked, bool ratio, const char *raw, wr_err_t *err)
{
  const struct wr_extract_limits *l = x->lim;
  if (l->max_bytes && unpacked > l->max_bytes)
    return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                     "archive unpacks to more than %llu bytes (at '%s'); see 'Limits' in "
                     "docs/images.md",
                     (unsigned long long)l->max_bytes, raw);
  if (ratio && over_ratio (l, x->a, unpacked))
    return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                     "archive expands more than %u times (%llu bytes from %lld at '%s'); see "
                     "'Limits' in docs/images.md",
                     l->max_ratio, (unsigned long long)unpacked,
                     (long long)archive_filter_bytes (x->a, -1), raw);
  return 0;
}

static int
write_data (struct xctx *x, int fd, struct archive_entry *e, const char *raw, wr_err_t *err)
{
  struct archive *a = x->a;
  struct wr_extract_stats *stats = x->stats;
  la_int64_t declared = archive_entry_size_is_set (e) ? archive_entry_size (e) : 0;
  if (declared < 0)
    return wr_error (err, 0, WR_E_INVALID, "archive entry '%s' has a negative size", raw);
  /* the size is known up front: refuse before writing anything (the ratio
   * can only be judged once the data has been read) */
  int r = check_growth (x, stats->bytes + (uint64_t)declared, false, raw, err);
  if (r < 0)
    return r;
  uint64_t end = 0; /* high-water mark of this file */
  for (;;)
    {
      const void *buf;
      size_t size;
      la_int64_t off;
      r = archive_read_data_block (a, &buf, &size, &off);
      if (r == ARCHIVE_EOF)
        break;
      if (r < ARCHIVE_WARN)
        return wr_error (err, 0, WR_E_INVALID, "corrupt or truncated archive at '%s': %s", raw,
                         archive_error_string (a));
      if (off < 0 || (uint64_t)off + size > (uint64_t)declared)
        return wr_error (err, 0, WR_E_INVALID, "archive entry '%s' has data past its size", raw);
      if ((uint64_t)off + size > end)
        end = (uint64_t)off + size;
      r = check_growth (x, stats->bytes + end, true, raw, err);
      if (r < 0)
        return r;
      const char *p = buf;
      while (size > 0)
        {
          ssize_t n = pwrite (fd, p, size, off);
          if (n < 0)
            {
              if (errno == EINTR)
                continue;
              return wr_sys_error (err, "write '%s'", raw);
            }
          p += n;
          off += n;
          size -= (size_t)n;
        }
    }
  /* sparse files end in a hole that has no data block */
  if (archive_entry_size_is_set (e) && ftruncate (fd, declared) < 0)
    return wr_sys_error (err, "truncate '%s'", raw);
  stats->bytes += (uint64_t)declared;
  return check_growth (x, stats->bytes, true, raw, err);
}

/* OCI whiteouts (".wh.NAME", ".wh..wh..opq") become what overlayfs mounted
 * with "userxattr" understands on a lower layer: a 0/0 character device
 * named NAME, and user.overlay.opaque=y on the directory. Returns 1 when the
 * entry was a whiteout (handled), 0 when it is an ordinary entry. */
static int
oci_whiteout (struct archive_entry *e, const struct path *p, int root_dfd, struct dir_times *dirs,
              struct wr_extract_stats *stats, const char *raw, wr_err_t *err)
{
  const char *base = p->comp[p->n - 1];
  if (strncmp (base, ".wh.", 4) != 0)
    return 0;
  if (archive_entry_filetype (e) == AE_IFDIR)
    return wr_error (err, 0, WR_E_INVALID, "whiteout '%s' is a directory", raw);
  _cleanup_close_ int pfd = open_parent (root_dfd, p, raw, dirs, err);
  if (pfd < 0)
    return pfd;
  if (strcmp (base, ".wh..wh..opq") == 0)
    {
      if (fsetxattr (pfd, "user.overlay.opaque", "y", 1, 0) < 0)
        return wr_sys_error (err, "mark '%s' opaque", raw);
      stats->whiteouts++;
      return 1;
    }
  const char *name = base + 4;
  if (name[0] == '\0' || strcmp (name, ".") == 0 || strcmp (name, "..") == 0
      || strncmp (name, ".wh.", 4) == 0)
    return wr_error (err, 0, WR_E_INVALID, "invalid whiteout '%s'", raw);
  int r = clear_slot (pfd, name, false, raw, err);
  if (r < 0)
    return r;
  if (mknodat (pfd, name, S_IFCHR | 0600, makedev (0, 0)) < 0)
    return wr_sys_error (err, "whiteout '%s'", raw);
  stats->whiteouts++;
  return 1;
}

static int
extract_entry (struct xctx *x, struct archive_entry *e, int root_dfd, wr_err_t *err)
{
  struct dir_times *dirs = x->dirs;
  struct wr_extract_stats *stats = x->stats;
  const char *raw = archive_entry_pathname (e);
  struct path p;
  int r = path_split ("entry", raw, &p, err);
  if (r < 0)
    return r;
  mode_t type = archive_entry_filetype (e);
  const char *hardlink = archive_entry_hardlink (e);
  struct timespec ts[2];
  entry_times (e, ts);

  if (p.n == 0)
    {
      /* "./": metadata of the layer root itself */
      if (type != AE_IFDIR || hardlink)
        return wr_error (err, 0, WR_E_INVALID, "archive root entry '%s' is not a directory", raw);
      r = apply_meta (root_dfd, e, stats, raw, err);
      if (r < 0)
        return r;
      return dir_times_add (dirs, "", ts) < 0 ? wr_error (err, ENOMEM, WR_E_INTERNAL, "oom") : 0;
    }

  if (x->flags & WR_EXTRACT_OCI_WHITEOUTS)
    {
      r = oci_whiteout (e, &p, root_dfd, dirs, stats, raw, err);
      if (r != 0)
        return r < 0 ? r : 0;
    }
  if (!hardlink && (type == AE_IFCHR || type == AE_IFBLK || type == AE_IFIFO || type == AE_IFSOCK))
    {
      stats->skipped_special++;
      return 0;
    }
  if (!hardlink && type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK)
    return wr_error (err, 0, WR_E_INVALID, "archive entry '%s' has an unsupported type 0%o", raw,
                     (unsigned)type);

  _cleanup_close_ int pfd = open_parent (root_dfd, &p, raw, dirs, err);
  if (pfd < 0)
    return pfd;
  const char *name = p.comp[p.n - 1];

  if (hardlink)
    {
      struct path t;
      r = path_split ("hard link target", hardlink, &t, err);
      if (r < 0)
        return r;
      if (t.n == 0)
        return wr_error (err, 0, WR_E_INVALID, "hard link '%s' points at the root", raw);
      _cleanup_close_ int tfd = open_parent (root_dfd, &t, hardlink, NULL, err);
      if (tfd < 0)
        return tfd;
      struct stat st;
      if (fstatat (tfd, t.comp[t.n - 1], &st, AT_SYMLINK_NOFOLLOW) < 0)
        return wr_error (err, errno, WR_E_INVALID, "hard link '%s' to '%s', not in the archive",
                         raw, hardlink);
      if (S_ISDIR (st.st_mode))
        return wr_error (err, 0, WR_E_INVALID, "hard link '%s' to directory '%s'", raw, hardlink);
      r = clear_slot (pfd, name, false, raw, err);
      if (r < 0)
        return r;
      /* flags 0: a symlink target is linked itself, never followed */
      if (linkat (tfd, t.comp[t.n - 1], pfd, name, 0) < 0)
        return wr_sys_error (err, "hard link '%s' to '%s'", raw, hardlink);
      return 0;
    }

  switch (type)
    {
    case AE_IFDIR:
      {
        r = clear_slot (pfd, name, true, raw, err);
        if (r < 0)
          return r;
        if (r == 0 && mkdirat (pfd, name, 0700) < 0)
          return wr_sys_error (err, "mkdir '%s'", raw);
        _cleanup_close_ int fd
            = openat (pfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0)
          return wr_sys_error (err, "open '%s'", raw);
        r = apply_meta (fd, e, stats, raw, err);
        if (r < 0)
          return r;
        char rel[4096];
        path_join (&p, p.n, rel);
        if (dir_times_add (dirs, rel, ts) < 0)
          return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
        return 0;
      }
    case AE_IFREG:
      {
        r = clear_slot (pfd, name, false, raw, err);
        if (r < 0)
          return r;
        _cleanup_close_ int fd
            = openat (pfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0)
          return wr_sys_error (err, "create '%s'", raw);
        r = write_data (x, fd, e, raw, err);
        if (r < 0)
          return r;
        r = apply_meta (fd, e, stats, raw, err);
        if (r < 0)
          return r;
        if (futimens (fd, ts) < 0)
          return wr_sys_error (err, "set times of '%s'", raw);
        return 0;
      }
    case AE_IFLNK:
      {
        /* Any target is fine, absolute ones included: it is resolved inside
         * the sandbox at run time, and extraction never follows it. */
        const char *target = archive_entry_symlink (e);
        if (target == NULL || target[0] == '\0')
          return wr_error (err, 0, WR_E_INVALID, "symlink '%s' has an empty target", raw);
        r = clear_slot (pfd, name, false, raw, err);
        if (r < 0)
          return r;
        if (symlinkat (target, pfd, name) < 0)
          return wr_sys_error (err, "symlink '%s'", raw);
        la_int64_t uid = archive_entry_uid (e), gid = archive_entry_gid (e);
        if (uid < 0 || uid >= UINT32_MAX || gid < 0 || gid >= UINT32_MAX)
          return wr_error (err, 0, WR_E_INVALID, "archive entry '%s' has an invalid owner", raw);
        if (fchownat (pfd, name, (uid_t)uid, (gid_t)gid, AT_SYMLINK_NOFOLLOW) < 0)
          return wr_sys_error (err, "chown '%s'", raw);
        if (utimensat (pfd, name, ts, AT_SYMLINK_NOFOLLOW) < 0)
          return wr_sys_error (err, "set times of '%s'", raw);
        return 0;
      }
    }
  return wr_error (err, 0, WR_E_INVALID, "archive entry '%s': unsupported type", raw);
}

static void
archive_freep (struct archive **a)
{
  if (*a)
    archive_read_free (*a);
}

const struct wr_extract_limits wr_extract_defaults = {
  .max_bytes = 8ull << 30,
  .max_entries = 1000000,
  .max_ratio = 100,
  .ratio_grace = 64ull << 20,
};

/* Feeds libarchive from fd and hashes every byte it hands over: the digest
 * of what was extracted, not of what was read at some earlier time. */
struct src_reader
{
  int fd;
  struct wr_sha256 h;
  char buf[1 << 16];
};

static la_ssize_t
src_read (struct archive *a, void *ud, const void **ret)
{
  struct src_reader *r = ud;
  for (;;)
    {
      ssize_t n = read (r->fd, r->buf, sizeof r->buf);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        {
          archive_set_error (a, errno, "read: %s", strerror (errno));
          return -1;
        }
      wr_sha256_update (&r->h, r->buf, (size_t)n);
      *ret = r->buf;
      return n;
    }
}

/* The sha256 of everything in fd: what libarchive read, then the rest it
 * did not need (padding after the end-of-archive blocks). */
static int
src_finish (struct src_reader *r, char hex[65], wr_err_t *err)
{
  for (;;)
    {
      ssize_t n = read (r->fd, r->buf, sizeof r->buf);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        return wr_sys_error (err, "read archive");
      if (n == 0)
        break;
      wr_sha256_update (&r->h, r->buf, (size_t)n);
    }
  uint8_t d[32];
  wr_sha256_final (&r->h, d);
  wr_sha256_to_hex (d, hex);
  return 0;
}

static void
src_freep (struct src_reader **r)
{
  free (*r);
}

/* compression is detected from the data, never from a file name */
static struct archive *
archive_open (int fd, bool tar, struct src_reader *rd)
{
  rd->fd = fd;
  wr_sha256_init (&rd->h);
  struct archive *a = archive_read_new ();
  if (a == NULL)
    return NULL;
  archive_read_support_filter_gzip (a);
  archive_read_support_filter_zstd (a);
  archive_read_support_filter_xz (a);
  archive_read_support_filter_bzip2 (a);
  if (tar)
    {
      archive_read_support_format_tar (a);
      archive_read_support_format_gnutar (a);
    }
  else
    archive_read_support_format_raw (a);
  if (archive_read_open (a, rd, NULL, src_read, NULL) != ARCHIVE_OK)
    {
      archive_read_free (a);
      return NULL;
    }
  return a;
}

bool
wr_tar_is_image_archive (int fd, const struct wr_extract_limits *lim)
{
  lseek (fd, 0, SEEK_SET);
  _cleanup_ (src_freep) struct src_reader *rd = malloc (sizeof *rd);
  if (rd == NULL)
    return false;
  _cleanup_ (archive_freep) struct archive *a = archive_open (fd, true, rd);
  bool found = false;
  for (int i = 0; a && i < 100000 && !found; i++)
    {
      struct archive_entry *e;
      int r = archive_read_next_header (a, &e);
      if (r != ARCHIVE_OK && r != ARCHIVE_WARN)
        break;
      const char *p = archive_entry_pathname (e);
      while (p && p[0] == '.' && p[1] == '/')
        p += 2;
      found = p && (strcmp (p, "manifest.json") == 0 || strcmp (p, "oci-layout") == 0);
      /* skipping entries decompresses them: stop a bomb here too (the
       * rootfs import it then becomes fails on the same limits) */
      uint64_t out = (uint64_t)archive_filter_bytes (a, 0);
      if ((lim->max_bytes && out > lim->max_bytes) || over_ratio (lim, a, out))
        break;
    }
  lseek (fd, 0, SEEK_SET);
  return found;
}

int
wr_tar_sha256 (int fd, const struct wr_extract_limits *lim, char hex[65], wr_err_t *err)
{
  if (lim == NULL)
    lim = &wr_extract_defaults;
  if (lseek (fd, 0, SEEK_SET) < 0 && errno != ESPIPE)
    return wr_sys_error (err, "seek");
  _cleanup_ (src_freep) struct src_reader *rd = malloc (sizeof *rd);
  if (rd == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  _cleanup_ (archive_freep) struct archive *a = archive_open (fd, false, rd);
  struct archive_entry *e;
  if (a == NULL || archive_read_next_header (a, &e) != ARCHIVE_OK)
    return wr_error (err, 0, WR_E_INVALID, "not a readable archive");
  struct xctx x = { .a = a, .lim = lim };
  struct wr_sha256 h;
  wr_sha256_init (&h);
  uint64_t total = 0;
  for (;;)
    {
      const void *buf;
      size_t size;
      la_int64_t off;
      int r = archive_read_data_block (a, &buf, &size, &off);
      if (r == ARCHIVE_EOF)
        break;
      if (r < ARCHIVE_WARN)
        return wr_error (err, 0, WR_E_INVALID, "corrupt or truncated archive: %s",
                         archive_error_string (a));
      total += size;
      r = check_growth (&x, total, true, "(stream)", err);
      if (r < 0)
        return r;
      wr_sha256_update (&h, buf, size);
    }
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, hex);
  if (lseek (fd, 0, SEEK_SET) < 0 && errno != ESPIPE)
    return wr_sys_error (err, "seek");
  return 0;
}

int
wr_tar_extract (int archive_fd, int root_dfd, struct wr_extract_stats *stats, wr_err_t *err)
{
  return wr_tar_extract_ex (archive_fd, root_dfd, 0, NULL, stats, err);
}

int
wr_tar_extract_ex (int archive_fd, int root_dfd, unsigned flags,
                   const struct wr_extract_limits *lim, struct wr_extract_stats *stats,
                   wr_err_t *err)
{
  memset (stats, 0, sizeof *stats);
  if (lim == NULL)
    lim = &wr_extract_defaults;
  _cleanup_ (src_freep) struct src_reader *rd = malloc (sizeof *rd);
  if (rd == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  _cleanup_ (archive_freep) struct archive *a = archive_open (archive_fd, true, rd);
  if (a == NULL)
    return wr_error (err, 0, WR_E_INVALID, "not a tar archive");

  /* mkdtemp made the root 0700 with the current time: give it rootfs
   * defaults and a fixed time so identical archives give identical layers */
  if (fchmod (root_dfd, 0755) < 0)
    return wr_sys_error (err, "chmod layer root");
  __attribute__ ((cleanup (dir_times_free))) struct dir_times dirs = { 0 };
  struct timespec zero[2] = { { 0, 0 }, { 0, 0 } };
  if (dir_times_add (&dirs, "", zero) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");

  struct xctx x = { .a = a, .flags = flags, .lim = lim, .dirs = &dirs, .stats = stats };
  for (;;)
    {
      struct archive_entry *e;
      int r = archive_read_next_header (a, &e);
      if (r == ARCHIVE_EOF)
        break;
      if (r < ARCHIVE_WARN)
        return wr_error (err, 0, WR_E_INVALID, "%s: %s",
                         stats->entries ? "corrupt or truncated archive" : "not a tar archive",
                         archive_error_string (a));
      if (lim->max_entries && stats->entries >= lim->max_entries)
        return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                         "archive has more than %llu entries; see 'Limits' in docs/images.md",
                         (unsigned long long)lim->max_entries);
      stats->entries++;
      r = extract_entry (&x, e, root_dfd, err);
      if (r < 0)
        return r;
    }
  if (stats->entries == 0)
    return wr_error (err, 0, WR_E_INVALID, "archive has no entries");
  int r = src_finish (rd, stats->source, err);
  if (r < 0)
    return r;
  return dir_times_apply (root_dfd, &dirs, err);
}

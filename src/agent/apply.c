/* The FILE op "apply" (docs/protocol.md): a restore in place in a VM guest.
 *
 * The daemon compares the guest's layer with a checkpoint (src/daemon/
 * fsdiff.c, as for a container) and sends what differs as a tar of the
 * checkpoint's entries, with OCI ".wh.NAME" entries for what must go. The
 * agent writes it through the sandbox's own root, as the daemon's restore
 * writes a container's: every path resolved inside the root
 * (ag_open_parent_in_root), files put in place by rename, the tasks cgroup
 * frozen meanwhile and new requests held (main.c), so the processes keep
 * running and see the checkpoint's files when they are thawed. The stream
 * comes from the daemon, which the agent trusts; it is parsed with bounds
 * all the same (pax records at most 64 KiB, paths at most PATH_MAX). */
#include "agent/agent.h"
#include "common/proto.h"
#include "common/util.h"

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define PAX_MAX (64u << 10)

enum phase
{
  PH_HEADER,
  PH_PAX,  /* a pax 'x' record block, for the next entry */
  PH_DATA, /* a file's data into fd */
  PH_SKIP, /* padding, or data nobody wants */
};

struct fapply
{
  struct ag_req r;
  enum phase ph;
  uint8_t hdr[512];
  size_t hdr_len;
  char *pax;
  size_t pax_len, pax_want;
  char pax_path[PATH_MAX], pax_link[PATH_MAX];
  uint64_t pax_size;
  bool has_pax_size;
  uint64_t left, pad;
  int fd, dir_fd; /* the file being written and its directory */
  char tmp[64], name[NAME_MAX + 1];
  struct stat meta; /* owner, mode, mtime of the file being written */
  bool frozen;
  uint64_t entries;
};

static void
fapply_free (struct fapply *a)
{
  ag_req_unlink (&a->r);
  if (a->fd >= 0)
    {
      close (a->fd);
      unlinkat (a->dir_fd, a->tmp, 0);
    }
  if (a->dir_fd >= 0)
    close (a->dir_fd);
  free (a->pax);
  if (a->frozen)
    ag_cg_freeze (false);
  ag.exporting--;
  ag.applying--;
  ag_defer_free (a);
}

int
ag_apply_start (uint32_t stream, json_t *body, wr_err_t *err)
{
  (void)body;
  struct fapply *a = calloc (1, sizeof *a);
  if (a == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  a->r.stream = stream;
  a->r.kind = AG_REQ_APPLY;
  a->fd = a->dir_fd = -1;
  snprintf (a->tmp, sizeof a->tmp, ".warren-restore-%d", (int)getpid ());
  ag.exporting++;
  ag.applying++;
  a->frozen = ag_cg_freeze (true) > 0;
  ag_req_link (&a->r);
  return 0;
}

static uint64_t
octal (const uint8_t *f, size_t len)
{
  uint64_t v = 0;
  for (size_t i = 0; i < len && f[i] >= '0' && f[i] <= '7'; i++)
    v = v * 8 + (uint64_t)(f[i] - '0');
  return v;
}

/* "LEN key=value\n" records: path, linkpath and size are used */
static void
pax_parse (struct fapply *a)
{
  size_t off = 0;
  while (off < a->pax_len)
    {
      char *end;
      unsigned long n = strtoul (a->pax + off, &end, 10);
      if (n == 0 || *end != ' ' || off + n > a->pax_len || a->pax[off + n - 1] != '\n')
        return;
      char *key = end + 1, *eq = memchr (key, '=', (size_t)(a->pax + off + n - key));
      if (eq)
        {
          size_t kl = (size_t)(eq - key), vl = (size_t)(a->pax + off + n - 1 - (eq + 1));
          char *dst = kl == 4 && memcmp (key, "path", 4) == 0       ? a->pax_path
                      : kl == 8 && memcmp (key, "linkpath", 8) == 0 ? a->pax_link
                                                                    : NULL;
          if (dst && vl < PATH_MAX)
            {
              memcpy (dst, eq + 1, vl);
              dst[vl] = '\0';
            }
          if (kl == 4 && memcmp (key, "size", 4) == 0)
            {
              a->pax_size = strtoull (eq + 1, NULL, 10);
              a->has_pax_size = true;
            }
        }
      off += n;
    }
}

static int
set_meta (int dfd, const char *name, const struct stat *st, bool link)
{
  if (fchownat (dfd, name, st->st_uid, st->st_gid, AT_SYMLINK_NOFOLLOW) < 0)
    return -errno;
  if (!link && fchmodat (dfd, name, st->st_mode & 07777, 0) < 0)
    return -errno;
  struct timespec ts[2] = { st->st_mtim, st->st_mtim };
  utimensat (dfd, name, ts, AT_SYMLINK_NOFOLLOW);
  return 0;
}

/* The entry at rel (no leading slash) in the live tree, as the header says;
 * a regular file's data follows (a->fd). */
static int
apply_entry (struct fapply *a, const char *rel, char type, const char *link, uint64_t size,
             wr_err_t *err)
{
  char abs[PATH_MAX + 2], base[NAME_MAX + 1];
  while (rel[0] == '.' && rel[1] == '/')
    rel += 2;
  size_t rl = strlen (rel);
  while (rl > 0 && rel[rl - 1] == '/')
    rl--;
  if (rl == 0 || rl >= PATH_MAX)
    return 0; /* the root itself keeps its owner and mode */
  snprintf (abs, sizeof abs, "/%.*s", (int)rl, rel);
  _cleanup_close_ int pfd = ag_open_parent_in_root (ag.rootfd, abs, base, ag.use_openat2, err);
  if (pfd < 0)
    return strncmp (base, ".wh.", 4) == 0 || err->errnum == ENOENT ? 0 : pfd;
  struct stat cur;
  if (strncmp (base, ".wh.", 4) == 0)
    {
      int r = wr_rm_rf_at (pfd, base + 4);
      return r < 0 && r != -ENOENT
                 ? wr_error (err, -r, ag_errno_code (-r), "restore: remove %s", abs)
                 : 0;
    }
  bool exists = fstatat (pfd, base, &cur, AT_SYMLINK_NOFOLLOW) == 0;
  if (type == '5')
    {
      if (exists && !S_ISDIR (cur.st_mode) && unlinkat (pfd, base, 0) < 0)
        return wr_sys_error (err, "restore: remove %s", abs);
      if ((!exists || !S_ISDIR (cur.st_mode)) && mkdirat (pfd, base, 0700) < 0)
        return wr_sys_error (err, "restore: mkdir %s", abs);
      return set_meta (pfd, base, &a->meta, false) < 0
                 ? wr_sys_error (err, "restore: owner and mode of %s", abs)
                 : 0;
    }
  if (type != '0' && type != '2')
    return 0; /* what a restore does not make (devices, fifos) */
  if (exists && S_ISDIR (cur.st_mode))
    {
      int r = wr_rm_rf_at (pfd, base);
      if (r < 0)
        return wr_error (err, -r, ag_errno_code (-r), "restore: remove %s", abs);
    }
  unlinkat (pfd, a->tmp, 0);
  if (type == '2')
    {
      if (symlinkat (link, pfd, a->tmp) < 0 || set_meta (pfd, a->tmp, &a->meta, true) < 0
          || renameat (pfd, a->tmp, pfd, base) < 0)
        {
          int r = wr_sys_error (err, "restore: symlink %s", abs);
          unlinkat (pfd, a->tmp, 0);
          return r;
        }
      return 0;
    }
  a->fd = openat (pfd, a->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (a->fd < 0)
    return wr_sys_error (err, "restore: create %s", abs);
  a->dir_fd = TAKE_FD (pfd);
  snprintf (a->name, sizeof a->name, "%s", base);
  a->left = size;
  return 0;
}

/* the file is complete: its owner, mode, time, and into place */
static int
file_done (struct fapply *a, wr_err_t *err)
{
  close (a->fd);
  a->fd = -1;
  int r = 0;
  if (set_meta (a->dir_fd, a->tmp, &a->meta, false) < 0
      || renameat (a->dir_fd, a->tmp, a->dir_fd, a->name) < 0)
    {
      r = wr_sys_error (err, "restore: put %s in place", a->name);
      unlinkat (a->dir_fd, a->tmp, 0);
    }
  close (a->dir_fd);
  a->dir_fd = -1;
  return r;
}

static int
header (struct fapply *a, wr_err_t *err)
{
  const uint8_t *h = a->hdr;
  bool zero = true;
  for (int i = 0; i < 512 && zero; i++)
    zero = h[i] == 0;
  if (zero)
    return 0; /* the end blocks */
  char type = (char)h[156];
  uint64_t size = a->has_pax_size ? a->pax_size : octal (h + 124, 12);
  uint64_t pad = (512 - size % 512) % 512;
  if (type == 'x' || type == 'g')
    {
      if (size > PAX_MAX)
        return wr_error (err, EINVAL, WR_E_INVALID, "restore: a pax header of %llu bytes",
                         (unsigned long long)size);
      a->pax_want = (size_t)size;
      a->pax_len = 0;
      a->pad = pad;
      a->ph = type == 'x' ? PH_PAX : PH_SKIP;
      if (type == 'g')
        a->left = size;
      return 0;
    }
  char path[PATH_MAX + 260], link[PATH_MAX];
  if (a->pax_path[0])
    snprintf (path, sizeof path, "%s", a->pax_path);
  else if (h[345])
    snprintf (path, sizeof path, "%.155s/%.100s", (const char *)h + 345, (const char *)h);
  else
    snprintf (path, sizeof path, "%.100s", (const char *)h);
  if (a->pax_link[0])
    snprintf (link, sizeof link, "%s", a->pax_link);
  else
    snprintf (link, sizeof link, "%.100s", (const char *)h + 157);
  memset (&a->meta, 0, sizeof a->meta);
  a->meta.st_mode = (mode_t)octal (h + 100, 8);
  a->meta.st_uid = (uid_t)octal (h + 108, 8);
  a->meta.st_gid = (gid_t)octal (h + 116, 8);
  a->meta.st_mtim.tv_sec = (time_t)octal (h + 136, 12);
  a->pax_path[0] = a->pax_link[0] = '\0';
  a->has_pax_size = false;
  a->entries++;
  int r = apply_entry (a, path, type == '\0' ? '0' : type, link, size, err);
  if (r < 0)
    return r;
  a->pad = pad;
  if (a->fd >= 0)
    {
      a->ph = PH_DATA;
      if (size == 0)
        {
          a->ph = PH_SKIP;
          a->left = 0;
          return file_done (a, err);
        }
      return 0;
    }
  a->left = type == '0' || type == '\0' ? size : 0; /* data nobody writes */
  a->ph = PH_SKIP;
  return 0;
}

static int
feed (struct fapply *a, const uint8_t *p, size_t len, wr_err_t *err)
{
  while (len > 0)
    {
      size_t n;
      switch (a->ph)
        {
        case PH_HEADER:
          n = 512 - a->hdr_len < len ? 512 - a->hdr_len : len;
          memcpy (a->hdr + a->hdr_len, p, n);
          a->hdr_len += n;
          if (a->hdr_len == 512)
            {
              a->hdr_len = 0;
              int r = header (a, err);
              if (r < 0)
                return r;
            }
          break;
        case PH_PAX:
          if (a->pax == NULL && (a->pax = malloc (PAX_MAX)) == NULL)
            return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
          n = a->pax_want - a->pax_len < len ? a->pax_want - a->pax_len : len;
          memcpy (a->pax + a->pax_len, p, n);
          a->pax_len += n;
          if (a->pax_len == a->pax_want)
            {
              pax_parse (a);
              a->left = 0;
              a->ph = PH_SKIP;
            }
          break;
        case PH_DATA:
          n = a->left < len ? (size_t)a->left : len;
          if (wr_write_all (a->fd, p, n) < 0)
            return wr_sys_error (err, "restore: write %s", a->name);
          a->left -= n;
          if (a->left == 0)
            {
              a->ph = PH_SKIP;
              int r = file_done (a, err);
              if (r < 0)
                return r;
            }
          break;
        case PH_SKIP:
        default:
          {
            uint64_t want = a->left + a->pad;
            n = want < len ? (size_t)want : len;
            uint64_t from_left = n < a->left ? n : a->left;
            a->left -= from_left;
            a->pad -= n - from_left;
            if (a->left == 0 && a->pad == 0)
              a->ph = PH_HEADER;
            break;
          }
        }
      p += n;
      len -= n;
    }
  return 0;
}

void
ag_apply_data (struct ag_req *r, const uint8_t *data, size_t len)
{
  struct fapply *a = (struct fapply *)r;
  wr_err_t err = { 0 };
  if (len > 0)
    {
      if (feed (a, data, len, &err) < 0)
        {
          /* as a failed write: the rest of the stream is ignored */
          ag_send_error (r->stream, &err);
          fapply_free (a);
        }
      return;
    }
  if (a->ph != PH_HEADER || a->fd >= 0)
    ag_send_errorf (r->stream, EINVAL, WR_E_INVALID, "restore: the stream ended inside an entry");
  else
    ag_send_json (r->stream, WR_MSG_RESULT,
                  json_pack ("{s:I,s:b}", "entries", (json_int_t)a->entries, "frozen", a->frozen));
  fapply_free (a);
}

void
ag_apply_orphan (struct ag_req *r)
{
  fapply_free ((struct fapply *)r);
}

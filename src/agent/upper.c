/* The FILE op "export" (docs/protocol.md): the writable layer of a VM guest
 * as one tar stream, the way the daemon's pack reads a container's upper.
 *
 * The guest's init mounts the upper ext4 disk (serial "wupper") at /mnt/rw
 * in the initramfs, which switch_root hides from us. So the agent mounts the
 * same disk again as a detached, read-only mount (fsopen/fsmount): the
 * kernel hands back the superblock the overlay uses, so we read exactly
 * what the guest sees, page cache included, and nothing needs a sync. The
 * tasks cgroup is frozen while the walk runs (a consistent view: every
 * write syscall of a task finished or not started), and EXEC/FILE requests
 * that arrive meanwhile wait (main.c), so what the daemon asked before the
 * export is in it and what it asked after is not.
 *
 * The stream is POSIX pax: overlay whiteouts (0/0 character devices) become
 * OCI ".wh.NAME" entries and opaque directories a ".wh..wh..opq" entry, user
 * xattrs travel as SCHILY.xattr records, and other overlay bookkeeping
 * stays behind. Sockets, fifos and devices are skipped. The daemon treats
 * all of it as hostile input (src/daemon/guest_upper.c). It is produced a
 * piece at a time from the event loop, paced like a file read. */
#include "agent/agent.h"
#include "common/proto.h"
#include "common/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include "backend/syscalls.h"

#define EXPORT_MAX_DEPTH 256
#define UPPER_SERIAL "wupper"

/* --upper DIR (tests): export this directory instead of the guest's disk */
const char *ag_upper_dir;

struct level
{
  DIR *d;
  size_t plen; /* length of the path prefix of this directory ("a/b/") */
};

struct hlink
{
  dev_t dev;
  ino_t ino;
  char *path;
};

struct fexport
{
  struct ag_req r;
  int mnt_fd; /* the detached mount, -1 without one */
  bool frozen;
  struct level stack[EXPORT_MAX_DEPTH];
  int depth;
  char path[PATH_MAX + NAME_MAX + 2];
  int file_fd; /* a regular file whose data is being sent */
  uint64_t file_left;
  size_t file_pad;
  bool ended;
  struct hlink *links;
  size_t n_links, cap_links;
  uint8_t *out;
  size_t out_len, out_cap;
  bool scrub;         /* pack: leave out what wr_pack_scrubbed names */
  uint64_t max, sent; /* the daemon's bound on the stream, bytes produced */
  uint64_t entries, bytes, skipped, scrubbed;
};

static int
out_room (struct fexport *x, size_t more)
{
  if (x->out_len + more <= x->out_cap)
    return 0;
  size_t cap = x->out_cap ? x->out_cap : AG_CHUNK * 2;
  while (cap < x->out_len + more)
    cap *= 2;
  uint8_t *n = realloc (x->out, cap);
  if (n == NULL)
    return -ENOMEM;
  x->out = n;
  x->out_cap = cap;
  return 0;
}

static void
octal (char *field, size_t len, uint64_t v)
{
  snprintf (field, len, "%0*llo", (int)len - 1, (unsigned long long)v);
}

/* one pax record "LEN key=value\n"; LEN counts itself */
static int
pax_add (char **buf, size_t *len, const char *key, const void *val, size_t vlen)
{
  size_t body = 1 + strlen (key) + 1 + vlen + 1, n = body + 1;
  for (;;)
    {
      char d[24];
      size_t dl = (size_t)snprintf (d, sizeof d, "%zu", n);
      if (dl + body == n)
        break;
      n = dl + body;
    }
  char *nb = realloc (*buf, *len + n);
  if (nb == NULL)
    return -ENOMEM;
  int hl = sprintf (nb + *len, "%zu %s=", n, key);
  memcpy (nb + *len + hl, val, vlen);
  nb[*len + n - 1] = '\n';
  *buf = nb;
  *len += n;
  return 0;
}

static void
header_seal (uint8_t h[512])
{
  memset (h + 148, ' ', 8);
  unsigned sum = 0;
  for (int i = 0; i < 512; i++)
    sum += h[i];
  snprintf ((char *)h + 148, 8, "%06o", sum);
  h[155] = ' ';
}

static void
header_fill (uint8_t h[512], const char *name, char type, uint64_t size, const struct stat *st,
             const char *link)
{
  memset (h, 0, 512);
  memcpy (h, name, strnlen (name, 100));
  octal ((char *)h + 100, 8, st->st_mode & 07777);
  octal ((char *)h + 108, 8, st->st_uid <= 07777777 ? st->st_uid : 0);
  octal ((char *)h + 116, 8, st->st_gid <= 07777777 ? st->st_gid : 0);
  octal ((char *)h + 124, 12, size <= 077777777777ull ? size : 0);
  uint64_t mt = st->st_mtim.tv_sec > 0 ? (uint64_t)st->st_mtim.tv_sec : 0;
  octal ((char *)h + 136, 12, mt <= 077777777777ull ? mt : 0);
  h[156] = (uint8_t)type;
  if (link)
    memcpy (h + 157, link, strnlen (link, 100));
  memcpy (h + 257, "ustar", 6);
  memcpy (h + 263, "00", 2);
  header_seal (h);
}

static int
xattrs_add (int dirfd, const char *name, char **pax, size_t *plen)
{
  /* through the magic link of an O_PATH fd, which lands on the entry
   * itself: a symlink's own xattrs, never its target's */
  char path[64], names[4096];
  _cleanup_close_ int fd = openat (dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return 0;
  snprintf (path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = listxattr (path, names, sizeof names);
  for (char *k = names; n > 0 && k < names + n; k += strlen (k) + 1)
    {
      if (strncmp (k, "user.", 5) != 0 || strncmp (k, "user.overlay.", 13) == 0)
        continue; /* overlay bookkeeping, security.* and trusted.* stay */
      char val[4096], key[300];
      ssize_t vl = getxattr (path, k, val, sizeof val);
      if (vl < 0)
        continue;
      snprintf (key, sizeof key, "SCHILY.xattr.%s", k);
      if (pax_add (pax, plen, key, val, (size_t)vl) < 0)
        return -ENOMEM;
    }
  return 0;
}

/* Queue one entry: a pax header when a field does not fit ustar (or xattrs
 * come along), then the ustar header. rel has no leading slash. */
static int
emit (struct fexport *x, int dirfd, const char *name, const char *rel, char type, uint64_t size,
      const struct stat *st, const char *link, wr_err_t *err)
{
  _cleanup_free_ char *pax = NULL;
  size_t plen = 0;
  int r = 0;
  if (strlen (rel) >= 100)
    r = pax_add (&pax, &plen, "path", rel, strlen (rel));
  if (r == 0 && link && strlen (link) >= 100)
    r = pax_add (&pax, &plen, "linkpath", link, strlen (link));
  char num[24];
  if (r == 0 && size > 077777777777ull)
    r = pax_add (&pax, &plen, "size", num, (size_t)sprintf (num, "%llu", (unsigned long long)size));
  if (r == 0 && st->st_uid > 07777777)
    r = pax_add (&pax, &plen, "uid", num, (size_t)sprintf (num, "%u", (unsigned)st->st_uid));
  if (r == 0 && st->st_gid > 07777777)
    r = pax_add (&pax, &plen, "gid", num, (size_t)sprintf (num, "%u", (unsigned)st->st_gid));
  if (r == 0 && dirfd >= 0 && type != '1')
    r = xattrs_add (dirfd, name, &pax, &plen);
  if (r < 0 || out_room (x, 512 * 3 + plen) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  /* what this entry adds to the stream, its data included: past the
   * daemon's bound, the export fails here rather than the connection */
  uint64_t adds = 512 * 3 + plen + (type == '0' ? size + 511 : 0);
  if (x->sent + adds + 1024 > x->max) /* 1024: the end of the archive */
    return wr_error (err, EFBIG, WR_E_TOO_LARGE,
                     "the writable layer's stream would pass %llu bytes at %s (twice the "
                     "sandbox's disk plus 64 MiB; sparse files count at their full size)",
                     (unsigned long long)x->max, rel);
  x->sent += adds;
  if (plen)
    {
      struct stat pst = { .st_mode = 0644 };
      header_fill (x->out + x->out_len, "PaxHeader", 'x', plen, &pst, NULL);
      x->out_len += 512;
      memcpy (x->out + x->out_len, pax, plen);
      size_t padded = (plen + 511) & ~(size_t)511;
      memset (x->out + x->out_len + plen, 0, padded - plen);
      x->out_len += padded;
    }
  header_fill (x->out + x->out_len, rel, type, size, st, link);
  x->out_len += 512;
  x->entries++;
  return 0;
}

static void
fexport_free (struct fexport *x)
{
  ag_req_unlink (&x->r);
  for (int i = 0; i < x->depth; i++)
    closedir (x->stack[i].d);
  if (x->file_fd >= 0)
    close (x->file_fd);
  for (size_t i = 0; i < x->n_links; i++)
    free (x->links[i].path);
  free (x->links);
  free (x->out);
  if (x->mnt_fd >= 0)
    close (x->mnt_fd);
  if (x->frozen)
    ag_cg_freeze (false);
  ag.exporting--;
  ag_defer_free (x);
}

/* /dev/NAME of the virtio disk whose serial is UPPER_SERIAL */
static int
find_upper_disk (char *dev, size_t len, wr_err_t *err)
{
  _cleanup_closedir_ DIR *d = opendir ("/sys/block");
  if (d == NULL)
    return wr_sys_error (err, "open /sys/block");
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      char path[300], serial[64];
      snprintf (path, sizeof path, "/sys/block/%s/serial", de->d_name);
      _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC);
      ssize_t n = fd >= 0 ? read (fd, serial, sizeof serial - 1) : -1;
      if (n <= 0)
        continue;
      serial[n] = '\0';
      serial[strcspn (serial, "\n")] = '\0';
      if (strcmp (serial, UPPER_SERIAL) == 0)
        {
          snprintf (dev, len, "/dev/%s", de->d_name);
          return 0;
        }
    }
  return wr_error (err, ENODEV, WR_E_UNSUPPORTED,
                   "this guest has no writable layer disk (serial \"" UPPER_SERIAL
                   "\"): only microvm and vm guests booted from image layers have one");
}

/* The guest's upper directory (the overlay's upperdir, /mnt/rw/u of the
 * init) through a detached read-only mount of the upper disk. */
static int
open_guest_upper (int *ret_mnt, wr_err_t *err)
{
  char dev[300];
  int r = find_upper_disk (dev, sizeof dev, err);
  if (r < 0)
    return r;
  _cleanup_close_ int fs = (int)syscall (__NR_fsopen, "ext4", FSOPEN_CLOEXEC);
  if (fs < 0)
    return wr_sys_error (err, "fsopen ext4");
  /* no "ro" here: the superblock is the live one, read-write; read-only is
   * this mount's attribute */
  if (syscall (__NR_fsconfig, fs, FSCONFIG_SET_STRING, "source", dev, 0) < 0
      || syscall (__NR_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
    return wr_sys_error (err, "mount %s again", dev);
  _cleanup_close_ int mnt
      = (int)syscall (__NR_fsmount, fs, FSMOUNT_CLOEXEC,
                      MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC);
  if (mnt < 0)
    return wr_sys_error (err, "fsmount %s", dev);
  int u = openat (mnt, "u", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (u < 0)
    return wr_sys_error (err, "open the upper directory of %s", dev);
  *ret_mnt = TAKE_FD (mnt);
  return u;
}

static bool
is_opaque (int fd)
{
  char v[4];
  ssize_t n = fgetxattr (fd, "user.overlay.opaque", v, sizeof v);
  return n == 1 && v[0] == 'y';
}

static int
push_dir (struct fexport *x, int fd, size_t plen, wr_err_t *err)
{
  if (x->depth == EXPORT_MAX_DEPTH)
    {
      close (fd);
      return wr_error (err, ELOOP, WR_E_INVALID, "%s: directories nested too deep", x->path);
    }
  DIR *d = fdopendir (fd);
  if (d == NULL)
    {
      close (fd);
      return wr_sys_error (err, "opendir %s", x->path);
    }
  x->stack[x->depth++] = (struct level){ d, plen };
  return 0;
}

int
ag_export_start (uint32_t stream, json_t *body, wr_err_t *err)
{
  json_t *scrub = json_object_get (body, "scrub"), *max = json_object_get (body, "max_bytes");
  if (scrub && !json_is_boolean (scrub))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"scrub\" must be a boolean");
  if (max && (!json_is_integer (max) || json_integer_value (max) < 0))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"max_bytes\" must be a positive integer");
  struct fexport *x = calloc (1, sizeof *x);
  if (x == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  x->scrub = json_is_true (scrub);
  x->max = max && json_integer_value (max) > 0 ? (uint64_t)json_integer_value (max) : UINT64_MAX;
  x->r.stream = stream;
  x->r.kind = AG_REQ_EXPORT;
  x->mnt_fd = -1;
  x->file_fd = -1;
  int u;
  if (ag_upper_dir)
    {
      u = open (ag_upper_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (u < 0)
        u = wr_sys_error (err, "open %s", ag_upper_dir);
    }
  else
    u = open_guest_upper (&x->mnt_fd, err);
  if (u < 0)
    {
      free (x);
      return u;
    }
  ag.exporting++;
  ag_req_link (&x->r);
  /* the root entry: mode and owner of / itself, and whether it is opaque */
  struct stat st;
  int r = fstat (u, &st) < 0 ? wr_sys_error (err, "stat the upper") : 0;
  if (r == 0)
    {
      /* only guest tasks: never the agent, nor a container's delegated tree */
      x->frozen = x->mnt_fd >= 0 && ag_cg_freeze (true) > 0;
      r = emit (x, -1, NULL, "./", '5', 0, &st, NULL, err);
      if (r == 0 && is_opaque (u))
        r = emit (x, -1, NULL, "./.wh..wh..opq", '0', 0, &st, NULL, err);
    }
  if (r == 0)
    r = push_dir (x, u, 0, err);
  else
    close (u);
  if (r < 0)
    {
      fexport_free (x);
      return r;
    }
  return 0;
}

/* the next entry of the walk into x->out; false at its end */
static int
walk_one (struct fexport *x, wr_err_t *err)
{
  struct level *top = &x->stack[x->depth - 1];
  errno = 0;
  struct dirent *de = readdir (top->d);
  if (de == NULL)
    {
      if (errno != 0)
        return wr_sys_error (err, "readdir %.*s", (int)top->plen, x->path);
      closedir (top->d);
      x->depth--;
      return 0;
    }
  const char *name = de->d_name;
  if (strcmp (name, ".") == 0 || strcmp (name, "..") == 0)
    return 0;
  int dfd = dirfd (top->d);
  size_t nl = strlen (name);
  if (top->plen + nl + 2 > sizeof x->path)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "path too long under %.*s", (int)top->plen,
                     x->path);
  if (x->scrub)
    {
      /* the directory's own path, without its trailing slash */
      char dir[sizeof x->path];
      snprintf (dir, sizeof dir, "%.*s", top->plen ? (int)top->plen - 1 : 0, x->path);
      if (wr_pack_scrubbed (dir, name))
        {
          x->scrubbed++;
          return 0;
        }
    }
  memcpy (x->path + top->plen, name, nl + 1);
  struct stat st;
  if (fstatat (dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
    return errno == ENOENT ? 0 : wr_sys_error (err, "stat %s", x->path);
  int r = 0;
  if (S_ISDIR (st.st_mode))
    {
      int fd = openat (dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0)
        return wr_sys_error (err, "open %s", x->path);
      memcpy (x->path + top->plen + nl, "/", 2);
      r = emit (x, dfd, name, x->path, '5', 0, &st, NULL, err);
      if (r == 0 && is_opaque (fd))
        {
          char wh[sizeof x->path + 16];
          snprintf (wh, sizeof wh, "%s.wh..wh..opq", x->path);
          struct stat w = { .st_mode = 0644 };
          r = emit (x, -1, NULL, wh, '0', 0, &w, NULL, err);
        }
      if (r < 0)
        {
          close (fd);
          return r;
        }
      return push_dir (x, fd, top->plen + nl + 1, err);
    }
  if (S_ISREG (st.st_mode))
    {
      if (st.st_nlink > 1)
        {
          for (size_t i = 0; i < x->n_links; i++)
            if (x->links[i].dev == st.st_dev && x->links[i].ino == st.st_ino)
              return emit (x, -1, NULL, x->path, '1', 0, &st, x->links[i].path, err);
          if (wr_grow (&x->links, &x->cap_links, x->n_links + 1, sizeof *x->links, 16) < 0
              || (x->links[x->n_links].path = strdup (x->path)) == NULL)
            return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
          x->links[x->n_links].dev = st.st_dev;
          x->links[x->n_links].ino = st.st_ino;
          x->n_links++;
        }
      int fd = openat (dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
      if (fd < 0)
        return wr_sys_error (err, "open %s", x->path);
      r = emit (x, dfd, name, x->path, '0', (uint64_t)st.st_size, &st, NULL, err);
      if (r < 0)
        {
          close (fd);
          return r;
        }
      x->file_fd = fd;
      x->file_left = (uint64_t)st.st_size;
      x->file_pad = (512 - (size_t)(st.st_size % 512)) % 512;
      x->bytes += (uint64_t)st.st_size;
      return 0;
    }
  if (S_ISLNK (st.st_mode))
    {
      char target[PATH_MAX];
      ssize_t n = readlinkat (dfd, name, target, sizeof target - 1);
      if (n < 0)
        return wr_sys_error (err, "readlink %s", x->path);
      target[n] = '\0';
      r = emit (x, dfd, name, x->path, '2', 0, &st, target, err);
    }
  else if (S_ISCHR (st.st_mode) && st.st_rdev == makedev (0, 0))
    {
      /* an overlay whiteout: the deletion this layer records */
      char wh[sizeof x->path + 8];
      snprintf (wh, sizeof wh, "%.*s.wh.%s", (int)top->plen, x->path, name);
      struct stat w = { .st_mode = 0644, .st_mtim = st.st_mtim };
      r = emit (x, -1, NULL, wh, '0', 0, &w, NULL, err);
    }
  else
    x->skipped++; /* sockets, fifos, devices */
  return r;
}

/* file data into x->out: at most one chunk */
static int
data_one (struct fexport *x, wr_err_t *err)
{
  size_t want = x->file_left < AG_CHUNK ? (size_t)x->file_left : AG_CHUNK;
  if (out_room (x, want + 512) < 0)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  ssize_t n = 0;
  if (want)
    {
      do
        n = read (x->file_fd, x->out + x->out_len, want);
      while (n < 0 && errno == EINTR);
      if (n < 0)
        return wr_sys_error (err, "read %s", x->path);
      if (n == 0)
        {
          /* shrank under us (a task the freeze missed): zeros, as tar does */
          memset (x->out + x->out_len, 0, want);
          n = (ssize_t)want;
        }
    }
  x->out_len += (size_t)n;
  x->file_left -= (uint64_t)n;
  if (x->file_left == 0)
    {
      memset (x->out + x->out_len, 0, x->file_pad);
      x->out_len += x->file_pad;
      close (x->file_fd);
      x->file_fd = -1;
    }
  return 0;
}

bool
ag_export_step (struct ag_req *r)
{
  struct fexport *x = (struct fexport *)r;
  if (r->orphan)
    {
      fexport_free (x);
      return false;
    }
  wr_err_t err = { 0 };
  while (x->out_len < AG_CHUNK && !x->ended)
    {
      int e;
      if (x->file_fd >= 0)
        e = data_one (x, &err);
      else if (x->depth > 0)
        e = walk_one (x, &err);
      else
        {
          /* the end: two zero blocks */
          e = out_room (x, 1024);
          if (e == 0)
            {
              memset (x->out + x->out_len, 0, 1024);
              x->out_len += 1024;
              x->ended = true;
            }
          else
            wr_error (&err, ENOMEM, WR_E_INTERNAL, "out of memory");
        }
      if (e < 0)
        {
          ag_send_error (r->stream, &err);
          fexport_free (x);
          return false;
        }
    }
  size_t off = 0;
  while (x->out_len - off >= AG_CHUNK || (x->ended && off < x->out_len))
    {
      size_t n = x->out_len - off < AG_CHUNK ? x->out_len - off : AG_CHUNK;
      ag_send (r->stream, WR_MSG_DATA, x->out + off, n);
      off += n;
    }
  memmove (x->out, x->out + off, x->out_len - off);
  x->out_len -= off;
  if (!x->ended)
    return true;
  ag_send_json (r->stream, WR_MSG_RESULT,
                json_pack ("{s:I,s:I,s:I,s:I,s:b}", "entries", (json_int_t)x->entries, "bytes",
                           (json_int_t)x->bytes, "skipped", (json_int_t)x->skipped, "scrubbed",
                           (json_int_t)x->scrubbed, "frozen", x->frozen));
  fexport_free (x);
  return false;
}

void
ag_export_orphan (struct ag_req *r)
{
  fexport_free ((struct fexport *)r);
}

/* pack: turn a live sandbox's changes into a layer and an image.
 *
 * The writable upper of a container is a tmpfs mounted only as a detached
 * mount inside the sandbox's mount namespace; its backend's upper_fd op
 * hands the daemon a directory fd of it (backends.c: pidfd_getfd of the
 * agent's --keep-fd, which also works after a daemon restart). The sandbox
 * is frozen while its upper is copied (a consistent snapshot), files are
 * shifted back from host uids to the sandbox's own view, and build
 * leftovers are scrubbed (docs/images.md). */
#include "daemon/images.h"
#include "daemon/log.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/guest_upper.h"
#include "daemon/http_util.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define MAX_DEPTH 256

static int
read_idmap (pid_t pid, const char *which, struct idmap *m, wr_err_t *err)
{
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/%s", (int)pid, which);
  _cleanup_fclose_ FILE *f = fopen (path, "re");
  if (f == NULL)
    return wr_sys_error (err, "open %s", path);
  m->n = 0;
  unsigned long a, b, c;
  while (m->n < 8 && fscanf (f, "%lu %lu %lu", &a, &b, &c) == 3)
    {
      m->in[m->n] = (uint32_t)a;
      m->out[m->n] = (uint32_t)b;
      m->count[m->n] = (uint32_t)c;
      m->n++;
    }
  return 0;
}

/* host id -> id inside the sandbox; unmapped ids become nobody */
static uint32_t
map_back (const struct idmap *m, uint32_t host)
{
  for (size_t i = 0; i < m->n; i++)
    if (host >= m->out[i] && host - m->out[i] < m->count[i])
      return m->in[i] + (host - m->out[i]);
  return 65534;
}

int
wrd_pack_begin (struct wrd *d, struct sandbox *sb, struct pack_snap *p, wr_err_t *err)
{
  memset (p, 0, sizeof *p);
  p->upper_fd = -1;
  if (sb->state == SB_DEAD || sb->state == SB_DESTROYING || !sb->has_container
      || !agent_conn_alive (sb->conn))
    return wr_error (err, 0, WR_E_GONE, "sandbox %s is dead; nothing to pack", sb->id);
  if (sb->ops->upper_fd == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "pack: the %s backend cannot hand out its writable layer", sb->backend);
  int fd = sb->ops->upper_fd (d, &sb->c, err);
  if (fd < 0)
    return fd;
  _cleanup_close_ int ufd = fd;
  int r = read_idmap (sb->c.pid, "uid_map", &p->uids, err);
  if (r == 0)
    r = read_idmap (sb->c.pid, "gid_map", &p->gids, err);
  if (r < 0)
    return r;
  p->layers = calloc (sb->n_layers ? sb->n_layers : 1, sizeof *p->layers);
  if (p->layers == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  memcpy (p->layers, sb->layers, sb->n_layers * sizeof *p->layers);
  p->n_layers = sb->n_layers;
  p->config = json_deep_copy (sb->img_conf ? sb->img_conf : json_null ());
  snprintf (p->id, sizeof p->id, "%s", sb->id);
  if (sb->state == SB_RUNNING)
    {
      r = sb->ops->freeze (d, &sb->c, true, err);
      if (r < 0)
        {
          free (p->layers);
          json_decref (p->config);
          return r;
        }
      p->froze = true;
    }
  sb->busy++;
  p->upper_fd = TAKE_FD (ufd);
  return 0;
}

void
wrd_pack_end (struct wrd *d, struct pack_snap *p)
{
  struct sandbox *sb = p->id[0] ? wrd_sandbox_find (d, p->id) : NULL;
  if (sb)
    {
      if (sb->busy)
        sb->busy--;
      wr_err_t err;
      if (p->froze && sb->state == SB_RUNNING && sb->has_container
          && sb->ops->freeze (d, &sb->c, false, &err) < 0)
        wrd_log (WRD_LOG_ERROR, "thaw %s after pack: %s\n", sb->id, err.msg);
    }
  if (p->upper_fd >= 0)
    close (p->upper_fd);
  p->upper_fd = -1;
  free (p->layers);
  p->layers = NULL;
  json_decref (p->config);
  p->config = NULL;
}

/* ---- copying the upper ---- */

struct hardlink
{
  dev_t dev;
  ino_t ino;
  char *rel;
};

struct copy
{
  const struct pack_snap *p;
  int dst_root;
  struct pack_stats *st;
  struct hardlink *links;
  size_t n_links, cap_links;
};

static int
copy_xattrs (int sfd, int dfd, const char *rel, wr_err_t *err)
{
  char names[8192];
  ssize_t n = flistxattr (sfd, names, sizeof names);
  if (n < 0)
    return errno == ENOTSUP ? 0 : wr_sys_error (err, "list xattrs of %s", rel);
  for (char *k = names; k < names + n; k += strlen (k) + 1)
    {
      char val[4096];
      ssize_t vl = fgetxattr (sfd, k, val, sizeof val);
      if (vl < 0)
        continue;
      if (strncmp (k, "user.overlay.", 13) == 0)
        {
          /* overlayfs bookkeeping (origin, impure) stays behind; opaque
           * directories are what a lower layer must keep */
          if (strcmp (k, "user.overlay.opaque") != 0 || vl != 1 || val[0] != 'y')
            continue;
        }
      else if (strncmp (k, "user.", 5) != 0)
        continue; /* security.* and trusted.* are not the sandbox's to hand on */
      if (fsetxattr (dfd, k, val, (size_t)vl, 0) < 0)
        return wr_sys_error (err, "set xattr %s on %s", k, rel);
    }
  return 0;
}

static int
apply_meta (const struct copy *c, int dfd, const struct stat *st, const char *rel, wr_err_t *err)
{
  if (fchown (dfd, map_back (&c->p->uids, st->st_uid), map_back (&c->p->gids, st->st_gid)) < 0)
    return wr_sys_error (err, "chown %s", rel);
  if (fchmod (dfd, st->st_mode & 07777) < 0)
    return wr_sys_error (err, "chmod %s", rel);
  return 0;
}

/* What a copied directory or file keeps of its source: xattrs, owner
 * (mapped back), mode, then times (last: the steps before change them). */
static int
copy_attrs (const struct copy *c, int sfd, int dfd, const struct stat *st, const char *rel,
            wr_err_t *err)
{
  int r = copy_xattrs (sfd, dfd, rel, err);
  if (r == 0)
    r = apply_meta (c, dfd, st, rel, err);
  if (r < 0)
    return r;
  const struct timespec ts[2] = { st->st_atim, st->st_mtim };
  if (futimens (dfd, ts) < 0)
    return wr_sys_error (err, "times of %s", rel);
  return 0;
}

static int
copy_data (int sfd, int dfd, const char *rel, wr_err_t *err)
{
  for (;;)
    {
      ssize_t n = copy_file_range (sfd, NULL, dfd, NULL, 1 << 30, 0);
      if (n == 0)
        return 0;
      if (n > 0)
        continue;
      if (errno == EINTR)
        continue;
      if (errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
        break;
      /* fall back to read/write */
      char buf[65536];
      for (;;)
        {
          ssize_t m = read (sfd, buf, sizeof buf);
          if (m < 0 && errno == EINTR)
            continue;
          if (m < 0)
            return wr_sys_error (err, "read %s", rel);
          if (m == 0)
            return 0;
          if (wr_write_all (dfd, buf, (size_t)m) < 0)
            break;
        }
      break;
    }
  int r = wr_sys_error (err, "copy %s", rel);
  if (errno == ENOSPC || errno == EDQUOT)
    err->code = WR_E_EXHAUSTED;
  return r;
}

static int
copy_dir (struct copy *c, int sfd, int dfd, const char *rel, int depth, wr_err_t *err)
{
  if (depth > MAX_DEPTH)
    return wr_error (err, 0, WR_E_INVALID, "%s: directories nested too deep", rel);
  _cleanup_closedir_ DIR *dir = wr_opendir_dup (sfd);
  if (dir == NULL)
    return wr_sys_error (err, "opendir %s", rel);
  struct dirent *de;
  while ((errno = 0, de = readdir (dir)) != NULL)
    {
      const char *name = de->d_name;
      if (strcmp (name, ".") == 0 || strcmp (name, "..") == 0)
        continue;
      char sub[4096];
      int sl = snprintf (sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "", name);
      if (sl < 0 || (size_t)sl >= sizeof sub)
        return wr_error (err, 0, WR_E_INVALID, "path too long under %s", rel);
      struct stat st;
      if (fstatat (sfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return wr_sys_error (err, "stat %s", sub);
      if (!c->p->keep_all && wr_pack_scrubbed (rel, name))
        {
          c->st->scrubbed++;
          continue;
        }
      struct timespec ts[2] = { st.st_atim, st.st_mtim };
      if (S_ISDIR (st.st_mode))
        {
          if (mkdirat (dfd, name, 0700) < 0)
            return wr_sys_error (err, "mkdir %s", sub);
          _cleanup_close_ int s2
              = openat (sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          _cleanup_close_ int d2
              = openat (dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          if (s2 < 0 || d2 < 0)
            return wr_sys_error (err, "open %s", sub);
          int r = copy_dir (c, s2, d2, sub, depth + 1, err);
          if (r == 0)
            r = copy_attrs (c, s2, d2, &st, sub, err);
          if (r < 0)
            return r;
        }
      else if (S_ISREG (st.st_mode))
        {
          if (st.st_nlink > 1)
            {
              bool linked = false;
              for (size_t i = 0; i < c->n_links && !linked; i++)
                if (c->links[i].dev == st.st_dev && c->links[i].ino == st.st_ino)
                  {
                    if (linkat (c->dst_root, c->links[i].rel, dfd, name, 0) < 0)
                      return wr_sys_error (err, "link %s", sub);
                    linked = true;
                  }
              if (linked)
                continue;
              int r = wr_grow (&c->links, &c->cap_links, c->n_links + 1, sizeof *c->links, 16);
              if (r < 0)
                return wr_error (err, -r, WR_E_INTERNAL, "out of memory");
              c->links[c->n_links] = (struct hardlink){ st.st_dev, st.st_ino, strdup (sub) };
              if (c->links[c->n_links].rel == NULL)
                return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
              c->n_links++;
            }
          _cleanup_close_ int s2 = openat (sfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
          _cleanup_close_ int d2
              = openat (dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
          if (s2 < 0 || d2 < 0)
            return wr_sys_error (err, "open %s", sub);
          int r = copy_data (s2, d2, sub, err);
          if (r == 0)
            r = copy_attrs (c, s2, d2, &st, sub, err);
          if (r < 0)
            return r;
          c->st->files++;
        }
      else if (S_ISLNK (st.st_mode))
        {
          char target[4096];
          ssize_t n = readlinkat (sfd, name, target, sizeof target - 1);
          if (n < 0)
            return wr_sys_error (err, "readlink %s", sub);
          target[n] = '\0';
          if (symlinkat (target, dfd, name) < 0
              || fchownat (dfd, name, map_back (&c->p->uids, st.st_uid),
                           map_back (&c->p->gids, st.st_gid), AT_SYMLINK_NOFOLLOW)
                     < 0
              || utimensat (dfd, name, ts, AT_SYMLINK_NOFOLLOW) < 0)
            return wr_sys_error (err, "symlink %s", sub);
          c->st->files++;
        }
      else if (S_ISCHR (st.st_mode) && st.st_rdev == makedev (0, 0))
        {
          /* an overlay whiteout: the deletion this layer records */
          if (mknodat (dfd, name, S_IFCHR | 0600, makedev (0, 0)) < 0)
            return wr_sys_error (err, "whiteout %s", sub);
          c->st->files++;
        }
      else
        c->st->skipped++; /* sockets (the agent's or anyone's), fifos, devices */
    }
  if (errno != 0)
    return wr_sys_error (err, "readdir %s", rel);
  return 0;
}

int
wrd_pack_commit (struct wr_store *s, struct pack_snap *p, const char *name,
                 const json_t *config_override, struct pack_stats *st, struct wr_image **ret,
                 wr_err_t *err)
{
  memset (st, 0, sizeof *st);
  /* before the slow copy: the new layer must fit on top */
  int r = wr_layers_check (p->n_layers + 1, "the packed image", err);
  if (r < 0)
    return r;
  char work[4096];
  r = wr_store_tmpdir (s, "pack", work, sizeof work, err);
  if (r < 0)
    return r;
  char tree[4200];
  snprintf (tree, sizeof tree, "%s/rootfs", work);
  struct copy c = { .p = p, .st = st };
  _cleanup_close_ int src = openat (p->upper_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (src < 0)
    r = wr_sys_error (err, "open the sandbox's upper dir");
  else if (mkdir (tree, 0755) < 0)
    r = wr_sys_error (err, "mkdir %s", tree);
  else if ((c.dst_root = open (tree, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW)) < 0)
    r = wr_sys_error (err, "open %s", tree);
  else
    {
      r = copy_dir (&c, src, c.dst_root, "", 0, err);
      struct stat rst;
      /* the layer root itself: the sandbox's / (mode, owner, opaque) */
      if (r == 0 && fstat (src, &rst) == 0)
        {
          r = copy_xattrs (src, c.dst_root, "/", err);
          if (r == 0)
            r = apply_meta (&c, c.dst_root, &rst, "/", err);
        }
      close (c.dst_root);
    }
  for (size_t i = 0; i < c.n_links; i++)
    free (c.links[i].rel);
  free (c.links);
  if (r == 0)
    {
      const char *base[WR_MAX_LAYERS];
      for (size_t i = 0; i < p->n_layers; i++)
        base[i] = p->layers[i];
      struct wr_import_opts o = {
        .base_layers = base,
        .n_base_layers = p->n_layers,
        .config = config_override ? config_override : p->config,
      };
      r = wr_image_import_ex (s, name, tree, &o, ret, err);
    }
  char *slash = strrchr (work, '/');
  *slash = '\0';
  _cleanup_close_ int pfd = open (work, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd >= 0)
    wr_rm_rf_at (pfd, slash + 1);
  return r;
}

/* ---- POST /v1/sandboxes/{id}/pack {"name":"NAME:TAG","stream":false} ---- */

struct pack_job
{
  struct wrd *d;
  struct wrd_stream *st;
  struct pack_snap snap;
  char name[256];
  struct pack_stats stats;
  struct wr_image *img;
  wr_err_t err;
  int r;
};

static void
pack_work (void *arg)
{
  struct pack_job *j = arg;
  wrd_stream_progress (j->st, "pack", 0, 1);
  j->r = wrd_pack_commit (j->d->store, &j->snap, j->name, NULL, &j->stats, &j->img, &j->err);
  if (j->r == 0)
    wrd_stream_progress (j->st, "pack", 1, 1);
}

static void
pack_reply (struct pack_job *j)
{
  json_t *res = NULL;
  if (j->r == 0)
    {
      res = wrd_image_json (j->img);
      json_object_set_new (res, "packed",
                           json_pack ("{s:I,s:I,s:I}", "files", (json_int_t)j->stats.files,
                                      "scrubbed", (json_int_t)j->stats.scrubbed, "skipped",
                                      (json_int_t)j->stats.skipped));
    }
  wrd_stream_finish (j->st, j->r, &j->err, res, 201);
  wr_image_free (j->img);
  free (j);
}

static void
pack_done (void *arg)
{
  struct pack_job *j = arg;
  wrd_pack_end (j->d, &j->snap);
  pack_reply (j);
}

/* a VM: its agent's export, committed (guest_upper.c) */
static void
pack_guest_done (struct wrd *d, void *ud, struct wrd_guest_snap *gs, wr_err_t *err)
{
  struct pack_job *j = ud;
  if (gs == NULL)
    {
      j->r = -1;
      j->err = *err;
    }
  else
    {
      j->img = gs->img;
      gs->img = NULL;
      j->stats = (struct pack_stats){ .files = gs->entries,
                                      .scrubbed = gs->scrubbed,
                                      .skipped = gs->skipped };
      wrd_stream_progress (j->st, "pack", 1, 1);
    }
  pack_reply (j);
}

void
wrd_http_pack (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  wr_err_t err;
  json_t *body;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  const char *name = json_string_value (json_object_get (body, "name"));
  json_t *sv = json_object_get (body, "stream");
  if (name == NULL || !wr_ref_valid (name) || strchr (name, '@') || strlen (name) >= 256
      || (sv && !json_is_boolean (sv)))
    {
      json_decref (body);
      wrd_reply_error_code (req, WR_E_INVALID,
                            "field \"name\" (NAME[:TAG], lowercase) is required; \"stream\" is a "
                            "boolean");
      return;
    }
  struct pack_job *j = calloc (1, sizeof *j);
  if (j == NULL)
    {
      json_decref (body);
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  j->d = d;
  snprintf (j->name, sizeof j->name, "%s", name);
  bool stream = json_is_true (sv);
  json_decref (body);
  if (sb->ops->upper_fd == NULL && wrd_guest_upper (sb))
    {
      if (wrd_guest_snap_start (d, sb, j->name, true, pack_guest_done, j, &err) < 0)
        {
          free (j);
          wrd_reply_error (req, &err);
          return;
        }
      j->st = wrd_stream_new (d, req, stream);
      wrd_stream_progress (j->st, "pack", 0, 1);
      return;
    }
  if (wrd_pack_begin (d, sb, &j->snap, &err) < 0)
    {
      free (j);
      wrd_reply_error (req, &err);
      return;
    }
  j->st = wrd_stream_new (d, req, stream);
  if (wrd_job_run (d, pack_work, pack_done, j) < 0)
    {
      wrd_pack_end (d, &j->snap);
      wr_error (&j->err, 0, WR_E_INTERNAL, "cannot start the pack worker");
      wrd_stream_finish (j->st, -1, &j->err, NULL, 0);
      free (j);
    }
}

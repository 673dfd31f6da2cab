/* FILE op "watch": directory change events from inotify, streamed as DATA
 * frames until the daemon ends the request (docs/protocol.md).
 *
 * One inotify instance serves every watch of the agent (instances are a
 * per-user resource, 128 by default, shared by every sandbox whose agent
 * runs as the same host user); it is closed when the last watch ends. Two
 * watches of one directory share its watch descriptor, so a descriptor is
 * removed only when no watch holds it any more. Directories are opened
 * inside the sandbox root like every FILE path and handed to inotify as
 * "." after an fchdir, so no path outside the root is ever named; a
 * recursive watch descends with openat(O_NOFOLLOW) one component at a
 * time and never follows a symlink. */
#include "agent/agent.h"
#include "common/proto.h"
#include "common/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <sys/stat.h>

#define WATCH_MASK                                                                                 \
  (IN_CREATE | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_EXCL_UNLINK    \
   | IN_ONLYDIR)
#define WATCH_MAX_DIRS 65536          /* per watch: a recursive watch of / stops here */
#define WATCH_FRAME_SOFT (256u << 10) /* flush a batch of events beyond this */

struct wdir
{
  int wd;
  char *rel; /* "" for the watched directory, "a/b" below it */
};

struct fwatch
{
  struct ag_req r;
  char *path; /* as asked: entries are stat'ed at path/rel/name */
  bool recursive, entry;
  struct wdir *dirs;
  size_t n_dirs, cap_dirs;
  json_t *batch; /* events of the current inotify read */
  size_t batch_bytes;
};

static struct ag_watch ino = { .fd = -1 };
static size_t n_watches;
static bool ino_paused;

static bool
wd_in_use (int wd, const struct fwatch *except)
{
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->kind == AG_REQ_WATCH && (const struct fwatch *)r != except)
      {
        const struct fwatch *w = (const struct fwatch *)r;
        for (size_t i = 0; i < w->n_dirs; i++)
          if (w->dirs[i].wd == wd)
            return true;
      }
  return false;
}

static void
fwatch_free (struct fwatch *w)
{
  for (size_t i = 0; i < w->n_dirs; i++)
    {
      if (ino.fd >= 0 && !wd_in_use (w->dirs[i].wd, w))
        inotify_rm_watch (ino.fd, w->dirs[i].wd);
      free (w->dirs[i].rel);
    }
  free (w->dirs);
  free (w->path);
  json_decref (w->batch);
  ag_req_unlink (&w->r);
  if (--n_watches == 0)
    ag_watch_close (&ino);
  ag_defer_free (w);
}

static void
batch_flush (struct fwatch *w)
{
  if (w->batch == NULL || json_array_size (w->batch) == 0)
    return;
  if (!w->r.orphan)
    ag_send_json (w->r.stream, WR_MSG_DATA, json_pack ("{s:O}", "events", w->batch));
  json_array_clear (w->batch);
  w->batch_bytes = 0;
}

static const char *
event_type (uint32_t mask)
{
  if (mask & (IN_CREATE | IN_MOVED_TO))
    return "create";
  if (mask & IN_MODIFY)
    return "write";
  if (mask & IN_DELETE)
    return "remove";
  if (mask & IN_MOVED_FROM)
    return "rename";
  if (mask & IN_ATTRIB)
    return "chmod";
  return NULL;
}

static int add_tree (struct fwatch *w, int dfd, const char *rel, wr_err_t *err);

/* Watch one directory (dfd) as rel; recursive: its subdirectories too. */
static int
add_dir (struct fwatch *w, int dfd, const char *rel, wr_err_t *err)
{
  if (w->n_dirs == WATCH_MAX_DIRS)
    return wr_error (err, ENOSPC, WR_E_EXHAUSTED, "more than %d directories to watch",
                     WATCH_MAX_DIRS);
  int r = wr_grow (&w->dirs, &w->cap_dirs, w->n_dirs + 1, sizeof *w->dirs, 8);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "out of memory");
  /* inotify takes a path: name the directory as "." from inside it, so
   * the kernel resolves nothing outside the fd we already hold */
  int wd = -1, e = 0;
  if (fchdir (dfd) == 0)
    {
      wd = inotify_add_watch (ino.fd, ".", WATCH_MASK);
      e = errno;
      if (chdir ("/") < 0)
        {
        }
    }
  else
    e = errno;
  if (wd < 0)
    return wr_error (err, e, e == ENOSPC ? WR_E_EXHAUSTED : ag_errno_code (e), "watch %s%s%s",
                     w->path, rel[0] ? "/" : "", rel);
  char *copy = strdup (rel);
  if (copy == NULL)
    {
      if (!wd_in_use (wd, w))
        inotify_rm_watch (ino.fd, wd);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }
  w->dirs[w->n_dirs++] = (struct wdir){ wd, copy };
  return w->recursive ? add_tree (w, dfd, rel, err) : 0;
}

static int
add_tree (struct fwatch *w, int dfd, const char *rel, wr_err_t *err)
{
  int dup = openat (dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  _cleanup_closedir_ DIR *d = dup >= 0 ? fdopendir (dup) : NULL;
  if (d == NULL)
    {
      if (dup >= 0)
        close (dup);
      return 0; /* unreadable: watch what we can */
    }
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
        continue;
      if (de->d_type != DT_DIR && de->d_type != DT_UNKNOWN)
        continue;
      _cleanup_close_ int cfd
          = openat (dirfd (d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (cfd < 0)
        continue; /* not a directory (a symlink, or gone meanwhile) */
      _cleanup_free_ char *crel = NULL;
      if (asprintf (&crel, "%s%s%s", rel, rel[0] ? "/" : "", de->d_name) < 0)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      if (add_dir (w, cfd, crel, err) < 0)
        return -1;
    }
  return 0;
}

/* A directory appeared under a recursive watch: watch it too. */
static void
add_new_dir (struct fwatch *w, const char *rel)
{
  _cleanup_free_ char *abs = NULL;
  if (asprintf (&abs, "%s/%s", w->path, rel) < 0)
    return;
  wr_err_t err;
  _cleanup_close_ int fd
      = ag_open_in_root (ag.rootfd, abs, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, ag.use_openat2, &err);
  if (fd >= 0)
    add_dir (w, fd, rel, &err);
}

static void
forget_wd (int wd)
{
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->kind == AG_REQ_WATCH)
      {
        struct fwatch *w = (struct fwatch *)r;
        for (size_t i = 0; i < w->n_dirs; i++)
          if (w->dirs[i].wd == wd)
            {
              free (w->dirs[i].rel);
              w->dirs[i] = w->dirs[--w->n_dirs];
              break;
            }
      }
}

static void
on_event (const struct inotify_event *ev)
{
  if (ev->mask & IN_IGNORED)
    {
      forget_wd (ev->wd); /* the directory is gone (or unmounted) */
      return;
    }
  const char *type = event_type (ev->mask);
  if (type == NULL || ev->len == 0 || ev->name[0] == '\0')
    return; /* about a watched directory itself: its parent reports it */
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    {
      if (r->kind != AG_REQ_WATCH || r->orphan)
        continue;
      struct fwatch *w = (struct fwatch *)r;
      const char *rel = NULL;
      for (size_t i = 0; i < w->n_dirs && rel == NULL; i++)
        if (w->dirs[i].wd == ev->wd)
          rel = w->dirs[i].rel;
      if (rel == NULL)
        continue;
      _cleanup_free_ char *name = NULL;
      if (asprintf (&name, "%s%s%s", rel, rel[0] ? "/" : "", ev->name) < 0)
        continue;
      json_t *e
          = json_pack ("{s:o,s:s}", "name", ag_json_lossy (name, strlen (name)), "type", type);
      if (w->entry
          || (w->recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO))))
        {
          _cleanup_free_ char *abs = NULL;
          wr_err_t err;
          struct stat st;
          _cleanup_close_ int fd = -1;
          if (asprintf (&abs, "%s/%s", w->path, name) >= 0)
            fd = ag_open_in_root (ag.rootfd, abs, O_PATH | O_NOFOLLOW, ag.use_openat2, &err);
          if (fd >= 0 && w->entry
              && fstatat (fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) == 0)
            json_object_set_new (e, "entry", ag_stat_json (ev->name, &st));
          if (fd >= 0 && w->recursive && (ev->mask & IN_ISDIR)
              && (ev->mask & (IN_CREATE | IN_MOVED_TO)))
            add_new_dir (w, name);
        }
      if (w->batch == NULL)
        w->batch = json_array ();
      json_array_append_new (w->batch, e);
      w->batch_bytes += 64 + strlen (name) * 2 + (w->entry ? 160 : 0);
      if (w->batch_bytes > WATCH_FRAME_SOFT)
        batch_flush (w);
    }
}

static void
ino_cb (struct ag_watch *iw, uint32_t events)
{
  static uint8_t buf[64 << 10] __attribute__ ((aligned (__alignof__(struct inotify_event))));
  ssize_t n = read (iw->fd, buf, sizeof buf);
  if (n <= 0)
    return;
  for (ssize_t off = 0; off + (ssize_t)sizeof (struct inotify_event) <= n;)
    {
      const struct inotify_event *ev = (const struct inotify_event *)(buf + off);
      off += (ssize_t)sizeof *ev + ev->len;
      if (ev->mask & IN_Q_OVERFLOW)
        {
          /* events were lost: no watch can be trusted to be complete */
          for (struct ag_req *r = ag.reqs, *next; r; r = next)
            {
              next = r->next;
              if (r->kind != AG_REQ_WATCH)
                continue;
              if (!r->orphan)
                ag_send_errorf (r->stream, EOVERFLOW, WR_E_EXHAUSTED,
                                "inotify queue overflow: events were lost");
              fwatch_free ((struct fwatch *)r);
            }
          return;
        }
      on_event (ev);
    }
  for (struct ag_req *r = ag.reqs; r; r = r->next)
    if (r->kind == AG_REQ_WATCH)
      batch_flush ((struct fwatch *)r);
}

void
ag_fwatch_pause (bool pause)
{
  ino_paused = pause;
  if (ino.fd >= 0)
    ag_watch_set (&ino, pause ? 0 : EPOLLIN);
}

int
ag_fwatch_start (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  json_t *rec = json_object_get (body, "recursive"), *ent = json_object_get (body, "entry");
  if ((rec && !json_is_boolean (rec)) || (ent && !json_is_boolean (ent)))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"recursive\" and \"entry\" must be booleans");
  _cleanup_close_ int fd
      = ag_open_in_root (ag.rootfd, path, O_RDONLY | O_DIRECTORY, ag.use_openat2, err);
  if (fd < 0)
    {
      if (err->errnum == ENOTDIR)
        return wr_error (err, ENOTDIR, WR_E_INVALID, "%s: not a directory", path);
      return fd;
    }
  if (ino.fd < 0)
    {
      ino.fn = ino_cb;
      ino.fd = inotify_init1 (IN_NONBLOCK | IN_CLOEXEC);
      if (ino.fd < 0)
        return wr_error (err, errno, errno == ENOSYS ? WR_E_UNSUPPORTED : WR_E_EXHAUSTED,
                         "inotify_init1");
      if (!ino_paused && ag_watch_set (&ino, EPOLLIN) < 0)
        {
          ag_watch_close (&ino);
          return wr_sys_error (err, "epoll inotify");
        }
    }
  struct fwatch *w = calloc (1, sizeof *w);
  if (w == NULL || (w->path = strdup (path)) == NULL)
    {
      free (w);
      if (n_watches == 0)
        ag_watch_close (&ino);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
    }
  w->r.stream = stream;
  w->r.kind = AG_REQ_WATCH;
  w->recursive = json_is_true (rec);
  w->entry = json_is_true (ent);
  n_watches++;
  if (add_dir (w, fd, "", err) < 0)
    {
      fwatch_free (w);
      return -1;
    }
  ag_req_link (&w->r);
  /* the watches are in place: from now on no change is missed */
  ag_send_json (stream, WR_MSG_DATA, json_pack ("{s:b}", "ready", 1));
  return 0;
}

/* Any DATA frame from the daemon ends the watch. */
void
ag_fwatch_stop (struct ag_req *r)
{
  ag_send_json (r->stream, WR_MSG_RESULT, json_object ());
  fwatch_free ((struct fwatch *)r);
}

void
ag_fwatch_orphan (struct ag_req *r)
{
  fwatch_free ((struct fwatch *)r);
}

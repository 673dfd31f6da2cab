/* Group fork, checkpoints, restore and diff (fork.h, docs/api.md).
 *
 * A snapshot is pack's: the sandbox is frozen, its writable upper copied
 * (ids shifted back to the sandbox's view) and committed as one EROFS layer
 * on top of its own layers. A checkpoint is such an image tagged
 * warren-checkpoint/ID:NAME, so it survives a daemon restart and its layers
 * live exactly as long as the tag; destroying the sandbox drops the tags. A
 * fork makes one snapshot, tagged warren-fork/ID:RANDOM only until every
 * child holds its layers, and starts N children on it, each with its own
 * empty upper. Restore compares the live tree with the checkpoint
 * (fsdiff.c) and rewrites only the paths that differ, through the
 * sandbox's own root, with the sandbox frozen: its processes keep running.
 *
 * A microvm or vm has no upper the daemon can read: its agent exports it
 * (guest_upper.c), committed as the same kind of image, which then stands
 * for the snapshot (checkpoint, fork) or for "now" (diff, restore, under a
 * temporary tag); a restore's changes go back as a tar its agent applies
 * through the guest's root (fsd_patch_tar, FILE op "apply"). */
#include "daemon/fork.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/securebits.h>

#include "common/proto.h"
#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/criu.h"
#include "daemon/fsdiff.h"
#include "daemon/guest_upper.h"
#include "daemon/http_util.h"
#include "daemon/images.h"
#include "daemon/log.h"
#include "daemon/trajlog.h"

#define CKPT_PREFIX "warren-checkpoint/"
#define FORK_PREFIX "warren-fork/"
#define DIFF_PREFIX "warren-diff/" /* a VM's "now", for one diff */
#define FORK_MAX 256

/* checkpoint names are image tags: [A-Za-z0-9_.-]{1,128} */
static bool
name_valid (const char *n)
{
  size_t l = n ? strlen (n) : 0;
  if (l == 0 || l > 128)
    return false;
  for (size_t i = 0; i < l; i++)
    if (!((n[i] >= 'a' && n[i] <= 'z') || (n[i] >= 'A' && n[i] <= 'Z')
          || (n[i] >= '0' && n[i] <= '9') || n[i] == '_' || n[i] == '.' || n[i] == '-'))
      return false;
  return true;
}

static void
ckpt_ref (char *buf, size_t len, const char *id, const char *name)
{
  snprintf (buf, len, CKPT_PREFIX "%s:%s", id, name);
}

/* Sandbox ids that have checkpoints (loop thread only), seeded from the
 * store once, so that destroying or inspecting any other sandbox never
 * scans the image table. */
static json_t *ckpt_owners;

static json_t *
owners (struct wrd *d)
{
  if (ckpt_owners)
    return ckpt_owners;
  json_t *all = NULL;
  wr_err_t err;
  if (wr_image_list (d->store, &all, &err) < 0)
    return NULL; /* try again next time */
  ckpt_owners = json_object ();
  size_t i;
  json_t *img;
  json_array_foreach (all, i, img)
  {
    const char *name = json_string_value (json_object_get (img, "name"));
    const char *colon = name ? strchr (name, ':') : NULL;
    if (colon && strncmp (name, CKPT_PREFIX, strlen (CKPT_PREFIX)) == 0)
      {
        char id[64];
        snprintf (id, sizeof id, "%.*s", (int)(colon - name - strlen (CKPT_PREFIX)),
                  name + strlen (CKPT_PREFIX));
        json_object_set_new (ckpt_owners, id, json_true ());
      }
  }
  json_decref (all);
  return ckpt_owners;
}

json_t *
wrd_checkpoints_json (struct wrd *d, const char *id)
{
  json_t *out = json_array (), *all = NULL;
  wr_err_t err;
  json_t *o = owners (d);
  if (o && json_object_get (o, id) == NULL)
    return out;
  if (wr_image_list (d->store, &all, &err) < 0)
    return out;
  char prefix[128];
  int pl = snprintf (prefix, sizeof prefix, CKPT_PREFIX "%s:", id);
  size_t i;
  json_t *img;
  json_array_foreach (all, i, img)
  {
    const char *name = json_string_value (json_object_get (img, "name"));
    if (name && strncmp (name, prefix, (size_t)pl) == 0)
      json_array_append_new (out, json_pack ("{s:s,s:s,s:O,s:O}", "name", name + pl, "image", name,
                                             "digest", json_object_get (img, "digest"), "created",
                                             json_object_get (img, "created")));
  }
  json_decref (all);
  return out;
}

void
wrd_checkpoints_drop (struct wrd *d, const char *id)
{
  json_t *list = wrd_checkpoints_json (d, id);
  size_t i;
  json_t *c;
  json_array_foreach (list, i, c)
  {
    wr_err_t err;
    if (wr_image_remove (d->store, json_string_value (json_object_get (c, "image")), &err) < 0)
      wrd_log (WRD_LOG_WARN, "drop checkpoint of %s: %s\n", id, err.msg);
  }
  json_decref (list);
  if (ckpt_owners)
    json_object_del (ckpt_owners, id);
}

/* "unsupported" naming the backend, before any work */
static int
check_fs_ops (struct sandbox *sb, const char *what, wr_err_t *err)
{
  if (sb->ops->upper_fd == NULL && wrd_guest_upper (sb))
    return wrd_guest_upper_check (sb, what, err);
  if (sb->ops->upper_fd == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "%s is not implemented on the %s backend: it cannot hand out its writable "
                     "layer (docs/rl.md); container, microvm and vm sandboxes support it",
                     what, sb->backend);
  return 0;
}

/* ---- snapshot jobs ---- */

enum job_kind
{
  JOB_CHECKPOINT,
  JOB_FORK,
  JOB_RESTORE,
  JOB_DIFF,
};

struct side
{
  bool now;
  char (*layers)[72]; /* bottom-most first */
  size_t n;
  char label[140];
};

struct fjob
{
  struct wrd *d;
  struct evhttp_request *req;
  enum job_kind kind;
  char id[33];
  struct pack_snap snap;
  bool have_snap;
  bool guest;        /* a VM: the snapshot is the agent's export (guest_upper.h) */
  char tmp_ref[256]; /* a VM's "now" of a diff or restore, untagged at the end */
  /* a VM's restore: the patch (fsd_patch_tar) its agent applies */
  int patch_fd;
  off_t patch_off, patch_size;
  uint32_t apply_stream;
  bool pumping, applied;
  char ref[256];
  char name[140];
  struct wr_image *img;
  struct pack_stats stats;
  /* restore / diff */
  struct side from, to;
  int root_fd;
  char prefix[4096];
  bool text;
  json_t *result;
  /* fork */
  unsigned count, pending, failed;
  json_t *child_req, *children;
  wr_err_t child_err;
  uint64_t t0, t_snap;
  int64_t fork_seq; /* the parent's "fork" event in the trajectory log */
  int64_t ev_seq;   /* a checkpoint's or restore's event */
  wr_err_t err;
  int r;
};

static void
fjob_free (struct fjob *j)
{
  if (j->have_snap)
    wrd_pack_end (j->d, &j->snap);
  wr_err_t e;
  if (j->tmp_ref[0] && wr_image_remove (j->d->store, j->tmp_ref, &e) < 0)
    wrd_log (WRD_LOG_WARN, "diff of %s: untag %s: %s\n", j->id, j->tmp_ref, e.msg);
  if (j->root_fd >= 0)
    close (j->root_fd);
  if (j->patch_fd >= 0)
    close (j->patch_fd);
  wr_image_free (j->img);
  free (j->from.layers);
  free (j->to.layers);
  json_decref (j->result);
  json_decref (j->child_req);
  json_decref (j->children);
  free (j);
}

static struct fjob *
fjob_new (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, enum job_kind kind)
{
  struct fjob *j = calloc (1, sizeof *j);
  if (j == NULL)
    return NULL;
  j->d = d;
  j->req = req;
  j->kind = kind;
  j->root_fd = -1;
  j->patch_fd = -1;
  j->t0 = wr_now_ns ();
  snprintf (j->id, sizeof j->id, "%s", sb->id);
  return j;
}

static int
side_layers (struct side *s, char (*layers)[72], size_t n, wr_err_t *err)
{
  s->layers = calloc (n + 1, sizeof *s->layers);
  if (s->layers == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  memcpy (s->layers, layers, n * sizeof *layers);
  s->n = n;
  return 0;
}

/* worker: a side as a layer stack (top-most first), its layers acquired */
static int
side_state (struct wrd *d, const struct fjob *j, const struct side *s, struct fsd_state *st,
            wr_err_t *err)
{
  if (s->now)
    {
      int r = fsd_state_push (st, j->snap.upper_fd, err);
      if (r < 0)
        return r;
    }
  for (size_t k = s->n; k-- > 0;)
    {
      const char *dir;
      int r = wr_layer_acquire (d->store, s->layers[k], &dir, err);
      if (r < 0)
        return r;
      _cleanup_close_ int fd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd < 0)
        r = wr_sys_error (err, "open layer %s", s->layers[k]);
      else
        r = fsd_state_push (st, fd, err);
      wr_layer_release (d->store, s->layers[k]);
      if (r < 0)
        return r;
    }
  return 0;
}

static void
mark_unshared (const struct side *a, struct fsd_state *sa, const struct side *b,
               struct fsd_state *sb)
{
  size_t common = 0;
  while (common < a->n && common < b->n && strcmp (a->layers[common], b->layers[common]) == 0)
    common++;
  sa->unshared = (a->n - common) + (a->now ? 1 : 0);
  sb->unshared = (b->n - common) + (b->now ? 1 : 0);
}

/* the uid/gid that the sandbox's root maps to on the host */
static uint32_t
host_base (const struct idmap *m)
{
  for (size_t i = 0; i < m->n; i++)
    if (m->in[i] == 0)
      return m->out[i];
  return 65534;
}

static void
job_work (void *arg)
{
  struct fjob *j = arg;
  struct wrd *d = j->d;
  if ((j->kind == JOB_CHECKPOINT || j->kind == JOB_FORK) && !j->guest)
    {
      j->r = wrd_pack_commit (d->store, &j->snap, j->ref, NULL, &j->stats, &j->img, &j->err);
      j->t_snap = wr_now_ns ();
      return;
    }
  struct fsd_state a, b;
  fsd_state_init (&a);
  fsd_state_init (&b);
  struct fsd_changes ch = { 0 };
  j->r = side_state (d, j, &j->from, &a, &j->err);
  if (j->r == 0)
    j->r = side_state (d, j, &j->to, &b, &j->err);
  if (j->r == 0)
    {
      mark_unshared (&j->from, &a, &j->to, &b);
      j->r = fsd_compare (&a, &b, &ch, &j->err);
    }
  if (j->r == 0 && j->kind == JOB_DIFF)
    {
      j->result = fsd_changes_json (&a, &b, &ch, j->prefix[0] ? j->prefix : NULL, j->text);
      json_object_set_new (j->result, "from", json_string (j->from.label));
      json_object_set_new (j->result, "to", json_string (j->to.label));
    }
  else if (j->r == 0 && j->guest)
    {
      /* the guest's agent writes it, through its own root (apply.c) */
      char tmp[1200];
      snprintf (tmp, sizeof tmp, "%s/tmp", wr_store_root (d->store));
      j->patch_fd = open (tmp, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
      if (j->patch_fd < 0)
        j->r = wr_sys_error (&j->err, "restore: spool file in %s", tmp);
      else
        j->r = fsd_patch_tar (&b, &ch, j->patch_fd, &j->err);
      struct stat pst;
      if (j->r == 0 && fstat (j->patch_fd, &pst) < 0)
        j->r = wr_sys_error (&j->err, "restore: stat the patch");
      if (j->r == 0)
        {
          j->patch_size = pst.st_size;
          j->result = json_pack ("{s:s,s:I}", "restored", j->name, "changes", (json_int_t)ch.n);
        }
    }
  else if (j->r == 0)
    {
      /* Write as the sandbox's root (a file the daemon's uid 0 made in the
       * sandbox's overlay would belong to nobody), keeping our capabilities
       * (NO_SETUID_FIXUP), on this thread only. */
      int bits = prctl (PR_GET_SECUREBITS, 0, 0, 0, 0);
      uint32_t ub = host_base (&j->snap.uids), gb = host_base (&j->snap.gids);
      if (bits < 0 || prctl (PR_SET_SECUREBITS, bits | SECBIT_NO_SETUID_FIXUP, 0, 0, 0) < 0)
        j->r = wr_sys_error (&j->err, "securebits");
      else
        {
          syscall (SYS_setfsgid, gb);
          syscall (SYS_setfsuid, ub);
          j->r = fsd_apply (j->root_fd, &b, &ch, ub, gb, &j->err);
          syscall (SYS_setfsuid, 0);
          syscall (SYS_setfsgid, 0);
          if (prctl (PR_SET_SECUREBITS, bits, 0, 0, 0) < 0
              || syscall (SYS_setfsuid, (uid_t)-1) != 0)
            abort (); /* a daemon thread left with another fsuid would be worse */
          if (j->r == 0)
            j->result = json_pack ("{s:s,s:I}", "restored", j->name, "changes", (json_int_t)ch.n);
        }
    }
  fsd_changes_free (&ch);
  fsd_state_clear (&a);
  fsd_state_clear (&b);
}

static void fork_children (struct fjob *j);
static void guest_apply (struct fjob *j);

/* Checkpoints and restores are trajectory events, logged when the sandbox
 * is frozen (what ran before is in them, what runs after is not) and
 * completed when they end: a replay starts from the latest one at or
 * before its step (trajlog.c). */
static void
log_begin (struct fjob *j, struct sandbox *sb, const char *kind)
{
  j->ev_seq = wrd_traj_lifecycle (j->d, sb, kind,
                                  json_pack ("{s:s,s:s}", "name", j->name, "image", j->ref));
}

static void
log_done (struct fjob *j, json_t *add)
{
  wrd_traj_event_update (j->d, j->ev_seq, add);
}

static void
job_done (void *arg)
{
  struct fjob *j = arg;
  if (j->have_snap)
    {
      wrd_pack_end (j->d, &j->snap); /* thaws the sandbox */
      j->have_snap = false;
    }
  if (j->r < 0)
    {
      if (j->kind == JOB_CHECKPOINT || j->kind == JOB_RESTORE)
        log_done (
            j, json_pack ("{s:{s:s?,s:s}}", "error", "code", j->err.code, "message", j->err.msg));
      wrd_reply_error (j->req, &j->err);
      fjob_free (j);
      return;
    }
  switch (j->kind)
    {
    case JOB_CHECKPOINT:
      if (owners (j->d))
        json_object_set_new (ckpt_owners, j->id, json_true ());
      log_done (j, json_pack ("{s:s}", "digest", j->img->digest));
      wrd_reply_json (j->req, 201,
                      json_pack ("{s:s,s:s,s:s,s:s,s:I,s:f}", "id", j->id, "name", j->name, "image",
                                 j->ref, "digest", j->img->digest, "files",
                                 (json_int_t)j->stats.files, "duration_ms",
                                 (double)(j->t_snap - j->t0) / 1e6));
      break;
    case JOB_FORK:
      fork_children (j);
      return; /* replies when every child is there */
    case JOB_RESTORE:
      if (j->guest)
        {
          guest_apply (j);
          return; /* replies when the agent has applied it */
        }
      log_done (j, json_pack ("{s:O}", "changes", json_object_get (j->result, "changes")));
      /* fall through */
    case JOB_DIFF:
      wrd_reply_json (j->req, 200, json_incref (j->result));
      break;
    }
  fjob_free (j);
}

static void
job_start (struct fjob *j)
{
  if (wrd_job_run (j->d, job_work, job_done, j) < 0)
    {
      wrd_reply_error_code (j->req, WR_E_INTERNAL, "cannot start a worker");
      fjob_free (j);
    }
}

/* ---- a VM's restore: the patch through its agent (FILE op "apply") ---- */

static void
apply_end (struct fjob *j, wr_err_t *err)
{
  j->applied = true;
  if (err)
    {
      log_done (j, json_pack ("{s:{s:s?,s:s}}", "error", "code", err->code, "message", err->msg));
      wrd_reply_error (j->req, err);
    }
  else
    {
      log_done (j, json_pack ("{s:O}", "changes", json_object_get (j->result, "changes")));
      wrd_reply_json (j->req, 200, json_incref (j->result));
    }
  if (!j->pumping)
    fjob_free (j);
}

static void
apply_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  (void)ud, (void)type, (void)data, (void)len; /* an apply answers no data */
}

static void
apply_on_done (void *ud, json_t *result)
{
  (void)result;
  apply_end (ud, NULL);
}

static void
apply_on_error (void *ud, const char *code, const char *message)
{
  wr_err_t err;
  wr_error (&err, 0,
            strcmp (code, WR_E_GONE) == 0      ? WR_E_GONE
            : strcmp (code, WR_E_TIMEOUT) == 0 ? WR_E_TIMEOUT
                                               : WR_E_INTERNAL,
            "the guest's agent could not apply the restore: %.400s", message ? message : "failed");
  apply_end (ud, &err);
}

/* Send the patch while the connection's queue is short; come back in a
 * millisecond otherwise (the agent, not warrend, holds the bytes). */
static void
apply_pump (evutil_socket_t fd, short what, void *arg)
{
  (void)fd, (void)what;
  struct fjob *j = arg;
  j->pumping = false;
  struct sandbox *sb = wrd_sandbox_find (j->d, j->id);
  if (j->applied || sb == NULL || !agent_conn_alive (sb->conn))
    {
      if (j->applied)
        fjob_free (j);
      return; /* else the request fails "gone", which replies */
    }
  char buf[256 << 10];
  while (j->patch_off < j->patch_size && agent_outq (sb->conn) < (1u << 20))
    {
      ssize_t n = pread (j->patch_fd, buf, sizeof buf, j->patch_off);
      if (n <= 0)
        {
          agent_cancel (sb->conn, j->apply_stream);
          wr_err_t err;
          wr_error (&err, n < 0 ? errno : EIO, WR_E_INTERNAL, "restore: read the patch");
          apply_end (j, &err);
          return;
        }
      agent_send (sb->conn, j->apply_stream, WR_MSG_DATA, buf, (size_t)n);
      j->patch_off += n;
    }
  if (j->patch_off < j->patch_size)
    {
      struct timeval tv = { 0, 1000 };
      if (event_base_once (j->d->base, -1, EV_TIMEOUT, apply_pump, j, &tv) == 0)
        {
          j->pumping = true;
          return;
        }
      agent_cancel (sb->conn, j->apply_stream);
      wr_err_t err;
      wr_error (&err, 0, WR_E_INTERNAL, "restore: cannot schedule the patch");
      apply_end (j, &err);
      return;
    }
  agent_send (sb->conn, j->apply_stream, WR_MSG_DATA, "", 0); /* the end */
  /* the agent answers once it has applied it all */
  agent_set_idle_timeout (sb->conn, j->apply_stream, WRD_GUEST_IDLE_MS);
}

static void
guest_apply (struct fjob *j)
{
  struct sandbox *sb = wrd_sandbox_find (j->d, j->id);
  static const struct agent_ops ops = { apply_on_data, apply_on_done, apply_on_error };
  json_t *body = json_pack ("{s:s,s:s}", "op", "apply", "path", "/");
  j->apply_stream = sb && agent_conn_alive (sb->conn)
                        ? agent_request (sb->conn, WR_MSG_FILE, body, &ops, j)
                        : 0;
  json_decref (body);
  if (j->apply_stream == 0)
    {
      wr_err_t err;
      wr_error (&err, 0, WR_E_GONE, "sandbox %s is gone", j->id);
      apply_end (j, &err);
      return;
    }
  apply_pump (-1, 0, j);
}

/* A VM's export is committed (guest_upper.c): a checkpoint or fork goes on
 * as a container's does after its commit; a diff's "now" becomes the
 * layers of that image. */
static void
guest_snap_done (struct wrd *d, void *ud, struct wrd_guest_snap *gs, wr_err_t *err)
{
  struct fjob *j = ud;
  j->t_snap = wr_now_ns ();
  if (gs == NULL)
    {
      j->r = -1;
      j->err = *err;
      job_done (j);
      return;
    }
  j->stats.files = gs->entries;
  if (j->kind == JOB_CHECKPOINT || j->kind == JOB_FORK)
    {
      j->img = gs->img;
      gs->img = NULL;
      job_done (j);
      return;
    }
  struct side *sides[2] = { &j->from, &j->to };
  for (int i = 0; i < 2; i++)
    if (sides[i]->now)
      {
        sides[i]->now = false;
        free (sides[i]->layers);
        sides[i]->layers = NULL;
        if (side_layers (sides[i], gs->img->layers, gs->img->n_layers, &j->err) < 0)
          {
            j->r = -1;
            job_done (j);
            return;
          }
      }
  job_start (j);
}

/* Freeze the sandbox and take hold of its writable layer: a container's
 * upper directory (pack.c), or a VM's export committed as image ref (a
 * diff's own temporary one when ref is NULL); the job goes on from
 * guest_snap_done then. */
static int
begin_snap (struct fjob *j, struct sandbox *sb, wr_err_t *err)
{
  if (sb->ops->upper_fd == NULL && wrd_guest_upper (sb))
    {
      const char *ref = j->ref;
      if (j->kind == JOB_DIFF || j->kind == JOB_RESTORE)
        {
          char rnd[13];
          wr_random_hex (rnd, 12);
          snprintf (j->tmp_ref, sizeof j->tmp_ref, DIFF_PREFIX "%s:%s", sb->id, rnd);
          ref = j->tmp_ref;
        }
      int r = wrd_guest_snap_start (j->d, sb, ref, false, guest_snap_done, j, err);
      if (r < 0)
        {
          j->tmp_ref[0] = '\0';
          return r;
        }
      j->guest = true;
      return 0;
    }
  int r = wrd_pack_begin (j->d, sb, &j->snap, err);
  if (r < 0)
    return r;
  j->snap.keep_all = true;
  j->have_snap = true;
  return 0;
}

/* ---- POST /v1/sandboxes/{id}/checkpoints {"name"} ---- */

static void
http_checkpoint (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  wr_err_t err;
  json_t *body;
  if (wrd_read_json_body (req, false, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *nv = json_object_get (body, "name");
  char name[140] = "";
  if (nv && !json_is_null (nv))
    {
      if (!json_is_string (nv) || !name_valid (json_string_value (nv)))
        {
          json_decref (body);
          wrd_reply_error_code (req, WR_E_INVALID,
                                "field \"name\": a checkpoint name is 1-128 of [A-Za-z0-9_.-] "
                                "(no slashes)");
          return;
        }
      snprintf (name, sizeof name, "%s", json_string_value (nv));
    }
  json_decref (body);
  if (check_fs_ops (sb, "checkpoint", &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *existing = wrd_checkpoints_json (d, sb->id);
  if (name[0] == '\0')
    for (size_t n = json_array_size (existing) + 1; name[0] == '\0'; n++)
      {
        snprintf (name, sizeof name, "ckpt-%zu", n);
        size_t i;
        json_t *c;
        json_array_foreach (
            existing, i, c) if (strcmp (json_string_value (json_object_get (c, "name")), name) == 0)
            name[0]
            = '\0';
      }
  else
    {
      size_t i;
      json_t *c;
      json_array_foreach (
          existing, i, c) if (strcmp (json_string_value (json_object_get (c, "name")), name) == 0)
      {
        json_decref (existing);
        char msg[256];
        snprintf (msg, sizeof msg, "sandbox %s already has a checkpoint named %s", sb->id, name);
        wrd_reply_error_code (req, WR_E_CONFLICT, msg);
        return;
      }
    }
  json_decref (existing);
  struct fjob *j = fjob_new (d, req, sb, JOB_CHECKPOINT);
  if (j == NULL)
    {
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  snprintf (j->name, sizeof j->name, "%s", name);
  ckpt_ref (j->ref, sizeof j->ref, sb->id, name);
  if (begin_snap (j, sb, &err) < 0)
    {
      wrd_reply_error (req, &err);
      fjob_free (j);
      return;
    }
  log_begin (j, sb, "checkpoint");
  if (!j->guest)
    job_start (j);
}

/* A side of a diff or restore: "image", "now" or a checkpoint name. */
static int
resolve_side (struct wrd *d, struct sandbox *sb, const char *what, struct side *s, wr_err_t *err)
{
  snprintf (s->label, sizeof s->label, "%s", what);
  if (strcmp (what, "now") == 0)
    {
      s->now = true;
      return side_layers (s, sb->layers, sb->n_layers, err);
    }
  if (strcmp (what, "image") == 0)
    return side_layers (s, sb->layers, sb->n_layers, err);
  if (!name_valid (what))
    return wr_error (err, 0, WR_E_INVALID,
                     "\"%.64s\" is not a checkpoint name (1-128 of [A-Za-z0-9_.-], no slashes), "
                     "\"image\" or \"now\"",
                     what);
  char ref[256];
  ckpt_ref (ref, sizeof ref, sb->id, what);
  struct wr_image *img = NULL;
  if (wr_image_resolve (d->store, ref, &img, err) < 0)
    return wr_error (err, 0, WR_E_NOT_FOUND, "sandbox %s has no checkpoint named %s", sb->id, what);
  int r = side_layers (s, img->layers, img->n_layers, err);
  wr_image_free (img);
  return r;
}

/* ---- POST /v1/sandboxes/{id}/restore {"name"} ---- */

static void
http_restore (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  wr_err_t err;
  json_t *body;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  const char *name = json_string_value (json_object_get (body, "name"));
  struct fjob *j = NULL;
  if (name == NULL)
    {
      wr_error (&err, 0, WR_E_INVALID, "field \"name\" (a checkpoint name) is required");
      goto fail;
    }
  if (check_fs_ops (sb, "restore", &err) < 0)
    goto fail;
  j = fjob_new (d, req, sb, JOB_RESTORE);
  if (j == NULL)
    {
      wr_error (&err, ENOMEM, WR_E_INTERNAL, "out of memory");
      goto fail;
    }
  snprintf (j->name, sizeof j->name, "%s", name);
  if (strcmp (name, "image") == 0 || strcmp (name, "now") == 0)
    {
      wr_error (&err, 0, WR_E_INVALID, "restore takes a checkpoint name");
      goto fail;
    }
  if (resolve_side (d, sb, name, &j->to, &err) < 0
      || resolve_side (d, sb, "now", &j->from, &err) < 0 || begin_snap (j, sb, &err) < 0)
    goto fail;
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/root", (int)sb->c.pid);
  if (!j->guest && (j->root_fd = open (path, O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0)
    {
      wr_sys_error (&err, "open the root of sandbox %s", sb->id);
      goto fail;
    }
  json_decref (body);
  ckpt_ref (j->ref, sizeof j->ref, sb->id, j->name);
  log_begin (j, sb, "restore");
  if (!j->guest)
    job_start (j);
  return;
fail:
  json_decref (body);
  wrd_reply_error (req, &err);
  if (j)
    fjob_free (j);
}

/* ---- GET /v1/sandboxes/{id}/diff?from=&to=&path=&text= ---- */

static void
http_diff (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, struct evkeyvalq *q)
{
  wr_err_t err;
  const char *from = wrd_query_get (q, "from"), *to = wrd_query_get (q, "to");
  const char *path = wrd_query_get (q, "path"), *text = wrd_query_get (q, "text");
  struct fjob *j = NULL;
  if (check_fs_ops (sb, "diff", &err) < 0)
    goto fail;
  j = fjob_new (d, req, sb, JOB_DIFF);
  if (j == NULL)
    {
      wr_error (&err, ENOMEM, WR_E_INTERNAL, "out of memory");
      goto fail;
    }
  j->text = text == NULL || strcmp (text, "0") != 0;
  if (path && fsd_path_normalise (path, j->prefix, sizeof j->prefix, &err) < 0)
    goto fail;
  if (resolve_side (d, sb, from && *from ? from : "image", &j->from, &err) < 0
      || resolve_side (d, sb, to && *to ? to : "now", &j->to, &err) < 0)
    goto fail;
  if ((j->from.now || j->to.now) && begin_snap (j, sb, &err) < 0)
    goto fail;
  if (!j->guest)
    job_start (j);
  return;
fail:
  wrd_reply_error (req, &err);
  if (j)
    fjob_free (j);
}

/* ---- POST /v1/sandboxes/{id}/fork {"count":N,...} ---- */

static void
fork_reply (struct fjob *j)
{
  wr_err_t e;
  if (wr_image_remove (j->d->store, j->ref, &e) < 0)
    wrd_log (WRD_LOG_WARN, "fork of %s: untag %s: %s\n", j->id, j->ref, e.msg);
  if (j->failed)
    {
      /* all or nothing: a group with a missing member is no group */
      size_t i;
      json_t *c;
      json_array_foreach (j->children, i, c)
      {
        struct sandbox *sb = wrd_sandbox_find (j->d, json_string_value (json_object_get (c, "id")));
        if (sb)
          wrd_sandbox_destroy (j->d, sb, &e);
      }
      wrd_reply_error (j->req, &j->child_err);
    }
  else
    wrd_reply_json (j->req, 201,
                    json_pack ("{s:s,s:O,s:s,s:{s:f,s:f},s:I}", "parent", j->id, "sandboxes",
                               j->children, "layer", j->img->layers[j->img->n_layers - 1],
                               "timing_ms", "snapshot", (double)(j->t_snap - j->t0) / 1e6, "total",
                               (double)(wr_now_ns () - j->t0) / 1e6, "files",
                               (json_int_t)j->stats.files));
  fjob_free (j);
}

static void
child_built (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct fjob *j = ud;
  if (sb)
    {
      json_array_append_new (j->children, wrd_sandbox_json (d, sb, false));
      wrd_traj_forked (d, sb->id, j->id, j->fork_seq);
    }
  else if (j->failed++ == 0)
    j->child_err = *err;
  if (--j->pending == 0)
    fork_reply (j);
}

static void
fork_children (struct fjob *j)
{
  j->children = json_array ();
  /* one more than the children while this loop runs: a create may finish,
   * and call child_built, before wrd_sandbox_create_async returns (the
   * last one would then free j under the loop) */
  j->pending = j->count + 1;
  for (unsigned i = 0; i < j->count; i++)
    {
      wr_err_t err;
      json_t *req = json_deep_copy (j->child_req);
      int r = wrd_sandbox_create_async (j->d, req, child_built, j, &err);
      json_decref (req);
      if (r < 0)
        {
          /* no callback for this one */
          if (j->failed++ == 0)
            j->child_err = err;
          j->pending--;
        }
    }
  if (--j->pending == 0)
    fork_reply (j);
}

static void
http_fork (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  wr_err_t err;
  json_t *body;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  struct fjob *j = NULL;
  json_t *count = json_object_get (body, "count");
  if (!json_is_integer (count) || json_integer_value (count) < 1
      || json_integer_value (count) > FORK_MAX)
    {
      wr_error (&err, 0, WR_E_INVALID, "field \"count\" must be an integer from 1 to %d", FORK_MAX);
      goto fail;
    }
  json_t *procs = json_object_get (body, "processes");
  if (procs && !json_is_boolean (procs))
    {
      wr_error (&err, 0, WR_E_INVALID, "field \"processes\" must be a boolean");
      goto fail;
    }
  if (json_is_true (procs))
    {
      /* docs/rl.md, "Process state in a fork": what blocks it here */
      wrd_criu_fork_blocker (sb->backend, &err);
      goto fail;
    }
  if (check_fs_ops (sb, "fork", &err) < 0)
    goto fail;
  j = fjob_new (d, req, sb, JOB_FORK);
  if (j == NULL)
    {
      wr_error (&err, ENOMEM, WR_E_INTERNAL, "out of memory");
      goto fail;
    }
  j->count = (unsigned)json_integer_value (count);
  json_int_t count_v = json_integer_value (count);
  char rnd[13];
  wr_random_hex (rnd, 12);
  snprintf (j->ref, sizeof j->ref, FORK_PREFIX "%s:%s", sb->id, rnd);
  /* the children: the parent's create request, its image replaced by the
   * snapshot, overridden by what the fork request says */
  json_t *cr = json_deep_copy (sb->spec);
  json_object_set_new (cr, "image", json_string (j->ref));
  json_object_set_new (cr, "layers", json_array ());
  static const char *const overridable[]
      = { "memory_mb", "cpus", "disk_mb", "pids_max", "ttl_s", "network", "env", "labels" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (overridable); i++)
    {
      json_t *v = json_object_get (body, overridable[i]);
      if (v)
        json_object_set (cr, overridable[i], v);
    }
  const char *k;
  json_t *v;
  json_object_foreach (body, k, v)
  {
    bool known = strcmp (k, "count") == 0 || strcmp (k, "processes") == 0;
    for (size_t i = 0; i < WR_ARRAY_SIZE (overridable); i++)
      known = known || strcmp (k, overridable[i]) == 0;
    if (!known)
      {
        json_decref (cr);
        wr_error (&err, 0, WR_E_INVALID, "unknown field \"%.64s\" in a fork request", k);
        goto fail;
      }
  }
  json_t *labels = json_object_get (cr, "labels");
  if (!json_is_object (labels))
    json_object_set_new (cr, "labels", labels = json_object ());
  json_object_set_new (labels, "warren.fork.parent", json_string (sb->id));
  /* the parent's idempotency key is the parent's: with it, every child's
   * create would be answered with the parent (the node dedups by key) */
  json_object_del (labels, "warren.idem");
  json_object_del (cr, "idempotency_key");
  j->child_req = cr;
  /* a bad override fails here, before the parent is frozen */
  json_t *norm = NULL;
  if (wrd_parse_create (d, cr, &norm, &err) < 0)
    goto fail;
  json_decref (norm);
  if (begin_snap (j, sb, &err) < 0)
    goto fail;
  /* the fork point: the parent's events before it are in the children */
  j->fork_seq = wrd_traj_lifecycle (d, sb, "fork", json_pack ("{s:I}", "count", count_v));
  json_decref (body);
  if (!j->guest)
    job_start (j);
  return;
fail:
  json_decref (body);
  wrd_reply_error (req, &err);
  if (j)
    fjob_free (j);
}

bool
wrd_http_fork_routes (struct wrd *d, struct evhttp_request *req, struct sandbox *sb,
                      const char *sub, struct evkeyvalq *q)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (strcmp (sub, "fork") == 0 && m == EVHTTP_REQ_POST)
    http_fork (d, req, sb);
  else if (strcmp (sub, "checkpoints") == 0 && m == EVHTTP_REQ_POST)
    http_checkpoint (d, req, sb);
  else if (strcmp (sub, "checkpoints") == 0 && m == EVHTTP_REQ_GET)
    wrd_reply_json (req, 200, json_pack ("{s:o}", "checkpoints", wrd_checkpoints_json (d, sb->id)));
  else if (strcmp (sub, "restore") == 0 && m == EVHTTP_REQ_POST)
    http_restore (d, req, sb);
  else if (strcmp (sub, "diff") == 0 && m == EVHTTP_REQ_GET)
    http_diff (d, req, sb, q);
  else
    return false;
  return true;
}

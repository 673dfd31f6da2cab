/* A VM sandbox's writable layer, from its agent, as an image (guest_upper.h).
 *
 * The guest is root over its own kernel and may run an agent of its own
 * making, so everything that arrives here is hostile: the stream is
 * spooled to an unnamed file under ROOT/tmp, bounded by
 * wrd_guest_stream_max (one byte more and the agent loses its connection,
 * so its sandbox), and then parsed only by the confined unpack helper
 * (src/image/unpack.c: its own user namespace, seccomp, the store's byte,
 * entry and ratio limits), which also builds the EROFS layer. The layer's
 * digest is the daemon's hash of that image. The host never mounts
 * anything the guest wrote. */
#include "daemon/guest_upper.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/proto.h"
#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/log.h"

#define HEADER_ROOM ((uint64_t)64 << 20)

bool
wrd_guest_upper (const struct sandbox *sb)
{
  return sb->ops->upper_fd == NULL && (sb->ops->flags & WRD_BACKEND_GUEST_UPPER);
}

int
wrd_guest_upper_check (const struct sandbox *sb, const char *what, wr_err_t *err)
{
  json_t *labels = json_object_get (sb->img_conf, "labels");
  if (json_object_get (labels, "warren.vm_disk"))
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "%s is not implemented for a %s sandbox booted from a disk image: its whole "
                     "disk is one qcow2 overlay under the guest's own init, with no separate "
                     "writable layer to export (docs/rl.md, 'Checkpoints, restore and diff on "
                     "microvm and vm'); sandboxes booted from image layers support it",
                     what, sb->backend);
  if (sb->state == SB_PAUSED)
    return wr_error (err, 0, WR_E_CONFLICT,
                     "%s of a paused %s sandbox: its agent exports the layer from inside the "
                     "guest, so resume it first",
                     what, sb->backend);
  return 0;
}

uint64_t
wrd_guest_stream_max (struct wrd *d, const struct sandbox *sb)
{
  json_int_t disk = json_integer_value (json_object_get (sb->spec, "disk_mb"));
  uint64_t max = (uint64_t)(disk > 0 ? disk : 1024) * 2 * (1u << 20) + HEADER_ROOM;
  struct wr_store_limits lim;
  wr_store_get_limits (d->store, &lim);
  if (lim.layer_bytes && max > lim.layer_bytes + HEADER_ROOM)
    max = lim.layer_bytes + HEADER_ROOM;
  return max;
}

int
wrd_guest_layer_commit (struct wr_store *s, int fd, const char *ref, char (*base)[72], size_t n,
                        const json_t *config, struct wr_image **ret, wr_err_t *err)
{
  int r = wr_layers_check (n + 1, "the snapshot image", err);
  if (r < 0)
    return r;
  if (lseek (fd, 0, SEEK_SET) < 0)
    return wr_sys_error (err, "rewind the guest's stream");
  struct wr_staged_layer *staged = NULL;
  /* OCI whiteouts: the agent sends deletions and opaque directories as
   * .wh. entries, which the helper turns into what overlayfs reads */
  r = wr_layer_stage_fd (s, fd, "the guest's writable layer", WR_STAGE_OCI, &staged, err);
  if (r < 0)
    return r;
  struct wr_layer_ref refs[WR_MAX_LAYERS + 1];
  memset (refs, 0, sizeof refs);
  for (size_t i = 0; i < n; i++)
    refs[i].digest = base[i];
  refs[n].staged = staged;
  r = wr_image_commit (s, ref, refs, n + 1, config, ret, err);
  wr_layer_stage_free (staged);
  return r;
}

/* ---- one export ---- */

struct gsnap
{
  struct wrd *d;
  char id[33];
  char ref[256];
  char (*layers)[72];
  size_t n_layers;
  json_t *config;
  int fd; /* the spool */
  uint64_t got, max;
  wr_err_t err; /* the first failure while spooling */
  bool failed;
  struct wrd_guest_snap snap;
  wrd_guest_snap_cb cb;
  void *ud;
  uint64_t t0, t_stream; /* ns */
  int r;
};

static void
gsnap_free (struct gsnap *g)
{
  if (g->fd >= 0)
    close (g->fd);
  free (g->layers);
  json_decref (g->config);
  wr_image_free (g->snap.img);
  free (g);
}

static void
gsnap_finish (struct gsnap *g, wr_err_t *err)
{
  struct sandbox *sb = wrd_sandbox_find (g->d, g->id);
  if (sb && sb->busy)
    sb->busy--;
  wr_err_t gone;
  if (sb == NULL && err == NULL)
    {
      /* destroyed meanwhile: its checkpoints were dropped already, so this
       * one must not outlive it */
      wr_image_remove (g->d->store, g->ref, NULL);
      wr_error (&gone, 0, WR_E_GONE, "sandbox %s was destroyed during the snapshot", g->id);
      err = &gone;
    }
  g->cb (g->d, g->ud, err ? NULL : &g->snap, err);
  gsnap_free (g);
}

static void
on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct gsnap *g = ud;
  if (g->failed)
    return;
  g->got += len;
  int w = wr_write_all (g->fd, data, len);
  if (w < 0)
    {
      g->failed = true;
      wr_error (&g->err, -w, w == -ENOSPC || w == -EDQUOT ? WR_E_EXHAUSTED : WR_E_INTERNAL,
                "spool the guest's writable layer");
    }
}

static void
commit_work (void *arg)
{
  struct gsnap *g = arg;
  g->r = wrd_guest_layer_commit (g->d->store, g->fd, g->ref, g->layers, g->n_layers, g->config,
                                 &g->snap.img, &g->err);
}

static void
commit_done (void *arg)
{
  struct gsnap *g = arg;
  uint64_t now = wr_now_ns ();
  wrd_log (WRD_LOG_INFO, "snapshot of %s: %llu stream bytes in %.0f ms, import %.0f ms%s\n", g->id,
           (unsigned long long)g->got, (double)(g->t_stream - g->t0) / 1e6,
           (double)(now - g->t_stream) / 1e6, g->r < 0 ? " (failed)" : "");
  gsnap_finish (g, g->r < 0 ? &g->err : NULL);
}

static void
on_done (void *ud, json_t *result)
{
  struct gsnap *g = ud;
  if (g->failed)
    {
      gsnap_finish (g, &g->err);
      return;
    }
  /* counts from the guest: shown, never trusted */
  static const char *const keys[] = { "entries", "bytes", "skipped", "scrubbed" };
  uint64_t *vals[] = { &g->snap.entries, &g->snap.bytes, &g->snap.skipped, &g->snap.scrubbed };
  for (size_t i = 0; i < WR_ARRAY_SIZE (keys); i++)
    {
      json_int_t v = json_integer_value (json_object_get (result, keys[i]));
      *vals[i] = v > 0 ? (uint64_t)v : 0;
    }
  g->snap.stream_bytes = g->got;
  g->t_stream = wr_now_ns ();
  g->snap.frozen = json_is_true (json_object_get (result, "frozen"));
  if (wrd_job_run (g->d, commit_work, commit_done, g) < 0)
    {
      wr_error (&g->err, 0, WR_E_INTERNAL, "cannot start a worker");
      gsnap_finish (g, &g->err);
    }
}

static void
on_error (void *ud, const char *code, const char *message)
{
  struct gsnap *g = ud;
  wr_err_t err;
  /* the agent's words are its sandbox's: they name what the guest lacks,
   * but only a few codes are taken as they are */
  bool gone = strcmp (code, WR_E_GONE) == 0;
  const char *c = gone                                   ? WR_E_GONE
                  : strcmp (code, WR_E_UNSUPPORTED) == 0 ? WR_E_UNSUPPORTED
                  : strcmp (code, WR_E_EXHAUSTED) == 0   ? WR_E_EXHAUSTED
                  : strcmp (code, WR_E_TOO_LARGE) == 0   ? WR_E_TOO_LARGE
                  : strcmp (code, WR_E_TIMEOUT) == 0     ? WR_E_TIMEOUT
                                                         : WR_E_INTERNAL;
  wr_error (&err, 0, c, "%s: %.400s",
            gone ? "the sandbox's agent went away during the export"
                 : "the guest's agent could not export its writable layer",
            message ? message : "failed");
  gsnap_finish (g, &err);
}

int
wrd_guest_snap_start (struct wrd *d, struct sandbox *sb, const char *ref, bool scrub,
                      wrd_guest_snap_cb cb, void *ud, wr_err_t *err)
{
  if (sb->state == SB_DEAD || sb->state == SB_DESTROYING || !sb->has_container
      || !agent_conn_alive (sb->conn))
    return wr_error (err, 0, WR_E_GONE, "sandbox %s is dead; nothing to export", sb->id);
  int r = wrd_guest_upper_check (sb, "a snapshot", err);
  if (r < 0)
    return r;
  struct gsnap *g = calloc (1, sizeof *g);
  if (g == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  g->d = d;
  g->fd = -1;
  g->cb = cb;
  g->ud = ud;
  snprintf (g->id, sizeof g->id, "%s", sb->id);
  snprintf (g->ref, sizeof g->ref, "%s", ref);
  g->layers = calloc (sb->n_layers + 1, sizeof *g->layers);
  g->config = json_deep_copy (sb->img_conf ? sb->img_conf : json_null ());
  char tmp[1200];
  snprintf (tmp, sizeof tmp, "%s/tmp", wr_store_root (d->store));
  g->fd = open (tmp, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (g->layers == NULL || g->fd < 0)
    {
      r = g->fd < 0 ? wr_sys_error (err, "spool file in %s", tmp)
                    : wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      gsnap_free (g);
      return r;
    }
  memcpy (g->layers, sb->layers, sb->n_layers * sizeof *g->layers);
  g->n_layers = sb->n_layers;
  g->max = wrd_guest_stream_max (d, sb);
  g->t0 = wr_now_ns ();
  static const struct agent_ops ops = { on_data, on_done, on_error };
  /* an honest agent stops short of the bound and says why; only one that
   * ignores it is cut off (agent_set_data_limit) */
  json_t *body = json_pack ("{s:s,s:s,s:b,s:I}", "op", "export", "path", "/", "scrub", scrub,
                            "max_bytes", (json_int_t)g->max);
  uint32_t stream = agent_request (sb->conn, WR_MSG_FILE, body, &ops, g);
  json_decref (body);
  if (stream == 0)
    {
      gsnap_free (g);
      return wr_error (err, 0, WR_E_GONE, "sandbox %s: its agent is not connected", sb->id);
    }
  agent_set_data_limit (sb->conn, stream, (size_t)g->max);
  agent_set_idle_timeout (sb->conn, stream, WRD_GUEST_IDLE_MS);
  sb->busy++; /* no idle pause while the agent streams */
  return 0;
}

/* The writable layer of a microvm or vm sandbox as an image (docs/rl.md,
 * "Checkpoints, restore and diff on microvm and vm"): its agent streams the
 * guest's overlay upper as a tar (the FILE op "export", docs/protocol.md),
 * and the daemon imports that stream as hostile input, through the confined
 * unpack helper and its limits, into one EROFS layer on top of the
 * sandbox's own layers. The result is the same kind of image a container's
 * pack makes, so checkpoints, diffs and forks work on it unchanged. */
#ifndef WRD_GUEST_UPPER_H
#define WRD_GUEST_UPPER_H

#include "daemon/daemon.h"

/* A guest agent silent this long on an export or an apply fails the request
 * with "timeout" (agent_set_idle_timeout): a hung or hostile guest cannot
 * hold a checkpoint, diff, fork or restore forever. */
#define WRD_GUEST_IDLE_MS 120000

/* Does sb's writable layer come from its agent (a VM backend)? */
bool wrd_guest_upper (const struct sandbox *sb);
/* 0 when sb can export its layer now, else why not (WR_E_UNSUPPORTED for a
 * VM booted from a disk image, WR_E_CONFLICT for a paused one). */
int wrd_guest_upper_check (const struct sandbox *sb, const char *what, wr_err_t *err);

struct wrd_guest_snap
{
  struct wr_image *img; /* the new image: sb's layers + the exported one */
  uint64_t entries, bytes, stream_bytes, skipped, scrubbed;
  bool frozen; /* the guest's tasks were frozen during the walk */
};

/* On the loop thread, exactly once: snap on success (owned by the callee
 * of the callback only for its duration; img is freed after), else err. */
typedef void (*wrd_guest_snap_cb) (struct wrd *d, void *ud, struct wrd_guest_snap *snap,
                                   wr_err_t *err);

/* Export sb's layer and commit it as image ref (name:tag) with sb's
 * layers below it and sb's image config; scrub leaves out what a pack
 * does (wr_pack_scrubbed). Asynchronous: cb reports. */
int wrd_guest_snap_start (struct wrd *d, struct sandbox *sb, const char *ref, bool scrub,
                          wrd_guest_snap_cb cb, void *ud, wr_err_t *err);

/* Worker thread: the tar at fd (read from its start, untrusted) as one
 * layer over base (n digests, bottom-most first) named ref, through the
 * confined helper with the store's layer limits. */
int wrd_guest_layer_commit (struct wr_store *s, int fd, const char *ref, char (*base)[72], size_t n,
                            const json_t *config, struct wr_image **ret, wr_err_t *err);

/* The most a guest's stream may hold (spooled on the host's disk): twice
 * the sandbox's disk plus 64 MiB for headers, at most the store's layer
 * limit plus that. One byte more and the agent loses its connection. */
uint64_t wrd_guest_stream_max (struct wrd *d, const struct sandbox *sb);

#endif

/* The sandbox backends behind one table: the daemon's lifecycle code calls
 * these and never a backend directly. A backend starts the same agent and
 * hands back a connected channel (wr_container.agent_fd); everything above
 * (exec, files, TTL, registry) is shared. */
#ifndef WRD_BACKENDS_H
#define WRD_BACKENDS_H

#include "daemon/daemon.h"

/* what a backend can do, so the daemon never asks for one by name */
enum
{
  /* create may run on a builder thread (off the event loop) */
  WRD_BACKEND_THREADED_CREATE = 1u << 0,
  /* the writable layer is exported by the agent from inside a guest
   * (guest_upper.h), not handed over as a host directory (upper_fd) */
  WRD_BACKEND_GUEST_UPPER = 1u << 1,
};

struct wrd_backend
{
  const char *name;
  unsigned flags;
  /* most read-only layers a sandbox may stack (0: WR_MAX_LAYERS) */
  size_t max_layers;
  int (*create) (struct wrd *d, const struct wr_container_spec *spec, struct wr_container *ret,
                 wr_err_t *err);
  int (*destroy) (struct wrd *d, struct wr_container *c, const char *state_dir, wr_err_t *err);
  int (*adopt) (struct wrd *d, const char *id, pid_t pid, uint64_t start_time,
                const char *state_dir, struct wr_container *ret, wr_err_t *err);
  int (*freeze) (struct wrd *d, struct wr_container *c, bool frozen, wr_err_t *err);
  /* pause that frees memory and resume (NULL: pause is freeze) */
  int (*pause) (struct wrd *d, struct wr_container *c, bool pause, struct wr_pause_stats *ret,
                wr_err_t *err);
  /* the slow half of a pause, on a worker thread (wr_container_reclaim;
   * NULL: none): it may use d->rt and id only */
  int (*reclaim) (struct wrd *d, const char *id, const atomic_bool *stop,
                  struct wr_pause_stats *st);
  int (*stats) (struct wrd *d, struct wr_container *c, struct wr_container_stats *ret,
                wr_err_t *err);
  /* the writable layer as a directory fd, for pack (NULL: no pack) */
  int (*upper_fd) (struct wrd *d, struct wr_container *c, wr_err_t *err);
};

struct sandbox;
/* Fill usage.oom_killed of an exec or call result (res, owned by the
 * caller): what the agent measured where it owns the task cgroup (VM
 * guests), else whether the sandbox's cgroups saw a new OOM kill when the
 * process died of SIGKILL. */
bool wrd_backend_exec_oom (struct wrd *d, struct sandbox *sb, json_t *res);

/* NULL when the name is unknown; ret_available false when known but not
 * usable on this node (e.g. its binaries are missing). */
const struct wrd_backend *wrd_backend_get (const char *name);
/* every backend name this build knows, comma separated, for messages */
const char *wrd_backend_names (void);
/* a name this build knows, usable here or not */
bool wrd_backend_known (const char *name);

#endif

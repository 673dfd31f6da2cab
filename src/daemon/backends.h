/* The sandbox backends behind one table: the daemon's lifecycle code calls
 * these and never a backend directly. A backend starts the same agent and
 * hands back a connected channel (wr_container.agent_fd); everything above
 * (exec, files, TTL, registry) is shared. */
#ifndef WRD_BACKENDS_H
#define WRD_BACKENDS_H

#include "daemon/daemon.h"

struct wrd_backend
{
  const char *name;
  int (*create) (struct wrd *d, const struct wr_container_spec *spec, struct wr_container *ret,
                 wr_err_t *err);
  int (*destroy) (struct wrd *d, struct wr_container *c, const char *state_dir, wr_err_t *err);
  int (*adopt) (struct wrd *d, const char *id, pid_t pid, uint64_t start_time,
                const char *state_dir, struct wr_container *ret, wr_err_t *err);
  int (*freeze) (struct wrd *d, struct wr_container *c, bool frozen, wr_err_t *err);
  int (*stats) (struct wrd *d, struct wr_container *c, struct wr_container_stats *ret,
                wr_err_t *err);
};

/* NULL when the name is unknown; ret_available false when known but not
 * usable on this node (e.g. its binaries are missing). */
const struct wrd_backend *wrd_backend_get (const char *name);

#endif

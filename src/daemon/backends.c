#include "daemon/backends.h"

#include <string.h>

static int
ct_create (struct wrd *d, const struct wr_container_spec *spec, struct wr_container *ret,
           wr_err_t *err)
{
  return wr_container_create (d->rt, spec, ret, err);
}

static int
ct_destroy (struct wrd *d, struct wr_container *c, const char *state_dir, wr_err_t *err)
{
  return wr_container_destroy (d->rt, c, state_dir, err);
}

static int
ct_adopt (struct wrd *d, const char *id, pid_t pid, uint64_t start_time, const char *state_dir,
          struct wr_container *ret, wr_err_t *err)
{
  return wr_container_adopt (d->rt, id, pid, start_time, state_dir, ret, err);
}

static int
ct_freeze (struct wrd *d, struct wr_container *c, bool frozen, wr_err_t *err)
{
  return wr_container_freeze (d->rt, c, frozen, err);
}

static int
ct_stats (struct wrd *d, struct wr_container *c, struct wr_container_stats *ret, wr_err_t *err)
{
  return wr_container_stats (d->rt, c, ret, err);
}

static const struct wrd_backend container_backend = {
  .name = "container",
  .create = ct_create,
  .destroy = ct_destroy,
  .adopt = ct_adopt,
  .freeze = ct_freeze,
  .stats = ct_stats,
};

static const struct wrd_backend *const backends[] = {
  &container_backend,
};

const struct wrd_backend *
wrd_backend_get (const char *name)
{
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp (backends[i]->name, name) == 0)
      return backends[i];
  return NULL;
}

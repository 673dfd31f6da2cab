#include "daemon/backends.h"

#include <stdio.h>
#include <string.h>

#include "backend/vm.h"

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

/* microvm / vm (src/backend/vm.c): QEMU processes; stats come from their
 * cgroup exactly as for containers. */
#define VM_OPS(prefix, kind)                                                                       \
  static int prefix##_create (struct wrd *d, const struct wr_container_spec *spec,                 \
                              struct wr_container *ret, wr_err_t *err)                             \
  {                                                                                                \
    return wr_vm_create (d->rt, kind, spec, ret, err);                                             \
  }

VM_OPS (mvm, WR_VM_MICRO)
VM_OPS (fvm, WR_VM_FULL)

static int
vm_destroy (struct wrd *d, struct wr_container *c, const char *state_dir, wr_err_t *err)
{
  return wr_vm_destroy (d->rt, c, state_dir, err);
}

static int
vm_adopt (struct wrd *d, const char *id, pid_t pid, uint64_t start_time, const char *state_dir,
          struct wr_container *ret, wr_err_t *err)
{
  return wr_vm_adopt (d->rt, id, pid, start_time, state_dir, ret, err);
}

static int
vm_freeze (struct wrd *d, struct wr_container *c, bool frozen, wr_err_t *err)
{
  char sdir[1200];
  snprintf (sdir, sizeof sdir, "%s/sandboxes/%s", d->root, c->id);
  return wr_vm_freeze (d->rt, sdir, frozen, err);
}

static const struct wrd_backend microvm_backend = {
  .name = "microvm",
  .create = mvm_create,
  .destroy = vm_destroy,
  .adopt = vm_adopt,
  .freeze = vm_freeze,
  .stats = ct_stats,
};

static const struct wrd_backend vm_backend = {
  .name = "vm",
  .create = fvm_create,
  .destroy = vm_destroy,
  .adopt = vm_adopt,
  .freeze = vm_freeze,
  .stats = ct_stats,
};

static const struct wrd_backend *const backends[] = {
  &container_backend,
  &microvm_backend,
  &vm_backend,
};

const struct wrd_backend *
wrd_backend_get (const char *name)
{
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp (backends[i]->name, name) == 0)
      return backends[i];
  return NULL;
}

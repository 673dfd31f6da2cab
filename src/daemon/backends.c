#include "daemon/backends.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <linux/magic.h>

#include "backend/container.h"
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
ct_pause (struct wrd *d, struct wr_container *c, bool pause, struct wr_pause_stats *ret,
          wr_err_t *err)
{
  return wr_container_pause (d->rt, c, pause, ret, err);
}

static int
ct_reclaim (struct wrd *d, const char *id, const atomic_bool *stop, struct wr_pause_stats *st)
{
  return wr_container_reclaim (d->rt, id, stop, st);
}

static int
ct_stats (struct wrd *d, struct wr_container *c, struct wr_container_stats *ret, wr_err_t *err)
{
  return wr_container_stats (d->rt, c, ret, err);
}

/* The container's writable layer is a detached tmpfs whose upper dir the
 * agent keeps at WR_AGENT_UPPER_FD (--keep-fd): reached with pidfd_getfd. */
static int
ct_upper_fd (struct wrd *d, struct wr_container *c, wr_err_t *err)
{
  if (wr_container_pidfd (c) < 0)
    return wr_error (err, 0, WR_E_UNSUPPORTED, "sandbox %s has no pidfd", c->id);
  int fd = (int)syscall (SYS_pidfd_getfd, c->pidfd, WR_AGENT_UPPER_FD, 0);
  if (fd < 0)
    return wr_error (err, errno, errno == EBADF ? WR_E_UNSUPPORTED : WR_E_INTERNAL,
                     "cannot reach the writable layer of sandbox %s%s", c->id,
                     errno == EBADF ? " (created by an older warrend? recreate it)" : "");
  /* the agent is ours, but check what we got before reading through it */
  struct statfs sfs;
  struct stat st;
  if (fstatfs (fd, &sfs) < 0 || sfs.f_type != TMPFS_MAGIC || fstat (fd, &st) < 0
      || !S_ISDIR (st.st_mode))
    {
      close (fd);
      return wr_error (err, 0, WR_E_INTERNAL, "sandbox %s: fd %d of its agent is not its upper dir",
                       c->id, WR_AGENT_UPPER_FD);
    }
  return fd;
}

static const struct wrd_backend container_backend = {
  .name = "container",
  .flags = WRD_BACKEND_THREADED_CREATE,
  .upper_fd = ct_upper_fd,
  .create = ct_create,
  .destroy = ct_destroy,
  .adopt = ct_adopt,
  .freeze = ct_freeze,
  .pause = ct_pause,
  .reclaim = ct_reclaim,
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
  .flags = WRD_BACKEND_GUEST_UPPER,
  .max_layers = WR_MICROVM_MAX_LAYERS,
  .create = mvm_create,
  .destroy = vm_destroy,
  .adopt = vm_adopt,
  .freeze = vm_freeze,
  .stats = ct_stats,
};

static const struct wrd_backend vm_backend = {
  .name = "vm",
  .flags = WRD_BACKEND_GUEST_UPPER,
  .max_layers = WR_VM_MAX_LAYERS,
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

const char *
wrd_backend_names (void)
{
  return "container, microvm, vm";
}

bool
wrd_backend_known (const char *name)
{
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp (backends[i]->name, name) == 0)
      return true;
  return false;
}

bool
wrd_backend_exec_oom (struct wrd *d, struct sandbox *sb, json_t *res)
{
  json_t *usage = json_object_get (res, "usage");
  if (!json_is_object (usage))
    json_object_set_new (res, "usage", usage = json_object ());
  json_t *told = json_object_get (usage, "oom_killed");
  bool oom = json_is_true (told);
  json_int_t code = json_integer_value (json_object_get (res, "exit_code"));
  json_int_t sig = json_integer_value (json_object_get (res, "signal"));
  if (told == NULL && sb && sb->has_container && (sig == 9 || code == 137))
    {
      struct wr_container_stats st;
      if (sb->ops->stats (d, &sb->c, &st, NULL) == 0 && st.oom_kills > sb->oom_seen)
        {
          oom = true;
          sb->oom_seen = st.oom_kills;
        }
    }
  json_object_set_new (usage, "oom_killed", json_boolean (oom));
  return oom;
}

const struct wrd_backend *
wrd_backend_get (const char *name)
{
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp (backends[i]->name, name) == 0)
      return backends[i];
  return NULL;
}

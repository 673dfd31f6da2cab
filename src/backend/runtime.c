/* wr_runtime: per-daemon state of the container backend, built once:
 * cgroup layout, the shared user namespace, the seccomp program and the
 * agent binary fd (docs/containers.md). */
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "../common/util.h"
#include "backend.h"
#include "syscalls.h"

#define CHILD_STACK (64 * 1024)

int
wr_runtime_private_mountns (wr_err_t *err)
{
  if (unshare (CLONE_NEWNS) < 0)
    return wr_sys_error (err, "unshare(CLONE_NEWNS)");
  if (mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    return wr_sys_error (err, "make / private");
  return 0;
}

static int
write_maps (pid_t pid, const char *map, wr_err_t *err)
{
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/uid_map", (int)pid);
  int r = wr_write_file_at (AT_FDCWD, path, map);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "write %s", path);
  snprintf (path, sizeof path, "/proc/%d/gid_map", (int)pid);
  r = wr_write_file_at (AT_FDCWD, path, map);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "write %s", path);
  return 0;
}

static int
userns_holder (void *arg)
{
  for (;;)
    pause ();
  return 0;
}

/* A user namespace with the sandbox mapping, kept as an fd: a throwaway child
 * unshares it, we write its maps, open /proc/pid/ns/user and kill the child. */
static int
make_userns (struct wr_runtime *rt, wr_err_t *err)
{
  static char stack[16384] __attribute__ ((aligned (16)));
  pid_t pid = clone (userns_holder, stack + sizeof stack, CLONE_NEWUSER | SIGCHLD, NULL);
  if (pid < 0)
    return wr_sys_error (err, "clone(CLONE_NEWUSER)");
  int r = write_maps (pid, rt->uid_map, err);
  if (r == 0)
    {
      char path[64];
      snprintf (path, sizeof path, "/proc/%d/ns/user", (int)pid);
      rt->userns_fd = open (path, O_RDONLY | O_CLOEXEC);
      if (rt->userns_fd < 0)
        r = wr_sys_error (err, "open %s", path);
    }
  kill (pid, SIGKILL);
  while (waitpid (pid, NULL, __WALL) < 0 && errno == EINTR)
    ;
  return r;
}

int
wr_idmap_mount (int userns_fd, const char *src_dir, const char *dst_dir, wr_err_t *err)
{
  _cleanup_close_ int t
      = wr_sys_open_tree (AT_FDCWD, src_dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
  if (t < 0)
    return wr_sys_error (err, "open_tree %s", src_dir);
  struct mount_attr attr = { .attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns_fd };
  if (wr_sys_mount_setattr (t, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0)
    return wr_error (err, errno, errno == EINVAL ? WR_E_UNSUPPORTED : WR_E_INTERNAL, "idmap %s",
                     src_dir);
  if (wr_sys_move_mount (t, "", AT_FDCWD, dst_dir, MOVE_MOUNT_F_EMPTY_PATH) < 0)
    return wr_sys_error (err, "move_mount %s -> %s", src_dir, dst_dir);
  return 0;
}

static const char *
layout_name (enum wr_cg_layout l)
{
  return l == WR_CG_V2 ? "v2" : l == WR_CG_HYBRID ? "hybrid" : "v1";
}

int
wr_runtime_new (const struct wr_runtime_config *cfg, struct wr_runtime **ret, wr_err_t *err)
{
  if (cfg == NULL || cfg->root == NULL || cfg->root[0] != '/' || cfg->agent_path == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "runtime config needs an absolute root and agent");
  if (cfg->uid_base == 0 || cfg->uid_count == 0
      || (uint64_t)cfg->uid_base + cfg->uid_count > UINT32_MAX)
    return wr_error (err, EINVAL, WR_E_INVALID, "uid range %u+%u (root must not map to host root)",
                     (unsigned)cfg->uid_base, cfg->uid_count);
  struct wr_runtime *rt = calloc (1, sizeof *rt);
  if (rt == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "runtime");
  rt->agent_fd = rt->userns_fd = -1;
  rt->cg.v2_fd = -1;
  for (int i = 0; i < WR_V1_N; i++)
    rt->cg.v1_fd[i] = -1;
  pthread_mutex_init (&rt->lock, NULL);
  pthread_cond_init (&rt->stack_free, NULL);
  rt->uid_base = cfg->uid_base;
  rt->uid_count = cfg->uid_count;
  snprintf (rt->uid_map, sizeof rt->uid_map, "0 %u %u\n", (unsigned)cfg->uid_base, cfg->uid_count);
  int r;
  rt->root = strdup (cfg->root);
  if (rt->root == NULL || asprintf (&rt->mnt_dir, "%s/run/mnt", cfg->root) < 0)
    {
      rt->mnt_dir = NULL;
      r = wr_error (err, ENOMEM, WR_E_INTERNAL, "runtime");
      goto fail;
    }
  if ((r = wr_mkdir_p (rt->mnt_dir, 0700)) < 0)
    {
      r = wr_error (err, -r, WR_E_INTERNAL, "mkdir %s", rt->mnt_dir);
      goto fail;
    }
  rt->agent_fd = open (cfg->agent_path, O_RDONLY | O_CLOEXEC);
  if (rt->agent_fd < 0)
    {
      r = wr_sys_error (err, "open agent %s", cfg->agent_path);
      goto fail;
    }
  {
    _cleanup_free_ char *b = NULL;
    rt->cap_last = 40;
    if (wr_read_file_at (AT_FDCWD, "/proc/sys/kernel/cap_last_cap", &b, NULL, 64) == 0)
      rt->cap_last = atoi (b);
  }
  for (int s = 1; s < 65; s++)
    {
      struct sigaction sa;
      if (s != SIGKILL && s != SIGSTOP && sigaction (s, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN)
        rt->ign_signals[rt->n_ign++] = s;
    }
  {
    /* One cgroup parent per daemon root: stable across restarts (recovery
     * finds the sandboxes), distinct between daemons on one host. */
    uint32_t h = 2166136261u;
    for (const char *c = rt->root; *c; c++)
      h = (h ^ (unsigned char)*c) * 16777619u;
    snprintf (rt->cg_name, sizeof rt->cg_name, "warren-%08x", h);
  }
  if ((r = wr_cg_init (&rt->cg, rt->cg_name, err)) < 0)
    goto fail;
  if ((r = make_userns (rt, err)) < 0)
    goto fail;
  if ((r = wr_seccomp_build (&rt->seccomp, err)) < 0)
    goto fail;
  rt->stack_size = CHILD_STACK;
  for (int i = 0; i < WR_CHILD_STACKS; i++)
    {
      rt->stack[i] = mmap (NULL, rt->stack_size, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
      if (rt->stack[i] == MAP_FAILED)
        {
          rt->stack[i] = NULL;
          r = wr_sys_error (err, "mmap child stack");
          goto fail;
        }
    }
  snprintf (rt->describe, sizeof rt->describe,
            "{\"cgroup_layout\":\"%s\",\"cgroup_v2\":\"%s\",\"clone_into_cgroup\":%s,"
            "\"uid_base\":%u,\"uid_count\":%u,\"idmapped_layers\":true,\"seccomp_insns\":%u,"
            "\"clone_vm\":%s}",
            layout_name (rt->cg.layout), rt->cg.v2_fd >= 0 ? rt->cg.v2_path : "",
            rt->cg.v2_fd >= 0 ? "true" : "false", (unsigned)rt->uid_base, rt->uid_count,
            rt->seccomp.len, WR_HAVE_CLONE3_RUN ? "true" : "false");
  *ret = rt;
  return 0;
fail:
  wr_runtime_free (rt);
  return r;
}

void
wr_runtime_free (struct wr_runtime *rt)
{
  if (rt == NULL)
    return;
  wr_cg_fini (&rt->cg);
  if (rt->agent_fd >= 0)
    close (rt->agent_fd);
  if (rt->userns_fd >= 0)
    close (rt->userns_fd);

  for (int i = 0; i < WR_CHILD_STACKS; i++)
    if (rt->stack[i])
      munmap (rt->stack[i], rt->stack_size);
  if (rt->mnt_dir)
    rmdir (rt->mnt_dir);
  free (rt->seccomp.filter);
  free (rt->mnt_dir);
  free (rt->root);
  pthread_mutex_destroy (&rt->lock);
  pthread_cond_destroy (&rt->stack_free);
  free (rt);
}

const char *
wr_runtime_describe (struct wr_runtime *rt)
{
  return rt->describe;
}

int
wr_runtime_userns_fd (struct wr_runtime *rt)
{
  return rt->userns_fd;
}

const char *
wr_runtime_cgroup_name (struct wr_runtime *rt)
{
  return rt->cg_name;
}

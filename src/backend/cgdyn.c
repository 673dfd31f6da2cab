/* cgroup "favordynmods" (docs/containers.md "Task migrations").
 *
 * Moving a task between cgroups (a write to cgroup.procs) takes the
 * kernel's cgroup_threadgroup_rwsem for writing. That rwsem is a per-cpu
 * one whose readers (every fork and exit) are fast only while no writer was
 * seen lately, so a writer on a quiet host first waits for an RCU grace
 * period: 6-8 ms per migration on this machine (a sandbox's first exec
 * joining its exec cgroup, every create's v1 attach), against 0.02 ms when
 * another migration had just happened. The `favordynmods` root flag keeps
 * the rwsem in its writer-friendly mode: migrations stop waiting, and forks
 * and exits pay an atomic instead of a per-cpu increment (not measurable
 * here: 1,000 fork+exit+wait at 0.66-1.09 ms each with and without).
 *
 * The flag belongs to the whole host (every cgroup root shares the rwsem)
 * and kernels since 6.18 do not let it be cleared again, so warrend sets it
 * once at start, logs it, and can be told not to (--no-cgroup-favordynmods).
 * Feature detection, not a version check: setting the option fails with
 * EINVAL on a kernel that lacks it. Returns 1 when it was set now, 0 when
 * it was on already, -1 with err. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "../common/util.h"
#include "backend.h"
#include "syscalls.h"

#ifndef __NR_fspick
#define __NR_fspick 433
#endif
#ifndef FSPICK_CLOEXEC
#define FSPICK_CLOEXEC 0x00000001
#endif
#ifndef FSPICK_NO_AUTOMOUNT
#define FSPICK_NO_AUTOMOUNT 0x00000004
#endif
#ifndef FSCONFIG_CMD_RECONFIGURE
#define FSCONFIG_CMD_RECONFIGURE 7
#endif

/* The first cgroup2 mount of the whole hierarchy (root "/") and its super
 * options; path[0] == '\0' when cgroup2 is not mounted (a v1-only host). */
struct v2_scan
{
  char *path, *opts;
};

static bool
v2_mount (const char *mnt, const char *fstype, char *opts, void *ud)
{
  struct v2_scan *v = ud;
  if (strcmp (fstype, "cgroup2") != 0)
    return false;
  snprintf (v->path, 256, "%s", mnt);
  snprintf (v->opts, 1024, "%s", opts);
  return true;
}

static int
find_v2 (char path[256], char opts[1024], wr_err_t *err)
{
  path[0] = '\0';
  struct v2_scan v = { path, opts };
  return wr_cg_mounts (v2_mount, &v, err);
}

static bool
has_word (const char *list, const char *w)
{
  size_t n = strlen (w);
  for (const char *p = list; (p = strstr (p, w)) != NULL; p += n)
    if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
      return true;
  return false;
}

int
wr_cg_favor_dynmods (char where[256], wr_err_t *err)
{
  char opts[1024] = "";
  int r = find_v2 (where, opts, err);
  if (r < 0)
    return r;
  bool mounted = where[0] != '\0';
  if (mounted && has_word (opts, "favordynmods"))
    return 0;
  _cleanup_close_ int fd = -1;
  if (mounted)
    {
      /* a cgroup2 mount: reconfigure it. A reconfigure applies the whole
       * set of root flags, so give back every one it has (nsdelegate,
       * memory_recursiveprot...), the mount's own rw/ro aside. */
      fd = (int)syscall (__NR_fspick, AT_FDCWD, where, FSPICK_CLOEXEC | FSPICK_NO_AUTOMOUNT);
      if (fd < 0)
        return wr_sys_error (err, "fspick %s", where);
      char *save = NULL;
      for (char *o = strtok_r (opts, ",", &save); o; o = strtok_r (NULL, ",", &save))
        if (strcmp (o, "rw") != 0 && strcmp (o, "ro") != 0
            && syscall (__NR_fsconfig, fd, FSCONFIG_SET_FLAG, o, NULL, 0) < 0)
          return wr_sys_error (err, "%s: keep option %s", where, o);
    }
  else
    {
      /* v1 only: a v1 root's flags cannot change at remount, but the rwsem
       * is shared by every root, and the cgroup2 root exists unmounted.
       * Making (not mounting) a cgroup2 superblock applies its flags; with
       * no cgroup2 mount there are no other flags to keep. */
      snprintf (where, 256, "cgroup2 (not mounted)");
      fd = (int)syscall (__NR_fsopen, "cgroup2", FSOPEN_CLOEXEC);
      if (fd < 0)
        return wr_sys_error (err, "fsopen cgroup2");
    }
  if (syscall (__NR_fsconfig, fd, FSCONFIG_SET_FLAG, "favordynmods", NULL, 0) < 0)
    return wr_error (err, errno, errno == EINVAL ? WR_E_UNSUPPORTED : WR_E_INTERNAL,
                     "%s: this kernel has no favordynmods", where);
  if (syscall (__NR_fsconfig, fd, mounted ? FSCONFIG_CMD_RECONFIGURE : FSCONFIG_CMD_CREATE, NULL,
               NULL, 0)
      < 0)
    return wr_sys_error (err, "%s: apply favordynmods", where);
  return 1;
}

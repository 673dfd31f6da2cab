/* Reference measurements for `warren bench`: what the kernel and the usual
 * alternatives cost on this machine, in the same run as Warren's figures
 * (docs/performance.md). Every measuring function runs a few warm-up
 * iterations, then s->n sequential measured ones, and fills s->lat_ms[0..n)
 * (allocated by the caller) with per-iteration latencies in milliseconds,
 * s->wall_s with the wall time of the measured part and s->note (a static
 * string or NULL) with how the measurement deviated from the plain recipe. */
#ifndef WR_CLI_BENCH_FLOOR_H
#define WR_CLI_BENCH_FLOOR_H

#include <stddef.h>
#include <jansson.h>

#include "common/err.h"

typedef struct wr_bench_stats
{
  size_t count;
  unsigned concurrency;
  double wall_s; /* wall time of the whole measured run */
  double rate_per_s;
  double p50_ms, p90_ms, p99_ms, mean_ms, min_ms, max_ms;
} wr_bench_stats_t;

#define WR_BENCH_MAX_STEPS 16

typedef struct wr_bench_sample
{
  double *lat_ms;
  size_t n;
  double wall_s;
  const char *note;
  /* Where the time goes (bare container floor only): mean duration of each
   * step over the measured iterations, in ms; n_steps == 0 when not known. */
  size_t n_steps;
  const char *step_name[WR_BENCH_MAX_STEPS];
  double step_mean_ms[WR_BENCH_MAX_STEPS];
} wr_bench_sample_t;

/* Sorts lat_ms in place. rate_per_s = count / wall_s. */
void wr_bench_stats_compute (double *lat_ms, size_t n, double wall_s, unsigned concurrency,
                             wr_bench_stats_t *ret);
/* {"count","concurrency","rate_per_s","p50_ms","p90_ms","p99_ms","mean_ms",...} */
json_t *wr_bench_stats_json (const wr_bench_stats_t *s);
/* qsort comparator for doubles, ascending */
int wr_bench_cmp_double (const void *a, const void *b);
/* {"median","min","max"} of n values (sorted in place; 3 decimals), null
 * when n is 0; *ret_median (may be NULL): the median, the mean of the two
 * middle values when n is even */
json_t *wr_bench_range_json (double *v, size_t n, double *ret_median);
/* {"step": mean_ms, ...} in order, or NULL when the sample has no steps. */
json_t *wr_bench_steps_json (const wr_bench_sample_t *s);

/* Build a minimal busybox rootfs in dir (created if missing): bin/busybox
 * copied from the host's static busybox, bin/true and bin/sh symlinks, and
 * empty proc, dev, sys, tmp, etc. Idempotent. */
int wr_bench_rootfs_prepare (const char *dir, wr_err_t *err);
/* Check that dir looks like a usable rootfs (bin/true, proc/). */
int wr_bench_rootfs_check (const char *dir, wr_err_t *err);

/* The bare container floor: clone(NEWPID|NEWNS|NEWUTS|NEWIPC) without user
 * namespace, cgroup or seccomp; the child makes mounts private, mounts a
 * tmpfs for the overlay upper/work dirs and an overlay (lower = rootfs),
 * mounts /proc, pivot_root(".", "."), detaches the old root and execs
 * /bin/true; the parent waits. scratch is an existing empty host directory
 * that the tmpfs covers inside the child's mount namespace only, so nothing
 * needs unmounting on the host. */
int wr_bench_floor_container (const char *rootfs, const char *scratch, wr_bench_sample_t *s,
                              wr_err_t *err);
/* The same with a plain fork-style clone (no CLONE_VM): the child gets a
 * copy-on-write address space, as a daemon that forks would. Context only. */
int wr_bench_floor_container_fork (const char *rootfs, const char *scratch, wr_bench_sample_t *s,
                                   wr_err_t *err);

/* posix_spawn + waitpid of rootfs/bin/busybox as `true` on the host. */
int wr_bench_floor_spawn (const char *rootfs, wr_bench_sample_t *s, wr_err_t *err);

/* `crun run` of a generated OCI bundle (rootfs, /bin/true, pid/mount/uts/ipc
 * namespaces, cgroups disabled). crun 1.8 refuses hybrid cgroup layouts
 * whose v2 hierarchy has controllers; then each crun runs in a private mount
 * namespace where /sys/fs/cgroup/unified is unmounted (s->note says so). workdir is an existing
 * directory for the bundle. Fails with WR_E_UNSUPPORTED when crun is not installed. */
int wr_bench_crun (const char *rootfs, const char *workdir, wr_bench_sample_t *s, wr_err_t *err);

/* `bwrap --unshare-all --bind ROOTFS / --proc /proc --dev /dev /bin/true`
 * (falls back to fewer namespaces if this bwrap refuses). Fails with
 * WR_E_UNSUPPORTED when bwrap is not installed. */
int wr_bench_bwrap (const char *rootfs, wr_bench_sample_t *s, wr_err_t *err);

/* Find an executable in PATH; malloc'd absolute path or NULL. */
char *wr_bench_which (const char *name);

/* Run argv[0] (a path) with stdin/stdout on /dev/null and stderr captured;
 * SIGKILL after timeout_ms. Returns the wait status (>= 0) when it exited 0,
 * else a negative error (WR_E_TIMEOUT on timeout) whose message ends with
 * the tail of the command's stderr. */
int wr_bench_run (char *const argv[], int timeout_ms, wr_err_t *err);
/* The same; with hide_cgroup2 the command runs in a new private mount
 * namespace without /sys/fs/cgroup/unified. */
int wr_bench_run_ex (char *const argv[], int timeout_ms, int hide_cgroup2, wr_err_t *err);

#endif

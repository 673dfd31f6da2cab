/* Container backend: namespaces, cgroups, overlay root, seccomp (docs/containers.md).
 * The daemon owns one wr_runtime; each sandbox one wr_container. */
#ifndef WR_CONTAINER_H
#define WR_CONTAINER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <jansson.h>

#include "../common/err.h"

struct wr_runtime; /* opaque: cgroup layout, uid range, seccomp program, agent binary fd */

struct wr_runtime_config
{
  const char *root;       /* daemon state root (absolute) */
  const char *agent_path; /* static warren-agent binary on the host */
  uid_t uid_base;         /* unused: each sandbox has its own block (below) */
  uint32_t uid_count;     /* unused */
  /* Host uid/gid range sandboxes take WR_UID_BLOCK ids each from (its root
   * is the block's first id). 0 count: $WARREN_UID_RANGE ("START:COUNT"),
   * else the default below. Start: a non-zero multiple of WR_UID_BLOCK. */
  uint64_t uid_range_start;
  uint64_t uid_range_count;
};

#define WR_UID_BLOCK 65536u
/* 2^30 .. 2^31-1: above the ranges useradd gives out (/etc/subuid from
 * 100000, system and login users below 60000) and below 2^31, which some
 * tools still treat as signed. 16384 blocks. */
#define WR_UID_RANGE_START (1ull << 30)
#define WR_UID_RANGE_COUNT (1ull << 30)

int wr_runtime_new (const struct wr_runtime_config *cfg, struct wr_runtime **ret, wr_err_t *err);
void wr_runtime_free (struct wr_runtime *rt);
/* Human-readable description of detected features (cgroup layout, idmap, ...) as JSON text. */
const char *wr_runtime_describe (struct wr_runtime *rt);
/* -1: no shared user namespace any more (each sandbox has its own uid block
 * and its layers are idmapped per sandbox); the store then hands out its
 * plain layer mounts. */
int wr_runtime_userns_fd (struct wr_runtime *rt);
/* Name of this runtime's parent cgroup under each hierarchy ("warren-<hash of root>"). */
const char *wr_runtime_cgroup_name (struct wr_runtime *rt);

/* Give the calling process a private mount namespace (unshare(CLONE_NEWNS) +
 * MS_REC|MS_PRIVATE on /). The daemon calls it once at startup, before
 * threads exist; sandboxes copy this namespace, so keep it small. */
int wr_runtime_private_mountns (wr_err_t *err);

/* Mount an idmapped clone of src_dir (recursively) on dst_dir, mapped through
 * userns_fd (open_tree(OPEN_TREE_CLONE) + mount_setattr(MOUNT_ATTR_IDMAP) +
 * move_mount). Used by the image store for layer mounts: host uid 0 files
 * show as the sandbox root. Fails with WR_E_UNSUPPORTED if the filesystem
 * cannot be idmapped. */
int wr_idmap_mount (int userns_fd, const char *src_dir, const char *dst_dir, wr_err_t *err);

struct wr_container_spec
{
  const char *id;         /* sandbox id: [a-z0-9-]{1,64} */
  const char *state_dir;  /* absolute host dir (0700) owned by the daemon for this sandbox */
  const char **lowerdirs; /* read-only layer dirs, top-most first (not idmapped: each
                           * sandbox gets its own idmapped clone) */
  size_t n_lowerdirs;
  uint64_t memory_mb;   /* 0 = unlimited */
  uint64_t disk_mb;     /* size of the writable upper (tmpfs); 0 = default */
  double cpus;          /* CPU quota in cores; 0 = unlimited */
  uint64_t pids_max;    /* 0 = default */
  bool net_host;        /* false: own netns with loopback only */
  const char *hostname; /* NULL = id */
  /* Determinism (docs/api.md): a time namespace whose CLOCK_MONOTONIC and
   * CLOCK_BOOTTIME start at uptime_s, where the kernel has time namespaces
   * (wr_timens_supported); ignored otherwise. */
  bool time_ns;
  uint64_t uptime_s;
  /* The same layers as EROFS image files, bottom-most first: VM backends
   * attach these as read-only disks (the container backend ignores them). */
  const char **layer_files;
  size_t n_layer_files;
  json_t *image_config; /* image config (env, workdir, ...); may be NULL */
  /* CPU QoS "best-effort" (docs/performance.md): the sandbox's cpu group
   * idle (or weight 1) and its processes SCHED_IDLE */
  bool best_effort;
  /* take the netns from this pool instead of the runtime's (networked
   * namespaces for allow=, docs/network.md); NULL: the runtime's */
  struct wr_netns_pool *netns_pool;
  /* VM backends: the NIC of an allow= VM (vm.h); NULL: none */
  const struct wr_vm_net *vm_net;
};

/* fd number at which the agent of a container holds its writable upper dir
 * (O_PATH): the daemon takes a copy with pidfd_getfd to pack the sandbox. */
#define WR_AGENT_UPPER_FD 7
/* the sandbox's cgroup2 dir, delegated to the agent (--cgroup-fd): one child
 * cgroup per exec, killed whole at its timeout */
#define WR_AGENT_CGROUP_FD 8

struct wr_container
{
  pid_t pid;           /* host pid of the agent (PID 1 inside) */
  int pidfd;           /* pidfd of the agent, -1 if unavailable */
  uint64_t start_time; /* /proc/pid/stat starttime, to recognise the pid after a restart */
  uid_t uid_base;      /* host uid/gid of the sandbox's root: its own block */
  int agent_fd;        /* connected socket to the agent (daemon side), O_CLOEXEC|O_NONBLOCK */
  char id[65];
};

/* The agent's pidfd, opened again (pid + start time checked) when it was
 * dropped; -1 if the process is gone. */
int wr_container_pidfd (struct wr_container *c);
/* Close the pidfd while the sandbox is idle (kept when the process could
 * not be recognised again without it). */
void wr_container_drop_pidfd (struct wr_container *c);

/* Create and start a sandbox whose PID 1 is warren-agent. On success the
 * agent is running and ret->agent_fd is a connected channel to it. */
/* Can containers get their own time namespace (CLONE_NEWTIME)? */
bool wr_timens_supported (void);
/* Largest start uptime a sandbox may ask for: about 100 years. */
#define WR_MAX_UPTIME_S (100ull * 366 * 86400)

int wr_container_create (struct wr_runtime *rt, const struct wr_container_spec *spec,
                         struct wr_container *ret, wr_err_t *err);

/* Kill every process of the sandbox, remove its cgroups and state; idempotent,
 * also used to reap a sandbox found after a daemon restart (pid may be 0). */
int wr_container_destroy (struct wr_runtime *rt, struct wr_container *c, const char *state_dir,
                          wr_err_t *err);

/* A new connection to a running sandbox's agent, by its socket's path
 * (dirfd: its state dir, or -1); the agent takes it in place of the one it
 * had. Returns the fd. */
int wr_container_agent_connect (struct wr_runtime *rt, const char *id, const char *state_dir,
                                int dirfd, wr_err_t *err);
/* Re-attach to a sandbox that survived a daemon restart: checks pid+start_time,
 * reconnects to state_dir/agent.sock. Fails (and the caller destroys) otherwise. */
int wr_container_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uint64_t start_time,
                        const char *state_dir, struct wr_container *ret, wr_err_t *err);

/* Freeze / thaw every process (pause / resume). */
int wr_container_freeze (struct wr_runtime *rt, struct wr_container *c, bool frozen, wr_err_t *err);

/* Pause that frees memory (docs/containers.md, "Pause"): freeze and let
 * the sandbox's cgroup swap (fast); wr_container_reclaim then pushes what
 * it holds into swap (zram when warrend sets it up). Resume: deny swap
 * again, prefetch the processes' swapped-out memory (MADV_WILLNEED through
 * process_madvise) and thaw. ret (may be NULL) gets the cgroup's memory
 * before and after, and the time each step took. */
struct wr_pause_stats
{
  uint64_t memory_before_bytes, memory_after_bytes;
  uint64_t freeze_ns, reclaim_ns;
};
int wr_container_pause (struct wr_runtime *rt, struct wr_container *c, bool pause,
                        struct wr_pause_stats *ret, wr_err_t *err);
/* The slow half of a pause (seconds for hundreds of MB), safe on a worker
 * thread: it uses only id and rt's cgroup roots. Waits for the freeze to
 * stop every task, pages out the processes' anonymous memory, then runs
 * the cgroup's reclaim rounds; stops early once *stop is set (a resume or
 * destroy meanwhile) or the group is no longer frozen. Adds to st's
 * freeze_ns, sets reclaim_ns and memory_after_bytes. 0 or -errno. */
int wr_container_reclaim (struct wr_runtime *rt, const char *id, const atomic_bool *stop,
                          struct wr_pause_stats *st);

struct wr_container_stats
{
  uint64_t memory_bytes;
  uint64_t memory_peak_bytes;
  uint64_t oom_kills; /* cumulative OOM kills in the sandbox */
  uint64_t pids;
  uint64_t cpu_usage_ns;
};
int wr_container_stats (struct wr_runtime *rt, struct wr_container *c,
                        struct wr_container_stats *ret, wr_err_t *err);

#endif

/* Internals shared by the container backend files (not a public API). */
#ifndef WR_BACKEND_H
#define WR_BACKEND_H

#include <linux/filter.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "container.h"

/* cgroup layout, detected from /proc/self/mountinfo + cgroup.controllers */
enum wr_cg_layout
{
  WR_CG_V2,     /* unified hierarchy only: everything in one v2 cgroup */
  WR_CG_HYBRID, /* v1 controllers + a cgroup2 mount: v2 for kill/freeze/CLONE_INTO_CGROUP */
  WR_CG_V1,     /* v1 only: freezer for kill/freeze */
};

/* v1 controllers we use; index into the fd arrays. */
enum wr_cg_v1
{
  WR_V1_MEMORY,
  WR_V1_PIDS,
  WR_V1_CPU,
  WR_V1_FREEZER,
  WR_V1_CPUACCT,
  WR_V1_N
};

struct wr_cgroups
{
  enum wr_cg_layout layout;
  int v2_fd;          /* <cgroup2 mount>/warren, -1 if unused */
  int v1_fd[WR_V1_N]; /* <v1 ctrl mount>/warren, -1 if unused */
  bool v2_limits;     /* memory/pids/cpu live in v2 (WR_CG_V2) */
  char v2_path[256];
  char v1_path[WR_V1_N][256];
  /* best-effort sandboxes' cpu groups live under <parent>.best-effort, a
   * sibling of the parent that is idle at the top level (cgroup.c, "CPU
   * QoS"): in the v1 cpu hierarchy, or the whole v2 tree when cpu is there */
  int be_v2_fd, be_cpu_fd; /* -1 if unused */
  char be_v2_path[256], be_cpu_path[256];
  struct wr_cg_pool *pool; /* released v1 groups for reuse (cgroup.c); NULL: none */
  /* What sandbox cgroups must be created for a layout (for destroy + stats). */
};

/* One sandbox's cgroup dirs (opened). */
struct wr_cg_sandbox
{
  int v2_fd;
  int v1_fd[WR_V1_N];
};

struct wr_cg_limits
{
  uint64_t memory_bytes; /* 0 = unlimited */
  uint64_t pids_max;
  double cpus;
  bool best_effort; /* CPU QoS class (set_qos in cgroup.c) */
};

/* name: the parent group under each hierarchy, one per daemon root
 * ("warren-<hash of root>"), so daemons on one host never share a parent. */
int wr_cg_init (struct wr_cgroups *cg, const char *name, wr_err_t *err);
void wr_cg_fini (struct wr_cgroups *cg);
/* Every mount of a whole cgroup hierarchy (root "/", a plain path under 256
 * bytes) in /proc/self/mountinfo, in order: fn (mount point, "cgroup" or
 * "cgroup2", super options, ud); fn returning true stops the walk. */
int wr_cg_mounts (bool (*fn) (const char *mnt, const char *fstype, char *opts, void *ud), void *ud,
                  wr_err_t *err);

/* Set the host's cgroup2 root flag favordynmods (src/backend/cgdyn.c): 1 set now,
 * 0 already on, -1 with err. where names the mount (or says none). */
int wr_cg_favor_dynmods (char where[256], wr_err_t *err);
/* Create (or reuse) the sandbox cgroups and apply limits. */
int wr_cg_create (struct wr_cgroups *cg, const char *id, const struct wr_cg_limits *lim,
                  struct wr_cg_sandbox *ret, wr_err_t *err);
/* Open existing sandbox cgroups (missing ones stay -1); returns count opened. */
int wr_cg_open (struct wr_cgroups *cg, const char *id, struct wr_cg_sandbox *ret);
/* Move pid into every sandbox cgroup not joined through CLONE_INTO_CGROUP. */
int wr_cg_attach_v1 (struct wr_cgroups *cg, struct wr_cg_sandbox *s, pid_t pid, wr_err_t *err);
/* Kill every process and wait until the cgroups are empty (bounded). */
int wr_cg_kill (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err);
int wr_cg_freeze (struct wr_cgroups *cg, struct wr_cg_sandbox *s, bool frozen, wr_err_t *err);
/* The sandbox's pids (the whole v2 subtree, else its v1 memory group):
 * how many there are; at most max stored. */
int wr_cg_pids (struct wr_cgroups *cg, struct wr_cg_sandbox *s, pid_t *pids, int max);
/* Pause: reclaim the frozen sandbox's memory (into swap where there is
 * some); resume: deny new swap-outs again. */
/* Wait (polling, at most timeout_ms) until a freeze has stopped every task:
 * 0, -ETIMEDOUT, or -ENOTSUP without a freezer. */
int wr_cg_wait_frozen (struct wr_cgroups *cg, struct wr_cg_sandbox *s, int timeout_ms);
int wr_cg_reclaim_begin (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err);
int wr_cg_reclaim (struct wr_cgroups *cg, struct wr_cg_sandbox *s, const atomic_bool *stop,
                   wr_err_t *err);
int wr_cg_unreclaim (struct wr_cgroups *cg, struct wr_cg_sandbox *s, wr_err_t *err);
int wr_cg_stats (struct wr_cgroups *cg, struct wr_cg_sandbox *s, struct wr_container_stats *ret,
                 wr_err_t *err);
/* rmdir the sandbox cgroups (retrying briefly on EBUSY); idempotent. */
int wr_cg_remove (struct wr_cgroups *cg, const char *id, wr_err_t *err);
void wr_cg_sandbox_close (struct wr_cg_sandbox *s);

/* container.c: take / give back a child stack slot */
int wr_stack_acquire (struct wr_runtime *rt);
void wr_stack_release (struct wr_runtime *rt, int slot);

/* container.c, shared with vm.c */
bool wr_valid_id (const char *id);
/* start time (clock ticks since boot, /proc/PID/stat field 22) */
int wr_read_start_time (pid_t pid, uint64_t *ret);
/* SIGKILL and wait for the exit (reaped when our child); no-op for -1. */
void wr_kill_reap (int pidfd);
/* Destroy's first half: kill the cgroup and the agent (c->pidfd, or c->pid if
 * its start time matches), close c's fds. Returns the cgroup kill's result. */
int wr_sandbox_kill (struct wr_runtime *rt, struct wr_container *c, wr_err_t *err);
/* A pidfd for pid only when its start time proves it is the same process; else -1. */
int wr_pidfd_if_ours (pid_t pid, uint64_t start_time);
/* Adopt after a restart: validate, pin pid with a pidfd, check its start time
 * (what names it in errors) and open state_dir (O_PATH). */
int wr_adopt_open (const char *what, const char *id, pid_t pid, uint64_t start_time,
                   const char *state_dir, int *ret_pidfd, int *ret_dirfd, wr_err_t *err);
/* Fill ret (zeroing the rest); takes pidfd and agent_fd. */
void wr_container_fill (struct wr_container *ret, const char *id, pid_t pid, int pidfd,
                        uint64_t start_time, int agent_fd);

/* runtime.c: per-sandbox host uid/gid blocks (docs/containers.md). Claimed
 * in WR_UID_CLAIM_DIR, shared by every daemon of the host. */
#define WR_UID_CLAIM_DIR "/run/warren-uids"
/* Claim the lowest free block of the range for sandbox id. */
int wr_uid_block_alloc (struct wr_runtime *rt, const char *id, uid_t *ret, wr_err_t *err);
/* Release the block claimed for id (base: its first uid, or 0 when unknown:
 * then every claim is looked at); call only when no process of it is left. */
void wr_uid_block_free (struct wr_runtime *rt, const char *id, uid_t base);
/* After a restart: the block in pid's uid_map, its claim checked (or renewed). */
int wr_uid_block_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uid_t *ret,
                        wr_err_t *err);

/* seccomp.c: build the default profile once; ret->filter is malloc'd. */
int wr_seccomp_build (struct sock_fprog *ret, wr_err_t *err);

#define WR_CHILD_STACKS 2

struct wr_runtime
{
  char *root;
  char cg_name[32];
  char *mnt_dir; /* ROOT/run/mnt: mount point every child overmounts in its own ns */
  int agent_fd;
  uid_t uid_range_start; /* sandboxes take WR_UID_BLOCK ids each from here */
  uint32_t uid_blocks;
  uint32_t uid_hint; /* blocks below were claimed when last scanned (atomic) */
  int cap_last;
  struct sock_fprog seccomp;
  struct wr_cgroups cg;
  int ign_signals[65]; /* signals the daemon ignores: reset to SIG_DFL in the child */
  int n_ign;
  /* CLONE_VM children run on stacks owned by the runtime, one per create in
   * flight: the creating thread waits until its child has exec'd the agent,
   * so WR_CHILD_STACKS threads can create at once. */
  pthread_mutex_t lock;
  pthread_cond_t stack_free;
  void *stack[WR_CHILD_STACKS];
  bool stack_busy[WR_CHILD_STACKS];
  size_t stack_size;
  struct wr_netns_pool *netns_pool; /* pool.c; NULL: every create makes its own */
  struct wr_zygote *zygote;         /* zygote.c: forks sandboxes' agents */
  int sock_dir_fd;                  /* agent sockets' tmpfs dir (runtime.c), -1: state dirs */
  char sock_dir[40];
  char describe[1024];
};

#endif

/* The sandbox child's setup (child.c), shared by the two ways a sandbox's
 * agent starts (docs/containers.md "Agent zygote"): the daemon's CLONE_VM
 * child, which execs the agent binary, and a child forked by the agent
 * zygote, which becomes the agent without exec. Both run the very same code
 * from the clone to the seccomp filter, with raw syscalls only. */
#ifndef WR_BACKEND_CHILD_H
#define WR_BACKEND_CHILD_H

#include <linux/filter.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "../common/limits.h"

enum wr_child_step
{
  WR_ST_SYNC = 1,
  WR_ST_TIMENS,
  WR_ST_CGROUPNS,
  WR_ST_IDS,
  WR_ST_HOSTNAME,
  WR_ST_FDS,
  WR_ST_TMPFS,
  WR_ST_OVERLAY,
  WR_ST_PROC,
  WR_ST_DEV,
  WR_ST_SYS,
  WR_ST_NET,
  WR_ST_PIVOT,
  WR_ST_CAPS,
  WR_ST_SECCOMP,
  WR_ST_EXEC,
  WR_ST_N,
};
extern const char *const wr_child_step_names[WR_ST_N];

struct wr_child_ctx
{
  int sync_fd, err_fd, listen_fd, conn_fd;
  int agent_fd;  /* the agent binary, exec'd at the end; -1: setup returns instead */
  int cgroup_fd; /* the sandbox's cgroup2 dir, -1 if none */
  bool net_host;
  /* a time namespace with these offsets (/proc/PID/timens_offsets text),
   * made by the child after the sync; NULL: none, or clone made it */
  const char *timens_offsets;
  int sysfs_fd; /* a pooled netns (pool.c): its sysfs, made by the pool; -1: own netns */
  const char *mnt;
  const char *const *lowers;
  size_t n_lower;
  const char *tmpfs_size;
  const char *hostname;
  size_t hostname_len;
  uint64_t cap_keep;
  int cap_last;
  const struct sock_fprog *seccomp;
  int securebits; /* the daemon's: the parent raised NO_SETUID_FIXUP around clone */
  char *const *argv;
  char *const *envp;
};

/* What the child writes to err_fd when a step fails. EOF: it reached the
 * agent (exec, or the zygote child closing err_fd). */
struct wr_child_err
{
  int step;
  int errnum;
};

/* The fd the error pipe ends up at in the child (closed once the agent runs). */
#define WR_CHILD_ERR_FD 6

/* The sandbox's upper tmpfs (one superblock, size-capped): the overlay's
 * upper and work dirs "u" and "w", and beside them the dirs bound on /dev
 * and /dev/shm, and with network host the empty one bound read-only over
 * /sys/fs/cgroup: outside the upper dir that pack, fork and diff read. */
#define WR_CHILD_DEV_DIR "d"
#define WR_CHILD_SHM_DIR "s"
#define WR_CHILD_EMPTY_DIR "c"

/* Everything from the parent's release to seccomp. 0: ready to be the agent
 * (fds 3, 4, 7, 8 arranged, WR_CHILD_ERR_FD still open); else the step's
 * failure was reported on the error pipe and the child should exit with it. */
int wr_child_setup (const struct wr_child_ctx *c);
/* wr_child_setup, then execveat of c->agent_fd (fd 5); returns only on failure. */
int wr_child_main (void *arg);

/* The detached tmpfs holding device nodes (child.c); made once per process
 * by host root before its first sandbox. */
void wr_dev_template_make (void);

/* ---- agent zygote protocol (SOCK_SEQPACKET, one message each way) ----
 * Start: the daemon sends the seccomp program (struct sock_filter array) as
 * the first message. Then per sandbox a wr_zygote_req followed by its
 * strings (mnt, tmpfs size, hostname, time namespace offsets, the lowers,
 * NUL-terminated each) with
 * the fds in SCM_RIGHTS in this order: sync (read end), error pipe (write
 * end), agent listener, agent connection, then the cgroup2 dir, the pooled
 * netns and its sysfs when their flags say so. The answer: an int32_t pid or
 * -errno, with the child's pidfd in SCM_RIGHTS when positive. */
#define WR_ZYGOTE_MAGIC 0x77727a31u /* "wrz1" */
#define WR_ZYGOTE_MAX_MSG 65536
#define WR_ZYGOTE_MAX_FDS 7

enum
{
  WR_ZY_CGROUP = 1,   /* a cgroup2 dir fd: CLONE_INTO_CGROUP */
  WR_ZY_DELEGATE = 2, /* ... and delegated to the agent (--cgroup-fd 8) */
  WR_ZY_NETNS = 4,    /* a pooled netns fd and its sysfs fd */
  WR_ZY_NET_HOST = 8, /* no network namespace of its own */
  WR_ZY_TIMENS = 16,  /* a time namespace: the child makes it (offsets string) */
};

struct wr_zygote_req
{
  uint32_t magic;
  uint32_t flags;     /* WR_ZY_* */
  uint64_t ns_flags;  /* CLONE_NEW* for clone3 */
  uint32_t owner;     /* euid around clone3: the owner of the user namespace */
  int32_t securebits; /* the daemon's */
  int32_t cap_last;
  uint32_t n_lower;
  uint64_t cap_keep;
};

/* Daemon side (zygote.c). */
struct wr_runtime;
struct wr_zygote;
/* The agent zygote (docs/containers.md "Agent zygote"): on unless
 * $WARREN_AGENT_ZYGOTE is 0 or the agent would not start as one; pid 0
 * while none runs (it starts at the first create). */
struct wr_zygote_stats
{
  bool enabled;
  pid_t pid;       /* the first running one's (one per child stack slot) */
  int running;     /* zygotes running */
  uint64_t forks;  /* sandboxes' agents forked by a zygote */
  uint64_t starts; /* zygotes started (restarts included) */
};
void wr_zygote_stats (struct wr_runtime *rt, struct wr_zygote_stats *ret);

int wr_zygote_new (bool enabled, struct wr_zygote **ret);
void wr_zygote_free (struct wr_zygote *z);
/* One request (a wr_zygote_req and its strings, len bytes) with its fds, to
 * the zygote of child stack slot `slot` (the caller holds the slot):
 * the child's host pid and *ret_pidfd, -ENOSYS when the zygote cannot be
 * used (disabled, or it would not start: exec the agent instead), or
 * another -errno (the zygote's clone3 failed, or it did not answer). */
long wr_zygote_spawn (struct wr_runtime *rt, int slot, const void *msg, size_t len, const int *fds,
                      int nfds, int *ret_pidfd);

#endif

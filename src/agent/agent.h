/* warren-agent internals: one process, one epoll loop, one daemon connection
 * at a time (docs/protocol.md). Everything here is single threaded. */
#ifndef WR_AGENT_H
#define WR_AGENT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/types.h>

#include "common/err.h"

/* Stop reading process output while this much is queued towards the daemon. */
#define AG_OUTQ_HIGH (4u << 20)
/* File reads produce more DATA only while the queue is below this. */
#define AG_OUTQ_LOW (1u << 20)
/* Stop reading frames from the daemon while this much is queued (it is not
 * reading our answers) or this much stdin is waiting for processes. */
#define AG_OUTQ_STOP_READ (16u << 20)
#define AG_STDIN_STOP_READ (8u << 20)
#define AG_CHUNK (64u << 10)

/* An fd in the epoll set. fd < 0 means closed: late events are ignored. */
struct ag_watch
{
  void (*fn) (struct ag_watch *w, uint32_t events);
  int fd;
  uint32_t events; /* currently registered, 0 = not in the epoll set */
};

enum ag_req_kind
{
  AG_REQ_EXEC,
  AG_REQ_READ,
  AG_REQ_WRITE,
  AG_REQ_WATCH,
  AG_REQ_EXPORT,
  AG_REQ_APPLY,
};

/* A live request (one stream). Orphans belong to a lost connection: they
 * finish silently and never send again. */
struct ag_req
{
  struct ag_req *next;
  uint32_t stream;
  enum ag_req_kind kind;
  bool orphan;
};

struct ag_state
{
  int epfd;
  int rootfd;          /* O_PATH dir that file paths resolve in */
  bool use_openat2;    /* false: component walk fallback */
  struct ag_req *reqs; /* live requests */
  size_t outq_bytes;   /* queued towards the daemon */
  size_t stdin_bytes;  /* buffered for process stdins */
  int devnull;         /* O_RDONLY /dev/null for stdin, -1 if unavailable */
  unsigned exporting;  /* FILE "export"/"apply" requests live: new EXEC/FILE requests wait */
  unsigned applying;   /* FILE "apply" requests live: their DATA must be read */
};

extern struct ag_state ag;

/* epoll registration; events == 0 removes the fd from the set. */
int ag_watch_set (struct ag_watch *w, uint32_t events);
void ag_watch_close (struct ag_watch *w);
/* free() p after the current batch of events (callbacks may still hold it). */
void ag_defer_free (void *p);

bool ag_connected (void);
/* Queue one frame to the daemon; silently dropped when not connected. */
void ag_send (uint32_t stream, uint8_t type, const void *payload, size_t len);
/* Serialize and send (takes the reference). */
void ag_send_json (uint32_t stream, uint8_t type, json_t *j);
void ag_send_error (uint32_t stream, const wr_err_t *err);
void ag_send_errorf (uint32_t stream, int errnum, const char *code, const char *fmt, ...)
    __attribute__ ((format (printf, 4, 5)));
/* A JSON string from arbitrary bytes: invalid UTF-8 becomes '?'. */
json_t *ag_json_lossy (const char *s, size_t len);

struct ag_req *ag_req_find (uint32_t stream);
void ag_req_link (struct ag_req *r);
void ag_req_unlink (struct ag_req *r);

/* exec.c */
void ag_exec_start (uint32_t stream, json_t *body);
void ag_exec_stdin (struct ag_req *r, const uint8_t *data, size_t len);
void ag_exec_signal (struct ag_req *r, const uint8_t *data, size_t len);
void ag_exec_orphan (struct ag_req *r);
void ag_exec_reaped (pid_t pid, int status, const struct rusage *ru);
void ag_exec_pause_output (bool pause);
/* Fire due timeouts; returns ms until the next one, -1 if none. */
int ag_exec_timeouts (uint64_t now_ms);
/* SIGKILL every process whose session id is sid (scans /proc). */
void ag_kill_session (pid_t sid);

/* cgroup.c: the agent's cgroup tree in a VM guest (tasks/ holds the limits,
 * one child per exec). Without one every call is a no-op. */
struct ag_exec_cg
{
  int dir_fd; /* O_PATH, -1 = none */
  char name[32];
  long long oom_base; /* memory.events oom_kill at start, -1 = no memory controller */
};
int ag_cg_init (void);
/* a container: the sandbox's cgroup2 dir, delegated by the daemon */
int ag_cg_init_delegated (int fd);
bool ag_cg_enabled (void);
/* payload of a LIMITS frame */
void ag_cg_limits (const uint8_t *payload, size_t len);
int ag_cg_exec_create (uint32_t stream, struct ag_exec_cg *ret);
int ag_cg_exec_join (const struct ag_exec_cg *c);
void ag_cg_exec_kill (const struct ag_exec_cg *c);
/* 1 OOM-killed, 0 not, -1 cannot tell (no memory controller here) */
int ag_cg_exec_oom (const struct ag_exec_cg *c);
void ag_cg_exec_release (struct ag_exec_cg *c);
/* Freeze (or thaw) every task process, where the agent owns the tree (a
 * VM guest): 1 when frozen (waits a bounded time for it), 0 when there is
 * nothing to freeze, negative on failure. */
int ag_cg_freeze (bool frozen);

/* vmnet.c: a networked VM's NIC, where the guest's init left it unset
 * (disk images); 1 when done (or already set), 0 while the NIC is not there */
int ag_vmnet_try (void);

/* files.c */
void ag_file_start (uint32_t stream, json_t *body);
void ag_file_data (struct ag_req *r, const uint8_t *data, size_t len);
void ag_file_orphan (struct ag_req *r);
/* Produce DATA for pending reads; returns true if more is pending. */
bool ag_file_pump (void);
struct stat;
json_t *ag_stat_json (const char *name, const struct stat *st);

/* watch.c: the FILE op "watch" (inotify) */
int ag_fwatch_start (uint32_t stream, const char *path, json_t *body, wr_err_t *err);
void ag_fwatch_stop (struct ag_req *r);
void ag_fwatch_orphan (struct ag_req *r);
/* Stop (or resume) reading events while the daemon is not reading ours. */
void ag_fwatch_pause (bool pause);

/* upper.c: the FILE op "export" (the guest's writable layer as a tar
 * stream); --upper DIR exports DIR instead (tests) */
extern const char *ag_upper_dir;
int ag_export_start (uint32_t stream, json_t *body, wr_err_t *err);
/* Produce DATA; returns true while more is to come. */
bool ag_export_step (struct ag_req *r);
void ag_export_orphan (struct ag_req *r);
/* apply.c: the FILE op "apply" (a restore in place: a tar of the
 * checkpoint's entries and .wh. deletions, written through the root) */
int ag_apply_start (uint32_t stream, json_t *body, wr_err_t *err);
void ag_apply_data (struct ag_req *r, const uint8_t *data, size_t len);
void ag_apply_orphan (struct ag_req *r);

/* users.c: accounts of the sandbox (its /etc/passwd and /etc/group) */
#define AG_USER_MAX_GROUPS 64
struct ag_user
{
  unsigned uid, gid;
  char home[256];
  unsigned groups[AG_USER_MAX_GROUPS]; /* the primary group first */
  size_t n_groups;
};
int ag_user_lookup (const char *name, struct ag_user *ret, wr_err_t *err);
/* {"user": NAME} of a request: *ret_has false when absent */
int ag_user_of (json_t *body, struct ag_user *ret, bool *ret_has, wr_err_t *err);
struct ag_names
{
  char *passwd, *group;
};
void ag_names_load (struct ag_names *n);
void ag_names_free (struct ag_names *n);
/* add "user" and "group" names to a stat object, where the ids have one */
void ag_names_add (const struct ag_names *n, json_t *st);

/* resolve.c: open path (absolute, inside the sandbox) relative to rootfd so
 * that "..", absolute and relative symlinks never leave rootfd. flags are
 * open(2) flags; O_NOFOLLOW applies to the last component only. */
int ag_path_check (const char *path, size_t len, wr_err_t *err);
int ag_open_in_root (int rootfd, const char *path, int flags, bool use_openat2, wr_err_t *err);
/* Open the parent directory of path (O_PATH) and copy its last component to
 * base[NAME_MAX + 1]; "/" and names "." / ".." are rejected. */
int ag_open_parent_in_root (int rootfd, const char *path, char *base, bool use_openat2,
                            wr_err_t *err);
bool ag_openat2_works (int rootfd);
const char *ag_errno_code (int errnum);

#endif

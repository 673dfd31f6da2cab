/* warrend internals: one event loop, a sandbox table, the registry. */
#ifndef WRD_DAEMON_H
#define WRD_DAEMON_H

#include <stdbool.h>
#include <stdint.h>
#include <sqlite3.h>
#include <jansson.h>
#include <event2/event.h>
#include <event2/http.h>

#include "common/err.h"
#include "backend/container.h"
#include "image/store.h"
#include "daemon/agent_conn.h"

enum sb_state
{
  SB_CREATING,
  SB_RUNNING,
  SB_PAUSED,
  SB_DEAD, /* agent gone: only DELETE (or the TTL) is left to do */
  SB_POOLED,
  SB_DESTROYING, /* killed, resources being released off the request path */
};
const char *sb_state_name (enum sb_state s);

struct pool;

struct sandbox
{
  char id[33];
  enum sb_state state;
  char backend[16];
  char image[256];
  char image_digest[72];
  json_t *spec;                  /* normalised create request */
  json_t *img_conf;              /* image config (env, workdir) */
  const struct wrd_backend *ops; /* backends.h */
  struct wr_container c;
  bool has_container;
  char (*layers)[72]; /* acquired layer digests */
  size_t n_layers;
  struct agent_conn *conn;
  struct event *ttl_ev;
  double created_at, expires_at; /* unix seconds; expires_at 0 = none */
  struct pool *pool;             /* set while waiting in a warm pool */
  struct sandbox *pool_next;
  struct sandbox *hnext;       /* hash chain */
  struct sandbox *reap_next;   /* in wrd.reaping while SB_DESTROYING */
  struct sandbox **reap_pprev; /* unlinked in O(1) when its exit is reaped */
  struct event *reap_ev;
  struct event *boot_ev; /* a VM until its agent first speaks (boot watchdog) */
  char *dead_reason;     /* why SB_DEAD, when more is known than "its agent exited" */
  unsigned reap_tries;
  uint64_t oom_seen;
  bool from_pool;            /* handed out by a warm pool */
  struct sbnet *net_pending; /* netsvc.c: attached by a builder, not yet started */
  unsigned busy;             /* requests in flight */
  /* pause (docs/containers.md): idle-pause timer, last request's end,
   * what the last pause gave back and how long the last resume took */
  struct event *idle_ev;
  double last_used;
  struct wr_pause_stats last_pause;
  uint64_t resume_ns;
  struct sb_reclaim *reclaim; /* a pause's reclaim on a worker (sandbox.c) */
  struct wrd *d;
};

struct pool
{
  char key[512];
  char image[256];
  json_t *spec;
  unsigned target;
  unsigned ready;
  struct sandbox *head;
  struct pool *next;
};

#define WRD_EXEC_BUCKETS 14
/* --vm-boot-timeout's default: a TCG boot here takes 5-15 s */
#define WRD_VM_BOOT_TIMEOUT_S 120
struct wrd_metrics
{
  uint64_t creations, creations_pooled, create_failures, destroys, execs, exec_failures;
  uint64_t exec_hist[WRD_EXEC_BUCKETS + 1];
  double exec_sum_s;
  uint64_t http_requests, files;
  /* TCP connections refused: bad token, over the limit, too slow or idle */
  uint64_t http_unauthorized, http_busy, http_timeouts;
  uint64_t vm_boot_timeouts; /* guests lost to the boot watchdog (sandbox.c) */
  double create_sum_s;
};

/* The TCP listener's limits (docs/operations.md); 0 = default. */
struct wrd_http_config
{
  unsigned max_connections;
  unsigned header_timeout_s; /* a connection's first request headers */
  unsigned idle_timeout_s;   /* no request and no bytes for this long: closed */
  bool allow_host_paths;     /* TCP clients may name daemon host paths */
};
struct wr_httpd; /* common/httpd.h */

struct wrd
{
  struct event_base *base;
  struct evhttp *http_unix;
  sqlite3 *db;
  struct wr_runtime *rt;
  struct wr_store *store;
  char root[1024];
  char default_image[256];
  char token[256];
  char node[5]; /* 4 hex chars at the start of every sandbox id */
  struct sandbox **table;
  size_t table_size, count;
  struct pool *pools;
  unsigned creating;       /* client creates being built (WARREN_MAX_SANDBOXES) */
  struct sandbox *reaping; /* destroyed, waiting for their processes to exit */
  size_t n_reaping;
  /* limits.c: --max-sandboxes (or $WARREN_MAX_SANDBOXES; 0: none) and what
   * the kernel limits allow, budgeted at start */
  unsigned max_sandboxes, kernel_max_sandboxes;
  const char *kernel_max_by;
  long long mem_reserve_kb, mem_avail_kb;
  double mem_checked_at;
  struct event *pool_ev;
  bool pool_building;
  struct wrd_metrics m;
  struct wrd_fncall *fncall; /* fncall.h */
  struct wrd_traj *traj;     /* the trajectory log (trajlog.h) */
  struct wrd_http_config http;
  struct wr_httpd *tcp;    /* the TCP listener's guard (common/httpd.h) */
  unsigned n_tcp_conns;    /* open TCP connections under the limit */
  bool allow_host_network; /* --allow-host-network: "network": "host" for sandboxes and builds */
  unsigned idle_pause_s;   /* --idle-pause: default "idle_pause_s" of a create (0: never) */
  /* --net-default-egress-kbps, --net-default-connections: an allow=
   * create's "net_limits" where it names none (0: unlimited) */
  unsigned long long net_default_egress_kbps, net_default_connections;
  /* --net-dns-min-ttl, --net-dns-max-ttl: the bounds of a re-resolved
   * name's TTL in seconds (docs/network.md, "DNS"; 0: 5 and 300) */
  unsigned net_dns_ttl_min, net_dns_ttl_max;
  unsigned vm_boot_timeout_s; /* --vm-boot-timeout; 0 = WRD_VM_BOOT_TIMEOUT_S */
  bool stopping;
};

/* sandbox.c */
/* Blocking create (internal users: builds, fncall). */
int wrd_sandbox_create (struct wrd *d, json_t *req, struct sandbox **ret, wr_err_t *err);
/* Create without blocking the loop: cb gets the sandbox, or NULL and the
 * error. Returns < 0 (cb never called) when the request is invalid. */
typedef void (*wrd_create_cb) (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud);
int wrd_sandbox_create_async (struct wrd *d, json_t *req, wrd_create_cb cb, void *ud,
                              wr_err_t *err);
int wrd_sandbox_destroy (struct wrd *d, struct sandbox *sb, wr_err_t *err);
struct sandbox *wrd_sandbox_find (struct wrd *d, const char *id);
json_t *wrd_sandbox_json (struct wrd *d, struct sandbox *sb, bool detail);
const char *wrd_sandbox_dead_reason (const struct sandbox *sb); /* why it is SB_DEAD */
int wrd_sandbox_pause (struct wrd *d, struct sandbox *sb, bool pause, wr_err_t *err);
/* Pause's reclaim runs on a worker after wrd_sandbox_pause returned: call
 * cb on the loop once it ended (sb NULL: destroyed meanwhile) and return 1,
 * or 0 (cb not called) when none is under way. */
typedef void (*wrd_reclaim_cb) (struct wrd *d, struct sandbox *sb, void *ud);
int wrd_sandbox_reclaim_wait (struct sandbox *sb, wrd_reclaim_cb cb, void *ud);
/* A request for sb starts: resume it first when paused (idle or not). */
int wrd_sandbox_wake (struct wrd *d, struct sandbox *sb, wr_err_t *err);
/* A request for sb ended: its idle-pause countdown restarts. */
void wrd_sandbox_touch (struct sandbox *sb);
/* Expire ttl_s seconds from now (recorded, so a restarted daemon keeps it). */
int wrd_sandbox_set_ttl (struct wrd *d, struct sandbox *sb, double ttl_s, wr_err_t *err);
int wrd_recover (struct wrd *d, wr_err_t *err);
void wrd_shutdown (struct wrd *d);
int wrd_pool_set (struct wrd *d, const char *image, unsigned size, wr_err_t *err);
json_t *wrd_pools_json (struct wrd *d);
int wrd_pools_load (struct wrd *d, wr_err_t *err);
/* Validate a create request and fill defaults; returns a new normalised object. */
int wrd_parse_create (struct wrd *d, json_t *req, json_t **ret, wr_err_t *err);
/* A sandbox for internal use (fncall pools): never listed, never pooled. */
int wrd_sandbox_build_internal (struct wrd *d, json_t *req, struct sandbox **ret, wr_err_t *err);

/* registry.c */
int wrd_db_open (struct wrd *d, wr_err_t *err);
int wrd_db_put (struct wrd *d, struct sandbox *sb, wr_err_t *err);
int wrd_db_delete (struct wrd *d, const char *id, wr_err_t *err);
typedef int (*wrd_db_row_cb) (struct wrd *d, json_t *row, void *ud);
int wrd_db_each (struct wrd *d, wrd_db_row_cb cb, void *ud, wr_err_t *err);
int wrd_db_pool_put (struct wrd *d, const char *image, unsigned size, wr_err_t *err);

/* limits.c: raise RLIMIT_NOFILE (and fs.nr_open) and kernel.pid_max at
 * start, and budget the open agent connections (--agent-conns: 0 derives
 * it from the descriptors, < 0 never sheds); budget the sandboxes the node
 * can hold and log every number; admit a create (0) or refuse it with the
 * reason (429 or 503) */
void wrd_limits_raise (long long agent_conns);
void wrd_limits_budget (struct wrd *d, unsigned configured);
int wrd_limits_admit (struct wrd *d, size_t client_held, wr_err_t *err);

/* http.c */
int wrd_http_listen (struct wrd *d, const char *spec, wr_err_t *err);
void wrd_http_free (struct wrd *d);

/* metrics */
void wrd_metrics_exec (struct wrd *d, double seconds, bool ok);
char *wrd_metrics_text (struct wrd *d);

/* worker thread jobs: run fn off the loop, then done on the loop */
typedef void (*wrd_job_fn) (void *arg);
int wrd_job_run (struct wrd *d, wrd_job_fn fn, wrd_job_fn done, void *arg);
/* Shutdown, before the HTTP server and the store go: cancel registry
 * transfers, wait for every job and deliver its done on the loop. */
void wrd_jobs_drain (struct wrd *d);

#endif

/* warren-gateway internals (docs/cluster.md): one libevent loop serving the
 * node API, a watch thread mirroring the cluster's state from etcd, and
 * short-lived threads for the rare quota reservations. */
#ifndef WRG_GATEWAY_H
#define WRG_GATEWAY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <jansson.h>
#include <event2/event.h>
#include <event2/http.h>

#include "cluster/etcd.h"
#include "cluster/keys.h"
#include "common/err.h"
#include "common/httpd.h"

#define GW_MAX_NODES 4096
#define GW_IDLE_MAX 64
#define GW_NODE_BACKENDS 8
/* A node publishes a create within this many seconds (it writes its status
 * at most once a second): until then the gateway keeps counting the slot. */
#define GW_SETTLE_S 5
/* The gateway's etcd session: its reserve keys and its reconciler
 * candidacy live under one lease of this TTL, refreshed every second. */
#define GW_SESSION_TTL_S 5
/* Outside /warren/, so their writes do not wake every gateway's watch. */
#define GW_KEY_RESERVE "/warren-reserve/"  /* PROJECT/GATEWAY-ID -> {"sandboxes","memory_mb"} */
#define GW_KEY_LEADER "/warren-reconciler" /* the elected reconciler's id, under its lease */
/* gw_place's "backend" for nodes serving the compat APIs (compat_port) */
#define GW_COMPAT "compat"

struct gw_node
{
  char name[WR_NODE_NAME_MAX + 1];
  /* written by the watch thread, under gw.mu */
  bool present; /* registered (its lease is alive) */
  bool drained;
  bool stopping;  /* its daemon stopped; its lease runs out unless it restarts */
  json_t *status; /* the node's last published status */
  char host[256];
  int port;
  char path[64];     /* advertise URL's path ("/n/NAME" for warren-sim), prefixed to requests */
  unsigned long gen; /* bumped when status changes */
  /* parsed from status when it arrives, so placement reads no JSON */
  long long sandboxes, memory_free_mb;
  int compat_port; /* the node's --listen-compat port, 0 when none (compat.c) */
  char backends[GW_NODE_BACKENDS][16];
  unsigned n_backends;
  uint64_t *images; /* FNV-1a hashes of the status's "images", sorted */
  unsigned n_images;
  /* loop only */
  unsigned long seen_gen;
  unsigned pending; /* placements sent here since its last status */
  char conn_host[256];
  int conn_port;
  struct evhttp_connection *idle[GW_IDLE_MAX];
  size_t n_idle;
  struct fwd *inflight; /* requests waiting on this node (gw_fail_lost) */
  json_t *last_list;    /* its sandboxes when it last answered a list */
};

struct gw_project
{
  char name[65];
  char token_sha256[65];
  long long max_sandboxes, max_memory_mb; /* 0 = unlimited memory */
  int priority;
  bool present;
  /* loop only: slots reserved in etcd and not yet used by this gateway */
  long long free_sb, free_mem;
  bool reserving;
  uint64_t last_use_ms; /* an idle reserve goes back to etcd (gw_quota_sweep) */
  /* What the reconciler may not take away (docs/cluster.md, "The reconciler"):
   * slots handed to creates still in flight, slots of creates answered in
   * the last GW_SETTLE_S seconds (the node may not have published them yet),
   * and credits from deletes, usable only once published. */
  long long inflight_sb, inflight_mem;
  long long pending_sb, pending_mem;
  long long recent_sb[GW_SETTLE_S + 1], recent_mem[GW_SETTLE_S + 1];
  uint64_t recent_s[GW_SETTLE_S + 1]; /* monotonic second of each bucket */
  long long pub_sb, pub_mem;          /* last value in /warren-reserve/NAME/ID */
  uint64_t pub_gen;                   /* under session generation pub_gen */
  struct create_ctx *waiters, **waiters_tail;
};

/* Counters for GET /metrics (atomic: quota threads bump some). */
struct gw_metrics
{
  _Atomic uint64_t requests, creates, create_failures, create_retries, forward_failures, node_lost,
      quota_txns, quota_conflicts, idem_claims;
};

struct gw
{
  struct gw_metrics m;
  struct event_base *base;
  struct wr_httpd *httpd; /* the guarded listener (common/httpd.h) */
  struct
  {
    unsigned max_connections, header_timeout_s, idle_timeout_s; /* 0: defaults */
  } http_limits;
  /* loop only: connections refused by the guard, and those open */
  uint64_t http_unauthorized, http_busy, http_timeouts;
  unsigned http_conns;
  char token[256], node_token[256];
  struct wr_etcd *etcd;
  long long chunk; /* quota slots reserved per etcd transaction */
  pthread_mutex_t mu;
  struct gw_node *nodes[GW_MAX_NODES];
  size_t n_nodes;
  unsigned long images_gen; /* bumped when any present node's image set changes */
  struct gw_project *projects[1024];
  size_t n_projects;
  bool synced; /* the first full read of etcd is done */
  volatile bool stop;
  pthread_t watch_thread;
  /* control plane health: a probe thread does a quorum read every 500 ms */
  struct wr_etcd *probe_etcd;
  _Atomic uint64_t cp_ok_ms; /* monotonic ms of the last successful quorum read */
  pthread_t probe_thread;
  /* reconcile.c: the session lease, the reconciler election */
  char id[40]; /* "gw-" + 16 hex: this gateway's reserve keys */
  pthread_mutex_t session_mu;
  _Atomic int64_t session;          /* lease id, 0 when none */
  _Atomic uint64_t session_gen;     /* bumped on every new lease */
  _Atomic uint64_t session_ok_ms;   /* last time etcd confirmed the lease */
  _Atomic bool reconciler;          /* this gateway is the elected reconciler */
  _Atomic uint64_t reconcile_fixes; /* counters lowered by this gateway's reconciler */
  long long idle_return_ms;         /* an unused reserve goes back after this (default 2 s) */
  long long priority_headroom_mb;   /* --priority-headroom: kept free for priority > 0 */
  pthread_t reconcile_thread;
  struct gw_compat *compat; /* compat.c, NULL without --listen-compat */
};

/* nodes.c */
int gw_watch_start (struct gw *g, wr_err_t *err);
/* Has etcd answered a quorum read within the last few seconds? */
bool gw_control_plane_ok (struct gw *g);
void gw_watch_stop (struct gw *g);
/* Under g->mu. */
struct gw_node *gw_node_find (struct gw *g, const char *name);
struct gw_project *gw_project_find (struct gw *g, const char *name);
struct gw_project *gw_project_by_token (struct gw *g, const char *token);
/* Placement: a node for a create (backend, memory, labels), NULL when none
 * fits; exclude is a node that just failed (may be NULL). Loop only. */
struct gw_node *gw_place (struct gw *g, const char *backend, long long memory_mb,
                          const json_t *want_labels, const char *image,
                          const struct gw_node *exclude);
json_t *gw_nodes_json (struct gw *g);
/* The registered nodes (out has room for GW_MAX_NODES); their count. */
size_t gw_present_nodes (struct gw *g, struct gw_node **out);
/* Nodes seen before whose lease is gone; into out[GW_MAX_NODES] */
size_t gw_lost_nodes (struct gw *g, struct gw_node **out);

/* proxy.c */
/* A buffered answer from a node: status 0 when the node could not be
 * reached (then body is NULL). The hook owns the reply to the client. */
struct fwd;
typedef void (*gw_fwd_hook) (struct gw *g, struct evhttp_request *client, int status,
                             struct evbuffer *body, void *ud);
/* Forward client's request (method, uri, body moved out of the client's
 * input buffer unless body is given) to node n. Without a hook the answer
 * is relayed as it comes (NDJSON streams chunk by chunk). */
void gw_forward (struct gw *g, struct gw_node *n, struct evhttp_request *client,
                 enum evhttp_cmd_type method, const char *uri, struct evbuffer *body,
                 gw_fwd_hook hook, void *ud);
void gw_nodes_free_conns (struct gw *g);
void gw_nodelay (struct evhttp_connection *c);
/* gw_forward relaying the answer, except a 409 "sandbox is paused", which
 * goes to on_paused (that then owns the reply and ud); ud_free(ud) otherwise. */
void gw_forward_resuming (struct gw *g, struct gw_node *n, struct evhttp_request *client,
                          enum evhttp_cmd_type method, const char *uri, gw_fwd_hook on_paused,
                          void *ud, void (*ud_free) (void *));
/* Fail every request in flight to a node whose lease expired (node_lost):
 * no request waits on a dead or partitioned node longer than its lease. */
void gw_fail_lost (struct gw *g);

/* http.c (routes) */
int gw_http_listen (struct gw *g, const char *spec, wr_err_t *err);
void gw_reply_json (struct evhttp_request *req, int status, json_t *j);
void gw_reply_error (struct evhttp_request *req, int status, const char *code, const char *fmt, ...)
    __attribute__ ((format (printf, 4, 5)));

/* compat.c: --listen-compat, SandboxFusion and E2B through the cluster */
int gw_compat_listen (struct gw *g, const char *spec, wr_err_t *err);
void gw_compat_free (struct gw *g);

/* jobs.c */
/* Exec and file requests: a paused sandbox is resumed first, then the request runs. */
void gw_route_resuming (struct gw *g, struct gw_node *n, struct evhttp_request *req,
                        enum evhttp_cmd_type method, const char *uri, const char *id);
/* POST /v1/jobs/{job}/pause|resume: every sandbox of the job on every node. */
void gw_jobs (struct gw *g, struct evhttp_request *req, const char *rest, const char *project);

/* quota.c */
struct create_ctx;
/* Take one sandbox of memory_mb from p's local reservation, reserving a
 * new chunk in etcd when it runs out; then cb(ok). */
typedef void (*gw_quota_cb) (struct gw *g, bool ok, const char *why, void *ud);
void gw_quota_take (struct gw *g, struct gw_project *p, long long memory_mb, gw_quota_cb cb,
                    void *ud);
/* Give back a slot (create failed, sandbox deleted). */
void gw_quota_put (struct gw *g, struct gw_project *p, long long memory_mb);
/* GET /v1/projects: limits and this gateway's unused reserve */
json_t *gw_projects_json (struct gw *g);
/* POST /v1/projects */
void gw_projects_create (struct gw *g, struct evhttp_request *req);
/* Return reserves unused for a while, so other gateways can have them (1 s timer). */
void gw_quota_sweep (struct gw *g);
/* Release every unused reservation (shutdown). */
void gw_quota_release_all (struct gw *g);
/* A create that took a slot ended: made (the slot is now the sandbox's) or not (credited back). */
void gw_quota_done (struct gw *g, struct gw_project *p, long long memory_mb, bool made);

/* idem.c: idempotency keys (blocking: worker threads) */
enum gw_idem_result
{
  GW_IDEM_CLAIMED, /* ours: create on node */
  GW_IDEM_ORPHAN,  /* ours, but an attempt whose gateway died went to node: look there first */
  GW_IDEM_TAKEN,   /* another attempt is live or done: its node (and id when done) */
};
struct gw_idem
{
  char key[129];
  char node[WR_NODE_NAME_MAX + 1]; /* in: the placement; out: the node to create on or ask */
  char id[65];                     /* out (TAKEN): the sandbox a finished attempt made */
  enum gw_idem_result result;
};
/* Claim c->key for a create placed on c->node, under this gateway's session lease. */
int gw_idem_claim (struct gw *g, struct gw_idem *c, wr_err_t *err);
/* The create's outcome: id made on node (kept under the retention lease), or NULL (released). */
void gw_idem_settle (struct gw *g, const char *key, const char *node, const char *id);

/* reconcile.c */
/* The session lease (granted on first use); 0 and err when etcd does not answer. */
int64_t gw_session (struct gw *g, wr_err_t *err);
/* Is the lease surely alive (refreshed within TTL - 2 s)? Reserves are usable only then. */
bool gw_session_fresh (struct gw *g);
int gw_reconcile_start (struct gw *g, wr_err_t *err);
void gw_reconcile_stop (struct gw *g); /* after gw_watch_stop: g->stop is set */

#endif

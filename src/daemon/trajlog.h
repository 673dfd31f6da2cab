/* The trajectory log (docs/rl.md): every exec, file change and lifecycle
 * event of a sandbox, in order, with its result, in its own SQLite database
 * under the root (WAL), kept for --log-retention seconds after the sandbox
 * is gone. Client step ids make requests replayable: a repeated step gets
 * its recorded result instead of running again. */
#ifndef WRD_TRAJLOG_H
#define WRD_TRAJLOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>

#include "daemon/daemon.h"

#define WRD_TRAJ_DEFAULT_RETENTION_S (24.0 * 3600)
/* Output kept per stream of an exec without a step id; a stepped exec keeps
 * all of it (up to its own caps) so a repeat returns the same bytes. */
#define WRD_TRAJ_OUTPUT_CAP (64u << 10)

struct wrd_traj;
struct wrd_traj_op; /* one exec or file change being recorded */

/* Open ROOT/trajectory.db (d->traj), mark what ran across a crash as
 * interrupted, arm the retention reaper. */
int wrd_traj_open (struct wrd *d, double retention_s, wr_err_t *err);
void wrd_traj_close (struct wrd *d);

/* Lifecycle: "create" starts a sandbox's log; "pause", "resume", "ttl",
 * "lost", "checkpoint", "restore", "fork" and "destroy" append to an
 * existing one ("destroy" starts the retention clock). detail (consumed,
 * may be NULL) is the event's result. Returns the event's seq, or -1 when
 * nothing was logged. */
int64_t wrd_traj_lifecycle (struct wrd *d, struct sandbox *sb, const char *kind, json_t *detail);
/* A fork child's log continues its parent's up to the parent's "fork"
 * event fork_seq: `log` shows it as the child's provenance, `replay`
 * fast-forwards through it. */
/* Merge add (consumed) into the result of event seq: how a checkpoint or
 * restore logged when it began ended. */
void wrd_traj_event_update (struct wrd *d, int64_t seq, json_t *add);
void wrd_traj_forked (struct wrd *d, const char *child, const char *parent, int64_t fork_seq);

/* Before an exec runs. Returns 1 when the request was answered here (a
 * recorded step replayed, a conflicting or running step, a log failure), 0
 * to run it with *ret recording it. body is the client's request, agent the
 * agent's EXEC body, in the decoded stdin. */
int wrd_traj_exec_begin (struct wrd *d, struct sandbox *sb, struct evhttp_request *req,
                         json_t *body, json_t *agent, const void *in, size_t in_len, bool stream,
                         struct wrd_traj_op **ret);
/* Same for a file change (write, mkdir, remove); step may be NULL, data is
 * the write's bytes (NULL otherwise); status is the reply's on success. */
int wrd_traj_file_begin (struct wrd *d, struct sandbox *sb, struct evhttp_request *req,
                         json_t *agent, const char *step, struct evbuffer *data, int status,
                         struct wrd_traj_op **ret);
/* Output as the client gets it (stream 0 stdout, 1 stderr). */
void wrd_traj_op_output (struct wrd_traj_op *op, int stream, const void *data, size_t len);
/* The outcome; each frees op and accepts NULL. */
void wrd_traj_op_done (struct wrd_traj_op *op, json_t *result);
void wrd_traj_op_error (struct wrd_traj_op *op, const char *code, const char *message);

/* GET /v1/sandboxes/{id}/log (also after the sandbox is gone) and
 * POST /v1/sandboxes/{id}/replay {"until": STEP}. */
void wrd_traj_http_log (struct wrd *d, struct evhttp_request *req, const char *id);
void wrd_traj_http_replay (struct wrd *d, struct evhttp_request *req, const char *id);

#endif

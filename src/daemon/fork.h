/* Group fork, checkpoints, restore and diffs of a sandbox's file system
 * (docs/api.md). Snapshots reuse pack's machinery (images.h): the frozen
 * writable layer becomes an EROFS layer on top of the sandbox's layers. */
#ifndef WRD_FORK_H
#define WRD_FORK_H

#include <stdbool.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>

#include "daemon/daemon.h"

/* Routes under /v1/sandboxes/{id}/: fork, checkpoints, restore, diff.
 * Returns false when sub is none of them (the caller answers 404). */
bool wrd_http_fork_routes (struct wrd *d, struct evhttp_request *req, struct sandbox *sb,
                           const char *sub, struct evkeyvalq *q);
/* The sandbox's checkpoints, for inspect: [{"name","digest","created","size"}]. */
json_t *wrd_checkpoints_json (struct wrd *d, const char *id);
/* Forget every checkpoint of a destroyed sandbox. */
void wrd_checkpoints_drop (struct wrd *d, const char *id);

#endif

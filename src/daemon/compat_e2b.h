/* The E2B-compatible listener (docs/e2b.md): E2B's control API (sandboxes,
 * timeouts, pause, connect) and its in-sandbox envd API (Connect-protocol
 * JSON for process.Process and filesystem.Filesystem, GET/POST /files,
 * /health) on one TCP port, the sandbox picked by the E2b-Sandbox-Id header
 * (the SDK's E2B_SANDBOX_URL mode). */
#ifndef WRD_COMPAT_E2B_H
#define WRD_COMPAT_E2B_H

#include <stdbool.h>
#include <event2/http.h>

#include "daemon/daemon.h"

/* Serve on "tcp:ADDR:PORT", "tcp:PORT" or "PORT" (ADDR: 127.0.0.1). */
int wrd_compat_e2b_start (struct wrd *d, const char *listen, wr_err_t *err);
void wrd_compat_e2b_stop (struct wrd *d); /* accepts a daemon without one */
/* Serve req if it is an E2B route (for a listener shared with another
 * compat API); false when it is not one. Needs wrd_compat_e2b_start or
 * wrd_compat_e2b_attach first. */
bool wrd_compat_e2b_route (struct evhttp_request *req);
/* Set up the E2B state without a listener of its own. */
int wrd_compat_e2b_attach (struct wrd *d, wr_err_t *err);
/* A listener serving these routes asks for a token (X-API-Key): sandboxes
 * then answer with the client's key as their envdAccessToken, which the
 * SDK sends back as X-Access-Token on envd requests. */
void wrd_compat_e2b_keyed (void);

#endif

/* The fncall backend (docs/fncall.md): stateless calls run in warm pools of
 * pre-created container sandboxes, one call at a time per sandbox. Command
 * calls are spawned by the sandbox's agent as a per-call uid; Python calls
 * go to a preloaded interpreter (src/zygote/pyzygote.py) that forks per call
 * ("fork") or runs them in a long-lived worker ("reuse"). */
#ifndef WRD_FNCALL_H
#define WRD_FNCALL_H

#include <stdbool.h>
#include <event2/http.h>

#include "daemon/daemon.h"

struct wrd_fncall_config
{
  unsigned default_size; /* members of a pool created by a first call (0: 2) */
  unsigned max_queue;    /* waiting calls per pool before 429 (0: 1024) */
  unsigned max_calls;    /* calls a member serves before it is replaced (0: 1000) */
  unsigned idle_s;       /* idle pools shrink to their minimum after this (0: 60) */
  const char *zygote;    /* path of pyzygote.py (NULL: search next to the binary) */
  const char *preload;   /* modules the Python zygote imports (NULL: a default list) */
};

int wrd_fncall_init (struct wrd *d, const struct wrd_fncall_config *cfg, wr_err_t *err);
void wrd_fncall_shutdown (struct wrd *d);
/* Configure a pool: lang "cmd" or "python"; size members kept warm (0 lets
 * it shrink away when idle); mode NULL or "fork"/"reuse" (Python default). */
int wrd_fncall_pool_set (struct wrd *d, const char *image, const char *lang, unsigned memory_mb,
                         unsigned size, const char *mode, wr_err_t *err);
/* "REF=N[,python][,reuse][,memory=MB]" as given to --fncall-pool */
int wrd_fncall_pool_arg (struct wrd *d, const char *arg, wr_err_t *err);

/* Stdin for a later call, staged in-process instead of travelling in the
 * call's JSON body (whose 1 MiB limit is the public API's): the compat
 * layer's stage inputs (files, source, build artifacts) run to tens of MB.
 * Takes data (malloc'd; freed on failure too) and names it by a random
 * ref (WRD_FNCALL_REF_LEN hex digits) that a /v1/calls body gives as
 * "stdin_ref"; the first call that names it takes it. A stage no call took
 * is freed by wrd_fncall_unstage (a no-op once taken). */
#define WRD_FNCALL_REF_LEN 32
int wrd_fncall_stage (struct wrd *d, char *data, size_t len, char ret_ref[WRD_FNCALL_REF_LEN + 1],
                      wr_err_t *err);
void wrd_fncall_unstage (struct wrd *d, const char *ref);

/* Routes: POST /v1/calls; GET|PUT /v1/fncall/pools */
void wrd_fncall_http_calls (struct wrd *d, struct evhttp_request *req);
void wrd_fncall_http_pools (struct wrd *d, struct evhttp_request *req);

#endif

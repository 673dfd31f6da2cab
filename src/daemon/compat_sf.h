/* The SandboxFusion-compatible listener (docs/compat.md): POST /run_code,
 * POST /run_jupyter and GET /v1/ping on their own TCP port, each request run
 * through the node's fncall pools (one pool per language image). */
#ifndef WRD_COMPAT_SF_H
#define WRD_COMPAT_SF_H

#include "daemon/daemon.h"

#define WRD_COMPAT_SF_MAX_IMAGES 32

struct wrd_compat_sf_config
{
  const char *listen;     /* "tcp:ADDR:PORT", "tcp:PORT" or "PORT" (ADDR: 127.0.0.1) */
  const char *token_file; /* NULL: no token (then keep the listener on loopback) */
  /* "[LANG=]REF": the image a language runs in (no LANG: every language) */
  const char *images[WRD_COMPAT_SF_MAX_IMAGES];
  size_t n_images;
};

/* Start serving (after the daemon's unix listener exists). */
int wrd_compat_sf_start (struct wrd *d, const struct wrd_compat_sf_config *cfg, wr_err_t *err);
void wrd_compat_sf_stop (struct wrd *d); /* accepts a daemon without one */
/* The listener's TCP port, 0 when none: a node publishes it in its cluster
 * status so that gateways forward compat requests to it (docs/cluster.md). */
int wrd_compat_sf_port (void);

#endif

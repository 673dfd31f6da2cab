/* Image work in the daemon (docs/images.md): progress streams to HTTP
 * clients, packing a sandbox's writable upper, builds. Long work runs on
 * wrd_job_run worker threads; everything touching sandboxes or replies runs
 * on the event loop. */
#ifndef WRD_IMAGES_H
#define WRD_IMAGES_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <event2/http.h>
#include <jansson.h>

#include "daemon/daemon.h"

/* A reply that is either one JSON object at the end, or (stream) NDJSON
 * progress lines {"progress":WHAT,"done":N,"total":M} then the final
 * object or {"error":{...}}. */
struct wrd_stream;
struct wrd_stream *wrd_stream_new (struct wrd *d, struct evhttp_request *req, bool stream);
/* wr_progress_fn: callable from any thread. */
void wrd_stream_progress (void *ud, const char *what, uint64_t done, uint64_t total);
/* On the loop: reply (result consumed; NULL with r < 0 means error) and free. */
void wrd_stream_finish (struct wrd_stream *st, int r, const wr_err_t *err, json_t *result,
                        int status);

json_t *wrd_image_json (const struct wr_image *img);

/* A frozen snapshot of a sandbox's upper being packed. */
struct idmap
{
  uint32_t in[8], out[8], count[8];
  size_t n;
};
struct pack_snap
{
  char id[33];
  int upper_fd;  /* O_PATH, from the agent through pidfd_getfd */
  bool froze;    /* we froze it: thaw at the end */
  bool keep_all; /* checkpoints and forks: no scrubbing of shell histories */
  struct idmap uids, gids;
  char (*layers)[72];
  size_t n_layers;
  json_t *config;
};
struct pack_stats
{
  uint64_t files, scrubbed, skipped;
};

/* loop: check the sandbox, take its upper fd, freeze it */
int wrd_pack_begin (struct wrd *d, struct sandbox *sb, struct pack_snap *p, wr_err_t *err);
/* worker: copy the upper into a new directory under dst_parent (uids
 * shifted back to the sandbox's view, build leftovers scrubbed), then
 * commit it as a layer on the sandbox's layers, named name. */
int wrd_pack_commit (struct wr_store *s, struct pack_snap *p, const char *name,
                     const json_t *config_override, struct pack_stats *st, struct wr_image **ret,
                     wr_err_t *err);
/* loop: thaw (if still there and we froze it) and release the snapshot */
void wrd_pack_end (struct wrd *d, struct pack_snap *p);

/* http routes in pack.c / build.c */
void wrd_http_image_build (struct wrd *d, struct evhttp_request *req);

#endif

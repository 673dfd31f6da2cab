/* Chunked uploads (docs/api.md, Uploads): how a client that does not share
 * the daemon's filesystem (a TCP client, one behind the cluster gateway)
 * hands it an image archive or a build context. An upload is an unnamed
 * owner-only file under ROOT/uploads held open by the daemon; routes that
 * consume one take its fd. */
#ifndef WRD_UPLOADS_H
#define WRD_UPLOADS_H

#include <stdint.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "daemon/daemon.h"

/* Bytes one PATCH may carry (evhttp holds a whole body in memory). */
#define WRD_UPLOAD_CHUNK_MAX (8u << 20)

/* /v1/uploads[/ID]: rest is the path after "/v1/uploads/" or NULL. */
void wrd_http_uploads (struct wrd *d, struct evhttp_request *req, const char *rest,
                       struct evkeyvalq *q);

/* Take upload id for a consuming route (import, build): on success the
 * upload leaves the table and *ret_fd (O_RDWR, O_CLOEXEC) is the caller's.
 * The caller must be the upload's owner (the same token, or the unix
 * socket); anything else is WR_E_NOT_FOUND, as an unknown id. */
int wrd_upload_take (struct wrd *d, struct evhttp_request *req, const char *id, int *ret_fd,
                     wr_err_t *err);

/* Worker thread: extract the tar (plain or compressed) at fd into a fresh
 * directory under ROOT/tmp through the confined unpack helper (layer
 * limits); its path goes to dir. The caller removes it (wrd_upload_rmdir). */
int wrd_upload_extract (struct wrd *d, int fd, char *dir, size_t size, wr_err_t *err);
void wrd_upload_rmdir (const char *dir);

#endif

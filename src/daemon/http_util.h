/* Helpers shared by the HTTP route files (http.c, http_images.c, ...). */
#ifndef WRD_HTTP_UTIL_H
#define WRD_HTTP_UTIL_H

#include <stdbool.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>

#include "daemon/daemon.h"

/* Reply with j (consumed) as JSON. */
void wrd_reply_json (struct evhttp_request *req, int status, json_t *j);
void wrd_reply_error_code (struct evhttp_request *req, const char *code, const char *msg);
void wrd_reply_error (struct evhttp_request *req, const wr_err_t *err);
void wrd_reply_empty (struct evhttp_request *req, int status);
/* Bytes as a JSON string, or base64 with "<field>_encoding":"base64". */
void wrd_json_set_bytes (json_t *o, const char *field, const void *data, size_t len);
/* Parse the body as a JSON object (1 MiB max); an empty body gives {} unless required. */
int wrd_read_json_body (struct evhttp_request *req, bool required, json_t **ret, wr_err_t *err);
const char *wrd_query_get (struct evkeyvalq *q, const char *key);

/* 403: the token does not grant everything (docs/operations.md). */
#define WRD_E_FORBIDDEN WR_E_FORBIDDEN
/* May this request name files on the daemon's host (import path, build
 * context)? Only over the owner-only unix socket, unless warrend runs with
 * --allow-host-paths. http.c checks import and build before routing; a new
 * route reading host paths calls this and, when false, refuses with
 * wrd_reply_host_path_refused (403 naming the field). */
bool wrd_http_host_paths_allowed (struct wrd *d, struct evhttp_request *req);
void wrd_reply_host_path_refused (struct evhttp_request *req, const char *field);
bool wrd_query_flag (struct evkeyvalq *q, const char *key);
/* An exec's complete environment: the image's, the sandbox's, then req_env's. */
int wrd_exec_env (struct sandbox *sb, json_t *req_env, json_t **ret, wr_err_t *err);

/* Route handlers living in their own files. rest is the path after the
 * prefix (NULL when the path is exactly the prefix). */
void wrd_http_images (struct wrd *d, struct evhttp_request *req, const char *rest,
                      struct evkeyvalq *q);
/* POST /v1/sandboxes/{id}/pack (src/daemon/pack.c) */
void wrd_http_pack (struct wrd *d, struct evhttp_request *req, struct sandbox *sb);

#endif

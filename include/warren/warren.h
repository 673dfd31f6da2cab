/* libwarren: the C client of the warrend HTTP API (docs/api.md).
 *
 * One opaque handle per thread (no global state, no locking inside): it owns
 * one keep-alive connection to the daemon, reconnecting when the daemon closed
 * it. Every function that can fail takes `warren_error_t *err` last (may be
 * NULL) and returns a negative int or NULL after filling it; success leaves
 * *err untouched. json_t results are new references the caller json_decref()s;
 * json_t arguments are borrowed. Nothing here logs, exits or touches signals. */
#ifndef WARREN_H
#define WARREN_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#include "warren/version.h" /* WARREN_VERSION */

#ifdef __cplusplus
extern "C"
{
#endif

/* libwarren's ABI is exactly what this header marks WARREN_EXPORT: the
 * library is compiled with -fvisibility=hidden, so its internals (wl_*) and
 * the shared code it links (wr_* in src/common) stay out of libwarren.so's
 * dynamic symbol table (checked by tests/unit/test_client.c). */
#define WARREN_EXPORT __attribute__ ((visibility ("default")))

  typedef struct warren_client warren_client_t;

  typedef struct warren_error
  {
    char code[48];     /* API code ("not_found", ...) or a client-side WARREN_E_* below */
    int status;        /* HTTP status of the failed response; 0 when none arrived */
    int errnum;        /* errno for transport and local failures, else 0 */
    char message[512]; /* human readable; includes strerror(errnum) when set */
  } warren_error_t;

/* Codes the daemon sends (docs/api.md), one HTTP status each. */
#define WARREN_E_INVALID "invalid_argument"     /* 400 */
#define WARREN_E_UNAUTHORIZED "unauthorized"    /* 401 */
#define WARREN_E_FORBIDDEN "forbidden"          /* 403: the token does not grant it */
#define WARREN_E_NOT_FOUND "not_found"          /* 404 */
#define WARREN_E_CONFLICT "conflict"            /* 409 */
#define WARREN_E_GONE "gone"                    /* 410 */
#define WARREN_E_TOO_LARGE "payload_too_large"  /* 413 */
#define WARREN_E_EXHAUSTED "resource_exhausted" /* 429 */
#define WARREN_E_INTERNAL "internal"            /* 500 */
#define WARREN_E_UNSUPPORTED "unsupported"      /* 501 */
#define WARREN_E_UNAVAILABLE "unavailable"      /* 503 */
#define WARREN_E_TIMEOUT "timeout"              /* 504, or the client's own deadline (status 0) */
/* Client-side codes (status 0). */
#define WARREN_E_CONNECT "connect_failed" /* cannot reach the daemon */
/* The request was sent, then the connection broke before an answer; a
 * non-idempotent request (exec) is not replayed: it may or may not have run.
 * Like connect_failed, an infrastructure failure, not the task's. */
#define WARREN_E_CONNECTION_LOST "connection_lost"
#define WARREN_E_PROTOCOL "protocol_error" /* malformed, oversized or truncated response */
#define WARREN_E_IO "io_error"             /* local file or fd failure */
#define WARREN_E_CANCELLED "cancelled"     /* the cancel flag was raised */

  /* Whose failure is err (docs/errors.md, "Infra or task")? true: the
   * platform's (agent or node lost, daemon gone mid-request, out of capacity,
   * the platform's own limits and timeouts, internal errors): retry it, or
   * mask the sample instead of scoring it. false: the caller's (bad request,
   * not found, cancelled, a local file). A completed exec or call is never an
   * error: its exit code, timeout or OOM is the task's result. */
  WARREN_EXPORT bool warren_err_is_infra (const warren_error_t *err);

  /* host: "unix:/path/sock", "http://host:port" or "tcp:host:port", or a
   * comma-separated list of them (gateways of one cluster: the client fails
   * over between them, docs/cluster.md); NULL -> $WARREN_HOST, else
   * unix:$WARREN_ROOT/warrend.sock, else unix:/var/lib/warren/warrend.sock.
   * token: NULL -> $WARREN_TOKEN (none when unset or empty). Does not connect. */
  WARREN_EXPORT warren_client_t *warren_client_new (const char *host, const char *token,
                                                    warren_error_t *err);
  WARREN_EXPORT void warren_client_free (warren_client_t *c); /* accepts NULL */
  /* The resolved host string ("unix:/..." or "http://..."); with a host
   * list, the one requests go to now. */
  WARREN_EXPORT const char *warren_client_host (const warren_client_t *c);
  /* Deadline for one whole request/response in ms (default 60000; 0 = none).
   * exec, call, image import and pack extend it to what they need. */
  WARREN_EXPORT void warren_client_set_timeout (warren_client_t *c, int timeout_ms);
  /* When *flag becomes non-zero (e.g. from a SIGINT handler), the request in
   * progress fails with WARREN_E_CANCELLED within ~250 ms and its connection is
   * dropped (the daemon kills a streaming exec whose client went away). */
  WARREN_EXPORT void warren_client_set_cancel_flag (warren_client_t *c,
                                                    const volatile sig_atomic_t *flag);
  /* Drop the cached connection (e.g. after fork). */
  WARREN_EXPORT void warren_client_disconnect (warren_client_t *c);
  WARREN_EXPORT const char *warren_version (void);

  /* Sandbox ids are [a-z0-9-]{1,64}, as the daemon requires; everything else
   * is rejected locally. */
  WARREN_EXPORT bool warren_id_valid (const char *id);

  /* Generic JSON request: body may be NULL; *ret (if ret) gets the parsed
   * response, an empty object for an empty body. path must start with '/'. */
  WARREN_EXPORT int warren_request (warren_client_t *c, const char *method, const char *path,
                                    const json_t *body, json_t **ret, warren_error_t *err);

  /* Sandboxes. req: {"backend","image","layers","memory_mb","cpus",...}, may be NULL. */
  WARREN_EXPORT json_t *warren_sandbox_create (warren_client_t *c, const json_t *req,
                                               warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_list (warren_client_t *c,
                                             warren_error_t *err); /* the array */
  WARREN_EXPORT json_t *warren_sandbox_get (warren_client_t *c, const char *id,
                                            warren_error_t *err);
  WARREN_EXPORT int warren_sandbox_delete (warren_client_t *c, const char *id, warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_pause (warren_client_t *c, const char *id,
                                              warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_resume (warren_client_t *c, const char *id,
                                               warren_error_t *err);
  /* Change a live "allow=" sandbox's network policy (docs/network.md):
   * network is the string "allow=RULE,..." (replace) or {"allow": RULES}
   * / {"deny": RULES} (edit); returns the sandbox. */
  WARREN_EXPORT json_t *warren_sandbox_set_network (warren_client_t *c, const char *id,
                                                    const json_t *network, warren_error_t *err);
  /* Group fork (docs/api.md): count new sandboxes starting from id's current
   * file system; overrides (NULL or an object: memory_mb, cpus, ttl_s, network,
   * env, labels, ...) apply to every child. {"parent","sandboxes":[...],...} */
  WARREN_EXPORT json_t *warren_sandbox_fork (warren_client_t *c, const char *id, unsigned count,
                                             const json_t *overrides, warren_error_t *err);
  /* Checkpoint id's file system as `name` (NULL: ckpt-N); restore it; diff two
   * states ("image", "now" or a checkpoint name; NULL: image and now), path
   * NULL or a subtree: {"changes":[{"path","kind","type","size","diff"}],...} */
  WARREN_EXPORT json_t *warren_sandbox_checkpoint (warren_client_t *c, const char *id,
                                                   const char *name, warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_restore (warren_client_t *c, const char *id,
                                                const char *name, warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_diff (warren_client_t *c, const char *id, const char *from,
                                             const char *to, const char *path, warren_error_t *err);
  /* Snapshot the sandbox's writable layer into image `name` (NAME[:TAG]). */
  WARREN_EXPORT json_t *warren_sandbox_pack (warren_client_t *c, const char *id, const char *name,
                                             warren_error_t *err);
  /* The trajectory log of a sandbox (docs/rl.md), also after it was destroyed:
   * {"id","image","image_digest","created_at","destroyed_at","replay_of","events":[...]}. */
  WARREN_EXPORT json_t *warren_sandbox_log (warren_client_t *c, const char *id,
                                            warren_error_t *err);
  /* A new sandbox from id's image, fast-forwarded along id's log up to step
   * `until` (NULL: all of it); the new sandbox object with "replay":{...}. */
  WARREN_EXPORT json_t *warren_sandbox_replay (warren_client_t *c, const char *id,
                                               const char *until, warren_error_t *err);

  /* Exec. req: {"cmd":[...]|"shell":"...","env","cwd","stdin","timeout_s",...}.
   * Returns the result {"exit_code","signal","timed_out","stdout","stderr",...}. */
  WARREN_EXPORT json_t *warren_exec (warren_client_t *c, const char *id, const json_t *req,
                                     warren_error_t *err);

  enum
  {
    WARREN_STDOUT = 1,
    WARREN_STDERR = 2
  };
  /* Called for each output chunk as it arrives, already base64-decoded; a
   * non-zero return aborts the exec (the connection is dropped, the daemon kills
   * the command) and warren_exec_stream fails with WARREN_E_CANCELLED. */
  typedef int (*warren_output_fn) (void *userdata, int stream, const void *data, size_t len);
  /* Streaming exec: output goes to fn as produced; returns the final result
   * (without stdout/stderr). */
  WARREN_EXPORT json_t *warren_exec_stream (warren_client_t *c, const char *id, const json_t *req,
                                            warren_output_fn fn, void *userdata,
                                            warren_error_t *err);
  /* One stateless job in a warm pool: {"image","cmd"|"shell","stdin","timeout_s"}. */
  WARREN_EXPORT json_t *warren_call (warren_client_t *c, const json_t *req, warren_error_t *err);

  /* Result helpers. Shell-style status: exit_code, 128+signal when killed,
   * 124 when timed out. */
  WARREN_EXPORT int warren_result_status (const json_t *result);
  /* Decode result[key] ("stdout"/"stderr"/"data"), honouring key_encoding;
   * *ret is malloc'd and NUL terminated (not counted in *ret_len). A missing
   * key gives an empty buffer. */
  WARREN_EXPORT int warren_result_bytes (const json_t *result, const char *key, void **ret,
                                         size_t *ret_len, warren_error_t *err);
  /* obj[key] = bytes as a string when valid UTF-8 without NUL, else base64 with
   * obj[key + "_encoding"] = "base64" (e.g. key "stdin"). */
  WARREN_EXPORT int warren_json_set_bytes (json_t *obj, const char *key, const void *data,
                                           size_t len, warren_error_t *err);

/* Files inside a sandbox (absolute paths). mode < 0: daemon default. */
#define WARREN_PUT_APPEND 1u
  /* Streams fd from its current offset to EOF. Pipes and other unseekable fds
   * are spooled to memory first (uploads are capped at 64 MiB by the daemon). */
  WARREN_EXPORT int warren_file_put_fd (warren_client_t *c, const char *id, const char *path,
                                        int fd, int mode, unsigned flags, warren_error_t *err);
  WARREN_EXPORT int warren_file_put (warren_client_t *c, const char *id, const char *path,
                                     const void *data, size_t len, int mode, unsigned flags,
                                     warren_error_t *err);
  /* Streams the file into fd; *ret_size (may be NULL) gets the byte count. */
  WARREN_EXPORT int warren_file_get_fd (warren_client_t *c, const char *id, const char *path,
                                        int fd, uint64_t *ret_size, warren_error_t *err);
  /* Whole file into a malloc'd buffer (NUL terminated, not counted); fails
   * with WARREN_E_TOO_LARGE past max bytes. */
  WARREN_EXPORT int warren_file_get (warren_client_t *c, const char *id, const char *path,
                                     void **ret, size_t *ret_len, size_t max, warren_error_t *err);
  WARREN_EXPORT json_t *warren_file_stat (warren_client_t *c, const char *id, const char *path,
                                          warren_error_t *err);
  WARREN_EXPORT json_t *warren_file_list (warren_client_t *c, const char *id, const char *path,
                                          warren_error_t *err); /* the entries array */
  WARREN_EXPORT int warren_file_mkdir (warren_client_t *c, const char *id, const char *path,
                                       bool parents, warren_error_t *err);
  WARREN_EXPORT int warren_file_remove (warren_client_t *c, const char *id, const char *path,
                                        bool recursive, warren_error_t *err);

  /* Images. path is on the daemon's host. */
  WARREN_EXPORT json_t *warren_image_import (warren_client_t *c, const char *name, const char *path,
                                             warren_error_t *err);
  WARREN_EXPORT json_t *warren_image_list (warren_client_t *c, warren_error_t *err); /* the array */
  WARREN_EXPORT json_t *warren_image_inspect (warren_client_t *c, const char *ref,
                                              warren_error_t *err);
  WARREN_EXPORT int warren_image_rm (warren_client_t *c, const char *ref, warren_error_t *err);
  /* Long image operations (src/lib/images.c) stream progress: fn (may be
   * NULL) gets each {"progress":what,"done","total"} line; the result is the
   * image object. */
  typedef void (*warren_progress_fn) (void *ud, const char *what, uint64_t done, uint64_t total);
  WARREN_EXPORT json_t *warren_image_op (warren_client_t *c, const char *path, const json_t *req,
                                         warren_progress_fn fn, void *ud, warren_error_t *err);
  WARREN_EXPORT json_t *warren_image_import_progress (warren_client_t *c, const char *name,
                                                      const char *path, warren_progress_fn fn,
                                                      void *ud, warren_error_t *err);
  /* ref: HOST[:PORT]/REPO[:TAG|@DIGEST]; name: local NAME[:TAG] or NULL. */
  WARREN_EXPORT json_t *warren_image_pull (warren_client_t *c, const char *ref, const char *name,
                                           bool insecure, warren_progress_fn fn, void *ud,
                                           warren_error_t *err);
  /* Push the stored image ref to target HOST[:PORT]/NAME[:TAG] (docs/images.md, Push):
   * {"ref","target","digest","uploaded","skipped","bytes"}. */
  WARREN_EXPORT json_t *warren_image_push (warren_client_t *c, const char *ref, const char *target,
                                           bool insecure, warren_progress_fn fn, void *ud,
                                           warren_error_t *err);
  /* spec: the build file's text; context: a directory on the daemon's host or NULL. */
  WARREN_EXPORT json_t *warren_image_build (warren_client_t *c, const char *name, const char *spec,
                                            const char *context, warren_progress_fn fn, void *ud,
                                            warren_error_t *err);
  /* Uploads (/v1/uploads): how a client that does not share the daemon's
   * filesystem (TCP) hands it a file, in chunks, resuming where the daemon
   * is after a refused offset or a broken connection. warren_upload_fd sends
   * the regular file fd (from offset 0); warren_upload_path a local file as
   * is, or a local directory as a tar (symlinks not followed). ret_id gets
   * the upload's id (32 hex characters). */
  WARREN_EXPORT int warren_upload_fd (warren_client_t *c, int fd, warren_progress_fn fn, void *ud,
                                      char ret_id[33], warren_error_t *err);
  WARREN_EXPORT int warren_upload_path (warren_client_t *c, const char *path, warren_progress_fn fn,
                                        void *ud, char ret_id[33], warren_error_t *err);
  /* Import / build from a local path (file, or directory tarred) through an
   * upload: what the CLI does over TCP. */
  WARREN_EXPORT json_t *warren_image_import_upload (warren_client_t *c, const char *name,
                                                    const char *path, warren_progress_fn fn,
                                                    void *ud, warren_error_t *err);
  WARREN_EXPORT json_t *warren_image_build_upload (warren_client_t *c, const char *name,
                                                   const char *spec, const char *context,
                                                   warren_progress_fn fn, void *ud,
                                                   warren_error_t *err);
  WARREN_EXPORT json_t *warren_sandbox_pack_progress (warren_client_t *c, const char *id,
                                                      const char *name, warren_progress_fn fn,
                                                      void *ud, warren_error_t *err);
  WARREN_EXPORT json_t *warren_image_tag (warren_client_t *c, const char *src, const char *dst,
                                          warren_error_t *err);
  /* {"removed_layers","removed_images","layers","images"} */
  WARREN_EXPORT json_t *warren_image_gc (warren_client_t *c, warren_error_t *err);

  /* Node. */
  WARREN_EXPORT json_t *warren_healthz (warren_client_t *c, warren_error_t *err);
  /* Prometheus text, malloc'd and NUL terminated. */
  WARREN_EXPORT char *warren_metrics (warren_client_t *c, warren_error_t *err);
  WARREN_EXPORT json_t *warren_pools_get (warren_client_t *c, warren_error_t *err);
  WARREN_EXPORT json_t *warren_pool_set (warren_client_t *c, const char *image, unsigned size,
                                         warren_error_t *err);

  /* Base64 (RFC 4648, padded). encode: malloc'd, NUL terminated, length in
   * *ret_len (may be NULL). decode: -EINVAL on malformed input, *ret malloc'd
   * and NUL terminated (not counted). */
  WARREN_EXPORT char *warren_base64_encode (const void *data, size_t len, size_t *ret_len);
  WARREN_EXPORT int warren_base64_decode (const char *s, size_t len, void **ret, size_t *ret_len);

#ifdef __cplusplus
}
#endif
#endif

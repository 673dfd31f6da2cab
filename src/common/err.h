/* Warren's one error convention (docs/errors.md).
 *
 * A function that can fail takes `wr_err_t *err` as its last argument and
 * returns a negative int (or NULL) on failure after filling *err with an
 * errno, a stable machine-readable code and a message. Library code never
 * logs or exits; the caller decides. `err` may be NULL when the caller does
 * not care. */
#ifndef WR_ERR_H
#define WR_ERR_H

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>

typedef struct wr_err
{
  int errnum;       /* errno of the failure, 0 when none applies */
  const char *code; /* stable API code: "invalid_argument", "not_found", ... */
  char msg[512];    /* human readable, already includes strerror(errnum) */
} wr_err_t;

/* Stable codes; each maps to one HTTP status (wr_err_http_status). */
#define WR_E_INVALID "invalid_argument"     /* 400 */
#define WR_E_TOO_LARGE "payload_too_large"  /* 413 */
#define WR_E_UNAUTHORIZED "unauthorized"    /* 401 */
#define WR_E_FORBIDDEN "forbidden"          /* 403: the credential does not grant it */
#define WR_E_NOT_FOUND "not_found"          /* 404 */
#define WR_E_CONFLICT "conflict"            /* 409 */
#define WR_E_GONE "gone"                    /* 410: sandbox destroyed */
#define WR_E_EXHAUSTED "resource_exhausted" /* 429 */
#define WR_E_UNAVAILABLE "unavailable"      /* 503 */
#define WR_E_TIMEOUT "timeout"              /* 504 */
#define WR_E_INTERNAL "internal"            /* 500 */
#define WR_E_UNSUPPORTED "unsupported"      /* 501 */
/* The cluster gateway's and the client's own codes (docs/errors.md). */
#define WR_E_NODE_LOST "node_lost"                                 /* 503 / 410 */
#define WR_E_CONTROL_PLANE_UNAVAILABLE "control_plane_unavailable" /* 503 */
#define WR_E_CONNECTION_LOST "connection_lost"                     /* client side: no answer came */

/* Fill err (if not NULL) with errnum, code and a printf-style message; when
 * errnum != 0 ": strerror(errnum)" is appended. Returns -errnum, or -EIO
 * when errnum is 0, so callers can `return wr_error (...)`. */
int wr_error (wr_err_t *err, int errnum, const char *code, const char *fmt, ...)
    __attribute__ ((format (printf, 4, 5)));
int wr_verror (wr_err_t *err, int errnum, const char *code, const char *fmt, va_list ap);

/* Shorthand for a system call failure: errno, code "internal". */
#define wr_sys_error(err, ...) wr_error ((err), errno, WR_E_INTERNAL, __VA_ARGS__)

/* Prefix an existing error's message with more context. Returns the same
 * negative value wr_error would. */
int wr_error_wrap (wr_err_t *err, const char *fmt, ...) __attribute__ ((format (printf, 2, 3)));

void wr_err_clear (wr_err_t *err);
int wr_err_http_status (const wr_err_t *err);
/* Map an API code string back to its HTTP status (400 for unknown codes). */
int wr_code_http_status (const char *code);

/* Whose failure is an error with this code (docs/errors.md, "Infra or
 * task")? true: the platform's (agent or node lost, capacity, the platform's
 * own limits and timeouts, internal errors), so a trainer masks the sample
 * instead of scoring it; false: the caller's or the task's. Codes outside
 * the table follow their HTTP status class (5xx: infra). */
bool wr_code_is_infra (const char *code);
bool wr_err_is_infra (const wr_err_t *err);

#endif

/* libwarren internals: the client handle and its small HTTP/1.1 client. */
#ifndef WARREN_LIB_INTERNAL_H
#define WARREN_LIB_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "warren/warren.h"

#define WL_HEADER_MAX (32 * 1024) /* status line + headers of one response */
#define WL_RBUF_SIZE (64 * 1024)  /* must exceed WL_HEADER_MAX */
#define WL_JSON_MAX                                                                                \
  (512u << 20) /* a JSON response body (exec output is capped at 64 MiB x2, base64) */
#define WL_ERROR_BODY_MAX (1u << 20)
#define WL_DEFAULT_TIMEOUT_MS 60000
#define WL_SLOW_TIMEOUT_MS (3600 * 1000) /* image import, pack */
#define WL_MAX_HOSTS 16                  /* gateways in one host list */
#define WL_FAILOVER_CONNECT_MS 5000      /* connect budget per host when there are several */
#define WL_IDEM_WAIT_MS 30000 /* a replayed create whose first attempt is still in flight */

/* One entry of a host list ("unix:/path", "http://h:p" or "tcp:h:p"). */
typedef struct wl_host
{
  char *name;      /* as resolved, for messages */
  char *unix_path; /* unix socket, or NULL for TCP */
  char *tcp_host;  /* TCP host and port */
  char *tcp_port;
  char *host_header;
} wl_host_t;

/* Parse a comma-separated host list (blanks around entries allowed; at most
 * WL_MAX_HOSTS, no empty entries). */
int wl_hosts_parse (const char *spec, wl_host_t **ret, size_t *ret_n, warren_error_t *err);
void wl_hosts_free (wl_host_t *hosts, size_t n);

struct warren_client
{
  wl_host_t *hosts; /* the host list; requests go to hosts[cur] */
  size_t nhosts, cur;
  /* hosts[cur]'s fields, borrowed: */
  const char *host;
  const char *unix_path;
  const char *tcp_host;
  const char *tcp_port;
  const char *host_header;
  char *token;
  int timeout_ms;
  const volatile sig_atomic_t *cancel;

  int fd;               /* cached connection, -1 when none */
  unsigned requests;    /* served on fd, to know whether it was reused */
  uint64_t deadline_ns; /* of the request in progress, 0 = none */
  bool conn_failed;     /* the last transport error was the peer going away */
  bool got_bytes;       /* some response bytes arrived for the request in progress */
  bool replayed;        /* the request in progress was sent again after a lost connection */
  char *rbuf;
  size_t rpos, rlen;
};

typedef struct wl_request
{
  const char *method;
  const char *target; /* path and query, already encoded */
  const char *content_type;
  const void *body; /* in-memory body, or */
  int body_fd;      /* -1, or a seekable fd streamed from body_off */
  off_t body_off;
  uint64_t body_len;
  int timeout_ms;       /* 0 = the client's default */
  const char *idem_key; /* Idempotency-Key header of a create, or NULL */
  bool idem_auto;       /* the client made idem_key up (it may make another) */
} wl_request_t;

typedef struct wl_response
{
  int status;
  bool chunked;
  bool keep_alive;
  bool until_close;   /* no length: the body ends when the server closes */
  bool done;          /* body fully consumed */
  uint64_t remaining; /* of the Content-Length body or the current chunk */
  bool in_chunk;
  bool chunk_crlf; /* the CRLF closing the previous chunk is still to read */
  char content_type[128];
} wl_response_t;

/* Fill err; returns -errnum or -EIO. */
int wl_error (warren_error_t *err, int errnum, const char *code, int status, const char *fmt, ...)
    __attribute__ ((format (printf, 5, 6)));
const char *wl_code_for_status (int status);

/* Make hosts[i] the current host (drops the connection to the old one). */
void wl_use_host (warren_client_t *c, size_t i);

/* Send a request and read the response head. On a reused connection found
 * dead, idempotent requests (GET/PUT/DELETE) are retried once on a new one.
 * With several hosts it fails over (docs/cluster.md, "Clients and
 * failover"): a connect failure moves any request to the next host; a
 * connection lost before the answer moves a replayable request (idempotent,
 * or a create with idem_key) there, and fails any other one with
 * WARREN_E_CONNECTION_LOST. */
int wl_http_begin (warren_client_t *c, const wl_request_t *req, wl_response_t *resp,
                   warren_error_t *err);
/* Read body bytes; 0 at the end of the body. */
ssize_t wl_http_read (warren_client_t *c, wl_response_t *resp, void *buf, size_t n,
                      warren_error_t *err);
/* Finish the exchange: keeps the connection for reuse only when the body was
 * consumed completely and the server allows it. */
void wl_http_end (warren_client_t *c, wl_response_t *resp);
/* Read the remaining body into a malloc'd NUL terminated buffer. */
int wl_http_read_all (warren_client_t *c, wl_response_t *resp, size_t max, char **ret,
                      size_t *ret_len, warren_error_t *err);
/* Read the body as lines: split at '\n' (or, when !split, the whole body is
 * one line), trailing CR/LF/blanks trimmed, empty lines skipped; fn gets each
 * one and stops the read by returning < 0 (with err set). A line longer than
 * max bytes is a protocol error. Returns 0 at the end of the body. */
typedef int (*wl_line_fn) (const char *line, size_t len, void *ud, warren_error_t *err);
int wl_http_read_lines (warren_client_t *c, wl_response_t *resp, bool split, size_t max,
                        wl_line_fn fn, void *ud, warren_error_t *err);
/* Turn a >= 400 response into err (reads and parses its body). */
int wl_http_error (warren_client_t *c, wl_response_t *resp, warren_error_t *err);

/* wl_http_begin, then a >= 400 response turned into err (-1 or its error). */
int wl_http_request (warren_client_t *c, const wl_request_t *req, wl_response_t *resp,
                     warren_error_t *err);

/* JSON request/response round trip (body may be NULL; ret may be NULL). */
int wl_json_call (warren_client_t *c, const char *method, const char *target, const json_t *body,
                  int timeout_ms, json_t **ret, warren_error_t *err);

/* POST req plus "stream": true to target and read the response head; a
 * >= 400 answer becomes err. what names the request in errors. */
int wl_stream_begin (warren_client_t *c, const char *target, const json_t *req, int timeout_ms,
                     const char *what, wl_response_t *resp, warren_error_t *err);

/* Percent-encode everything but RFC 3986 unreserved characters. */
char *wl_urlencode (const char *s);

#endif

/* A hardened TCP front for evhttp, shared by warrend's TCP listener and
 * warren-gateway (docs/operations.md, docs/cluster.md): a connection's
 * first request is authenticated on its headers before any byte of a body
 * is read, headers must arrive within a timeout, idle connections close,
 * and connections beyond a limit are answered 503. Linked only into the
 * binaries that serve HTTP (not the agent, not libwarren). */
#ifndef WR_HTTPD_H
#define WR_HTTPD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>

#include "common/err.h"

/* Header bytes a connection's first request may use to present its token. */
#define WR_HTTPD_HEADER_MAX (16u << 10)
#define WR_HTTPD_MAX_CONNECTIONS 512
#define WR_HTTPD_HEADER_TIMEOUT_S 10
#define WR_HTTPD_IDLE_TIMEOUT_S 60

struct wr_httpd;

struct wr_httpd_config
{
  unsigned max_connections;  /* 0: WR_HTTPD_MAX_CONNECTIONS */
  unsigned header_timeout_s; /* a connection's first request headers; 0: default */
  unsigned idle_timeout_s;   /* no request and no bytes for this long: closed; 0: default */
  size_t max_body;           /* evhttp's body limit for admitted connections */
  /* Header stage: does this Authorization header value admit the connection? */
  bool (*authorized) (void *arg, const char *value, size_t len);
  /* Optional: does this X-API-Key or X-Access-Token value admit it? (Then
   * any one admitting header is enough.) */
  bool (*authorized_key) (void *arg, const char *value, size_t len);
  /* Requests of admitted connections (they still carry their headers). */
  void (*route) (struct evhttp_request *req, void *arg);
  /* Answer a refused connection (401, 413 or 503 with code and message). */
  void (*refused) (struct evhttp_request *req, int status, const char *code, const char *msg,
                   void *arg);
  void *arg;
  /* Counters bumped by the guard (any may be NULL): refused for a bad
   * token, for the connection limit, closed by a timeout; and the open
   * connections counted against the limit. */
  uint64_t *unauthorized, *busy, *timeouts;
  unsigned *connections;
};

int wr_httpd_new (struct event_base *base, const struct wr_httpd_config *cfg, struct wr_httpd **ret,
                  wr_err_t *err);
/* Listen on "tcp:ADDR:PORT" (TCP_NODELAY on the listener: accepted sockets
 * inherit it). PORT 0 picks a free port: see wr_httpd_port. */
int wr_httpd_bind (struct wr_httpd *h, const char *spec, wr_err_t *err);
/* The port the last wr_httpd_bind listens on (0 before any). */
int wr_httpd_port (const struct wr_httpd *h);
/* The limits in force (defaults filled in). */
const struct wr_httpd_config *wr_httpd_config (const struct wr_httpd *h);
/* Did req arrive through this guard? */
bool wr_httpd_owns (struct wr_httpd *h, struct evhttp_request *req);
void wr_httpd_free (struct wr_httpd *h); /* accepts NULL */

/* Listeners that rest WR_ACCEPT_PAUSE_MS (httpd.c) when accept() fails for
 * want of descriptors or memory, instead of spinning on it. wr_httpd_bind
 * guards its own; other evhttp listeners call wr_accept_guard once bound
 * and wr_accept_guards_free (owner) before evhttp_free (owner). */
int wr_accept_guard (struct evhttp *owner, struct evhttp_bound_socket *bs, wr_err_t *err);
void wr_accept_guards_free (struct evhttp *owner); /* accepts NULL */
uint64_t wr_accept_pauses (void);                  /* times a listener rested */

/* A listening TCP socket for a plain evhttp server (the compat APIs):
 * "tcp:ADDR:PORT", "tcp:PORT" or "PORT" (ADDR 127.0.0.1; IPv6 as [ADDR]),
 * SO_REUSEADDR and TCP_NODELAY, served by http with its accept guard.
 * flag names the option in errors; *ret_port (may be NULL) gets the port
 * (PORT 0 picks one). Call wr_accept_guards_free (http) before evhttp_free. */
int wr_http_serve_tcp (struct evhttp *http, const char *spec, const char *flag, int backlog,
                       int *ret_port, wr_err_t *err);

/* The listener flags warrend and warren-gateway share, as getopt_long
 * entries (include <getopt.h>), and their parser: opt is the entry's code,
 * the value a number in [1, 1000000] stored in the matching field. */
#define WR_HTTPD_LONG_OPTIONS                                                                      \
  { "max-connections", required_argument, NULL, WR_HTTPD_OPT_MAX_CONNECTIONS },                    \
      { "http-header-timeout", required_argument, NULL, WR_HTTPD_OPT_HEADER_TIMEOUT },             \
  {                                                                                                \
    "http-idle-timeout", required_argument, NULL, WR_HTTPD_OPT_IDLE_TIMEOUT                        \
  }
#define WR_HTTPD_OPT_MAX_CONNECTIONS 0x4801
#define WR_HTTPD_OPT_HEADER_TIMEOUT 0x4802
#define WR_HTTPD_OPT_IDLE_TIMEOUT 0x4803
#define WR_HTTPD_IS_OPT(c) ((c) >= WR_HTTPD_OPT_MAX_CONNECTIONS && (c) <= WR_HTTPD_OPT_IDLE_TIMEOUT)
int wr_httpd_limit_opt (int opt, const char *arg, unsigned *max_connections,
                        unsigned *header_timeout_s, unsigned *idle_timeout_s, wr_err_t *err);

/* evhttp over a bufferevent filter (evhttp_set_bevcb), as the guard and the
 * SandboxFusion listener run it. libevent 2.1's filter reports output
 * written once it reaches the socket's buffer, and evhttp may then free a
 * Connection: close connection with the answer unsent: wr_http_filter_out
 * (the filter's output function) moves output silently, and
 * wr_http_sent_cb (an evbuffer callback on the socket bufferevent's
 * output, the filter as its argument) reports it written when the socket's
 * buffer is empty. The filter also holds output added before writing is
 * enabled (evhttp's order): flush it on the next loop turn unless
 * wr_http_filter_closing (evhttp is freeing the connection). */
enum bufferevent_filter_result wr_http_filter_out (struct evbuffer *src, struct evbuffer *dst,
                                                   ev_ssize_t lim, enum bufferevent_flush_mode mode,
                                                   void *arg);
void wr_http_sent_cb (struct evbuffer *b, const struct evbuffer_cb_info *info, void *filter);
bool wr_http_filter_closing (struct bufferevent *filter);

/* "Bearer TOKEN" (value[0..len)) against token, in constant time for a
 * given length; an empty token matches nothing. */
bool wr_bearer_matches (const char *value, size_t len, const char *token);
/* value == token, in constant time (token non-empty) */
bool wr_token_matches (const char *value, size_t len, const char *token);

#endif

/* The hardened TCP front shared by warrend and warren-gateway (httpd.h).
 *
 * evhttp reads a whole request, body included, before anyone sees it, and
 * libevent 2.1 has no hook between headers and body for a server request.
 * So every TCP connection reads through a bufferevent filter that holds the
 * bytes of its first request until the header block is complete (at most
 * WR_HTTPD_HEADER_MAX), checks the bearer token there, and only then lets
 * evhttp see anything. A refused connection never reaches evhttp's parser
 * with its own bytes: the filter discards them and feeds evhttp a minimal
 * request of its own that the guard answers with the error (401, 503, 413),
 * then the connection closes. The filter also owns the connection's timers
 * (headers within header_timeout_s, closed after idle_timeout_s without a
 * request) and counts connections against max_connections. */
#include "common/httpd.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/listener.h>

#include "common/util.h"

/* Bytes handed to the socket at once; the rest waits in evhttp's buffer, so
 * a reply produced piecewise (buffered exec) sees when the client reads. */
#define SOCKET_QUEUE (1u << 20)

enum conn_state
{
  CONN_HEADERS, /* first request's headers not complete yet */
  CONN_OPEN,    /* authenticated: bytes pass through */
  CONN_REFUSED, /* answered with an error; input is discarded */
};

struct conn
{
  struct wr_httpd *h;
  struct bufferevent *bev; /* the filter, evhttp's side */
  struct event *timer;
  struct event *kick; /* flushes the filter's output (see out_cb) */
  enum conn_state state;
  int refuse;         /* 401, 413, 503 once decided */
  bool counted;       /* holds one of max_connections */
  size_t scanned;     /* header bytes already searched for the blank line */
  unsigned in_flight; /* requests routed and not answered yet */
  uint64_t last_rx;   /* ns */
  struct conn *prev, *next;
};

struct wr_httpd
{
  struct wr_httpd_config cfg;
  struct evhttp *http;
  struct conn *conns; /* open connections */
  unsigned n_counted; /* of them, those under the limit */
  int port;           /* of the last bound socket (wr_httpd_port) */
};

static void
bump (uint64_t *counter)
{
  if (counter)
    (*counter)++;
}

bool
wr_bearer_matches (const char *v, size_t n, const char *token)
{
  if (n < 7 || strncmp (v, "Bearer ", 7) != 0)
    return false;
  return wr_token_matches (v + 7, n - 7, token);
}

bool
wr_token_matches (const char *v, size_t n, const char *token)
{
  size_t b = strlen (token);
  unsigned char diff = n != b;
  for (size_t i = 0; i < n && i < b; i++)
    diff |= (unsigned char)(v[i] ^ token[i]);
  return diff == 0 && b > 0;
}

/* Offset just past the blank line ending the header block in buf[0..n), or
 * 0. *scanned remembers how far earlier calls looked (slowloris clients send
 * one byte at a time: do not search the same bytes again). */
static size_t
header_block_end (const char *buf, size_t n, size_t *scanned)
{
  size_t i = *scanned > 2 ? *scanned - 2 : 0;
  for (; i < n; i++)
    if (buf[i] == '\n')
      {
        if (i + 1 < n && buf[i + 1] == '\n')
          return i + 2;
        if (i + 2 < n && buf[i + 1] == '\r' && buf[i + 2] == '\n')
          return i + 3;
      }
  *scanned = n;
  return 0;
}

/* Does the header block carry an admitted token? The request line is
 * skipped; header names are case-insensitive. With authorized_key, an
 * X-API-Key or X-Access-Token header may carry it too (E2B's SDK sends
 * those, and an Authorization: Basic that names a user, not a token). */
static bool
headers_authorized (struct wr_httpd *h, const char *buf, size_t n)
{
  const char *p = memchr (buf, '\n', n), *end = buf + n;
  while (p && ++p < end)
    {
      const char *eol = memchr (p, '\n', (size_t)(end - p));
      if (eol == NULL)
        break;
      size_t nl = 0;
      bool key = false;
      if (eol - p > 14 && strncasecmp (p, "authorization:", 14) == 0)
        nl = 14;
      else if (h->cfg.authorized_key && eol - p > 10 && strncasecmp (p, "x-api-key:", 10) == 0)
        nl = 10, key = true;
      else if (h->cfg.authorized_key && eol - p > 15 && strncasecmp (p, "x-access-token:", 15) == 0)
        nl = 15, key = true;
      if (nl)
        {
          const char *v = p + nl;
          while (v < eol && (*v == ' ' || *v == '\t'))
            v++;
          const char *ve = eol;
          while (ve > v && (ve[-1] == '\r' || ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;
          bool ok = key ? h->cfg.authorized_key (h->cfg.arg, v, (size_t)(ve - v))
                        : h->cfg.authorized (h->cfg.arg, v, (size_t)(ve - v));
          if (ok || !h->cfg.authorized_key)
            return ok;
        }
      p = eol;
    }
  return false;
}

static void
conn_refuse (struct conn *t, struct evbuffer *dst, int why)
{
  t->state = CONN_REFUSED;
  t->refuse = why;
  if (why == 401)
    bump (t->h->cfg.unauthorized);
  /* guard_route answers it from t->refuse; the client's bytes never reach evhttp */
  static const char req[] = "GET / HTTP/1.1\r\nHost: warren\r\nConnection: close\r\n\r\n";
  evbuffer_add (dst, req, sizeof req - 1);
}

static enum bufferevent_filter_result
filter_in (struct evbuffer *src, struct evbuffer *dst, ev_ssize_t lim,
           enum bufferevent_flush_mode mode WR_UNUSED, void *arg)
{
  struct conn *t = arg;
  size_t len = evbuffer_get_length (src);
  if (len)
    t->last_rx = wr_now_ns ();
  if (t->state == CONN_OPEN)
    return evbuffer_remove_buffer (src, dst, lim < 0 ? len : (size_t)lim) >= 0 ? BEV_OK : BEV_ERROR;
  if (t->state == CONN_REFUSED)
    {
      evbuffer_drain (src, len);
      return BEV_NEED_MORE;
    }
  size_t n = len < WR_HTTPD_HEADER_MAX ? len : WR_HTTPD_HEADER_MAX;
  const char *buf = (const char *)evbuffer_pullup (src, (ev_ssize_t)n);
  size_t end = buf ? header_block_end (buf, n, &t->scanned) : 0;
  if (end == 0 && len < WR_HTTPD_HEADER_MAX)
    return BEV_NEED_MORE;
  if (end == 0)
    conn_refuse (t, dst, 413);
  else if (t->refuse)
    conn_refuse (t, dst, t->refuse); /* over the connection limit */
  else if (!headers_authorized (t->h, buf, end))
    conn_refuse (t, dst, 401);
  if (t->state == CONN_REFUSED)
    {
      evbuffer_drain (src, len);
      return BEV_OK;
    }
  t->state = CONN_OPEN;
  struct timeval tv = { t->h->cfg.idle_timeout_s, 0 };
  if (t->timer)
    evtimer_add (t->timer, &tv);
  return evbuffer_remove_buffer (src, dst, lim < 0 ? len : (size_t)lim) >= 0 ? BEV_OK : BEV_ERROR;
}

/* Is evhttp freeing the connection? (Its callbacks are gone; the filter and
 * t live on until libevent finalizes them.) */
bool
wr_http_filter_closing (struct bufferevent *filter)
{
  bufferevent_data_cb rcb, wcb;
  bufferevent_event_cb ecb;
  void *cbarg;
  bufferevent_getcb (filter, &rcb, &wcb, &ecb, &cbarg);
  return ecb == NULL;
}

static bool
conn_closing (struct conn *t)
{
  return wr_http_filter_closing (t->bev);
}

/* Close the connection the way a read timeout would. */
static void
conn_drop (struct conn *t)
{
  bump (t->h->cfg.timeouts);
  bufferevent_trigger_event (t->bev, BEV_EVENT_READING | BEV_EVENT_TIMEOUT, 0);
}

static void
timer_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct conn *t = arg;
  if (conn_closing (t))
    return;
  if (t->state != CONN_OPEN)
    {
      conn_drop (t); /* headers too slow, or a refusal the client does not read */
      return;
    }
  uint64_t idle = (uint64_t)t->h->cfg.idle_timeout_s * 1000000000u, now = wr_now_ns ();
  if (t->in_flight == 0 && now - t->last_rx >= idle)
    {
      conn_drop (t);
      return;
    }
  uint64_t left = t->in_flight ? idle : idle - (now - t->last_rx);
  struct timeval tv = { (time_t)(left / 1000000000u), (suseconds_t)(left % 1000000000u / 1000) };
  evtimer_add (t->timer, &tv);
}

/* libevent 2.1's filter moves output to the socket only when data is added
 * while writing is enabled, and evhttp adds a reply first and enables
 * writing after: flush on the next loop turn. */
static void
kick_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct conn *t = arg;
  if (!conn_closing (t))
    bufferevent_flush (t->bev, EV_WRITE, BEV_NORMAL);
}

/* evhttp takes its bufferevent's write callback to mean "the peer has the
 * bytes" (then it may close the connection, or produce the next piece of a
 * reply). The filter would say so as soon as bytes moved to the socket's
 * buffer: it moves them silently (BEV_NEED_MORE), and wr_http_sent_cb says
 * so when the socket's buffer is empty. */
enum bufferevent_filter_result
wr_http_filter_out (struct evbuffer *src, struct evbuffer *dst, ev_ssize_t lim,
                    enum bufferevent_flush_mode mode WR_UNUSED, void *arg WR_UNUSED)
{
  size_t len = evbuffer_get_length (src);
  if (lim >= 0 && (size_t)lim < len)
    len = (size_t)lim;
  return evbuffer_remove_buffer (src, dst, len) >= 0 ? BEV_NEED_MORE : BEV_ERROR;
}

void
wr_http_sent_cb (struct evbuffer *b, const struct evbuffer_cb_info *info, void *filter)
{
  if (info->n_deleted && evbuffer_get_length (b) == 0
      && evbuffer_get_length (bufferevent_get_output (filter)) == 0)
    bufferevent_trigger (filter, EV_WRITE, 0);
}

static void
out_cb (struct evbuffer *b WR_UNUSED, const struct evbuffer_cb_info *info, void *arg)
{
  struct conn *t = arg;
  if (info->n_added && t->kick)
    event_active (t->kick, EV_TIMEOUT, 0);
}

static void
set_connections (struct wr_httpd *h)
{
  if (h->cfg.connections)
    *h->cfg.connections = h->n_counted;
}

static void
conn_free (void *arg)
{
  struct conn *t = arg;
  struct wr_httpd *h = t->h;
  if (h)
    {
      if (t->counted)
        h->n_counted--;
      set_connections (h);
      if (t->prev)
        t->prev->next = t->next;
      else
        h->conns = t->next;
      if (t->next)
        t->next->prev = t->prev;
    }
  if (t->timer)
    event_free (t->timer);
  if (t->kick)
    event_free (t->kick);
  free (t);
}

static struct bufferevent *
bev_cb (struct event_base *base, void *arg)
{
  struct wr_httpd *h = arg;
  struct conn *t = calloc (1, sizeof *t);
  if (t == NULL)
    return NULL;
  struct bufferevent *u = bufferevent_socket_new (base, -1, BEV_OPT_CLOSE_ON_FREE);
  t->timer = evtimer_new (base, timer_cb, t);
  t->kick = event_new (base, -1, 0, kick_cb, t);
  if (u == NULL || t->timer == NULL || t->kick == NULL)
    goto fail;
  /* deferred callbacks: evhttp's write callback then means "moved towards
   * the socket", never a re-entrant call from inside evhttp's own write */
  t->bev = bufferevent_filter_new (u, filter_in, wr_http_filter_out,
                                   BEV_OPT_CLOSE_ON_FREE | BEV_OPT_DEFER_CALLBACKS, conn_free, t);
  if (t->bev == NULL)
    goto fail;
  bufferevent_setwatermark (u, EV_WRITE, 0, SOCKET_QUEUE);
  evbuffer_add_cb (bufferevent_get_output (t->bev), out_cb, t);
  evbuffer_add_cb (bufferevent_get_output (u), wr_http_sent_cb, t->bev);
  t->h = h;
  t->last_rx = wr_now_ns ();
  if (h->n_counted >= h->cfg.max_connections)
    {
      t->refuse = 503;
      bump (h->cfg.busy);
    }
  else
    {
      t->counted = true;
      h->n_counted++;
      set_connections (h);
    }
  t->next = h->conns;
  if (t->next)
    t->next->prev = t;
  h->conns = t;
  struct timeval tv = { h->cfg.header_timeout_s, 0 };
  evtimer_add (t->timer, &tv);
  return t->bev;
fail:
  if (u)
    bufferevent_free (u);
  if (t->timer)
    event_free (t->timer);
  if (t->kick)
    event_free (t->kick);
  free (t);
  return NULL; /* evhttp makes a plain socket; guard_route refuses it */
}

static struct conn *
conn_of (struct wr_httpd *h, struct evhttp_request *req)
{
  struct evhttp_connection *evcon = evhttp_request_get_connection (req);
  struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent (evcon) : NULL;
  for (struct conn *t = h->conns; t; t = t->next)
    if (t->bev == bev)
      return t;
  return NULL;
}

bool
wr_httpd_owns (struct wr_httpd *h, struct evhttp_request *req)
{
  return h && conn_of (h, req) != NULL;
}

static void
request_done (struct evhttp_request *req WR_UNUSED, void *arg)
{
  struct conn *t = arg;
  if (t->in_flight)
    t->in_flight--;
  t->last_rx = wr_now_ns ();
}

static void
guard_route (struct evhttp_request *req, void *arg)
{
  struct wr_httpd *h = arg;
  struct conn *t = conn_of (h, req);
  void *ua = h->cfg.arg;
  if (t == NULL)
    {
      h->cfg.refused (req, 503, WR_E_UNAVAILABLE, "out of memory for a new connection", ua);
      return;
    }
  if (t->state == CONN_REFUSED)
    {
      char msg[128];
      evhttp_add_header (evhttp_request_get_output_headers (req), "Connection", "close");
      if (t->refuse == 503)
        {
          snprintf (msg, sizeof msg, "too many connections (the limit is %u); retry later",
                    h->cfg.max_connections);
          h->cfg.refused (req, 503, WR_E_UNAVAILABLE, msg, ua);
        }
      else if (t->refuse == 413)
        {
          snprintf (msg, sizeof msg, "request headers over %u bytes", WR_HTTPD_HEADER_MAX);
          h->cfg.refused (req, 413, WR_E_TOO_LARGE, msg, ua);
        }
      else
        h->cfg.refused (req, 401, WR_E_UNAUTHORIZED, "a valid bearer token is required", ua);
      return;
    }
  t->in_flight++;
  evhttp_request_set_on_complete_cb (req, request_done, t);
  h->cfg.route (req, ua);
}

int
wr_httpd_new (struct event_base *base, const struct wr_httpd_config *cfg, struct wr_httpd **ret,
              wr_err_t *err)
{
  if (cfg->authorized == NULL || cfg->route == NULL || cfg->refused == NULL)
    return wr_error (err, EINVAL, WR_E_INTERNAL, "httpd: authorized, route and refused are needed");
  struct wr_httpd *h = calloc (1, sizeof *h);
  if (h == NULL)
    return wr_sys_error (err, "httpd");
  h->cfg = *cfg;
  if (h->cfg.max_connections == 0)
    h->cfg.max_connections = WR_HTTPD_MAX_CONNECTIONS;
  if (h->cfg.header_timeout_s == 0)
    h->cfg.header_timeout_s = WR_HTTPD_HEADER_TIMEOUT_S;
  if (h->cfg.idle_timeout_s == 0)
    h->cfg.idle_timeout_s = WR_HTTPD_IDLE_TIMEOUT_S;
  h->http = evhttp_new (base);
  if (h->http == NULL)
    {
      free (h);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "evhttp_new");
    }
  evhttp_set_gencb (h->http, guard_route, h);
  evhttp_set_max_body_size (h->http, h->cfg.max_body);
  evhttp_set_max_headers_size (h->http, WR_HTTPD_HEADER_MAX);
  evhttp_set_allowed_methods (h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_PUT
                                           | EVHTTP_REQ_DELETE | EVHTTP_REQ_HEAD
                                           | EVHTTP_REQ_PATCH);
  /* a backstop against dead peers; idleness is the guard's business */
  evhttp_set_timeout (h->http, 3600);
  evhttp_set_bevcb (h->http, bev_cb, h);
  set_connections (h);
  *ret = h;
  return 0;
}

const struct wr_httpd_config *
wr_httpd_config (const struct wr_httpd *h)
{
  return &h->cfg;
}

int
wr_httpd_bind (struct wr_httpd *h, const char *spec, wr_err_t *err)
{
  if (strncmp (spec, "tcp:", 4) != 0)
    return wr_error (err, 0, WR_E_INVALID, "expected tcp:ADDR:PORT, got %s", spec);
  char host[256];
  snprintf (host, sizeof host, "%s", spec + 4);
  char *colon = strrchr (host, ':');
  if (colon == NULL)
    return wr_error (err, 0, WR_E_INVALID, "expected tcp:ADDR:PORT, got %s", spec);
  *colon = '\0';
  char *end;
  long port = strtol (colon + 1, &end, 10);
  if (colon[1] == '\0' || *end || port < 0 || port > 65535)
    return wr_error (err, 0, WR_E_INVALID, "bad port in %s", spec);
  struct evhttp_bound_socket *bs
      = evhttp_bind_socket_with_handle (h->http, host, (ev_uint16_t)port);
  if (bs == NULL)
    return wr_error (err, errno, WR_E_INTERNAL, "bind %s", spec);
  if (wr_accept_guard (h->http, bs, err) < 0)
    return -1;
  /* small request/answer exchanges: no Nagle delay (accepted sockets
   * inherit the option from the listener on Linux) */
  int one = 1, fd = evhttp_bound_socket_get_fd (bs);
  setsockopt (fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  h->port = (int)port;
  if (getsockname (fd, (struct sockaddr *)&ss, &sl) == 0)
    h->port = ntohs (ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                              : ((struct sockaddr_in *)&ss)->sin_port);
  return 0;
}

/* ---- accept errors ---- */

/* Out of descriptors (or memory), accept() fails while the connection waits
 * in the backlog, so the listener stays readable: libevent would call
 * accept() again at once, forever, and log each failure. Instead the
 * listener rests for WR_ACCEPT_PAUSE_MS and tries again; the waiting client
 * is served as soon as a descriptor is free, and the loop keeps serving
 * the connections it has. evconnlistener hands the error callback the
 * listener's own argument (evhttp's), hence the list to find the guard. */
#define WR_ACCEPT_PAUSE_MS 100

struct accept_guard
{
  struct evconnlistener *l;
  struct evhttp *owner;
  struct event *resume;
  struct accept_guard *next;
};
static struct accept_guard *accept_guards;
static uint64_t accept_pauses;

static void
accept_resume (evutil_socket_t fd, short what, void *arg)
{
  (void)fd;
  (void)what;
  struct accept_guard *g = arg;
  evconnlistener_enable (g->l);
}

static void
accept_error (struct evconnlistener *l, void *arg)
{
  (void)arg;
  int e = EVUTIL_SOCKET_ERROR ();
  struct accept_guard *g = accept_guards;
  while (g && g->l != l)
    g = g->next;
  if (g == NULL || (e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM))
    return; /* anything else is the connection's own failure: go on */
  evconnlistener_disable (l);
  struct timeval tv = { 0, WR_ACCEPT_PAUSE_MS * 1000 };
  evtimer_add (g->resume, &tv);
  accept_pauses++;
}

int
wr_accept_guard (struct evhttp *owner, struct evhttp_bound_socket *bs, wr_err_t *err)
{
  struct evconnlistener *l = evhttp_bound_socket_get_listener (bs);
  struct accept_guard *g = calloc (1, sizeof *g);
  if (g == NULL
      || (g->resume = evtimer_new (evconnlistener_get_base (l), accept_resume, g)) == NULL)
    {
      free (g);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "accept guard");
    }
  g->l = l;
  g->owner = owner;
  g->next = accept_guards;
  accept_guards = g;
  evconnlistener_set_error_cb (g->l, accept_error);
  return 0;
}

void
wr_accept_guards_free (struct evhttp *owner)
{
  for (struct accept_guard **l = &accept_guards; *l;)
    {
      struct accept_guard *g = *l;
      if (g->owner != owner)
        {
          l = &g->next;
          continue;
        }
      *l = g->next;
      event_free (g->resume);
      free (g);
    }
}

uint64_t
wr_accept_pauses (void)
{
  return accept_pauses;
}

int
wr_httpd_port (const struct wr_httpd *h)
{
  return h ? h->port : 0;
}

void
wr_httpd_free (struct wr_httpd *h)
{
  if (h == NULL)
    return;
  wr_accept_guards_free (h->http);
  evhttp_free (h->http);
  /* connections' filters are finalized later, maybe after the base: their
   * timers go now, and they forget the guard */
  for (struct conn *t = h->conns; t; t = t->next)
    {
      if (t->timer)
        event_free (t->timer);
      if (t->kick)
        event_free (t->kick);
      t->timer = t->kick = NULL;
      t->h = NULL;
    }
  free (h);
}

int
wr_httpd_limit_opt (int opt, const char *arg, unsigned *max_connections, unsigned *header_timeout_s,
                    unsigned *idle_timeout_s, wr_err_t *err)
{
  const char *name = opt == WR_HTTPD_OPT_MAX_CONNECTIONS  ? "max-connections"
                     : opt == WR_HTTPD_OPT_HEADER_TIMEOUT ? "http-header-timeout"
                                                          : "http-idle-timeout";
  char *end;
  errno = 0;
  unsigned long v = strtoul (arg, &end, 10);
  if (*arg == '\0' || *end || errno || v == 0 || v > 1000000)
    return wr_error (err, 0, WR_E_INVALID, "--%s wants a number in [1, 1000000], got %s", name,
                     arg);
  *(opt == WR_HTTPD_OPT_MAX_CONNECTIONS  ? max_connections
    : opt == WR_HTTPD_OPT_HEADER_TIMEOUT ? header_timeout_s
                                         : idle_timeout_s)
      = (unsigned)v;
  return 0;
}

/* ---- plain TCP listeners (the compat APIs) ---- */

int
wr_http_serve_tcp (struct evhttp *http, const char *spec, const char *flag, int backlog,
                   int *ret_port, wr_err_t *err)
{
  const char *p = strncmp (spec, "tcp:", 4) == 0 ? spec + 4 : spec;
  char host[256] = "127.0.0.1";
  const char *colon = strrchr (p, ':');
  if (colon && colon > p)
    {
      const char *h = p, *e = colon;
      if (*h == '[' && e > h + 1 && e[-1] == ']')
        h++, e--;
      snprintf (host, sizeof host, "%.*s", (int)(e - h), h);
    }
  const char *port_s = colon ? colon + 1 : p;
  char *end;
  long port = strtol (port_s, &end, 10);
  if (*port_s == '\0' || *end || port < 0 || port > 65535)
    return wr_error (err, 0, WR_E_INVALID, "%s wants tcp:ADDR:PORT, got %s", flag, spec);
  struct sockaddr_storage ss = { 0 };
  socklen_t sl;
  struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
  struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
  if (inet_pton (AF_INET, host, &a4->sin_addr) == 1)
    {
      a4->sin_family = AF_INET;
      a4->sin_port = htons ((uint16_t)port);
      sl = sizeof *a4;
    }
  else if (inet_pton (AF_INET6, host, &a6->sin6_addr) == 1)
    {
      a6->sin6_family = AF_INET6;
      a6->sin6_port = htons ((uint16_t)port);
      sl = sizeof *a6;
    }
  else
    return wr_error (err, 0, WR_E_INVALID, "%s: %s is not an IP address", flag, host);
  int fd = socket (ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  if (fd < 0 || setsockopt (fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0
      || setsockopt (fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0
      || bind (fd, (struct sockaddr *)&ss, sl) < 0 || listen (fd, backlog) < 0)
    {
      int r = wr_sys_error (err, "listen on %s", spec);
      if (fd >= 0)
        close (fd);
      return r;
    }
  struct sockaddr_storage bound;
  socklen_t bl = sizeof bound;
  if (ret_port)
    *ret_port
        = getsockname (fd, (struct sockaddr *)&bound, &bl) == 0
              ? ntohs (bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                   : ((struct sockaddr_in *)&bound)->sin_port)
              : (int)port;
  struct evhttp_bound_socket *bs = evhttp_accept_socket_with_handle (http, fd);
  if (bs == NULL)
    {
      close (fd);
      return wr_error (err, 0, WR_E_INTERNAL, "cannot serve %s", spec);
    }
  return wr_accept_guard (http, bs, err); /* evhttp owns fd */
}

/* A deliberately small HTTP/1.1 client: one connection per handle, requests
 * with a Content-Length body, responses with Content-Length, chunked encoding
 * or read-until-close, a deadline per request and hard caps on what the peer
 * may make us buffer. The socket is non-blocking and every wait is a poll()
 * bounded by the request's deadline, so a silent or half-dead daemon turns
 * into an error, never a hang. */
#include "internal.h"

#include <ctype.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

#include "common/err.h" /* the one infra/task table */
#include "common/util.h"

int
wl_error (warren_error_t *err, int errnum, const char *code, int status, const char *fmt, ...)
{
  int ret = errnum > 0 ? -errnum : -EIO;
  if (err == NULL)
    return ret;
  snprintf (err->code, sizeof err->code, "%s", code ? code : WARREN_E_INTERNAL);
  err->status = status;
  err->errnum = errnum;
  va_list ap;
  va_start (ap, fmt);
  int n = vsnprintf (err->message, sizeof err->message, fmt, ap);
  va_end (ap);
  if (n < 0)
    n = 0;
  if (errnum > 0 && (size_t)n < sizeof err->message)
    snprintf (err->message + n, sizeof err->message - n, ": %s", strerror (errnum));
  return ret;
}

bool
warren_err_is_infra (const warren_error_t *err)
{
  if (err == NULL || err->code[0] == '\0')
    return false;
  /* a 5xx the table does not know (a proxy's, a gateway's) is the platform's */
  if (err->status >= 500)
    return true;
  /* the client's own deadline: the platform did not answer in time */
  if (err->status == 0 && strcmp (err->code, WARREN_E_TIMEOUT) == 0)
    return true;
  return wr_code_is_infra (err->code);
}

const char *
wl_code_for_status (int status)
{
  switch (status)
    {
    case 400:
      return WARREN_E_INVALID;
    case 401:
      return WARREN_E_UNAUTHORIZED;
    case 403:
      return WARREN_E_FORBIDDEN;
    case 404:
      return WARREN_E_NOT_FOUND;
    case 409:
      return WARREN_E_CONFLICT;
    case 410:
      return WARREN_E_GONE;
    case 413:
      return WARREN_E_TOO_LARGE;
    case 429:
      return WARREN_E_EXHAUSTED;
    case 501:
      return WARREN_E_UNSUPPORTED;
    case 503:
      return WARREN_E_UNAVAILABLE;
    case 504:
      return WARREN_E_TIMEOUT;
    default:
      return status >= 500 ? WARREN_E_INTERNAL : WARREN_E_INVALID;
    }
}

static void
conn_close (warren_client_t *c)
{
  if (c->fd >= 0)
    close (c->fd);
  c->fd = -1;
  c->rpos = c->rlen = 0;
}

/* Wait until fd is ready for events, honouring the deadline and the cancel flag. */
static int
conn_wait (warren_client_t *c, short events, warren_error_t *err)
{
  for (;;)
    {
      if (c->cancel && *c->cancel)
        return wl_error (err, 0, WARREN_E_CANCELLED, 0, "request to %s cancelled", c->host);
      int slice = -1;
      if (c->deadline_ns)
        {
          uint64_t now = wr_now_ns ();
          if (now >= c->deadline_ns)
            return wl_error (err, 0, WARREN_E_TIMEOUT, 0, "no answer from %s in time", c->host);
          slice = (int)((c->deadline_ns - now + 999999) / 1000000);
        }
      /* A signal may land between the flag check and poll(); slicing bounds
       * how long such a cancel goes unnoticed. */
      if (c->cancel && (slice < 0 || slice > 250))
        slice = 250;
      struct pollfd p = { .fd = c->fd, .events = events };
      int r = poll (&p, 1, slice);
      if (r < 0 && errno != EINTR)
        return wl_error (err, errno, WARREN_E_IO, 0, "poll");
      if (r > 0)
        return 0;
    }
}

static int
conn_send (warren_client_t *c, const void *buf, size_t len, warren_error_t *err)
{
  const char *p = buf;
  while (len > 0)
    {
      ssize_t n = send (c->fd, p, len, MSG_NOSIGNAL);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          if (errno == EAGAIN)
            {
              if (conn_wait (c, POLLOUT, err) < 0)
                return -1;
              continue;
            }
          c->conn_failed = errno == EPIPE || errno == ECONNRESET;
          return wl_error (err, errno, WARREN_E_CONNECT, 0, "sending to %s", c->host);
        }
      p += n;
      len -= (size_t)n;
    }
  return 0;
}

/* Read some bytes from the socket (not the buffer); 0 at EOF. */
static ssize_t
conn_recv (warren_client_t *c, void *buf, size_t n, warren_error_t *err)
{
  for (;;)
    {
      ssize_t r = recv (c->fd, buf, n, 0);
      if (r > 0)
        {
          c->got_bytes = true;
          return r;
        }
      if (r == 0)
        {
          c->conn_failed = true;
          return 0;
        }
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN)
        {
          if (conn_wait (c, POLLIN, err) < 0)
            return -1;
          continue;
        }
      c->conn_failed = errno == ECONNRESET;
      return wl_error (err, errno, WARREN_E_CONNECT, 0, "reading from %s", c->host);
    }
}

/* Buffered read: what is left in rbuf first, then the socket directly. */
static ssize_t
conn_read (warren_client_t *c, void *buf, size_t n, warren_error_t *err)
{
  if (c->rpos < c->rlen)
    {
      size_t m = c->rlen - c->rpos;
      if (m > n)
        m = n;
      memcpy (buf, c->rbuf + c->rpos, m);
      c->rpos += m;
      return (ssize_t)m;
    }
  return conn_recv (c, buf, n, err);
}

/* Append socket bytes to rbuf (compacting first). 0 at EOF. */
static ssize_t
conn_fill (warren_client_t *c, warren_error_t *err)
{
  if (c->rpos > 0)
    {
      memmove (c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
      c->rlen -= c->rpos;
      c->rpos = 0;
    }
  if (c->rlen >= WL_RBUF_SIZE)
    return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response line too long from %s", c->host);
  ssize_t r = conn_recv (c, c->rbuf + c->rlen, WL_RBUF_SIZE - c->rlen, err);
  if (r > 0)
    c->rlen += (size_t)r;
  return r;
}

/* One CRLF (or LF) terminated line of at most cap-1 bytes, terminator stripped. */
static int
conn_getline (warren_client_t *c, char *line, size_t cap, warren_error_t *err)
{
  for (;;)
    {
      char *nl = memchr (c->rbuf + c->rpos, '\n', c->rlen - c->rpos);
      if (nl)
        {
          size_t len = (size_t)(nl - (c->rbuf + c->rpos));
          if (len >= cap)
            return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response line too long from %s",
                             c->host);
          memcpy (line, c->rbuf + c->rpos, len);
          if (len > 0 && line[len - 1] == '\r')
            len--;
          line[len] = '\0';
          c->rpos += (size_t)(nl - (c->rbuf + c->rpos)) + 1;
          return 0;
        }
      if (c->rlen - c->rpos >= cap)
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response line too long from %s", c->host);
      ssize_t r = conn_fill (c, err);
      if (r < 0)
        return -1;
      if (r == 0)
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                         "connection to %s closed in the middle of a response", c->host);
    }
}

static int
connect_error (warren_client_t *c, int errnum, warren_error_t *err)
{
  bool hint = errnum == ENOENT || errnum == ECONNREFUSED;
  return wl_error (err, 0, WARREN_E_CONNECT, 0, "cannot connect to %s: %s%s", c->host,
                   strerror (errnum), hint ? " (is warrend running?)" : "");
}

static int
connect_unix (warren_client_t *c, warren_error_t *err)
{
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  size_t len = strlen (c->unix_path);
  if (len >= sizeof sa.sun_path)
    return wl_error (err, ENAMETOOLONG, WARREN_E_CONNECT, 0, "cannot connect to %s", c->host);
  memcpy (sa.sun_path, c->unix_path, len + 1);
  _cleanup_close_ int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return wl_error (err, errno, WARREN_E_CONNECT, 0, "socket");
  /* A non-blocking unix connect fails with EAGAIN while the listen backlog is
   * full; back off briefly until the deadline. */
  for (;;)
    {
      if (connect (fd, (struct sockaddr *)&sa, sizeof sa) == 0)
        break;
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN)
        return connect_error (c, errno, err);
      if (c->deadline_ns && wr_now_ns () >= c->deadline_ns)
        return connect_error (c, ETIMEDOUT, err);
      if (c->cancel && *c->cancel)
        return wl_error (err, 0, WARREN_E_CANCELLED, 0, "connect to %s cancelled", c->host);
      nanosleep (&(struct timespec){ .tv_nsec = 2000000 }, NULL);
    }
  c->fd = TAKE_FD (fd);
  return 0;
}

static int
connect_tcp (warren_client_t *c, warren_error_t *err)
{
  struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_family = AF_UNSPEC };
  struct addrinfo *ai = NULL;
  int r = getaddrinfo (c->tcp_host, c->tcp_port, &hints, &ai);
  if (r != 0)
    return wl_error (err, 0, WARREN_E_CONNECT, 0, "cannot connect to %s: %s", c->host,
                     gai_strerror (r));
  int last = ECONNREFUSED;
  for (struct addrinfo *a = ai; a; a = a->ai_next)
    {
      int fd = socket (a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0)
        {
          last = errno;
          continue;
        }
      c->fd = fd;
      if (connect (fd, a->ai_addr, a->ai_addrlen) < 0 && errno != EINPROGRESS)
        {
          last = errno;
          conn_close (c);
          continue;
        }
      warren_error_t werr;
      if (conn_wait (c, POLLOUT, &werr) < 0)
        {
          conn_close (c);
          freeaddrinfo (ai);
          if (strcmp (werr.code, WARREN_E_TIMEOUT) == 0)
            return connect_error (c, ETIMEDOUT, err);
          if (err)
            *err = werr;
          return -1;
        }
      int soerr = 0;
      socklen_t sl = sizeof soerr;
      if (getsockopt (fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
        soerr = errno;
      if (soerr != 0)
        {
          last = soerr;
          conn_close (c);
          continue;
        }
      int one = 1;
      setsockopt (fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      freeaddrinfo (ai);
      return 0;
    }
  freeaddrinfo (ai);
  return connect_error (c, last, err);
}

/* A kept connection is usable only when the daemon has sent nothing since the
 * last response: readability here means EOF (idle close) or garbage. */
static bool
conn_idle_ok (warren_client_t *c)
{
  struct pollfd p = { .fd = c->fd, .events = POLLIN };
  return poll (&p, 1, 0) == 0;
}

static bool
token_char_ok (const char *s)
{
  for (; *s; s++)
    if ((unsigned char)*s < 0x21 || (unsigned char)*s > 0x7e)
      return false;
  return true;
}

static int
send_request (warren_client_t *c, const wl_request_t *req, warren_error_t *err)
{
  bool has_body = req->body || req->body_fd >= 0 || strcmp (req->method, "POST") == 0
                  || strcmp (req->method, "PUT") == 0;
  char lenhdr[64] = "";
  if (has_body)
    snprintf (lenhdr, sizeof lenhdr, "Content-Length: %" PRIu64 "\r\n", req->body_len);
  _cleanup_free_ char *head = NULL;
  int hl = asprintf (&head,
                     "%s %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: libwarren/" WARREN_VERSION
                     "\r\nAccept: */*\r\n%s%s%s%s%s%s%s%s%s\r\n",
                     req->method, req->target, c->host_header,
                     c->token ? "Authorization: Bearer " : "", c->token ? c->token : "",
                     c->token ? "\r\n" : "", req->content_type && has_body ? "Content-Type: " : "",
                     req->content_type && has_body ? req->content_type : "",
                     req->content_type && has_body ? "\r\n" : "",
                     req->idem_key ? "Idempotency-Key: " : "", req->idem_key ? req->idem_key : "",
                     req->idem_key ? "\r\n" : "");
  if (hl < 0)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");
  /* Append lenhdr right before the final CRLF. */
  _cleanup_free_ char *full = NULL;
  int fl = asprintf (&full, "%.*s%s\r\n", hl - 2, head, lenhdr);
  if (fl < 0)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");

  if (req->body && req->body_len > 0 && req->body_len <= 65536)
    {
      /* One write for small requests: no extra segment, no extra syscall. */
      _cleanup_free_ char *one = malloc ((size_t)fl + req->body_len);
      if (one == NULL)
        return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "request");
      memcpy (one, full, (size_t)fl);
      memcpy (one + fl, req->body, req->body_len);
      return conn_send (c, one, (size_t)fl + req->body_len, err);
    }
  if (conn_send (c, full, (size_t)fl, err) < 0)
    return -1;
  if (req->body && req->body_len > 0)
    return conn_send (c, req->body, req->body_len, err);
  if (req->body_fd >= 0)
    {
      char buf[65536];
      uint64_t left = req->body_len;
      off_t off = req->body_off;
      while (left > 0)
        {
          size_t want = left < sizeof buf ? (size_t)left : sizeof buf;
          ssize_t n = pread (req->body_fd, buf, want, off);
          if (n < 0 && errno == EINTR)
            continue;
          if (n < 0)
            return wl_error (err, errno, WARREN_E_IO, 0, "reading the upload");
          if (n == 0)
            return wl_error (err, 0, WARREN_E_IO, 0, "the upload shrank while it was being sent");
          if (conn_send (c, buf, (size_t)n, err) < 0)
            return -1;
          off += n;
          left -= (uint64_t)n;
        }
    }
  return 0;
}

static char *
skip_ws (char *s)
{
  while (*s == ' ' || *s == '\t')
    s++;
  return s;
}

static int
parse_u64 (const char *s, int base, uint64_t *ret)
{
  if (!isxdigit ((unsigned char)*s))
    return -1;
  uint64_t v = 0;
  for (; isxdigit ((unsigned char)*s); s++)
    {
      int d = isdigit ((unsigned char)*s) ? *s - '0' : (tolower ((unsigned char)*s) - 'a' + 10);
      if (d >= base || v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base)
        return -1;
      v = v * (uint64_t)base + (uint64_t)d;
    }
  *ret = v;
  return *skip_ws ((char *)s) == '\0' ? 0 : -1;
}

/* Read and parse one response head; 1xx interim responses are skipped. */
static int
read_head (warren_client_t *c, const wl_request_t *req, wl_response_t *resp, warren_error_t *err)
{
  for (;;)
    {
      char *end;
      size_t scanned = 0;
      for (;;)
        {
          size_t avail = c->rlen - c->rpos;
          size_t from = scanned > 3 ? scanned - 3 : 0;
          end = avail >= 4 ? memmem (c->rbuf + c->rpos + from, avail - from, "\r\n\r\n", 4) : NULL;
          if (end)
            break;
          scanned = avail;
          if (avail > WL_HEADER_MAX)
            return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                             "response headers from %s exceed %d bytes", c->host, WL_HEADER_MAX);
          bool had = c->got_bytes;
          ssize_t r = conn_fill (c, err);
          if (r < 0)
            return -1;
          if (r == 0)
            {
              if (!had && avail == 0)
                return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                                 "connection to %s closed before a response", c->host);
              c->conn_failed = false;
              return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                               "connection to %s closed in the middle of the response headers",
                               c->host);
            }
        }
      char *head = c->rbuf + c->rpos;
      size_t hlen = (size_t)(end - head);
      if (hlen > WL_HEADER_MAX)
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response headers from %s exceed %d bytes",
                         c->host, WL_HEADER_MAX);
      if (memchr (head, '\0', hlen))
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "NUL byte in response headers from %s",
                         c->host);
      *end = '\0';
      c->rpos += hlen + 4;

      memset (resp, 0, sizeof *resp);
      char *save = NULL;
      char *line = strtok_r (head, "\r\n", &save);
      int minor = 0, status = 0, consumed = 0;
      if (line == NULL || sscanf (line, "HTTP/1.%1d %3d%n", &minor, &status, &consumed) != 2
          || status < 100 || status > 599 || (line[consumed] != ' ' && line[consumed] != '\0'))
        return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "malformed status line from %s", c->host);
      resp->status = status;
      resp->keep_alive = minor >= 1;
      bool have_len = false;
      uint64_t clen = 0;
      while ((line = strtok_r (NULL, "\r\n", &save)))
        {
          char *colon = strchr (line, ':');
          if (colon == NULL || colon == line)
            return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "malformed header line from %s",
                             c->host);
          *colon = '\0';
          char *v = skip_ws (colon + 1);
          size_t vl = strlen (v);
          while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\t'))
            v[--vl] = '\0';
          if (strcasecmp (line, "Content-Length") == 0)
            {
              uint64_t n;
              if (parse_u64 (v, 10, &n) < 0 || (have_len && n != clen))
                return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "bad Content-Length from %s",
                                 c->host);
              have_len = true;
              clen = n;
            }
          else if (strcasecmp (line, "Transfer-Encoding") == 0)
            {
              const char *last = strrchr (v, ',');
              last = last ? skip_ws ((char *)last + 1) : v;
              if (strcasecmp (last, "chunked") != 0)
                return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                                 "unsupported Transfer-Encoding '%.64s' from %s", v, c->host);
              resp->chunked = true;
            }
          else if (strcasecmp (line, "Connection") == 0)
            {
              if (strcasestr (v, "close"))
                resp->keep_alive = false;
              else if (strcasestr (v, "keep-alive"))
                resp->keep_alive = true;
            }
          else if (strcasecmp (line, "Content-Type") == 0)
            snprintf (resp->content_type, sizeof resp->content_type, "%s", v);
        }
      if (status >= 100 && status < 200)
        continue; /* interim (100 Continue...) */

      if (status == 204 || status == 304 || strcmp (req->method, "HEAD") == 0)
        resp->done = true;
      else if (resp->chunked)
        ;
      else if (have_len)
        {
          resp->remaining = clen;
          resp->done = clen == 0;
        }
      else
        {
          resp->until_close = true;
          resp->keep_alive = false;
        }
      return 0;
    }
}

static void
next_host (warren_client_t *c)
{
  wl_use_host (c, (c->cur + 1) % c->nhosts);
}

static int
copy_error (warren_error_t *err, const warren_error_t *e, int r)
{
  if (err)
    *err = *e;
  return r < 0 ? r : -EIO;
}

int
wl_http_begin (warren_client_t *c, const wl_request_t *req, wl_response_t *resp,
               warren_error_t *err)
{
  if (c->token && !token_char_ok (c->token))
    return wl_error (err, 0, WARREN_E_INVALID, 0, "the token contains invalid characters");
  int timeout = req->timeout_ms ? req->timeout_ms : c->timeout_ms;
  uint64_t deadline = timeout > 0 ? wr_now_ns () + (uint64_t)timeout * 1000000ull : 0;
  c->deadline_ns = deadline;
  bool idempotent = strcmp (req->method, "GET") == 0 || strcmp (req->method, "PUT") == 0
                    || strcmp (req->method, "DELETE") == 0 || strcmp (req->method, "HEAD") == 0;
  /* A create with a key may go out twice only to gateways, which answer the
   * second with the first one's sandbox; a node ignores the key. Several
   * hosts are gateways of one cluster (docs/cluster.md). */
  bool replayable = idempotent || (req->idem_key && c->nhosts > 1);
  size_t hops = 0; /* hosts this request gave up on */
  bool stale_retried = false;
  for (;;)
    {
      warren_error_t e;
      bool reused = false;
      if (c->fd >= 0)
        {
          if (conn_idle_ok (c))
            reused = true;
          else
            conn_close (c);
        }
      if (c->fd < 0)
        {
          /* One silent host must not eat the whole deadline of a list. */
          if (c->nhosts > 1)
            {
              uint64_t cap = wr_now_ns () + WL_FAILOVER_CONNECT_MS * 1000000ull;
              if (deadline == 0 || cap < deadline)
                c->deadline_ns = cap;
            }
          int r = c->unix_path ? connect_unix (c, &e) : connect_tcp (c, &e);
          c->deadline_ns = deadline;
          if (r < 0)
            {
              /* nothing was sent: any request may go to the next host */
              if (strcmp (e.code, WARREN_E_CONNECT) == 0 && hops + 1 < c->nhosts)
                {
                  next_host (c);
                  hops++;
                  continue;
                }
              return copy_error (err, &e, r);
            }
        }
      c->rpos = c->rlen = 0;
      c->conn_failed = false;
      c->got_bytes = false;
      int r = send_request (c, req, &e);
      if (r == 0)
        r = read_head (c, req, resp, &e);
      if (r == 0)
        return 0;
      /* The peer went away before answering: the daemon closing an idle
       * keep-alive connection at that moment, or a crashed gateway. */
      bool lost = c->conn_failed && !c->got_bytes;
      conn_close (c);
      if (lost && reused && !stale_retried && idempotent)
        {
          stale_retried = true; /* the same host, once, on a new connection */
          continue;
        }
      if (lost && replayable && hops + 1 < c->nhosts)
        {
          next_host (c);
          hops++;
          c->replayed = true;
          continue;
        }
      if (lost && !replayable)
        return wl_error (err, 0, WARREN_E_CONNECTION_LOST, 0,
                         "connection to %s closed before an answer to %s %s: it may or may not "
                         "have run, and is not sent again (an infrastructure failure)",
                         c->host, req->method, req->target);
      return copy_error (err, &e, r);
    }
}

static int
truncated (warren_client_t *c, warren_error_t *err)
{
  return wl_error (err, 0, WARREN_E_PROTOCOL, 0,
                   "connection to %s closed in the middle of the response body", c->host);
}

/* Up to n bytes of what remains of the body or of the current chunk. */
static ssize_t
read_part (warren_client_t *c, wl_response_t *resp, void *buf, size_t n, warren_error_t *err)
{
  size_t m = resp->remaining < n ? (size_t)resp->remaining : n;
  ssize_t r = conn_read (c, buf, m, err);
  if (r < 0)
    return -1;
  if (r == 0)
    return truncated (c, err);
  resp->remaining -= (uint64_t)r;
  return r;
}

ssize_t
wl_http_read (warren_client_t *c, wl_response_t *resp, void *buf, size_t n, warren_error_t *err)
{
  if (resp->done || n == 0)
    return 0;
  if (resp->until_close)
    {
      ssize_t r = conn_read (c, buf, n, err);
      if (r == 0)
        resp->done = true;
      return r;
    }
  if (resp->chunked)
    {
      char line[256];
      while (!resp->in_chunk)
        {
          if (resp->chunk_crlf)
            {
              if (conn_getline (c, line, sizeof line, err) < 0)
                return -1;
              if (line[0] != '\0')
                return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "bad chunk framing from %s",
                                 c->host);
              resp->chunk_crlf = false;
            }
          if (conn_getline (c, line, sizeof line, err) < 0)
            return -1;
          char *ext = strchr (line, ';');
          if (ext)
            *ext = '\0';
          uint64_t size;
          if (parse_u64 (line, 16, &size) < 0)
            return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "bad chunk size from %s", c->host);
          if (size == 0)
            {
              /* Trailers, up to the empty line; bounded like the head. */
              size_t total = 0;
              char tl[1024];
              do
                {
                  if (conn_getline (c, tl, sizeof tl, err) < 0)
                    return -1;
                  total += strlen (tl) + 2;
                  if (total > WL_HEADER_MAX)
                    return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "trailers too long from %s",
                                     c->host);
                }
              while (tl[0] != '\0');
              resp->done = true;
              return 0;
            }
          resp->remaining = size;
          resp->in_chunk = true;
        }
      ssize_t r = read_part (c, resp, buf, n, err);
      if (r > 0 && resp->remaining == 0)
        {
          resp->in_chunk = false;
          resp->chunk_crlf = true;
        }
      return r;
    }
  ssize_t r = read_part (c, resp, buf, n, err);
  if (r > 0 && resp->remaining == 0)
    resp->done = true;
  return r;
}

void
wl_http_end (warren_client_t *c, wl_response_t *resp)
{
  if (!(resp->done && resp->keep_alive) || c->rpos != c->rlen)
    conn_close (c);
  c->deadline_ns = 0;
}

int
wl_http_read_all (warren_client_t *c, wl_response_t *resp, size_t max, char **ret, size_t *ret_len,
                  warren_error_t *err)
{
  size_t cap = resp->done || resp->chunked || resp->until_close
                   ? 4096
                   : (resp->remaining < max ? (size_t)resp->remaining + 1 : max + 1);
  if (!resp->chunked && !resp->until_close && resp->remaining > max)
    return wl_error (err, 0, WARREN_E_TOO_LARGE, 0, "response from %s larger than %zu bytes",
                     c->host, max);
  size_t len = 0;
  _cleanup_free_ char *buf = malloc (cap);
  if (buf == NULL)
    return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "response buffer");
  for (;;)
    {
      if (resp->done)
        break;
      if (len + 1 >= cap)
        {
          if (cap > max)
            return wl_error (err, 0, WARREN_E_TOO_LARGE, 0,
                             "response from %s larger than %zu bytes", c->host, max);
          size_t ncap = cap * 2 > max + 1 ? max + 1 : cap * 2;
          if (ncap <= cap)
            ncap = cap + 1;
          char *nb = realloc (buf, ncap);
          if (nb == NULL)
            return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "response buffer");
          buf = nb;
          cap = ncap;
        }
      ssize_t r = wl_http_read (c, resp, buf + len, cap - 1 - len, err);
      if (r < 0)
        return -1;
      len += (size_t)r;
    }
  buf[len] = '\0';
  *ret = TAKE_PTR (buf);
  if (ret_len)
    *ret_len = len;
  return 0;
}

int
wl_http_read_lines (warren_client_t *c, wl_response_t *resp, bool split, size_t max, wl_line_fn fn,
                    void *ud, warren_error_t *err)
{
  _cleanup_free_ char *line = NULL;
  size_t len = 0, cap = 0;
  char buf[65536];
  for (;;)
    {
      ssize_t n = wl_http_read (c, resp, buf, sizeof buf, err);
      if (n < 0)
        return -1;
      /* At the end, a last line without '\n' still counts. */
      bool eof = n == 0;
      const char *p = buf, *end = buf + n;
      while (p < end || (eof && len > 0))
        {
          const char *nl = split && p < end ? memchr (p, '\n', (size_t)(end - p)) : NULL;
          size_t take = nl ? (size_t)(nl - p) : (size_t)(end - p);
          if (len + take > max)
            return wl_error (err, 0, WARREN_E_PROTOCOL, 0, "response line from %s too long",
                             c->host);
          if (len + take + 1 > cap)
            {
              size_t ncap = cap ? cap : 4096;
              while (ncap < len + take + 1)
                ncap *= 2;
              char *nb = realloc (line, ncap);
              if (nb == NULL)
                return wl_error (err, ENOMEM, WARREN_E_INTERNAL, 0, "response line buffer");
              line = nb;
              cap = ncap;
            }
          memcpy (line + len, p, take);
          len += take;
          p += take;
          if (nl == NULL && !eof)
            break; /* need more bytes */
          if (nl)
            p++;
          size_t l = len;
          len = 0;
          while (l > 0 && (line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\n'))
            l--;
          if (l > 0 && fn (line, l, ud, err) < 0)
            return -1;
        }
      if (eof)
        return 0;
    }
}

int
wl_http_error (warren_client_t *c, wl_response_t *resp, warren_error_t *err)
{
  int status = resp->status;
  _cleanup_free_ char *body = NULL;
  size_t len = 0;
  warren_error_t ignored;
  if (wl_http_read_all (c, resp, WL_ERROR_BODY_MAX, &body, &len, &ignored) < 0)
    body = NULL;
  wl_http_end (c, resp);
  if (body)
    {
      json_t *j = json_loadb (body, len, 0, NULL);
      json_t *e = json_object_get (j, "error");
      const char *code = json_string_value (json_object_get (e, "code"));
      const char *msg = json_string_value (json_object_get (e, "message"));
      if (code && msg)
        {
          int r = wl_error (err, 0, code, status, "%s", msg);
          json_decref (j);
          return r;
        }
      json_decref (j);
    }
  /* Not our JSON (a proxy, a crash page): keep a printable snippet. */
  char snip[201] = "";
  size_t k = 0;
  for (size_t i = 0; body && i < len && k < sizeof snip - 1; i++)
    snip[k++] = (body[i] >= 0x20 && body[i] < 0x7f) ? body[i] : ' ';
  snip[k] = '\0';
  return wl_error (err, 0, wl_code_for_status (status), status, "%s answered HTTP %d%s%s", c->host,
                   status, k ? ": " : "", snip);
}

/* Sleep ms, or less when the deadline or a cancel comes first; -1 then. */
static int
pause_ms (warren_client_t *c, int ms, uint64_t deadline, warren_error_t *err)
{
  uint64_t until = wr_now_ns () + (uint64_t)ms * 1000000ull;
  if (deadline && until >= deadline)
    return wl_error (err, 0, WARREN_E_TIMEOUT, 0, "no answer from %s in time", c->host);
  while (wr_now_ns () < until)
    {
      if (c->cancel && *c->cancel)
        return wl_error (err, 0, WARREN_E_CANCELLED, 0, "request to %s cancelled", c->host);
      nanosleep (&(struct timespec){ .tv_nsec = 10000000 }, NULL);
    }
  return 0;
}

int
wl_http_request (warren_client_t *c, const wl_request_t *req, wl_response_t *resp,
                 warren_error_t *err)
{
  c->replayed = false;
  int timeout = req->timeout_ms ? req->timeout_ms : c->timeout_ms;
  uint64_t deadline = timeout > 0 ? wr_now_ns () + (uint64_t)timeout * 1000000ull : 0;
  size_t hops = 0;
  int waited_ms = 0, backoff_ms = 25;
  wl_request_t rekey;
  char newkey[40];
  bool rekeyed = false;
  for (;;)
    {
      if (wl_http_begin (c, req, resp, err) < 0)
        return -1;
      if (resp->status < 400)
        return 0;
      warren_error_t e;
      int r = wl_http_error (c, resp, &e);
      /* A gateway that lost etcd did nothing with the request; another
       * gateway may still reach it. */
      if (resp->status == 503 && strcmp (e.code, "control_plane_unavailable") == 0
          && hops + 1 < c->nhosts)
        {
          next_host (c);
          hops++;
          continue;
        }
      /* A replayed create whose first attempt (through a gateway that died)
       * is still being made: the key answers with that sandbox once it
       * exists. */
      if (resp->status == 409 && req->idem_key && c->replayed
          && strcmp (e.code, WARREN_E_CONFLICT) == 0)
        {
          if (waited_ms < WL_IDEM_WAIT_MS)
            {
              int pr = pause_ms (c, backoff_ms, deadline, err);
              if (pr < 0)
                return pr;
              waited_ms += backoff_ms;
              backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
              continue;
            }
          /* Still no sandbox for the key: the gateway died after claiming it
           * and before any node made one, and its claim outlives it. A key
           * of our own is replaced once by a fresh one. */
          if (req->idem_auto && !rekeyed && wr_random_hex (newkey + 3, 32) == 0)
            {
              memcpy (newkey, "wl-", 3);
              rekey = *req;
              rekey.idem_key = newkey;
              req = &rekey;
              rekeyed = true;
              continue;
            }
        }
      return copy_error (err, &e, r);
    }
}

char *
wl_urlencode (const char *s)
{
  static const char hex[] = "0123456789ABCDEF";
  size_t n = strlen (s);
  char *out = malloc (n * 3 + 1);
  if (out == NULL)
    return NULL;
  char *o = out;
  for (; *s; s++)
    {
      unsigned char ch = (unsigned char)*s;
      if (isalnum (ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~')
        *o++ = (char)ch;
      else
        {
          *o++ = '%';
          *o++ = hex[ch >> 4];
          *o++ = hex[ch & 15];
        }
    }
  *o = '\0';
  return out;
}

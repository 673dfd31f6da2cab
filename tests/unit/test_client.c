/* libwarren against a scripted fake daemon: a thread serving canned HTTP on a
 * unix socket in a temp dir, checking what the client sends. TAP output. */
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "warren/warren.h"
#include "tap.h"

static char tmpdir[64];

/* Every wait in this file is bounded only to catch a hang: CI runs on a
 * loaded 2-core VM whose speed drifts, so nothing may hinge on a thread
 * being scheduled within some milliseconds. Orderings that matter are made
 * explicit with srv_note/srv_await instead of sleeps. */
#define WAIT_MS 60000

static uint64_t
now_ms (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- fake daemon ---- */

typedef struct srv srv_t;
struct srv
{
  char path[108];
  int lfd;
  pthread_t th;
  void (*handler) (srv_t *);
  int accepts;
  int failures;
  int arg;
  int note[2]; /* socketpair: [0] the test's end, [1] the server thread's */
};

typedef struct req
{
  char method[16];
  char target[1024];
  char headers[8192];
  char *body;
  size_t body_len;
} req_t;

static int
srv_accept (srv_t *s, int timeout_ms)
{
  struct pollfd p = { .fd = s->lfd, .events = POLLIN };
  if (poll (&p, 1, timeout_ms) <= 0)
    return -1;
  int fd = accept4 (s->lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd >= 0)
    {
      s->accepts++;
      struct timeval tv = { .tv_sec = WAIT_MS / 1000 };
      setsockopt (fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
  return fd;
}

/* Read one request; -1 on EOF or error. */
static int
srv_read_req (int fd, req_t *r)
{
  memset (r, 0, sizeof *r);
  char head[16384];
  size_t n = 0;
  while (n < sizeof head - 1)
    {
      ssize_t k = read (fd, head + n, 1);
      if (k <= 0)
        return -1;
      n++;
      if (n >= 4 && memcmp (head + n - 4, "\r\n\r\n", 4) == 0)
        break;
    }
  head[n] = '\0';
  if (sscanf (head, "%15s %1023s", r->method, r->target) != 2)
    return -1;
  char *h = strstr (head, "\r\n");
  snprintf (r->headers, sizeof r->headers, "%s", h ? h + 2 : "");
  char *cl = strcasestr (r->headers, "Content-Length:");
  r->body_len = cl ? strtoul (cl + 15, NULL, 10) : 0;
  r->body = malloc (r->body_len + 1);
  size_t got = 0;
  while (got < r->body_len)
    {
      ssize_t k = read (fd, r->body + got, r->body_len - got);
      if (k <= 0)
        return -1;
      got += (size_t)k;
    }
  r->body[r->body_len] = '\0';
  return 0;
}

static void
srv_write (int fd, const void *data, size_t len)
{
  const char *p = data;
  while (len > 0)
    {
      ssize_t k = send (fd, p, len, MSG_NOSIGNAL);
      if (k <= 0)
        return;
      p += k;
      len -= (size_t)k;
    }
}

static void
srv_puts (int fd, const char *s)
{
  srv_write (fd, s, strlen (s));
}

static void
srv_json (int fd, int status, const char *json)
{
  char head[256];
  snprintf (head, sizeof head,
            "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
            status, strlen (json));
  srv_puts (fd, head);
  srv_puts (fd, json);
}

static void
srv_chunk (int fd, const void *data, size_t len)
{
  char h[32];
  snprintf (h, sizeof h, "%zx\r\n", len);
  srv_puts (fd, h);
  srv_write (fd, data, len);
  srv_puts (fd, "\r\n");
}

/* One side tells the other that something has happened (end 0: the test,
 * end 1: the server thread); the other waits for it, bounded by WAIT_MS. */
static void
srv_note (int fd)
{
  if (write (fd, "!", 1) != 1)
    perror ("srv_note");
}

static int
srv_await (int fd)
{
  struct pollfd p = { .fd = fd, .events = POLLIN };
  char b;
  if (poll (&p, 1, WAIT_MS) <= 0 || read (fd, &b, 1) != 1)
    return -1;
  return 0;
}

/* The test has seen the client call return, so every connection the client
 * made is in the listen queue: none there means the client made no other. */
static bool
srv_no_more_accepts (srv_t *s)
{
  TAP_EQ (srv_await (s->note[1]), 0, "server check");
  int extra = srv_accept (s, 0);
  if (extra >= 0)
    close (extra);
  return extra < 0;
}

/* Wait for the client to hang up (bounded). */
static void
srv_wait_eof (int fd)
{
  char b[256];
  while (read (fd, b, sizeof b) > 0)
    ;
}

static void *
srv_main (void *arg)
{
  srv_t *s = arg;
  /* the server's checks count into s->failures: TAP lines come from main */
  tap_soft_fail_to (&s->failures);
  s->handler (s);
  return NULL;
}

static int srv_counter;

static void
srv_start (srv_t *s, void (*handler) (srv_t *), int arg)
{
  memset (s, 0, sizeof *s);
  snprintf (s->path, sizeof s->path, "%s/s%d.sock", tmpdir, srv_counter++);
  s->handler = handler;
  s->arg = arg;
  s->lfd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (socketpair (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, s->note) < 0)
    {
      perror ("socketpair");
      exit (2);
    }
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  strcpy (sa.sun_path, s->path);
  if (bind (s->lfd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen (s->lfd, 16) < 0)
    {
      perror ("fake server");
      exit (2);
    }
  pthread_create (&s->th, NULL, srv_main, s);
}

static int
srv_join (srv_t *s)
{
  pthread_join (s->th, NULL);
  close (s->note[0]);
  close (s->note[1]);
  close (s->lfd);
  unlink (s->path);
  return s->failures;
}

static warren_client_t *
client_for (srv_t *s, const char *token)
{
  char host[160];
  snprintf (host, sizeof host, "unix:%s", s->path);
  warren_error_t err;
  warren_client_t *c = warren_client_new (host, token, &err);
  if (c == NULL)
    {
      TAP_DIAG ("client_new: %s", err.message);
      exit (2);
    }
  warren_client_set_timeout (c, WAIT_MS);
  return c;
}

/* ---- scripts ---- */

static void
h_keepalive (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_OK (TAP_C_GE (fd, 0) && TAP_C_EQ (srv_read_req (fd, &r), 0), "server check");
  TAP_OK (TAP_C_EQ_STR (r.method, "GET") && TAP_C_EQ_STR (r.target, "/healthz"), "server check");
  TAP_OK (TAP_C_HAS_STR (r.headers, "Authorization: Bearer tok-123\r\n"), "server check");
  TAP_OK (strcasestr (r.headers, "Host: ") != NULL, "server check");
  free (r.body);
  srv_json (fd, 200, "{\"status\":\"ok\",\"sandboxes\":2,\"version\":\"t\"}");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.target, "/v1/sandboxes", "server check");
  free (r.body);
  srv_json (fd, 200, "{\"sandboxes\":[{\"id\":\"abc\"},{\"id\":\"def\"}]}");
  srv_wait_eof (fd);
  close (fd);
  /* A second connection would be a failed reuse. */
  TAP_OK (srv_no_more_accepts (s), "server check");
}

static void
test_keepalive (void)
{
  srv_t s;
  srv_start (&s, h_keepalive, 0);
  warren_client_t *c = client_for (&s, "tok-123");
  warren_error_t err = { 0 };
  json_t *h = warren_healthz (c, &err);
  TAP_OK (h && TAP_C_EQ_STR (json_string_value (json_object_get (h, "status")), "ok"),
          "healthz parsed");
  json_t *l = warren_sandbox_list (c, &err);
  TAP_OK (json_is_array (l) && TAP_C_EQ (json_array_size (l), 2), "sandbox list returns the array");
  json_decref (h);
  json_decref (l);
  warren_client_free (c);
  srv_note (s.note[0]);
  int f = srv_join (&s);
  TAP_EQ (f, 0, "server saw token, host and expected requests");
  TAP_EQ (s.accepts, 1, "two requests on one connection (accepts=%d)", s.accepts);
}

static void
h_errors (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.target, "/v1/sandboxes/zzz", "server check");
  free (r.body);
  srv_json (fd, 404,
            "{\"error\":{\"code\":\"not_found\",\"message\":\"sandbox zzz: no such sandbox\"}}");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  srv_puts (fd, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 11\r\n\r\nproxy\x01oops!");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_OK (TAP_C_EQ_STR (r.method, "POST") && TAP_C_EQ_STR (r.target, "/v1/sandboxes/zzz/pause"),
          "server check");
  free (r.body);
  /* Chunked error body. */
  srv_puts (fd, "HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n");
  srv_chunk (fd, "{\"error\":{\"code\":\"conf", 22);
  srv_chunk (fd, "lict\",\"message\":\"sandbox is paused\"}}", 37);
  srv_puts (fd, "0\r\n\r\n");
  srv_wait_eof (fd);
  close (fd);
}

static void
test_errors (void)
{
  srv_t s;
  srv_start (&s, h_errors, 0);
  warren_client_t *c = client_for (&s, NULL);
  warren_error_t err = { 0 };
  json_t *j = warren_sandbox_get (c, "zzz", &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "not_found") && TAP_C_EQ (err.status, 404)
              && TAP_C_EQ_STR (err.message, "sandbox zzz: no such sandbox"),
          "error JSON maps to code/status/message (%s %d %s)", err.code, err.status, err.message);
  memset (&err, 0, sizeof err);
  j = warren_sandbox_get (c, "zzz", &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "internal") && TAP_C_EQ (err.status, 502)
              && TAP_C_HAS_STR (err.message, "HTTP 502")
              && TAP_C_HAS_STR (err.message, "proxy oops!"),
          "non-JSON error keeps status and a sanitized snippet (%s)", err.message);
  memset (&err, 0, sizeof err);
  j = warren_sandbox_pause (c, "zzz", &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "conflict") && TAP_C_EQ (err.status, 409)
              && TAP_C_EQ_STR (err.message, "sandbox is paused"),
          "chunked error body parsed (%s)", err.message);
  warren_client_free (c);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 1),
          "errors keep the connection (accepts=%d)", s.accepts);
}

static void
h_split (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.target, "/v1/sandboxes/abc-1", "server check");
  free (r.body);
  const char *parts[] = { "HTTP/1.1 2",           "00 OK\r\nConte", "nt-Length: 34\r", "\n\r",
                          "\n{\"id\":\"abc-1\",", "\"state\":\"r",  "unning\"}  " };
  for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
    {
      srv_puts (fd, parts[i]);
      usleep (20000);
    }
  srv_wait_eof (fd);
  close (fd);
}

static void
test_split (void)
{
  srv_t s;
  srv_start (&s, h_split, 0);
  warren_client_t *c = client_for (&s, NULL);
  warren_error_t err = { 0 };
  json_t *j = warren_sandbox_get (c, "abc-1", &err);
  TAP_OK (j && TAP_C_EQ_STR (json_string_value (json_object_get (j, "state")), "running"),
          "Content-Length response split over many writes (%s)", j ? "" : err.message);
  json_decref (j);
  warren_client_free (c);
  TAP_EQ (srv_join (&s), 0, "split: server checks");
}

static void
h_stream (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.method, "POST", "server check");
  TAP_EQ (strncmp (r.target, "/v1/sandboxes/abc/exec", 22), 0, "server check");
  json_t *b = json_loads (r.body ? r.body : "", 0, NULL);
  TAP_OK (json_is_true (json_object_get (b, "stream")), "server check");
  TAP_EQ (json_array_size (json_object_get (b, "cmd")), 2, "server check");
  TAP_EQ_STR (json_string_value (json_object_get (b, "stdin")) ?: "", "AP8=", "server check");
  TAP_EQ_STR (json_string_value (json_object_get (b, "stdin_encoding")) ?: "", "base64",
              "server check");
  json_decref (b);
  free (r.body);
  srv_puts (fd, "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                "Transfer-Encoding: chunked\r\n\r\n");
  const char *l1 = "{\"stream\":\"stdout\",\"data\":\"1\\n\"}\n{\"stream\":\"std";
  srv_chunk (fd, l1, strlen (l1));
  usleep (20000);
  const char *l2 = "err\",\"data\":\"AP8K\",\"data_encoding\":\"base64\"}\n";
  char ext[32];
  snprintf (ext, sizeof ext, "%zx;ext=1\r\n", strlen (l2)); /* extensions are ignored */
  srv_puts (fd, ext);
  srv_write (fd, l2, strlen (l2));
  srv_puts (fd, "\r\n");
  const char *l3 = "{\"stream\":\"stdout\",\"data\":\"2\\n\"}\n{\"exit_code\":3,\"signal\":0,"
                   "\"timed_out\":false,\"duration_ms\":5}\n";
  srv_chunk (fd, l3, strlen (l3));
  srv_puts (fd, "0\r\nX-Trailer: 1\r\n\r\n");
  /* The connection stays usable after a fully read stream. */
  if (srv_read_req (fd, &r) == 0)
    {
      free (r.body);
      srv_json (fd, 200, "{\"status\":\"ok\"}");
    }
  else
    TAP_OK (0, "second request on the stream connection");
  srv_wait_eof (fd);
  close (fd);
}

struct outbuf
{
  char out[256], errb[256];
  size_t olen, elen;
  int calls;
};

static int
collect (void *ud, int stream, const void *data, size_t len)
{
  struct outbuf *o = ud;
  o->calls++;
  if (stream == WARREN_STDOUT && o->olen + len <= sizeof o->out)
    memcpy (o->out + o->olen, data, len), o->olen += len;
  else if (stream == WARREN_STDERR && o->elen + len <= sizeof o->errb)
    memcpy (o->errb + o->elen, data, len), o->elen += len;
  return 0;
}

static void
test_stream (void)
{
  srv_t s;
  srv_start (&s, h_stream, 0);
  warren_client_t *c = client_for (&s, NULL);
  warren_error_t err = { 0 };
  json_t *req = json_pack ("{s:[s,s]}", "cmd", "echo", "hi");
  static const char in[] = { 0x00, (char)0xff };
  TAP_EQ (warren_json_set_bytes (req, "stdin", in, 2, &err), 0, "binary stdin set as base64");
  struct outbuf o = { 0 };
  json_t *res = warren_exec_stream (c, "abc", req, collect, &o, &err);
  TAP_OK (res != NULL, "stream exec returns a result (%s)", res ? "" : err.message);
  TAP_OK (TAP_C_EQ (o.olen, 4) && TAP_C_EQ_MEM (o.out, 4, "1\n2\n", 4),
          "stdout chunks delivered in order");
  TAP_OK (TAP_C_EQ (o.elen, 3) && TAP_C_EQ_MEM (o.errb, 3, "\x00\xff\n", 3),
          "base64 stderr chunk decoded");
  TAP_OK (res && TAP_C_EQ (warren_result_status (res), 3), "exit status from the final result");
  json_t *h = warren_healthz (c, &err);
  TAP_OK (h != NULL, "connection reused after the stream");
  json_decref (h);
  json_decref (res);
  json_decref (req);
  warren_client_free (c);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 1),
          "stream: server checks (accepts=%d)", s.accepts);
}

/* arg selects how the response dies. */
static void
h_early_close (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  if (s->arg == 0)
    srv_puts (fd, "HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{\"partial");
  else if (s->arg == 1)
    srv_puts (fd, "HTTP/1.1 201 Created\r\nContent-Le");
  else if (s->arg == 2)
    srv_puts (fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nabc");
  close (fd);
  TAP_OK (srv_no_more_accepts (s), "server check"); /* POST must not be retried */
}

static void
test_early_close (void)
{
  for (int mode = 0; mode < 4; mode++)
    {
      srv_t s;
      srv_start (&s, h_early_close, mode);
      warren_client_t *c = client_for (&s, NULL);
      warren_error_t err = { 0 };
      uint64_t t0 = now_ms ();
      json_t *j = warren_sandbox_create (c, NULL, &err);
      uint64_t dt = now_ms () - t0;
      /* not the client's timeout: a clear error, long before WAIT_MS */
      /* mode 3 answers nothing: the request was lost, not garbled */
      const char *want = mode == 3 ? WARREN_E_CONNECTION_LOST : "protocol_error";
      TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, want) && TAP_C_HAS_STR (err.message, "closed")
                  && TAP_C_LT (dt, WAIT_MS / 2),
              "early close mode %d: clear error in %llu ms (%s)", mode, (unsigned long long)dt,
              err.message);
      warren_client_free (c);
      srv_note (s.note[0]);
      TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 1),
              "early close mode %d: no retry of POST", mode);
    }
}

/* Connection 1 answers one request, then drops the next one unanswered. */
static void
h_stale (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  srv_json (fd, 200, "{\"status\":\"ok\"}");
  if (s->arg == 2)
    {
      close (fd); /* idle close, noticed before the next request is sent */
      srv_note (s->note[1]);
    }
  else
    {
      TAP_EQ (srv_read_req (fd, &r), 0, "server check");
      free (r.body);
      close (fd);
    }
  if (s->arg == 1)
    {
      TAP_OK (srv_no_more_accepts (s), "server check");
      return;
    }
  int fd2 = srv_accept (s, WAIT_MS);
  TAP_OK (TAP_C_GE (fd2, 0) && TAP_C_EQ (srv_read_req (fd2, &r), 0), "server check");
  free (r.body);
  srv_json (fd2, s->arg == 2 ? 201 : 200, "{\"status\":\"ok\",\"id\":\"x\"}");
  srv_wait_eof (fd2);
  close (fd2);
}

static void
test_stale (void)
{
  srv_t s;
  warren_error_t err = { 0 };
  srv_start (&s, h_stale, 0);
  warren_client_t *c = client_for (&s, NULL);
  json_t *a = warren_healthz (c, &err);
  json_t *b = warren_healthz (c, &err);
  TAP_OK (a && b, "GET retried on a new connection after the old one died (%s)",
          b ? "" : err.message);
  json_decref (a);
  json_decref (b);
  warren_client_free (c);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 2), "GET retry: accepts=%d",
          s.accepts);

  srv_start (&s, h_stale, 1);
  c = client_for (&s, NULL);
  a = warren_healthz (c, &err);
  memset (&err, 0, sizeof err);
  b = warren_sandbox_create (c, NULL, &err);
  TAP_OK (a && b == NULL && err.code[0], "POST on a connection that dies is not retried (%s)",
          err.message);
  json_decref (a);
  warren_client_free (c);
  srv_note (s.note[0]);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 1), "POST no retry: accepts=%d",
          s.accepts);

  srv_start (&s, h_stale, 2);
  c = client_for (&s, NULL);
  a = warren_healthz (c, &err);
  TAP_EQ (srv_await (s.note[0]), 0, "the server closed the idle connection");
  b = warren_sandbox_create (c, NULL, &err);
  TAP_OK (a && b, "idle-closed connection replaced before a POST (%s)", b ? "" : err.message);
  json_decref (a);
  json_decref (b);
  warren_client_free (c);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 2), "idle close: accepts=%d",
          s.accepts);
}

static void
h_oversize (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  if (s->arg == 0)
    {
      srv_puts (fd, "HTTP/1.1 200 OK\r\nX-Big: ");
      char big[4096];
      memset (big, 'a', sizeof big);
      for (int i = 0; i < 40; i++)
        srv_write (fd, big, sizeof big);
      srv_puts (fd, "\r\n\r\n{}");
    }
  else
    {
      srv_puts (fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
      char big[4096];
      memset (big, 'f', sizeof big);
      srv_write (fd, big, sizeof big);
    }
  srv_wait_eof (fd);
  close (fd);
}

static void
test_oversize (void)
{
  for (int mode = 0; mode < 2; mode++)
    {
      srv_t s;
      srv_start (&s, h_oversize, mode);
      warren_client_t *c = client_for (&s, NULL);
      warren_error_t err = { 0 };
      json_t *j = warren_healthz (c, &err);
      TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "protocol_error"), "oversize %s rejected (%s)",
              mode ? "chunk size line" : "headers", err.message);
      warren_client_free (c);
      TAP_EQ (srv_join (&s), 0, "oversize: server checks");
    }
}

static void
h_silent (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  if (s->arg == 1)
    {
      srv_puts (fd, "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n");
      const char *l = "{\"stream\":\"stdout\",\"data\":\"x\"}\n";
      srv_chunk (fd, l, strlen (l));
    }
  srv_wait_eof (fd); /* never answers */
  close (fd);
}

static volatile sig_atomic_t cancel_flag;
static atomic_int got_output;

static int
collect_note (void *ud, int stream, const void *data, size_t len)
{
  int r = collect (ud, stream, data, len);
  atomic_store (&got_output, 1);
  return r;
}

/* Cancel once the stream is surely under way: its first chunk has arrived. */
static void *
raise_cancel (void *arg)
{
  for (int i = 0; i < WAIT_MS && !atomic_load (&got_output); i++)
    usleep (1000);
  cancel_flag = 1;
  return NULL;
}

static void
test_timeout_cancel (void)
{
  srv_t s;
  srv_start (&s, h_silent, 0);
  warren_client_t *c = client_for (&s, NULL);
  warren_client_set_timeout (c, 300);
  warren_error_t err = { 0 };
  uint64_t t0 = now_ms ();
  json_t *j = warren_healthz (c, &err);
  uint64_t dt = now_ms () - t0;
  /* never early; late only by scheduling (a hang would take WAIT_MS) */
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "timeout") && TAP_C_GE (dt, 250)
              && TAP_C_LT (dt, WAIT_MS / 2),
          "silent daemon times out after %llu ms (%s)", (unsigned long long)dt, err.message);
  warren_client_free (c);
  TAP_EQ (srv_join (&s), 0, "timeout: server checks");

  srv_start (&s, h_silent, 1);
  c = client_for (&s, NULL);
  warren_client_set_cancel_flag (c, &cancel_flag);
  pthread_t th;
  pthread_create (&th, NULL, raise_cancel, NULL);
  json_t *req = json_pack ("{s:s}", "shell", "sleep 100");
  struct outbuf o = { 0 };
  t0 = now_ms ();
  j = warren_exec_stream (c, "abc", req, collect_note, &o, &err);
  dt = now_ms () - t0;
  pthread_join (th, NULL);
  /* not ended by the client's own WAIT_MS timeout, nor by the server */
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "cancelled") && TAP_C_EQ (o.olen, 1)
              && TAP_C_LT (dt, WAIT_MS / 2),
          "cancel flag stops a streaming exec in %llu ms (%s)", (unsigned long long)dt,
          err.message);
  json_decref (req);
  warren_client_free (c);
  TAP_EQ (srv_join (&s), 0, "cancel: server checks");
}

#define BIG (200 * 1024 + 7)

static void
h_files (srv_t *s)
{
  int fd = srv_accept (s, WAIT_MS);
  req_t r;
  /* 1: buffer upload with mode. */
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.method, "PUT", "server check");
  TAP_EQ_STR (r.target, "/v1/sandboxes/abc/files?path=%2Fdir%2Fa%20b%26c&mode=0644",
              "server check");
  TAP_EQ (r.body_len, 256, "server check");
  for (size_t i = 0; i < r.body_len && i < 256; i++)
    TAP_EQ ((unsigned char)r.body[i], i, "server check");
  free (r.body);
  srv_json (fd, 201, "{\"path\":\"/dir/a b&c\",\"size\":256}");
  /* 2: regular-file upload, streamed. */
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ (r.body_len, BIG, "server check");
  if (r.body_len != BIG)
    TAP_DIAG ("got %zu bytes, target %s headers %s", r.body_len, r.target, r.headers);
  for (size_t i = 0; i < r.body_len; i++)
    if ((unsigned char)r.body[i] != (unsigned char)(i * 7))
      {
        TAP_OK (0, "file upload bytes differ");
        break;
      }
  free (r.body);
  srv_json (fd, 201, "{}");
  /* 3: pipe upload (spooled). */
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_OK (TAP_C_EQ (r.body_len, 5) && TAP_C_EQ_MEM (r.body, 5, "pi\0pe", 5), "server check");
  TAP_OK (TAP_C_HAS_STR (r.target, "&append=1"), "server check");
  free (r.body);
  srv_json (fd, 201, "{}");
  /* 4: download, chunked, all byte values. */
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.method, "GET", "server check");
  free (r.body);
  srv_puts (fd, "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                "Transfer-Encoding: chunked\r\n\r\n");
  unsigned char *big = malloc (BIG);
  for (size_t i = 0; i < BIG; i++)
    big[i] = (unsigned char)(i * 7);
  for (size_t off = 0; off < BIG; off += 10000)
    srv_chunk (fd, big + off, BIG - off < 10000 ? BIG - off : 10000);
  srv_puts (fd, "0\r\n\r\n");
  /* 5: download into a buffer over its max. */
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  free (r.body);
  char head[128];
  snprintf (head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", BIG);
  srv_puts (fd, head);
  srv_write (fd, big, BIG);
  free (big);
  /* 6: stat / list / mkdir / remove targets. */
  int fd2 = srv_accept (s, WAIT_MS); /* the client dropped fd after the refused download */
  close (fd);
  fd = fd2;
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.target, "/v1/sandboxes/abc/files?path=%2Fw&op=list", "server check");
  free (r.body);
  srv_json (fd, 200, "{\"entries\":[{\"name\":\"a\",\"type\":\"file\"}]}");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_OK (TAP_C_EQ_STR (r.method, "POST")
              && strcmp (r.target, "/v1/sandboxes/abc/files?path=%2Fw%2Fd&op=mkdir&parents=1") == 0,
          "server check");
  free (r.body);
  srv_json (fd, 201, "{}");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_OK (TAP_C_EQ_STR (r.method, "DELETE")
              && strcmp (r.target, "/v1/sandboxes/abc/files?path=%2Fw&recursive=1") == 0,
          "server check");
  free (r.body);
  srv_puts (fd, "HTTP/1.1 204 No Content\r\n\r\n");
  TAP_EQ (srv_read_req (fd, &r), 0, "server check");
  TAP_EQ_STR (r.target, "/v1/images/busybox%3Alatest", "server check");
  free (r.body);
  srv_puts (fd, "HTTP/1.1 204 No Content\r\n\r\n");
  srv_wait_eof (fd);
  close (fd);
}

static void
test_files (void)
{
  srv_t s;
  srv_start (&s, h_files, 0);
  warren_client_t *c = client_for (&s, NULL);
  warren_error_t err = { 0 };
  unsigned char buf[256];
  for (int i = 0; i < 256; i++)
    buf[i] = (unsigned char)i;
  TAP_EQ (warren_file_put (c, "abc", "/dir/a b&c", buf, 256, 0644, 0, &err), 0,
          "binary buffer upload with mode and encoded path (%s)", err.message);

  char fpath[128];
  snprintf (fpath, sizeof fpath, "%s/up.bin", tmpdir);
  int f = open (fpath, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  unsigned char *big = malloc (BIG);
  for (size_t i = 0; i < BIG; i++)
    big[i] = (unsigned char)(i * 7);
  TAP_OK (TAP_C_EQ (write (f, big, BIG), BIG) && TAP_C_EQ (lseek (f, 0, SEEK_SET), 0),
          "temp file written");
  TAP_EQ (warren_file_put_fd (c, "abc", "/big", f, -1, 0, &err), 0, "regular file streamed (%s)",
          err.message);
  close (f);

  int p[2];
  TAP_OK (TAP_C_EQ (pipe (p), 0) && TAP_C_EQ (write (p[1], "pi\0pe", 5), 5), "pipe");
  close (p[1]);
  TAP_EQ (warren_file_put_fd (c, "abc", "/p", p[0], -1, WARREN_PUT_APPEND, &err), 0,
          "pipe upload spooled (%s)", err.message);
  close (p[0]);

  snprintf (fpath, sizeof fpath, "%s/down.bin", tmpdir);
  f = open (fpath, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  uint64_t got = 0;
  TAP_OK (TAP_C_EQ (warren_file_get_fd (c, "abc", "/big", f, &got, &err), 0) && TAP_C_EQ (got, BIG),
          "chunked download to fd (%llu bytes)", (unsigned long long)got);
  unsigned char *back = malloc (BIG);
  TAP_OK (TAP_C_EQ (pread (f, back, BIG, 0), BIG) && TAP_C_EQ_MEM (back, BIG, big, BIG),
          "downloaded bytes identical");
  close (f);
  free (back);
  free (big);

  void *data = NULL;
  size_t dlen = 0;
  memset (&err, 0, sizeof err);
  TAP_OK (TAP_C_LT (warren_file_get (c, "abc", "/big", &data, &dlen, 1000, &err), 0)
              && TAP_C_EQ_STR (err.code, "payload_too_large"),
          "download over max refused (%s)", err.message);

  json_t *l = warren_file_list (c, "abc", "/w", &err);
  TAP_EQ (json_array_size (l), 1, "list returns entries");
  json_decref (l);
  TAP_EQ (warren_file_mkdir (c, "abc", "/w/d", true, &err), 0, "mkdir -p");
  TAP_EQ (warren_file_remove (c, "abc", "/w", true, &err), 0, "recursive remove (204)");
  TAP_EQ (warren_image_rm (c, "busybox:latest", &err), 0, "image rm encodes the ref");
  warren_client_free (c);
  TAP_OK (TAP_C_EQ (srv_join (&s), 0) && TAP_C_EQ (s.accepts, 2),
          "files: server checks (accepts=%d)", s.accepts);
}

static void
test_base64 (void)
{
  static const char *vec[][2] = { { "", "" },
                                  { "f", "Zg==" },
                                  { "fo", "Zm8=" },
                                  { "foo", "Zm9v" },
                                  { "foob", "Zm9vYg==" },
                                  { "fooba", "Zm9vYmE=" },
                                  { "foobar", "Zm9vYmFy" } };
  int ok = 1;
  for (size_t i = 0; i < sizeof vec / sizeof vec[0]; i++)
    {
      size_t n;
      char *e = warren_base64_encode (vec[i][0], strlen (vec[i][0]), &n);
      ok &= e && strcmp (e, vec[i][1]) == 0 && n == strlen (vec[i][1]);
      free (e);
    }
  TAP_OK (ok, "RFC 4648 test vectors");
  unsigned char src[300];
  for (size_t i = 0; i < sizeof src; i++)
    src[i] = (unsigned char)(255 - i * 13);
  ok = 1;
  for (size_t len = 0; len <= sizeof src; len++)
    {
      size_t n, dn = 0;
      char *e = warren_base64_encode (src, len, &n);
      void *d = NULL;
      ok &= e && n == (len + 2) / 3 * 4;
      ok &= warren_base64_decode (e, n, &d, &dn) == 0 && dn == len && memcmp (d, src, len) == 0;
      free (e);
      free (d);
    }
  TAP_OK (ok, "round trips for lengths 0..300");
  const char *bad[] = { "abc", "a===", "@@@@", "Zg=a", "Zm9v\n" };
  ok = 1;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    {
      void *d = NULL;
      size_t dn;
      ok &= warren_base64_decode (bad[i], strlen (bad[i]), &d, &dn) == -EINVAL;
    }
  TAP_OK (ok, "malformed base64 rejected");
}

static void
test_local (void)
{
  /* the daemon's id rule (wr_id_valid), checked locally */
  char id[70];
  memset (id, 'a', sizeof id);
  id[64] = '\0';
  TAP_OK (warren_id_valid (id) && warren_id_valid ("0a-b9"), "ids of 1..64 [a-z0-9-] pass");
  id[64] = 'a';
  id[65] = '\0';
  TAP_OK (!warren_id_valid (id) && !warren_id_valid ("") && !warren_id_valid (NULL)
              && !warren_id_valid ("aB") && !warren_id_valid ("a/b") && !warren_id_valid ("a_b"),
          "longer ids and other characters are refused");
  warren_error_t err = { 0 };
  unsetenv ("WARREN_HOST");
  setenv ("WARREN_ROOT", "/tmp/wr-root", 1);
  warren_client_t *c = warren_client_new (NULL, NULL, &err);
  TAP_OK (c && TAP_C_EQ_STR (warren_client_host (c), "unix:/tmp/wr-root/warrend.sock"),
          "default host from WARREN_ROOT");
  warren_client_free (c);
  unsetenv ("WARREN_ROOT");
  c = warren_client_new (NULL, NULL, &err);
  TAP_OK (c && TAP_C_EQ_STR (warren_client_host (c), "unix:/var/lib/warren/warrend.sock"),
          "default host");
  warren_client_free (c);
  setenv ("WARREN_HOST", "http://[::1]:7070", 1);
  c = warren_client_new (NULL, NULL, &err);
  TAP_OK (c && TAP_C_EQ_STR (warren_client_host (c), "http://[::1]:7070"), "WARREN_HOST, ipv6");
  warren_client_free (c);
  unsetenv ("WARREN_HOST");
  c = warren_client_new ("ftp://x", NULL, &err);
  TAP_OK (c == NULL && TAP_C_EQ_STR (err.code, "invalid_argument"), "bad scheme rejected");
  c = warren_client_new ("http://h:99999", NULL, &err);
  TAP_OK (c == NULL, "bad port rejected");

  char host[160];
  snprintf (host, sizeof host, "unix:%s/nope.sock", tmpdir);
  c = warren_client_new (host, NULL, &err);
  memset (&err, 0, sizeof err);
  json_t *j = warren_sandbox_get (c, "../images", &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "invalid_argument"), "bad id rejected locally");
  j = warren_sandbox_get (c, "ABC", &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "invalid_argument"), "uppercase id rejected");
  memset (&err, 0, sizeof err);
  j = warren_healthz (c, &err);
  TAP_OK (j == NULL && TAP_C_EQ_STR (err.code, "connect_failed")
              && TAP_C_HAS_STR (err.message, "No such file or directory (is warrend running?)")
              && TAP_C_HAS_STR (err.message, "cannot connect to unix:"),
          "no daemon: %s", err.message);
  warren_client_free (c);

  json_t *r = json_pack ("{s:i,s:i,s:b}", "exit_code", -1, "signal", 9, "timed_out", 0);
  TAP_EQ (warren_result_status (r), 137, "killed by signal 9 -> 137");
  json_object_set_new (r, "timed_out", json_true ());
  TAP_EQ (warren_result_status (r), 124, "timed out -> 124");
  json_object_set_new (r, "stdout", json_string ("aGk="));
  json_object_set_new (r, "stdout_encoding", json_string ("base64"));
  void *d = NULL;
  size_t dn = 0;
  TAP_OK (TAP_C_EQ (warren_result_bytes (r, "stdout", &d, &dn, &err), 0) && TAP_C_EQ (dn, 2)
              && TAP_C_EQ_MEM (d, 2, "hi", 2),
          "result bytes decoded");
  free (d);
  TAP_OK (TAP_C_EQ (warren_json_set_bytes (r, "stdin", "plain", 5, &err), 0)
              && TAP_C_EQ_STR (json_string_value (json_object_get (r, "stdin")), "plain")
              && json_object_get (r, "stdin_encoding") == NULL,
          "UTF-8 stdin travels as text");
  TAP_OK (TAP_C_EQ (warren_json_set_bytes (r, "stdin", "\xc3\x28", 2, &err), 0)
              && TAP_C_EQ_STR (json_string_value (json_object_get (r, "stdin_encoding")), "base64"),
          "invalid UTF-8 stdin travels as base64");
  json_decref (r);
}

/* ---- the shared library's ABI ---- */

/* path = the build directory (where bin/ and lib/ are: this binary is
 * B/tests/test_client) joined with rel; false when it cannot be found. */
static bool
build_path (const char *rel, char *path, size_t size)
{
  char self[PATH_MAX];
  ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 1);
  char *slash = n > 0 ? (self[n] = '\0', strrchr (self, '/')) : NULL;
  if (slash == NULL
      || (size_t)snprintf (path, size, "%.*s/../%s", (int)(slash - self), self, rel) >= size)
    {
      TAP_OK (0, "find the build directory");
      return false;
    }
  return true;
}

/* libwarren.so exports what warren.h marks WARREN_EXPORT and nothing else:
 * every defined dynamic symbol is a warren_* function (the wl_* internals
 * and the wr_* common code it links are hidden). Reads .dynsym of the
 * library next to this binary (B/tests/test_client -> B/lib/libwarren.so). */
static void
test_exports (void)
{
  char path[PATH_MAX];
  if (!build_path ("lib/libwarren.so", path, sizeof path))
    return;
  int fd = open (path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat (fd, &st) < 0 || (size_t)st.st_size < sizeof (Elf64_Ehdr))
    {
      TAP_OK (0, "open %s", path);
      if (fd >= 0)
        close (fd);
      return;
    }
  const uint8_t *m = mmap (NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close (fd);
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)m;
  if (m == MAP_FAILED || memcmp (eh->e_ident, ELFMAG, SELFMAG) != 0
      || eh->e_ident[EI_CLASS] != ELFCLASS64)
    {
      TAP_OK (0, "%s is a 64-bit ELF file", path);
      return;
    }
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(m + eh->e_shoff);
  unsigned exported = 0, foreign = 0;
  bool client_new = false;
  for (unsigned i = 0; i < eh->e_shnum; i++)
    {
      if (sh[i].sh_type != SHT_DYNSYM)
        continue;
      const Elf64_Sym *sym = (const Elf64_Sym *)(m + sh[i].sh_offset);
      const char *names = (const char *)(m + sh[sh[i].sh_link].sh_offset);
      for (size_t k = 0; k < sh[i].sh_size / sizeof *sym; k++)
        {
          int bind = ELF64_ST_BIND (sym[k].st_info);
          if (sym[k].st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK))
            continue;
          const char *name = names + sym[k].st_name;
          exported++;
          client_new |= strcmp (name, "warren_client_new") == 0;
          if (strncmp (name, "warren_", 7) != 0)
            {
              foreign++;
              TAP_DIAG ("  exported but not public: %s", name);
            }
        }
    }
  munmap ((void *)m, (size_t)st.st_size);
  TAP_OK (TAP_C_GT (exported, 0) && client_new, "libwarren.so exports its API (%u symbols)",
          exported);
  TAP_EQ (foreign, 0, "libwarren.so exports nothing outside warren.h (%u others)", foreign);
}

/* One version string (include/warren/version.h): the library, `warren
 * --version` and `warrend --version` all print it. */
static void
test_version (void)
{
  TAP_EQ_STR (warren_version (), WARREN_VERSION, "warren_version () is WARREN_VERSION");
  static const char *const bins[] = { "warren", "warrend" };
  for (size_t i = 0; i < sizeof bins / sizeof bins[0]; i++)
    {
      char rel[64], cmd[PATH_MAX + 32], want[64], got[128] = "";
      snprintf (rel, sizeof rel, "bin/%s", bins[i]);
      if (!build_path (rel, cmd, PATH_MAX))
        return;
      strcat (cmd, " --version 2>&1");
      snprintf (want, sizeof want, "%s %s\n", bins[i], WARREN_VERSION);
      FILE *f = popen (cmd, "r");
      if (f && fgets (got, sizeof got, f) == NULL)
        got[0] = '\0';
      int rc = f ? pclose (f) : -1;
      TAP_OK (TAP_C_EQ (rc, 0) && TAP_C_EQ_STR (got, want),
              "%s --version prints \"%.*s\" (got \"%.*s\")", bins[i], (int)strlen (want) - 1, want,
              (int)strcspn (got, "\n"), got);
    }
}

int
main (void)
{
  alarm (240); /* a hang backstop above any single WAIT_MS wait */
  if (tap_mkdtemp (tmpdir, sizeof tmpdir, "warren-test-client") == NULL)
    {
      perror ("mkdtemp");
      return 2;
    }
  test_base64 ();
  test_local ();
  test_keepalive ();
  test_errors ();
  test_split ();
  test_stream ();
  test_early_close ();
  test_stale ();
  test_oversize ();
  test_timeout_cancel ();
  test_files ();
  test_exports ();
  test_version ();
  char cmd[128];
  snprintf (cmd, sizeof cmd, "rm -rf %s", tmpdir);
  if (system (cmd) != 0)
    TAP_DIAG ("could not remove %s", tmpdir);
  return TAP_DONE ();
}

/* The daemon's HTTP front (src/daemon/http.c): raw bytes from a client go
 * through the real listeners wrd_http_listen makes (the unix socket, and
 * the hardened TCP listener of src/common/httpd.c on a loopback port, whose
 * header-stage token check admits or refuses the connection first), then
 * evhttp's request parser into route(): token check (TCP mode),
 * query strings, JSON bodies, sandbox ids, create and pool validation. What
 * would act on the host (building sandboxes, images, fncall pools, pack) is
 * replaced by stubs that validate and refuse. The first byte picks TCP mode
 * (bit 0) or, with bit 1, feeds the rest as JSON to the exec validator. */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);
int LLVMFuzzerInitialize (int *argc, char ***argv);

#define wrd_sandbox_create_async fuzz_create_async
#define wrd_sandbox_find fuzz_sandbox_find
#define wrd_pool_set fuzz_pool_set
#define wrd_http_images fuzz_http_images
#define wrd_http_pack fuzz_http_pack
#define wrd_fncall_http_calls fuzz_fncall_calls
#define wrd_fncall_http_pools fuzz_fncall_pools
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#include "daemon/http.c"
#pragma clang diagnostic pop

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <netinet/in.h>

#include "harness.h"

int
fuzz_create_async (struct wrd *d, json_t *req, wrd_create_cb cb, void *ud, wr_err_t *err)
{
  json_t *spec = NULL;
  int r = wrd_parse_create (d, req, &spec, err);
  if (r < 0)
    return r;
  json_decref (spec);
  return wr_error (err, 0, WR_E_UNAVAILABLE, "fuzz: no sandboxes here");
}

struct sandbox *
fuzz_sandbox_find (struct wrd *d, const char *id)
{
  return NULL;
}

int
fuzz_pool_set (struct wrd *d, const char *image, unsigned size, wr_err_t *err)
{
  return wr_error (err, 0, WR_E_UNAVAILABLE, "fuzz: no pools here");
}

void
fuzz_http_images (struct wrd *d, struct evhttp_request *req, const char *rest, struct evkeyvalq *q)
{
  json_t *body;
  wr_err_t err;
  if (wrd_read_json_body (req, false, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_decref (body);
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "fuzz: no images here");
}

void
fuzz_http_pack (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "fuzz: no pack here");
}

void
fuzz_fncall_calls (struct wrd *d, struct evhttp_request *req)
{
  fuzz_http_images (d, req, NULL, NULL);
}

void
fuzz_fncall_pools (struct wrd *d, struct evhttp_request *req)
{
  fuzz_http_images (d, req, NULL, NULL);
}

static struct wrd d;
static char sock_path[108];
static int tcp_port;

static void
cleanup (void)
{
  wrd_http_free (&d);
  unlink (sock_path);
}

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
  signal (SIGPIPE, SIG_IGN);
  fuzz_private_netns ();
  d.base = event_base_new ();
  snprintf (d.default_image, sizeof d.default_image, "busybox:latest");
  snprintf (d.token, sizeof d.token, "fuzz-token-0123456789");
  snprintf (d.node, sizeof d.node, "f022");
  snprintf (sock_path, sizeof sock_path, "/tmp/warren-fuzz-http-%d.sock", (int)getpid ());
  char spec[160];
  snprintf (spec, sizeof spec, "unix:%s", sock_path);
  wr_err_t err;
  if (wrd_http_listen (&d, spec, &err) < 0 || wrd_http_listen (&d, "tcp:127.0.0.1:0", &err) < 0)
    {
      fprintf (stderr, "fuzz_http: %s\n", err.msg);
      abort ();
    }
  tcp_port = wr_httpd_port (d.tcp);
  atexit (cleanup);
  return 0;
}

/* Connect fd (non-blocking) to sa. A loopback connect usually completes
 * inside the call, but when the kernel defers the handshake to ksoftirqd
 * (a loaded machine) it waits, and libFuzzer's SIGALRM (its -timeout
 * check, every second) interrupted a blocking connect with EINTR: CI
 * aborted here once in ~200K runs. So the connect never blocks: TCP's
 * EINPROGRESS is waited for with poll, a full unix backlog (EAGAIN) is
 * drained by turning the daemon's loop, which is what accepts. */
static void
connect_nb (int fd, const struct sockaddr *sa, socklen_t len)
{
  fcntl (fd, F_SETFL, O_NONBLOCK);
  for (int tries = 0; tries < 10000; tries++)
    {
      if (connect (fd, sa, len) == 0 || errno == EISCONN)
        return;
      if (errno == EAGAIN || errno == EINTR)
        {
          event_base_loop (d.base, EVLOOP_NONBLOCK); /* let the listener accept */
          continue;
        }
      if (errno == EINPROGRESS || errno == EALREADY)
        {
          struct pollfd p = { .fd = fd, .events = POLLOUT };
          int e = 0;
          socklen_t el = sizeof e;
          if (poll (&p, 1, 100) < 0 && errno != EINTR)
            break;
          if (p.revents == 0)
            continue; /* not yet: connect again reports EALREADY or EISCONN */
          if (getsockopt (fd, SOL_SOCKET, SO_ERROR, &e, &el) == 0 && e == 0)
            return;
          errno = e;
        }
      break;
    }
  fprintf (stderr, "fuzz_http: connect: %m\n");
  abort ();
}

/* A connected, non-blocking socket to one of the listeners. */
static int
connect_to (bool tcp)
{
  int fd;
  if (tcp)
    {
      struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)tcp_port) };
      sa.sin_addr.s_addr = htonl (INADDR_LOOPBACK);
      fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      /* each connection from its own 127/8 source address: the listener
       * closes first and keeps the 4-tuple in TIME_WAIT for a minute, so
       * one source address runs out of ports after ~28K connections (a
       * 15 s run makes ~200K) */
      static uint32_t next_src;
      struct sockaddr_in src = { .sin_family = AF_INET };
      src.sin_addr.s_addr = htonl (0x7f000000u | (1 + next_src++ % 0xfffffdu));
      if (fd < 0 || bind (fd, (struct sockaddr *)&src, sizeof src) < 0)
        {
          fprintf (stderr, "fuzz_http: socket/bind: %m\n");
          abort ();
        }
      /* the client closes first: no TIME_WAIT left on the fuzzer's ports */
      struct linger lg = { 1, 0 };
      setsockopt (fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
      connect_nb (fd, (struct sockaddr *)&sa, sizeof sa);
    }
  else
    {
      struct sockaddr_un sa = { .sun_family = AF_UNIX };
      snprintf (sa.sun_path, sizeof sa.sun_path, "%s", sock_path);
      fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0)
        abort ();
      connect_nb (fd, (struct sockaddr *)&sa, sizeof sa);
    }
  return fd;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (size < 1)
    return 0;
  if (data[0] & 2)
    {
      /* the exec request validator, on its own: no sandbox is ever found */
      json_t *img_conf = json_pack ("{s:[s,s],s:s}", "env", "PATH=/bin", "A=1", "workdir", "/w");
      json_t *spec = json_pack ("{s:{s:s}}", "env", "B", "2");
      struct sandbox sb = { .img_conf = img_conf, .spec = spec };
      json_t *req = json_loadb ((const char *)data + 1, size - 1, JSON_REJECT_DUPLICATES, NULL);
      json_t *body = NULL;
      char *in = NULL;
      size_t in_len = 0;
      wr_err_t err;
      if (json_is_object (req) && parse_exec (&sb, req, &body, &in, &in_len, &err) == 0)
        {
          free (json_dumps (body, JSON_COMPACT));
          json_decref (body);
          free (in);
        }
      json_decref (req);
      json_decref (img_conf);
      json_decref (spec);
      return 0;
    }
  int fd = connect_to (data[0] & 1);
  size_t off = 1;
  bool eof = false;
  char buf[65536];
  for (int spins = 0; spins < 2000 && !eof; spins++)
    {
      if (off < size)
        {
          ssize_t n = send (fd, data + off, size - off, MSG_NOSIGNAL);
          if (n > 0)
            off += (size_t)n;
          else if (n < 0 && errno != EAGAIN)
            off = size;
          if (off == size)
            shutdown (fd, SHUT_WR);
        }
      event_base_loop (d.base, EVLOOP_NONBLOCK);
      for (;;)
        {
          ssize_t n = read (fd, buf, sizeof buf);
          if (n == 0 || (n < 0 && errno != EAGAIN))
            eof = true;
          if (n <= 0)
            break;
        }
      if (off == size && spins > 50)
        break; /* evhttp keeps a half-closed connection while it answers */
    }
  close (fd);
  /* let evhttp notice the close and free the connection */
  for (int i = 0; i < 4; i++)
    event_base_loop (d.base, EVLOOP_NONBLOCK);
  return 0;
}

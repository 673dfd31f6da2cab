/* libwarren's host lists (WARREN_HOST=tcp:H1:P1,tcp:H2:P2): parsing, and
 * failover between real listeners in this process. The cluster behaviour
 * (gateways killed under load) is tests/integration/test_cluster_failover.py. */
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "lib/internal.h"
#include "tap.h"

static void
test_parse (void)
{
  wl_host_t *h = NULL;
  size_t n = 0;
  warren_error_t err;
  TAP_EQ_INT (wl_hosts_parse ("tcp:10.0.0.1:8080, http://gw2:81 ,unix:/run/w.sock", &h, &n, &err),
              0, "three hosts parse");
  TAP_EQ_INT (n, 3, "three entries");
  TAP_EQ_STR (h[0].name, "http://10.0.0.1:8080", "tcp: is http");
  TAP_EQ_STR (h[1].tcp_host, "gw2", "blanks around entries are trimmed");
  TAP_EQ_STR (h[1].tcp_port, "81", "port");
  TAP_EQ_STR (h[2].unix_path, "/run/w.sock", "a unix socket in a list");
  wl_hosts_free (h, n);

  TAP_EQ_INT (wl_hosts_parse ("http://[::1]:7", &h, &n, &err), 0, "one host is a list of one");
  TAP_EQ_INT (n, 1, "one entry");
  TAP_EQ_STR (h[0].host_header, "[::1]:7", "IPv6 host header");
  wl_hosts_free (h, n);

  const char *bad[] = { "tcp:a:1,,tcp:b:2", "tcp:a:1,",    ",tcp:a:1",
                        "tcp:a:1, ",        "tcp:a:99999", "https://a:1,tcp:b:2" };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    {
      h = NULL;
      TAP_OK (wl_hosts_parse (bad[i], &h, &n, &err) < 0 && h == NULL, "'%s' refused: %s", bad[i],
              err.message);
    }
  char many[1024] = "";
  for (int i = 0; i <= WL_MAX_HOSTS; i++)
    snprintf (many + strlen (many), sizeof many - strlen (many), "%stcp:h%d:1", i ? "," : "", i);
  TAP_OK (wl_hosts_parse (many, &h, &n, &err) < 0, "more than %d hosts refused", WL_MAX_HOSTS);
}

/* A listener that answers every request with one JSON object and counts
 * the requests and the Idempotency-Key headers it saw. */
struct srv
{
  int fd, port, requests, keyed;
  char last_key[64];
  pthread_t t;
};

static void *
serve (void *arg)
{
  struct srv *s = arg;
  for (;;)
    {
      int c = accept (s->fd, NULL, NULL);
      if (c < 0)
        return NULL;
      char buf[8192];
      ssize_t n = recv (c, buf, sizeof buf - 1, 0);
      if (n > 0)
        {
          buf[n] = '\0';
          s->requests++;
          char *k = strstr (buf, "Idempotency-Key: ");
          if (k)
            {
              s->keyed++;
              sscanf (k + 17, "%63[^\r]", s->last_key);
            }
          const char *ok = "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                           "Content-Length: 17\r\nConnection: close\r\n\r\n{\"id\":\"sb-1234\"}\n";
          if (send (c, ok, strlen (ok), MSG_NOSIGNAL) < 0)
            perror ("send");
        }
      close (c);
    }
}

/* A loopback port, listening or (listen == false) only bound: connects to
 * that one are refused. */
static int
bind_any (int *port, bool listen_too)
{
  int fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl (INADDR_LOOPBACK) };
  socklen_t l = sizeof a;
  if (fd < 0 || bind (fd, (struct sockaddr *)&a, sizeof a) < 0
      || (listen_too && listen (fd, 16) < 0) || getsockname (fd, (struct sockaddr *)&a, &l) < 0)
    return -1;
  *port = ntohs (a.sin_port);
  return fd;
}

static void
test_failover (void)
{
  int dead_port;
  int dead = bind_any (&dead_port, false);
  struct srv s = { 0 };
  s.fd = bind_any (&s.port, true);
  TAP_OK (dead >= 0 && s.fd >= 0, "two loopback ports");
  pthread_create (&s.t, NULL, serve, &s);

  char hosts[128];
  snprintf (hosts, sizeof hosts, "tcp:127.0.0.1:%d,tcp:127.0.0.1:%d", dead_port, s.port);
  warren_error_t err;
  warren_client_t *c = warren_client_new (hosts, "t", &err);
  TAP_OK (c != NULL, "client for a host list");
  char want[64];
  snprintf (want, sizeof want, "http://127.0.0.1:%d", dead_port);
  TAP_EQ_STR (warren_client_host (c), want, "starts on the first host");

  json_t *sb = warren_sandbox_create (c, NULL, &err);
  TAP_OK (sb != NULL, "create fails over to the second host (%s)", sb ? "" : err.message);
  json_decref (sb);
  snprintf (want, sizeof want, "http://127.0.0.1:%d", s.port);
  TAP_EQ_STR (warren_client_host (c), want, "and sticks to it");
  TAP_EQ_INT (s.keyed, 1, "the create carried an Idempotency-Key");
  TAP_OK (strncmp (s.last_key, "wl-", 3) == 0 && strlen (s.last_key) == 35, "a generated key: %s",
          s.last_key);
  char first[64];
  snprintf (first, sizeof first, "%s", s.last_key);

  json_t *req = json_pack ("{s:s}", "idempotency_key", "mine-1");
  sb = warren_sandbox_create (c, req, &err);
  json_decref (sb);
  TAP_EQ_STR (s.last_key, "mine-1", "the caller's key is the header");
  json_decref (req);
  sb = warren_sandbox_create (c, NULL, &err);
  json_decref (sb);
  TAP_OK (strcmp (s.last_key, first) != 0, "one key per create");
  TAP_EQ_INT (s.requests, 3, "each create sent once");
  json_t *l = warren_sandbox_get (c, "sb-1234", &err);
  json_decref (l);
  TAP_EQ_INT (s.keyed, 3, "only creates carry a key");
  warren_client_free (c);

  /* everything down: the error names the last host tried, nothing hangs */
  snprintf (hosts, sizeof hosts, "tcp:127.0.0.1:%d,tcp:127.0.0.1:%d", dead_port, dead_port);
  c = warren_client_new (hosts, "t", &err);
  sb = warren_sandbox_create (c, NULL, &err);
  TAP_OK (sb == NULL && strcmp (err.code, WARREN_E_CONNECT) == 0, "all down: %s", err.message);
  warren_client_free (c);
  shutdown (s.fd, SHUT_RDWR);
  close (s.fd);
  pthread_join (s.t, NULL);
  close (dead);
}

int
main (void)
{
  test_parse ();
  test_failover ();
  return TAP_DONE ();
}

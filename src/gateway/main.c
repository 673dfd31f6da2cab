/* warren-gateway: a stateless front for a cluster of warrend nodes
 * (docs/cluster.md). Run as many as you like. */
#include "gateway/gateway.h"

#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <event2/thread.h>

#include "common/util.h"

static void
usage (FILE *f)
{
  fprintf (f, "usage: warren-gateway --cluster http://H:P[,http://H:P...] --listen tcp:ADDR:PORT\n"
              "                      --token-file F --node-token-file F2 [--quota-chunk N]\n"
              "                      [--max-connections N] [--http-header-timeout S]\n"
              "                      [--http-idle-timeout S] [--quota-idle-return S]\n"
              "                      [--priority-headroom MB] [--listen-compat tcp:ADDR:PORT]\n"
              "                      [--etcd-cacert F] [--etcd-cert F [--etcd-key F]]\n"
              "Serves the Warren API for a cluster: places creates on nodes, routes every\n"
              "other sandbox request to the node named in its id. F holds the admin token\n"
              "clients present; F2 the token the nodes' TCP listeners accept.\n"
              "--listen-compat serves SandboxFusion's and E2B's APIs (no token) by forwarding\n"
              "to the nodes' own --listen-compat ports.\n");
}

static int
read_token (const char *path, char *buf, size_t size)
{
  char *tok = NULL;
  size_t len;
  if (wr_read_file_at (AT_FDCWD, path, &tok, &len, 4096) < 0)
    {
      fprintf (stderr, "warren-gateway: cannot read token file %s: %m\n", path);
      return -1;
    }
  while (len && (tok[len - 1] == '\n' || tok[len - 1] == '\r' || tok[len - 1] == ' '))
    tok[--len] = '\0';
  if (len < 16 || len >= size)
    {
      fprintf (stderr, "warren-gateway: token in %s must be 16..255 characters\n", path);
      free (tok);
      return -1;
    }
  snprintf (buf, size, "%s", tok);
  explicit_bzero (tok, len);
  free (tok);
  return 0;
}

static void
sweep_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  gw_quota_sweep (arg);
}

static void
lost_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  gw_fail_lost (arg);
}

static void
on_signal (evutil_socket_t sig, short what WR_UNUSED, void *arg)
{
  struct gw *g = arg;
  fprintf (stderr, "warren-gateway: signal %d, shutting down\n", (int)sig);
  event_base_loopbreak (g->base);
}

int
main (int argc, char **argv)
{
  static struct gw g = { .chunk = 16,
                         .mu = PTHREAD_MUTEX_INITIALIZER,
                         .session_mu = PTHREAD_MUTEX_INITIALIZER,
                         .idle_return_ms = 2000 };
  const char *urls = NULL, *token_file = NULL, *node_token_file = NULL;
  const char *etcd_cacert = NULL, *etcd_cert = NULL, *etcd_key = NULL;
  const char *listens[8], *compat_listens[8];
  size_t n_listen = 0, n_compat = 0;
  static const struct option opts[] = {
    { "cluster", required_argument, NULL, 'c' },
    { "listen", required_argument, NULL, 'l' },
    { "token-file", required_argument, NULL, 't' },
    { "node-token-file", required_argument, NULL, 'n' },
    { "quota-chunk", required_argument, NULL, 'q' },
    WR_HTTPD_LONG_OPTIONS,
    { "quota-idle-return", required_argument, NULL, 'r' },
    { "priority-headroom", required_argument, NULL, 'p' },
    { "listen-compat", required_argument, NULL, 'C' },
    { "etcd-cacert", required_argument, NULL, 'A' },
    { "etcd-cert", required_argument, NULL, 'E' },
    { "etcd-key", required_argument, NULL, 'K' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
  };
  int c;
  while ((c = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (c)
      {
      case 'c':
        urls = optarg;
        break;
      case 'l':
        if (n_listen < WR_ARRAY_SIZE (listens))
          listens[n_listen++] = optarg;
        break;
      case 'C':
        if (n_compat < WR_ARRAY_SIZE (compat_listens))
          compat_listens[n_compat++] = optarg;
        break;
      case 't':
        token_file = optarg;
        break;
      case 'A':
        etcd_cacert = optarg;
        break;
      case 'E':
        etcd_cert = optarg;
        break;
      case 'K':
        etcd_key = optarg;
        break;
      case 'n':
        node_token_file = optarg;
        break;
      case 'q':
        g.chunk = strtoll (optarg, NULL, 10);
        if (g.chunk < 1 || g.chunk > 100000)
          {
            fprintf (stderr, "warren-gateway: --quota-chunk wants 1..100000\n");
            return 2;
          }
        break;
      case 'r':
      case 'p':
        {
          char *end;
          long long v = strtoll (optarg, &end, 10);
          if (*end || v < 0 || v > 100000000)
            {
              fprintf (stderr, "warren-gateway: --%s wants a number in [0, 100000000]\n",
                       c == 'r' ? "quota-idle-return" : "priority-headroom");
              return 2;
            }
          if (c == 'r')
            g.idle_return_ms = v * 1000;
          else
            g.priority_headroom_mb = v;
          break;
        }
      case 'h':
        usage (stdout);
        return 0;
      default:
        if (WR_HTTPD_IS_OPT (c))
          {
            wr_err_t err;
            if (wr_httpd_limit_opt (c, optarg, &g.http_limits.max_connections,
                                    &g.http_limits.header_timeout_s, &g.http_limits.idle_timeout_s,
                                    &err)
                < 0)
              {
                fprintf (stderr, "warren-gateway: %s\n", err.msg);
                return 2;
              }
            break;
          }
        usage (stderr);
        return 2;
      }
  if (urls == NULL || n_listen == 0 || token_file == NULL || node_token_file == NULL)
    {
      usage (stderr);
      return 2;
    }
  if (read_token (token_file, g.token, sizeof g.token) < 0
      || read_token (node_token_file, g.node_token, sizeof g.node_token) < 0)
    return 1;
  wr_err_t err;
  if ((etcd_cacert || etcd_cert || etcd_key)
      && wr_etcd_tls (etcd_cacert, etcd_cert, etcd_key, &err) < 0)
    {
      fprintf (stderr, "warren-gateway: %s\n", err.msg);
      return 2;
    }
  if (wr_etcd_new (urls, 3000, &g.etcd, &err) < 0
      || wr_etcd_new (urls, 1000, &g.probe_etcd, &err) < 0)
    {
      fprintf (stderr, "warren-gateway: %s\n", err.msg);
      return 2;
    }
  struct rlimit rl;
  if (getrlimit (RLIMIT_NOFILE, &rl) == 0)
    {
      rl.rlim_cur = rl.rlim_max;
      setrlimit (RLIMIT_NOFILE, &rl);
    }
  signal (SIGPIPE, SIG_IGN);
  evthread_use_pthreads ();
  g.base = event_base_new ();
  for (size_t i = 0; i < n_listen; i++)
    if (gw_http_listen (&g, listens[i], &err) < 0)
      {
        fprintf (stderr, "warren-gateway: %s\n", err.msg);
        return 1;
      }
  for (size_t i = 0; i < n_compat; i++)
    if (gw_compat_listen (&g, compat_listens[i], &err) < 0)
      {
        fprintf (stderr, "warren-gateway: %s\n", err.msg);
        return 1;
      }
  if (gw_watch_start (&g, &err) < 0 || gw_reconcile_start (&g, &err) < 0)
    {
      fprintf (stderr, "warren-gateway: %s\n", err.msg);
      return 1;
    }
  struct event *sigint = evsignal_new (g.base, SIGINT, on_signal, &g);
  struct event *sigterm = evsignal_new (g.base, SIGTERM, on_signal, &g);
  evsignal_add (sigint, NULL);
  evsignal_add (sigterm, NULL);
  struct event *sweep = event_new (g.base, -1, EV_PERSIST, sweep_cb, &g);
  event_add (sweep, &(struct timeval){ 1, 0 });
  struct event *lost = event_new (g.base, -1, EV_PERSIST, lost_cb, &g);
  event_add (lost, &(struct timeval){ 0, 250 * 1000 });
  fprintf (stderr, "warren-gateway: serving %s (cluster %s)\n", listens[0], urls);
  event_base_dispatch (g.base);
  wr_httpd_free (g.httpd);
  gw_compat_free (&g);
  gw_watch_stop (&g);
  gw_quota_release_all (&g);
  gw_reconcile_stop (&g);
  gw_nodes_free_conns (&g);
  event_free (sigint);
  event_free (sigterm);
  event_free (sweep);
  event_free (lost);
  event_base_free (g.base);
  wr_etcd_free (g.etcd);
  wr_etcd_free (g.probe_etcd);
  return 0;
}

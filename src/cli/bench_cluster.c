/* `warren bench cluster`: the cluster's control plane at scale, by
 * simulation (docs/performance.md, "Cluster"). Starts etcd (or uses
 * --etcd), warren-sim with N simulated nodes, two warren-gateways, and
 * reports in one JSON run:
 *  - gateway overhead: create+destroy and exec p50 through a gateway vs
 *    direct to one node, interleaved in short blocks (median and range),
 *    against a simulated node and, with --real-node ROOTFS, a real warrend
 *    (container backend, ROOTFS imported as busybox);
 *  - control plane: creates/s through both gateways over N nodes with
 *    concurrent clients, p50/p99, busiest node / mean after 100K placements,
 *    etcd revisions (writes) per create;
 *  - node loss: seconds from kill -9 of a node process to "lost".
 * Load comes from plain blocking HTTP/1.1 keep-alive connections, one per
 * client thread, so the client costs little next to what it measures. */
#include "cli/bench.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "common/util.h"

extern char **environ;

#define TOKEN "bench-cluster-token-0123456789abcdef"
#define BALANCE_AT 100000
#define MAX_CLIENTS 256

static int etcd_port;

/* ---- a minimal keep-alive HTTP/1.1 client ---- */

struct conn
{
  int fd;
  int port;
  bool noauth; /* etcd refuses an unknown bearer token even with auth off */
  char *buf;
  size_t len, cap;
};

static void
conn_close (struct conn *c)
{
  if (c->fd >= 0)
    close (c->fd);
  c->fd = -1;
  c->len = 0;
}

static int
conn_open (struct conn *c)
{
  c->fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)c->port) };
  sa.sin_addr.s_addr = htonl (INADDR_LOOPBACK);
  int one = 1;
  setsockopt (c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct timeval tv = { 30, 0 };
  setsockopt (c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (c->fd < 0 || connect (c->fd, (struct sockaddr *)&sa, sizeof sa) < 0)
    {
      conn_close (c);
      return -1;
    }
  return 0;
}

/* One request; *ret_body points into c->buf (valid until the next call).
 * The HTTP status, or -1 when the connection failed. */
static int
conn_req_once (struct conn *c, const char *method, const char *path, const char *body,
               const char **ret_body, size_t *ret_len)
{
  if (c->fd < 0 && conn_open (c) < 0)
    return -1;
  char head[1024];
  size_t bl = body ? strlen (body) : 0;
  int hl = snprintf (head, sizeof head,
                     "%s %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                     method, path, c->port, c->noauth ? "" : "Authorization: Bearer " TOKEN "\r\n",
                     bl);
  struct iovec iov[2] = { { head, (size_t)hl }, { (void *)body, bl } };
  struct msghdr mh = { .msg_iov = iov, .msg_iovlen = bl ? 2 : 1 };
  if (sendmsg (c->fd, &mh, MSG_NOSIGNAL) != hl + (ssize_t)bl)
    return -1;
  c->len = 0;
  size_t need = 0, hend = 0;
  for (;;)
    {
      if (c->cap - c->len < 65536)
        {
          c->cap = c->cap ? c->cap * 2 : 1 << 17;
          c->buf = realloc (c->buf, c->cap + 1);
        }
      ssize_t r = read (c->fd, c->buf + c->len, c->cap - c->len);
      if (r <= 0)
        return -1;
      c->len += (size_t)r;
      c->buf[c->len] = '\0';
      if (hend == 0)
        {
          char *e = strstr (c->buf, "\r\n\r\n");
          if (e == NULL)
            continue;
          hend = (size_t)(e - c->buf) + 4;
          char *cl = strcasestr (c->buf, "\r\nContent-Length:");
          need = hend + (cl && cl < e ? strtoul (cl + 17, NULL, 10) : 0);
        }
      if (c->len >= need)
        break;
    }
  int status = atoi (c->buf + 9);
  *ret_body = c->buf + hend;
  *ret_len = need - hend;
  return status;
}

static int
conn_req (struct conn *c, const char *method, const char *path, const char *body,
          const char **ret_body, size_t *ret_len)
{
  int st = conn_req_once (c, method, path, body, ret_body, ret_len);
  if (st < 0)
    {
      /* a kept-alive connection closed by the peer: once more on a new one */
      conn_close (c);
      st = conn_req_once (c, method, path, body, ret_body, ret_len);
      if (st < 0)
        conn_close (c);
    }
  return st;
}

static json_t *
get_json (int port, const char *path)
{
  struct conn c = { .fd = -1, .port = port, .noauth = port == etcd_port };
  const char *b;
  size_t l;
  json_t *j = conn_req (&c, "GET", path, NULL, &b, &l) == 200 ? json_loadb (b, l, 0, NULL) : NULL;
  conn_close (&c);
  free (c.buf);
  return j;
}

/* ---- processes ---- */

struct proc
{
  pid_t pid;
  const char *what;
};

static struct proc procs[8];
static size_t n_procs;
static char tmpdir[256];

static pid_t
spawn (const char *what, char *const argv[], const char *log)
{
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init (&fa);
  posix_spawn_file_actions_addopen (&fa, 1, log, O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2 (&fa, 1, 2);
  pid_t pid = -1;
  if (posix_spawn (&pid, argv[0], &fa, NULL, argv, environ) != 0)
    pid = -1;
  posix_spawn_file_actions_destroy (&fa);
  if (pid > 0 && n_procs < WR_ARRAY_SIZE (procs))
    procs[n_procs++] = (struct proc){ pid, what };
  return pid;
}

static void
stop_all (void)
{
  for (size_t i = n_procs; i-- > 0;)
    if (procs[i].pid > 0)
      kill (procs[i].pid, SIGTERM);
  for (size_t i = n_procs; i-- > 0;)
    if (procs[i].pid > 0)
      {
        for (int t = 0; t < 300 && waitpid (procs[i].pid, NULL, WNOHANG) == 0; t++)
          usleep (100 * 1000);
        if (kill (procs[i].pid, 0) == 0)
          {
            kill (procs[i].pid, SIGKILL);
            waitpid (procs[i].pid, NULL, 0);
          }
        procs[i].pid = 0;
      }
  n_procs = 0;
  if (tmpdir[0])
    {
      char cmd[300];
      snprintf (cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
      if (system (cmd) != 0)
        fprintf (stderr, "bench: could not remove %s\n", tmpdir);
      tmpdir[0] = '\0';
    }
}

/* A loopback port free now and outside the kernel's ephemeral range: a
 * bind(0) port is an ephemeral one, which any outgoing connection (1,000
 * simulated nodes dial etcd and the gateways dial them) may take as its
 * source port before the process it was picked for binds it. */
static int
free_port (void)
{
  static bool seeded;
  if (!seeded)
    srandom ((unsigned)getpid () ^ (unsigned)time (NULL)), seeded = true;
  int lo = 32768, hi = 60999;
  _cleanup_fclose_ FILE *f = fopen ("/proc/sys/net/ipv4/ip_local_port_range", "re");
  if (f && fscanf (f, "%d %d", &lo, &hi) != 2)
    lo = 32768, hi = 60999;
  for (int i = 0; i < 200; i++)
    {
      long r = random ();
      int port = lo - 10000 >= 1000   ? 10000 + (int)(r % (lo - 10000))
                 : 65535 - hi >= 1000 ? hi + 1 + (int)(r % (65535 - hi))
                                      : 10000 + (int)(r % 55535);
      int fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0)
        return -1;
      struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)port) };
      sa.sin_addr.s_addr = htonl (INADDR_LOOPBACK);
      int ok = bind (fd, (struct sockaddr *)&sa, sizeof sa) == 0;
      close (fd);
      if (ok)
        return port;
    }
  return -1;
}

static void
bin_path (char *buf, size_t size, const char *name)
{
  char self[1024];
  ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 1);
  self[n > 0 ? n : 0] = '\0';
  char *slash = strrchr (self, '/');
  if (slash)
    *slash = '\0';
  snprintf (buf, size, "%s/%s", self, name);
}

static void __attribute__ ((format (printf, 1, 2))) progress (const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  fputs ("bench cluster: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
}

/* Poll until fn is true or timeout_s passed. */
static bool
wait_until (bool (*fn) (void *), void *arg, int timeout_s)
{
  uint64_t end = wr_now_ms () + (uint64_t)timeout_s * 1000;
  while (wr_now_ms () < end)
    {
      if (fn (arg))
        return true;
      usleep (100 * 1000);
    }
  return false;
}

static bool
etcd_healthy (void *arg WR_UNUSED)
{
  json_t *j = get_json (etcd_port, "/health");
  bool ok = j && strcmp (json_string_value (json_object_get (j, "health")) ?: "", "true") == 0;
  json_decref (j);
  return ok;
}

static long long
etcd_revision (void)
{
  struct conn c = { .fd = -1, .port = etcd_port, .noauth = true };
  const char *b;
  size_t l;
  long long rev = -1;
  /* a range over a key that does not exist still returns the store revision */
  if (conn_req (&c, "POST", "/v3/kv/range", "{\"key\":\"L3dhcnJlbi1iZW5jaC1ub25l\"}", &b, &l)
      == 200)
    {
      json_t *j = json_loadb (b, l, 0, NULL);
      const char *r
          = json_string_value (json_object_get (json_object_get (j, "header"), "revision"));
      rev = r ? strtoll (r, NULL, 10) : -1;
      json_decref (j);
    }
  conn_close (&c);
  free (c.buf);
  return rev;
}

struct ready_arg
{
  int port;
  size_t want;
};

/* The gateway is synced and lists `want` ready nodes. */
static bool
gateway_ready (void *p)
{
  struct ready_arg *a = p;
  json_t *j = get_json (a->port, "/v1/nodes");
  size_t ready = 0, i;
  json_t *n;
  json_array_foreach (
      json_object_get (j, "nodes"), i,
      n) if (strcmp (json_string_value (json_object_get (n, "state")) ?: "", "ready") == 0) ready++;
  json_decref (j);
  return ready >= a->want;
}

/* ---- load ---- */

struct load
{
  int gw_ports[2];
  size_t total; /* creates to make */
  size_t nodes;
  _Atomic size_t next, done, failed;
  double *lat_ms;           /* per create, indexed by its sequence number */
  _Atomic unsigned *placed; /* per node, for the first BALANCE_AT creates */
  char first_error[256];
  pthread_mutex_t mu;
};

struct client
{
  struct load *l;
  unsigned index;
};

static void *
client_main (void *p)
{
  struct client *cl = p;
  struct load *l = cl->l;
  struct conn c = { .fd = -1, .port = l->gw_ports[cl->index % 2] };
  static const char body[]
      = "{\"memory_mb\":256,\"image\":\"busybox\",\"node_labels\":{\"warren.bench\":\"sim\"}}";
  for (;;)
    {
      size_t seq = atomic_fetch_add (&l->next, 1);
      if (seq >= l->total)
        break;
      uint64_t t0 = wr_now_ns ();
      const char *b;
      size_t len;
      int st = conn_req (&c, "POST", "/v1/sandboxes", body, &b, &len);
      l->lat_ms[seq] = (double)(wr_now_ns () - t0) / 1e6;
      if (st != 201)
        {
          if (atomic_fetch_add (&l->failed, 1) == 0)
            snprintf (l->first_error, sizeof l->first_error, "HTTP %d: %.200s", st,
                      st > 0 ? b : "connection failed");
          l->lat_ms[seq] = NAN;
          continue;
        }
      atomic_fetch_add (&l->done, 1);
      /* "id":"sim-N-<hex>": count node N */
      const char *id = strstr (b, "\"id\":\"sim-");
      if (id && seq < BALANCE_AT)
        {
          unsigned long ni = strtoul (id + 10, NULL, 10);
          if (ni < l->nodes)
            atomic_fetch_add (&l->placed[ni], 1);
        }
    }
  conn_close (&c);
  free (c.buf);
  return NULL;
}

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double
pct (double *v, size_t n, double p)
{
  if (n == 0)
    return NAN;
  size_t i = (size_t)(p * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

static json_t *
control_plane (int gw0, int gw1, size_t nodes, size_t total, unsigned clients, int sim_port)
{
  struct load l = {
    .gw_ports = { gw0, gw1 }, .total = total, .nodes = nodes, .mu = PTHREAD_MUTEX_INITIALIZER
  };
  l.lat_ms = calloc (total, sizeof *l.lat_ms);
  l.placed = calloc (nodes, sizeof *l.placed);
  json_t *sim0 = get_json (sim_port, "/v1/sim");
  long long rev0 = etcd_revision ();
  pthread_t th[MAX_CLIENTS];
  struct client cl[MAX_CLIENTS];
  progress ("control plane: %zu creates, %u clients, 2 gateways, %zu nodes", total, clients, nodes);
  uint64_t t0 = wr_now_ns ();
  for (unsigned i = 0; i < clients; i++)
    {
      cl[i] = (struct client){ &l, i };
      pthread_create (&th[i], NULL, client_main, &cl[i]);
    }
  for (unsigned i = 0; i < clients; i++)
    pthread_join (th[i], NULL);
  double secs = (double)(wr_now_ns () - t0) / 1e9;
  /* the status writes of the burst land within a publish interval */
  sleep (2);
  long long rev1 = etcd_revision ();
  json_t *sim1 = get_json (sim_port, "/v1/sim");
  size_t ok = 0;
  for (size_t i = 0; i < total; i++)
    if (!isnan (l.lat_ms[i]))
      l.lat_ms[ok++] = l.lat_ms[i];
  qsort (l.lat_ms, ok, sizeof *l.lat_ms, cmp_double);
  unsigned long long placed = 0, busiest = 0;
  for (size_t i = 0; i < nodes; i++)
    {
      placed += l.placed[i];
      if (l.placed[i] > busiest)
        busiest = l.placed[i];
    }
  double mean = (double)placed / (double)nodes;
  long long writes = json_integer_value (json_object_get (sim1, "status_writes"))
                     - json_integer_value (json_object_get (sim0, "status_writes"));
  json_t *r = json_pack (
      "{s:I,s:I,s:I,s:i,s:f,s:f,s:f,s:f,s:f,s:{s:I,s:I,s:f,s:f},s:{s:I,s:f,s:I,s:f}}", "nodes",
      (json_int_t)nodes, "creates", (json_int_t)ok, "failed", (json_int_t)l.failed, "clients",
      (int)clients, "seconds", secs, "creates_per_s", (double)ok / secs, "p50_ms",
      pct (l.lat_ms, ok, 0.5), "p99_ms", pct (l.lat_ms, ok, 0.99), "max_ms",
      pct (l.lat_ms, ok, 1.0), "balance", "placements", (json_int_t)placed, "busiest",
      (json_int_t)busiest, "mean", mean, "busiest_over_mean", mean > 0 ? (double)busiest / mean : 0,
      "etcd", "revisions", (json_int_t)(rev1 - rev0), "revisions_per_create",
      ok ? (double)(rev1 - rev0) / (double)ok : 0, "node_status_writes", (json_int_t)writes,
      "node_status_writes_per_create", ok ? (double)writes / (double)ok : 0);
  if (l.failed)
    json_object_set_new (r, "first_error", json_string (l.first_error));
  json_decref (sim0);
  json_decref (sim1);
  free (l.lat_ms);
  free (l.placed);
  return r;
}

/* ---- gateway overhead: the same node direct and through a gateway ---- */

static double
median (double *v, size_t n)
{
  qsort (v, n, sizeof *v, cmp_double);
  return n ? v[n / 2] : NAN;
}

/* The create both sides send (warrend's default image, busybox): a gateway
 * places it on the node measured by its label. */
static void
create_body (char *buf, size_t size, const char *label)
{
  snprintf (buf, size, "{\"memory_mb\":256,\"node_labels\":{\"warren.bench\":\"%s\"}}", label);
}

/* create+destroy pairs per second over one connection; < 0 on failure */
static double
create_destroy_block (int port, const char *prefix, const char *label, size_t n)
{
  struct conn c = { .fd = -1, .port = port };
  char path[256], id[80], body[160];
  create_body (body, sizeof body, label);
  uint64_t t0 = wr_now_ns ();
  double rate = -1;
  for (size_t i = 0; i < n; i++)
    {
      const char *b;
      size_t len;
      snprintf (path, sizeof path, "%s/v1/sandboxes", prefix);
      if (conn_req (&c, "POST", path, body, &b, &len) != 201)
        goto out;
      const char *p = strstr (b, "\"id\":\"");
      if (p == NULL || sscanf (p + 6, "%79[^\"]", id) != 1)
        goto out;
      snprintf (path, sizeof path, "%s/v1/sandboxes/%s", prefix, id);
      if (conn_req (&c, "DELETE", path, NULL, &b, &len) != 204)
        goto out;
    }
  rate = (double)n / ((double)(wr_now_ns () - t0) / 1e9);
out:
  conn_close (&c);
  free (c.buf);
  return rate;
}

static double
exec_block_p50 (int port, const char *path, size_t n)
{
  struct conn c = { .fd = -1, .port = port };
  double *v = calloc (n, sizeof *v);
  double r = -1;
  for (size_t i = 0; i < n; i++)
    {
      const char *b;
      size_t len;
      uint64_t t0 = wr_now_ns ();
      if (conn_req (&c, "POST", path, "{\"cmd\":[\"true\"]}", &b, &len) != 200)
        goto out;
      v[i] = (double)(wr_now_ns () - t0) / 1e6;
    }
  r = median (v, n);
out:
  free (v);
  conn_close (&c);
  free (c.buf);
  return r;
}

static json_t *
range_entry (double *v, size_t n)
{
  double med = median (v, n);
  return json_pack ("{s:f,s:f,s:f}", "median", med, "min", n ? v[0] : NAN, "max",
                    n ? v[n - 1] : NAN);
}

/* label: the node's warren.bench label; per: requests per block and side */
static json_t *
overhead (int gw, int node_port, const char *node_prefix, const char *node_kind, const char *label,
          size_t blocks, size_t per)
{
  double direct_cd[64], gw_cd[64], direct_ex[64], gw_ex[64];
  if (blocks > 64)
    blocks = 64;
  progress ("gateway overhead: %zu interleaved blocks against a %s node", blocks, node_kind);
  /* one sandbox for the execs, made through the gateway */
  struct conn c = { .fd = -1, .port = gw };
  const char *b;
  size_t len;
  char id[80] = "", gpath[256], dpath[256], body[160];
  create_body (body, sizeof body, label);
  if (conn_req (&c, "POST", "/v1/sandboxes", body, &b, &len) == 201 && strstr (b, "\"id\":\""))
    sscanf (strstr (b, "\"id\":\"") + 6, "%79[^\"]", id);
  snprintf (gpath, sizeof gpath, "/v1/sandboxes/%s/exec", id);
  snprintf (dpath, sizeof dpath, "%s/v1/sandboxes/%s/exec", node_prefix, id);
  size_t nb = 0;
  for (size_t i = 0; i < blocks; i++)
    {
      /* alternate which goes first, so drift favours neither */
      bool gfirst = i % 2;
      double g1 = gfirst ? create_destroy_block (gw, "", label, per) : 0;
      double d1 = create_destroy_block (node_port, node_prefix, label, per);
      double g2 = gfirst ? 0 : create_destroy_block (gw, "", label, per);
      double ge1 = gfirst ? exec_block_p50 (gw, gpath, per) : 0;
      double de1 = exec_block_p50 (node_port, dpath, per);
      double ge2 = gfirst ? 0 : exec_block_p50 (gw, gpath, per);
      direct_cd[nb] = d1;
      gw_cd[nb] = gfirst ? g1 : g2;
      direct_ex[nb] = de1;
      gw_ex[nb] = gfirst ? ge1 : ge2;
      if (direct_cd[nb] > 0 && gw_cd[nb] > 0 && direct_ex[nb] > 0 && gw_ex[nb] > 0)
        nb++;
    }
  if (id[0])
    {
      snprintf (gpath, sizeof gpath, "/v1/sandboxes/%s", id);
      conn_req (&c, "DELETE", gpath, NULL, &b, &len);
    }
  conn_close (&c);
  free (c.buf);
  if (nb == 0)
    return json_pack ("{s:s}", "error", "every block failed");
  double ratio_cd[64], ratio_ex[64];
  for (size_t i = 0; i < nb; i++)
    {
      ratio_cd[i] = gw_cd[i] / direct_cd[i];
      ratio_ex[i] = gw_ex[i] / direct_ex[i];
    }
  return json_pack ("{s:s,s:I,s:I,s:{s:o,s:o,s:o},s:{s:o,s:o,s:o}}", "node", node_kind, "blocks",
                    (json_int_t)nb, "per_block", (json_int_t)per, "create_destroy_per_s", "direct",
                    range_entry (direct_cd, nb), "gateway", range_entry (gw_cd, nb),
                    "gateway_over_direct", range_entry (ratio_cd, nb), "exec_p50_ms", "direct",
                    range_entry (direct_ex, nb), "gateway", range_entry (gw_ex, nb),
                    "gateway_over_direct", range_entry (ratio_ex, nb));
}

/* ---- node loss ---- */

struct lost_arg
{
  int port;
  const char *node;
};

static bool
node_lost (void *p)
{
  struct lost_arg *a = p;
  json_t *j = get_json (a->port, "/v1/nodes");
  bool lost = false;
  size_t i;
  json_t *n;
  json_array_foreach (json_object_get (j, "nodes"), i,
                      n) if (strcmp (json_string_value (json_object_get (n, "name")) ?: "", a->node)
                             == 0) lost
      = strcmp (json_string_value (json_object_get (n, "state")) ?: "", "lost") == 0;
  json_decref (j);
  return lost;
}

static json_t *
node_loss (int gw, pid_t victim, const char *node, int ttl_s)
{
  progress ("node loss: kill -9 of %s (lease TTL %d s)", node, ttl_s);
  uint64_t t0 = wr_now_ns ();
  kill (victim, SIGKILL);
  waitpid (victim, NULL, 0);
  for (size_t i = 0; i < n_procs; i++)
    if (procs[i].pid == victim)
      procs[i].pid = 0;
  struct lost_arg a = { gw, node };
  bool ok = wait_until (node_lost, &a, ttl_s + 30);
  double secs = (double)(wr_now_ns () - t0) / 1e9;
  if (!ok)
    return json_pack ("{s:s,s:i}", "error", "the node was never reported lost", "lease_ttl_s",
                      ttl_s);
  return json_pack ("{s:f,s:i,s:f}", "seconds_to_lost", secs, "lease_ttl_s", ttl_s, "bound_s",
                    (double)ttl_s + 2.0);
}

/* ---- a real node ---- */

static bool
node_healthy (void *p)
{
  json_t *j = get_json (*(int *)p, "/healthz");
  bool ok = j != NULL;
  json_decref (j);
  return ok;
}

/* warrend in cluster mode on a root under tmpdir, labelled warren.bench=real,
 * with rootfs imported as busybox: its port, or -1. */
static int
start_real_node (const char *rootfs, const char *urls, const char *tok, const char *log)
{
  char bin[1100], root[300], listen[64], adv[64];
  bin_path (bin, sizeof bin, "warrend");
  int port = free_port ();
  snprintf (root, sizeof root, "%s/real", tmpdir);
  snprintf (listen, sizeof listen, "tcp:127.0.0.1:%d", port);
  snprintf (adv, sizeof adv, "http://127.0.0.1:%d", port);
  progress ("starting a real warrend (root %s)", root);
  char *argv[] = { bin,           "--root",    root,
                   "--listen",    listen,      "--token-file",
                   (char *)tok,   "--cluster", (char *)urls,
                   "--node-name", "real",      "--advertise",
                   adv,           "--label",   "warren.bench=real",
                   NULL };
  if (mkdir (root, 0700) < 0 || spawn ("warrend", argv, log) < 0
      || !wait_until (node_healthy, &port, 60))
    {
      fprintf (stderr, "bench cluster: warrend did not start (log: %s)\n", log);
      return -1;
    }
  /* a path is imported over the owner-only unix socket (TCP clients upload) */
  json_t *req = json_pack ("{s:s,s:s}", "name", "busybox:latest", "path", rootfs);
  _cleanup_free_ char *body = json_dumps (req, JSON_COMPACT);
  json_decref (req);
  struct sockaddr_un sa = { .sun_family = AF_UNIX };
  snprintf (sa.sun_path, sizeof sa.sun_path, "%s/warrend.sock", root);
  _cleanup_close_ int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  char head[256], ans[64] = "";
  int hl = snprintf (head, sizeof head,
                     "POST /v1/images/import HTTP/1.1\r\nHost: warrend\r\nContent-Type: "
                     "application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                     body ? strlen (body) : 0);
  if (body == NULL || fd < 0 || connect (fd, (struct sockaddr *)&sa, sizeof sa) < 0
      || write (fd, head, (size_t)hl) != hl
      || write (fd, body, strlen (body)) != (ssize_t)strlen (body)
      || read (fd, ans, sizeof ans - 1) < 12 || strncmp (ans + 9, "201", 3) != 0)
    {
      fprintf (stderr, "bench cluster: importing %s on warrend failed: %.40s (log: %s)\n", rootfs,
               ans, log);
      return -1;
    }
  return port;
}

/* ---- main ---- */

static void
usage (FILE *f)
{
  fprintf (f, "usage: warren bench cluster [--nodes N] [--sandboxes N] [--clients N]\n"
              "                            [--blocks N] [--lease-ttl S] [--etcd URL]\n"
              "                            [--real-node ROOTFS] [--json]\n"
              "Starts etcd (unless --etcd names a running one), warren-sim with N simulated\n"
              "nodes, a one-node warren-sim for the direct comparison and node loss, and two\n"
              "warren-gateways; measures gateway overhead, the control plane and node loss.\n"
              "--real-node ROOTFS also starts a real warrend (container backend, ROOTFS\n"
              "imported as busybox; scripts/mk-busybox-rootfs.sh) and measures the gateway's\n"
              "overhead against it (needs root).\n"
              "Defaults: 1000 nodes, 400000 sandboxes, 32 clients, 10 blocks, TTL 5 s.\n");
}

static json_t *
verdicts (json_t *report)
{
  json_t *cp = json_object_get (report, "control_plane");
  json_t *ov = json_object_get (report, "gateway_overhead");
  json_t *nl = json_object_get (report, "node_loss");
#define NUM(o, ...) json_number_value (json_object_get (o, __VA_ARGS__))
  double rate = NUM (cp, "creates_per_s"), p99 = NUM (cp, "p99_ms");
  double bal
      = json_number_value (json_object_get (json_object_get (cp, "balance"), "busiest_over_mean"));
  double cd = json_number_value (json_object_get (
      json_object_get (json_object_get (ov, "create_destroy_per_s"), "gateway_over_direct"),
      "median"));
  double ex = json_number_value (json_object_get (
      json_object_get (json_object_get (ov, "exec_p50_ms"), "gateway_over_direct"), "median"));
  double lost = NUM (nl, "seconds_to_lost"), bound = NUM (nl, "bound_s");
#undef NUM
  json_t *real = json_object_get (report, "gateway_overhead_real");
  if (real)
    {
      /* the targets are about a real node: its figures decide them */
      cd = json_number_value (json_object_get (
          json_object_get (json_object_get (real, "create_destroy_per_s"), "gateway_over_direct"),
          "median"));
      ex = json_number_value (json_object_get (
          json_object_get (json_object_get (real, "exec_p50_ms"), "gateway_over_direct"),
          "median"));
    }
  return json_pack ("{s:{s:f,s:b},s:{s:f,s:b},s:{s:f,s:b},s:{s:f,s:b},s:{s:f,s:b},s:{s:f,s:b}}",
                    "creates_per_s_ge_5000", "value", rate, "met", rate >= 5000, "p99_ms_le_50",
                    "value", p99, "met", p99 <= 50, "busiest_over_mean_le_1.25", "value", bal,
                    "met", bal > 0 && bal <= 1.25, "gateway_create_destroy_ge_0.85x", "value", cd,
                    "met", cd >= 0.85, "gateway_exec_p50_le_1.3x", "value", ex, "met",
                    ex > 0 && ex <= 1.3, "node_lost_within_ttl_plus_2s", "value", lost, "met",
                    lost > 0 && lost <= bound);
}

static void
on_fatal (int sig)
{
  stop_all ();
  signal (sig, SIG_DFL);
  raise (sig);
}

int
wr_cli_bench_cluster (int argc, char **argv)
{
  size_t nodes = 1000, total = 400000, blocks = 10;
  unsigned clients = 32;
  int ttl = 5;
  const char *etcd = NULL, *real_rootfs = NULL;
  static const struct option opts[] = {
    { "real-node", required_argument, NULL, 'r' },
    { "nodes", required_argument, NULL, 'n' },
    { "sandboxes", required_argument, NULL, 's' },
    { "clients", required_argument, NULL, 'c' },
    { "blocks", required_argument, NULL, 'b' },
    { "lease-ttl", required_argument, NULL, 't' },
    { "etcd", required_argument, NULL, 'e' },
    { "json", no_argument, NULL, 'j' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
  };
  optind = 1;
  int o;
  while ((o = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (o)
      {
      case 'n':
        nodes = strtoul (optarg, NULL, 10);
        break;
      case 's':
        total = strtoul (optarg, NULL, 10);
        break;
      case 'c':
        clients = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'b':
        blocks = strtoul (optarg, NULL, 10);
        break;
      case 't':
        ttl = atoi (optarg);
        break;
      case 'e':
        etcd = optarg;
        break;
      case 'r':
        real_rootfs = optarg;
        break;
      case 'j':
        break; /* the report is always JSON */
      case 'h':
        usage (stdout);
        return 0;
      default:
        usage (stderr);
        return 2;
      }
  if (nodes < 2 || nodes > 4000 || total < 1 || total > 10000000 || clients < 1
      || clients > MAX_CLIENTS || blocks < 1 || ttl < 2)
    {
      usage (stderr);
      return 2;
    }
  char sim_bin[1100], gw_bin[1100];
  bin_path (sim_bin, sizeof sim_bin, "warren-sim");
  bin_path (gw_bin, sizeof gw_bin, "warren-gateway");
  snprintf (tmpdir, sizeof tmpdir, "/var/tmp/wr-bench-cluster-XXXXXX");
  if (mkdtemp (tmpdir) == NULL)
    {
      tmpdir[0] = '\0';
      perror ("bench cluster: mkdtemp");
      return 1;
    }
  signal (SIGINT, on_fatal);
  signal (SIGTERM, on_fatal);
  char tok[300], log[300], urls[300];
  snprintf (tok, sizeof tok, "%s/token", tmpdir);
  snprintf (log, sizeof log, "%s/log", tmpdir);
  FILE *tf = fopen (tok, "we");
  if (tf == NULL)
    {
      stop_all ();
      return 1;
    }
  fputs (TOKEN "\n", tf);
  fclose (tf);
  int rc = 1;
  json_t *report = NULL;
  if (etcd == NULL)
    {
      etcd_port = free_port ();
      int peer = free_port ();
      char data[300], client[64], peer_url[64], cluster[96];
      snprintf (data, sizeof data, "%s/etcd", tmpdir);
      snprintf (client, sizeof client, "http://127.0.0.1:%d", etcd_port);
      snprintf (peer_url, sizeof peer_url, "http://127.0.0.1:%d", peer);
      snprintf (cluster, sizeof cluster, "b0=%s", peer_url);
      char *eargv[] = { "/usr/bin/etcd",
                        "--name",
                        "b0",
                        "--data-dir",
                        data,
                        "--listen-client-urls",
                        client,
                        "--advertise-client-urls",
                        client,
                        "--listen-peer-urls",
                        peer_url,
                        "--initial-advertise-peer-urls",
                        peer_url,
                        "--initial-cluster",
                        cluster,
                        NULL };
      if (spawn ("etcd", eargv, log) < 0)
        {
          fprintf (stderr, "bench cluster: cannot start /usr/bin/etcd (Debian etcd-server)\n");
          goto out;
        }
      snprintf (urls, sizeof urls, "%s", client);
    }
  else
    {
      snprintf (urls, sizeof urls, "%s", etcd);
      const char *colon = strrchr (etcd + 7, ':');
      etcd_port = colon ? atoi (colon + 1) : 2379;
    }
  if (!wait_until (etcd_healthy, NULL, 60))
    {
      fprintf (stderr, "bench cluster: etcd not healthy (log: %s)\n", log);
      goto out;
    }
  int sim_port = free_port (), one_port = free_port ();
  char listen[64], one_listen[64], nbuf[32], ttlbuf[16], capbuf[32];
  snprintf (listen, sizeof listen, "tcp:127.0.0.1:%d", sim_port);
  snprintf (one_listen, sizeof one_listen, "tcp:127.0.0.1:%d", one_port);
  snprintf (nbuf, sizeof nbuf, "%zu", nodes);
  snprintf (ttlbuf, sizeof ttlbuf, "%d", ttl);
  snprintf (capbuf, sizeof capbuf, "%zu", total / nodes * 2 + 1000);
  progress ("starting %zu simulated nodes and 2 gateways (etcd %s)", nodes, urls);
  char *sargv[] = { sim_bin,
                    "--cluster",
                    urls,
                    "--listen",
                    listen,
                    "--nodes",
                    nbuf,
                    "--name-prefix",
                    "sim",
                    "--capacity",
                    capbuf,
                    "--label",
                    "warren.bench=sim",
                    "--token-file",
                    tok,
                    "--lease-ttl",
                    "30",
                    NULL };
  char *oargv[] = { sim_bin,
                    "--cluster",
                    urls,
                    "--listen",
                    one_listen,
                    "--nodes",
                    "1",
                    "--name-prefix",
                    "direct",
                    "--label",
                    "warren.bench=direct",
                    "--token-file",
                    tok,
                    "--lease-ttl",
                    ttlbuf,
                    NULL };
  pid_t one_pid = spawn ("warren-sim (direct)", oargv, log);
  if (spawn ("warren-sim", sargv, log) < 0 || one_pid < 0)
    goto out;
  int real_port = real_rootfs ? start_real_node (real_rootfs, urls, tok, log) : 0;
  if (real_port < 0)
    goto out;
  int gw_ports[2];
  for (int i = 0; i < 2; i++)
    {
      gw_ports[i] = free_port ();
      char gl[64];
      snprintf (gl, sizeof gl, "tcp:127.0.0.1:%d", gw_ports[i]);
      char *gargv[] = { gw_bin, "--cluster",         urls, "--listen", gl, "--token-file",
                        tok,    "--node-token-file", tok,  NULL };
      if (spawn ("warren-gateway", gargv, log) < 0)
        goto out;
    }
  for (int i = 0; i < 2; i++)
    {
      struct ready_arg a = { gw_ports[i], nodes + 1 + (real_port > 0) };
      if (!wait_until (gateway_ready, &a, 120))
        {
          fprintf (stderr, "bench cluster: gateway %d never saw %zu ready nodes (log: %s)\n", i,
                   nodes + 1 + (real_port > 0), log);
          goto out;
        }
    }
  report = json_object ();
  json_object_set_new (report, "benchmark", json_string ("cluster"));
  json_object_set_new (report, "cpus", json_integer (sysconf (_SC_NPROCESSORS_ONLN)));
  char direct_prefix[64];
  snprintf (direct_prefix, sizeof direct_prefix, "/n/direct-0");
  json_object_set_new (
      report, "gateway_overhead",
      overhead (gw_ports[0], one_port, direct_prefix, "simulated", "direct", blocks, 50));
  if (real_port > 0)
    json_object_set_new (
        report, "gateway_overhead_real",
        overhead (gw_ports[0], real_port, "", "warrend (container)", "real", blocks, 20));
  json_object_set_new (report, "control_plane",
                       control_plane (gw_ports[0], gw_ports[1], nodes, total, clients, sim_port));
  json_object_set_new (report, "node_loss", node_loss (gw_ports[0], one_pid, "direct-0", ttl));
  json_object_set_new (report, "targets", verdicts (report));
  rc = 0;
out:
  stop_all ();
  if (report)
    {
      char *s = json_dumps (report, JSON_INDENT (2) | JSON_PRESERVE_ORDER);
      puts (s);
      free (s);
      json_decref (report);
    }
  return rc;
}

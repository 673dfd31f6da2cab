/* warren-sim: many simulated cluster nodes in one process (docs/cluster.md,
 * "Simulation and scale"). Each node registers in etcd exactly as warrend
 * does (the same keys, one lease per node, the same status JSON through
 * src/cluster/member.c) and answers the node API a gateway uses, but makes
 * no sandboxes: a create records a few bytes and answers with an id that
 * carries the node's prefix, an exec answers a canned success. Gateways,
 * placement, routing and quotas stay real.
 *
 * One event loop and one listener serve every node: node NAME advertises
 * http://ADDR:PORT/n/NAME and the gateway prefixes its requests with that
 * path. Two threads do the etcd I/O, as in warrend: one registers and keeps
 * the leases alive, one writes the status of the nodes that changed, at most
 * once a second per node, batched into transactions (a batch of 128 nodes'
 * writes is one etcd round trip and one revision; the keys are written as
 * separately as a real node's). */
#include <fcntl.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <unistd.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>

#include "cluster/etcd.h"
#include "cluster/keys.h"
#include "cluster/member.h"
#include "common/util.h"

#define SIM_MAX_NODES 100000
#define SIM_HASH_BITS 20

struct sim_sb
{
  uint64_t rnd; /* the id's 12 hex digits */
  struct sim_sb *hnext;
  struct sim_sb *prev, *next; /* the node's list */
  uint32_t node;
  int32_t memory_mb;
  double created_at;
  char *image;
  char backend[12];
  bool paused;
  json_t *labels; /* NULL: none */
};

struct sim_node
{
  char name[WR_NODE_NAME_MAX + 1];
  char advertise[128];
  /* under sim.mu: the loop changes the counts, the status thread reads them */
  long long sandboxes, memory_mb;
  json_t *projects;
  unsigned long gen, published;
  /* lease thread only (lease read by the status thread: atomic) */
  _Atomic int64_t lease;
  int64_t lost_at_ms;
  uint64_t next_keepalive_ms;
  uint64_t last_put_ms; /* status thread only */
  struct sim_sb *list;  /* loop only */
};

static struct
{
  const char *urls, *prefix, *host;
  int port;
  size_t n_nodes;
  long long capacity, memory_total_mb;
  long ttl_s;
  json_t *labels, *backends;
  char token[256];
  struct sim_node *nodes;
  struct sim_sb *hash[1u << SIM_HASH_BITS];
  pthread_mutex_t mu;
  struct wr_etcd *etcd, *lease_etcd;
  volatile bool stop;
  double started_at;
  _Atomic uint64_t registered, status_writes, status_txns, keepalives, creates, deletes, execs;
  struct event_base *base;
} sim = { .prefix = "sim",
          .n_nodes = 10,
          .capacity = 1000,
          .memory_total_mb = 1 << 20,
          .ttl_s = 10,
          .mu = PTHREAD_MUTEX_INITIALIZER };

/* ---- the sandbox table ---- */

static int64_t
realtime_ms (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t
bucket (uint64_t rnd)
{
  return (size_t)((rnd * 0x9E3779B97F4A7C15ull) >> (64 - SIM_HASH_BITS));
}

static struct sim_sb *
sb_find (uint64_t rnd)
{
  for (struct sim_sb *s = sim.hash[bucket (rnd)]; s; s = s->hnext)
    if (s->rnd == rnd)
      return s;
  return NULL;
}

static uint64_t
rnd48 (void)
{
  static uint64_t state;
  if (state == 0 && getrandom (&state, sizeof state, 0) != sizeof state)
    state = wr_now_ns () | 1;
  for (;;)
    {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      uint64_t r = state & 0xffffffffffffull;
      if (sb_find (r) == NULL)
        return r;
    }
}

static const char *
project_of (const json_t *labels)
{
  return json_string_value (json_object_get (labels, WR_LABEL_PROJECT));
}

/* Count a sandbox in or out of its node's status; under sim.mu. */
static void
account (struct sim_node *n, const struct sim_sb *s, int sign)
{
  n->sandboxes += sign;
  n->memory_mb += sign * s->memory_mb;
  const char *p = project_of (s->labels);
  if (p && sign > 0)
    wr_node_status_count_project (n->projects, p, s->memory_mb);
  else if (p)
    {
      json_t *pj = json_object_get (n->projects, p);
      long long left = json_integer_value (json_object_get (pj, "sandboxes")) - 1;
      if (left <= 0)
        json_object_del (n->projects, p);
      else
        {
          json_object_set_new (pj, "sandboxes", json_integer (left));
          json_object_set_new (
              pj, "memory_mb",
              json_integer (json_integer_value (json_object_get (pj, "memory_mb")) - s->memory_mb));
        }
    }
  n->gen++;
}

static void
sb_free (struct sim_sb *s)
{
  json_decref (s->labels);
  free (s->image);
  free (s);
}

static void
sb_remove (struct sim_sb *s)
{
  struct sim_sb **pp = &sim.hash[bucket (s->rnd)];
  while (*pp != s)
    pp = &(*pp)->hnext;
  *pp = s->hnext;
  struct sim_node *n = &sim.nodes[s->node];
  if (s->prev)
    s->prev->next = s->next;
  else
    n->list = s->next;
  if (s->next)
    s->next->prev = s->prev;
  pthread_mutex_lock (&sim.mu);
  account (n, s, -1);
  pthread_mutex_unlock (&sim.mu);
  sb_free (s);
}

static json_t *
sb_json (const struct sim_sb *s)
{
  char id[64];
  snprintf (id, sizeof id, "%s-%012llx", sim.nodes[s->node].name, (unsigned long long)s->rnd);
  return json_pack ("{s:s,s:s,s:s,s:s,s:f,s:i,s:o,s:b,s:b}", "id", id, "backend", s->backend,
                    "image", s->image, "state", s->paused ? "paused" : "running", "created_at",
                    s->created_at, "memory_mb", (int)s->memory_mb, "labels",
                    s->labels ? json_incref (s->labels) : json_object (), "pooled", 0, "simulated",
                    1);
}

/* ---- HTTP ---- */

static void
reply_json (struct evhttp_request *req, int status, json_t *j)
{
  char *text = j ? json_dumps (j, JSON_COMPACT) : NULL;
  json_decref (j);
  struct evbuffer *b = evbuffer_new ();
  if (text)
    evbuffer_add (b, text, strlen (text));
  free (text);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, status < 300 ? "OK" : "Error", b);
  evbuffer_free (b);
}

static void
reply_error (struct evhttp_request *req, int status, const char *code, const char *msg)
{
  reply_json (req, status,
              json_pack ("{s:{s:s,s:s},s:b}", "error", "code", code, "message", msg,
                         "infra_failure", status >= 500));
}

static json_t *
body_json (struct evhttp_request *req)
{
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  size_t len = evbuffer_get_length (in);
  if (len == 0)
    return json_object ();
  return json_loadb ((const char *)evbuffer_pullup (in, -1), len, 0, NULL);
}

static void
create (struct evhttp_request *req, uint32_t ni)
{
  struct sim_node *n = &sim.nodes[ni];
  json_t *body = body_json (req);
  if (!json_is_object (body))
    {
      json_decref (body);
      reply_error (req, 400, WR_E_INVALID, "the body must be a JSON object");
      return;
    }
  json_t *v = json_object_get (body, "memory_mb");
  long long mem = json_is_integer (v) ? json_integer_value (v) : 1024;
  if (n->sandboxes >= sim.capacity || n->memory_mb + mem > sim.memory_total_mb)
    {
      json_decref (body);
      reply_error (req, 429, WR_E_EXHAUSTED, "simulated node is full");
      return;
    }
  struct sim_sb *s = calloc (1, sizeof *s);
  if (s == NULL)
    {
      json_decref (body);
      reply_error (req, 500, WR_E_INTERNAL, "out of memory");
      return;
    }
  s->rnd = rnd48 ();
  s->node = ni;
  s->memory_mb = (int32_t)mem;
  s->created_at = (double)realtime_ms () / 1000.0;
  s->image = strdup (json_string_value (json_object_get (body, "image")) ?: "busybox:latest");
  snprintf (s->backend, sizeof s->backend, "%s",
            json_string_value (json_object_get (body, "backend")) ?: "container");
  json_t *labels = json_object_get (body, "labels");
  if (json_is_object (labels) && json_object_size (labels) > 0)
    s->labels = json_incref (labels);
  json_decref (body);
  size_t b = bucket (s->rnd);
  s->hnext = sim.hash[b];
  sim.hash[b] = s;
  s->next = n->list;
  if (n->list)
    n->list->prev = s;
  n->list = s;
  pthread_mutex_lock (&sim.mu);
  account (n, s, +1);
  pthread_mutex_unlock (&sim.mu);
  sim.creates++;
  reply_json (req, 201, sb_json (s));
}

static void
list (struct evhttp_request *req, uint32_t ni)
{
  json_t *a = json_array ();
  for (struct sim_sb *s = sim.nodes[ni].list; s; s = s->next)
    json_array_append_new (a, sb_json (s));
  reply_json (req, 200, json_pack ("{s:o}", "sandboxes", a));
}

/* /v1/sandboxes/ID[/SUB] of node ni */
static void
one (struct evhttp_request *req, uint32_t ni, const char *rest)
{
  const struct sim_node *n = &sim.nodes[ni];
  size_t nl = strlen (n->name);
  char *end = NULL;
  uint64_t rnd = 0;
  if (strncmp (rest, n->name, nl) == 0 && rest[nl] == '-')
    rnd = strtoull (rest + nl + 1, &end, 16);
  struct sim_sb *s = end && end - (rest + nl + 1) == WR_ID_RANDOM_HEX ? sb_find (rnd) : NULL;
  if (s == NULL || s->node != ni || (*end != '\0' && *end != '/'))
    {
      reply_error (req, 404, WR_E_NOT_FOUND, "no such sandbox");
      return;
    }
  const char *sub = *end == '/' ? end + 1 : "";
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (*sub == '\0' && m == EVHTTP_REQ_GET)
    reply_json (req, 200, sb_json (s));
  else if (*sub == '\0' && m == EVHTTP_REQ_DELETE)
    {
      sb_remove (s);
      sim.deletes++;
      evhttp_send_reply (req, 204, "No Content", NULL);
    }
  else if (strcmp (sub, "exec") == 0 && m == EVHTTP_REQ_POST)
    {
      sim.execs++;
      reply_json (req, 200,
                  json_pack ("{s:i,s:n,s:b,s:b,s:b,s:b,s:i,s:s,s:s}", "exit_code", 0, "signal",
                             "timed_out", 0, "oom_killed", 0, "truncated", 0, "simulated", 1,
                             "duration_ms", 0, "stdout", "", "stderr", ""));
    }
  else if ((strcmp (sub, "pause") == 0 || strcmp (sub, "resume") == 0) && m == EVHTTP_REQ_POST)
    {
      s->paused = sub[0] == 'p';
      reply_json (req, 200, sb_json (s));
    }
  else
    reply_error (req, 501, "not_implemented",
                 "a simulated node has no files, streams or snapshots");
}

static json_t *
stats_json (void)
{
  long long sandboxes = 0;
  pthread_mutex_lock (&sim.mu);
  for (size_t i = 0; i < sim.n_nodes; i++)
    sandboxes += sim.nodes[i].sandboxes;
  pthread_mutex_unlock (&sim.mu);
  return json_pack ("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "nodes", (json_int_t)sim.n_nodes,
                    "registered", (json_int_t)sim.registered, "sandboxes", (json_int_t)sandboxes,
                    "status_writes", (json_int_t)sim.status_writes, "status_txns",
                    (json_int_t)sim.status_txns, "keepalives", (json_int_t)sim.keepalives,
                    "creates", (json_int_t)sim.creates, "deletes", (json_int_t)sim.deletes, "execs",
                    (json_int_t)sim.execs);
}

/* Node index of "PREFIX-N" or -1. */
static long
node_index (const char *name, size_t len)
{
  size_t pl = strlen (sim.prefix);
  if (len <= pl + 1 || strncmp (name, sim.prefix, pl) != 0 || name[pl] != '-')
    return -1;
  long i = 0;
  for (size_t k = pl + 1; k < len; k++)
    {
      if (name[k] < '0' || name[k] > '9' || i > SIM_MAX_NODES)
        return -1;
      i = i * 10 + (name[k] - '0');
    }
  return i < (long)sim.n_nodes && strlen (sim.nodes[i].name) == len
                 && memcmp (sim.nodes[i].name, name, len) == 0
             ? i
             : -1;
}

static void
route (struct evhttp_request *req, void *arg WR_UNUSED)
{
  const char *path = evhttp_uri_get_path (evhttp_request_get_evhttp_uri (req));
  if (path == NULL)
    path = "/";
  if (sim.token[0])
    {
      const char *h = evhttp_find_header (evhttp_request_get_input_headers (req), "Authorization");
      if (h == NULL || strncmp (h, "Bearer ", 7) != 0 || strcmp (h + 7, sim.token) != 0)
        {
          reply_error (req, 401, WR_E_UNAUTHORIZED, "bad or missing bearer token");
          return;
        }
    }
  if (strcmp (path, "/healthz") == 0 || strcmp (path, "/v1/sim") == 0)
    {
      reply_json (req, 200, stats_json ());
      return;
    }
  if (strncmp (path, "/n/", 3) != 0)
    {
      reply_error (req, 404, WR_E_NOT_FOUND, "want /n/NODE/...");
      return;
    }
  const char *name = path + 3, *slash = strchr (name, '/');
  long ni = node_index (name, slash ? (size_t)(slash - name) : strlen (name));
  if (ni < 0)
    {
      reply_error (req, 404, WR_E_NOT_FOUND, "no such simulated node");
      return;
    }
  const char *rest = slash ? slash : "/";
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (strcmp (rest, "/healthz") == 0)
    reply_json (req, 200, json_pack ("{s:s,s:s}", "status", "ok", "version", WARREN_VERSION));
  else if (strcmp (rest, "/v1/sandboxes") == 0 && m == EVHTTP_REQ_POST)
    create (req, (uint32_t)ni);
  else if (strcmp (rest, "/v1/sandboxes") == 0 && m == EVHTTP_REQ_GET)
    list (req, (uint32_t)ni);
  else if (strncmp (rest, "/v1/sandboxes/", 14) == 0)
    one (req, (uint32_t)ni, rest + 14);
  else if (strcmp (rest, "/v1/images") == 0 && m == EVHTTP_REQ_GET)
    reply_json (req, 200, json_pack ("{s:[]}", "images"));
  else
    reply_error (req, 404, WR_E_NOT_FOUND, "not simulated");
}

/* ---- etcd: leases and status ---- */

static char *
status_text (struct sim_node *n, unsigned long *ret_gen)
{
  pthread_mutex_lock (&sim.mu);
  struct wr_node_status st = {
    .name = n->name,
    .advertise = n->advertise,
    .labels = sim.labels,
    .backends = sim.backends,
    .projects = n->projects,
    .sandboxes = n->sandboxes,
    .memory_reserved_mb = n->memory_mb,
    .memory_total_mb = sim.memory_total_mb,
    .memory_free_mb = sim.memory_total_mb - n->memory_mb,
    .cpus = 1,
    .started_at = sim.started_at,
    .lost_at_ms = n->lost_at_ms,
  };
  json_t *j = wr_node_status_json (&st);
  *ret_gen = n->gen;
  pthread_mutex_unlock (&sim.mu);
  char *text = j ? json_dumps (j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
  json_decref (j);
  return text;
}

static void *
lease_main (void *arg WR_UNUSED)
{
  bool complained = false;
  while (!sim.stop)
    {
      uint64_t now = wr_now_ms ();
      for (size_t i = 0; i < sim.n_nodes && !sim.stop; i++)
        {
          struct sim_node *n = &sim.nodes[i];
          wr_err_t err;
          int64_t lease = atomic_load (&n->lease);
          if (lease == 0)
            {
              unsigned long gen;
              _cleanup_free_ char *text = status_text (n, &gen);
              if (text == NULL
                  || wr_node_register (sim.etcd, n->name, text, sim.ttl_s, &lease, &err) < 0)
                {
                  if (!complained && text)
                    fprintf (stderr, "warren-sim: registering %s: %s (retrying)\n", n->name,
                             err.msg);
                  complained = true;
                  usleep (200 * 1000);
                  break;
                }
              complained = false;
              pthread_mutex_lock (&sim.mu);
              n->published = gen;
              pthread_mutex_unlock (&sim.mu);
              atomic_store (&n->lease, lease);
              sim.registered++;
              n->next_keepalive_ms = wr_now_ms () + (uint64_t)sim.ttl_s * 1000 / 4;
            }
          else if (now >= n->next_keepalive_ms)
            {
              int64_t ttl = 0;
              if (wr_etcd_lease_keepalive (sim.lease_etcd, lease, &ttl, &err) < 0)
                n->next_keepalive_ms = now + 200;
              else if (ttl <= 0)
                {
                  /* the cluster declared this node lost: say so, as warrend does */
                  n->lost_at_ms = realtime_ms ();
                  atomic_store (&n->lease, 0);
                  sim.registered--;
                }
              else
                {
                  sim.keepalives++;
                  n->next_keepalive_ms = now + (uint64_t)sim.ttl_s * 1000 / 4;
                }
            }
        }
      usleep (20 * 1000);
    }
  for (size_t i = 0; i < sim.n_nodes; i++)
    {
      int64_t lease = atomic_exchange (&sim.nodes[i].lease, 0);
      if (lease)
        wr_etcd_lease_revoke (sim.lease_etcd, lease, NULL);
    }
  return NULL;
}

static void
flush (size_t k, struct sim_node **batch, char **texts, unsigned long *gens)
{
  if (k == 0)
    return;
  const char *names[WR_NODE_TXN_MAX];
  int64_t leases[WR_NODE_TXN_MAX];
  bool ok[WR_NODE_TXN_MAX];
  for (size_t i = 0; i < k; i++)
    {
      names[i] = batch[i]->name;
      leases[i] = atomic_load (&batch[i]->lease);
      ok[i] = false;
    }
  wr_err_t err;
  sim.status_txns++;
  if (wr_node_publish_many (sim.etcd, k, names, (const char *const *)texts, leases, &err) == 0)
    for (size_t i = 0; i < k; i++)
      ok[i] = true;
  else
    /* a lease expired meanwhile (the whole transaction failed): one by one */
    for (size_t i = 0; i < k; i++)
      ok[i] = wr_node_publish_many (sim.etcd, 1, &names[i], (const char *const *)&texts[i],
                                    &leases[i], &err)
              == 0;
  uint64_t now = wr_now_ms ();
  for (size_t i = 0; i < k; i++)
    {
      if (ok[i])
        {
          sim.status_writes++;
          pthread_mutex_lock (&sim.mu);
          batch[i]->published = gens[i];
          pthread_mutex_unlock (&sim.mu);
        }
      batch[i]->last_put_ms = now;
      free (texts[i]);
    }
}

static void *
status_main (void *arg WR_UNUSED)
{
  struct sim_node *batch[WR_NODE_TXN_MAX];
  char *texts[WR_NODE_TXN_MAX];
  unsigned long gens[WR_NODE_TXN_MAX];
  while (!sim.stop)
    {
      usleep (100 * 1000);
      uint64_t now = wr_now_ms ();
      size_t k = 0;
      for (size_t i = 0; i < sim.n_nodes && !sim.stop; i++)
        {
          struct sim_node *n = &sim.nodes[i];
          if (atomic_load (&n->lease) == 0 || now - n->last_put_ms < WR_NODE_PUBLISH_MIN_MS)
            continue;
          pthread_mutex_lock (&sim.mu);
          bool changed = n->gen != n->published;
          pthread_mutex_unlock (&sim.mu);
          if (!changed)
            continue;
          texts[k] = status_text (n, &gens[k]);
          if (texts[k] == NULL)
            continue;
          batch[k++] = n;
          if (k == WR_NODE_TXN_MAX)
            {
              flush (k, batch, texts, gens);
              k = 0;
            }
        }
      flush (k, batch, texts, gens);
    }
  return NULL;
}

/* ---- main ---- */

static void
usage (FILE *f)
{
  fprintf (f,
           "usage: warren-sim --cluster http://H:P[,...] --listen tcp:ADDR:PORT [--nodes N]\n"
           "                  [--name-prefix P] [--capacity N] [--memory-mb MB] [--lease-ttl S]\n"
           "                  [--label K=V]... [--backends B,...] [--token-file F]\n"
           "Runs N simulated cluster nodes P-0 .. P-(N-1) in one process: each registers in\n"
           "etcd as warrend does and answers the node API at http://ADDR:PORT/n/NAME,\n"
           "without making sandboxes (docs/cluster.md, \"Simulation and scale\").\n"
           "Defaults: 10 nodes, prefix sim, capacity 1000 sandboxes and 1048576 MB per\n"
           "node, lease TTL 10 s, backends container.\n");
}

static int
read_token (const char *path)
{
  _cleanup_free_ char *tok = NULL;
  size_t len;
  if (wr_read_file_at (AT_FDCWD, path, &tok, &len, 4096) < 0)
    {
      fprintf (stderr, "warren-sim: cannot read token file %s: %m\n", path);
      return -1;
    }
  while (len && (tok[len - 1] == '\n' || tok[len - 1] == '\r' || tok[len - 1] == ' '))
    tok[--len] = '\0';
  if (len == 0 || len >= sizeof sim.token)
    {
      fprintf (stderr, "warren-sim: bad token in %s\n", path);
      return -1;
    }
  memcpy (sim.token, tok, len + 1);
  return 0;
}

static int
listen_on (const char *spec)
{
  if (strncmp (spec, "tcp:", 4) != 0)
    return -1;
  static char host[256];
  snprintf (host, sizeof host, "%s", spec + 4);
  char *colon = strrchr (host, ':');
  if (colon == NULL)
    return -1;
  *colon = '\0';
  sim.host = host;
  sim.port = atoi (colon + 1);
  struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)sim.port) };
  if (sim.port <= 0 || sim.port > 65535 || inet_pton (AF_INET, host, &sa.sin_addr) != 1)
    return -1;
  int fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt (fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt (fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  /* every gateway keeps connections to every node, all on this one socket */
  if (fd < 0 || bind (fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen (fd, 4096) < 0)
    {
      fprintf (stderr, "warren-sim: listen %s: %m\n", spec);
      return -2;
    }
  return fd;
}

static void
on_signal (evutil_socket_t sig WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  event_base_loopbreak (sim.base);
}

int
main (int argc, char **argv)
{
  const char *listen_spec = NULL, *token_file = NULL, *backends = "container";
  static const struct option opts[] = {
    { "cluster", required_argument, NULL, 'c' },
    { "listen", required_argument, NULL, 'l' },
    { "nodes", required_argument, NULL, 'n' },
    { "name-prefix", required_argument, NULL, 'p' },
    { "capacity", required_argument, NULL, 'C' },
    { "memory-mb", required_argument, NULL, 'm' },
    { "lease-ttl", required_argument, NULL, 'T' },
    { "label", required_argument, NULL, 'L' },
    { "backends", required_argument, NULL, 'b' },
    { "token-file", required_argument, NULL, 't' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
  };
  sim.labels = json_object ();
  int c;
  while ((c = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (c)
      {
      case 'c':
        sim.urls = optarg;
        break;
      case 'l':
        listen_spec = optarg;
        break;
      case 'n':
        sim.n_nodes = strtoul (optarg, NULL, 10);
        break;
      case 'p':
        sim.prefix = optarg;
        break;
      case 'C':
        sim.capacity = strtoll (optarg, NULL, 10);
        break;
      case 'm':
        sim.memory_total_mb = strtoll (optarg, NULL, 10);
        break;
      case 'T':
        sim.ttl_s = strtol (optarg, NULL, 10);
        break;
      case 'L':
        {
          char *eq = strchr (optarg, '=');
          if (eq == NULL || eq == optarg)
            {
              fprintf (stderr, "warren-sim: --label wants K=V\n");
              return 2;
            }
          *eq = '\0';
          json_object_set_new (sim.labels, optarg, json_string (eq + 1));
          break;
        }
      case 'b':
        backends = optarg;
        break;
      case 't':
        token_file = optarg;
        break;
      case 'h':
        usage (stdout);
        return 0;
      default:
        usage (stderr);
        return 2;
      }
  if (sim.urls == NULL || listen_spec == NULL)
    {
      usage (stderr);
      return 2;
    }
  if (sim.n_nodes < 1 || sim.n_nodes > SIM_MAX_NODES || sim.capacity < 1 || sim.memory_total_mb < 1
      || sim.ttl_s < 2 || sim.ttl_s > 3600)
    {
      fprintf (stderr,
               "warren-sim: --nodes 1..%d, --capacity and --memory-mb >= 1, "
               "--lease-ttl 2..3600\n",
               SIM_MAX_NODES);
      return 2;
    }
  char probe[WR_NODE_NAME_MAX + 8];
  snprintf (probe, sizeof probe, "%s-%zu", sim.prefix, sim.n_nodes - 1);
  if (!wr_node_name_valid (probe))
    {
      fprintf (stderr, "warren-sim: node names %s-N must be [a-z0-9-]{1,%d}\n", sim.prefix,
               WR_NODE_NAME_MAX);
      return 2;
    }
  if (token_file && read_token (token_file) < 0)
    return 1;
  sim.backends = json_array ();
  _cleanup_free_ char *bcopy = strdup (backends);
  char *save = NULL;
  for (char *b = strtok_r (bcopy, ",", &save); b; b = strtok_r (NULL, ",", &save))
    json_array_append_new (sim.backends, json_string (b));
  int fd = listen_on (listen_spec);
  if (fd < 0)
    {
      if (fd == -1)
        fprintf (stderr, "warren-sim: --listen wants tcp:IPV4:PORT\n");
      return 1;
    }
  wr_err_t err;
  if (wr_etcd_new (sim.urls, 3000, &sim.etcd, &err) < 0
      || wr_etcd_new (sim.urls, (int)(sim.ttl_s * 1000 / 4 < 3000 ? sim.ttl_s * 1000 / 4 : 3000),
                      &sim.lease_etcd, &err)
             < 0)
    {
      fprintf (stderr, "warren-sim: %s\n", err.msg);
      return 2;
    }
  sim.nodes = calloc (sim.n_nodes, sizeof *sim.nodes);
  if (sim.nodes == NULL)
    return 1;
  for (size_t i = 0; i < sim.n_nodes; i++)
    {
      struct sim_node *n = &sim.nodes[i];
      snprintf (n->name, sizeof n->name, "%s-%zu", sim.prefix, i);
      snprintf (n->advertise, sizeof n->advertise, "http://%s:%d/n/%s", sim.host, sim.port,
                n->name);
      n->projects = json_object ();
    }
  sim.started_at = (double)time (NULL);
  struct rlimit rl;
  if (getrlimit (RLIMIT_NOFILE, &rl) == 0)
    {
      rl.rlim_cur = rl.rlim_max;
      setrlimit (RLIMIT_NOFILE, &rl);
    }
  signal (SIGPIPE, SIG_IGN);
  evthread_use_pthreads ();
  sim.base = event_base_new ();
  struct evhttp *http = evhttp_new (sim.base);
  evhttp_set_gencb (http, route, NULL);
  evhttp_set_allowed_methods (http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_PUT
                                        | EVHTTP_REQ_DELETE | EVHTTP_REQ_HEAD);
  evhttp_set_timeout (http, 3600);
  if (evhttp_accept_socket (http, fd) < 0)
    {
      fprintf (stderr, "warren-sim: cannot serve %s\n", listen_spec);
      return 1;
    }
  pthread_t lease_thread, status_thread;
  if (pthread_create (&lease_thread, NULL, lease_main, NULL) != 0
      || pthread_create (&status_thread, NULL, status_main, NULL) != 0)
    return 1;
  struct event *sigint = evsignal_new (sim.base, SIGINT, on_signal, NULL);
  struct event *sigterm = evsignal_new (sim.base, SIGTERM, on_signal, NULL);
  evsignal_add (sigint, NULL);
  evsignal_add (sigterm, NULL);
  fprintf (stderr, "warren-sim: %zu nodes %s-0.. on %s (cluster %s)\n", sim.n_nodes, sim.prefix,
           listen_spec, sim.urls);
  event_base_dispatch (sim.base);
  /* leave the cluster at once: revoke every lease */
  sim.stop = true;
  pthread_join (status_thread, NULL);
  pthread_join (lease_thread, NULL);
  evhttp_free (http);
  event_free (sigint);
  event_free (sigterm);
  event_base_free (sim.base);
  for (size_t i = 0; i < WR_ARRAY_SIZE (sim.hash); i++)
    for (struct sim_sb *s = sim.hash[i], *next; s; s = next)
      {
        next = s->hnext;
        sb_free (s);
      }
  for (size_t i = 0; i < sim.n_nodes; i++)
    json_decref (sim.nodes[i].projects);
  free (sim.nodes);
  json_decref (sim.labels);
  json_decref (sim.backends);
  wr_etcd_free (sim.etcd);
  wr_etcd_free (sim.lease_etcd);
  return 0;
}

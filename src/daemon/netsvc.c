/* Sandbox network policy, the daemon's half (docs/network.md): parses and
 * resolves rules, keeps named services in SQLite, answers each networked
 * sandbox's DNS (allowed names are forwarded upstream and their answers
 * added to the sandbox's allowed set; every other name gets NXDOMAIN), and
 * serves the PATCH, services and proxy routes. The kernel half is
 * src/backend/net.c. */
#include "daemon/netsvc.h"
#include "daemon/daemon.h"
#include "daemon/http_util.h"
#include "daemon/log.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <sys/queue.h>
#include <event2/keyvalq_struct.h>

#include "backend/net.h"
#include "backend/pool.h"
#include "backend/vm.h"
#include "common/util.h"

#define MAX_RULES 256
#define MAX_ADDRS 1024
/* UDP questions out to the upstream at once, per sandbox (the oldest is
 * given up for a new one: its client asks again) */
#define PENDING 64
/* DNS over TCP (a resolver's fallback for truncated answers): connections
 * per sandbox, the largest question taken, and how long a connection may
 * idle or wait for the upstream */
#define DNS_TCP_CONNS 8
#define DNS_TCP_QUERY_MAX 4096
#define DNS_TCP_TIMEOUT_S 10

struct dns_tcp;

struct sbnet
{
  struct sandbox *sb;
  unsigned slot;
  char group[9]; /* 8 hex of the group name, "" = none */
  json_t *names; /* allowed name -> array of [lo, hi] port ranges */
  int dns_fd, up_fd;
  struct event *dns_ev, *up_ev;
  /* each question goes up under an id of the daemon's own (next_id), so
   * two clients' ids, or a client's A and AAAA questions, never share a
   * slot; the answer goes back with the client's id */
  struct
  {
    uint16_t up_id, client_id;
    bool used;
    uint64_t sent;
    struct sockaddr_in from;
  } pend[PENDING];
  uint16_t next_id;
  int tcp_fd; /* DNS over TCP: the listener on the gateway, its connections */
  struct event *tcp_ev;
  struct dns_tcp *tcp_conns;
  unsigned n_tcp;
  /* for re-resolution ("watch" below): the policy's address and CIDR
   * destinations, the addresses its names had when it was applied (until
   * the watch has them), and the addresses that left a name's record while
   * connections to them were kept (name -> [address...]) */
  struct wr_net_allow *fixed;
  size_t n_fixed;
  json_t *seen, *kept;
  struct sbnet *next;
};

static struct wr_net *knet; /* NULL: no networking on this host */
/* namespaces with a sandbox link made ahead, for allow= creates (NULL: none) */
static struct wr_netns_pool *npool;
static char knet_error[256];
static struct sbnet *sbnets;
/* Destroyed sandboxes' slots leave nftables in batches: every transaction
 * costs a read of the whole table (docs/network.md, "Creation cost"), so
 * the slots of sandboxes destroyed within DETACH_DELAY_MS go in one. Their
 * chains outlive them by that long; the slots are not reused before. */
#define DETACH_BATCH 64
#define DETACH_DELAY_MS 50
static struct
{
  unsigned slots[DETACH_BATCH];
  char groups[DETACH_BATCH][9];
  size_t n;
  struct event *ev;
} detaching;
static void detach_flush (evutil_socket_t fd, short what, void *arg);
static struct sockaddr_in upstream;
static struct wrd *wd; /* the daemon (the watch's timers and services) */
static void watch_stop (void);

static struct sbnet *
sbnet_of (struct sandbox *sb)
{
  for (struct sbnet *s = sbnets; s; s = s->next)
    if (s->sb == sb)
      return s;
  return NULL;
}

static const char services_schema[]
    = "CREATE TABLE IF NOT EXISTS net_services (name TEXT PRIMARY KEY, targets TEXT NOT NULL);";

static void
upstream_init (void)
{
  upstream.sin_family = AF_INET;
  upstream.sin_port = htons (53);
  const char *env = getenv ("WARREN_DNS_UPSTREAM");
  char buf[256] = "";
  if (env && *env)
    snprintf (buf, sizeof buf, "%s", env);
  else
    {
      FILE *f = fopen ("/etc/resolv.conf", "re");
      char line[256];
      while (f && fgets (line, sizeof line, f))
        if (sscanf (line, "nameserver %63s", buf) == 1 && strchr (buf, ':') == NULL)
          break;
        else
          buf[0] = 0;
      if (f)
        fclose (f);
    }
  char *colon = strchr (buf, ':');
  if (colon)
    {
      *colon = 0;
      upstream.sin_port = htons ((uint16_t)atoi (colon + 1));
    }
  if (inet_pton (AF_INET, buf[0] ? buf : "127.0.0.1", &upstream.sin_addr) != 1)
    inet_pton (AF_INET, "127.0.0.1", &upstream.sin_addr);
}

/* A daemon that exits without its shutdown (a startup error after init)
 * must not leave its table: with no networked sandbox nothing needs it. */
static void
net_atexit (void)
{
  wr_netns_pool_free (npool);
  npool = NULL;
  if (knet && sbnets == NULL)
    {
      wr_net_free (knet);
      knet = NULL;
    }
}

static int
npool_prepare (void *arg WR_UNUSED, int netns_fd)
{
  wr_err_t e;
  if (wr_net_prepare (knet, netns_fd, &e) < 0)
    {
      wrd_log (WRD_LOG_WARN, "net: prepared links stop: %s\n", e.msg);
      return -1;
    }
  return 0;
}

static void
npool_discard (void *arg WR_UNUSED, int netns_fd)
{
  wr_net_unprepare (knet, netns_fd);
}

/* The pool of networked namespaces (docs/network.md, "Creation cost"):
 * WARREN_NET_POOL=N of them (0: none; default the netns pool's size). An
 * allow= create takes one instead of a plain one and only its policy is
 * left to apply; without one it makes its link itself. */
static void
npool_up (void)
{
  static bool tried; /* one attempt: a failing pool leaves creates to the old path */
  if (tried)
    return;
  tried = true;
  const char *np = getenv ("WARREN_NET_POOL");
  unsigned n = np && *np ? (unsigned)strtoul (np, NULL, 10) : WR_NETNS_POOL_DEFAULT;
  struct wr_netns_pool_hooks h = { npool_prepare, npool_discard, NULL };
  wr_err_t e;
  if (wr_netns_pool_new_hooked (n, &h, &npool, &e) < 0)
    wrd_log (WRD_LOG_WARN, "net: no pool of networked namespaces: %s\n", e.msg);
}

struct wr_netns_pool *
wrd_net_pool (json_t *spec)
{
  return wrd_net_wanted (spec) ? npool : NULL;
}

/* The table and the address block are taken on first use: a daemon that
 * never networks a sandbox leaves nothing in nftables. */
static int
knet_up (struct wrd *d, wr_err_t *err)
{
  static bool registered;
  if (knet)
    return 0;
  wr_err_t e;
  if (wr_net_new (d->root, &knet, &e) < 0)
    {
      knet = NULL;
      snprintf (knet_error, sizeof knet_error, "%s", e.msg);
      wrd_log (WRD_LOG_WARN, "net: no sandbox networking on this host: %s\n", e.msg);
      return wr_error (err, 0, WR_E_UNSUPPORTED, "no sandbox networking on this node: %s",
                       knet_error);
    }
  wrd_log (WRD_LOG_INFO, "net: table inet %s, sandbox block %s\n", wr_net_table (knet),
           wr_net_block (knet));
  if (!registered)
    atexit (net_atexit);
  registered = true;
  return 0;
}

void
wrd_net_init (struct wrd *d)
{
  char *msg = NULL;
  if (sqlite3_exec (d->db, services_schema, NULL, NULL, &msg) != SQLITE_OK)
    {
      wrd_log (WRD_LOG_WARN, "net: services table: %s\n", msg ? msg : "?");
      sqlite3_free (msg);
    }
  upstream_init ();
  wd = d;
  if (d->net_dns_ttl_min == 0)
    d->net_dns_ttl_min = 5;
  if (d->net_dns_ttl_max == 0)
    d->net_dns_ttl_max = 300;
  if (d->net_dns_ttl_max < d->net_dns_ttl_min)
    d->net_dns_ttl_max = d->net_dns_ttl_min;
  /* a claim of ours: a previous run died with networked sandboxes; their
   * table is reset now and their chains come back as they are adopted */
  if (wr_net_claimed (d->root))
    knet_up (d, NULL);
}

void
wrd_net_shutdown (struct wrd *d WR_UNUSED)
{
  /* before the table: its namespaces give their slots back */
  wr_netns_pool_free (npool);
  npool = NULL;
  watch_stop ();
  if (knet == NULL)
    return;
  detach_flush (-1, 0, NULL); /* destroyed sandboxes' slots */
  if (detaching.ev)
    event_free (detaching.ev);
  detaching.ev = NULL;
  if (sbnets) /* networked sandboxes outlive us: keep their rules */
    return;
  wr_net_free (knet);
  knet = NULL;
}

/* ---- rules ---- */

static bool
valid_name (const char *s, size_t len)
{
  if (len == 0 || len > 253)
    return false;
  for (size_t i = 0; i < len; i++)
    if (!isalnum ((unsigned char)s[i]) && s[i] != '-' && s[i] != '.' && s[i] != '_')
      return false;
  return true;
}

static int
parse_ports (const char *p, uint16_t *lo, uint16_t *hi)
{
  if (p == NULL || strcmp (p, "*") == 0)
    {
      *lo = 0;
      *hi = 65535;
      return 0;
    }
  char *end;
  long a = strtol (p, &end, 10), b = a;
  if (end == p)
    return -1;
  if (*end == '-')
    {
      const char *q = end + 1;
      b = strtol (q, &end, 10);
      if (end == q)
        return -1;
    }
  if (*end || a < 1 || b > 65535 || a > b)
    return -1;
  *lo = (uint16_t)a;
  *hi = (uint16_t)b;
  return 0;
}

static const char *
service_targets (struct wrd *d, const char *name, char *buf, size_t len)
{
  sqlite3_stmt *st = NULL;
  const char *r = NULL;
  if (sqlite3_prepare_v2 (d->db, "SELECT targets FROM net_services WHERE name = ?", -1, &st, NULL)
      != SQLITE_OK)
    return NULL;
  sqlite3_bind_text (st, 1, name, -1, SQLITE_STATIC);
  if (sqlite3_step (st) == SQLITE_ROW)
    {
      snprintf (buf, len, "%s", (const char *)sqlite3_column_text (st, 0));
      r = buf;
    }
  sqlite3_finalize (st);
  return r;
}

/* One destination (HOST[:PORTS], IP[/N][:PORTS]); hostnames go to names,
 * addresses to allow. How host names get their addresses: */
enum names_from
{
  NAMES_SYNTAX, /* only the syntax is checked */
  NAMES_LOOKUP, /* asked now, blocking (up to 2 s a name): off the loop only */
  NAMES_CACHED, /* what the watch (below) knows; on the loop, never blocks */
};

struct compiled
{
  struct wr_net_allow allow[MAX_ADDRS];
  size_t n;
  json_t *names;
  struct wr_net_allow fixed[MAX_ADDRS]; /* the address and CIDR destinations */
  size_t n_fixed;
  json_t *seen; /* name -> [address...] resolved (resolve=true) */
};

static int dns_resolve (const char *name, uint32_t *addrs, size_t max, size_t *ret_n);
static size_t watch_cached (const char *name, uint32_t *addrs, size_t max);

static void
add_name (json_t *names, const char *name, uint16_t lo, uint16_t hi)
{
  json_t *a = json_object_get (names, name);
  if (a == NULL)
    json_object_set_new (names, name, a = json_array ());
  json_array_append_new (a, json_pack ("[i,i]", lo, hi));
}

static int
compile_target (const char *t, enum names_from resolve, struct compiled *c, wr_err_t *err)
{
  char host[300];
  const char *colon = strrchr (t, ':');
  size_t hl = colon ? (size_t)(colon - t) : strlen (t);
  if (hl == 0 || hl >= sizeof host)
    return wr_error (err, 0, WR_E_INVALID, "network rule \"%s\": no host", t);
  memcpy (host, t, hl);
  host[hl] = 0;
  uint16_t lo, hi;
  if (parse_ports (colon ? colon + 1 : NULL, &lo, &hi) < 0)
    return wr_error (err, 0, WR_E_INVALID, "network rule \"%s\": ports must be N, N-M or *", t);
  unsigned prefix = 32;
  char *slash = strchr (host, '/');
  if (slash)
    {
      char *end;
      long p = strtol (slash + 1, &end, 10);
      if (*end || end == slash + 1 || p < 0 || p > 32)
        return wr_error (err, 0, WR_E_INVALID, "network rule \"%s\": bad prefix length", t);
      prefix = (unsigned)p;
      *slash = 0;
    }
  struct in_addr a;
  if (inet_pton (AF_INET, host, &a) == 1)
    {
      if (c->n >= MAX_ADDRS)
        return wr_error (err, 0, WR_E_INVALID, "network policy: too many destinations");
      c->allow[c->n++] = (struct wr_net_allow){ ntohl (a.s_addr), (uint8_t)prefix, lo, hi };
      c->fixed[c->n_fixed++] = c->allow[c->n - 1];
      return 0;
    }
  if (slash || !valid_name (host, strlen (host)) || strchr (host, '.') == NULL)
    return wr_error (err, 0, WR_E_INVALID,
                     "network rule \"%s\": not an IPv4 address, CIDR or host name", t);
  for (char *p = host; *p; p++)
    *p = (char)tolower ((unsigned char)*p);
  if (c->names)
    add_name (c->names, host, lo, hi);
  if (resolve == NAMES_SYNTAX)
    return 0;
  uint32_t addrs[64];
  size_t n = 0;
  if (resolve == NAMES_CACHED)
    n = watch_cached (host, addrs, 64);
  else
    dns_resolve (host, addrs, 64, &n); /* a name without records yet is allowed */
  for (size_t i = 0; i < n && c->n < MAX_ADDRS; i++)
    c->allow[c->n++] = (struct wr_net_allow){ addrs[i], 32, lo, hi };
  if (c->seen && n && json_object_get (c->seen, host) == NULL)
    {
      json_t *found = json_array ();
      for (size_t i = 0; i < n; i++)
        json_array_append_new (found, json_integer (addrs[i]));
      json_object_set_new (c->seen, host, found);
    }
  return 0;
}

/* "allow=R1,R2" (or the bare list) into c; rules that are not a
 * destination name a service. */
static int
compile_rules (struct wrd *d, const char *list, enum names_from resolve, struct compiled *c,
               wr_err_t *err)
{
  char *dup = strdup (list), *save = NULL;
  if (dup == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "rules");
  int r = 0, count = 0;
  for (char *rule = strtok_r (dup, ",", &save); rule && r == 0; rule = strtok_r (NULL, ",", &save))
    {
      if (++count > MAX_RULES)
        r = wr_error (err, 0, WR_E_INVALID, "network policy: more than %d rules", MAX_RULES);
      else if (strchr (rule, ':') == NULL && strchr (rule, '/') == NULL
               && strchr (rule, '.') == NULL)
        {
          char targets[4096];
          if (service_targets (d, rule, targets, sizeof targets) == NULL)
            r = wr_error (err, 0, WR_E_INVALID, "network rule \"%s\": no such service", rule);
          char *s2 = NULL;
          for (char *t = r == 0 ? strtok_r (targets, " ", &s2) : NULL; t && r == 0;
               t = strtok_r (NULL, " ", &s2))
            r = compile_target (t, resolve, c, err);
        }
      else
        r = compile_target (rule, resolve, c, err);
    }
  free (dup);
  return r;
}

static const char *
rules_of (json_t *spec)
{
  const char *n = json_string_value (json_object_get (spec, "network"));
  return n && strncmp (n, "allow=", 6) == 0 ? n + 6 : NULL;
}

bool
wrd_net_wanted (json_t *spec)
{
  return rules_of (spec) != NULL;
}

/* Rules as a sorted, de-duplicated "allow=..." string. */
static json_t *
normalise (json_t *rules)
{
  size_t n = json_array_size (rules), len = 7;
  const char **v = calloc (n + 1, sizeof *v);
  for (size_t i = 0; i < n; i++)
    {
      v[i] = json_string_value (json_array_get (rules, i));
      len += strlen (v[i]) + 1;
    }
  qsort (v, n, sizeof *v, (int (*) (const void *, const void *))strverscmp);
  char *s = malloc (len);
  size_t o = (size_t)sprintf (s, "allow=");
  for (size_t i = 0; i < n; i++)
    if (i == 0 || strcmp (v[i], v[i - 1]) != 0)
      o += (size_t)sprintf (s + o, "%s%s", o > 6 ? "," : "", v[i]);
  json_t *j = json_string (s);
  free (s);
  free (v);
  return j;
}

static json_t *
split_rules (const char *list)
{
  json_t *a = json_array ();
  char *dup = strdup (list), *save = NULL;
  for (char *r = strtok_r (dup, ",", &save); r; r = strtok_r (NULL, ",", &save))
    json_array_append_new (a, json_string (r));
  free (dup);
  return a;
}

static int
check_group (json_t *group, wr_err_t *err)
{
  if (group == NULL || json_is_null (group))
    return 0;
  const char *g = json_string_value (group);
  if (g == NULL || !valid_name (g, strlen (g)) || strlen (g) > 64)
    return wr_error (err, 0, WR_E_INVALID, "field \"net_group\" must be 1-64 of [A-Za-z0-9._-]");
  return 0;
}

int
wrd_net_parse (struct wrd *d, json_t *network, json_t *group, json_t **ret_network, wr_err_t *err)
{
  const char *s = network && !json_is_null (network) ? json_string_value (network) : "none";
  if (s == NULL)
    return wr_error (err, 0, WR_E_INVALID,
                     "field \"network\" must be \"none\", \"host\" or \"allow=RULE,...\"");
  if (check_group (group, err) < 0)
    return -EINVAL;
  if (strcmp (s, "none") == 0 || strcmp (s, "host") == 0)
    {
      if (strcmp (s, "host") == 0 && !d->allow_host_network)
        return wr_error (err, 0, WR_E_INVALID,
                         "\"network\": \"host\" is not permitted on this node (warrend runs "
                         "without --allow-host-network)");
      if (group && !json_is_null (group))
        return wr_error (err, 0, WR_E_INVALID, "\"net_group\" needs \"network\": \"allow=...\"");
      *ret_network = json_string (s);
      return 0;
    }
  if (strncmp (s, "allow=", 6) != 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "field \"network\" must be \"none\", \"host\" or \"allow=RULE,...\"");
  if (knet_up (d, err) < 0)
    return -EOPNOTSUPP;
  /* here, not in knet_up: a restarted daemon adopts its sandboxes (and
   * their slots) before it serves, and the pool takes free slots */
  if (npool == NULL)
    npool_up ();
  struct compiled *c = calloc (1, sizeof *c);
  int r = compile_rules (d, s + 6, NAMES_SYNTAX, c, err);
  free (c);
  if (r < 0)
    return r;
  json_t *rules = split_rules (s + 6);
  *ret_network = normalise (rules);
  json_decref (rules);
  return 0;
}

/* ---- egress limits ---- */

#define MAX_EGRESS_KBPS 100000000ull /* 100 Gbit/s */
#define MAX_CONNECTIONS 1000000

/* {"egress_kbps": N, "connections": N} over base (0: unlimited) */
static int
limits_parse (json_t *j, struct wr_net_limits *l, wr_err_t *err)
{
  if (!json_is_object (j))
    return wr_error (err, 0, WR_E_INVALID,
                     "field \"net_limits\" must be {\"egress_kbps\": N, \"connections\": N}");
  const char *k;
  json_t *v;
  json_object_foreach (j, k, v)
  {
    bool rate = strcmp (k, "egress_kbps") == 0;
    if (!rate && strcmp (k, "connections") != 0)
      return wr_error (err, 0, WR_E_INVALID,
                       "\"net_limits\" takes \"egress_kbps\" and \"connections\", not \"%.64s\"",
                       k);
    json_int_t x = json_is_null (v) ? 0 : json_is_integer (v) ? json_integer_value (v) : -1;
    if (x < 0 || (uint64_t)x > (rate ? MAX_EGRESS_KBPS : MAX_CONNECTIONS))
      return wr_error (err, 0, WR_E_INVALID,
                       "\"net_limits\": \"%s\" must be an integer in [0, %llu] (0: unlimited)", k,
                       rate ? MAX_EGRESS_KBPS : (unsigned long long)MAX_CONNECTIONS);
    if (rate)
      l->egress_kbps = (uint64_t)x;
    else
      l->connections = (uint32_t)x;
  }
  return 0;
}

static void
limits_of (json_t *spec, struct wr_net_limits *l)
{
  json_t *j = json_object_get (spec, "net_limits");
  l->egress_kbps = (uint64_t)json_integer_value (json_object_get (j, "egress_kbps"));
  l->connections = (uint32_t)json_integer_value (json_object_get (j, "connections"));
}

static json_t *
limits_json (const struct wr_net_limits *l)
{
  return json_pack ("{s:I,s:I}", "egress_kbps", (json_int_t)l->egress_kbps, "connections",
                    (json_int_t)l->connections);
}

int
wrd_net_parse_limits (struct wrd *d, json_t *limits, const char *network, json_t **ret_limits,
                      wr_err_t *err)
{
  *ret_limits = NULL;
  bool allow = network && strncmp (network, "allow=", 6) == 0;
  /* the daemon's defaults (--net-default-*), where the request names none */
  struct wr_net_limits l = { d->net_default_egress_kbps, (uint32_t)d->net_default_connections };
  if (limits && !json_is_null (limits))
    {
      if (limits_parse (limits, &l, err) < 0)
        return -EINVAL;
      if (!allow)
        return wr_error (err, 0, WR_E_INVALID, "\"net_limits\" needs \"network\": \"allow=...\"");
    }
  if (allow && (l.egress_kbps || l.connections))
    *ret_limits = limits_json (&l);
  return 0;
}

/* ---- applying ---- */

static int
apply (struct wrd *d, struct sbnet *s, const char *rules, enum names_from resolve, wr_err_t *err)
{
  struct compiled *c = calloc (1, sizeof *c);
  if (c == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "policy");
  c->names = json_object ();
  c->seen = json_object ();
  int r = compile_rules (d, rules, resolve, c, err);
  /* the sandbox's egress limits, in the policy's transaction */
  struct wr_net_limits lim;
  limits_of (s->sb->spec, &lim);
  if (r == 0)
    r = wr_net_set_limits (knet, s->slot, &lim, true, err);
  if (r == 0)
    r = wr_net_set_policy (knet, s->slot, c->allow, c->n, s->group[0] ? s->group : NULL,
                           json_object_size (c->names) > 0, err);
  struct wr_net_allow *fixed = NULL;
  if (r == 0 && c->n_fixed && (fixed = malloc (c->n_fixed * sizeof *fixed)) == NULL)
    r = wr_error (err, ENOMEM, WR_E_INTERNAL, "policy");
  if (r == 0)
    {
      json_decref (s->names);
      s->names = json_incref (c->names);
      json_decref (s->seen);
      s->seen = json_incref (c->seen);
      if (c->n_fixed)
        memcpy (fixed, c->fixed, c->n_fixed * sizeof *fixed);
      free (s->fixed);
      s->fixed = fixed;
      s->n_fixed = c->n_fixed;
    }
  json_decref (c->names);
  json_decref (c->seen);
  free (c);
  return r;
}

static void
group_hash (json_t *spec, char out[9])
{
  const char *g = json_string_value (json_object_get (spec, "net_group"));
  out[0] = 0;
  if (g == NULL)
    return;
  uint32_t h = 2166136261u;
  for (; *g; g++)
    h = (h ^ (unsigned char)*g) * 16777619u;
  snprintf (out, 9, "%08x", h);
}

/* /etc/resolv.conf of the sandbox, written through its root (RESOLVE_IN_ROOT:
 * a symlink in the image cannot send the write to the host). */
static void
write_resolv (struct sandbox *sb, struct in_addr gw)
{
  char root[64], line[64];
  snprintf (root, sizeof root, "/proc/%d/root", (int)sb->c.pid);
  _cleanup_close_ int rfd = open (root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (rfd < 0)
    return;
  struct open_how how = { .flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                          .mode = 0644,
                          .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS };
  int fd = (int)syscall (SYS_openat2, rfd, "etc/resolv.conf", &how, sizeof how);
  if (fd < 0)
    return;
  int len = snprintf (line, sizeof line, "nameserver %s\n", inet_ntoa (gw));
  if (write (fd, line, (size_t)len) != len || fchown (fd, sb->c.uid_base, sb->c.uid_base) < 0)
    wrd_log (WRD_LOG_DEBUG, "net %s: resolv.conf\n", sb->id);
  close (fd);
}

static struct sbnet *
sbnet_new (struct sandbox *sb, unsigned slot)
{
  struct sbnet *s = calloc (1, sizeof *s);
  s->sb = sb;
  s->slot = slot;
  s->dns_fd = s->up_fd = s->tcp_fd = -1;
  group_hash (sb->spec, s->group);
  return s;
}

static void
sbnet_free (struct sbnet *s)
{
  json_decref (s->names);
  json_decref (s->seen);
  json_decref (s->kept);
  free (s->fixed);
  free (s);
}

int
wrd_net_attach (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  if (knet == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED, "no sandbox networking on this node: %s",
                     knet_error);
  /* VM backends get their tap before QEMU starts (wrd_net_attach_vm): the
   * process behind their pidfd is the VMM, in a netns of its own */
  if (strcmp (sb->backend, "container") != 0 || wr_container_pidfd (&sb->c) < 0)
    return wr_error (err, 0, WR_E_INTERNAL, "%s sandbox: no container to attach a link to",
                     sb->backend);
  unsigned slot;
  int r = 0;
  /* a netns from npool has its link ready: only the policy is left */
  bool prepared = wr_net_claim (knet, sb->c.pid, &slot) == 0;
  if (!prepared && (r = wr_net_slot_alloc (knet, &slot, err)) < 0)
    return r;
  struct sbnet *s = sbnet_new (sb, slot);
  if (!prepared)
    r = wr_net_attach (knet, slot, wr_container_pidfd (&sb->c), err);
  if (r == 0)
    r = apply (d, s, rules_of (sb->spec), NAMES_LOOKUP, err);
  if (r < 0)
    {
      wr_net_detach (knet, slot, s->group[0] ? s->group : NULL);
      sbnet_free (s);
      return r;
    }
  write_resolv (sb, wr_net_gateway (knet, slot));
  json_object_set_new (sb->spec, "net_slot", json_integer (slot));
  /* linked into sbnets on the loop (wrd_net_start): this is a worker thread */
  sb->net_pending = s;
  return 0;
}

/* VM backends (docs/network.md, "VMs"): the slot's host side is a tap
 * made before QEMU starts, with the policy in place, so the guest's first
 * packet meets it; the guest's init configures eth0 and resolv.conf. */
int
wrd_net_attach_vm (struct wrd *d, struct sandbox *sb, struct wr_vm_net *ret, wr_err_t *err)
{
  if (knet == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED, "no sandbox networking on this node: %s",
                     knet_error);
  unsigned slot;
  int r = wr_net_slot_alloc (knet, &slot, err);
  if (r < 0)
    return r;
  struct sbnet *s = sbnet_new (sb, slot);
  int tap = wr_net_attach_tap (knet, slot, err);
  r = tap < 0 ? tap : apply (d, s, rules_of (sb->spec), NAMES_LOOKUP, err);
  if (r < 0)
    {
      if (tap >= 0)
        close (tap);
      wr_net_detach (knet, slot, s->group[0] ? s->group : NULL);
      sbnet_free (s);
      return r;
    }
  *ret = (struct wr_vm_net){ tap, wr_net_address (knet, slot), wr_net_gateway (knet, slot) };
  json_object_set_new (sb->spec, "net_slot", json_integer (slot));
  sb->net_pending = s; /* as wrd_net_attach: linked in by wrd_net_start */
  return 0;
}

/* ---- DNS ---- */

/* Skip a (possibly compressed) name; returns the offset after it or -1.
 * out (if not NULL) gets the dotted lower-case name when uncompressed. */
static int
dns_name (const unsigned char *m, size_t len, size_t off, char *out, size_t outlen)
{
  size_t o = 0;
  while (off < len)
    {
      unsigned l = m[off];
      if (l == 0)
        {
          if (out)
            out[o ? o - 1 : 0] = 0;
          return (int)off + 1;
        }
      if ((l & 0xc0) == 0xc0)
        return off + 2 <= len && out == NULL ? (int)off + 2 : -1;
      if (off + 1 + l > len)
        return -1;
      if (out)
        {
          if (o + l + 1 >= outlen)
            return -1;
          for (unsigned i = 0; i < l; i++)
            out[o++] = (char)tolower (m[off + 1 + i]);
          out[o++] = '.';
        }
      off += 1 + l;
    }
  return -1;
}

/* A records of a response; returns their count. ret_ttl (if not NULL)
 * gets the least TTL of its answer records (A and CNAME alike), untouched
 * when it has none. */
static size_t
dns_answers (const unsigned char *m, size_t len, uint32_t *addrs, size_t max, uint32_t *ret_ttl)
{
  if (len < 12)
    return 0;
  unsigned qd = (unsigned)(m[4] << 8 | m[5]), an = (unsigned)(m[6] << 8 | m[7]);
  int off = 12;
  for (unsigned i = 0; i < qd && off > 0; i++)
    {
      off = dns_name (m, len, (size_t)off, NULL, 0);
      off = off > 0 ? off + 4 : -1;
    }
  size_t n = 0;
  for (unsigned i = 0; i < an && off > 0 && n < max; i++)
    {
      off = dns_name (m, len, (size_t)off, NULL, 0);
      if (off < 0 || (size_t)off + 10 > len)
        break;
      unsigned type = (unsigned)(m[off] << 8 | m[off + 1]);
      unsigned rdlen = (unsigned)(m[off + 8] << 8 | m[off + 9]);
      uint32_t ttl = (uint32_t)m[off + 4] << 24 | (uint32_t)m[off + 5] << 16
                     | (uint32_t)m[off + 6] << 8 | m[off + 7];
      if (ret_ttl && (i == 0 || ttl < *ret_ttl))
        *ret_ttl = ttl;
      off += 10;
      if ((size_t)off + rdlen > len)
        break;
      if (type == 1 && rdlen == 4)
        {
          uint32_t a;
          memcpy (&a, m + off, 4);
          addrs[n++] = ntohl (a);
        }
      off += (int)rdlen;
    }
  return n;
}

/* The A question for name, with id, into q[300]; returns its length or -1. */
static int
dns_question (const char *name, uint16_t id, unsigned char *q)
{
  size_t o = 12;
  memset (q, 0, 12);
  q[0] = (unsigned char)(id >> 8);
  q[1] = (unsigned char)id;
  q[2] = 1; /* RD */
  q[5] = 1; /* QDCOUNT */
  const char *p = name;
  while (*p)
    {
      const char *dot = strchr (p, '.');
      size_t l = dot ? (size_t)(dot - p) : strlen (p);
      if (l == 0 || l > 63 || o + l + 6 > 300)
        return -1;
      q[o++] = (unsigned char)l;
      memcpy (q + o, p, l);
      o += l;
      p += l + (dot ? 1 : 0);
    }
  q[o++] = 0;
  q[o++] = 0, q[o++] = 1; /* A */
  q[o++] = 0, q[o++] = 1; /* IN */
  return (int)o;
}

/* Blocking A lookup at the upstream (2 s); used when a policy is applied. */
static int
dns_resolve (const char *name, uint32_t *addrs, size_t max, size_t *ret_n)
{
  unsigned char q[300];
  int o = dns_question (name, (uint16_t)random (), q);
  if (o < 0)
    return -1;
  _cleanup_close_ int fd = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect (fd, (struct sockaddr *)&upstream, sizeof upstream) < 0
      || send (fd, q, (size_t)o, 0) < 0)
    return -1;
  struct pollfd pf = { .fd = fd, .events = POLLIN };
  unsigned char r[1500];
  while (poll (&pf, 1, 2000) == 1)
    {
      ssize_t n = recv (fd, r, sizeof r, 0);
      if (n < 12 || r[0] != q[0] || r[1] != q[1])
        continue;
      *ret_n = dns_answers (r, (size_t)n, addrs, max, NULL);
      return 0;
    }
  return -1;
}

/* ---- re-resolution: names follow their records (docs/network.md, "DNS") ----
 * Every name that a live sandbox's policy names (its own rules and its
 * services' targets) is asked again when its record's TTL runs out,
 * clamped to [--net-dns-min-ttl, --net-dns-max-ttl], on the loop (one
 * socket, never a blocking lookup). A new address joins the sets of every
 * sandbox allowed the name; an address no answer named for one TTL leaves
 * them, in one nftables transaction for all of them, while connections
 * already open to it are kept (net.c's kept set). The sandboxes' own
 * lookups add addresses too (learn) but never remove one. */

#define WATCH_ADDRS 64
#define WATCH_QUERY_MS 2000 /* an unanswered question is asked again at the least TTL */

struct watch
{
  struct watch *next;
  char name[256];
  struct
  {
    uint32_t addr;
    uint64_t missing_since; /* ms, monotonic; 0: in the last answer */
  } a[WATCH_ADDRS];
  size_t n;
  unsigned ttl;        /* seconds, clamped */
  uint64_t due, asked; /* ms: the next question; the one out (0: none) */
  uint16_t qid;
  bool changed; /* addresses the sandboxes' sets do not have yet */
  bool used;
};

static struct
{
  struct watch *list;
  int fd; /* to the upstream */
  struct event *rd, *tick;
} watch = { NULL, -1, NULL, NULL };

static struct watch *
watch_find (const char *name)
{
  for (struct watch *w = watch.list; w; w = w->next)
    if (strcmp (w->name, name) == 0)
      return w;
  return NULL;
}

/* the addresses the watch knows for name (NAMES_CACHED) */
static size_t
watch_cached (const char *name, uint32_t *addrs, size_t max)
{
  struct watch *w = watch_find (name);
  size_t n = 0;
  for (size_t k = 0; w && k < w->n && n < max; k++)
    addrs[n++] = w->a[k].addr;
  return n;
}

/* PATCHes that named a name the watch had no answer for yet: the reply
 * waits (off the loop) until each such name's question is answered or
 * given up, so that a sandbox may connect by address once it has its 200,
 * as after a create. */
struct patch_wait
{
  struct patch_wait *next;
  struct wrd *d;
  struct evhttp_request *req; /* NULL once the client went away */
  struct evhttp_connection *evcon;
  char id[WR_ID_MAX + 1];
  json_t *names;
};

static struct patch_wait *patch_waits;

static void
patch_wait_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  ((struct patch_wait *)arg)->req = NULL;
}

static void
patch_wait_finish (struct patch_wait *pw)
{
  if (pw->req)
    {
      evhttp_connection_set_closecb (pw->evcon, NULL, NULL);
      struct sandbox *sb = wrd_sandbox_find (pw->d, pw->id);
      if (sb && sb->state != SB_DESTROYING)
        wrd_reply_json (pw->req, 200, wrd_sandbox_json (pw->d, sb, true));
      else
        wrd_reply_error_code (pw->req, WR_E_GONE, "the sandbox was destroyed");
    }
  json_decref (pw->names);
  free (pw);
}

/* every PATCH whose names have no question out any more is answered */
static void
patch_waits_run (bool all)
{
  for (struct patch_wait **pp = &patch_waits; *pp;)
    {
      struct patch_wait *pw = *pp;
      bool done = all;
      size_t i;
      json_t *n;
      if (!done)
        {
          done = true;
          json_array_foreach (pw->names, i, n)
          {
            struct watch *w = watch_find (json_string_value (n));
            if (w && w->asked)
              done = false;
          }
        }
      if (!done)
        {
          pp = &pw->next;
          continue;
        }
      *pp = pw->next;
      patch_wait_finish (pw);
    }
}

/* true if the reply to req was left to patch_waits_run */
static bool
patch_wait_add (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, json_t *names)
{
  json_t *out = json_array ();
  const char *name;
  json_t *v;
  json_object_foreach (names, name, v)
  {
    struct watch *w = watch_find (name);
    if (w && w->asked)
      json_array_append_new (out, json_string (name));
  }
  struct patch_wait *pw = json_array_size (out) ? calloc (1, sizeof *pw) : NULL;
  if (pw == NULL)
    {
      json_decref (out);
      return false;
    }
  pw->d = d;
  pw->req = req;
  pw->evcon = evhttp_request_get_connection (req);
  snprintf (pw->id, sizeof pw->id, "%s", sb->id);
  pw->names = out;
  pw->next = patch_waits;
  patch_waits = pw;
  evhttp_connection_set_closecb (pw->evcon, patch_wait_closed, pw);
  return true;
}

/* addresses seen in an answer for w: new ones join, known ones are back */
static void
watch_saw (struct watch *w, const uint32_t *addrs, size_t n)
{
  for (size_t i = 0; i < n; i++)
    {
      size_t k = 0;
      while (k < w->n && w->a[k].addr != addrs[i])
        k++;
      if (k == w->n)
        {
          if (w->n == WATCH_ADDRS)
            continue;
          w->a[w->n++].addr = addrs[i];
          w->changed = true;
        }
      w->a[k].missing_since = 0;
    }
}

static void watch_schedule (void);

/* a sandbox's answer for an allowed name (learn) */
static void
watch_learn (const char *name, const uint32_t *addrs, size_t n)
{
  struct watch *w = watch_find (name);
  if (w)
    watch_saw (w, addrs, n);
}

/* addr with each of a name's port ranges ([[lo, hi]...]) into out[o...max) */
static size_t
with_ports (uint32_t addr, json_t *ports, struct wr_net_allow *out, size_t o, size_t max)
{
  size_t i;
  json_t *pr;
  json_array_foreach (ports, i, pr)
  {
    if (o < max)
      out[o++]
          = (struct wr_net_allow){ addr, 32, (uint16_t)json_integer_value (json_array_get (pr, 0)),
                                   (uint16_t)json_integer_value (json_array_get (pr, 1)) };
  }
  return o;
}

/* s's allowed destinations now: its fixed ones and its names' addresses */
static size_t
watch_allowed (struct sbnet *s, struct wr_net_allow *out, size_t max)
{
  size_t o = 0;
  for (size_t i = 0; i < s->n_fixed && o < max; i++)
    out[o++] = s->fixed[i];
  const char *name;
  json_t *ports;
  json_object_foreach (s->names, name, ports)
  {
    struct watch *w = watch_find (name);
    for (size_t k = 0; w && k < w->n; k++)
      o = with_ports (w->a[k].addr, ports, out, o, max);
  }
  return o;
}

/* w's addresses changed (gone: those that left): every sandbox allowed w's
 * name gets its set rebuilt, all in one transaction */
static void
watch_apply (struct watch *w, const uint32_t *gone, size_t n_gone)
{
  size_t count = 0, cap = 0;
  for (struct sbnet *s = sbnets; s; s = s->next)
    cap += json_object_get (s->names, w->name) != NULL;
  struct wr_net_set_update *u = cap ? calloc (cap, sizeof *u) : NULL;
  for (struct sbnet *s = sbnets; s && u && count < cap; s = s->next)
    {
      if (json_object_get (s->names, w->name) == NULL)
        continue;
      struct wr_net_allow *allow = malloc (MAX_ADDRS * sizeof *allow);
      if (allow == NULL)
        break;
      u[count] = (struct wr_net_set_update){ s->slot, allow, watch_allowed (s, allow, MAX_ADDRS),
                                             gone, n_gone };
      count++;
      if (n_gone == 0)
        continue;
      /* remembered so that a policy without the name ends them (net_kept_forget) */
      if (s->kept == NULL)
        s->kept = json_object ();
      json_t *k = json_object_get (s->kept, w->name);
      if (k == NULL)
        json_object_set_new (s->kept, w->name, k = json_array ());
      for (size_t i = 0; i < n_gone && json_array_size (k) < WATCH_ADDRS; i++)
        json_array_append_new (k, json_integer (gone[i]));
    }
  wr_err_t err;
  if (count && wr_net_sets_replace (knet, u, count, &err) < 0)
    wrd_log (WRD_LOG_WARN, "net: %s changed: %s\n", w->name, err.msg);
  else
    w->changed = false;
  wrd_log (WRD_LOG_DEBUG, "net: %s: %zu addresses, %zu left, %zu sandboxes\n", w->name, w->n,
           n_gone, count);
  for (size_t i = 0; i < count; i++)
    free ((void *)u[i].allow);
  free (u);
}

static void
watch_answer_cb (evutil_socket_t fd, short what WR_UNUSED, void *arg WR_UNUSED)
{
  unsigned char m[1500];
  ssize_t len = recv (fd, m, sizeof m, 0);
  char name[256];
  if (len < 12 || !(m[2] & 0x80) || dns_name (m, (size_t)len, 12, name, sizeof name) < 0)
    return;
  struct watch *w = watch_find (name);
  uint16_t id = (uint16_t)(m[0] << 8 | m[1]);
  if (w == NULL || !w->asked || w->qid != id)
    return;
  uint64_t now = wr_now_ms ();
  unsigned rcode = m[3] & 0xf;
  w->asked = 0;
  if ((rcode != 0 && rcode != 3) || (m[2] & 0x02)) /* a failure or truncated: keep all */
    {
      w->due = now + wd->net_dns_ttl_min * 1000ull;
      watch_schedule ();
      return;
    }
  uint32_t addrs[WATCH_ADDRS], ttl = wd->net_dns_ttl_min;
  size_t n = dns_answers (m, (size_t)len, addrs, WATCH_ADDRS, &ttl);
  w->ttl = ttl < wd->net_dns_ttl_min   ? wd->net_dns_ttl_min
           : ttl > wd->net_dns_ttl_max ? wd->net_dns_ttl_max
                                       : ttl;
  w->due = now + w->ttl * 1000ull;
  for (size_t k = 0; k < w->n; k++)
    w->a[k].missing_since = w->a[k].missing_since ? w->a[k].missing_since : now;
  watch_saw (w, addrs, n);
  /* gone for a TTL: out */
  uint32_t gone[WATCH_ADDRS];
  size_t n_gone = 0;
  for (size_t k = 0; k < w->n;)
    if (w->a[k].missing_since && now - w->a[k].missing_since >= w->ttl * 1000ull)
      {
        gone[n_gone++] = w->a[k].addr;
        w->a[k] = w->a[--w->n];
      }
    else
      k++;
  if (w->changed || n_gone)
    watch_apply (w, gone, n_gone);
  watch_schedule ();
}

static void
watch_ask (struct watch *w, uint64_t now)
{
  if (watch.fd < 0)
    {
      watch.fd = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (watch.fd >= 0 && connect (watch.fd, (struct sockaddr *)&upstream, sizeof upstream) == 0)
        {
          watch.rd = event_new (wd->base, watch.fd, EV_READ | EV_PERSIST, watch_answer_cb, NULL);
          event_add (watch.rd, NULL);
        }
      else if (watch.fd >= 0)
        {
          close (watch.fd);
          watch.fd = -1;
        }
    }
  unsigned char q[300];
  w->qid = (uint16_t)random ();
  int len = dns_question (w->name, w->qid, q);
  w->asked = now;
  if (watch.fd < 0 || len < 0 || send (watch.fd, q, (size_t)len, 0) < 0)
    wrd_log (WRD_LOG_DEBUG, "net: asking for %s: %s\n", w->name, strerror (errno));
}

/* Names no sandbox needs any more go; those due are asked; an unanswered
 * question is given up after WATCH_QUERY_MS (its addresses stay). */
static void
watch_tick (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  for (struct watch *w = watch.list; w; w = w->next)
    w->used = false;
  for (struct sbnet *s = sbnets; s; s = s->next)
    {
      const char *name;
      json_t *v;
      json_object_foreach (s->names, name, v)
      {
        struct watch *w = watch_find (name);
        if (w)
          w->used = true;
      }
    }
  uint64_t now = wr_now_ms ();
  for (struct watch **pp = &watch.list; *pp;)
    {
      struct watch *w = *pp;
      if (!w->used)
        {
          *pp = w->next;
          free (w);
          continue;
        }
      if (w->asked && now - w->asked >= WATCH_QUERY_MS)
        {
          w->asked = 0;
          w->due = now + wd->net_dns_ttl_min * 1000ull;
        }
      if (!w->asked && w->due <= now)
        watch_ask (w, now);
      pp = &w->next;
    }
  watch_schedule ();
}

/* the tick at the earliest question due or given up */
static void
watch_schedule (void)
{
  patch_waits_run (false);
  if (watch.list == NULL)
    return;
  uint64_t next = UINT64_MAX, now = wr_now_ms ();
  for (struct watch *w = watch.list; w; w = w->next)
    {
      uint64_t t = w->asked ? w->asked + WATCH_QUERY_MS : w->due;
      next = t < next ? t : next;
    }
  if (watch.tick == NULL && (watch.tick = evtimer_new (wd->base, watch_tick, NULL)) == NULL)
    return;
  uint64_t ms = next > now ? next - now : 0;
  struct timeval tv = { (time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000 };
  evtimer_add (watch.tick, &tv);
}

/* On the loop, once s's policy is applied: its names are watched (a new
 * one is asked at once), with the addresses the policy found for them. */
static void
watch_sync (struct sbnet *s)
{
  bool added = false;
  const char *name;
  json_t *v;
  json_object_foreach (s->names, name, v)
  {
    struct watch *w = watch_find (name);
    bool created = false;
    if (w == NULL && strlen (name) < sizeof w->name && (w = calloc (1, sizeof *w)) != NULL)
      {
        created = true;
        snprintf (w->name, sizeof w->name, "%s", name);
        w->ttl = wd->net_dns_ttl_min;
        w->due = wr_now_ms ();
        w->next = watch.list;
        watch.list = w;
        added = true;
      }
    json_t *seen = json_object_get (s->seen, name);
    for (size_t i = 0; w && i < json_array_size (seen); i++)
      {
        uint32_t a = (uint32_t)json_integer_value (json_array_get (seen, i));
        watch_saw (w, &a, 1);
      }
    /* s has them; other sandboxes, of a name watched already, may not */
    if (w && created)
      w->changed = false;
  }
  json_decref (s->seen);
  s->seen = NULL;
  if (added)
    watch_tick (-1, 0, NULL);
}

/* A new policy of s: the connections kept to addresses of names it no
 * longer names end. */
static void
net_kept_forget (struct sbnet *s)
{
  const char *name;
  json_t *addrs, *tmp;
  json_object_foreach_safe (s->kept, tmp, name, addrs)
  {
    if (json_object_get (s->names, name))
      continue;
    uint32_t a[WATCH_ADDRS];
    size_t n = 0;
    for (size_t i = 0; i < json_array_size (addrs) && n < WATCH_ADDRS; i++)
      a[n++] = (uint32_t)json_integer_value (json_array_get (addrs, i));
    wr_err_t err;
    if (wr_net_kept_drop (knet, s->slot, a, n, &err) < 0)
      wrd_log (WRD_LOG_WARN, "net %s: %s\n", s->sb->id, err.msg);
    json_object_del (s->kept, name);
  }
}

static void
watch_stop (void)
{
  patch_waits_run (true);
  while (watch.list)
    {
      struct watch *w = watch.list;
      watch.list = w->next;
      free (w);
    }
  if (watch.rd)
    event_free (watch.rd);
  if (watch.tick)
    event_free (watch.tick);
  if (watch.fd >= 0)
    close (watch.fd);
  watch.rd = watch.tick = NULL;
  watch.fd = -1;
}

/* An answer for an allowed name: its addresses join the sandbox's set
 * before the sandbox sees them (records that changed since the policy was
 * applied are followed this way). */
static void
learn (struct sbnet *s, const char *name, const unsigned char *m, size_t len)
{
  json_t *ports = json_object_get (s->names, name);
  uint32_t addrs[64];
  size_t n = dns_answers (m, len, addrs, 64, NULL);
  if (ports == NULL || n == 0)
    return;
  watch_learn (name, addrs, n);
  struct wr_net_allow add[64];
  size_t na = 0;
  for (size_t k = 0; k < n; k++)
    na = with_ports (addrs[k], ports, add, na, 64);
  wr_err_t err;
  if (wr_net_allow_add (knet, s->slot, add, na, &err) < 0)
    wrd_log (WRD_LOG_WARN, "net %s: %s\n", s->sb->id, err.msg);
}

/* The question m (qend: the end of its name) turned into its NXDOMAIN
 * answer in place: the question back, no records. Returns its length. */
static size_t
dns_nxdomain (unsigned char *m, int qend)
{
  m[2] = (unsigned char)(0x80 | (m[2] & 0x79)); /* QR, opcode, RD kept */
  m[3] = 0x83;                                  /* RA, NXDOMAIN */
  m[4] = 0, m[5] = 1;
  memset (m + 6, 0, 6);
  return (size_t)qend + 4;
}

static void
dns_query_cb (evutil_socket_t fd, short what WR_UNUSED, void *arg)
{
  struct sbnet *s = arg;
  unsigned char m[1500];
  struct sockaddr_in from;
  socklen_t fl = sizeof from;
  ssize_t n = recvfrom (fd, m, sizeof m, 0, (struct sockaddr *)&from, &fl);
  if (n < 17 || (m[2] & 0x80))
    return;
  char name[256];
  int qend = dns_name (m, (size_t)n, 12, name, sizeof name);
  if (qend < 0 || (size_t)qend + 4 > (size_t)n)
    return;
  if (json_object_get (s->names, name) && s->up_fd >= 0)
    {
      unsigned k = 0;
      for (unsigned i = 0; i < PENDING; i++)
        {
          if (!s->pend[i].used)
            {
              k = i;
              break;
            }
          if (s->pend[i].sent < s->pend[k].sent)
            k = i;
        }
      s->pend[k].client_id = (uint16_t)(m[0] << 8 | m[1]);
      s->pend[k].up_id = s->next_id++;
      s->pend[k].used = true;
      s->pend[k].sent = wr_now_ms ();
      s->pend[k].from = from;
      m[0] = (unsigned char)(s->pend[k].up_id >> 8);
      m[1] = (unsigned char)(s->pend[k].up_id & 0xff);
      if (send (s->up_fd, m, (size_t)n, 0) < 0)
        s->pend[k].used = false;
      return;
    }
  sendto (fd, m, dns_nxdomain (m, qend), 0, (struct sockaddr *)&from, fl);
}

static void
dns_answer_cb (evutil_socket_t fd, short what WR_UNUSED, void *arg)
{
  struct sbnet *s = arg;
  unsigned char m[1500];
  ssize_t n = recv (fd, m, sizeof m, 0);
  if (n < 12)
    return;
  uint16_t id = (uint16_t)(m[0] << 8 | m[1]);
  unsigned k = 0;
  while (k < PENDING && !(s->pend[k].used && s->pend[k].up_id == id))
    k++;
  if (k == PENDING)
    return;
  s->pend[k].used = false;
  char name[256];
  if (dns_name (m, (size_t)n, 12, name, sizeof name) > 0)
    learn (s, name, m, (size_t)n);
  m[0] = (unsigned char)(s->pend[k].client_id >> 8);
  m[1] = (unsigned char)(s->pend[k].client_id & 0xff);
  sendto (s->dns_fd, m, (size_t)n, 0, (struct sockaddr *)&s->pend[k].from, sizeof s->pend[k].from);
}

/* ---- DNS over TCP: the same policy as UDP, on the loop ----
 * One question at a time per connection (a length-prefixed message, RFC
 * 1035 4.2.2): an allowed name goes to the upstream over its own TCP
 * connection and the answer is relayed (its addresses learnt first), any
 * other name gets NXDOMAIN. */

struct dns_tcp
{
  struct sbnet *s;
  struct bufferevent *c;  /* the sandbox's connection */
  struct bufferevent *up; /* the upstream, while a question is out */
  char name[256];         /* that question's name */
  struct dns_tcp *next;
};

static void
dns_tcp_free (struct dns_tcp *t)
{
  struct sbnet *s = t->s;
  for (struct dns_tcp **pp = &s->tcp_conns; *pp; pp = &(*pp)->next)
    if (*pp == t)
      {
        *pp = t->next;
        break;
      }
  s->n_tcp--;
  if (t->up)
    bufferevent_free (t->up);
  bufferevent_free (t->c);
  free (t);
}

/* a whole length-prefixed message in b (at most max bytes): its length,
 * 0 while incomplete, -1 when too long or too short */
static int
dns_tcp_msg (struct evbuffer *b, size_t max)
{
  unsigned char l[2];
  if (evbuffer_copyout (b, l, 2) < 2)
    return 0;
  size_t len = (size_t)(l[0] << 8 | l[1]);
  if (len < 12 || len > max)
    return -1;
  return evbuffer_get_length (b) >= 2 + len ? (int)len : 0;
}

static void
dns_tcp_send (struct bufferevent *b, const unsigned char *m, size_t len)
{
  unsigned char l[2] = { (unsigned char)(len >> 8), (unsigned char)len };
  bufferevent_write (b, l, 2);
  bufferevent_write (b, m, len);
}

static void dns_tcp_read (struct bufferevent *bev, void *arg);

static void
dns_tcp_up_read (struct bufferevent *bev, void *arg)
{
  struct dns_tcp *t = arg;
  struct evbuffer *in = bufferevent_get_input (bev);
  int len = dns_tcp_msg (in, 65535);
  if (len == 0)
    return;
  if (len < 0)
    {
      dns_tcp_free (t);
      return;
    }
  unsigned char *m = malloc ((size_t)len);
  if (m == NULL)
    {
      dns_tcp_free (t);
      return;
    }
  evbuffer_drain (in, 2);
  evbuffer_remove (in, m, (size_t)len);
  learn (t->s, t->name, m, (size_t)len);
  dns_tcp_send (t->c, m, (size_t)len);
  free (m);
  bufferevent_free (t->up);
  t->up = NULL;
  bufferevent_enable (t->c, EV_READ);
  dns_tcp_read (t->c, t); /* a question sent behind the first */
}

static void
dns_tcp_event (struct bufferevent *bev WR_UNUSED, short what, void *arg)
{
  struct dns_tcp *t = arg;
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT))
    dns_tcp_free (t); /* either side: the sandbox's resolver retries */
}

/* the question m to the upstream, over a connection of its own */
static int
dns_tcp_forward (struct dns_tcp *t, const unsigned char *m, size_t len)
{
  int fd = socket (AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  t->up = bufferevent_socket_new (bufferevent_get_base (t->c), fd, BEV_OPT_CLOSE_ON_FREE);
  if (t->up == NULL)
    {
      close (fd);
      return -1;
    }
  struct timeval tv = { DNS_TCP_TIMEOUT_S, 0 };
  bufferevent_set_timeouts (t->up, &tv, &tv);
  bufferevent_setcb (t->up, dns_tcp_up_read, NULL, dns_tcp_event, t);
  if (bufferevent_socket_connect (t->up, (struct sockaddr *)&upstream, sizeof upstream) < 0)
    return -1;
  dns_tcp_send (t->up, m, len);
  bufferevent_enable (t->up, EV_READ);
  bufferevent_disable (t->c, EV_READ); /* the next question waits for this answer */
  return 0;
}

static void
dns_tcp_read (struct bufferevent *bev, void *arg)
{
  struct dns_tcp *t = arg;
  struct evbuffer *in = bufferevent_get_input (bev);
  while (t->up == NULL)
    {
      int len = dns_tcp_msg (in, DNS_TCP_QUERY_MAX);
      if (len == 0)
        return;
      unsigned char m[DNS_TCP_QUERY_MAX];
      int qend = -1;
      if (len > 0)
        {
          evbuffer_drain (in, 2);
          evbuffer_remove (in, m, (size_t)len);
          qend = (m[2] & 0x80) ? -1 : dns_name (m, (size_t)len, 12, t->name, sizeof t->name);
        }
      if (qend < 0 || (size_t)qend + 4 > (size_t)len)
        {
          dns_tcp_free (t); /* not a question */
          return;
        }
      if (json_object_get (t->s->names, t->name))
        {
          if (dns_tcp_forward (t, m, (size_t)len) < 0)
            dns_tcp_free (t);
          return;
        }
      dns_tcp_send (t->c, m, dns_nxdomain (m, qend));
    }
}

static void
dns_tcp_accept (evutil_socket_t fd, short what WR_UNUSED, void *arg)
{
  struct sbnet *s = arg;
  int c = accept4 (fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (c < 0)
    return;
  struct dns_tcp *t = s->n_tcp < DNS_TCP_CONNS ? calloc (1, sizeof *t) : NULL;
  if (t)
    t->c = bufferevent_socket_new (event_get_base (s->tcp_ev), c, BEV_OPT_CLOSE_ON_FREE);
  if (t == NULL || t->c == NULL)
    {
      close (c); /* over the bound: the resolver sees the connection closed */
      free (t);
      return;
    }
  t->s = s;
  t->next = s->tcp_conns;
  s->tcp_conns = t;
  s->n_tcp++;
  struct timeval tv = { DNS_TCP_TIMEOUT_S, 0 };
  bufferevent_set_timeouts (t->c, &tv, &tv);
  bufferevent_setwatermark (t->c, EV_READ, 0, 2 + DNS_TCP_QUERY_MAX);
  bufferevent_setcb (t->c, dns_tcp_read, NULL, dns_tcp_event, t);
  bufferevent_enable (t->c, EV_READ);
}

static void
dns_tcp_start (struct wrd *d, struct sbnet *s, const struct sockaddr_in *a)
{
  int one = 1;
  s->tcp_fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s->tcp_fd < 0 || setsockopt (s->tcp_fd, SOL_IP, IP_FREEBIND, &one, sizeof one) < 0
      || setsockopt (s->tcp_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0
      || bind (s->tcp_fd, (const struct sockaddr *)a, sizeof *a) < 0
      || listen (s->tcp_fd, DNS_TCP_CONNS) < 0)
    {
      wrd_log (WRD_LOG_WARN, "net %s: DNS over TCP on %s: %s\n", s->sb->id, inet_ntoa (a->sin_addr),
               strerror (errno));
      return;
    }
  s->tcp_ev = event_new (d->base, s->tcp_fd, EV_READ | EV_PERSIST, dns_tcp_accept, s);
  event_add (s->tcp_ev, NULL);
}

static void
dns_stop (struct sbnet *s)
{
  while (s->tcp_conns)
    dns_tcp_free (s->tcp_conns);
  if (s->tcp_ev)
    event_free (s->tcp_ev);
  if (s->tcp_fd >= 0)
    close (s->tcp_fd);
  if (s->dns_ev)
    event_free (s->dns_ev);
  if (s->up_ev)
    event_free (s->up_ev);
  if (s->dns_fd >= 0)
    close (s->dns_fd);
  if (s->up_fd >= 0)
    close (s->up_fd);
}

static void
dns_start (struct wrd *d, struct sbnet *s)
{
  struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons (53) };
  a.sin_addr = wr_net_gateway (knet, s->slot);
  s->dns_fd = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt (s->dns_fd, SOL_IP, IP_FREEBIND, &one, sizeof one);
  if (s->dns_fd < 0 || bind (s->dns_fd, (struct sockaddr *)&a, sizeof a) < 0)
    {
      wrd_log (WRD_LOG_WARN, "net %s: DNS on %s: %s\n", s->sb->id, inet_ntoa (a.sin_addr),
               strerror (errno));
      return;
    }
  /* the upstream's ids start anywhere: none to guess from the sandbox */
  if (getrandom (&s->next_id, sizeof s->next_id, GRND_NONBLOCK) < 0)
    s->next_id = (uint16_t)wr_now_ms ();
  s->up_fd = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s->up_fd >= 0 && connect (s->up_fd, (struct sockaddr *)&upstream, sizeof upstream) < 0)
    {
      close (s->up_fd);
      s->up_fd = -1;
    }
  s->dns_ev = event_new (d->base, s->dns_fd, EV_READ | EV_PERSIST, dns_query_cb, s);
  event_add (s->dns_ev, NULL);
  dns_tcp_start (d, s, &a);
  if (s->up_fd >= 0)
    {
      s->up_ev = event_new (d->base, s->up_fd, EV_READ | EV_PERSIST, dns_answer_cb, s);
      event_add (s->up_ev, NULL);
    }
}

void
wrd_net_start (struct wrd *d, struct sandbox *sb)
{
  struct sbnet *s = sb->net_pending;
  if (s == NULL)
    return;
  sb->net_pending = NULL;
  s->next = sbnets;
  sbnets = s;
  dns_start (d, s);
  watch_sync (s);
}

int
wrd_net_readopt (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  if (!wrd_net_wanted (sb->spec))
    return 0;
  json_t *jslot = json_object_get (sb->spec, "net_slot");
  if (!json_is_integer (jslot))
    return wr_error (err, 0, WR_E_UNSUPPORTED, "sandbox network cannot be restored");
  int r = knet_up (d, err);
  if (r < 0)
    return r;
  unsigned slot = (unsigned)json_integer_value (jslot);
  wr_net_slot_take (knet, slot);
  struct sbnet *s = sbnet_new (sb, slot);
  r = wr_net_readopt (knet, slot, err);
  if (r == 0)
    r = apply (d, s, rules_of (sb->spec), NAMES_LOOKUP, err);
  s->next = sbnets;
  sbnets = s; /* even on failure: detach undoes it */
  if (r == 0)
    {
      dns_start (d, s);
      watch_sync (s);
    }
  return r;
}

static void
detach_flush (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  const char *groups[DETACH_BATCH];
  for (size_t i = 0; i < detaching.n; i++)
    groups[i] = detaching.groups[i][0] ? detaching.groups[i] : NULL;
  if (detaching.n)
    wr_net_detach_many (knet, detaching.slots, groups, detaching.n);
  detaching.n = 0;
}

void
wrd_net_detach (struct wrd *d, struct sandbox *sb)
{
  struct sbnet *s = sb->net_pending;
  sb->net_pending = NULL;
  bool started = s == NULL; /* on the loop: linked in by wrd_net_start */
  if (s == NULL)
    for (struct sbnet **pp = &sbnets; *pp; pp = &(*pp)->next)
      if ((*pp)->sb == sb)
        {
          s = *pp;
          *pp = s->next;
          break;
        }
  if (s == NULL)
    return;
  dns_stop (s);
  if (!started) /* maybe a builder's thread: at once */
    wr_net_detach (knet, s->slot, s->group[0] ? s->group : NULL);
  else
    {
      if (detaching.n == DETACH_BATCH)
        detach_flush (-1, 0, NULL);
      detaching.slots[detaching.n] = s->slot;
      memcpy (detaching.groups[detaching.n++], s->group, sizeof s->group);
      if (detaching.ev == NULL)
        detaching.ev = evtimer_new (d->base, detach_flush, NULL);
      struct timeval tv = { 0, DETACH_DELAY_MS * 1000 };
      if (detaching.ev && !evtimer_pending (detaching.ev, NULL))
        evtimer_add (detaching.ev, &tv);
      else if (detaching.ev == NULL)
        detach_flush (-1, 0, NULL);
    }
  sbnet_free (s);
}

json_t *
wrd_net_json (struct wrd *d WR_UNUSED, struct sandbox *sb, bool detail)
{
  struct sbnet *s = sbnet_of (sb);
  if (s == NULL)
    return NULL;
  char a[INET_ADDRSTRLEN], g[INET_ADDRSTRLEN];
  struct in_addr x = wr_net_address (knet, s->slot), y = wr_net_gateway (knet, s->slot);
  inet_ntop (AF_INET, &x, a, sizeof a);
  inet_ntop (AF_INET, &y, g, sizeof g);
  uint64_t denied = 0;
  if (detail)
    wr_net_denied (knet, s->slot, &denied, NULL);
  json_t *names = json_array ();
  const char *k;
  json_t *v;
  json_object_foreach (s->names, k, v) json_array_append_new (names, json_string (k));
  char ifn[16];
  wr_net_ifname (knet, s->slot, ifn);
  json_t *j = json_pack ("{s:s,s:s,s:s,s:o,s:o}", "address", a, "gateway", g, "interface", ifn,
                         "names", names, "group",
                         json_object_get (sb->spec, "net_group")
                             ? json_incref (json_object_get (sb->spec, "net_group"))
                             : json_null ());
  struct wr_net_limits lim;
  limits_of (sb->spec, &lim);
  json_object_set_new (j, "limits", limits_json (&lim));
  if (detail)
    {
      uint64_t eg, in;
      wr_net_bytes (knet, s->slot, &eg, &in);
      json_object_set_new (j, "denied_packets", json_integer ((json_int_t)denied));
      json_object_set_new (j, "egress_bytes", json_integer ((json_int_t)eg));
      json_object_set_new (j, "ingress_bytes", json_integer ((json_int_t)in));
    }
  return j;
}

void
wrd_net_metrics (struct wrd *d WR_UNUSED, FILE *f)
{
  if (npool)
    {
      unsigned ready;
      uint64_t taken, missed;
      wr_netns_pool_stats (npool, &ready, &taken, &missed);
      fprintf (f,
               "# HELP warren_net_pool_ready Network namespaces with a sandbox link made ahead.\n"
               "# TYPE warren_net_pool_ready gauge\nwarren_net_pool_ready %u\n"
               "# HELP warren_net_pool_taken_total allow= creates that took a prepared one.\n"
               "# TYPE warren_net_pool_taken_total counter\nwarren_net_pool_taken_total %llu\n"
               "# HELP warren_net_pool_missed_total allow= creates that made their own link.\n"
               "# TYPE warren_net_pool_missed_total counter\nwarren_net_pool_missed_total %llu\n",
               ready, (unsigned long long)taken, (unsigned long long)missed);
    }
  if (sbnets)
    fprintf (f, "# HELP warren_net_denied_packets_total Packets a sandbox's network policy "
                "dropped.\n# TYPE warren_net_denied_packets_total counter\n");
  for (struct sbnet *s = sbnets; s; s = s->next)
    {
      uint64_t denied = 0;
      if (wr_net_denied (knet, s->slot, &denied, NULL) == 0)
        fprintf (f, "warren_net_denied_packets_total{sandbox=\"%s\"} %llu\n", s->sb->id,
                 (unsigned long long)denied);
    }
  if (sbnets)
    fprintf (f, "# HELP warren_net_egress_bytes_total Bytes a sandbox sent on its link.\n"
                "# TYPE warren_net_egress_bytes_total counter\n");
  for (struct sbnet *s = sbnets; s; s = s->next)
    {
      uint64_t eg, in;
      wr_net_bytes (knet, s->slot, &eg, &in);
      fprintf (f, "warren_net_egress_bytes_total{sandbox=\"%s\"} %llu\n", s->sb->id,
               (unsigned long long)eg);
    }
}

/* ---- HTTP ---- */

void
wrd_http_net_patch (struct wrd *d, struct evhttp_request *req, struct sandbox *sb)
{
  json_t *body = NULL;
  wr_err_t err;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *nv = json_object_get (body, "network");
  json_t *lv = json_object_get (body, "net_limits");
  struct sbnet *s = sbnet_of (sb);
  json_t *rules = NULL;
  const char *cur = rules_of (sb->spec);
  int r = 0;
  struct wr_net_limits lim;
  bool wait = false;
  limits_of (sb->spec, &lim); /* the keys a PATCH leaves out stay */
  if (nv == NULL && lv == NULL)
    r = wr_error (&err, 0, WR_E_INVALID, "PATCH takes {\"network\": ..., \"net_limits\": ...}");
  else if (lv && limits_parse (lv, &lim, &err) < 0)
    r = -EINVAL;
  else if (s == NULL)
    r = wr_error (&err, 0, WR_E_CONFLICT,
                  "sandbox %s has no network interface (created with \"network\": \"%s\"); "
                  "policies apply to sandboxes created with \"allow=...\"",
                  sb->id, json_string_value (json_object_get (sb->spec, "network")));
  else if (json_is_string (nv))
    {
      json_t *norm = NULL;
      const char *str = json_string_value (nv);
      if (strncmp (str, "allow=", 6) != 0)
        r = wr_error (&err, 0, WR_E_INVALID, "a live sandbox's \"network\" is \"allow=...\"");
      else if ((r = wrd_net_parse (d, nv, NULL, &norm, &err)) == 0)
        {
          rules = split_rules (json_string_value (norm) + 6);
          json_decref (norm);
        }
    }
  else if (json_is_object (nv))
    {
      const char *add = json_string_value (json_object_get (nv, "allow"));
      const char *del = json_string_value (json_object_get (nv, "deny"));
      rules = split_rules (cur ? cur : "");
      if (add)
        {
          json_t *a = split_rules (add);
          json_array_extend (rules, a);
          json_decref (a);
        }
      if (del)
        {
          json_t *dl = split_rules (del);
          size_t i, j;
          json_t *x;
          for (i = json_array_size (rules); i-- > 0;)
            json_array_foreach (dl, j, x) if (strcmp (json_string_value (x),
                                                      json_string_value (json_array_get (rules, i)))
                                              == 0)
            {
              json_array_remove (rules, i);
              break;
            }
          json_decref (dl);
        }
      if (!add && !del)
        r = wr_error (&err, 0, WR_E_INVALID, "\"network\" object takes \"allow\" and/or \"deny\"");
    }
  else if (nv != NULL)
    r = wr_error (&err, 0, WR_E_INVALID, "\"network\" must be a string or {allow, deny}");
  if (r == 0 && rules)
    {
      json_t *norm = normalise (rules);
      struct compiled *c = calloc (1, sizeof *c);
      r = compile_rules (d, json_string_value (norm) + 6, NAMES_SYNTAX, c, &err);
      free (c);
      if (r == 0)
        {
          json_t *old = json_incref (json_object_get (sb->spec, "network"));
          json_object_set (sb->spec, "network", norm);
          /* on the loop: the watch's addresses; a name it has none for
           * yet is asked now, and the reply waits for its answer */
          r = apply (d, s, json_string_value (norm) + 6, NAMES_CACHED, &err);
          if (r == 0)
            {
              watch_sync (s);
              net_kept_forget (s);
              r = wrd_db_put (d, sb, &err);
              wait = r == 0;
            }
          else
            json_object_set (sb->spec, "network", old);
          json_decref (old);
        }
      json_decref (norm);
    }
  if (r == 0 && lv)
    {
      json_t *old = json_incref (json_object_get (sb->spec, "net_limits"));
      json_object_set_new (sb->spec, "net_limits", limits_json (&lim));
      r = wr_net_set_limits (knet, s->slot, &lim, false, &err);
      if (r == 0)
        r = wrd_db_put (d, sb, &err);
      else if (old)
        json_object_set (sb->spec, "net_limits", old);
      else
        json_object_del (sb->spec, "net_limits");
      json_decref (old);
    }
  json_decref (rules);
  json_decref (body);
  if (r < 0)
    wrd_reply_error (req, &err);
  else if (!wait || !patch_wait_add (d, req, sb, s->names))
    wrd_reply_json (req, 200, wrd_sandbox_json (d, sb, true));
}

static bool
service_name_ok (const char *n)
{
  size_t l = strlen (n);
  if (l == 0 || l > 64)
    return false;
  for (size_t i = 0; i < l; i++)
    if (!isalnum ((unsigned char)n[i]) && n[i] != '-' && n[i] != '_')
      return false;
  return true;
}

void
wrd_http_net_services (struct wrd *d, struct evhttp_request *req, const char *rest)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  wr_err_t err;
  if (rest == NULL && m == EVHTTP_REQ_GET)
    {
      sqlite3_stmt *st = NULL;
      json_t *out = json_array ();
      if (sqlite3_prepare_v2 (d->db, "SELECT name, targets FROM net_services ORDER BY name", -1,
                              &st, NULL)
          == SQLITE_OK)
        while (sqlite3_step (st) == SQLITE_ROW)
          json_array_append_new (
              out, json_pack ("{s:s,s:o}", "name", (const char *)sqlite3_column_text (st, 0),
                              "targets", split_rules ((const char *)sqlite3_column_text (st, 1))));
      sqlite3_finalize (st);
      wrd_reply_json (req, 200, json_pack ("{s:o}", "services", out));
      return;
    }
  if (rest == NULL && m == EVHTTP_REQ_POST)
    {
      json_t *body = NULL;
      if (wrd_read_json_body (req, true, &body, &err) < 0)
        {
          wrd_reply_error (req, &err);
          return;
        }
      const char *name = json_string_value (json_object_get (body, "name"));
      json_t *targets = json_object_get (body, "targets");
      int r = 0;
      char joined[4096] = "";
      size_t o = 0;
      if (name == NULL || !service_name_ok (name))
        r = wr_error (&err, 0, WR_E_INVALID, "\"name\" must be 1-64 of [A-Za-z0-9_-]");
      else if (!json_is_array (targets) || json_array_size (targets) == 0
               || json_array_size (targets) > 64)
        r = wr_error (&err, 0, WR_E_INVALID, "\"targets\" must be 1-64 \"HOST[:PORT]\" strings");
      size_t i;
      json_t *t;
      json_array_foreach (targets, i, t)
      {
        struct compiled *c = calloc (1, sizeof *c);
        const char *ts = json_string_value (t);
        if (r == 0 && (ts == NULL || strchr (ts, ',') || strchr (ts, ' ')))
          r = wr_error (&err, 0, WR_E_INVALID, "target %zu is not HOST[:PORT]", i);
        if (r == 0)
          r = compile_target (ts, NAMES_SYNTAX, c, &err);
        if (r == 0)
          o += (size_t)snprintf (joined + o, sizeof joined - o, "%s%s", o ? " " : "", ts);
        free (c);
      }
      if (r == 0)
        {
          sqlite3_stmt *st = NULL;
          if (sqlite3_prepare_v2 (d->db, "INSERT OR REPLACE INTO net_services VALUES (?, ?)", -1,
                                  &st, NULL)
                  != SQLITE_OK
              || (sqlite3_bind_text (st, 1, name, -1, SQLITE_STATIC),
                  sqlite3_bind_text (st, 2, joined, -1, SQLITE_STATIC), sqlite3_step (st))
                     != SQLITE_DONE)
            r = wr_error (&err, 0, WR_E_INTERNAL, "services: %s", sqlite3_errmsg (d->db));
          sqlite3_finalize (st);
        }
      if (r < 0)
        wrd_reply_error (req, &err);
      else
        wrd_reply_json (req, 201,
                        json_pack ("{s:s,s:o}", "name", name, "targets", split_rules (joined)));
      json_decref (body); /* after the reply: name is body's */
      return;
    }
  if (rest && m == EVHTTP_REQ_DELETE)
    {
      sqlite3_stmt *st = NULL;
      int changed = 0;
      if (sqlite3_prepare_v2 (d->db, "DELETE FROM net_services WHERE name = ?", -1, &st, NULL)
          == SQLITE_OK)
        {
          sqlite3_bind_text (st, 1, rest, -1, SQLITE_STATIC);
          if (sqlite3_step (st) == SQLITE_DONE)
            changed = sqlite3_changes (d->db);
        }
      sqlite3_finalize (st);
      if (changed)
        wrd_reply_empty (req, 204);
      else
        wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such service");
      return;
    }
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

/* ---- inbound: HTTP into a port of the sandbox ----
 * The daemon opens its socket inside the sandbox's network namespace
 * (setns on a worker thread) and talks to 127.0.0.1:PORT there: this works
 * for every mode, needs no route into the sandbox and opens nothing to
 * anyone but authenticated API clients. One request, HTTP/1.0, the answer
 * read whole (PROXY_MAX) within PROXY_TIMEOUT_MS. */

#define PROXY_MAX (64u << 20)
#define PROXY_TIMEOUT_MS 30000

struct proxy_job
{
  struct evhttp_request *req;
  int pidfd;
  struct in_addr guest; /* a networked VM's address (0: 127.0.0.1 in pidfd's netns) */
  unsigned port;
  char *head; /* request line + headers */
  struct evbuffer *body;
  char *resp;
  size_t resp_len;
  wr_err_t err;
  int r;
};

/* a networked VM's guest, from the host over its tap: QEMU's own netns
 * (the pidfd's) is empty; the guest's reply enters through the slot's
 * input chain as an established connection */
static int
proxy_connect_guest (struct proxy_job *j, wr_err_t *err)
{
  int fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return wr_sys_error (err, "socket");
  struct sockaddr_in a
      = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)j->port), .sin_addr = j->guest };
  struct timeval tv = { PROXY_TIMEOUT_MS / 1000, 0 };
  setsockopt (fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt (fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect (fd, (struct sockaddr *)&a, sizeof a) < 0)
    {
      int e = errno;
      close (fd);
      return wr_error (err, e, WR_E_UNAVAILABLE, "port %u in the sandbox", j->port);
    }
  return fd;
}

static int
proxy_connect (struct proxy_job *j, wr_err_t *err)
{
  if (j->guest.s_addr)
    return proxy_connect_guest (j, err);
  int self = open ("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (self < 0)
    return wr_sys_error (err, "own netns");
  if (setns (j->pidfd, CLONE_NEWNET) < 0)
    {
      close (self);
      return wr_sys_error (err, "setns into the sandbox");
    }
  int fd = socket (AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int e = errno;
  if (setns (self, CLONE_NEWNET) < 0)
    abort (); /* never leave a worker in a sandbox's netns */
  close (self);
  if (fd < 0)
    return wr_error (err, e, WR_E_INTERNAL, "socket");
  struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons ((uint16_t)j->port) };
  a.sin_addr.s_addr = htonl (INADDR_LOOPBACK);
  struct timeval tv = { PROXY_TIMEOUT_MS / 1000, 0 };
  setsockopt (fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt (fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect (fd, (struct sockaddr *)&a, sizeof a) < 0)
    {
      e = errno;
      close (fd);
      return wr_error (err, e, WR_E_UNAVAILABLE, "port %u in the sandbox", j->port);
    }
  return fd;
}

static void
proxy_work (void *arg)
{
  struct proxy_job *j = arg;
  _cleanup_close_ int fd = proxy_connect (j, &j->err);
  if (fd < 0)
    {
      j->r = fd;
      return;
    }
  size_t blen = evbuffer_get_length (j->body);
  const unsigned char *body = evbuffer_pullup (j->body, -1);
  if (send (fd, j->head, strlen (j->head), MSG_NOSIGNAL) < 0
      || (blen && send (fd, body, blen, MSG_NOSIGNAL) < 0))
    {
      j->r = wr_error (&j->err, errno, WR_E_UNAVAILABLE, "port %u: send", j->port);
      return;
    }
  size_t cap = 65536;
  j->resp = malloc (cap);
  for (;;)
    {
      if (j->resp_len == cap)
        {
          if (cap >= PROXY_MAX)
            {
              j->r = wr_error (&j->err, 0, WR_E_TOO_LARGE, "answer over %u bytes", PROXY_MAX);
              return;
            }
          cap *= 2;
          j->resp = realloc (j->resp, cap);
        }
      ssize_t n = recv (fd, j->resp + j->resp_len, cap - j->resp_len, 0);
      if (n < 0)
        {
          j->r = wr_error (&j->err, errno, errno == EAGAIN ? WR_E_TIMEOUT : WR_E_UNAVAILABLE,
                           "port %u: receive", j->port);
          return;
        }
      if (n == 0)
        break;
      j->resp_len += (size_t)n;
    }
}

static void
proxy_done (void *arg)
{
  struct proxy_job *j = arg;
  char *hend = j->r == 0 && j->resp ? memmem (j->resp, j->resp_len, "\r\n\r\n", 4) : NULL;
  int status = 0;
  if (j->r == 0 && (hend == NULL || sscanf (j->resp, "HTTP/%*d.%*d %d", &status) != 1))
    j->r = wr_error (&j->err, 0, WR_E_UNAVAILABLE, "port %u: not an HTTP answer", j->port);
  if (j->r < 0)
    wrd_reply_error (j->req, &j->err);
  else
    {
      *hend = 0;
      struct evkeyvalq *out = evhttp_request_get_output_headers (j->req);
      char *save = NULL;
      strtok_r (j->resp, "\r\n", &save); /* status line */
      for (char *h = strtok_r (NULL, "\r\n", &save); h; h = strtok_r (NULL, "\r\n", &save))
        {
          char *c = strchr (h, ':');
          if (c == NULL)
            continue;
          *c++ = 0;
          while (*c == ' ')
            c++;
          if (strcasecmp (h, "Content-Length") != 0 && strcasecmp (h, "Connection") != 0
              && strcasecmp (h, "Transfer-Encoding") != 0 && strcasecmp (h, "Date") != 0
              && strcasecmp (h, "Server") != 0)
            evhttp_add_header (out, h, c);
        }
      struct evbuffer *b = evbuffer_new ();
      evbuffer_add (b, hend + 4, j->resp_len - (size_t)(hend + 4 - j->resp));
      evhttp_send_reply (j->req, status, "Proxied", b);
      evbuffer_free (b);
    }
  close (j->pidfd);
  free (j->head);
  evbuffer_free (j->body);
  free (j->resp);
  free (j);
}

void
wrd_http_net_proxy (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, const char *rest)
{
  char *end;
  long port = strtol (rest, &end, 10);
  if (end == rest || (*end && *end != '/') || port < 1 || port > 65535)
    {
      wrd_reply_error_code (req, WR_E_INVALID, "proxy route is proxy/PORT/PATH");
      return;
    }
  if (sb->state != SB_RUNNING || wr_container_pidfd (&sb->c) < 0)
    {
      wrd_reply_error_code (req, WR_E_CONFLICT, "the sandbox is not running a container");
      return;
    }
  const char *m;
  switch (evhttp_request_get_command (req))
    {
    case EVHTTP_REQ_GET:
      m = "GET";
      break;
    case EVHTTP_REQ_POST:
      m = "POST";
      break;
    case EVHTTP_REQ_PUT:
      m = "PUT";
      break;
    case EVHTTP_REQ_DELETE:
      m = "DELETE";
      break;
    case EVHTTP_REQ_HEAD:
      m = "HEAD";
      break;
    case EVHTTP_REQ_PATCH:
      m = "PATCH";
      break;
    default:
      wrd_reply_error_code (req, WR_E_INVALID, "method not proxied");
      return;
    }
  const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri (req);
  const char *qs = evhttp_uri_get_query (uri);
  struct evbuffer *h = evbuffer_new ();
  evbuffer_add_printf (h, "%s %s%s%s HTTP/1.0\r\nHost: 127.0.0.1:%ld\r\nConnection: close\r\n", m,
                       *end ? end : "/", qs ? "?" : "", qs ? qs : "", port);
  struct evkeyval *kv;
  TAILQ_FOREACH (kv, evhttp_request_get_input_headers (req), next)
  {
    /* the API's credential stays with the API */
    if (strcasecmp (kv->key, "Authorization") && strcasecmp (kv->key, "Host")
        && strcasecmp (kv->key, "Connection") && strcasecmp (kv->key, "Content-Length")
        && strcasecmp (kv->key, "Transfer-Encoding"))
      evbuffer_add_printf (h, "%s: %s\r\n", kv->key, kv->value);
  }
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  evbuffer_add_printf (h, "Content-Length: %zu\r\n\r\n", evbuffer_get_length (in));
  struct proxy_job *j = calloc (1, sizeof *j);
  j->req = req;
  j->port = (unsigned)port;
  j->pidfd = fcntl (sb->c.pidfd, F_DUPFD_CLOEXEC, 3);
  struct sbnet *vs = strcmp (sb->backend, "container") != 0 ? sbnet_of (sb) : NULL;
  if (vs)
    j->guest = wr_net_address (knet, vs->slot);
  size_t hl = evbuffer_get_length (h);
  j->head = malloc (hl + 1);
  evbuffer_remove (h, j->head, hl);
  j->head[hl] = 0;
  evbuffer_free (h);
  j->body = evbuffer_new ();
  evbuffer_add_buffer (j->body, in);
  if (j->pidfd < 0 || wrd_job_run (d, proxy_work, proxy_done, j) < 0)
    {
      j->r = wr_error (&j->err, 0, WR_E_INTERNAL, "cannot start the proxy");
      if (j->pidfd < 0)
        j->pidfd = open ("/dev/null", O_RDONLY | O_CLOEXEC);
      proxy_done (j);
    }
}

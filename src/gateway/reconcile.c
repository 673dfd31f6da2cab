/* The quota reconciler (docs/cluster.md, "The reconciler").
 *
 * Every gateway holds an etcd session (one lease) under which it publishes
 * what it holds of each project's quota (/warren-reserve/PROJECT/ID) and
 * stands for election (/warren-reconciler, created only if absent). The
 * elected one reads, at one etcd revision X, the nodes' per-project counts,
 * every live gateway's published holdings and the quota counters, and
 * lowers a counter R to what that snapshot accounts for, in a transaction
 * that also requires: R unchanged since X, no holding under the project
 * written since X, and the election key still its own. It never raises R. */
#include "gateway/gateway.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/b64.h"
#include "common/util.h"

/* etcd's JSON gateway takes 64-bit numbers as strings */
static json_t *
rev_json (long long v)
{
  char b[24];
  snprintf (b, sizeof b, "%lld", v);
  return json_string (b);
}

#define RECONCILE_EVERY_MS 1000

int64_t
gw_session (struct gw *g, wr_err_t *err)
{
  pthread_mutex_lock (&g->session_mu);
  int64_t id = atomic_load (&g->session);
  if (id == 0 && wr_etcd_lease_grant (g->etcd, GW_SESSION_TTL_S, &id, err) == 0)
    {
      atomic_store (&g->session_ok_ms, wr_now_ms ());
      atomic_fetch_add (&g->session_gen, 1);
      atomic_store (&g->session, id);
    }
  pthread_mutex_unlock (&g->session_mu);
  return id;
}

bool
gw_session_fresh (struct gw *g)
{
  uint64_t ok = atomic_load (&g->session_ok_ms);
  return atomic_load (&g->session) != 0 && ok && wr_now_ms () - ok < (GW_SESSION_TTL_S - 2) * 1000u;
}

static void
keepalive (struct gw *g)
{
  wr_err_t err;
  int64_t id = gw_session (g, &err);
  if (id == 0)
    return;
  uint64_t sent = wr_now_ms ();
  int64_t ttl = 0;
  if (wr_etcd_lease_keepalive (g->etcd, id, &ttl, &err) < 0)
    return; /* etcd unreachable: the reserve stops being usable once the lease may be gone */
  if (ttl > 0)
    {
      atomic_store (&g->session_ok_ms, sent);
      return;
    }
  /* expired: every key under it is gone; a new lease, and every holding is
   * published again (gw_quota_sweep) before it is used */
  fprintf (stderr, "warren-gateway: etcd session expired; starting a new one\n");
  pthread_mutex_lock (&g->session_mu);
  if (atomic_load (&g->session) == id)
    atomic_store (&g->session, 0);
  pthread_mutex_unlock (&g->session_mu);
  atomic_store (&g->reconciler, false);
  gw_session (g, &err);
}

static json_t *
range_op (const char *prefix, int64_t rev)
{
  json_t *r = json_pack ("{s:o,s:o}", "key", wr_etcd_b64 (prefix, strlen (prefix)), "range_end",
                         wr_etcd_prefix_end (prefix));
  if (rev)
    json_object_set_new (r, "revision", rev_json (rev));
  return json_pack ("{s:o}", "request_range", r);
}

static long long
jint (const json_t *o, const char *f)
{
  json_t *v = json_object_get (o, f);
  return json_is_integer (v)  ? json_integer_value (v)
         : json_is_string (v) ? atoll (json_string_value (v))
                              : 0;
}

/* key/value of an etcd kv as strings (decoded); NULL when malformed */
static char *
kv_str (const json_t *kv, const char *field)
{
  const char *b = json_string_value (json_object_get (kv, field));
  if (b == NULL)
    return strdup ("");
  size_t len = strlen (b);
  char *out = malloc (len / 4 * 3 + 4);
  long n = out ? wr_b64_decode (b, len, out) : -1;
  if (n < 0)
    {
      free (out);
      return NULL;
    }
  out[n] = '\0';
  return out;
}

/* Am I the reconciler? Create the election key if absent, under the session. */
static bool
elect (struct gw *g, int64_t lease, int64_t *ret_create_rev)
{
  json_t *k = wr_etcd_b64 (GW_KEY_LEADER, strlen (GW_KEY_LEADER));
  json_t *body
      = json_pack ("{s:[{s:O,s:s,s:s,s:s}],s:[{s:{s:O,s:o,s:s}}],s:[{s:{s:O}}]}", "compare", "key",
                   k, "target", "CREATE", "result", "EQUAL", "create_revision", "0", "success",
                   "request_put", "key", k, "value", wr_etcd_b64 (g->id, strlen (g->id)), "lease",
                   "", "failure", "request_range", "key", k);
  json_object_set_new (
      json_object_get (json_array_get (json_object_get (body, "success"), 0), "request_put"),
      "lease", rev_json (lease));
  json_decref (k);
  json_t *resp = NULL;
  wr_err_t err;
  int r = wr_etcd_call (g->etcd, "/v3/kv/txn", body, &resp, &err);
  json_decref (body);
  if (r < 0)
    return false;
  bool won = json_is_true (json_object_get (resp, "succeeded"));
  bool me = won;
  int64_t crev = won ? jint (json_object_get (resp, "header"), "revision") : 0;
  if (!won)
    {
      json_t *kv = json_array_get (
          json_object_get (json_object_get (json_array_get (json_object_get (resp, "responses"), 0),
                                            "response_range"),
                           "kvs"),
          0);
      _cleanup_free_ char *v = kv ? kv_str (kv, "value") : NULL;
      me = v && strcmp (v, g->id) == 0 && jint (kv, "lease") == lease;
      crev = jint (kv, "create_revision");
    }
  json_decref (resp);
  *ret_create_rev = crev;
  return me;
}

static long long
counted (json_t *tally, const char *project, const char *field)
{
  return json_integer_value (json_object_get (json_object_get (tally, project), field));
}

static void
tally_add (json_t *tally, const char *project, long long sb, long long mem)
{
  json_t *t = json_object_get (tally, project);
  if (t == NULL)
    json_object_set_new (
        tally, project,
        t = json_pack ("{s:I,s:I}", "sandboxes", (json_int_t)0, "memory_mb", (json_int_t)0));
  json_object_set_new (t, "sandboxes", json_integer (jint (t, "sandboxes") + sb));
  json_object_set_new (t, "memory_mb", json_integer (jint (t, "memory_mb") + mem));
}

static json_t *
kvs_of (json_t *resp, size_t i)
{
  return json_object_get (
      json_object_get (json_array_get (json_object_get (resp, "responses"), i), "response_range"),
      "kvs");
}

/* One pass: read everything at one revision, lower the counters it proves too high. */
static void
reconcile (struct gw *g, int64_t leader_crev)
{
  json_t *body = json_pack ("{s:[],s:[o,o,o]}", "compare", "success", range_op (WR_KEY_NODES, 0),
                            range_op (GW_KEY_RESERVE, 0), range_op (WR_KEY_QUOTA, 0));
  json_t *resp = NULL;
  wr_err_t err;
  int r = wr_etcd_call (g->etcd, "/v3/kv/txn", body, &resp, &err);
  json_decref (body);
  if (r < 0)
    return;
  int64_t X = jint (json_object_get (resp, "header"), "revision");
  json_t *tally = json_object ();
  size_t i;
  json_t *kv;
  json_array_foreach (kvs_of (resp, 0), i, kv)
  {
    _cleanup_free_ char *v = kv_str (kv, "value");
    json_t *st = v ? json_loads (v, 0, NULL) : NULL;
    const char *name;
    json_t *pj;
    json_object_foreach (json_object_get (st, "projects"), name, pj)
        tally_add (tally, name, jint (pj, "sandboxes"), jint (pj, "memory_mb"));
    json_decref (st);
  }
  json_array_foreach (kvs_of (resp, 1), i, kv)
  {
    _cleanup_free_ char *k = kv_str (kv, "key"), *v = kv_str (kv, "value");
    if (k == NULL || v == NULL)
      continue;
    char *proj = k + strlen (GW_KEY_RESERVE), *slash = strchr (proj, '/');
    if (slash == NULL)
      continue;
    *slash = '\0';
    json_t *h = json_loads (v, 0, NULL);
    tally_add (tally, proj, jint (h, "sandboxes"), jint (h, "memory_mb"));
    json_decref (h);
  }
  json_array_foreach (kvs_of (resp, 2), i, kv)
  {
    _cleanup_free_ char *k = kv_str (kv, "key"), *v = kv_str (kv, "value");
    if (k == NULL || v == NULL)
      continue;
    const char *proj = k + strlen (WR_KEY_QUOTA);
    json_t *c = json_loads (v, 0, NULL);
    long long R = jint (c, "sandboxes"), M = jint (c, "memory_mb");
    json_decref (c);
    long long want_sb = counted (tally, proj, "sandboxes"),
              want_mem = counted (tally, proj, "memory_mb");
    if (want_sb >= R && want_mem >= M)
      continue;
    /* only ever lower, each dimension on its own */
    long long new_sb = want_sb < R ? want_sb : R, new_mem = want_mem < M ? want_mem : M;
    char text[128], rprefix[200];
    snprintf (text, sizeof text, "{\"sandboxes\":%lld,\"memory_mb\":%lld}", new_sb, new_mem);
    snprintf (rprefix, sizeof rprefix, "%s%s/", GW_KEY_RESERVE, proj);
    json_t *qk = wr_etcd_b64 (k, strlen (k));
    json_t *lk = wr_etcd_b64 (GW_KEY_LEADER, strlen (GW_KEY_LEADER));
    json_t *txn = json_pack (
        "{s:[{s:O,s:s,s:s,s:o},{s:o,s:o,s:s,s:s,s:o},{s:o,s:s,s:s,s:o}],s:[{s:{s:O,s:o}}]}",
        "compare",
        /* the counter is as read at X */
        "key", qk, "target", "MOD", "result", "EQUAL", "mod_revision",
        rev_json (jint (kv, "mod_revision")),
        /* no gateway wrote a holding of this project since X */
        "key", wr_etcd_b64 (rprefix, strlen (rprefix)), "range_end", wr_etcd_prefix_end (rprefix),
        "target", "MOD", "result", "LESS", "mod_revision", rev_json (X + 1),
        /* still the elected reconciler */
        "key", lk, "target", "CREATE", "result", "EQUAL", "create_revision", rev_json (leader_crev),
        "success", "request_put", "key", qk, "value", wr_etcd_b64 (text, strlen (text)));
    json_decref (qk);
    json_t *tr = NULL;
    if (wr_etcd_call (g->etcd, "/v3/kv/txn", txn, &tr, &err) == 0
        && json_is_true (json_object_get (tr, "succeeded")))
      {
        atomic_fetch_add (&g->reconcile_fixes, 1);
        fprintf (stderr,
                 "warren-gateway: reconciler: project %s reserved %lld sandboxes / %lld MB, "
                 "accounted for %lld / %lld at revision %lld: lowered\n",
                 proj, R, M, want_sb, want_mem, (long long)X);
      }
    json_decref (tr);
    json_decref (txn);
  }
  json_decref (tally);
  json_decref (resp);
}

static void *
reconcile_main (void *arg)
{
  struct gw *g = arg;
  while (!g->stop)
    {
      uint64_t t0 = wr_now_ms ();
      keepalive (g);
      int64_t lease = atomic_load (&g->session), crev = 0;
      bool leader = lease && gw_session_fresh (g) && elect (g, lease, &crev);
      if (leader != atomic_load (&g->reconciler))
        fprintf (stderr, "warren-gateway: %s the quota reconciler\n",
                 leader ? "elected" : "no longer");
      atomic_store (&g->reconciler, leader);
      if (leader)
        reconcile (g, crev);
      while (!g->stop && wr_now_ms () - t0 < RECONCILE_EVERY_MS)
        usleep (50 * 1000);
    }
  return NULL;
}

int
gw_reconcile_start (struct gw *g, wr_err_t *err)
{
  char hex[17];
  wr_random_hex (hex, 16);
  snprintf (g->id, sizeof g->id, "gw-%s", hex);
  if (pthread_create (&g->reconcile_thread, NULL, reconcile_main, g) != 0)
    return wr_error (err, errno, WR_E_INTERNAL, "reconciler thread");
  return 0;
}

void
gw_reconcile_stop (struct gw *g)
{
  pthread_join (g->reconcile_thread, NULL);
  /* leave at once: the reserve keys and the candidacy go with the lease */
  int64_t id = atomic_load (&g->session);
  wr_err_t err;
  if (id)
    wr_etcd_lease_revoke (g->etcd, id, &err);
}

/* Idempotency keys in etcd (docs/cluster.md, "Idempotent creates").
 *
 * Two keys per idempotency key K:
 * - the claim /warren-idem/K: {"gw","node"} while the create is in flight,
 *   under the claiming gateway's session lease (GW_SESSION_TTL_S), so a
 *   gateway killed mid-create leaves it behind for seconds, not hours; once
 *   the create succeeded, {"node","id"} under the retention lease (one to
 *   two hours); deleted when the create failed.
 * - the hint /warren-idem-node/K: {"node"} under the retention lease, from
 *   the same transaction as the claim: the node the first attempt went to.
 *   A retry that finds the claim gone but the hint there (its gateway died)
 *   looks for the sandbox on that node and otherwise creates it there.
 * Blocking calls: run on a worker thread. */
#include "gateway/gateway.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/b64.h"
#include "common/util.h"

#define KEY_CLAIM "/warren-idem/"
#define KEY_HINT "/warren-idem-node/"
#define RETENTION_S 7200

static pthread_mutex_t retention_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t retention_lease;
static uint64_t retention_ms;

/* A lease of RETENTION_S, replaced hourly: keys under it live one to two hours. */
static int64_t
retention (struct gw *g, wr_err_t *err)
{
  pthread_mutex_lock (&retention_mu);
  if (retention_lease == 0 || wr_now_ms () - retention_ms > RETENTION_S / 2 * 1000u)
    {
      int64_t id = 0;
      if (wr_etcd_lease_grant (g->etcd, RETENTION_S, &id, err) == 0)
        {
          retention_lease = id;
          retention_ms = wr_now_ms ();
        }
    }
  int64_t lease = retention_lease;
  pthread_mutex_unlock (&retention_mu);
  return lease;
}

static json_t *
num (long long v)
{
  char b[24];
  snprintf (b, sizeof b, "%lld", v);
  return json_string (b);
}

static json_t *
b64 (const char *s)
{
  return wr_etcd_b64 (s, strlen (s));
}

static json_t *
absent (const char *key)
{
  return json_pack ("{s:o,s:s,s:s,s:o}", "key", b64 (key), "target", "CREATE", "result", "EQUAL",
                    "create_revision", num (0));
}

static json_t *
put (const char *key, const char *val, int64_t lease)
{
  return json_pack ("{s:{s:o,s:o,s:o}}", "request_put", "key", b64 (key), "value", b64 (val),
                    "lease", num (lease));
}

/* The value of the i-th range response of a txn answer, parsed; NULL when absent. */
static json_t *
range_value (json_t *resp, size_t i)
{
  json_t *kv = json_array_get (
      json_object_get (json_object_get (json_array_get (json_object_get (resp, "responses"), i),
                                        "response_range"),
                       "kvs"),
      0);
  const char *v = json_string_value (json_object_get (kv, "value"));
  if (v == NULL)
    return NULL;
  size_t n = strlen (v);
  char *out = malloc (n / 4 * 3 + 4);
  long k = out ? wr_b64_decode (v, n, out) : -1;
  json_t *j = k >= 0 ? json_loadb (out, (size_t)k, 0, NULL) : NULL;
  free (out);
  return j;
}

static void
copy_field (json_t *j, const char *field, char *buf, size_t size)
{
  const char *s = json_string_value (json_object_get (j, field));
  if (s && strlen (s) < size)
    snprintf (buf, size, "%s", s);
}

int
gw_idem_claim (struct gw *g, struct gw_idem *c, wr_err_t *err)
{
  char ck[160], hk[160], val[200], hval[100];
  snprintf (ck, sizeof ck, "%s%s", KEY_CLAIM, c->key);
  snprintf (hk, sizeof hk, "%s%s", KEY_HINT, c->key);
  int64_t session = gw_session (g, err), keep = session ? retention (g, err) : 0;
  if (session == 0 || keep == 0)
    return -1;
  for (int round = 0; round < 2; round++)
    {
      /* round 0: neither key exists, a first attempt; round 1: the hint
       * names the node an earlier attempt went to, whose gateway died */
      snprintf (val, sizeof val, "{\"gw\":\"%s\",\"node\":\"%s\"}", g->id, c->node);
      snprintf (hval, sizeof hval, "{\"node\":\"%s\"}", c->node);
      json_t *cmp = json_pack ("[o]", absent (ck));
      if (round == 0)
        json_array_append_new (cmp, absent (hk));
      json_t *body = json_pack ("{s:o,s:[o,o],s:[{s:{s:o}},{s:{s:o}}]}", "compare", cmp, "success",
                                put (ck, val, session), put (hk, hval, keep), "failure",
                                "request_range", "key", b64 (ck), "request_range", "key", b64 (hk));
      json_t *resp = NULL;
      int r = wr_etcd_call (g->etcd, "/v3/kv/txn", body, &resp, err);
      json_decref (body);
      g->m.idem_claims++;
      if (r < 0)
        return -1;
      if (json_is_true (json_object_get (resp, "succeeded")))
        {
          json_decref (resp);
          c->result = round == 0 ? GW_IDEM_CLAIMED : GW_IDEM_ORPHAN;
          return 0;
        }
      json_t *claim = range_value (resp, 0), *hint = range_value (resp, 1);
      json_decref (resp);
      if (claim)
        {
          /* a live attempt (another gateway's, or done): its node, its sandbox */
          c->result = GW_IDEM_TAKEN;
          copy_field (claim, "node", c->node, sizeof c->node);
          copy_field (claim, "id", c->id, sizeof c->id);
          json_decref (claim);
          json_decref (hint);
          return 0;
        }
      /* claim gone, hint left: the attempt's gateway died before the outcome */
      copy_field (hint, "node", c->node, sizeof c->node);
      json_decref (hint);
    }
  /* lost the re-claim race to another gateway retrying the same key */
  c->result = GW_IDEM_TAKEN;
  return 0;
}

void
gw_idem_settle (struct gw *g, const char *key, const char *node, const char *id)
{
  char ck[160], hk[160];
  snprintf (ck, sizeof ck, "%s%s", KEY_CLAIM, key);
  snprintf (hk, sizeof hk, "%s%s", KEY_HINT, key);
  wr_err_t err;
  if (id == NULL)
    {
      /* the create failed: a retry starts afresh */
      wr_etcd_delete (g->etcd, ck, &err);
      wr_etcd_delete (g->etcd, hk, &err);
      return;
    }
  char val[200];
  snprintf (val, sizeof val, "{\"node\":\"%s\",\"id\":\"%s\"}", node, id);
  int64_t keep = retention (g, &err);
  if (keep)
    wr_etcd_put (g->etcd, ck, val, keep, &err);
  g->m.idem_claims++;
}

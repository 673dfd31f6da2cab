/* Project quotas across racing gateways (docs/cluster.md, "Quotas").
 *
 * etcd holds one counter per project, /warren-quota/NAME =
 * {"sandboxes": R, "memory_mb": M}: what all gateways together have
 * reserved. A gateway reserves a chunk at once (compare-and-swap on the
 * counter's mod_revision, so two gateways never both take the last slots)
 * and hands slots out locally, so only one create in `chunk` pays an etcd
 * round trip. Deletes give the slot back to the local reserve; a reserve
 * above two chunks is returned to etcd. Live sandboxes <= R <= the quota
 * at every instant, whatever the interleaving. */
#include "gateway/gateway.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <event2/buffer.h>

#include "common/util.h"

/* etcd's JSON gateway takes 64-bit numbers as strings */
static json_t *
rev_json (long long v)
{
  char b[24];
  snprintf (b, sizeof b, "%lld", v);
  return json_string (b);
}
#include "image/sha256.h"

struct create_ctx; /* opaque here: waiters are kept in their own nodes */

struct waiter
{
  long long mem;
  gw_quota_cb cb;
  void *ud;
  struct waiter *next;
};

struct job
{
  struct gw *g;
  struct gw_project *p;
  char name[65];
  long long max_sb, max_mem;
  long long delta_sb, delta_mem; /* > 0 reserve, < 0 release */
  long long min_sb, min_mem;     /* a reservation below this is useless */
  long long got_sb, got_mem;
  /* the holding published with the change: base + what the change got */
  long long base_sb, base_mem;
  long long credit_sb, credit_mem; /* pending credits the publication makes usable */
  bool publish_only;
  uint64_t gen;  /* session generation the publication was made under */
  int64_t lease; /* that session's lease */
  bool ok;
  char why[300];
  struct event *done;
};

/* the waiters list lives beside the project (gateway.h keeps it opaque) */
static struct waiter *
wq_head (struct gw_project *p)
{
  return (struct waiter *)p->waiters;
}

static void
wq_set_head (struct gw_project *p, struct waiter *w)
{
  p->waiters = (struct create_ctx *)w;
  if (w == NULL)
    p->waiters_tail = &p->waiters;
}

static void
holding_text (struct job *j, long long dsb, long long dmem, char *buf, size_t size)
{
  long long sb = j->base_sb + (dsb > 0 ? dsb : 0), mem = j->base_mem + (dmem > 0 ? dmem : 0);
  snprintf (buf, size, "{\"sandboxes\":%lld,\"memory_mb\":%lld}", sb, mem);
}

static void
holding_key (struct gw *g, const char *project, char *buf, size_t size)
{
  snprintf (buf, size, "%s%s/%s", GW_KEY_RESERVE, project, g->id);
}

/* The counter's compare-and-swap, and this gateway's published holding in
 * the same transaction (under its session lease): the reconciler never sees
 * a reservation that no holding accounts for. 1 written, 0 lost the race. */
static int
cas_and_publish (struct gw *g, struct job *j, const char *key, int64_t rev, const char *text,
                 long long dsb, long long dmem, wr_err_t *err)
{
  int64_t lease = j->lease;
  if (lease == 0)
    return wr_etcd_cas (g->etcd, key, rev, text, 0, err); /* shutdown: no session */
  char hk[200], hv[128];
  holding_key (g, j->name, hk, sizeof hk);
  holding_text (j, dsb, dmem, hv, sizeof hv);
  json_t *k = wr_etcd_b64 (key, strlen (key));
  json_t *body
      = json_pack ("{s:[{s:O,s:s,s:s,s:o}],s:[{s:{s:O,s:o}},{s:{s:o,s:o,s:o}}]}", "compare", "key",
                   k, "target", "MOD", "result", "EQUAL", "mod_revision", rev_json (rev), "success",
                   "request_put", "key", k, "value", wr_etcd_b64 (text, strlen (text)),
                   "request_put", "key", wr_etcd_b64 (hk, strlen (hk)), "value",
                   wr_etcd_b64 (hv, strlen (hv)), "lease", rev_json (lease));
  json_decref (k);
  json_t *resp = NULL;
  int r = wr_etcd_call (g->etcd, "/v3/kv/txn", body, &resp, err);
  json_decref (body);
  if (r < 0)
    return r;
  bool ok = json_is_true (json_object_get (resp, "succeeded"));
  json_decref (resp);
  return ok ? 1 : 0;
}

static int
publish (struct gw *g, struct job *j, wr_err_t *err)
{
  int64_t lease = j->lease;
  char hk[200], hv[128];
  holding_key (g, j->name, hk, sizeof hk);
  holding_text (j, 0, 0, hv, sizeof hv);
  return wr_etcd_put (g->etcd, hk, hv, lease, err);
}

static int
quota_cas (struct gw *g, struct job *j, wr_err_t *err)
{
  char key[128];
  snprintf (key, sizeof key, "%s%s", WR_KEY_QUOTA, j->name);
  for (int attempt = 0; attempt < 50; attempt++)
    {
      _cleanup_free_ char *val = NULL;
      int64_t rev = 0;
      int r = wr_etcd_get (g->etcd, key, &val, &rev, err);
      if (r < 0)
        return r;
      json_t *cur = val ? json_loads (val, 0, NULL) : NULL;
      long long R = json_integer_value (json_object_get (cur, "sandboxes"));
      long long M = json_integer_value (json_object_get (cur, "memory_mb"));
      json_decref (cur);
      long long dsb = j->delta_sb, dmem = j->delta_mem;
      if (dsb > 0)
        {
          if (R + j->min_sb > j->max_sb)
            return wr_error (err, 0, WR_E_EXHAUSTED, "project %s: quota of %lld sandboxes reached",
                             j->name, j->max_sb);
          if (R + dsb > j->max_sb)
            dsb = j->max_sb - R;
          if (j->max_mem > 0)
            {
              if (M + j->min_mem > j->max_mem)
                return wr_error (err, 0, WR_E_EXHAUSTED, "project %s: quota of %lld MB reached",
                                 j->name, j->max_mem);
              if (M + dmem > j->max_mem)
                dmem = j->max_mem - M;
            }
          else
            dmem = 0;
        }
      else
        {
          /* never below zero, whatever a crashed peer left behind */
          if (R + dsb < 0)
            dsb = -R;
          if (M + dmem < 0)
            dmem = -M;
        }
      char text[128];
      snprintf (text, sizeof text, "{\"sandboxes\":%lld,\"memory_mb\":%lld}", R + dsb, M + dmem);
      r = cas_and_publish (g, j, key, rev, text, dsb, dmem, err);
      if (r < 0)
        return r;
      g->m.quota_txns++;
      if (r == 0)
        g->m.quota_conflicts++;
      if (r == 1)
        {
          j->got_sb = dsb;
          j->got_mem = dmem;
          return 0;
        }
      /* another gateway got there first: read again */
      usleep ((useconds_t)(200 + (wr_now_ns () % 800)));
    }
  return wr_error (err, 0, WR_E_UNAVAILABLE, "project %s: quota counter too contended", j->name);
}

static void *
job_main (void *arg)
{
  struct job *j = arg;
  wr_err_t err;
  /* the holding is absolute: whatever session it goes under, it is all of it */
  j->gen = atomic_load (&j->g->session_gen);
  j->lease = gw_session (j->g, &err);
  if (j->lease && j->gen != atomic_load (&j->g->session_gen))
    j->gen = atomic_load (&j->g->session_gen);
  if (j->lease == 0)
    j->ok = false;
  else
    j->ok = (j->publish_only ? publish (j->g, j, &err) : quota_cas (j->g, j, &err)) == 0;
  if (!j->ok)
    snprintf (j->why, sizeof j->why, "%s%s", err.msg,
              strcmp (err.code, WR_E_EXHAUSTED) == 0 ? "" : " (control plane unavailable)");
  event_active (j->done, EV_TIMEOUT, 0);
  return NULL;
}

static void serve_waiters (struct gw *g, struct gw_project *p, const char *failure);
static long long holding (struct gw_project *p, long long *ret_mem);
static void start_job (struct gw *g, struct gw_project *p, long long dsb, long long dmem,
                       long long min_sb, long long min_mem);

static void
job_done (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct job *j = arg;
  struct gw_project *p = j->p;
  struct gw *g = j->g;
  p->reserving = false;
  if (j->ok)
    {
      /* the publication made these credits count: now they may be used */
      p->pending_sb -= j->credit_sb;
      p->pending_mem -= j->credit_mem;
      p->free_sb += j->credit_sb;
      p->free_mem += j->credit_mem;
      p->pub_sb = j->base_sb + (j->got_sb > 0 ? j->got_sb : 0);
      p->pub_mem = j->base_mem + (j->got_mem > 0 ? j->got_mem : 0);
      p->pub_gen = j->gen;
    }
  if (j->ok && j->delta_sb > 0)
    {
      p->free_sb += j->got_sb;
      p->free_mem += j->got_mem;
    }
  else if (!j->ok && j->delta_sb < 0)
    {
      /* could not give it back: keep it, try again later */
      p->free_sb -= j->delta_sb;
      p->free_mem -= j->delta_mem;
    }
  bool reserving = j->delta_sb > 0;
  char why[300];
  snprintf (why, sizeof why, "%s", j->why);
  event_free (j->done);
  free (j);
  serve_waiters (g, p, reserving && why[0] ? why : NULL);
}

static void
start_job (struct gw *g, struct gw_project *p, long long dsb, long long dmem, long long min_sb,
           long long min_mem)
{
  struct job *j = calloc (1, sizeof *j);
  if (j == NULL)
    return;
  *j = (struct job){ .g = g,
                     .p = p,
                     .max_sb = p->max_sandboxes,
                     .max_mem = p->max_memory_mb,
                     .delta_sb = dsb,
                     .delta_mem = dmem,
                     .min_sb = min_sb,
                     .min_mem = min_mem };
  snprintf (j->name, sizeof j->name, "%s", p->name);
  j->done = event_new (g->base, -1, 0, job_done, j);
  if (dsb < 0)
    {
      p->free_sb += dsb;
      p->free_mem += dmem;
    }
  j->publish_only = dsb == 0 && dmem == 0;
  j->base_sb = holding (p, &j->base_mem);
  j->credit_sb = p->pending_sb;
  j->credit_mem = p->pending_mem;
  p->reserving = true;
  pthread_t t;
  if (pthread_create (&t, NULL, job_main, j) != 0)
    {
      snprintf (j->why, sizeof j->why, "project %s: cannot start a reservation", p->name);
      event_active (j->done, EV_TIMEOUT, 0);
      return;
    }
  pthread_detach (t);
}

/* What the reconciler must keep counting for this gateway (gateway.h);
 * *ret_mem the memory of it. */
static long long
holding (struct gw_project *p, long long *ret_mem)
{
  uint64_t now = wr_now_ms () / 1000;
  long long sb = p->free_sb + p->inflight_sb + p->pending_sb;
  long long mem = p->free_mem + p->inflight_mem + p->pending_mem;
  for (int i = 0; i <= GW_SETTLE_S; i++)
    if (now - p->recent_s[i] <= (uint64_t)GW_SETTLE_S)
      {
        sb += p->recent_sb[i];
        mem += p->recent_mem[i];
      }
  *ret_mem = mem;
  return sb;
}

/* A slot leaves the reserve for a create. */
static void
use_slot (struct gw_project *p, long long mem)
{
  p->free_sb--;
  p->inflight_sb++;
  if (p->max_memory_mb)
    {
      p->free_mem -= mem;
      p->inflight_mem += mem;
    }
}

void
gw_quota_done (struct gw *g, struct gw_project *p, long long memory_mb, bool made)
{
  long long mem = p->max_memory_mb ? memory_mb : 0;
  p->inflight_sb--;
  p->inflight_mem -= mem;
  if (!made)
    {
      gw_quota_put (g, p, memory_mb);
      return;
    }
  uint64_t now = wr_now_ms () / 1000;
  int b = (int)(now % (uint64_t)(GW_SETTLE_S + 1));
  if (p->recent_s[b] != now)
    {
      p->recent_s[b] = now;
      p->recent_sb[b] = p->recent_mem[b] = 0;
    }
  p->recent_sb[b]++;
  p->recent_mem[b] += mem;
}

static bool
fits (struct gw *g, struct gw_project *p, long long mem)
{
  /* a reserve the cluster cannot see (no live session, or not published
   * under it) is not used: the reconciler may have handed it out again */
  return p->free_sb >= 1 && (p->max_memory_mb == 0 || p->free_mem >= mem) && gw_session_fresh (g)
         && p->pub_gen == atomic_load (&g->session_gen);
}

/* Slots per etcd transaction: the gateway's --quota-chunk, but at most an
 * eighth of the quota, so a small quota is not held whole by one gateway
 * while another is refused. */
static long long
chunk_of (struct gw *g, struct gw_project *p)
{
  long long c = p->max_sandboxes / 8;
  if (c < 1)
    c = 1;
  return c < g->chunk ? c : g->chunk;
}

/* Reserve enough for every queued create (at least a chunk); the first
 * waiter's needs are the minimum worth taking. */
static void
reserve_for_waiters (struct gw *g, struct gw_project *p)
{
  struct waiter *w = wq_head (p);
  long long n = 0, maxmem = 0;
  for (struct waiter *x = w; x; x = x->next)
    {
      n++;
      maxmem = x->mem > maxmem ? x->mem : maxmem;
    }
  long long chunk = chunk_of (g, p);
  long long total = n > chunk ? n : chunk;
  long long want_sb = total - p->free_sb > 1 ? total - p->free_sb : 1;
  long long min_sb = p->free_sb >= 1 ? 0 : 1;
  long long want_mem = 0, min_mem = 0;
  if (p->max_memory_mb)
    {
      want_mem = total * maxmem - p->free_mem;
      min_mem = w->mem - p->free_mem > 0 ? w->mem - p->free_mem : 0;
      if (want_mem < min_mem)
        want_mem = min_mem;
    }
  start_job (g, p, want_sb, want_mem, min_sb, min_mem);
}

static void
serve_waiters (struct gw *g, struct gw_project *p, const char *failure)
{
  struct waiter *w;
  while ((w = wq_head (p)) != NULL)
    {
      bool ok = fits (g, p, w->mem);
      if (!ok && failure == NULL)
        {
          if (!p->reserving)
            reserve_for_waiters (g, p);
          return;
        }
      if (ok)
        use_slot (p, w->mem);
      wq_set_head (p, w->next);
      w->cb (g, ok, ok ? NULL : failure, w->ud);
      free (w);
    }
}

void
gw_quota_take (struct gw *g, struct gw_project *p, long long memory_mb, gw_quota_cb cb, void *ud)
{
  p->last_use_ms = wr_now_ms ();
  if (wq_head (p) == NULL && fits (g, p, memory_mb))
    {
      use_slot (p, memory_mb);
      cb (g, true, NULL, ud);
      return;
    }
  struct waiter *w = calloc (1, sizeof *w);
  if (w == NULL)
    {
      cb (g, false, "out of memory", ud);
      return;
    }
  *w = (struct waiter){ .mem = memory_mb, .cb = cb, .ud = ud };
  *p->waiters_tail = (struct create_ctx *)w;
  p->waiters_tail = (struct create_ctx **)&w->next;
  if (!p->reserving)
    serve_waiters (g, p, NULL);
}

void
gw_quota_put (struct gw *g, struct gw_project *p, long long memory_mb)
{
  /* usable once published (gw_quota_sweep): until then the node may have
   * stopped counting the sandbox while no holding counts the slot */
  p->pending_sb++;
  if (p->max_memory_mb)
    p->pending_mem += memory_mb;
  p->last_use_ms = wr_now_ms ();
  if (wq_head (p))
    {
      if (!p->reserving)
        serve_waiters (g, p, NULL);
      return;
    }
  long long chunk = chunk_of (g, p);
  if (!p->reserving && p->free_sb > 2 * chunk)
    {
      long long k = p->free_sb - chunk;
      long long mem = p->max_memory_mb ? p->free_mem * k / p->free_sb : 0;
      start_job (g, p, -k, -mem, 0, 0);
    }
}

void
gw_quota_sweep (struct gw *g)
{
  uint64_t now = wr_now_ms ();
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_projects; i++)
    {
      struct gw_project *p = g->projects[i];
      if (p->reserving)
        continue;
      long long mem, sb = holding (p, &mem);
      if (wq_head (p) == NULL && (p->free_sb > 0 || p->free_mem > 0)
          && now - p->last_use_ms > (uint64_t)g->idle_return_ms)
        start_job (g, p, -p->free_sb, -p->free_mem, 0, 0);
      else if (p->pending_sb > 0 || p->pending_mem > 0 || sb != p->pub_sb || mem != p->pub_mem
               || p->pub_gen != atomic_load (&g->session_gen))
        start_job (g, p, 0, 0, 0, 0); /* publish the holding */
    }
  pthread_mutex_unlock (&g->mu);
}

void
gw_quota_release_all (struct gw *g)
{
  for (size_t i = 0; i < g->n_projects; i++)
    {
      struct gw_project *p = g->projects[i];
      long long sb = p->free_sb + p->pending_sb, mem = p->free_mem + p->pending_mem;
      if (sb <= 0 && mem <= 0)
        continue;
      struct job j = { .g = g, .p = p, .delta_sb = -sb, .delta_mem = -mem };
      snprintf (j.name, sizeof j.name, "%s", p->name);
      wr_err_t err;
      if (quota_cas (g, &j, &err) < 0)
        fprintf (stderr, "warren-gateway: returning %s's reserve: %s\n", p->name, err.msg);
      else
        p->free_sb = p->free_mem = p->pending_sb = p->pending_mem = 0;
    }
}

json_t *
gw_projects_json (struct gw *g)
{
  json_t *a = json_array ();
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_projects; i++)
    {
      struct gw_project *p = g->projects[i];
      if (p->present)
        json_array_append_new (a, json_pack ("{s:s,s:I,s:I,s:i,s:{s:I,s:I}}", "name", p->name,
                                             "max_sandboxes", (json_int_t)p->max_sandboxes,
                                             "max_memory_mb", (json_int_t)p->max_memory_mb,
                                             "priority", p->priority, "reserve", "sandboxes",
                                             (json_int_t)p->free_sb, "memory_mb",
                                             (json_int_t)p->free_mem));
    }
  pthread_mutex_unlock (&g->mu);
  return json_pack ("{s:o}", "projects", a);
}

/* ---- POST /v1/projects ---- */

void
gw_projects_create (struct gw *g, struct evhttp_request *req)
{
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  size_t len = evbuffer_get_length (in);
  json_error_t je;
  json_t *body = len ? json_loadb ((const char *)evbuffer_pullup (in, -1), len, 0, &je) : NULL;
  const char *name = json_string_value (json_object_get (body, "name"));
  json_t *ms = json_object_get (body, "max_sandboxes"),
         *mm = json_object_get (body, "max_memory_mb"), *pr = json_object_get (body, "priority");
  if (!json_is_object (body) || !wr_project_name_valid (name))
    {
      gw_reply_error (req, 400, WR_E_INVALID, "field \"name\" must be [a-z0-9-]{1,64}");
      json_decref (body);
      return;
    }
  if (!json_is_integer (ms) || json_integer_value (ms) < 0
      || (mm && (!json_is_integer (mm) || json_integer_value (mm) < 0))
      || (pr && !json_is_integer (pr)))
    {
      gw_reply_error (req, 400, WR_E_INVALID,
                      "\"max_sandboxes\" (required), \"max_memory_mb\" and \"priority\" must be "
                      "non-negative integers");
      json_decref (body);
      return;
    }
  char token[69] = "wrp_";
  wr_random_hex (token + 4, 64);
  char hex[65];
  wr_sha256_hex (token, strlen (token), hex);
  json_t *rec = json_pack ("{s:s,s:I,s:I,s:I,s:s,s:I}", "name", name, "max_sandboxes",
                           json_integer_value (ms), "max_memory_mb",
                           mm ? json_integer_value (mm) : (json_int_t)0, "priority",
                           pr ? json_integer_value (pr) : (json_int_t)0, "token_sha256", hex,
                           "created_at", (json_int_t)time (NULL));
  char *text = json_dumps (rec, JSON_COMPACT | JSON_SORT_KEYS);
  char key[128];
  snprintf (key, sizeof key, "%s%s", WR_KEY_PROJECTS, name);
  wr_err_t err;
  /* an admin call, rare: a short blocking etcd transaction on the loop */
  int r = wr_etcd_cas (g->etcd, key, 0, text, 0, &err);
  free (text);
  if (r < 0)
    gw_reply_error (req, 503, "control_plane_unavailable", "%s", err.msg);
  else if (r == 0)
    gw_reply_error (req, 409, WR_E_CONFLICT, "project %s exists", name);
  else
    {
      json_object_del (rec, "token_sha256");
      json_object_set_new (rec, "token", json_string (token));
      gw_reply_json (req, 201, json_incref (rec));
    }
  json_decref (rec);
  json_decref (body);
  explicit_bzero (token, sizeof token);
}

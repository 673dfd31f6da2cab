/* The gateway's view of the cluster: a thread reads everything under
 * /warren/ once, then follows etcd's watch stream, so requests never ask
 * etcd who the nodes are. Entries are never freed: a node whose lease is
 * gone keeps its last address (routing of its ids then fails fast with
 * node_lost instead of "not found"), a drained node keeps its flag. */
#include "gateway/gateway.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/util.h"
#include "image/sha256.h"

static uint64_t rng_state;

static uint64_t
rng (void)
{
  if (rng_state == 0 && getrandom (&rng_state, sizeof rng_state, 0) != sizeof rng_state)
    rng_state = wr_now_ns () | 1;
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

struct gw_node *
gw_node_find (struct gw *g, const char *name)
{
  for (size_t i = 0; i < g->n_nodes; i++)
    if (strcmp (g->nodes[i]->name, name) == 0)
      return g->nodes[i];
  return NULL;
}

static struct gw_node *
node_get (struct gw *g, const char *name)
{
  struct gw_node *n = gw_node_find (g, name);
  if (n || !wr_node_name_valid (name) || g->n_nodes >= GW_MAX_NODES)
    return n;
  n = calloc (1, sizeof *n);
  if (n == NULL)
    return NULL;
  snprintf (n->name, sizeof n->name, "%s", name);
  g->nodes[g->n_nodes++] = n;
  return n;
}

struct gw_project *
gw_project_find (struct gw *g, const char *name)
{
  for (size_t i = 0; i < g->n_projects; i++)
    if (strcmp (g->projects[i]->name, name) == 0)
      return g->projects[i];
  return NULL;
}

struct gw_project *
gw_project_by_token (struct gw *g, const char *token)
{
  char hex[65];
  wr_sha256_hex (token, strlen (token), hex);
  for (size_t i = 0; i < g->n_projects; i++)
    if (g->projects[i]->present && strcmp (g->projects[i]->token_sha256, hex) == 0)
      return g->projects[i];
  return NULL;
}

static void
set_address (struct gw_node *n, const char *addr)
{
  n->host[0] = n->path[0] = '\0';
  n->port = 0;
  if (addr == NULL || strncmp (addr, "http://", 7) != 0)
    return;
  snprintf (n->host, sizeof n->host, "%s", addr + 7);
  char *slash = strchr (n->host, '/');
  if (slash)
    {
      /* several (simulated) nodes behind one listener: requests go under the path */
      if (strlen (slash) < sizeof n->path && slash[1] != '\0')
        snprintf (n->path, sizeof n->path, "%s", slash);
      *slash = '\0';
    }
  char *colon = strrchr (n->host, ':');
  if (colon)
    {
      *colon = '\0';
      n->port = atoi (colon + 1);
    }
  else
    n->port = 80;
}

static uint64_t
fnv1a (const char *s)
{
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static int
cmp_u64 (const void *a, const void *b)
{
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The fields placement reads, parsed once per status instead of on every
 * create. True when the node's image set changed. */
static bool
parse_status (struct gw_node *n, const json_t *j)
{
  n->sandboxes = json_integer_value (json_object_get (j, "sandboxes"));
  n->memory_free_mb = json_integer_value (json_object_get (j, "memory_free_mb"));
  n->compat_port = (int)json_integer_value (json_object_get (j, "compat_port"));
  n->stopping = json_is_true (json_object_get (j, "stopping"));
  n->n_backends = 0;
  size_t i;
  json_t *v;
  json_array_foreach (json_object_get (j, "backends"), i, v)
  {
    if (json_is_string (v) && n->n_backends < GW_NODE_BACKENDS
        && strlen (json_string_value (v)) < sizeof n->backends[0])
      strcpy (n->backends[n->n_backends++], json_string_value (v));
  }
  json_t *imgs = json_object_get (j, "images");
  size_t k = json_array_size (imgs);
  uint64_t *h = k ? calloc (k, sizeof *h) : NULL;
  unsigned nh = 0;
  json_array_foreach (imgs, i, v) if (h && json_is_string (v)) h[nh++]
      = fnv1a (json_string_value (v));
  if (nh > 1)
    qsort (h, nh, sizeof *h, cmp_u64);
  bool changed = nh != n->n_images || (nh && memcmp (h, n->images, nh * sizeof *h) != 0);
  free (n->images);
  n->images = h;
  n->n_images = nh;
  return changed;
}

static bool
node_holds (const struct gw_node *n, uint64_t image)
{
  return n->n_images && bsearch (&image, n->images, n->n_images, sizeof image, cmp_u64) != NULL;
}

static bool
node_offers (const struct gw_node *n, const char *backend)
{
  if (strcmp (backend, GW_COMPAT) == 0)
    return n->compat_port > 0;
  for (unsigned i = 0; i < n->n_backends; i++)
    if (strcmp (n->backends[i], backend) == 0)
      return true;
  return false;
}

/* One key changed (val NULL: deleted). Under g->mu. */
static void
apply (struct gw *g, const char *key, const char *val)
{
  if (strncmp (key, WR_KEY_NODES, strlen (WR_KEY_NODES)) == 0)
    {
      struct gw_node *n = node_get (g, key + strlen (WR_KEY_NODES));
      if (n == NULL)
        return;
      if (val == NULL)
        {
          n->present = false;
          n->gen++;
          g->images_gen++;
          return;
        }
      json_t *j = json_loads (val, 0, NULL);
      if (!json_is_object (j))
        {
          json_decref (j);
          return;
        }
      json_decref (n->status);
      n->status = j;
      set_address (n, json_string_value (json_object_get (j, "address")));
      if (parse_status (n, j) || !n->present)
        g->images_gen++;
      n->present = true;
      n->gen++;
    }
  else if (strncmp (key, WR_KEY_DRAIN, strlen (WR_KEY_DRAIN)) == 0)
    {
      struct gw_node *n = node_get (g, key + strlen (WR_KEY_DRAIN));
      if (n)
        n->drained = val != NULL;
    }
  else if (strncmp (key, WR_KEY_PROJECTS, strlen (WR_KEY_PROJECTS)) == 0)
    {
      const char *name = key + strlen (WR_KEY_PROJECTS);
      struct gw_project *p = gw_project_find (g, name);
      if (p == NULL)
        {
          if (val == NULL || !wr_project_name_valid (name)
              || g->n_projects >= WR_ARRAY_SIZE (g->projects)
              || (p = calloc (1, sizeof *p)) == NULL)
            return;
          snprintf (p->name, sizeof p->name, "%s", name);
          p->waiters_tail = &p->waiters;
          g->projects[g->n_projects++] = p;
        }
      json_t *j = val ? json_loads (val, 0, NULL) : NULL;
      p->present = json_is_object (j);
      if (p->present)
        {
          p->max_sandboxes = json_integer_value (json_object_get (j, "max_sandboxes"));
          p->max_memory_mb = json_integer_value (json_object_get (j, "max_memory_mb"));
          p->priority = (int)json_integer_value (json_object_get (j, "priority"));
          snprintf (p->token_sha256, sizeof p->token_sha256, "%s",
                    json_string_value (json_object_get (j, "token_sha256")) ?: "");
        }
      json_decref (j);
    }
}

static int
watch_cb (void *ud, const char *key, const char *val, int64_t rev WR_UNUSED)
{
  struct gw *g = ud;
  pthread_mutex_lock (&g->mu);
  apply (g, key, val);
  pthread_mutex_unlock (&g->mu);
  return g->stop ? 1 : 0;
}

static void *
watch_main (void *arg)
{
  struct gw *g = arg;
  bool complained = false;
  while (!g->stop)
    {
      wr_err_t err;
      json_t *kvs = NULL;
      int64_t rev = 0;
      if (wr_etcd_get_prefix (g->etcd, WR_KEY_ROOT, &kvs, &rev, &err) < 0)
        {
          if (!complained)
            fprintf (stderr, "warren-gateway: reading cluster state: %s (retrying)\n", err.msg);
          complained = true;
          usleep (300 * 1000);
          continue;
        }
      complained = false;
      pthread_mutex_lock (&g->mu);
      /* a full read replaces what a broken watch may have missed */
      for (size_t i = 0; i < g->n_nodes; i++)
        {
          if (g->nodes[i]->present)
            g->nodes[i]->gen++;
          g->nodes[i]->present = g->nodes[i]->drained = false;
        }
      for (size_t i = 0; i < g->n_projects; i++)
        g->projects[i]->present = false;
      size_t i;
      json_t *kv;
      json_array_foreach (kvs, i, kv) apply (g, json_string_value (json_object_get (kv, "key")),
                                             json_string_value (json_object_get (kv, "value")));
      g->synced = true;
      g->images_gen++;
      pthread_mutex_unlock (&g->mu);
      json_decref (kvs);
      if (wr_etcd_watch (g->etcd, WR_KEY_ROOT, rev + 1, watch_cb, g, &g->stop, &err) < 0
          && !g->stop)
        {
          fprintf (stderr, "warren-gateway: %s; reading again\n", err.msg);
          usleep (200 * 1000);
        }
    }
  return NULL;
}

/* A watch stream stays open on a member that lost quorum, so the watch
 * cannot tell: a linearizable read every 500 ms can (it needs a leader). */
#define CP_STALE_MS 3000

static void *
probe_main (void *arg)
{
  struct gw *g = arg;
  json_t *body = json_pack ("{s:o}", "key", wr_etcd_b64 ("/warren/", 8));
  while (!g->stop)
    {
      json_t *resp = NULL;
      if (wr_etcd_call (g->probe_etcd, "/v3/kv/range", body, &resp, NULL) == 0)
        atomic_store (&g->cp_ok_ms, wr_now_ms ());
      json_decref (resp);
      usleep (500 * 1000);
    }
  json_decref (body);
  return NULL;
}

bool
gw_control_plane_ok (struct gw *g)
{
  uint64_t ok = atomic_load (&g->cp_ok_ms);
  return ok && wr_now_ms () - ok < CP_STALE_MS;
}

int
gw_watch_start (struct gw *g, wr_err_t *err)
{
  if (pthread_create (&g->watch_thread, NULL, watch_main, g) != 0)
    return wr_error (err, errno, WR_E_INTERNAL, "watch thread");
  if (pthread_create (&g->probe_thread, NULL, probe_main, g) != 0)
    return wr_error (err, errno, WR_E_INTERNAL, "probe thread");
  return 0;
}

void
gw_watch_stop (struct gw *g)
{
  g->stop = true;
  pthread_join (g->watch_thread, NULL);
  pthread_join (g->probe_thread, NULL);
}

static bool
labels_match (const json_t *status, const json_t *want)
{
  const json_t *have = json_object_get (status, "labels");
  const char *k;
  json_t *v;
  json_object_foreach ((json_t *)want, k, v)
  {
    json_t *h = json_object_get (have, k);
    if (!json_is_string (h) || !json_is_string (v)
        || strcmp (json_string_value (h), json_string_value (v)) != 0)
      return false;
  }
  return true;
}

static long long
load (struct gw_node *n)
{
  if (n->gen != n->seen_gen)
    {
      /* a fresh status counts what we placed before it was taken */
      n->seen_gen = n->gen;
      n->pending = 0;
    }
  return n->sandboxes + n->pending;
}

struct want
{
  const char *backend;
  long long memory_mb;
  const json_t *labels;
  const struct gw_node *exclude;
};

/* The filters: registered, not drained or stopping, the backend, the
 * labels, the memory. */
static bool
fits (struct gw_node *n, const struct want *w)
{
  if (!n->present || n->drained || n->stopping || n == w->exclude || n->port == 0
      || !node_offers (n, w->backend))
    return false;
  load (n); /* forgets placements a newer status already counts */
  if (n->memory_free_mb - (long long)n->pending * w->memory_mb < w->memory_mb)
    return false;
  return w->labels == NULL || labels_match (n->status, w->labels);
}

/* Does any present node hold the image? Cached per image set generation:
 * statuses change every second, image sets rarely. */
static bool
image_anywhere (struct gw *g, uint64_t image)
{
  static struct
  {
    uint64_t image;
    unsigned long gen;
    bool any;
  } cache[64];
  unsigned slot = (unsigned)(image % 64);
  if (cache[slot].image == image && cache[slot].gen == g->images_gen && g->images_gen)
    return cache[slot].any;
  bool any = false;
  for (size_t i = 0; i < g->n_nodes && !any; i++)
    any = g->nodes[i]->present && node_holds (g->nodes[i], image);
  cache[slot].image = image;
  cache[slot].gen = g->images_gen;
  cache[slot].any = any;
  return any;
}

/* Samples drawn before falling back to a scan of every node. */
#define PLACE_DRAWS 32

struct gw_node *
gw_place (struct gw *g, const char *backend, long long memory_mb, const json_t *want_labels,
          const char *image, const struct gw_node *exclude)
{
  static struct gw_node *cands[GW_MAX_NODES];
  const struct want w = { backend, memory_mb, want_labels, exclude };
  struct gw_node *pair[2] = { NULL, NULL };
  size_t np = 0;
  pthread_mutex_lock (&g->mu);
  uint64_t img = image ? fnv1a (image) : 0;
  /* nodes that hold the image first (the others would have to fetch it),
   * when any does */
  bool prefer = image && g->n_nodes > 1 && image_anywhere (g, img);
  /* power of two choices by sampling: two distinct random nodes that pass
   * the filters (and hold the image when preferred) */
  for (int d = 0; d < PLACE_DRAWS && np < 2 && g->n_nodes; d++)
    {
      struct gw_node *n = g->nodes[rng () % g->n_nodes];
      if (n != pair[0] && fits (n, &w) && (!prefer || node_holds (n, img)))
        pair[np++] = n;
    }
  if (np < 2)
    {
      /* few nodes fit: look at all of them */
      size_t nc = 0, nh = 0;
      for (size_t i = 0; i < g->n_nodes; i++)
        if (fits (g->nodes[i], &w))
          cands[nc++] = g->nodes[i];
      if (prefer)
        {
          for (size_t i = 0; i < nc; i++)
            if (node_holds (cands[i], img))
              cands[nh++] = cands[i];
          if (nh > 0)
            nc = nh; /* else none that fits has it: cands[] is untouched, all stay */
        }
      np = nc < 2 ? nc : 2;
      if (nc == 1)
        pair[0] = cands[0];
      else if (nc > 1)
        {
          size_t a = rng () % nc, b = rng () % (nc - 1);
          if (b >= a)
            b++;
          pair[0] = cands[a];
          pair[1] = cands[b];
        }
    }
  struct gw_node *pick = pair[0];
  if (np == 2 && load (pair[1]) < load (pair[0]))
    pick = pair[1]; /* the less loaded of the two */
  if (pick)
    {
      load (pick);
      pick->pending++;
    }
  pthread_mutex_unlock (&g->mu);
  return pick;
}

json_t *
gw_nodes_json (struct gw *g)
{
  json_t *a = json_array ();
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_nodes; i++)
    {
      struct gw_node *n = g->nodes[i];
      if (n->status == NULL)
        continue; /* a drain flag for a node never seen */
      const char *state = !n->present   ? "lost"
                          : n->stopping ? "stopping"
                          : n->drained  ? "drained"
                                        : "ready";
      json_t *o = json_deep_copy (n->status);
      json_object_set_new (o, "name", json_string (n->name));
      json_object_set_new (o, "state", json_string (state));
      json_object_set_new (o, "drained", json_boolean (n->drained));
      json_array_append_new (a, o);
    }
  pthread_mutex_unlock (&g->mu);
  return json_pack ("{s:o}", "nodes", a);
}

size_t
gw_present_nodes (struct gw *g, struct gw_node **out)
{
  size_t n = 0;
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_nodes; i++)
    if (g->nodes[i]->present)
      out[n++] = g->nodes[i];
  pthread_mutex_unlock (&g->mu);
  return n;
}

/* Nodes seen before whose lease is gone */
size_t
gw_lost_nodes (struct gw *g, struct gw_node **out)
{
  size_t n = 0;
  pthread_mutex_lock (&g->mu);
  for (size_t i = 0; i < g->n_nodes; i++)
    if (!g->nodes[i]->present && g->nodes[i]->status != NULL)
      out[n++] = g->nodes[i];
  pthread_mutex_unlock (&g->mu);
  return n;
}

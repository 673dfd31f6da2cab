/* Node side of cluster mode (cluster.h, docs/cluster.md).
 *
 * The loop owns the sandbox table, so a 1 s timer on the loop snapshots the
 * node's status into a string; a membership thread does all etcd I/O
 * (blocking, with deadlines) and never touches the table. The thread keeps
 * the lease alive every TTL/3 and writes the status when it changed, at most
 * once per second, so a burst of creates costs etcd one write a second. */
#include "daemon/cluster.h"
#include "daemon/log.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cluster/etcd.h"
#include "cluster/keys.h"
#include "cluster/member.h"
#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/compat_sf.h"

#define IMAGES_EVERY 5
#define IMAGES_MAX 256

static struct
{
  const char *urls, *name, *advertise;
  const char *etcd_cacert, *etcd_cert, *etcd_key; /* TLS to etcd */
  json_t *labels;
  long ttl_s;
  struct wrd *d;
  struct wr_etcd *etcd;            /* status writes */
  struct wr_etcd *lease_etcd;      /* registration and keepalives: short deadlines */
  _Atomic int64_t lease;           /* 0: not registered */
  _Atomic unsigned long published; /* status_gen last written */
  pthread_t status_thread;
  char prefix[WR_NODE_NAME_MAX + 2];
  bool enabled;
  volatile bool stop;
  pthread_t thread;
  bool thread_started;
  pthread_mutex_t mu;
  char *status; /* latest snapshot, under mu */
  unsigned long status_gen;
  struct event *tick;
  double started_at;
  json_t *images; /* image names on this node, refreshed every IMAGES_EVERY ticks */
  /* Wall-clock ms when the cluster last declared this node lost (its lease
   * expired while it ran, e.g. a partition): gateways refuse its older
   * sandboxes with node_lost rather than resurrect them silently. */
  _Atomic int64_t lost_at_ms;
  /* the lease a previous daemon on this root held (STATE_FILE): resumed if
   * still alive, so a restart within the TTL keeps the node's sandboxes */
  int64_t saved_lease;
  bool stopping; /* the last status says so: gateways place nothing here */
  int root_fd;
  unsigned image_ticks; /* the store lock is shared with imports: not every tick */
} g = { .ttl_s = 10, .mu = PTHREAD_MUTEX_INITIALIZER, .root_fd = -1 };

/* In the daemon's root: "NAME LEASE LOST_AT_MS", rewritten at every
 * registration (docs/cluster.md, "Restarts"). */
#define STATE_FILE "cluster-lease"

int
wrd_cluster_opt (int opt, const char *arg, wr_err_t *err)
{
  switch (opt)
    {
    case WRD_OPT_CLUSTER:
      g.urls = arg;
      return 0;
    case WRD_OPT_NODE_NAME:
      g.name = arg;
      return 0;
    case WRD_OPT_ADVERTISE:
      g.advertise = arg;
      return 0;
    case WRD_OPT_LEASE_TTL:
      g.ttl_s = strtol (arg, NULL, 10);
      if (g.ttl_s < 2 || g.ttl_s > 3600)
        return wr_error (err, 0, WR_E_INVALID, "--lease-ttl wants 2..3600 seconds");
      return 0;
    case WRD_OPT_ETCD_CACERT:
      g.etcd_cacert = arg;
      return 0;
    case WRD_OPT_ETCD_CERT:
      g.etcd_cert = arg;
      return 0;
    case WRD_OPT_ETCD_KEY:
      g.etcd_key = arg;
      return 0;
    case WRD_OPT_LABEL:
      {
        const char *eq = strchr (arg, '=');
        if (eq == NULL || eq == arg)
          return wr_error (err, 0, WR_E_INVALID, "--label wants K=V, got %.64s", arg);
        if (g.labels == NULL)
          g.labels = json_object ();
        _cleanup_free_ char *k = strndup (arg, eq - arg);
        json_t *v = json_string (eq + 1);
        if (k == NULL || v == NULL || json_object_set_new (g.labels, k, v) < 0)
          return wr_error (err, 0, WR_E_INVALID, "--label %.64s: not UTF-8", arg);
        return 0;
      }
    }
  return wr_error (err, 0, WR_E_INVALID, "unknown cluster option");
}

const char *
wrd_cluster_id_prefix (void)
{
  return g.enabled ? g.prefix : NULL;
}

static void
meminfo (long long *total_mb, long long *avail_mb)
{
  *total_mb = *avail_mb = 0;
  _cleanup_fclose_ FILE *f = fopen ("/proc/meminfo", "re");
  char line[256];
  while (f && fgets (line, sizeof line, f))
    {
      long long kb;
      if (sscanf (line, "MemTotal: %lld kB", &kb) == 1)
        *total_mb = kb / 1024;
      else if (sscanf (line, "MemAvailable: %lld kB", &kb) == 1)
        *avail_mb = kb / 1024;
    }
}

/* Names of the node's images (bounded): gateways prefer nodes holding the
 * image a create asks for. */
static json_t *
image_names (struct wrd *d)
{
  if (g.images == NULL || g.image_ticks++ % IMAGES_EVERY == 0)
    {
      json_t *list = NULL;
      if (wr_image_list (d->store, &list, NULL) == 0)
        {
          json_t *names = json_array ();
          size_t i;
          json_t *img;
          json_array_foreach (list, i, img) if (i < IMAGES_MAX)
              json_array_append (names, json_object_get (img, "name"));
          json_decref (g.images);
          g.images = names;
        }
      json_decref (list);
    }
  return g.images ? json_incref (g.images) : json_array ();
}

static json_t *
status_json (struct wrd *d)
{
  long long total, avail;
  meminfo (&total, &avail);
  json_t *backends = json_array ();
  static const char *const names[] = { "container", "fncall", "microvm", "vm" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (names); i++)
    if (strcmp (names[i], "fncall") == 0 ? d->fncall != NULL : wrd_backend_get (names[i]) != NULL)
      json_array_append_new (backends, json_string (names[i]));
  json_t *projects = json_object ();
  json_int_t n = 0, mem = 0;
  for (size_t i = 0; i < d->table_size; i++)
    for (struct sandbox *s = d->table[i]; s; s = s->hnext)
      {
        if (s->state == SB_POOLED || s->state == SB_DESTROYING)
          continue;
        json_int_t m = json_integer_value (json_object_get (s->spec, "memory_mb"));
        n++;
        mem += m;
        const char *p = json_string_value (
            json_object_get (json_object_get (s->spec, "labels"), WR_LABEL_PROJECT));
        if (p)
          wr_node_status_count_project (projects, p, m);
      }
  json_t *images = image_names (d);
  struct wr_node_status st = {
    .name = g.name,
    .advertise = g.advertise,
    .labels = g.labels,
    .backends = backends,
    .projects = projects,
    .images = images,
    .sandboxes = n,
    .memory_reserved_mb = mem,
    .memory_total_mb = total,
    .memory_free_mb = avail,
    .cpus = sysconf (_SC_NPROCESSORS_ONLN),
    .started_at = g.started_at,
    .lost_at_ms = atomic_load (&g.lost_at_ms),
    .stopping = g.stopping,
  };
  json_t *j = wr_node_status_json (&st);
  if (wrd_compat_sf_port () > 0) /* gateways' --listen-compat forwards here */
    json_object_set_new (j, "compat_port", json_integer (wrd_compat_sf_port ()));
  json_decref (backends);
  json_decref (projects);
  json_decref (images);
  return j;
}

static void
snapshot (struct wrd *d)
{
  json_t *j = status_json (d);
  char *text = json_dumps (j, JSON_COMPACT | JSON_SORT_KEYS);
  json_decref (j);
  if (text == NULL)
    return;
  pthread_mutex_lock (&g.mu);
  if (g.status && strcmp (g.status, text) == 0)
    free (text);
  else
    {
      free (g.status);
      g.status = text;
      g.status_gen++;
    }
  pthread_mutex_unlock (&g.mu);
}

static void
tick_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  snapshot (arg);
}

/* The latest status snapshot as text, with what the loop's snapshot may
 * not carry yet: lost_at (set by this thread a moment ago; a gateway that
 * saw the node without it would route to its lost sandboxes) and, when
 * stopping, the flag. */
static char *
status_text (unsigned long *gen, bool stopping)
{
  pthread_mutex_lock (&g.mu);
  _cleanup_free_ char *text = strdup (g.status);
  if (gen)
    *gen = g.status_gen;
  pthread_mutex_unlock (&g.mu);
  int64_t lost = atomic_load (&g.lost_at_ms);
  if (text == NULL || (lost == 0 && !stopping))
    {
      char *t = text;
      text = NULL;
      return t;
    }
  json_t *j = json_loads (text, 0, NULL);
  if (j == NULL)
    return NULL;
  if (lost)
    json_object_set_new (j, "lost_at", json_real ((double)lost / 1000.0));
  if (stopping)
    json_object_set_new (j, "stopping", json_true ());
  char *out = json_dumps (j, JSON_COMPACT | JSON_SORT_KEYS);
  json_decref (j);
  return out;
}

/* Record the lease (and when the cluster last declared this node lost) for
 * the next daemon on this root; written aside and renamed into place. */
static void
state_save (int64_t lease)
{
  char text[256], tmp[64];
  snprintf (text, sizeof text, "%s %lld %lld\n", g.name, (long long)lease,
            (long long)atomic_load (&g.lost_at_ms));
  snprintf (tmp, sizeof tmp, STATE_FILE ".%d", (int)getpid ());
  _cleanup_close_ int fd
      = openat (g.root_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || wr_write_all (fd, text, strlen (text)) < 0 || fsync (fd) < 0
      || renameat (g.root_fd, tmp, g.root_fd, STATE_FILE) < 0)
    {
      wrd_log (WRD_LOG_WARN, "cluster: saving %s: %s (a restart will register afresh)\n",
               STATE_FILE, strerror (errno));
      unlinkat (g.root_fd, tmp, 0);
    }
}

/* What a previous daemon on this root left: its lease, and lost_at (kept
 * across restarts, or the sandboxes of an earlier loss would resurrect). */
static void
state_load (void)
{
  _cleanup_free_ char *text = NULL;
  size_t len;
  if (wr_read_file_at (g.root_fd, STATE_FILE, &text, &len, 4096) < 0)
    return;
  char name[72];
  long long lease, lost;
  if (sscanf (text, "%64s %lld %lld", name, &lease, &lost) != 3 || strcmp (name, g.name) != 0)
    return; /* another node's (the root was renamed): nothing to resume */
  g.saved_lease = lease;
  atomic_store (&g.lost_at_ms, lost);
}

/* Register (grant a lease, write the node key under it); 0 or < 0. */
static int
register_node (int64_t *lease, unsigned long *gen, wr_err_t *err)
{
  _cleanup_free_ char *text = status_text (gen, false);
  if (text == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "status");
  int r = wr_node_register (g.etcd, g.name, text, g.ttl_s, lease, err);
  if (r == 0)
    state_save (*lease);
  return r;
}

/* The previous daemon's lease: 1 when it is still alive (this is a restart
 * within the TTL: the cluster never saw the node go, so its sandboxes are
 * still its own) and now carries the status, 0 when it expired (the cluster
 * declared the node lost meanwhile), < 0 when etcd did not answer. */
static int
resume_lease (unsigned long *gen, wr_err_t *err)
{
  int64_t ttl = 0;
  if (wr_etcd_lease_keepalive (g.lease_etcd, g.saved_lease, &ttl, err) < 0)
    return strcmp (err->code, WR_E_NOT_FOUND) == 0 ? 0 : -1;
  if (ttl <= 0)
    return 0;
  _cleanup_free_ char *text = status_text (gen, false);
  char key[128];
  wr_node_key (key, sizeof key, g.name);
  if (text == NULL || wr_etcd_put (g.etcd, key, text, g.saved_lease, err) < 0)
    return strcmp (err->code, WR_E_NOT_FOUND) == 0 ? 0 : -1;
  return 1;
}

static void
declared_lost (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_REALTIME, &ts);
  atomic_store (&g.lost_at_ms, (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
  /* the next snapshot carries it; force one even if nothing else changed */
  pthread_mutex_lock (&g.mu);
  g.status_gen++;
  pthread_mutex_unlock (&g.mu);
}

/* The lease thread: registers, then refreshes the lease every TTL/4 with a
 * deadline of TTL/4 per member, so a slow status write (a Raft proposal that
 * waits on a busy disk) never delays a keepalive past the TTL. */
static void *
lease_main (void *arg WR_UNUSED)
{
  uint64_t next_keepalive = 0;
  bool complained = false;
  while (!g.stop)
    {
      wr_err_t err;
      uint64_t now = wr_now_ms ();
      int64_t lease = atomic_load (&g.lease);
      if (lease == 0 && g.saved_lease)
        {
          unsigned long gen;
          int r = resume_lease (&gen, &err);
          if (r < 0)
            {
              if (!complained)
                wrd_log (WRD_LOG_WARN, "cluster: resuming %s's lease: %s (retrying)\n", g.name,
                         err.msg);
              complained = true;
              usleep (500 * 1000);
              continue;
            }
          lease = g.saved_lease;
          g.saved_lease = 0;
          if (r > 0)
            {
              wrd_log (WRD_LOG_INFO,
                       "cluster: resumed %s's lease %llx (restarted within its %lds TTL: the "
                       "cluster kept the node and its sandboxes)\n",
                       g.name, (unsigned long long)lease, g.ttl_s);
              complained = false;
              atomic_store (&g.published, gen);
              atomic_store (&g.lease, lease);
              next_keepalive = now + (uint64_t)g.ttl_s * 1000 / 4;
              continue;
            }
          wrd_log (WRD_LOG_ERROR,
                   "cluster: %s's lease expired while no daemon ran (the cluster declared the "
                   "node lost): its sandboxes from before are reported lost, registering again\n",
                   g.name);
          declared_lost ();
          lease = 0;
        }
      if (lease == 0)
        {
          unsigned long gen;
          if (register_node (&lease, &gen, &err) < 0)
            {
              if (!complained)
                wrd_log (WRD_LOG_WARN, "cluster: registering %s: %s (retrying)\n", g.name, err.msg);
              complained = true;
              usleep (500 * 1000);
              continue;
            }
          wrd_log (WRD_LOG_INFO, "cluster: registered as %s (lease %llx, ttl %lds)\n", g.name,
                   (unsigned long long)lease, g.ttl_s);
          complained = false;
          atomic_store (&g.published, gen);
          atomic_store (&g.lease, lease);
          next_keepalive = now + (uint64_t)g.ttl_s * 1000 / 4;
        }
      else if (now >= next_keepalive)
        {
          int64_t ttl = 0;
          if (wr_etcd_lease_keepalive (g.lease_etcd, lease, &ttl, &err) < 0)
            {
              /* etcd unreachable: keep trying until the lease would be gone */
              if (!complained)
                wrd_log (WRD_LOG_WARN, "cluster: keepalive: %s\n", err.msg);
              complained = true;
              next_keepalive = now + 200;
            }
          else if (ttl <= 0)
            {
              wrd_log (WRD_LOG_ERROR, "cluster: lease expired (the cluster declared this node "
                                      "lost), registering again\n");
              declared_lost ();
              atomic_store (&g.lease, 0);
              continue;
            }
          else
            {
              complained = false;
              next_keepalive = now + (uint64_t)g.ttl_s * 1000 / 4;
            }
        }
      usleep (50 * 1000);
    }
  return NULL; /* the lease is left to wrd_cluster_stop */
}

/* The status thread: writes the node key when the status changed, at most
 * once a second, under the current lease. */
static void *
status_main (void *arg WR_UNUSED)
{
  uint64_t last_put = 0;
  char key[128];
  wr_node_key (key, sizeof key, g.name);
  while (!g.stop)
    {
      usleep (100 * 1000);
      int64_t lease = atomic_load (&g.lease);
      uint64_t now = wr_now_ms ();
      if (lease == 0 || now - last_put < WR_NODE_PUBLISH_MIN_MS)
        continue;
      pthread_mutex_lock (&g.mu);
      unsigned long gen = g.status_gen;
      _cleanup_free_ char *text = gen != atomic_load (&g.published) ? strdup (g.status) : NULL;
      pthread_mutex_unlock (&g.mu);
      if (text == NULL)
        continue;
      wr_err_t err;
      last_put = now;
      if (wr_etcd_put (g.etcd, key, text, lease, &err) == 0)
        atomic_store (&g.published, gen);
      else if (strcmp (err.code, WR_E_NOT_FOUND) == 0)
        {
          /* expired meanwhile */
          if (atomic_compare_exchange_strong (&g.lease, &lease, 0))
            declared_lost ();
        }
    }
  return NULL;
}

int
wrd_cluster_start (struct wrd *d, wr_err_t *err)
{
  if (g.urls == NULL)
    {
      if (g.name || g.advertise || g.labels || g.etcd_cacert || g.etcd_cert || g.etcd_key)
        return wr_error (err, 0, WR_E_INVALID,
                         "--node-name, --advertise, --label and --etcd-* need --cluster");
      return 0;
    }
  if (!wr_node_name_valid (g.name))
    return wr_error (err, 0, WR_E_INVALID,
                     "--node-name wants [a-z0-9-]{1,%d} (no leading or trailing '-')",
                     WR_NODE_NAME_MAX);
  if (g.advertise == NULL || strncmp (g.advertise, "http://", 7) != 0)
    return wr_error (err, 0, WR_E_INVALID, "--cluster needs --advertise http://ADDR:PORT");
  if (g.labels == NULL)
    g.labels = json_object ();
  if ((g.etcd_cacert || g.etcd_cert || g.etcd_key)
      && wr_etcd_tls (g.etcd_cacert, g.etcd_cert, g.etcd_key, err) < 0)
    return -1;
  int r = wr_etcd_new (g.urls, 3000, &g.etcd, err);
  if (r < 0)
    return r;
  g.d = d;
  g.root_fd = open (d->root, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (g.root_fd < 0)
    return wr_error (err, errno, WR_E_INTERNAL, "open %s", d->root);
  state_load ();
  g.started_at = (double)time (NULL);
  snprintf (g.prefix, sizeof g.prefix, "%s-", g.name);
  g.enabled = true;
  snapshot (d);
  g.tick = event_new (d->base, -1, EV_PERSIST, tick_cb, d);
  struct timeval tv = { 1, 0 };
  event_add (g.tick, &tv);
  int ka_ms = (int)(g.ttl_s * 1000 / 4);
  r = wr_etcd_new (g.urls, ka_ms < 3000 ? ka_ms : 3000, &g.lease_etcd, err);
  if (r < 0)
    return r;
  if (pthread_create (&g.thread, NULL, lease_main, NULL) != 0
      || pthread_create (&g.status_thread, NULL, status_main, NULL) != 0)
    return wr_error (err, errno, WR_E_INTERNAL, "cluster threads");
  g.thread_started = true;
  return 0;
}

void
wrd_cluster_stop (struct wrd *d WR_UNUSED)
{
  if (!g.enabled)
    return;
  g.stop = true;
  if (g.thread_started)
    {
      pthread_join (g.status_thread, NULL);
      pthread_join (g.thread, NULL);
    }
  /* Leave placement at once, but keep the lease running out by itself: a
   * daemon restarted within the TTL resumes it and the cluster never declares
   * the node's sandboxes (which outlive the daemon) lost; one that stays
   * down longer is declared lost when the lease expires. */
  int64_t lease = atomic_exchange (&g.lease, 0);
  if (lease)
    {
      g.stopping = true;
      _cleanup_free_ char *text = status_text (NULL, true);
      char key[128];
      wr_node_key (key, sizeof key, g.name);
      wr_err_t err;
      if (text && wr_etcd_put (g.lease_etcd, key, text, lease, &err) < 0)
        wrd_log (WRD_LOG_WARN, "cluster: publishing the stop: %s\n", err.msg);
    }
  if (g.root_fd >= 0)
    close (g.root_fd);
  if (g.tick)
    event_free (g.tick);
  wr_etcd_free (g.etcd);
  wr_etcd_free (g.lease_etcd);
  json_decref (g.labels);
  json_decref (g.images);
  free (g.status);
  g.enabled = false;
}

/* Sandbox lifecycle: create (from a warm pool or from scratch), TTL,
 * pause/resume, destroy, recovery after a daemon restart. */
#include "daemon/daemon.h"
#include "daemon/netsvc.h"
#include "daemon/log.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>

#include "common/util.h"
#include "backend/backend.h"
#include "backend/vm.h"
#include "daemon/backends.h"
#include "daemon/fork.h"
#include "daemon/trajlog.h"
#include "daemon/cluster.h" /* cluster mode: node-named ids */

#define DEFAULT_MEMORY_MB 1024
#define DEFAULT_DISK_MB 1024
#define DEFAULT_PIDS 1024
#define DEFAULT_CPUS 1.0
#define MAX_TTL_S (30 * 86400)
#define LABEL_IDEM "warren.idem" /* a create's idempotency key (docs/cluster.md) */

const char *
sb_state_name (enum sb_state s)
{
  static const char *names[] = { "creating", "running", "paused", "dead", "pooled", "destroying" };
  return s <= SB_DESTROYING ? names[s] : "?";
}

static double
now_s (void)
{
  struct timeval tv;
  gettimeofday (&tv, NULL);
  return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

/* ---- the sandbox table: chained hash on the id ---- */

static size_t
hash_id (const char *id)
{
  size_t h = 1469598103934665603ull;
  for (; *id; id++)
    h = (h ^ (unsigned char)*id) * 1099511628211ull;
  return h;
}

static void
table_insert (struct wrd *d, struct sandbox *sb)
{
  if (d->count + 1 > d->table_size)
    {
      size_t nsize = d->table_size ? d->table_size * 2 : 1024;
      struct sandbox **nt = calloc (nsize, sizeof *nt);
      if (nt == NULL)
        abort ();
      for (size_t i = 0; i < d->table_size; i++)
        for (struct sandbox *s = d->table[i], *next; s; s = next)
          {
            next = s->hnext;
            size_t b = hash_id (s->id) & (nsize - 1);
            s->hnext = nt[b];
            nt[b] = s;
          }
      free (d->table);
      d->table = nt;
      d->table_size = nsize;
    }
  size_t b = hash_id (sb->id) & (d->table_size - 1);
  sb->hnext = d->table[b];
  d->table[b] = sb;
  d->count++;
}

static void
table_remove (struct wrd *d, struct sandbox *sb)
{
  if (d->table_size == 0)
    return;
  for (struct sandbox **l = &d->table[hash_id (sb->id) & (d->table_size - 1)]; *l; l = &(*l)->hnext)
    if (*l == sb)
      {
        *l = sb->hnext;
        d->count--;
        return;
      }
}

struct sandbox *
wrd_sandbox_find (struct wrd *d, const char *id)
{
  if (d->table_size == 0)
    return NULL;
  for (struct sandbox *s = d->table[hash_id (id) & (d->table_size - 1)]; s; s = s->hnext)
    if (strcmp (s->id, id) == 0)
      return s;
  return NULL;
}

/* ---- request validation ---- */

static int
get_uint (json_t *req, const char *field, uint64_t def, uint64_t min, uint64_t max, uint64_t *ret,
          wr_err_t *err)
{
  json_t *v = json_object_get (req, field);
  if (v == NULL || json_is_null (v))
    {
      *ret = def;
      return 0;
    }
  if (!json_is_integer (v) || json_integer_value (v) < (json_int_t)min
      || (uint64_t)json_integer_value (v) > max)
    return wr_error (err, 0, WR_E_INVALID, "field \"%s\" must be an integer in [%llu, %llu]", field,
                     (unsigned long long)min, (unsigned long long)max);
  *ret = (uint64_t)json_integer_value (v);
  return 0;
}

static int
check_string_map (json_t *v, const char *field, wr_err_t *err)
{
  if (v == NULL || json_is_null (v))
    return 0;
  if (!json_is_object (v))
    return wr_error (err, 0, WR_E_INVALID, "field \"%s\" must be an object of strings", field);
  const char *k;
  json_t *x;
  json_object_foreach (v, k, x)
  {
    if (!json_is_string (x) || strlen (k) == 0 || strchr (k, '=') || strlen (k) > 256
        || json_string_length (x) > 65536)
      return wr_error (err, 0, WR_E_INVALID, "field \"%s\": entry \"%.64s\" is not a valid string",
                       field, k);
  }
  return 0;
}

/* "deterministic": {"seed","epoch","hostname","uptime_s"} (docs/api.md,
 * "Determinism"): normalised with its defaults into *ret, and its
 * environment (PYTHONHASHSEED, SOURCE_DATE_EPOCH) merged under env, where
 * the caller's own env entries win. */
static int
parse_deterministic (json_t *v, json_t *env, json_t **ret, wr_err_t *err)
{
  *ret = NULL;
  if (v == NULL || json_is_null (v) || json_is_false (v))
    return 0;
  json_t *empty = NULL;
  if (json_is_true (v))
    v = empty = json_object ();
  if (!json_is_object (v))
    return wr_error (err, 0, WR_E_INVALID, "field \"deterministic\" must be an object or true");
  uint64_t seed, epoch, uptime;
  /* PYTHONHASHSEED takes [0, 2^32-1] */
  int r = get_uint (v, "seed", 0, 0, UINT32_MAX, &seed, err);
  if (r == 0)
    r = get_uint (v, "epoch", 0, 0, (uint64_t)1 << 40, &epoch, err);
  if (r == 0)
    r = get_uint (v, "uptime_s", 0, 0, WR_MAX_UPTIME_S, &uptime, err);
  const char *host = "sandbox";
  json_t *h = json_object_get (v, "hostname");
  if (r == 0 && h && !json_is_null (h))
    {
      host = json_string_value (h);
      size_t n = host ? strlen (host) : 0;
      bool ok = n > 0 && n <= 64;
      for (size_t i = 0; ok && i < n; i++)
        ok = (host[i] >= 'a' && host[i] <= 'z') || (host[i] >= 'A' && host[i] <= 'Z')
             || (host[i] >= '0' && host[i] <= '9') || host[i] == '-' || host[i] == '.';
      if (!ok)
        r = wr_error (err, 0, WR_E_INVALID,
                      "field \"deterministic\".\"hostname\" must be 1-64 of [A-Za-z0-9.-]");
    }
  if (r < 0)
    {
      json_decref (empty);
      return r;
    }
  *ret = json_pack ("{s:I,s:I,s:s,s:I}", "seed", (json_int_t)seed, "epoch", (json_int_t)epoch,
                    "hostname", host, "uptime_s", (json_int_t)uptime);
  json_decref (empty);
  char num[24];
  snprintf (num, sizeof num, "%" PRIu64, seed);
  if (json_object_get (env, "PYTHONHASHSEED") == NULL)
    json_object_set_new (env, "PYTHONHASHSEED", json_string (num));
  snprintf (num, sizeof num, "%" PRIu64, epoch);
  if (json_object_get (env, "SOURCE_DATE_EPOCH") == NULL)
    json_object_set_new (env, "SOURCE_DATE_EPOCH", json_string (num));
  return 0;
}

/* An idempotency key: [A-Za-z0-9._:-]{1,128}, as the gateway takes it. */
static bool
key_chars_ok (const char *s)
{
  size_t n = s ? strlen (s) : 0;
  bool ok = n > 0 && n <= 128;
  for (size_t i = 0; ok && i < n; i++)
    ok = (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')
         || (s[i] >= '0' && s[i] <= '9') || strchr ("._:-", s[i]);
  return ok;
}

int
wrd_parse_create (struct wrd *d, json_t *req, json_t **ret, wr_err_t *err)
{
  if (!json_is_object (req))
    return wr_error (err, 0, WR_E_INVALID, "request body must be a JSON object");
  const char *backend = "container";
  json_t *v = json_object_get (req, "backend");
  if (v && !json_is_null (v))
    {
      if (!json_is_string (v))
        return wr_error (err, 0, WR_E_INVALID, "field \"backend\" must be a string");
      backend = json_string_value (v);
      if (wrd_backend_get (backend) == NULL)
        {
          if (wrd_backend_known (backend))
            return wr_error (err, 0, WR_E_UNSUPPORTED,
                             "backend \"%s\" is not available on this node", backend);
          /* fncall is no sandbox backend: its calls go to POST /v1/calls */
          return wr_error (err, 0, WR_E_INVALID, "unknown backend \"%.32s\" (%s%s)", backend,
                           wrd_backend_names (),
                           strcmp (backend, "fncall") == 0 ? "; fncall jobs: POST /v1/calls" : "");
        }
    }
  const char *image = d->default_image;
  v = json_object_get (req, "image");
  if (v && !json_is_null (v))
    {
      char local[512];
      if (!json_is_string (v)
          || (!wr_ref_valid (json_string_value (v))
              && !wr_registry_local_name (json_string_value (v), local, sizeof local)))
        return wr_error (err, 0, WR_E_INVALID, "field \"image\" must be an image reference");
      image = json_string_value (v);
    }
  json_t *layers = json_object_get (req, "layers");
  if (layers && !json_is_null (layers))
    {
      if (!json_is_array (layers) || json_array_size (layers) > 32)
        return wr_error (err, 0, WR_E_INVALID,
                         "field \"layers\" must be an array of at most 32 image references");
      size_t i;
      json_t *l;
      json_array_foreach (
          layers, i,
          l) if (!json_is_string (l)
                 || !wr_ref_valid (json_string_value (
                     l))) return wr_error (err, 0, WR_E_INVALID,
                                           "field \"layers\"[%zu] is not an image reference", i);
    }
  else
    layers = NULL;
  uint64_t mem, disk, pids, ttl;
  if (get_uint (req, "memory_mb", DEFAULT_MEMORY_MB, 16, 1 << 20, &mem, err) < 0
      || get_uint (req, "disk_mb", DEFAULT_DISK_MB, 1, 1 << 20, &disk, err) < 0
      || get_uint (req, "pids_max", DEFAULT_PIDS, 8, 1 << 22, &pids, err) < 0
      || get_uint (req, "ttl_s", 0, 0, MAX_TTL_S, &ttl, err) < 0)
    return -EINVAL;
  double cpus = DEFAULT_CPUS;
  v = json_object_get (req, "cpus");
  if (v && !json_is_null (v))
    {
      if (!json_is_number (v) || !(json_number_value (v) >= 0.01) || json_number_value (v) > 1024)
        return wr_error (err, 0, WR_E_INVALID, "field \"cpus\" must be a number in [0.01, 1024]");
      cpus = json_number_value (v);
    }
  /* CPU QoS and idle-pause (docs/api.md) */
  const char *qos = "latency";
  v = json_object_get (req, "qos");
  if (v && !json_is_null (v))
    {
      if (!json_is_string (v)
          || (strcmp (json_string_value (v), "latency") != 0
              && strcmp (json_string_value (v), "best-effort") != 0))
        return wr_error (err, 0, WR_E_INVALID,
                         "field \"qos\" must be \"latency\" or \"best-effort\"");
      qos = json_string_value (v);
    }
  uint64_t idle_pause;
  if (get_uint (req, "idle_pause_s", d->idle_pause_s, 0, MAX_TTL_S, &idle_pause, err) < 0)
    return -EINVAL;
  json_t *netj = NULL;
  if (wrd_net_parse (d, json_object_get (req, "network"), json_object_get (req, "net_group"), &netj,
                     err)
      < 0)
    return -EINVAL;
  const char *net = json_string_value (netj);
  if (check_string_map (json_object_get (req, "env"), "env", err) < 0
      || check_string_map (json_object_get (req, "labels"), "labels", err) < 0)
    {
      json_decref (netj);
      return -EINVAL;
    }
  json_t *net_limits = NULL; /* egress limits: docs/network.md */
  if (wrd_net_parse_limits (d, json_object_get (req, "net_limits"), net, &net_limits, err) < 0)
    {
      json_decref (netj);
      return -EINVAL;
    }
  json_t *out
      = json_pack ("{s:s,s:s,s:I,s:I,s:I,s:I,s:f,s:s}", "backend", backend, "image", image,
                   "memory_mb", (json_int_t)mem, "disk_mb", (json_int_t)disk, "pids_max",
                   (json_int_t)pids, "ttl_s", (json_int_t)ttl, "cpus", cpus, "network", net);
  json_object_set_new (out, "qos", json_string (qos));
  json_object_set_new (out, "idle_pause_s", json_integer ((json_int_t)idle_pause));
  json_decref (netj); /* out holds its own copy of the string */
  if (net_limits)
    json_object_set_new (out, "net_limits", net_limits);
  if (json_is_string (json_object_get (req, "net_group")))
    json_object_set (out, "net_group", json_object_get (req, "net_group"));
  json_t *env = json_object_get (req, "env"), *labels = json_object_get (req, "labels");
  json_object_set_new (out, "layers", layers ? json_deep_copy (layers) : json_array ());
  json_object_set_new (out, "env", json_is_object (env) ? json_deep_copy (env) : json_object ());
  json_object_set_new (out, "labels",
                       json_is_object (labels) ? json_deep_copy (labels) : json_object ());
  /* an idempotency key (the body's, or the Idempotency-Key header's): kept
   * as the label the gateway sets, so creates are deduplicated by it */
  v = json_object_get (req, "idempotency_key");
  if (v && !json_is_null (v))
    {
      if (!key_chars_ok (json_string_value (v)))
        {
          json_decref (out);
          return wr_error (err, 0, WR_E_INVALID, "idempotency key must be [A-Za-z0-9._:-]{1,128}");
        }
      json_object_set (json_object_get (out, "labels"), LABEL_IDEM, v);
    }
  json_t *det;
  if (parse_deterministic (json_object_get (req, "deterministic"), json_object_get (out, "env"),
                           &det, err)
      < 0)
    {
      json_decref (out);
      return -EINVAL;
    }
  if (det)
    json_object_set_new (out, "deterministic", det);
  *ret = out;
  return 0;
}

/* ---- lifecycle ---- */

static void reclaim_detach (struct sandbox *sb);

static void
sb_free (struct sandbox *sb)
{
  reclaim_detach (sb);
  if (sb->ttl_ev)
    event_free (sb->ttl_ev);
  if (sb->reap_ev)
    event_free (sb->reap_ev);
  if (sb->idle_ev)
    event_free (sb->idle_ev);
  if (sb->boot_ev)
    event_free (sb->boot_ev);
  free (sb->dead_reason);
  agent_conn_free (sb->conn);
  for (size_t i = 0; i < sb->n_layers; i++)
    wr_layer_release (sb->d->store, sb->layers[i]);
  free (sb->layers);
  json_decref (sb->spec);
  json_decref (sb->img_conf);
  free (sb);
}

static void
state_dir (struct wrd *d, const char *id, char *buf, size_t len)
{
  snprintf (buf, len, "%s/sandboxes/%s", d->root, id);
}

static void
ttl_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sandbox *sb = arg;
  wr_err_t err;
  wrd_traj_lifecycle (sb->d, sb, "ttl", NULL);
  if (wrd_sandbox_destroy (sb->d, sb, &err) < 0)
    wrd_log (WRD_LOG_WARN, "ttl destroy %s: %s\n", sb->id, err.msg);
}

static void
arm_ttl (struct sandbox *sb)
{
  if (sb->expires_at <= 0)
    return;
  if (sb->ttl_ev == NULL)
    sb->ttl_ev = evtimer_new (sb->d->base, ttl_cb, sb);
  double left = sb->expires_at - now_s ();
  if (left < 0)
    left = 0;
  struct timeval tv = { (time_t)left, (suseconds_t)((left - floor (left)) * 1e6) };
  evtimer_add (sb->ttl_ev, &tv);
}

const char *
wrd_sandbox_dead_reason (const struct sandbox *sb)
{
  return sb->dead_reason ? sb->dead_reason : "its agent exited";
}

static void
agent_lost (void *ud)
{
  struct sandbox *sb = ud;
  if (sb->state == SB_DEAD)
    return;
  sb->state = SB_DEAD;
  if (sb->pool)
    return; /* the pool refill notices and replaces it */
  wrd_traj_lifecycle (sb->d, sb, "lost",
                      json_pack ("{s:s}", "reason", wrd_sandbox_dead_reason (sb)));
  wr_err_t err;
  if (wrd_db_put (sb->d, sb, &err) < 0)
    wrd_log (WRD_LOG_ERROR, "%s\n", err.msg);
}

/* A container's agent connection may be shed while idle (agent_conn.h):
 * its listener is found again by path, its death by pid and start time. */
static int
agent_reconnect (void *ud)
{
  struct sandbox *sb = ud;
  char sdir[1200];
  state_dir (sb->d, sb->id, sdir, sizeof sdir);
  wr_err_t err;
  int fd = wr_container_agent_connect (sb->d->rt, sb->id, sdir, -1, &err);
  if (fd < 0)
    wrd_log (WRD_LOG_INFO, "reconnect %s: %s\n", sb->id, err.msg);
  return fd;
}

/* No descriptor per sandbox: the daemon's own child (no zygote) stays a
 * zombie until reaped at destroy, so waitid(WNOWAIT) sees its exit; any
 * other (a zygote's, or adopted after a restart) is reaped by its parent
 * and kill(0) sees it gone. Thorough: the start time rules out a reused pid. */
static int
agent_probe (void *ud, bool thorough)
{
  struct sandbox *sb = ud;
  pid_t pid = sb->c.pid;
  if (pid <= 0)
    return 1;
  siginfo_t si = { 0 };
  if (waitid (P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT | __WALL) == 0)
    {
      if (si.si_pid == pid)
        return 0;
    }
  else if (errno == ECHILD && kill (pid, 0) < 0 && errno == ESRCH)
    return 0;
  uint64_t st;
  if (thorough && sb->c.start_time && wr_read_start_time (pid, &st) == 0 && st != sb->c.start_time)
    return 0;
  return 1;
}

static void
agent_conn_setup (struct sandbox *sb)
{
  if (sb->conn && strcmp (sb->ops->name, "container") == 0)
    agent_conn_reconnectable (sb->conn, agent_reconnect, agent_probe);
}

/* ---- boot watchdog ----
 * A VM's create returns once QEMU runs; its agent speaks when the guest
 * has booted (or, for a restored clone, answers the restore ping). A
 * guest that never gets there (a boot hung under TCG; a panic ends QEMU,
 * which runs -no-reboot, and is seen as the socket closing) would hold
 * every request sent to it until its client gave up: after --vm-boot-timeout the sandbox is
 * declared lost instead, its requests fail as the platform's failure with the end of the guest's
 * console, and QEMU is killed. */

static unsigned
boot_timeout_s (const struct wrd *d)
{
  return d->vm_boot_timeout_s ? d->vm_boot_timeout_s : WRD_VM_BOOT_TIMEOUT_S;
}

/* The last bytes of the guest's console, printable, in out. */
static void
console_tail (struct sandbox *sb, char *out, size_t len)
{
  char path[1300];
  state_dir (sb->d, sb->id, path, sizeof path);
  strncat (path, "/console.log", sizeof path - strlen (path) - 1);
  out[0] = '\0';
  _cleanup_close_ int fd = open (path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat (fd, &st) < 0 || len < 2)
    return;
  size_t want = len - 1;
  off_t from = st.st_size > (off_t)want ? st.st_size - (off_t)want : 0;
  ssize_t n = pread (fd, out, want, from);
  if (n <= 0)
    return;
  out[n] = '\0';
  for (ssize_t i = 0; i < n; i++)
    if ((unsigned char)out[i] < 0x20 || (unsigned char)out[i] > 0x7e)
      out[i] = out[i] == '\n' ? '|' : ' ';
}

static void
boot_fired (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sandbox *sb = arg;
  if (agent_conn_heard (sb->conn) || sb->state == SB_DEAD || sb->state == SB_DESTROYING)
    return;
  if (sb->state == SB_PAUSED)
    {
      /* stopped by its owner: the clock starts again at resume */
      struct timeval tv = { boot_timeout_s (sb->d), 0 };
      evtimer_add (sb->boot_ev, &tv);
      return;
    }
  char tail[320], msg[512];
  console_tail (sb, tail, sizeof tail);
  snprintf (msg, sizeof msg,
            "the %s guest did not start its agent within %u s (a platform failure; console: "
            "%s)",
            sb->ops->name, boot_timeout_s (sb->d), tail[0] ? tail : "empty");
  wrd_log (WRD_LOG_ERROR, "sandbox %s: %s\n", sb->id, msg);
  sb->d->m.vm_boot_timeouts++;
  free (sb->dead_reason);
  sb->dead_reason = strdup (msg);
  agent_conn_fail (sb->conn, msg);
  wr_err_t err;
  if (wr_sandbox_kill (sb->d->rt, &sb->c, &err) < 0)
    wrd_log (WRD_LOG_WARN, "kill %s: %s\n", sb->id, err.msg);
}

static void
boot_watch (struct sandbox *sb)
{
  if (strcmp (sb->ops->name, "microvm") != 0 && strcmp (sb->ops->name, "vm") != 0)
    return;
  if (agent_conn_heard (sb->conn))
    return;
  if (sb->boot_ev == NULL && (sb->boot_ev = evtimer_new (sb->d->base, boot_fired, sb)) == NULL)
    return;
  /* the loop's cached time may be from before a long create */
  event_base_update_cache_time (sb->d->base);
  struct timeval tv = { boot_timeout_s (sb->d), 0 };
  evtimer_add (sb->boot_ev, &tv);
}

/* The image's layers, then each extra image's (docs/images.md), at most
 * WR_MAX_LAYERS in all: dirs has room for that many. */
static int
resolve_layers (struct wrd *d, struct sandbox *sb, json_t *spec, const char **dirs, wr_err_t *err)
{
  const char *image = json_string_value (json_object_get (spec, "image"));
  struct wr_image *img = NULL;
  char local[512];
  /* a registry reference: fetched on first use, once however many wait */
  int r = wr_registry_local_name (image, local, sizeof local)
              ? wr_image_fetch_once (d->store, image, local, &img, err)
              : wr_image_resolve (d->store, image, &img, err);
  if (r < 0)
    return r;
  snprintf (sb->image_digest, sizeof sb->image_digest, "%s", img->digest);
  sb->img_conf = json_incref (img->config);
  sb->layers = calloc (WR_MAX_LAYERS, sizeof *sb->layers);
  if (sb->layers == NULL)
    {
      wr_image_free (img);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "layers");
    }
  size_t n = 0;
  json_t *extra = json_object_get (spec, "layers");
  for (size_t i = 0; img; i++)
    {
      r = wr_layers_check (n + img->n_layers, "the sandbox's image with its extra layers", err);
      if (r < 0)
        {
          wr_image_free (img);
          return r;
        }
      for (size_t k = 0; k < img->n_layers; k++)
        memcpy (sb->layers[n++], img->layers[k], sizeof sb->layers[0]);
      wr_image_free (img);
      img = NULL;
      if (i < json_array_size (extra))
        {
          r = wr_image_resolve (d->store, json_string_value (json_array_get (extra, i)), &img, err);
          if (r < 0)
            return r;
        }
    }
  /* a layer in both the image and an extra one: overlayfs refuses the same
   * lower twice (ELOOP), so keep the top-most, as wr_image_commit does */
  size_t m = 0;
  for (size_t k = 0; k < n; k++)
    {
      bool later = false;
      for (size_t j = k + 1; j < n && !later; j++)
        later = strcmp (sb->layers[k], sb->layers[j]) == 0;
      if (!later)
        memmove (sb->layers[m++], sb->layers[k], sizeof sb->layers[0]);
    }
  n = m;
  if (sb->ops && sb->ops->max_layers && n > sb->ops->max_layers)
    return wr_error (err, E2BIG, WR_E_INVALID,
                     "the sandbox's image with its extra layers has %zu layers; the %s backend "
                     "attaches at most %zu (one virtual disk each)",
                     n, sb->ops->name, sb->ops->max_layers);
  sb->n_layers = 0;
  for (size_t k = 0; k < n; k++)
    {
      r = wr_layer_acquire (d->store, sb->layers[k], &dirs[k], err);
      if (r < 0)
        return r;
      sb->n_layers++;
    }
  return 0;
}

/* Building a sandbox from scratch has three parts: prepare (image, layers,
 * state dir) and finish (agent connection, registry, table) run on the
 * loop; the backend's create, which waits for the sandbox's first process
 * to set itself up and exec the agent, runs on the build worker thread for
 * containers, so the loop keeps serving requests (and releasing destroyed
 * sandboxes) while the kernel builds namespaces on the other core. */
struct build
{
  struct wrd *d;
  struct sandbox *sb;
  enum sb_state state;
  const char *lowers[WR_MAX_LAYERS];
  char files[WR_MAX_LAYERS][1200];
  const char *file_ptrs[WR_MAX_LAYERS];
  char sdir[1200];
  struct wr_container_spec cs;
  int r;
  wr_err_t err;
  wrd_create_cb cb;
  void *ud;
  struct event *ev;
  struct build *next; /* worker queue */
};

static void
build_free (struct build *b)
{
  if (b->ev)
    event_free (b->ev);
  free (b);
}

static int
build_prepare (struct wrd *d, json_t *spec, enum sb_state state, struct build **ret, wr_err_t *err)
{
  struct build *b = calloc (1, sizeof *b);
  struct sandbox *sb = calloc (1, sizeof *sb);
  if (sb == NULL || b == NULL)
    {
      free (b);
      free (sb);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "sandbox");
    }
  b->d = d;
  b->sb = sb;
  b->state = state;
  sb->d = d;
  sb->spec = json_incref (spec);
  sb->state = SB_CREATING;
  snprintf (sb->backend, sizeof sb->backend, "%s",
            json_string_value (json_object_get (spec, "backend")));
  snprintf (sb->image, sizeof sb->image, "%s", json_string_value (json_object_get (spec, "image")));
  char rnd[13];
  wr_random_hex (rnd, 12);
  /* cluster mode: "NAME-" + 12 hex, so a gateway routes by the id alone */
  const char *node_prefix = wrd_cluster_id_prefix ();
  snprintf (sb->id, sizeof sb->id, "%s%s", node_prefix ? node_prefix : d->node, rnd);
  sb->ops = wrd_backend_get (sb->backend);
  const char *dirs[WR_MAX_LAYERS];
  int r = resolve_layers (d, sb, spec, dirs, err);
  if (r < 0)
    {
      sb_free (sb);
      free (b);
      return r;
    }
  /* overlay wants lowerdirs top-most first */
  for (size_t k = 0; k < sb->n_layers; k++)
    {
      b->lowers[sb->n_layers - 1 - k] = dirs[k];
      b->file_ptrs[k] = b->files[k];
      if (r == 0)
        r = wr_layer_file (d->store, sb->layers[k], b->files[k], sizeof b->files[k], err);
    }
  if (r < 0)
    {
      sb_free (sb);
      free (b);
      return r;
    }
  state_dir (d, sb->id, b->sdir, sizeof b->sdir);
  if (mkdir (b->sdir, 0700) < 0)
    {
      r = wr_error (err, errno, WR_E_INTERNAL, "mkdir %s", b->sdir);
      sb_free (sb);
      free (b);
      return r;
    }
  b->cs = (struct wr_container_spec){
    .id = sb->id,
    .state_dir = b->sdir,
    .lowerdirs = b->lowers,
    .n_lowerdirs = sb->n_layers,
    .memory_mb = (uint64_t)json_integer_value (json_object_get (spec, "memory_mb")),
    .disk_mb = (uint64_t)json_integer_value (json_object_get (spec, "disk_mb")),
    .cpus = json_number_value (json_object_get (spec, "cpus")),
    .pids_max = (uint64_t)json_integer_value (json_object_get (spec, "pids_max")),
    .net_host = strcmp (json_string_value (json_object_get (spec, "network")), "host") == 0,
    .netns_pool = wrd_net_pool (spec),
    .layer_files = b->file_ptrs,
    .n_layer_files = sb->n_layers,
    .image_config = sb->img_conf,
    .best_effort = strcmp (json_string_value (json_object_get (spec, "qos")), "best-effort") == 0,
  };
  json_t *det = json_object_get (spec, "deterministic");
  if (det)
    {
      b->cs.hostname = json_string_value (json_object_get (det, "hostname"));
      b->cs.time_ns = true;
      b->cs.uptime_s = (uint64_t)json_integer_value (json_object_get (det, "uptime_s"));
    }
  *ret = b;
  return 0;
}

static void
build_run (struct build *b)
{
  /* a VM's NIC needs its tap (and policy) before QEMU starts */
  struct wr_vm_net vmnet = { .tap_fd = -1 };
  bool vm_net = wrd_net_wanted (b->sb->spec) && strcmp (b->sb->backend, "container") != 0;
  if (vm_net && (b->r = wrd_net_attach_vm (b->d, b->sb, &vmnet, &b->err)) < 0)
    return;
  b->cs.vm_net = vm_net ? &vmnet : NULL;
  b->r = b->sb->ops->create (b->d, &b->cs, &b->sb->c, &b->err);
  b->cs.vm_net = NULL;
  if (vm_net)
    {
      close (vmnet.tap_fd); /* QEMU's copy keeps the tap, and it goes with QEMU */
      if (b->r < 0)
        wrd_net_detach (b->d, b->sb);
    }
  /* the sandbox's link and policy, before anything of its own runs */
  else if (b->r == 0 && wrd_net_wanted (b->sb->spec)
           && (b->r = wrd_net_attach (b->d, b->sb, &b->err)) < 0)
    b->sb->ops->destroy (b->d, &b->sb->c, b->sdir, NULL);
}

/* Consumes b. */
static int
build_finish (struct build *b, struct sandbox **ret, wr_err_t *err)
{
  struct wrd *d = b->d;
  struct sandbox *sb = b->sb;
  int r = b->r;
  if (r < 0)
    {
      if (err)
        *err = b->err;
      goto fail;
    }
  sb->has_container = true;
  wrd_net_start (d, sb);
  sb->conn = agent_conn_new (d->base, sb->c.agent_fd, agent_lost, sb);
  if (sb->conn)
    sb->c.agent_fd = -1; /* the connection owns (and closes) it now */
  if (sb->conn == NULL)
    {
      r = wr_error (err, ENOMEM, WR_E_INTERNAL, "agent connection");
      goto fail_destroy;
    }
  sb->created_at = now_s ();
  sb->state = b->state;
  if (d->stopping)
    {
      r = wr_error (err, 0, WR_E_UNAVAILABLE, "warrend is shutting down");
      goto fail_destroy;
    }
  r = wrd_db_put (d, sb, err);
  if (r < 0)
    goto fail_destroy;
  table_insert (d, sb);
  if (strcmp (sb->ops->name, "container") == 0)
    wr_container_drop_pidfd (&sb->c); /* idle: no daemon descriptor once its socket is shed */
  agent_conn_setup (sb);
  boot_watch (sb);
  build_free (b);
  *ret = sb;
  return 0;
fail_destroy:
  sb->ops->destroy (d, &sb->c, b->sdir, NULL);
  wrd_net_detach (d, sb);
fail:
  wr_rm_rf_at (AT_FDCWD, b->sdir);
  sb_free (sb);
  build_free (b);
  return r;
}

/* Build a sandbox from scratch, blocking the loop (internal callers). */
static int
sandbox_build (struct wrd *d, json_t *spec, enum sb_state state, struct sandbox **ret,
               wr_err_t *err)
{
  struct build *b;
  int r = build_prepare (d, spec, state, &b, err);
  if (r < 0)
    return r;
  build_run (b);
  return build_finish (b, ret, err);
}

/* ---- the build worker ---- */

static pthread_mutex_t worker_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t worker_cond = PTHREAD_COND_INITIALIZER;
static struct build *worker_head, **worker_tail = &worker_head;
static bool worker_started, worker_stop;
/* As many builders as the backend has child stacks (WR_CHILD_STACKS): while
 * one waits for its sandbox's first process, the other starts the next. */
#define N_BUILDERS 2
static pthread_t worker_thread[N_BUILDERS];
static unsigned builds_in_flight;

static void *
worker_main (void *arg WR_UNUSED)
{
  pthread_mutex_lock (&worker_lock);
  for (;;)
    {
      while (worker_head == NULL && !worker_stop)
        pthread_cond_wait (&worker_cond, &worker_lock);
      if (worker_head == NULL)
        break;
      struct build *b = worker_head;
      worker_head = b->next;
      if (worker_head == NULL)
        worker_tail = &worker_head;
      pthread_mutex_unlock (&worker_lock);
      build_run (b);
      event_active (b->ev, EV_TIMEOUT, 0); /* back to the loop */
      pthread_mutex_lock (&worker_lock);
    }
  pthread_mutex_unlock (&worker_lock);
  return NULL;
}

static void
build_done_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct build *b = arg;
  struct wrd *d = b->d;
  wrd_create_cb cb = b->cb;
  void *ud = b->ud;
  struct sandbox *sb = NULL;
  wr_err_t err;
  builds_in_flight--;
  int r = build_finish (b, &sb, &err);
  cb (d, r < 0 ? NULL : sb, r < 0 ? &err : NULL, ud);
}

static int
build_async (struct wrd *d, json_t *spec, enum sb_state state, bool urgent, wrd_create_cb cb,
             void *ud, wr_err_t *err)
{
  struct build *b;
  int r = build_prepare (d, spec, state, &b, err);
  if (r < 0)
    return r;
  b->cb = cb;
  b->ud = ud;
  bool threaded = b->sb->ops->flags & WRD_BACKEND_THREADED_CREATE;
  if (threaded && !worker_started)
    {
      worker_started = true;
      for (int i = 0; i < N_BUILDERS; i++)
        if (pthread_create (&worker_thread[i], NULL, worker_main, NULL) != 0)
          abort (); /* no thread at startup: nothing sensible to fall back to */
    }
  b->ev = event_new (d->base, -1, 0, build_done_cb, b);
  builds_in_flight++;
  if (!threaded || b->ev == NULL)
    {
      build_run (b);
      build_done_cb (-1, 0, b);
      return 0;
    }
  pthread_mutex_lock (&worker_lock);
  /* requests go before pool refills */
  if (urgent)
    {
      b->next = worker_head;
      worker_head = b;
      if (b->next == NULL)
        worker_tail = &b->next;
    }
  else
    {
      b->next = NULL;
      *worker_tail = b;
      worker_tail = &b->next;
    }
  pthread_cond_signal (&worker_cond);
  pthread_mutex_unlock (&worker_lock);
  return 0;
}

/* Stop the worker; builds that finished but were not delivered are undone. */
static void
worker_shutdown (struct wrd *d)
{
  if (!worker_started)
    return;
  pthread_mutex_lock (&worker_lock);
  worker_stop = true;
  pthread_cond_broadcast (&worker_cond);
  pthread_mutex_unlock (&worker_lock);
  for (int i = 0; i < N_BUILDERS; i++)
    pthread_join (worker_thread[i], NULL);
  worker_started = false;
  /* deliver what the worker finished (the loop no longer runs) */
  if (builds_in_flight)
    event_base_loop (d->base, EVLOOP_NONBLOCK);
}

/* An internal sandbox (fncall pool member): built like any other, never
 * listed (state pooled) and reaped, not re-adopted, after a restart. */
int
wrd_sandbox_build_internal (struct wrd *d, json_t *req, struct sandbox **ret, wr_err_t *err)
{
  json_t *spec = NULL;
  int r = wrd_parse_create (d, req, &spec, err);
  if (r < 0)
    return r;
  r = sandbox_build (d, spec, SB_POOLED, ret, err);
  json_decref (spec);
  return r;
}

/* ---- warm pools ---- */

static void pool_kick (struct wrd *d);

static void
pool_key (json_t *spec, char *buf, size_t len)
{
  snprintf (buf, len, "%s|%lld|%lld|%lld|%g|%s|%s",
            json_string_value (json_object_get (spec, "image")),
            json_integer_value (json_object_get (spec, "memory_mb")),
            json_integer_value (json_object_get (spec, "disk_mb")),
            json_integer_value (json_object_get (spec, "pids_max")),
            json_number_value (json_object_get (spec, "cpus")),
            json_string_value (json_object_get (spec, "network")),
            json_string_value (json_object_get (spec, "qos")));
}

static bool
poolable (json_t *spec)
{
  return json_array_size (json_object_get (spec, "layers")) == 0
         && json_object_get (spec, "net_group") == NULL
         && json_object_get (spec, "net_limits") == NULL
         && json_object_size (json_object_get (spec, "env")) == 0
         && json_object_get (spec, "deterministic") == NULL;
}

static struct pool *
pool_find (struct wrd *d, const char *key)
{
  for (struct pool *p = d->pools; p; p = p->next)
    if (strcmp (p->key, key) == 0)
      return p;
  return NULL;
}

static struct sandbox *
pool_take (struct wrd *d, json_t *spec)
{
  if (!poolable (spec))
    return NULL;
  char key[512];
  pool_key (spec, key, sizeof key);
  struct pool *p = pool_find (d, key);
  if (p == NULL)
    return NULL;
  struct sandbox *sb;
  while ((sb = p->head) != NULL)
    {
      p->head = sb->pool_next;
      p->ready--;
      sb->pool = NULL;
      sb->pool_next = NULL;
      if (sb->state == SB_POOLED && agent_conn_alive (sb->conn))
        {
          pool_kick (d);
          return sb;
        }
      wrd_sandbox_destroy (d, sb, NULL);
    }
  pool_kick (d);
  return NULL;
}

static void
pool_built (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct pool *p = ud;
  d->pool_building = false;
  if (sb == NULL)
    {
      wrd_log (WRD_LOG_WARN, "pool %s: %s\n", p->image, err->msg);
      struct timeval tv = { 1, 0 }; /* back off */
      if (d->pool_ev && !d->stopping)
        evtimer_add (d->pool_ev, &tv);
      return;
    }
  if (d->stopping || p->ready >= p->target)
    {
      wrd_sandbox_destroy (d, sb, NULL);
      return;
    }
  sb->pool = p;
  sb->pool_next = p->head;
  p->head = sb;
  p->ready++;
  pool_kick (d);
}

static int build_async (struct wrd *d, json_t *spec, enum sb_state state, bool urgent,
                        wrd_create_cb cb, void *ud, wr_err_t *err);

static void
pool_fill_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct wrd *d = arg;
  if (d->stopping || d->pool_building)
    return;
  /* One pool sandbox in the making at a time, behind any request's. */
  for (struct pool *p = d->pools; p; p = p->next)
    {
      if (p->ready >= p->target)
        continue;
      wr_err_t err;
      d->pool_building = true;
      if (build_async (d, p->spec, SB_POOLED, false, pool_built, p, &err) < 0)
        {
          d->pool_building = false;
          wrd_log (WRD_LOG_WARN, "pool %s: %s\n", p->image, err.msg);
          struct timeval tv = { 1, 0 };
          evtimer_add (d->pool_ev, &tv);
        }
      return;
    }
}

static void
pool_kick (struct wrd *d)
{
  if (d->pool_ev == NULL)
    {
      d->pool_ev = evtimer_new (d->base, pool_fill_cb, d);
      event_priority_set (d->pool_ev, 2);
    }
  if (!evtimer_pending (d->pool_ev, NULL))
    {
      struct timeval tv = { 0, 0 };
      evtimer_add (d->pool_ev, &tv);
    }
}

int
wrd_pool_set (struct wrd *d, const char *image, unsigned size, wr_err_t *err)
{
  if (size > 100000)
    return wr_error (err, 0, WR_E_INVALID, "pool size %u is too large (max 100000)", size);
  json_t *req = json_pack ("{s:s}", "image", image);
  json_t *spec = NULL;
  int r = wrd_parse_create (d, req, &spec, err);
  json_decref (req);
  if (r < 0)
    return r;
  struct wr_image *img = NULL;
  r = wr_image_resolve (d->store, image, &img, err);
  if (r < 0)
    {
      json_decref (spec);
      return r;
    }
  wr_image_free (img);
  char key[512];
  pool_key (spec, key, sizeof key);
  struct pool *p = pool_find (d, key);
  if (p == NULL)
    {
      p = calloc (1, sizeof *p);
      snprintf (p->key, sizeof p->key, "%s", key);
      snprintf (p->image, sizeof p->image, "%s", image);
      p->spec = json_incref (spec);
      p->next = d->pools;
      d->pools = p;
    }
  json_decref (spec);
  p->target = size;
  while (p->ready > p->target && p->head)
    {
      struct sandbox *sb = p->head;
      p->head = sb->pool_next;
      p->ready--;
      sb->pool = NULL;
      wrd_sandbox_destroy (d, sb, NULL);
    }
  r = wrd_db_pool_put (d, image, size, err);
  pool_kick (d);
  return r;
}

json_t *
wrd_pools_json (struct wrd *d)
{
  json_t *a = json_array ();
  for (struct pool *p = d->pools; p; p = p->next)
    json_array_append_new (a, json_pack ("{s:s,s:I,s:I}", "image", p->image, "size",
                                         (json_int_t)p->target, "ready", (json_int_t)p->ready));
  return json_pack ("{s:o}", "pools", a);
}

/* ---- public operations ---- */

/* Claimed or built: TTL, registry, metrics. */
static int
create_complete (struct wrd *d, struct sandbox *sb, uint64_t t0, wr_err_t *err)
{
  uint64_t ttl = (uint64_t)json_integer_value (json_object_get (sb->spec, "ttl_s"));
  sb->expires_at = ttl ? sb->created_at + (double)ttl : 0;
  arm_ttl (sb);
  wrd_sandbox_touch (sb);
  int r = wrd_db_put (d, sb, err);
  if (r < 0)
    {
      wrd_sandbox_destroy (d, sb, NULL);
      return r;
    }
  wrd_traj_lifecycle (d, sb, "create", json_pack ("{s:b}", "pooled", sb->from_pool));
  d->m.creations++;
  d->m.create_sum_s += (double)(wr_now_ns () - t0) / 1e9;
  return 0;
}

static struct sandbox *
claim_pooled (struct wrd *d, json_t *spec)
{
  struct sandbox *sb = pool_take (d, spec);
  if (sb)
    {
      json_decref (sb->spec);
      sb->spec = json_incref (spec);
      sb->state = SB_RUNNING;
      sb->created_at = now_s ();
      sb->from_pool = true;
      d->m.creations_pooled++;
    }
  return sb;
}

int
wrd_sandbox_create (struct wrd *d, json_t *req, struct sandbox **ret, wr_err_t *err)
{
  json_t *spec = NULL;
  int r = wrd_parse_create (d, req, &spec, err);
  if (r < 0)
    return r;
  uint64_t t0 = wr_now_ns ();
  struct sandbox *sb = claim_pooled (d, spec);
  if (sb == NULL && (r = sandbox_build (d, spec, SB_RUNNING, &sb, err)) < 0)
    {
      json_decref (spec);
      d->m.create_failures++;
      return r;
    }
  json_decref (spec);
  if ((r = create_complete (d, sb, t0, err)) < 0)
    return r;
  *ret = sb;
  return 0;
}

/* A create carrying an idempotency key (label warren.idem) while it is
 * built: a create with the same key waits for it and gets its outcome. */
struct idem_waiter
{
  wrd_create_cb cb;
  void *ud;
  struct idem_waiter *next;
};

struct create_req
{
  wrd_create_cb cb;
  void *ud;
  uint64_t t0;
  char idem[129]; /* "" when the create carries no key */
  struct idem_waiter *waiters;
  struct create_req *next; /* in keyed_inflight when idem[0] */
};

/* Keyed creates being built; warrend serves one daemon (as uploads.c). */
static struct create_req *keyed_inflight;

static const char *
spec_idem (json_t *spec)
{
  return json_string_value (json_object_get (json_object_get (spec, "labels"), LABEL_IDEM));
}

/* A create with this key already made (any state but pooled or being
 * destroyed) or being built here: the sandbox, or the build to wait on.
 * A walk of the table: keyed creates pay O(sandboxes), a few µs each. */
static struct sandbox *
idem_find (struct wrd *d, const char *key, struct create_req **ret_building)
{
  *ret_building = NULL;
  for (struct create_req *c = keyed_inflight; c; c = c->next)
    if (strcmp (c->idem, key) == 0)
      {
        *ret_building = c;
        return NULL;
      }
  for (size_t i = 0; i < d->table_size; i++)
    for (struct sandbox *s = d->table[i]; s; s = s->hnext)
      if (s->state != SB_POOLED && s->state != SB_DESTROYING)
        {
          const char *k = spec_idem (s->spec);
          if (k && strcmp (k, key) == 0)
            return s;
        }
  return NULL;
}

static void
create_built (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct create_req *c = ud;
  wr_err_t e2;
  d->creating--;
  if (c->idem[0])
    for (struct create_req **l = &keyed_inflight; *l; l = &(*l)->next)
      if (*l == c)
        {
          *l = c->next;
          break;
        }
  if (sb == NULL)
    d->m.create_failures++;
  else if (create_complete (d, sb, c->t0, &e2) < 0)
    {
      sb = NULL;
      err = &e2;
    }
  c->cb (d, sb, err, c->ud);
  /* retries of the same key get the same outcome: the sandbox, or the error */
  for (struct idem_waiter *w = c->waiters, *next; w; w = next)
    {
      next = w->next;
      w->cb (d, sb, err, w->ud);
      free (w);
    }
  free (c);
}

/* --max-sandboxes (or $WARREN_MAX_SANDBOXES) caps the sandboxes a client
 * can hold (warm-pool and fncall members not counted, creates under way
 * counted); the kernel budget (limits.c) caps everything held. Over either
 * a create is 429, an infra failure (docs/errors.md): the platform is full,
 * the task did nothing wrong. O(1): a count, not a walk of the table. */
static int
check_capacity (struct wrd *d, wr_err_t *err)
{
  size_t pooled = 0;
  for (struct pool *p = d->pools; p; p = p->next)
    pooled += p->ready;
  size_t held = d->count > pooled ? d->count - pooled : 0;
  return wrd_limits_admit (d, held + d->creating, err);
}

int
wrd_sandbox_create_async (struct wrd *d, json_t *req, wrd_create_cb cb, void *ud, wr_err_t *err)
{
  json_t *spec = NULL;
  int r = check_capacity (d, err);
  if (r < 0)
    return r;
  r = wrd_parse_create (d, req, &spec, err);
  if (r < 0)
    return r;
  const char *key = spec_idem (spec);
  struct create_req *building = NULL;
  struct sandbox *sb = key ? idem_find (d, key, &building) : NULL;
  if (sb || building)
    {
      /* a retry of a create made or being made here: never a second sandbox */
      json_decref (spec);
      if (sb)
        {
          cb (d, sb, NULL, ud);
          return 0;
        }
      struct idem_waiter *w = calloc (1, sizeof *w);
      if (w == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "create");
      *w = (struct idem_waiter){ .cb = cb, .ud = ud, .next = building->waiters };
      building->waiters = w;
      return 0;
    }
  uint64_t t0 = wr_now_ns ();
  sb = claim_pooled (d, spec);
  if (sb)
    {
      json_decref (spec);
      wr_err_t e2;
      if (create_complete (d, sb, t0, &e2) < 0)
        cb (d, NULL, &e2, ud);
      else
        cb (d, sb, NULL, ud);
      return 0;
    }
  struct create_req *c = calloc (1, sizeof *c);
  if (c == NULL)
    {
      json_decref (spec);
      return wr_error (err, ENOMEM, WR_E_INTERNAL, "create");
    }
  c->cb = cb;
  c->ud = ud;
  c->t0 = t0;
  if (key)
    {
      snprintf (c->idem, sizeof c->idem, "%s", key);
      c->next = keyed_inflight;
      keyed_inflight = c;
    }
  d->creating++; /* before: build_async may finish (create_built) at once */
  r = build_async (d, spec, SB_RUNNING, true, create_built, c, err);
  json_decref (spec);
  if (r < 0)
    {
      d->creating--;
      if (key)
        keyed_inflight = c->next; /* nothing was pushed since */
      free (c);
      d->m.create_failures++;
    }
  return r;
}

/* Release what a killed sandbox holds: processes (already dying), cgroups,
 * state dir, registry row. */
static int
sandbox_release (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  char sdir[1200];
  state_dir (d, sb->id, sdir, sizeof sdir);
  int r = 0;
  if (sb->has_container)
    r = sb->ops->destroy (d, &sb->c, sdir, err);
  if (r < 0)
    return r; /* keep the record: a later attempt or a restart retries */
  wrd_net_detach (d, sb);
  wr_rm_rf_at (AT_FDCWD, sdir);
  wrd_db_delete (d, sb->id, NULL);
  d->m.destroys++;
  return 0;
}

static void
reaping_unlink (struct wrd *d, struct sandbox *sb)
{
  if (sb->reap_pprev == NULL)
    return;
  *sb->reap_pprev = sb->reap_next;
  if (sb->reap_next)
    sb->reap_next->reap_pprev = sb->reap_pprev;
  sb->reap_pprev = NULL;
  d->n_reaping--;
}

static void
reap_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sandbox *sb = arg;
  struct wrd *d = sb->d;
  wr_err_t err;
  if (sandbox_release (d, sb, &err) < 0)
    {
      /* e.g. a cgroup still busy while the kernel finishes the exit */
      if (++sb->reap_tries < 50)
        {
          event_free (sb->reap_ev);
          sb->reap_ev = evtimer_new (d->base, reap_cb, sb);
          struct timeval tv = { 0, 20000 };
          evtimer_add (sb->reap_ev, &tv);
          return;
        }
      wrd_log (WRD_LOG_ERROR, "destroy %s: %s (a restart retries)\n", sb->id, err.msg);
    }
  reaping_unlink (d, sb);
  sb_free (sb);
}

int
wrd_sandbox_destroy (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  if (sb->state == SB_DESTROYING)
    return 0;
  wrd_checkpoints_drop (d, sb->id);
  if (sb->pool)
    {
      for (struct sandbox **l = &sb->pool->head; *l; l = &(*l)->pool_next)
        if (*l == sb)
          {
            *l = sb->pool_next;
            sb->pool->ready--;
            break;
          }
      sb->pool = NULL;
      pool_kick (d);
    }
  reclaim_detach (sb); /* a pause's reclaim stops, its record comes first */
  wrd_traj_lifecycle (d, sb, "destroy", NULL);
  agent_conn_free (sb->conn);
  sb->conn = NULL;
  if (sb->ttl_ev)
    evtimer_del (sb->ttl_ev);
  if (sb->idle_ev)
    evtimer_del (sb->idle_ev);
  /* Fast path: SIGKILL the sandbox's first process (for a container, init of
   * its pid namespace: the kernel kills every other process with it), answer
   * at once, and release cgroups and state when its pidfd reports the exit.
   * Nothing waits on the request path. If the daemon dies before that, the
   * registry row is still there and the restart reaps it. */
  if (!d->stopping && sb->has_container && wr_container_pidfd (&sb->c) >= 0
      && syscall (SYS_pidfd_send_signal, sb->c.pidfd, SIGKILL, NULL, 0) == 0)
    {
      sb->reap_ev = event_new (d->base, sb->c.pidfd, EV_READ, reap_cb, sb);
      if (sb->reap_ev && event_add (sb->reap_ev, NULL) == 0)
        {
          table_remove (d, sb);
          sb->state = SB_DESTROYING;
          sb->reap_next = d->reaping;
          if (d->reaping)
            d->reaping->reap_pprev = &sb->reap_next;
          sb->reap_pprev = &d->reaping;
          d->reaping = sb;
          d->n_reaping++;
          return 0;
        }
    }
  int r = sandbox_release (d, sb, err);
  if (r < 0)
    return r;
  table_remove (d, sb);
  sb_free (sb);
  return 0;
}

/* ---- pause: the reclaim on a worker ----
 * Pushing hundreds of MB into swap takes seconds; on the loop every other
 * request would wait. The freeze (and the swap let in) happen on the loop,
 * the sandbox reads "paused" at once, and the reclaim runs on a worker
 * that knows the sandbox by id only. A resume or destroy meanwhile sets
 * stop (the worker ends its rounds: thawed, new swap denied again, nothing
 * of a running sandbox is pushed out); destroy detaches sb, so the result
 * is delivered to no sandbox. The pause's "pause" log record and its
 * figures come when the reclaim ends, or with the resume that cut it.
 * A reclaim pass in the kernel (v1 memory.force_empty above all) goes on
 * until the group is empty, thawed or not: a resume would see what its
 * first requests read back pushed out again. Such passes stop at a
 * signal, so stop also sends the worker SIGUSR2 (a handler that does
 * nothing, without SA_RESTART). */

struct reclaim_waiter
{
  wrd_reclaim_cb cb;
  void *ud;
  struct reclaim_waiter *next;
};

struct sb_reclaim
{
  struct wrd *d;
  struct sandbox *sb; /* NULL once destroyed */
  char id[sizeof ((struct sandbox *)0)->id];
  const struct wrd_backend *ops;
  atomic_bool stop;
  bool again;  /* paused again while a stopped reclaim was still running */
  bool logged; /* the "pause" record is written */
  uint64_t t0;
  struct wr_pause_stats st; /* the worker's until done */
  struct reclaim_waiter *waiters;
  pthread_mutex_t lock; /* thread is valid (and signalled) while running */
  pthread_t thread;
  bool running;
  struct event *kick; /* after a stop: SIGUSR2 again every 5 ms until it ends */
};

static void
reclaim_interrupt (int sig WR_UNUSED)
{
}

static void
reclaim_signal_init (void)
{
  struct sigaction sa = { .sa_handler = reclaim_interrupt };
  sigemptyset (&sa.sa_mask);
  sigaction (SIGUSR2, &sa, NULL);
}

static void
reclaim_log (struct sb_reclaim *rc)
{
  if (rc->logged || rc->sb == NULL)
    return;
  rc->logged = true;
  struct wr_pause_stats *st = &rc->sb->last_pause;
  wrd_traj_lifecycle (
      rc->d, rc->sb, "pause",
      json_pack ("{s:I,s:I,s:f,s:b}", "memory_before_bytes", (json_int_t)st->memory_before_bytes,
                 "memory_after_bytes", (json_int_t)st->memory_after_bytes, "ms",
                 (double)(wr_now_ns () - rc->t0) / 1e6, "completed", !atomic_load (&rc->stop)));
}

static void
reclaim_work (void *arg)
{
  struct sb_reclaim *rc = arg;
  pthread_mutex_lock (&rc->lock);
  rc->thread = pthread_self ();
  rc->running = true;
  pthread_mutex_unlock (&rc->lock);
  if (!atomic_load (&rc->stop))
    rc->ops->reclaim (rc->d, rc->id, &rc->stop, &rc->st);
  pthread_mutex_lock (&rc->lock);
  rc->running = false;
  pthread_mutex_unlock (&rc->lock);
}

static int reclaim_start (struct wrd *d, struct sandbox *sb);

static void
reclaim_done (void *arg)
{
  struct sb_reclaim *rc = arg;
  struct sandbox *sb = rc->sb;
  if (sb)
    sb->reclaim = NULL;
  /* paused again meanwhile: its reclaim starts now; the waiters (its
   * request among them) wait for that one */
  if (sb && rc->again && sb->state == SB_PAUSED && reclaim_start (rc->d, sb) == 0)
    {
      sb->reclaim->waiters = rc->waiters;
      rc->waiters = NULL;
    }
  else if (sb)
    {
      if (!atomic_load (&rc->stop))
        {
          sb->last_pause.freeze_ns += rc->st.freeze_ns;
          sb->last_pause.reclaim_ns = rc->st.reclaim_ns;
          sb->last_pause.memory_after_bytes = rc->st.memory_after_bytes;
        }
      reclaim_log (rc);
    }
  for (struct reclaim_waiter *w = rc->waiters, *next; w; w = next)
    {
      next = w->next;
      w->cb (rc->d, sb, w->ud);
      free (w);
    }
  if (rc->kick)
    event_free (rc->kick);
  pthread_mutex_destroy (&rc->lock);
  free (rc);
}

static int
reclaim_start (struct wrd *d, struct sandbox *sb)
{
  struct sb_reclaim *rc = calloc (1, sizeof *rc);
  if (rc == NULL)
    return -ENOMEM;
  rc->d = d;
  rc->sb = sb;
  rc->ops = sb->ops;
  rc->t0 = wr_now_ns ();
  snprintf (rc->id, sizeof rc->id, "%s", sb->id);
  atomic_init (&rc->stop, false);
  static pthread_once_t sig_once = PTHREAD_ONCE_INIT;
  pthread_once (&sig_once, reclaim_signal_init);
  pthread_mutex_init (&rc->lock, NULL);
  int r = wrd_job_run (d, reclaim_work, reclaim_done, rc);
  if (r < 0)
    {
      pthread_mutex_destroy (&rc->lock);
      free (rc);
      return r;
    }
  sb->reclaim = rc;
  return 0;
}

/* The signal that cuts a kernel pass short can land just before the
 * worker enters the next one (after its check of stop): that pass would
 * then run to its end, pushing out what a resume has just read back. So
 * the signal comes again every 5 ms until the worker is done. */
static void
reclaim_kick (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sb_reclaim *rc = arg;
  pthread_mutex_lock (&rc->lock);
  bool running = rc->running;
  if (running) /* cut the kernel's pass short (EINTR) */
    pthread_kill (rc->thread, SIGUSR2);
  pthread_mutex_unlock (&rc->lock);
  struct timeval tv = { 0, 5000 };
  if (running && rc->kick)
    evtimer_add (rc->kick, &tv);
}

/* resume or destroy: the worker stops at its next step */
static void
reclaim_stop (struct sandbox *sb)
{
  if (sb->reclaim == NULL)
    return;
  struct sb_reclaim *rc = sb->reclaim;
  atomic_store (&rc->stop, true);
  if (rc->kick == NULL)
    rc->kick = evtimer_new (rc->d->base, reclaim_kick, rc);
  reclaim_kick (-1, 0, rc);
  sb->reclaim->again = false;
  reclaim_log (sb->reclaim);
}

static void
reclaim_detach (struct sandbox *sb)
{
  if (sb->reclaim == NULL)
    return;
  reclaim_stop (sb);
  sb->reclaim->sb = NULL;
  sb->reclaim = NULL;
}

int
wrd_sandbox_reclaim_wait (struct sandbox *sb, wrd_reclaim_cb cb, void *ud)
{
  struct reclaim_waiter *w;
  if (sb->reclaim == NULL || (atomic_load (&sb->reclaim->stop) && !sb->reclaim->again)
      || (w = calloc (1, sizeof *w)) == NULL)
    return 0;
  w->cb = cb;
  w->ud = ud;
  w->next = sb->reclaim->waiters;
  sb->reclaim->waiters = w;
  return 1;
}

int
wrd_sandbox_pause (struct wrd *d, struct sandbox *sb, bool pause, wr_err_t *err)
{
  if (sb->state == SB_DEAD)
    return wr_error (err, 0, WR_E_GONE, "sandbox %s is dead (%s)", sb->id,
                     wrd_sandbox_dead_reason (sb));
  if ((pause && sb->state == SB_PAUSED) || (!pause && sb->state == SB_RUNNING))
    return 0;
  /* containers: freeze (and let swap in) here, reclaim on a worker;
   * prefetch and thaw (docs/containers.md, "Pause"); other backends just
   * freeze */
  struct wr_pause_stats st = { 0 };
  uint64_t t0 = wr_now_ns ();
  if (!pause)
    reclaim_stop (sb);
  int r = sb->ops->pause ? sb->ops->pause (d, &sb->c, pause, &st, err)
                         : sb->ops->freeze (d, &sb->c, pause, err);
  if (r < 0)
    return r;
  if (pause)
    sb->last_pause = st;
  else
    sb->resume_ns = wr_now_ns () - t0;
  sb->state = pause ? SB_PAUSED : SB_RUNNING;
  bool later = false;
  if (pause && sb->ops->pause && sb->ops->reclaim)
    {
      if (sb->reclaim) /* a stopped one still running: this one follows it */
        {
          sb->reclaim->again = later = true;
          sb->reclaim->logged = false;
          sb->reclaim->t0 = t0;
        }
      else
        later = reclaim_start (d, sb) == 0;
      if (!later)
        wrd_log (WRD_LOG_WARN, "pause %s: no worker for the reclaim; frozen only\n", sb->id);
    }
  if (!later)
    wrd_traj_lifecycle (d, sb, pause ? "pause" : "resume", NULL);
  if (!pause)
    wrd_sandbox_touch (sb);
  return wrd_db_put (d, sb, err);
}

/* ---- idle-pause ---- */

static void
idle_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sandbox *sb = arg;
  double idle = (double)json_integer_value (json_object_get (sb->spec, "idle_pause_s"));
  if (sb->state != SB_RUNNING || idle <= 0)
    return; /* the next request (or resume) re-arms */
  double left = sb->last_used + idle - now_s ();
  if (sb->busy || left > 0)
    {
      /* a request under way, or one ended since the timer was set */
      left = sb->busy || left > idle ? idle : left;
      struct timeval tv = { (time_t)left, (suseconds_t)((left - floor (left)) * 1e6) };
      evtimer_add (sb->idle_ev, &tv);
      return;
    }
  wr_err_t err;
  if (wrd_sandbox_pause (sb->d, sb, true, &err) < 0)
    wrd_log (WRD_LOG_WARN, "idle-pause %s: %s\n", sb->id, err.msg);
  else
    wrd_log (WRD_LOG_DEBUG, "idle-pause %s after %.0f s without requests\n", sb->id, idle);
}

void
wrd_sandbox_touch (struct sandbox *sb)
{
  sb->last_used = now_s ();
  double idle = (double)json_integer_value (json_object_get (sb->spec, "idle_pause_s"));
  if (idle <= 0 || sb->state != SB_RUNNING)
    return;
  if (sb->idle_ev == NULL)
    sb->idle_ev = evtimer_new (sb->d->base, idle_cb, sb);
  /* armed once; idle_cb looks at last_used and waits out the rest */
  if (sb->idle_ev && !evtimer_pending (sb->idle_ev, NULL))
    {
      struct timeval tv = { (time_t)idle, (suseconds_t)((idle - floor (idle)) * 1e6) };
      evtimer_add (sb->idle_ev, &tv);
    }
}

int
wrd_sandbox_wake (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  int r = sb->state == SB_PAUSED ? wrd_sandbox_pause (d, sb, false, err) : 0;
  if (r == 0)
    wrd_sandbox_touch (sb);
  return r;
}

int
wrd_sandbox_set_ttl (struct wrd *d, struct sandbox *sb, double ttl_s, wr_err_t *err)
{
  sb->expires_at = now_s () + ttl_s;
  json_int_t ttl = (json_int_t)ceil (sb->expires_at - sb->created_at);
  json_object_set_new (sb->spec, "ttl_s", json_integer (ttl));
  arm_ttl (sb);
  return wrd_db_put (d, sb, err);
}

json_t *
wrd_sandbox_json (struct wrd *d, struct sandbox *sb, bool detail)
{
  json_t *j = json_pack (
      "{s:s,s:s,s:s,s:s,s:f,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O}", "id", sb->id, "backend", sb->backend,
      "image", sb->image, "state", sb_state_name (sb->state), "created_at", sb->created_at,
      "memory_mb", json_object_get (sb->spec, "memory_mb"), "cpus",
      json_object_get (sb->spec, "cpus"), "disk_mb", json_object_get (sb->spec, "disk_mb"),
      "pids_max", json_object_get (sb->spec, "pids_max"), "network",
      json_object_get (sb->spec, "network"), "layers", json_object_get (sb->spec, "layers"),
      "labels", json_object_get (sb->spec, "labels"), "ttl_s", json_object_get (sb->spec, "ttl_s"));
  json_object_set_new (j, "expires_at",
                       sb->expires_at > 0 ? json_real (sb->expires_at) : json_null ());
  json_object_set_new (j, "image_digest", json_string (sb->image_digest));
  json_object_set_new (j, "pooled", json_boolean (sb->from_pool));
  if (sb->state == SB_DEAD)
    json_object_set_new (j, "dead_reason", json_string (wrd_sandbox_dead_reason (sb)));
  json_t *qos = json_object_get (sb->spec, "qos");
  json_object_set_new (j, "qos", qos ? json_incref (qos) : json_string ("latency"));
  json_object_set_new (
      j, "idle_pause_s",
      json_integer (json_integer_value (json_object_get (sb->spec, "idle_pause_s"))));
  if (sb->state == SB_PAUSED && sb->last_pause.memory_before_bytes)
    json_object_set_new (
        j, "pause",
        json_pack ("{s:I,s:I,s:f,s:f,s:b}", "memory_before_bytes",
                   (json_int_t)sb->last_pause.memory_before_bytes, "memory_after_bytes",
                   (json_int_t)sb->last_pause.memory_after_bytes, "freeze_ms",
                   (double)sb->last_pause.freeze_ns / 1e6, "reclaim_ms",
                   (double)sb->last_pause.reclaim_ns / 1e6, "reclaiming", sb->reclaim != NULL));
  else if (sb->state == SB_RUNNING && sb->resume_ns)
    json_object_set_new (j, "resume", json_pack ("{s:f}", "ms", (double)sb->resume_ns / 1e6));
  json_t *det = json_object_get (sb->spec, "deterministic");
  if (det)
    {
      /* only containers get a time namespace so far (docs/api.md) */
      det = json_deep_copy (det);
      json_object_set_new (
          det, "time_namespace",
          json_boolean (strcmp (sb->backend, "container") == 0 && wr_timens_supported ()));
      json_object_set_new (j, "deterministic", det);
    }
  if (detail && sb->has_container && sb->state != SB_DEAD)
    {
      struct wr_container_stats st;
      if (sb->ops->stats (d, &sb->c, &st, NULL) == 0)
        json_object_set_new (j, "usage",
                             json_pack ("{s:I,s:I,s:I,s:I,s:I}", "memory_bytes",
                                        (json_int_t)st.memory_bytes, "memory_peak_bytes",
                                        (json_int_t)st.memory_peak_bytes, "oom_kills",
                                        (json_int_t)st.oom_kills, "pids", (json_int_t)st.pids,
                                        "cpu_usage_ns", (json_int_t)st.cpu_usage_ns));
      json_object_set_new (j, "pid", json_integer (sb->c.pid));
    }
  if (detail)
    json_object_set_new (j, "checkpoints", wrd_checkpoints_json (d, sb->id));
  json_t *net = wrd_net_json (d, sb, detail);
  json_t *usage = json_object_get (j, "usage");
  if (net && usage && json_object_get (net, "egress_bytes"))
    json_object_set (usage, "net_egress_bytes", json_object_get (net, "egress_bytes"));
  if (net)
    json_object_set_new (j, "net", net);
  return j;
}

/* ---- restart recovery ---- */

static int
recover_row (struct wrd *d, json_t *row, void *ud WR_UNUSED)
{
  const char *id = json_string_value (json_object_get (row, "id"));
  const char *state = json_string_value (json_object_get (row, "state"));
  char sdir[1200];
  state_dir (d, id, sdir, sizeof sdir);
  pid_t pid = (pid_t)json_integer_value (json_object_get (row, "pid"));
  uint64_t st = (uint64_t)json_integer_value (json_object_get (row, "start_time"));
  double expires = json_number_value (json_object_get (row, "expires_at"));
  wr_err_t err;
  bool keep = strcmp (state, "running") == 0 || strcmp (state, "paused") == 0;
  if (expires > 0 && expires <= now_s ())
    keep = false;
  struct sandbox *sb = calloc (1, sizeof *sb);
  sb->d = d;
  snprintf (sb->id, sizeof sb->id, "%s", id);
  sb->ops = wrd_backend_get (json_string_value (json_object_get (row, "backend")));
  if (sb->ops == NULL)
    sb->ops = wrd_backend_get ("container");
  if (keep && sb->ops->adopt (d, id, pid, st, sdir, &sb->c, &err) == 0)
    {
      sb->has_container = true;
      sb->spec = json_incref (json_object_get (row, "spec"));
      snprintf (sb->backend, sizeof sb->backend, "%s",
                json_string_value (json_object_get (row, "backend")));
      snprintf (sb->image, sizeof sb->image, "%s",
                json_string_value (json_object_get (row, "image")));
      sb->state = strcmp (state, "paused") == 0 ? SB_PAUSED : SB_RUNNING;
      sb->created_at = json_number_value (json_object_get (row, "created_at"));
      sb->expires_at = expires;
      json_t *layers = json_object_get (row, "layers");
      sb->layers = calloc (json_array_size (layers) + 1, sizeof *sb->layers);
      size_t i;
      json_t *l;
      json_array_foreach (layers, i, l)
      {
        const char *dir;
        if (wr_layer_acquire (d->store, json_string_value (l), &dir, NULL) == 0)
          snprintf (sb->layers[sb->n_layers++], sizeof sb->layers[0], "%s", json_string_value (l));
      }
      struct wr_image *img = NULL;
      if (wr_image_resolve (d->store, sb->image, &img, NULL) == 0)
        {
          sb->img_conf = json_incref (img->config);
          snprintf (sb->image_digest, sizeof sb->image_digest, "%s", img->digest);
          wr_image_free (img);
        }
      sb->conn = agent_conn_new (d->base, sb->c.agent_fd, agent_lost, sb);
      if (sb->conn)
        sb->c.agent_fd = -1; /* owned by the connection now */
      table_insert (d, sb);
      if (wrd_net_readopt (d, sb, &err) < 0)
        wrd_log (WRD_LOG_WARN, "recover %s: network: %s\n", id, err.msg);
      if (strcmp (sb->ops->name, "container") == 0)
        wr_container_drop_pidfd (&sb->c);
      agent_conn_setup (sb);
      arm_ttl (sb);
      wrd_sandbox_touch (sb); /* idle-pause counts from the restart */
      wrd_log (WRD_LOG_INFO, "re-adopted sandbox %s (pid %d)\n", id, (int)pid);
      return 0;
    }
  /* Reap: the sandbox is gone, pooled, expired or cannot be reached. */
  memset (&sb->c, 0, sizeof sb->c);
  sb->c.pidfd = -1;
  sb->c.agent_fd = -1;
  snprintf (sb->c.id, sizeof sb->c.id, "%s", id);
  if (pid > 0 && keep == false)
    {
      struct wr_container tmp;
      if (sb->ops->adopt (d, id, pid, st, sdir, &tmp, NULL) == 0)
        {
          if (tmp.agent_fd >= 0)
            close (tmp.agent_fd);
          sb->c = tmp;
          sb->c.agent_fd = -1;
        }
    }
  if (sb->ops->destroy (d, &sb->c, sdir, &err) < 0)
    wrd_log (WRD_LOG_WARN, "reap %s: %s\n", id, err.msg);
  wr_rm_rf_at (AT_FDCWD, sdir);
  wrd_db_delete (d, id, NULL);
  bool traj_expired = expires > 0 && expires <= now_s ();
  wrd_traj_lifecycle (d, sb, traj_expired ? "ttl" : "lost",
                      json_pack ("{s:s}", "reason", "gone at daemon restart"));
  wrd_traj_lifecycle (d, sb, "destroy", NULL);
  wrd_log (WRD_LOG_INFO, "reaped sandbox %s (%s)\n", id, state);
  free (sb);
  return 0;
}

int
wrd_recover (struct wrd *d, wr_err_t *err)
{
  wrd_net_init (d); /* before adoption: a fresh table, then each sandbox's chains */
  int r = wrd_db_each (d, recover_row, NULL, err);
  if (r < 0)
    return r;
  /* State dirs without a registry row: a crash between mkdir and insert. */
  char sroot[1100];
  snprintf (sroot, sizeof sroot, "%s/sandboxes", d->root);
  DIR *dir = opendir (sroot);
  if (dir)
    {
      struct dirent *de;
      while ((de = readdir (dir)) != NULL)
        {
          if (de->d_name[0] == '.' || wrd_sandbox_find (d, de->d_name))
            continue;
          struct wr_container c = { .pid = 0, .pidfd = -1, .agent_fd = -1 };
          snprintf (c.id, sizeof c.id, "%s", de->d_name);
          char sdir[1200];
          state_dir (d, de->d_name, sdir, sizeof sdir);
          wr_container_destroy (d->rt, &c, sdir, NULL);
          wr_rm_rf_at (AT_FDCWD, sdir);
        }
      closedir (dir);
    }
  return 0;
}

void
wrd_shutdown (struct wrd *d)
{
  d->stopping = true;
  worker_shutdown (d);
  /* finish releasing what was destroyed just before the stop */
  while (d->reaping)
    {
      struct sandbox *sb = d->reaping;
      reaping_unlink (d, sb);
      sandbox_release (d, sb, NULL);
      sb_free (sb);
    }
  /* Pooled sandboxes are only a cache: destroy them. Claimed ones survive
   * the daemon and are re-adopted by the next one. */
  for (struct pool *p = d->pools; p; p = p->next)
    while (p->head)
      wrd_sandbox_destroy (d, p->head, NULL);
  for (size_t i = 0; i < d->table_size; i++)
    for (struct sandbox *s = d->table[i], *next; s; s = next)
      {
        next = s->hnext;
        table_remove (d, s);
        sb_free (s);
      }
  for (struct pool *p = d->pools, *next; p; p = next)
    {
      next = p->next;
      json_decref (p->spec);
      free (p);
    }
  d->pools = NULL;
  if (d->pool_ev)
    event_free (d->pool_ev);
  d->pool_ev = NULL;
  wrd_net_shutdown (d);
}

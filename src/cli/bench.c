/* `warren bench`: Warren's figures next to the kernel floor and the usual
 * alternatives, measured in the same run, as one JSON report on stdout.
 * Progress goes to stderr. See docs/performance.md for what each figure
 * means. */
#include "cli/bench.h"

#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include "cli/bench_floor.h"
#include "common/util.h"

#define BENCH_WARMUP 3
#define BENCH_MAX_COUNT 1000000
#define BENCH_MAX_CONCURRENCY 256
#define BENCH_REQUEST_TIMEOUT_MS 30000

struct bench_opts
{
  size_t count;       /* warren iterations */
  size_t floor_count; /* bare container and posix_spawn iterations */
  size_t alt_count;   /* crun and bwrap iterations (slow) */
  size_t burst;       /* sandboxes claimed from the warm pool */
  unsigned concurrency;
  const char *image; /* NULL: the daemon's default image */
  const char *rootfs;
  int pool_timeout_s;
  unsigned blocks; /* create: interleaved blocks of floor, crun and warren (0/1: none) */
  bool pool, no_floor, no_alt, check, quiet;
};

struct floors
{
  json_t *floor, *floor_fork, *spawn, *crun, *bwrap; /* report entries */
  wr_bench_stats_t floor_s, spawn_s, crun_s, bwrap_s;
  bool floor_ok, spawn_ok, crun_ok, bwrap_ok;
};

static bool bench_quiet;

static void __attribute__ ((format (printf, 1, 2))) progress (const char *fmt, ...)
{
  if (bench_quiet)
    return;
  va_list ap;
  va_start (ap, fmt);
  fputs ("bench: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
}

static json_t *
error_entry (const char *msg)
{
  return json_pack ("{s:s}", "error", msg);
}

static json_t *
warren_error_entry (const warren_error_t *e, size_t completed)
{
  return json_pack ("{s:s, s:s, s:I}", "error", e->message, "code", e->code, "completed",
                    (json_int_t)completed);
}

/* ---- floors ------------------------------------------------------------ */

typedef int (*floor_fn) (const char *rootfs, const char *scratch, const char *workdir,
                         wr_bench_sample_t *s, wr_err_t *err);

static int
run_container (const char *rootfs, const char *scratch, const char *workdir, wr_bench_sample_t *s,
               wr_err_t *err)
{
  return wr_bench_floor_container (rootfs, scratch, s, err);
}
static int
run_container_fork (const char *rootfs, const char *scratch, const char *workdir,
                    wr_bench_sample_t *s, wr_err_t *err)
{
  return wr_bench_floor_container_fork (rootfs, scratch, s, err);
}
static int
run_spawn (const char *rootfs, const char *scratch, const char *workdir, wr_bench_sample_t *s,
           wr_err_t *err)
{
  return wr_bench_floor_spawn (rootfs, s, err);
}
static int
run_crun (const char *rootfs, const char *scratch, const char *workdir, wr_bench_sample_t *s,
          wr_err_t *err)
{
  return wr_bench_crun (rootfs, workdir, s, err);
}
static int
run_bwrap (const char *rootfs, const char *scratch, const char *workdir, wr_bench_sample_t *s,
           wr_err_t *err)
{
  return wr_bench_bwrap (rootfs, s, err);
}

/* One reference measurement as a report entry: stats, {"error"} or {"skip"}. */
static json_t *
measure_one (const char *name, floor_fn fn, size_t n, const char *rootfs, const char *scratch,
             const char *workdir, wr_bench_stats_t *ret_stats, bool *ret_ok)
{
  *ret_ok = false;
  if (n == 0)
    return json_pack ("{s:s}", "skip", "count is 0");
  progress ("%s: %zu iterations", name, n);
  _cleanup_free_ double *lat = calloc (n, sizeof *lat);
  if (!lat)
    return error_entry ("out of memory");
  wr_bench_sample_t s = { .lat_ms = lat, .n = n };
  wr_err_t err;
  wr_err_clear (&err);
  if (fn (rootfs, scratch, workdir, &s, &err) < 0)
    {
      if (err.code && strcmp (err.code, WR_E_UNSUPPORTED) == 0)
        return json_pack ("{s:s}", "skip", err.msg);
      return error_entry (err.msg);
    }
  wr_bench_stats_compute (lat, n, s.wall_s, 1, ret_stats);
  json_t *j = wr_bench_stats_json (ret_stats);
  if (j && s.note)
    json_object_set_new (j, "note", json_string (s.note));
  json_t *steps = wr_bench_steps_json (&s);
  if (j && steps)
    json_object_set_new (j, "steps_mean_ms", steps);
  else
    json_decref (steps);
  *ret_ok = j != NULL;
  return j;
}

static void
floors_free (struct floors *f)
{
  json_decref (f->floor);
  json_decref (f->floor_fork);
  json_decref (f->spawn);
  json_decref (f->crun);
  json_decref (f->bwrap);
}

static void
measure_floors (const struct bench_opts *o, const char *rootfs, const char *scratch,
                const char *workdir, struct floors *f)
{
  memset (f, 0, sizeof *f);
  wr_bench_stats_t unused;
  bool unused_ok;
  if (o->no_floor)
    {
      f->floor = json_pack ("{s:s}", "skip", "--no-floor");
      f->spawn = json_pack ("{s:s}", "skip", "--no-floor");
    }
  else
    {
      f->floor = measure_one ("bare container floor", run_container, o->floor_count, rootfs,
                              scratch, workdir, &f->floor_s, &f->floor_ok);
      f->floor_fork = measure_one ("bare container floor (fork-style)", run_container_fork,
                                   o->floor_count, rootfs, scratch, workdir, &unused, &unused_ok);
      f->spawn = measure_one ("posix_spawn", run_spawn, o->floor_count, rootfs, scratch, workdir,
                              &f->spawn_s, &f->spawn_ok);
    }
  if (o->no_alt)
    {
      f->crun = json_pack ("{s:s}", "skip", "--no-alt");
      f->bwrap = json_pack ("{s:s}", "skip", "--no-alt");
    }
  else
    {
      f->crun = measure_one ("crun run", run_crun, o->alt_count, rootfs, scratch, workdir,
                             &f->crun_s, &f->crun_ok);
      f->bwrap = measure_one ("bwrap", run_bwrap, o->alt_count, rootfs, scratch, workdir,
                              &f->bwrap_s, &f->bwrap_ok);
    }
}

static void
add_floors (json_t *report, const struct floors *f)
{
  json_object_set (report, "floor", f->floor);
  if (f->floor_fork)
    json_object_set (report, "floor_fork", f->floor_fork);
  json_object_set (report, "posix_spawn", f->spawn);
  json_object_set (report, "crun", f->crun);
  json_object_set (report, "bwrap", f->bwrap);
}

/* a / b, or null when either side is missing. */
static json_t *
ratio (bool ok_a, double a, bool ok_b, double b)
{
  if (!ok_a || !ok_b || b <= 0)
    return json_null ();
  return json_real (round (a / b * 1000.0) / 1000.0);
}

/* Target verdict: null when it could not be evaluated. */
static json_t *
verdict (json_t *r, bool at_least, double bound, int *missed)
{
  if (!json_is_real (r))
    {
      (*missed)++;
      return json_null ();
    }
  double v = json_real_value (r);
  bool ok = at_least ? v >= bound : v <= bound;
  if (!ok)
    (*missed)++;
  return json_boolean (ok);
}

static json_t *
host_entry (warren_client_t *c)
{
  struct utsname u;
  uname (&u);
  return json_pack ("{s:s, s:s, s:I, s:s}", "kernel", u.release, "machine", u.machine, "cpus",
                    (json_int_t)sysconf (_SC_NPROCESSORS_ONLN), "warren_host",
                    c ? warren_client_host (c) : "");
}

/* ---- warren: sustained create + destroy, burst claims ------------------- */

struct worker_shared
{
  const char *host;
  json_t *req;
  size_t total;
  atomic_size_t next;
  atomic_size_t done;
  atomic_size_t pooled;
  atomic_bool failed;
  double *lat, *lat_create, *lat_destroy; /* per iteration, ms */
  char **ids;                             /* burst: claimed ids, destroyed later */
  bool destroy;                           /* create+destroy, else claim only */
  pthread_mutex_t mu;
  warren_error_t first_err;
};

static void
record_failure (struct worker_shared *sh, const warren_error_t *e)
{
  pthread_mutex_lock (&sh->mu);
  if (!atomic_load (&sh->failed))
    sh->first_err = *e;
  atomic_store (&sh->failed, true);
  pthread_mutex_unlock (&sh->mu);
}

static void *
create_worker (void *p)
{
  struct worker_shared *sh = p;
  warren_error_t e;
  warren_client_t *c = warren_client_new (sh->host, NULL, &e);
  if (!c)
    {
      record_failure (sh, &e);
      return NULL;
    }
  warren_client_set_timeout (c, BENCH_REQUEST_TIMEOUT_MS);
  while (!atomic_load (&sh->failed))
    {
      size_t i = atomic_fetch_add (&sh->next, 1);
      if (i >= sh->total)
        break;
      uint64_t t0 = wr_now_ns ();
      json_t *sb = warren_sandbox_create (c, sh->req, &e);
      uint64_t t1 = wr_now_ns ();
      if (!sb)
        {
          record_failure (sh, &e);
          break;
        }
      const char *id = json_string_value (json_object_get (sb, "id"));
      if (!id || !warren_id_valid (id))
        {
          snprintf (e.code, sizeof e.code, "%s", WARREN_E_PROTOCOL);
          snprintf (e.message, sizeof e.message, "create returned no valid id");
          record_failure (sh, &e);
          json_decref (sb);
          break;
        }
      if (json_is_true (json_object_get (sb, "pooled")))
        atomic_fetch_add (&sh->pooled, 1);
      if (sh->destroy)
        {
          int r = warren_sandbox_delete (c, id, &e);
          uint64_t t2 = wr_now_ns ();
          json_decref (sb);
          if (r < 0)
            {
              record_failure (sh, &e);
              break;
            }
          sh->lat[i] = (double)(t2 - t0) / 1e6;
          sh->lat_destroy[i] = (double)(t2 - t1) / 1e6;
        }
      else
        {
          sh->ids[i] = strdup (id);
          json_decref (sb);
          sh->lat[i] = (double)(t1 - t0) / 1e6;
        }
      sh->lat_create[i] = (double)(t1 - t0) / 1e6;
      atomic_fetch_add (&sh->done, 1);
    }
  warren_client_free (c);
  return NULL;
}

/* Run total creates over `concurrency` threads; returns wall seconds or -1
 * (sh->first_err says why). */
static double
run_workers (struct worker_shared *sh, unsigned concurrency)
{
  pthread_t th[BENCH_MAX_CONCURRENCY];
  unsigned started = 0;
  uint64_t t0 = wr_now_ns ();
  for (unsigned i = 0; i < concurrency; i++)
    {
      if (pthread_create (&th[i], NULL, create_worker, sh) != 0)
        break;
      started++;
    }
  if (started == 0)
    {
      snprintf (sh->first_err.code, sizeof sh->first_err.code, "%s", WARREN_E_INTERNAL);
      snprintf (sh->first_err.message, sizeof sh->first_err.message, "pthread_create failed");
      atomic_store (&sh->failed, true);
    }
  for (unsigned i = 0; i < started; i++)
    pthread_join (th[i], NULL);
  double wall = (double)(wr_now_ns () - t0) / 1e9;
  return atomic_load (&sh->failed) ? -1 : wall;
}

static json_t *
create_request (const struct bench_opts *o, const char *image)
{
  json_t *req = json_pack ("{s:s}", "backend", "container");
  if (req && image)
    json_object_set_new (req, "image", json_string (image));
  return req;
}

/* The image the daemon resolves for our request, so pools can be keyed on it. */
static char *
resolve_image (warren_client_t *c, const struct bench_opts *o, warren_error_t *e)
{
  if (o->image)
    return strdup (o->image);
  json_t *req = create_request (o, NULL);
  json_t *sb = warren_sandbox_create (c, req, e);
  json_decref (req);
  if (!sb)
    return NULL;
  const char *id = json_string_value (json_object_get (sb, "id"));
  const char *img = json_string_value (json_object_get (sb, "image"));
  char *ret = img ? strdup (img) : NULL;
  if (id)
    warren_sandbox_delete (c, id, NULL);
  json_decref (sb);
  if (!ret)
    {
      snprintf (e->code, sizeof e->code, "%s", WARREN_E_PROTOCOL);
      snprintf (e->message, sizeof e->message, "create response has no \"image\"");
    }
  return ret;
}

/* Pool entry {"image","size","ready"} for image; *ret_size / *ret_ready. */
static int
pool_status (warren_client_t *c, const char *image, long long *ret_size, long long *ret_ready,
             warren_error_t *e)
{
  json_t *p = warren_pools_get (c, e);
  if (!p)
    return -1;
  *ret_size = 0;
  *ret_ready = 0;
  json_t *arr = json_is_array (p) ? p : json_object_get (p, "pools");
  size_t i;
  json_t *it;
  json_array_foreach (arr, i, it)
  {
    const char *img = json_string_value (json_object_get (it, "image"));
    if (img && strcmp (img, image) == 0)
      {
        *ret_size = json_integer_value (json_object_get (it, "size"));
        *ret_ready = json_integer_value (json_object_get (it, "ready"));
      }
  }
  json_decref (p);
  return 0;
}

/* Set the pool and wait until `want` sandboxes are ready; returns seconds
 * waited or -1. */
static double
pool_fill (warren_client_t *c, const char *image, unsigned size, long long want, int timeout_s,
           warren_error_t *e)
{
  uint64_t t0 = wr_now_ns ();
  json_t *r = warren_pool_set (c, image, size, e);
  if (!r)
    return -1;
  json_decref (r);
  for (;;)
    {
      long long sz, ready;
      if (pool_status (c, image, &sz, &ready, e) < 0)
        return -1;
      double waited = (double)(wr_now_ns () - t0) / 1e9;
      if (ready >= want)
        return waited;
      if (waited > timeout_s)
        {
          snprintf (e->code, sizeof e->code, "%s", WARREN_E_TIMEOUT);
          snprintf (e->message, sizeof e->message,
                    "pool %s: %lld of %lld sandboxes ready after %d s", image, ready, want,
                    timeout_s);
          return -1;
        }
      usleep (20000);
    }
}

static double
p50_of (double *v, size_t n)
{
  wr_bench_stats_t s;
  wr_bench_stats_compute (v, n, 1, 1, &s);
  return round (s.p50_ms * 1000.0) / 1000.0;
}

static int
warmup_creates (warren_client_t *c, json_t *req, warren_error_t *e)
{
  for (int i = 0; i < BENCH_WARMUP; i++)
    {
      json_t *sb = warren_sandbox_create (c, req, e);
      if (!sb)
        return -1;
      const char *id = json_string_value (json_object_get (sb, "id"));
      int r = id ? warren_sandbox_delete (c, id, e) : 0;
      json_decref (sb);
      if (r < 0)
        return -1;
    }
  return 0;
}

/* Sustained create + destroy. Fills *ret_stats on success. */
static json_t *
bench_warren_create (warren_client_t *c, const struct bench_opts *o, wr_bench_stats_t *ret_stats,
                     bool *ret_ok)
{
  *ret_ok = false;
  warren_error_t e;
  _cleanup_free_ char *image = NULL;
  long long prev_size = 0, ready = 0;
  json_t *req = NULL;
  json_t *out = NULL;
  double fill_s = -1;
  if (o->pool)
    {
      image = resolve_image (c, o, &e);
      if (!image || pool_status (c, image, &prev_size, &ready, &e) < 0)
        return warren_error_entry (&e, 0);
      unsigned size = o->concurrency * 4 > 16 ? o->concurrency * 4 : 16;
      progress ("warren: filling pool %s to %u", image, size);
      fill_s = pool_fill (c, image, size, size, o->pool_timeout_s, &e);
      if (fill_s < 0)
        {
          out = warren_error_entry (&e, 0);
          goto restore;
        }
    }
  req = create_request (o, o->pool ? image : o->image);
  if (warmup_creates (c, req, &e) < 0)
    {
      out = warren_error_entry (&e, 0);
      goto restore;
    }
  progress ("warren: %zu create+destroy, concurrency %u", o->count, o->concurrency);
  struct worker_shared sh
      = { .host = warren_client_host (c), .req = req, .total = o->count, .destroy = true };
  pthread_mutex_init (&sh.mu, NULL);
  sh.lat = calloc (o->count, sizeof (double));
  sh.lat_create = calloc (o->count, sizeof (double));
  sh.lat_destroy = calloc (o->count, sizeof (double));
  if (!sh.lat || !sh.lat_create || !sh.lat_destroy)
    out = error_entry ("out of memory");
  else
    {
      double wall = run_workers (&sh, o->concurrency);
      if (wall < 0)
        out = warren_error_entry (&sh.first_err, atomic_load (&sh.done));
      else
        {
          wr_bench_stats_compute (sh.lat, o->count, wall, o->concurrency, ret_stats);
          out = wr_bench_stats_json (ret_stats);
          json_object_set_new (out, "create_p50_ms", json_real (p50_of (sh.lat_create, o->count)));
          json_object_set_new (out, "destroy_p50_ms",
                               json_real (p50_of (sh.lat_destroy, o->count)));
          json_object_set_new (out, "pooled", json_integer ((json_int_t)atomic_load (&sh.pooled)));
          if (fill_s >= 0)
            json_object_set_new (out, "pool_fill_s", json_real (round (fill_s * 1000) / 1000));
          *ret_ok = true;
        }
    }
  free (sh.lat);
  free (sh.lat_create);
  free (sh.lat_destroy);
  pthread_mutex_destroy (&sh.mu);
restore:
  json_decref (req);
  if (o->pool && image)
    {
      json_t *r = warren_pool_set (c, image, (unsigned)prev_size, NULL);
      json_decref (r);
    }
  return out;
}

/* Burst: fill a warm pool with N, then claim N as fast as possible. */
static json_t *
bench_warren_burst (warren_client_t *c, const struct bench_opts *o, int *missed,
                    json_t **ret_targets)
{
  warren_error_t e;
  size_t n = o->burst;
  _cleanup_free_ char *image = resolve_image (c, o, &e);
  long long prev_size = 0, ready = 0;
  if (!image || pool_status (c, image, &prev_size, &ready, &e) < 0)
    return warren_error_entry (&e, 0);
  progress ("warren: filling pool %s to %zu", image, n);
  json_t *out = NULL;
  json_t *req = NULL;
  struct worker_shared sh = { .host = warren_client_host (c), .total = n, .destroy = false };
  pthread_mutex_init (&sh.mu, NULL);
  double fill_s = pool_fill (c, image, (unsigned)n, (long long)n, o->pool_timeout_s, &e);
  if (fill_s < 0)
    {
      out = warren_error_entry (&e, 0);
      goto restore;
    }
  req = create_request (o, image);
  sh.req = req;
  sh.lat = calloc (n, sizeof (double));
  sh.lat_create = calloc (n, sizeof (double));
  sh.ids = calloc (n, sizeof (char *));
  if (!sh.lat || !sh.lat_create || !sh.ids)
    {
      out = error_entry ("out of memory");
      goto restore;
    }
  progress ("warren: claiming %zu, concurrency %u", n, o->concurrency);
  double wall = run_workers (&sh, o->concurrency);
  if (wall < 0)
    out = warren_error_entry (&sh.first_err, atomic_load (&sh.done));
  else
    {
      wr_bench_stats_t s;
      wr_bench_stats_compute (sh.lat, n, wall, o->concurrency, &s);
      out = wr_bench_stats_json (&s);
      size_t pooled = atomic_load (&sh.pooled);
      json_object_set_new (out, "total_ms", json_real (round (wall * 1e6) / 1000.0));
      json_object_set_new (out, "pooled", json_integer ((json_int_t)pooled));
      json_object_set_new (out, "pool_fill_s", json_real (round (fill_s * 1000) / 1000));
      json_t *t = json_object ();
      /* 500 in <= 1 s, scaled to the burst size asked for. */
      double budget_ms = (double)n * 2.0;
      bool fast = wall * 1000.0 <= budget_ms;
      bool p50 = s.p50_ms <= 2.0;
      json_object_set_new (t, "burst_rate>=500/s", json_boolean (fast));
      json_object_set_new (t, "claim_p50<=2ms", json_boolean (p50));
      json_object_set_new (t, "all_from_pool", json_boolean (pooled == n));
      *missed += !fast + !p50 + (pooled != n);
      *ret_targets = t;
    }
restore:
  json_decref (req);
  /* Shrink the pool first so destroying the claims does not race a refill. */
  json_decref (warren_pool_set (c, image, (unsigned)prev_size, NULL));
  if (sh.ids)
    {
      uint64_t t0 = wr_now_ns ();
      size_t destroyed = 0;
      for (size_t i = 0; i < n; i++)
        if (sh.ids[i])
          {
            if (warren_sandbox_delete (c, sh.ids[i], NULL) == 0)
              destroyed++;
            free (sh.ids[i]);
          }
      if (out && destroyed > 0 && json_is_object (out) && !json_object_get (out, "error"))
        json_object_set_new (
            out, "destroy_rate_per_s",
            json_real (round ((double)destroyed / ((double)(wr_now_ns () - t0) / 1e9) * 1000)
                       / 1000));
    }
  free (sh.ids);
  free (sh.lat);
  free (sh.lat_create);
  pthread_mutex_destroy (&sh.mu);
  return out;
}

/* Exec of /bin/true round trips in one sandbox. */
static json_t *
bench_warren_exec (warren_client_t *c, const struct bench_opts *o, wr_bench_stats_t *ret_stats,
                   bool *ret_ok)
{
  *ret_ok = false;
  warren_error_t e;
  json_t *req = create_request (o, o->image);
  json_t *sb = warren_sandbox_create (c, req, &e);
  json_decref (req);
  if (!sb)
    return warren_error_entry (&e, 0);
  _cleanup_free_ char *id = strdup (json_string_value (json_object_get (sb, "id")) ?: "");
  json_decref (sb);
  if (!warren_id_valid (id))
    return error_entry ("create returned no valid id");

  json_t *ex = json_pack ("{s:[s], s:i}", "cmd", "/bin/true", "timeout_s", 30);
  _cleanup_free_ double *lat = calloc (o->count, sizeof *lat);
  json_t *out = NULL;
  size_t done = 0;
  if (!lat)
    {
      out = error_entry ("out of memory");
      goto out;
    }
  progress ("warren: %zu exec round trips of /bin/true", o->count);
  uint64_t start = 0;
  for (size_t i = 0; i < o->count + BENCH_WARMUP; i++)
    {
      if (i == BENCH_WARMUP)
        start = wr_now_ns ();
      uint64_t t0 = wr_now_ns ();
      json_t *res = warren_exec (c, id, ex, &e);
      uint64_t t1 = wr_now_ns ();
      if (!res)
        {
          out = warren_error_entry (&e, done);
          goto out;
        }
      int status = warren_result_status (res);
      json_decref (res);
      if (status != 0)
        {
          char msg[128];
          snprintf (msg, sizeof msg, "/bin/true in the sandbox exited with status %d", status);
          out = error_entry (msg);
          goto out;
        }
      if (i >= BENCH_WARMUP)
        {
          lat[i - BENCH_WARMUP] = (double)(t1 - t0) / 1e6;
          done++;
        }
    }
  wr_bench_stats_compute (lat, o->count, (double)(wr_now_ns () - start) / 1e9, 1, ret_stats);
  out = wr_bench_stats_json (ret_stats);
  *ret_ok = true;
out:
  json_decref (ex);
  warren_sandbox_delete (c, id, NULL);
  return out;
}

/* ---- reports ----------------------------------------------------------- */

static json_t *
report_floor (warren_client_t *c, const struct floors *f, int *missed)
{
  json_t *r = json_pack ("{s:s}", "benchmark", "floor");
  add_floors (r, f);
  json_object_set_new (
      r, "ratios",
      json_pack ("{s:o, s:o, s:o}", "floor_vs_crun_rate",
                 ratio (f->floor_ok, f->floor_s.rate_per_s, f->crun_ok, f->crun_s.rate_per_s),
                 "floor_vs_bwrap_rate",
                 ratio (f->floor_ok, f->floor_s.rate_per_s, f->bwrap_ok, f->bwrap_s.rate_per_s),
                 "spawn_vs_floor_rate",
                 ratio (f->spawn_ok, f->spawn_s.rate_per_s, f->floor_ok, f->floor_s.rate_per_s)));
  json_object_set_new (r, "host", host_entry (c));
  if (!f->floor_ok || !f->spawn_ok)
    (*missed)++;
  return r;
}

/* --blocks K: K short blocks, each the floor, crun and warren create+destroy
 * back to back, so that all three see the same moment of a shared machine;
 * the ratios are per block, reported as median and range. */
static json_t *
create_blocks (warren_client_t *c, const struct bench_opts *o, const char *rootfs,
               const char *scratch, const char *workdir, json_t **ret_vs_floor,
               json_t **ret_vs_crun)
{
  unsigned k = o->blocks;
  json_t *list = json_array ();
  double *vf = calloc (k, sizeof *vf), *vc = calloc (k, sizeof *vc), *wr = calloc (k, sizeof *wr);
  size_t nf = 0, nc = 0, nw = 0;
  struct bench_opts ob = *o;
  ob.count = o->count / k > 0 ? o->count / k : 1;
  size_t floor_n = o->floor_count / k > 20 ? o->floor_count / k : 20;
  size_t crun_n = o->alt_count / k > 10 ? o->alt_count / k : 10;
  for (unsigned b = 0; list && vf && vc && wr && b < k; b++)
    {
      progress ("block %u/%u", b + 1, k);
      wr_bench_stats_t fs, cs, ws;
      bool fok = false, cok = false, wok = false;
      json_t *fj = o->no_floor ? NULL
                               : measure_one ("bare container floor", run_container, floor_n,
                                              rootfs, scratch, workdir, &fs, &fok);
      json_t *cj = o->no_alt ? NULL
                             : measure_one ("crun run", run_crun, crun_n, rootfs, scratch, workdir,
                                            &cs, &cok);
      json_t *wj = bench_warren_create (c, &ob, &ws, &wok);
      json_decref (fj);
      json_decref (cj);
      json_decref (wj);
      json_t *e = json_object ();
      if (wok)
        {
          json_object_set_new (e, "warren_rate", json_real (ws.rate_per_s));
          wr[nw++] = ws.rate_per_s;
        }
      if (fok)
        json_object_set_new (e, "floor_rate", json_real (fs.rate_per_s));
      if (cok)
        json_object_set_new (e, "crun_rate", json_real (cs.rate_per_s));
      if (wok && fok && fs.rate_per_s > 0)
        {
          vf[nf] = ws.rate_per_s / fs.rate_per_s;
          json_object_set_new (e, "vs_floor", json_real (round (vf[nf++] * 1000) / 1000));
        }
      if (wok && cok && cs.rate_per_s > 0)
        {
          vc[nc] = ws.rate_per_s / cs.rate_per_s;
          json_object_set_new (e, "vs_crun", json_real (round (vc[nc++] * 1000) / 1000));
        }
      json_array_append_new (list, e);
    }
  json_t *out = json_pack ("{s:I, s:I, s:I, s:I, s:o}", "blocks", (json_int_t)k, "warren_count",
                           (json_int_t)ob.count, "floor_count", (json_int_t)floor_n, "crun_count",
                           (json_int_t)crun_n, "each", list);
  if (out)
    {
      json_object_set_new (out, "warren_rate", wr_bench_range_json (wr, nw, NULL));
      json_object_set_new (out, "vs_floor", wr_bench_range_json (vf, nf, NULL));
      json_object_set_new (out, "vs_crun", wr_bench_range_json (vc, nc, NULL));
    }
  double mf = 0, mc = 0;
  json_decref (wr_bench_range_json (vf, nf, &mf));
  json_decref (wr_bench_range_json (vc, nc, &mc));
  *ret_vs_floor = nf ? json_real (mf) : json_null ();
  *ret_vs_crun = nc ? json_real (mc) : json_null ();
  free (vf);
  free (vc);
  free (wr);
  return out;
}

static json_t *
report_create (warren_client_t *c, const struct bench_opts *o, const struct floors *f, int *missed,
               bool *failed, const char *rootfs, const char *scratch, const char *workdir)
{
  wr_bench_stats_t w;
  bool ok;
  json_t *r = json_pack ("{s:s}", "benchmark", "create");
  json_object_set_new (r, "warren", bench_warren_create (c, o, &w, &ok));
  *failed |= !ok;
  add_floors (r, f);
  json_t *vs_floor = ratio (ok, w.rate_per_s, f->floor_ok, f->floor_s.rate_per_s);
  json_t *vs_crun = ratio (ok, w.rate_per_s, f->crun_ok, f->crun_s.rate_per_s);
  json_t *vs_bwrap = ratio (ok, w.rate_per_s, f->bwrap_ok, f->bwrap_s.rate_per_s);
  if (o->blocks > 1)
    {
      /* the targets are judged on the medians of the interleaved blocks */
      json_t *bf, *bc;
      json_object_set_new (r, "blocks", create_blocks (c, o, rootfs, scratch, workdir, &bf, &bc));
      json_object_set_new (r, "ratios_single_run",
                           json_pack ("{s:O, s:O}", "warren_vs_floor_rate", vs_floor,
                                      "warren_vs_crun_rate", vs_crun));
      json_decref (vs_floor);
      json_decref (vs_crun);
      vs_floor = bf;
      vs_crun = bc;
    }
  json_object_set_new (r, "targets",
                       json_pack ("{s:o, s:o}", "create_vs_floor>=1.0",
                                  verdict (vs_floor, true, 1.0, missed), "create_vs_crun>=10",
                                  verdict (vs_crun, true, 10.0, missed)));
  json_object_set_new (r, "ratios",
                       json_pack ("{s:o, s:o, s:o}", "warren_vs_floor_rate", vs_floor,
                                  "warren_vs_crun_rate", vs_crun, "warren_vs_bwrap_rate",
                                  vs_bwrap));
  json_object_set_new (r, "host", host_entry (c));
  return r;
}

static json_t *
report_burst (warren_client_t *c, const struct bench_opts *o, const struct floors *f, int *missed,
              bool *failed)
{
  json_t *targets = NULL;
  json_t *r = json_pack ("{s:s}", "benchmark", "burst");
  json_t *w = bench_warren_burst (c, o, missed, &targets);
  if (!targets)
    {
      *failed = true;
      (*missed)++;
      targets = json_pack ("{s:n, s:n}", "burst_rate>=500/s", "claim_p50<=2ms");
    }
  json_object_set_new (r, "warren", w);
  add_floors (r, f);
  json_t *wrate = json_object_get (w, "rate_per_s");
  json_object_set_new (r, "ratios",
                       json_pack ("{s:o, s:o}", "warren_vs_floor_rate",
                                  ratio (json_is_number (wrate), json_number_value (wrate),
                                         f->floor_ok, f->floor_s.rate_per_s),
                                  "warren_vs_crun_rate",
                                  ratio (json_is_number (wrate), json_number_value (wrate),
                                         f->crun_ok, f->crun_s.rate_per_s)));
  json_object_set_new (r, "targets", targets);
  json_object_set_new (r, "host", host_entry (c));
  return r;
}

static json_t *
report_exec (warren_client_t *c, const struct bench_opts *o, const struct floors *f, int *missed,
             bool *failed)
{
  wr_bench_stats_t w;
  bool ok;
  json_t *r = json_pack ("{s:s}", "benchmark", "exec");
  json_object_set_new (r, "warren", bench_warren_exec (c, o, &w, &ok));
  *failed |= !ok;
  add_floors (r, f);
  json_t *p50 = ratio (ok, w.p50_ms, f->spawn_ok, f->spawn_s.p50_ms);
  json_t *mean = ratio (ok, w.mean_ms, f->spawn_ok, f->spawn_s.mean_ms);
  json_object_set_new (
      r, "targets",
      json_pack ("{s:o}", "exec_p50_vs_spawn_p50<=1.5", verdict (p50, false, 1.5, missed)));
  json_object_set_new (r, "ratios",
                       json_pack ("{s:o, s:o}", "warren_vs_spawn_p50_latency", p50,
                                  "warren_vs_spawn_mean_latency", mean));
  json_object_set_new (r, "host", host_entry (c));
  return r;
}

/* ---- command line ------------------------------------------------------ */

static void
usage (FILE *f)
{
  fputs ("usage: warren bench floor|create|burst|exec|all [options]\n"
         "       warren bench call [options]   (fncall; see warren bench call --help)\n"
         "       warren bench image [options]  (layers; see warren bench image --help)\n"
         "       warren bench vm [options]     (VM boot/restore; see warren bench vm --help)\n"
         "       warren bench cluster [options] (simulated nodes; warren bench cluster --help)\n"
         "       warren bench density [options] (idle sandboxes; warren bench density --help)\n"
         "       warren bench pause|qos [options] (pause memory, CPU QoS; --help)\n"
         "       warren bench net [-n N] [--updates M] (network policy create cost, updates)\n"
         "  -n, --count N          warren iterations (default 200)\n"
         "  -c, --concurrency C    client threads (default 4; exec: 1)\n"
         "      --image REF        image (default: the daemon's default image)\n"
         "      --pool             create: draw from a warm pool (sized for C)\n"
         "      --burst N          create: claim N from a pool of N (same as `bench burst`)\n"
         "      --floor-count N    bare container and posix_spawn iterations (default 200)\n"
         "      --alt-count N      crun and bwrap iterations (default 100)\n"
         "      --rootfs DIR       busybox rootfs for the floors (default: built in a temp dir)\n"
         "      --pool-timeout S   seconds to wait for a pool to fill (default 120)\n"
         "      --no-floor         skip the bare container and posix_spawn floors\n"
         "      --blocks K         create: also K interleaved blocks of floor, crun and\n"
         "                         warren; targets judged on the per-block ratios' median\n"
         "      --no-alt           skip crun and bwrap\n"
         "      --check            exit 3 when a target is missed\n"
         "  -q, --quiet            no progress on stderr\n",
         f);
}

static int
parse_size (const char *s, size_t max, size_t *ret)
{
  char *end;
  errno = 0;
  unsigned long long v = strtoull (s, &end, 10);
  if (errno || end == s || *end || s[0] == '-' || v > max)
    return -1;
  *ret = (size_t)v;
  return 0;
}

static int
parse_opts (int argc, char **argv, struct bench_opts *o, bool *explicit_conc)
{
  static const struct option longopts[] = {
    { "count", required_argument, NULL, 'n' },
    { "concurrency", required_argument, NULL, 'c' },
    { "image", required_argument, NULL, 'i' },
    { "pool", no_argument, NULL, 'p' },
    { "burst", required_argument, NULL, 'b' },
    { "floor-count", required_argument, NULL, 'f' },
    { "alt-count", required_argument, NULL, 'a' },
    { "rootfs", required_argument, NULL, 'r' },
    { "pool-timeout", required_argument, NULL, 't' },
    { "no-floor", no_argument, NULL, 'F' },
    { "blocks", required_argument, NULL, 'B' },
    { "no-alt", no_argument, NULL, 'A' },
    { "check", no_argument, NULL, 'C' },
    { "quiet", no_argument, NULL, 'q' },
    { "help", no_argument, NULL, 'h' },
    { NULL, 0, NULL, 0 },
  };
  optind = 0; /* GNU: re-initialise, the CLI may have parsed its own options */
  opterr = 0;
  int ch;
  size_t v;
  while ((ch = getopt_long (argc, argv, "+n:c:qh", longopts, NULL)) != -1)
    switch (ch)
      {
      case 'n':
        if (parse_size (optarg, BENCH_MAX_COUNT, &o->count) < 0 || o->count == 0)
          goto bad;
        break;
      case 'c':
        if (parse_size (optarg, BENCH_MAX_CONCURRENCY, &v) < 0 || v == 0)
          goto bad;
        o->concurrency = (unsigned)v;
        *explicit_conc = true;
        break;
      case 'i':
        o->image = optarg;
        break;
      case 'p':
        o->pool = true;
        break;
      case 'b':
        if (parse_size (optarg, 100000, &o->burst) < 0 || o->burst == 0)
          goto bad;
        break;
      case 'f':
        if (parse_size (optarg, BENCH_MAX_COUNT, &o->floor_count) < 0)
          goto bad;
        break;
      case 'a':
        if (parse_size (optarg, BENCH_MAX_COUNT, &o->alt_count) < 0)
          goto bad;
        break;
      case 'r':
        o->rootfs = optarg;
        break;
      case 't':
        if (parse_size (optarg, 86400, &v) < 0)
          goto bad;
        o->pool_timeout_s = (int)v;
        break;
      case 'F':
        o->no_floor = true;
        break;
      case 'B':
        if (parse_size (optarg, 1000, &v) < 0)
          goto bad;
        o->blocks = (unsigned)v;
        break;
      case 'A':
        o->no_alt = true;
        break;
      case 'C':
        o->check = true;
        break;
      case 'q':
        o->quiet = true;
        break;
      case 'h':
        usage (stdout);
        return 1;
      default:
        goto bad;
      }
  if (optind != argc)
    {
      fprintf (stderr, "warren bench: unexpected argument '%s'\n", argv[optind]);
      return -1;
    }
  return 0;
bad:
  if (optind > 0 && optind <= argc)
    fprintf (stderr, "warren bench: bad option or value near '%s'\n", argv[optind - 1]);
  usage (stderr);
  return -1;
}

static int
emit (json_t *report)
{
  if (!report)
    {
      fprintf (stderr, "warren bench: out of memory\n");
      return -1;
    }
  char *s = json_dumps (report, JSON_INDENT (2) | JSON_REAL_PRECISION (10));
  json_decref (report);
  if (!s)
    return -1;
  puts (s);
  fflush (stdout);
  free (s);
  return 0;
}

int
wr_cli_bench (warren_client_t *c, int argc, char **argv)
{
  if (argc > 0 && strcmp (argv[0], "bench") == 0)
    {
      argc--;
      argv++;
    }
  if (argc < 1)
    {
      usage (stderr);
      return 2;
    }
  const char *sub = argv[0];
  if (strcmp (sub, "image") == 0)
    {
      int wr_cli_bench_image (warren_client_t * c, int argc, char **argv); /* bench_image.c */
      return c ? wr_cli_bench_image (c, argc, argv) : 1;
    }
  if (strcmp (sub, "vm") == 0)
    {
      int wr_cli_bench_vm (warren_client_t * c, int argc, char **argv); /* bench_vm.c */
      return c ? wr_cli_bench_vm (c, argc, argv) : 1;
    }
  if (strcmp (sub, "call") == 0)
    {
      int wr_cli_bench_call (warren_client_t * c, int argc, char **argv); /* bench_call.c */
      return c ? wr_cli_bench_call (c, argc, argv) : 1;
    }
  if (strcmp (sub, "fork") == 0)
    {
      int wr_cli_bench_fork (warren_client_t * c, int argc, char **argv); /* bench_fork.c */
      return c ? wr_cli_bench_fork (c, argc, argv) : 1;
    }
  if (strcmp (sub, "density") == 0)
    {
      int wr_cli_bench_density (warren_client_t * c, int argc, char **argv); /* bench_density.c */
      return c ? wr_cli_bench_density (c, argc, argv) : 1;
    }
  if (strcmp (sub, "net") == 0)
    {
      int wr_cli_bench_net (warren_client_t * c, int argc, char **argv); /* bench_net.c */
      return c ? wr_cli_bench_net (c, argc, argv) : 1;
    }
  if (strcmp (sub, "pause") == 0)
    return c ? wr_cli_bench_pause (c, argc, argv) : 1;
  if (strcmp (sub, "qos") == 0)
    return c ? wr_cli_bench_qos (c, argc, argv) : 1;
  if (strcmp (sub, "cluster") == 0)
    return wr_cli_bench_cluster (argc, argv); /* bench_cluster.c: needs no daemon */
  if (strcmp (sub, "-h") == 0 || strcmp (sub, "--help") == 0 || strcmp (sub, "help") == 0)
    {
      usage (stdout);
      return 0;
    }
  bool want_floor = strcmp (sub, "floor") == 0, want_create = strcmp (sub, "create") == 0,
       want_burst = strcmp (sub, "burst") == 0, want_exec = strcmp (sub, "exec") == 0,
       want_all = strcmp (sub, "all") == 0;
  if (!want_floor && !want_create && !want_burst && !want_exec && !want_all)
    {
      fprintf (stderr, "warren bench: unknown benchmark '%s'\n", sub);
      usage (stderr);
      return 2;
    }
  struct bench_opts o = {
    .count = 200, .floor_count = 200, .alt_count = 100, .concurrency = 4, .pool_timeout_s = 120
  };
  bool explicit_conc = false;
  int pr = parse_opts (argc, argv, &o, &explicit_conc);
  if (pr != 0)
    return pr > 0 ? 0 : 2;
  bench_quiet = o.quiet;
  if (want_create && o.burst)
    {
      want_create = false;
      want_burst = true;
    }
  if (want_burst && !o.burst)
    o.burst = 500;
  if (want_all && !o.burst)
    o.burst = 500;
  if ((want_burst || want_create || want_exec || want_all) && !c)
    {
      fprintf (stderr, "warren bench: no daemon client\n");
      return 1;
    }
  if (want_burst || want_create || want_exec || want_all)
    {
      /* Fail before spending seconds on the floors. */
      warren_error_t e;
      json_t *h = warren_healthz (c, &e);
      if (!h)
        {
          fprintf (stderr,
                   "warren bench: daemon at %s: %s (`warren bench floor` measures the references "
                   "alone)\n",
                   warren_client_host (c), e.message);
          return 1;
        }
      json_decref (h);
      warren_client_set_timeout (c, BENCH_REQUEST_TIMEOUT_MS);
    }

  /* Everything the floors write lives under one temp dir; their mounts live
   * only in the children's mount namespaces, so there is nothing to unmount. */
  const char *tmp = getenv ("TMPDIR");
  char workdir[4096];
  snprintf (workdir, sizeof workdir, "%s/warren-bench-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
  if (!mkdtemp (workdir))
    {
      fprintf (stderr, "warren bench: mkdtemp %s: %s\n", workdir, strerror (errno));
      return 1;
    }
  char rootfs[4200], scratch[4200];
  snprintf (scratch, sizeof scratch, "%s/scratch", workdir);
  int rc = 0;
  struct floors f;
  memset (&f, 0, sizeof f);
  wr_err_t err;
  if (mkdir (scratch, 0700) < 0)
    {
      fprintf (stderr, "warren bench: mkdir %s: %s\n", scratch, strerror (errno));
      rc = 1;
      goto out;
    }
  if (o.rootfs)
    {
      snprintf (rootfs, sizeof rootfs, "%s", o.rootfs);
      if (wr_bench_rootfs_check (rootfs, &err) < 0)
        {
          fprintf (stderr, "warren bench: %s\n", err.msg);
          rc = 1;
          goto out;
        }
    }
  else
    {
      snprintf (rootfs, sizeof rootfs, "%s/rootfs", workdir);
      if (wr_bench_rootfs_prepare (rootfs, &err) < 0)
        {
          fprintf (stderr, "warren bench: %s\n", err.msg);
          rc = 1;
          goto out;
        }
    }

  measure_floors (&o, rootfs, scratch, workdir, &f);
  int missed = 0;
  bool failed = false;
  /* `all` prints one document holding every report. */
  json_t *reports = json_array ();
  if (want_floor || want_all)
    {
      int floor_missed = 0;
      json_array_append_new (reports, report_floor (c, &f, &floor_missed));
      /* Floors have no targets; failing to measure them is a failure. */
      failed |= floor_missed > 0 && want_floor;
    }
  if (want_create || want_all)
    json_array_append_new (reports,
                           report_create (c, &o, &f, &missed, &failed, rootfs, scratch, workdir));
  if (want_burst || want_all)
    json_array_append_new (reports, report_burst (c, &o, &f, &missed, &failed));
  if (want_exec || want_all)
    {
      struct bench_opts oe = o;
      if (!explicit_conc)
        oe.concurrency = 1;
      json_array_append_new (reports, report_exec (c, &oe, &f, &missed, &failed));
    }
  json_t *doc;
  if (want_all)
    doc = json_pack ("{s:s, s:o, s:o}", "benchmark", "all", "reports", reports, "host",
                     host_entry (c));
  else
    {
      doc = json_incref (json_array_get (reports, 0));
      json_decref (reports);
    }
  if (emit (doc) < 0)
    failed = true;
  rc = failed ? 1 : (o.check && missed > 0) ? 3 : 0;
out:
  floors_free (&f);
  if (wr_rm_rf_at (AT_FDCWD, workdir) < 0)
    fprintf (stderr, "warren bench: could not remove %s\n", workdir);
  return rc;
}

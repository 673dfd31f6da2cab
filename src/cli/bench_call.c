/* `warren bench call`: fncall throughput and latency next to the
 * alternatives, all in the same run (docs/fncall.md, docs/performance.md):
 *   - a `true` command call and a Python `print(1+1)` call (fork and reuse)
 *     at several client concurrencies;
 *   - host posix_spawn + wait of the same binary, bwrap, a one-shot
 *     container sandbox per job (create + exec + delete through the API),
 *     and a fresh `python3 -c` per call on the host. */
#include "cli/bench.h"

#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/wait.h>
#include <fcntl.h>

#include "cli/bench_floor.h"
#include "common/util.h"

extern char **environ;

int wr_cli_bench_call (warren_client_t *c, int argc, char **argv);

struct call_opts
{
  size_t count;     /* calls per concurrency level */
  size_t alt_count; /* iterations of the slow alternatives */
  unsigned conc[8];
  size_t n_conc;
  unsigned pool_size;
  const char *image, *py_image;
  bool no_alt, quiet;
};

static void say (const struct call_opts *o, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));
static void
say (const struct call_opts *o, const char *fmt, ...)
{
  if (o->quiet)
    return;
  va_list ap;
  va_start (ap, fmt);
  fputs ("bench call: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
}

static json_t *
err_entry (const char *msg)
{
  return json_pack ("{s:s}", "error", msg);
}

/* ---- fncall at one concurrency ---- */

struct shared
{
  const char *host;
  json_t *req;
  size_t total;
  atomic_size_t next;
  double *lat;
  atomic_int failed;
  char err[300];
  pthread_mutex_t mu;
};

static void *
call_worker (void *arg)
{
  struct shared *s = arg;
  warren_error_t e;
  warren_client_t *c = warren_client_new (s->host, NULL, &e);
  if (c == NULL)
    {
      atomic_store (&s->failed, 1);
      return NULL;
    }
  for (;;)
    {
      size_t i = atomic_fetch_add (&s->next, 1);
      if (i >= s->total || atomic_load (&s->failed))
        break;
      uint64_t t0 = wr_now_ns ();
      json_t *r = warren_call (c, s->req, &e);
      uint64_t t1 = wr_now_ns ();
      int st = r ? warren_result_status (r) : -1;
      json_decref (r);
      if (st != 0)
        {
          pthread_mutex_lock (&s->mu);
          if (!s->err[0])
            snprintf (s->err, sizeof s->err, "%s", r ? "the call exited non-zero" : e.message);
          pthread_mutex_unlock (&s->mu);
          atomic_store (&s->failed, 1);
          break;
        }
      s->lat[i] = (double)(t1 - t0) / 1e6;
    }
  warren_client_free (c);
  return NULL;
}

static json_t *
run_calls (warren_client_t *c, json_t *req, size_t count, unsigned conc, wr_bench_stats_t *ret)
{
  struct shared s = { .host = warren_client_host (c), .req = req, .total = count };
  pthread_mutex_init (&s.mu, NULL);
  s.lat = calloc (count, sizeof *s.lat);
  pthread_t th[256];
  unsigned started = 0;
  uint64_t t0 = wr_now_ns ();
  for (unsigned i = 0; i < conc && i < 256; i++)
    if (pthread_create (&th[i], NULL, call_worker, &s) == 0)
      started++;
  for (unsigned i = 0; i < started; i++)
    pthread_join (th[i], NULL);
  double wall = (double)(wr_now_ns () - t0) / 1e9;
  json_t *out;
  if (atomic_load (&s.failed) || started == 0)
    out = err_entry (s.err[0] ? s.err : "a call failed");
  else
    {
      wr_bench_stats_compute (s.lat, count, wall, conc, ret);
      out = wr_bench_stats_json (ret);
    }
  free (s.lat);
  pthread_mutex_destroy (&s.mu);
  return out;
}

/* Warm the pool (size members, a few calls each) before measuring. */
static int
warm (warren_client_t *c, const char *image, const char *lang, unsigned size, json_t *req,
      char *msg, size_t msglen)
{
  warren_error_t e;
  json_t *body
      = json_pack ("{s:s,s:s,s:I}", "image", image, "lang", lang, "size", (json_int_t)size);
  /* the pool's isolation mode is its owner's to set (calls may only repeat it) */
  json_t *mode = json_object_get (req, "mode");
  if (json_is_string (mode))
    json_object_set (body, "mode", mode);
  json_t *r = NULL;
  if (warren_request (c, "PUT", "/v1/fncall/pools", body, &r, &e) < 0)
    {
      json_decref (body);
      snprintf (msg, msglen, "configure the pool: %s", e.message);
      return -1;
    }
  json_decref (body);
  json_decref (r);
  uint64_t deadline = wr_now_ms () + 60000;
  for (;;)
    {
      json_t *p = NULL;
      if (warren_request (c, "GET", "/v1/fncall/pools", NULL, &p, &e) < 0)
        {
          snprintf (msg, msglen, "%s", e.message);
          return -1;
        }
      size_t ready = 0, i;
      json_t *it;
      json_array_foreach (json_object_get (p, "pools"), i, it)
      {
        const char *img = json_string_value (json_object_get (it, "image"));
        const char *l = json_string_value (json_object_get (it, "lang"));
        if (img && l && strcmp (img, image) == 0 && strcmp (l, lang) == 0
            && json_integer_value (json_object_get (it, "memory_mb")) == 256)
          {
            size_t k;
            json_t *m;
            json_array_foreach (json_object_get (it, "members"), k, m) ready
                += strcmp (json_string_value (json_object_get (m, "state")) ?: "", "starting") != 0;
          }
      }
      json_decref (p);
      if (ready >= size)
        break;
      if (wr_now_ms () > deadline)
        {
          snprintf (msg, msglen, "pool %s (%s) not ready after 60 s", image, lang);
          return -1;
        }
      usleep (20000);
    }
  for (unsigned i = 0; i < size * 4; i++)
    {
      json_t *x = warren_call (c, req, &e);
      if (x == NULL)
        {
          snprintf (msg, msglen, "warm-up call: %s", e.message);
          return -1;
        }
      json_decref (x);
    }
  return 0;
}

/* {"c1": stats, "c2": stats, ...}; *best = highest rate; *p50_1/p99_1 at concurrency 1 */
static json_t *
sweep (warren_client_t *c, const struct call_opts *o, json_t *req, const char *what, double *best,
       double *p50_1, double *p99_1)
{
  json_t *j = json_object ();
  *best = 0;
  *p50_1 = *p99_1 = 0;
  for (size_t k = 0; k < o->n_conc; k++)
    {
      say (o, "fncall %s: %zu calls at concurrency %u", what, o->count, o->conc[k]);
      wr_bench_stats_t st;
      json_t *r = run_calls (c, req, o->count, o->conc[k], &st);
      char key[16];
      snprintf (key, sizeof key, "c%u", o->conc[k]);
      if (!json_object_get (r, "error"))
        {
          if (st.rate_per_s > *best)
            *best = st.rate_per_s;
          if (o->conc[k] == 1)
            {
              *p50_1 = st.p50_ms;
              *p99_1 = st.p99_ms;
            }
        }
      json_object_set_new (j, key, r);
    }
  return j;
}

/* ---- alternatives ---- */

/* posix_spawn + wait of argv with stdout/stderr on /dev/null, n times. */
static json_t *
host_spawn (char *const argv[], size_t n, wr_bench_stats_t *ret)
{
  double *lat = calloc (n, sizeof *lat);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init (&fa);
  posix_spawn_file_actions_addopen (&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen (&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen (&fa, 2, "/dev/null", O_WRONLY, 0);
  json_t *out = NULL;
  uint64_t start = 0;
  for (size_t i = 0; i < n + 3; i++)
    {
      if (i == 3)
        start = wr_now_ns ();
      uint64_t t0 = wr_now_ns ();
      pid_t pid;
      int st;
      if (posix_spawn (&pid, argv[0], &fa, NULL, argv, environ) != 0 || waitpid (pid, &st, 0) != pid
          || !WIFEXITED (st) || WEXITSTATUS (st) != 0)
        {
          out = err_entry ("spawn failed or exited non-zero");
          break;
        }
      if (i >= 3)
        lat[i - 3] = (double)(wr_now_ns () - t0) / 1e6;
    }
  if (out == NULL)
    {
      wr_bench_stats_compute (lat, n, (double)(wr_now_ns () - start) / 1e9, 1, ret);
      out = wr_bench_stats_json (ret);
    }
  posix_spawn_file_actions_destroy (&fa);
  free (lat);
  return out;
}

/* create + exec `true` + delete through the API, n times sequentially. */
static json_t *
oneshot (warren_client_t *c, const char *image, size_t n, wr_bench_stats_t *ret)
{
  double *lat = calloc (n, sizeof *lat);
  json_t *creq = json_pack ("{s:s}", "image", image);
  json_t *ex = json_pack ("{s:[s],s:i}", "cmd", "true", "timeout_s", 30);
  json_t *out = NULL;
  uint64_t start = wr_now_ns ();
  for (size_t i = 0; i < n; i++)
    {
      warren_error_t e;
      uint64_t t0 = wr_now_ns ();
      json_t *sb = warren_sandbox_create (c, creq, &e);
      if (sb == NULL)
        {
          out = err_entry (e.message);
          break;
        }
      char id[160];
      snprintf (id, sizeof id, "%s", json_string_value (json_object_get (sb, "id")) ?: "");
      json_decref (sb);
      json_t *r = warren_exec (c, id, ex, &e);
      int st = r ? warren_result_status (r) : -1;
      json_decref (r);
      warren_sandbox_delete (c, id, NULL);
      if (st != 0)
        {
          out = err_entry ("exec in the one-shot sandbox failed");
          break;
        }
      lat[i] = (double)(wr_now_ns () - t0) / 1e6;
    }
  if (out == NULL)
    {
      wr_bench_stats_compute (lat, n, (double)(wr_now_ns () - start) / 1e9, 1, ret);
      out = wr_bench_stats_json (ret);
    }
  json_decref (creq);
  json_decref (ex);
  free (lat);
  return out;
}

static json_t *
ratio (double a, double b)
{
  return a > 0 && b > 0 ? json_real (round (a / b * 100) / 100) : json_null ();
}

static json_t *
target (const char *what, double value, double want, const char *op)
{
  bool met = value > 0 && (strcmp (op, ">=") == 0 ? value >= want : value <= want);
  return json_pack ("{s:s,s:o,s:f,s:s,s:b}", "metric", what, "value",
                    value > 0 ? json_real (round (value * 100) / 100) : json_null (), "target",
                    want, "op", op, "met", met);
}

static void
usage_call (FILE *f)
{
  fputs ("usage: warren bench call [--count N] [--alt-count N] [--concurrency 1,2,4,8]\n"
         "                         [--pool-size N] [--image REF] [--python-image REF]\n"
         "                         [--no-alt] [--quiet]\n"
         "fncall calls/s and latency for `true` and Python print(1+1) (fork and reuse) next\n"
         "to host posix_spawn, bwrap, one-shot sandboxes and a fresh python3 -c per call.\n",
         f);
}

int
wr_cli_bench_call (warren_client_t *c, int argc, char **argv)
{
  struct call_opts o = { .count = 500,
                         .alt_count = 40,
                         .conc = { 1, 2, 4, 8 },
                         .n_conc = 4,
                         .pool_size = 4,
                         .image = "busybox:latest",
                         .py_image = "python:latest" };
  static const struct option opts[] = {
    { "count", required_argument, NULL, 'n' },
    { "alt-count", required_argument, NULL, 'a' },
    { "concurrency", required_argument, NULL, 'c' },
    { "pool-size", required_argument, NULL, 's' },
    { "image", required_argument, NULL, 'i' },
    { "python-image", required_argument, NULL, 'p' },
    { "no-alt", no_argument, NULL, 'N' },
    { "quiet", no_argument, NULL, 'q' },
    { "help", no_argument, NULL, 'h' },
    { 0 },
  };
  optind = 0;
  int opt;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    switch (opt)
      {
      case 'n':
        o.count = strtoul (optarg, NULL, 10);
        break;
      case 'a':
        o.alt_count = strtoul (optarg, NULL, 10);
        break;
      case 's':
        o.pool_size = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'c':
        {
          o.n_conc = 0;
          char buf[128];
          snprintf (buf, sizeof buf, "%s", optarg);
          char *save = NULL;
          for (char *t = strtok_r (buf, ",", &save); t && o.n_conc < 8;
               t = strtok_r (NULL, ",", &save))
            {
              unsigned v = (unsigned)strtoul (t, NULL, 10);
              if (v < 1 || v > 256)
                {
                  fprintf (stderr, "warren bench call: concurrency must be in [1, 256]\n");
                  return 2;
                }
              o.conc[o.n_conc++] = v;
            }
          break;
        }
      case 'i':
        o.image = optarg;
        break;
      case 'p':
        o.py_image = optarg;
        break;
      case 'N':
        o.no_alt = true;
        break;
      case 'q':
        o.quiet = true;
        break;
      case 'h':
        usage_call (stdout);
        return 0;
      default:
        usage_call (stderr);
        return 2;
      }
  if (o.count < 10 || o.count > 1000000 || o.n_conc == 0 || o.pool_size < 1 || o.pool_size > 64)
    {
      usage_call (stderr);
      return 2;
    }
  warren_client_set_timeout (c, 60000);
  json_t *rep = json_pack ("{s:s,s:I,s:I}", "benchmark", "call", "count", (json_int_t)o.count,
                           "pool_size", (json_int_t)o.pool_size);
  char msg[400];
  int status = 0;

  /* fncall `true` */
  json_t *treq = json_pack ("{s:s,s:[s]}", "image", o.image, "cmd", "true");
  double true_best = 0, true_p50 = 0, true_p99 = 0;
  say (&o, "warming the %s cmd pool (%u sandboxes)", o.image, o.pool_size);
  if (warm (c, o.image, "cmd", o.pool_size, treq, msg, sizeof msg) < 0)
    {
      json_object_set_new (rep, "fncall_true", err_entry (msg));
      status = 1;
    }
  else
    json_object_set_new (rep, "fncall_true",
                         sweep (c, &o, treq, "true", &true_best, &true_p50, &true_p99));

  /* fncall Python */
  double py_best[2] = { 0, 0 }, py_p50[2] = { 0, 0 }, py_p99[2] = { 0, 0 };
  static const char *modes[2] = { "fork", "reuse" };
  for (int m = 0; m < 2; m++)
    {
      json_t *preq = json_pack ("{s:s,s:s,s:s,s:s}", "image", o.py_image, "lang", "python", "code",
                                "print(1+1)", "mode", modes[m]);
      char key[32];
      snprintf (key, sizeof key, "fncall_python_%s", modes[m]);
      say (&o, "warming the %s python pool (%s)", o.py_image, modes[m]);
      if (warm (c, o.py_image, "python", o.pool_size, preq, msg, sizeof msg) < 0)
        {
          json_object_set_new (rep, key, err_entry (msg));
          status = 1;
        }
      else
        json_object_set_new (rep, key,
                             sweep (c, &o, preq, modes[m], &py_best[m], &py_p50[m], &py_p99[m]));
      json_decref (preq);
    }

  /* alternatives */
  double spawn_rate = 0, bwrap_rate = 0, oneshot_rate = 0, pyc_rate = 0;
  char tmpl[] = "/tmp/warren-bench-call-XXXXXX";
  const char *tmp = mkdtemp (tmpl);
  if (!o.no_alt && tmp)
    {
      char rootfs[256];
      snprintf (rootfs, sizeof rootfs, "%s/rootfs", tmp);
      wr_err_t err;
      wr_bench_stats_t st;
      if (wr_bench_rootfs_prepare (rootfs, &err) == 0)
        {
          char bb[300];
          snprintf (bb, sizeof bb, "%s/bin/busybox", rootfs);
          char *targv[] = { bb, "true", NULL };
          say (&o, "host posix_spawn + wait of busybox true (%zu)", o.count);
          json_t *j = host_spawn (targv, o.count, &st);
          if (!json_object_get (j, "error"))
            spawn_rate = st.rate_per_s;
          json_object_set_new (rep, "host_posix_spawn_true", j);
          size_t n = o.alt_count;
          double *lat = calloc (n, sizeof *lat);
          wr_bench_sample_t s = { .lat_ms = lat, .n = n };
          say (&o, "bwrap true (%zu)", n);
          if (wr_bench_bwrap (rootfs, &s, &err) == 0)
            {
              wr_bench_stats_compute (lat, n, s.wall_s, 1, &st);
              bwrap_rate = st.rate_per_s;
              json_object_set_new (rep, "bwrap_true", wr_bench_stats_json (&st));
            }
          else
            json_object_set_new (rep, "bwrap_true", err_entry (err.msg));
          free (lat);
        }
      else
        json_object_set_new (rep, "host_posix_spawn_true", err_entry (err.msg));
      say (&o, "one-shot container sandboxes: create + exec true + delete (%zu)", o.alt_count);
      json_t *j = oneshot (c, o.image, o.alt_count, &st);
      if (!json_object_get (j, "error"))
        oneshot_rate = st.rate_per_s;
      json_object_set_new (rep, "oneshot_sandbox_true", j);
      char *pyargv[] = { "/usr/bin/python3", "-c", "print(1+1)", NULL };
      if (access (pyargv[0], X_OK) == 0)
        {
          say (&o, "fresh python3 -c per call on the host (%zu)", o.alt_count);
          j = host_spawn (pyargv, o.alt_count, &st);
          if (!json_object_get (j, "error"))
            pyc_rate = st.rate_per_s;
          json_object_set_new (rep, "host_python3_c", j);
        }
      else
        json_object_set_new (rep, "host_python3_c", err_entry ("/usr/bin/python3 not found"));
      wr_rm_rf_at (AT_FDCWD, tmp);
    }

  json_object_set_new (rep, "ratios",
                       json_pack ("{s:o,s:o,s:o,s:o,s:o}", "true_vs_posix_spawn",
                                  ratio (true_best, spawn_rate), "true_vs_oneshot_sandbox",
                                  ratio (true_best, oneshot_rate), "true_vs_bwrap",
                                  ratio (true_best, bwrap_rate), "python_fork_vs_python3_c",
                                  ratio (py_best[0], pyc_rate), "python_reuse_vs_python3_c",
                                  ratio (py_best[1], pyc_rate)));
  json_t *targets = json_array ();
  json_array_append_new (targets, target ("fncall true calls/s / host posix_spawn calls/s",
                                          spawn_rate > 0 ? true_best / spawn_rate : 0, 0.8, ">="));
  json_array_append_new (targets,
                         target ("fncall true calls/s / one-shot sandbox calls/s",
                                 oneshot_rate > 0 ? true_best / oneshot_rate : 0, 2.0, ">="));
  json_array_append_new (targets, target ("python fork calls/s / python3 -c calls/s",
                                          pyc_rate > 0 ? py_best[0] / pyc_rate : 0, 10, ">="));
  json_array_append_new (targets, target ("python reuse calls/s", py_best[1], 5000, ">="));
  json_array_append_new (targets, target ("true p99/p50 at concurrency 1",
                                          true_p50 > 0 ? true_p99 / true_p50 : 0, 3, "<="));
  json_array_append_new (targets, target ("python fork p99/p50 at concurrency 1",
                                          py_p50[0] > 0 ? py_p99[0] / py_p50[0] : 0, 3, "<="));
  json_array_append_new (targets, target ("python reuse p99/p50 at concurrency 1",
                                          py_p50[1] > 0 ? py_p99[1] / py_p50[1] : 0, 3, "<="));
  json_object_set_new (rep, "targets", targets);
  json_decref (treq);
  char *text = json_dumps (rep, JSON_INDENT (2));
  json_decref (rep);
  if (text)
    {
      puts (text);
      free (text);
    }
  return status;
}

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

/* ---- measured runs, accumulated over blocks ---- */

#define MAX_BLOCKS 64

/* latencies of every run of one kind at one concurrency, and their wall time */
struct acc
{
  double *lat;
  size_t n, cap;
  double wall_s;
};

static void
acc_add (struct acc *a, const double *lat, size_t n, double wall_s)
{
  if (a->n + n > a->cap)
    {
      size_t cap = (a->n + n) * 2;
      double *v = realloc (a->lat, cap * sizeof *v);
      if (v == NULL)
        return;
      a->lat = v;
      a->cap = cap;
    }
  memcpy (a->lat + a->n, lat, n * sizeof *lat);
  a->n += n;
  a->wall_s += wall_s;
}

static json_t *
acc_json (struct acc *a, unsigned conc, wr_bench_stats_t *ret)
{
  wr_bench_stats_t st;
  wr_bench_stats_compute (a->lat, a->n, a->wall_s, conc, &st);
  if (ret)
    *ret = st;
  return wr_bench_stats_json (&st);
}

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* {"median","min","max"} of n values (sorted in place); *ret_median */
static json_t *
range_json (double *v, size_t n, double *ret_median)
{
  qsort (v, n, sizeof *v, cmp_double);
  *ret_median = n ? v[n / 2] : 0;
  if (n == 0)
    return json_null ();
  return json_pack ("{s:f,s:f,s:f}", "median", round (v[n / 2] * 100) / 100, "min",
                    round (v[0] * 100) / 100, "max", round (v[n - 1] * 100) / 100);
}

/* A reference's stats over all blocks and its rate per block (median and
 * range; blk itself stays in block order for the per-block ratios). */
static json_t *
ref_json (struct acc *a, const double *blk, size_t blocks, const char *why)
{
  if (a->n == 0)
    return err_entry (why);
  double v[MAX_BLOCKS], med;
  memcpy (v, blk, blocks * sizeof *v);
  json_t *j = acc_json (a, 1, NULL);
  json_object_set_new (j, "rate_per_block", range_json (v, blocks, &med));
  return j;
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

/* count calls at conc, added to *a; returns calls/s, or < 0 with msg set */
static double
run_calls (warren_client_t *c, json_t *req, size_t count, unsigned conc, struct acc *a, char *msg,
           size_t msglen)
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
  double wall = (double)(wr_now_ns () - t0) / 1e9, rate = -1;
  if (atomic_load (&s.failed) || started == 0)
    snprintf (msg, msglen, "%s", s.err[0] ? s.err : "a call failed");
  else
    {
      acc_add (a, s.lat, count, wall);
      rate = (double)count / wall;
    }
  free (s.lat);
  pthread_mutex_destroy (&s.mu);
  return rate;
}

/* Warm the pool (size members, a few calls each) before measuring. */
static int
warm (warren_client_t *c, const char *lang, unsigned size, json_t *req, char *msg, size_t msglen)
{
  warren_error_t e;
  const char *image = json_string_value (json_object_get (req, "image"));
  json_int_t mem = json_integer_value (json_object_get (req, "memory_mb"));
  json_t *body = json_pack ("{s:s,s:s,s:I,s:I}", "image", image, "lang", lang, "size",
                            (json_int_t)size, "memory_mb", mem);
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
            && json_integer_value (json_object_get (it, "memory_mb")) == mem)
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

/* ---- alternatives ---- */

/* posix_spawn + wait of argv with stdout/stderr on /dev/null, n times
 * (after 2 unmeasured), added to *a; returns spawns/s or < 0 */
static double
host_spawn (char *const argv[], size_t n, struct acc *a)
{
  double *lat = calloc (n, sizeof *lat);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init (&fa);
  posix_spawn_file_actions_addopen (&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen (&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen (&fa, 2, "/dev/null", O_WRONLY, 0);
  double rate = -1;
  uint64_t start = 0;
  size_t i;
  for (i = 0; i < n + 2; i++)
    {
      if (i == 2)
        start = wr_now_ns ();
      uint64_t t0 = wr_now_ns ();
      pid_t pid;
      int st;
      if (posix_spawn (&pid, argv[0], &fa, NULL, argv, environ) != 0 || waitpid (pid, &st, 0) != pid
          || !WIFEXITED (st) || WEXITSTATUS (st) != 0)
        break;
      if (i >= 2)
        lat[i - 2] = (double)(wr_now_ns () - t0) / 1e6;
    }
  if (i == n + 2)
    {
      double wall = (double)(wr_now_ns () - start) / 1e9;
      acc_add (a, lat, n, wall);
      rate = (double)n / wall;
    }
  posix_spawn_file_actions_destroy (&fa);
  free (lat);
  return rate;
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
         "                         [--blocks N] [--only true,fork,reuse] [--pool-size N]\n"
         "                         [--image REF] [--python-image REF] [--no-alt] [--quiet]\n"
         "fncall calls/s and latency for `true` and Python print(1+1) (fork and reuse),\n"
         "interleaved in --blocks short blocks with host posix_spawn and a fresh python3 -c\n"
         "(ratios: median and range over the blocks); then bwrap and one-shot sandboxes.\n",
         f);
}

enum kind_id
{
  K_TRUE,
  K_FORK,
  K_REUSE,
  N_KINDS,
};

struct kind
{
  const char *name, *key; /* --only name, report key */
  bool on;
  json_t *req;
  struct acc lv[8];        /* per concurrency level, over all blocks */
  double best[MAX_BLOCKS]; /* best calls/s over the levels, per block */
  char err[300];
};

/* One block of a kind: every concurrency level, count calls each. */
static void
kind_block (warren_client_t *c, const struct call_opts *o, struct kind *k, size_t b, size_t count)
{
  k->best[b] = 0;
  for (size_t i = 0; i < o->n_conc && !k->err[0]; i++)
    {
      double r = run_calls (c, k->req, count, o->conc[i], &k->lv[i], k->err, sizeof k->err);
      if (r > k->best[b])
        k->best[b] = r;
    }
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
  size_t blocks = 5;
  struct kind kinds[N_KINDS] = {
    [K_TRUE] = { .name = "true", .key = "fncall_true", .on = true },
    [K_FORK] = { .name = "fork", .key = "fncall_python_fork", .on = true },
    [K_REUSE] = { .name = "reuse", .key = "fncall_python_reuse", .on = true },
  };
  static const struct option opts[] = {
    { "count", required_argument, NULL, 'n' },
    { "alt-count", required_argument, NULL, 'a' },
    { "concurrency", required_argument, NULL, 'c' },
    { "blocks", required_argument, NULL, 'b' },
    { "only", required_argument, NULL, 'o' },
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
      case 'b':
        blocks = strtoul (optarg, NULL, 10);
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
      case 'o':
        {
          for (int k = 0; k < N_KINDS; k++)
            kinds[k].on = false;
          char buf[128];
          snprintf (buf, sizeof buf, "%s", optarg);
          char *save = NULL;
          for (char *t = strtok_r (buf, ",", &save); t; t = strtok_r (NULL, ",", &save))
            {
              int k = 0;
              while (k < N_KINDS && strcmp (t, kinds[k].name) != 0)
                k++;
              if (k == N_KINDS)
                {
                  fprintf (stderr, "warren bench call: --only takes true, fork, reuse\n");
                  return 2;
                }
              kinds[k].on = true;
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
  if (o.count < 10 || o.count > 1000000 || o.n_conc == 0 || o.pool_size < 1 || o.pool_size > 64
      || blocks < 1 || blocks > MAX_BLOCKS || o.alt_count < 1)
    {
      usage_call (stderr);
      return 2;
    }
  warren_client_set_timeout (c, 60000);
  json_t *rep = json_pack ("{s:s,s:I,s:I,s:I}", "benchmark", "call", "count", (json_int_t)o.count,
                           "blocks", (json_int_t)blocks, "pool_size", (json_int_t)o.pool_size);
  int status = 0;

  /* The reuse pool is keyed with 1 MB more than the fork pool (a pool is
   * (image, lang, memory)): both stay warm side by side, no mode switch and
   * no member rebuilt between blocks. */
  kinds[K_TRUE].req
      = json_pack ("{s:s,s:[s],s:i}", "image", o.image, "cmd", "true", "memory_mb", 256);
  kinds[K_FORK].req = json_pack ("{s:s,s:s,s:s,s:s,s:i}", "image", o.py_image, "lang", "python",
                                 "code", "print(1+1)", "mode", "fork", "memory_mb", 256);
  kinds[K_REUSE].req = json_pack ("{s:s,s:s,s:s,s:s,s:i}", "image", o.py_image, "lang", "python",
                                  "code", "print(1+1)", "mode", "reuse", "memory_mb", 257);
  for (int k = 0; k < N_KINDS; k++)
    if (kinds[k].on)
      {
        say (&o, "warming the %s pool (%u sandboxes)", kinds[k].name, o.pool_size);
        if (warm (c, k == K_TRUE ? "cmd" : "python", o.pool_size, kinds[k].req, kinds[k].err,
                  sizeof kinds[k].err)
            < 0)
          status = 1;
      }

  /* the references, measured between fncall runs in the same blocks */
  char tmpl[] = "/tmp/warren-bench-call-XXXXXX";
  const char *tmp = mkdtemp (tmpl);
  char rootfs[256] = "", bb[300] = "";
  wr_err_t err = { 0 };
  if (tmp)
    {
      snprintf (rootfs, sizeof rootfs, "%s/rootfs", tmp);
      if (wr_bench_rootfs_prepare (rootfs, &err) == 0)
        snprintf (bb, sizeof bb, "%s/bin/busybox", rootfs);
    }
  char *targv[] = { bb, "true", NULL };
  char *pyargv[] = { "/usr/bin/python3", "-c", "print(1+1)", NULL };
  bool have_py = access (pyargv[0], X_OK) == 0;
  struct acc spawn_acc = { 0 }, pyc_acc = { 0 };
  double spawn_blk[MAX_BLOCKS] = { 0 }, pyc_blk[MAX_BLOCKS] = { 0 };
  size_t per = o.count / blocks < 10 ? 10 : o.count / blocks;
  size_t alt_per = o.alt_count / blocks < 3 ? 3 : o.alt_count / blocks;
  for (size_t b = 0; b < blocks; b++)
    {
      say (&o, "block %zu/%zu: %zu calls per concurrency level", b + 1, blocks, per);
      /* alternate which side goes first, so that a slow spell does not
       * always land on the same one */
      for (int side = 0; side < 2; side++)
        {
          bool ref = (side == 0) == (b % 2 == 0);
          if (ref)
            {
              if (kinds[K_TRUE].on && bb[0])
                spawn_blk[b] = host_spawn (targv, per, &spawn_acc);
              if (kinds[K_FORK].on && have_py)
                pyc_blk[b] = host_spawn (pyargv, alt_per, &pyc_acc);
              continue;
            }
          for (int k = 0; k < N_KINDS; k++)
            {
              struct kind *kd = &kinds[k];
              if (!kd->on || kd->err[0])
                continue;
              kind_block (c, &o, kd, b, per);
              if (kd->err[0])
                status = 1;
            }
        }
    }

  /* per kind: stats per concurrency over all blocks; best rate per block */
  double med[N_KINDS] = { 0 }, p50_1[N_KINDS] = { 0 }, p99_1[N_KINDS] = { 0 };
  for (int k = 0; k < N_KINDS; k++)
    {
      struct kind *kd = &kinds[k];
      if (!kd->on)
        continue;
      if (kd->err[0])
        {
          json_object_set_new (rep, kd->key, err_entry (kd->err));
          continue;
        }
      json_t *j = json_object ();
      for (size_t i = 0; i < o.n_conc; i++)
        {
          char key[16];
          wr_bench_stats_t st;
          snprintf (key, sizeof key, "c%u", o.conc[i]);
          json_object_set_new (j, key, acc_json (&kd->lv[i], o.conc[i], &st));
          if (o.conc[i] == 1)
            p50_1[k] = st.p50_ms, p99_1[k] = st.p99_ms;
        }
      double v[MAX_BLOCKS];
      memcpy (v, kd->best, blocks * sizeof *v);
      json_object_set_new (j, "best_rate_per_block", range_json (v, blocks, &med[k]));
      json_object_set_new (rep, kd->key, j);
    }
  if (kinds[K_TRUE].on)
    json_object_set_new (rep, "host_posix_spawn_true",
                         ref_json (&spawn_acc, spawn_blk, blocks,
                                   err.msg[0] ? err.msg : "spawn failed or exited non-zero"));
  if (kinds[K_FORK].on)
    json_object_set_new (rep, "host_python3_c",
                         ref_json (&pyc_acc, pyc_blk, blocks,
                                   have_py ? "python3 -c failed" : "/usr/bin/python3 not found"));

  /* ratios per block: median and range */
  double r_true[MAX_BLOCKS], r_fork[MAX_BLOCKS], r_true_med = 0, r_fork_med = 0;
  size_t n_true = 0, n_fork = 0;
  json_t *per_block = json_array ();
  for (size_t b = 0; b < blocks; b++)
    {
      /* what each ratio of this block was computed from (calls/s) */
      json_t *jb = json_object ();
      static const char *ref_names[N_KINDS] = { "posix_spawn", "python3_c", NULL };
      double *refs[N_KINDS] = { spawn_blk, pyc_blk, NULL };
      for (int k = 0; k < N_KINDS; k++)
        if (kinds[k].on)
          {
            json_object_set_new (jb, kinds[k].name, json_real (round (kinds[k].best[b])));
            if (ref_names[k])
              json_object_set_new (jb, ref_names[k], json_real (round (refs[k][b] * 10) / 10));
          }
      json_array_append_new (per_block, jb);
      if (kinds[K_TRUE].best[b] > 0 && spawn_blk[b] > 0)
        r_true[n_true++] = kinds[K_TRUE].best[b] / spawn_blk[b];
      if (kinds[K_FORK].best[b] > 0 && pyc_blk[b] > 0)
        r_fork[n_fork++] = kinds[K_FORK].best[b] / pyc_blk[b];
    }
  json_object_set_new (rep, "per_block", per_block);
  json_t *ratios = json_object ();
  json_object_set_new (ratios, "true_vs_posix_spawn", range_json (r_true, n_true, &r_true_med));
  json_object_set_new (ratios, "python_fork_vs_python3_c",
                       range_json (r_fork, n_fork, &r_fork_med));

  /* the slow alternatives, once, after the blocks */
  double bwrap_rate = 0, oneshot_rate = 0;
  if (!o.no_alt && kinds[K_TRUE].on)
    {
      wr_bench_stats_t st;
      if (bb[0])
        {
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
      say (&o, "one-shot container sandboxes: create + exec true + delete (%zu)", o.alt_count);
      json_t *j = oneshot (c, o.image, o.alt_count, &st);
      if (!json_object_get (j, "error"))
        oneshot_rate = st.rate_per_s;
      json_object_set_new (rep, "oneshot_sandbox_true", j);
      json_object_set_new (ratios, "true_vs_oneshot_sandbox", ratio (med[K_TRUE], oneshot_rate));
      json_object_set_new (ratios, "true_vs_bwrap", ratio (med[K_TRUE], bwrap_rate));
    }
  if (tmp)
    wr_rm_rf_at (AT_FDCWD, tmp);
  json_object_set_new (rep, "ratios", ratios);

  json_t *targets = json_array ();
  if (kinds[K_TRUE].on)
    {
      json_array_append_new (targets,
                             target ("fncall true calls/s / host posix_spawn calls/s (median of "
                                     "per-block ratios)",
                                     r_true_med, 0.8, ">="));
      if (!o.no_alt)
        json_array_append_new (targets, target ("fncall true calls/s / one-shot sandbox calls/s",
                                                oneshot_rate > 0 ? med[K_TRUE] / oneshot_rate : 0,
                                                2.0, ">="));
    }
  if (kinds[K_FORK].on)
    json_array_append_new (targets, target ("python fork calls/s / python3 -c calls/s (median of "
                                            "per-block ratios)",
                                            r_fork_med, 10, ">="));
  if (kinds[K_REUSE].on)
    json_array_append_new (targets, target ("python reuse calls/s (median of per-block best)",
                                            med[K_REUSE], 5000, ">="));
  static const char *p_names[N_KINDS]
      = { "true p99/p50 at concurrency 1", "python fork p99/p50 at concurrency 1",
          "python reuse p99/p50 at concurrency 1" };
  for (int k = 0; k < N_KINDS; k++)
    if (kinds[k].on)
      json_array_append_new (targets,
                             target (p_names[k], p50_1[k] > 0 ? p99_1[k] / p50_1[k] : 0, 3, "<="));
  json_object_set_new (rep, "targets", targets);
  for (int k = 0; k < N_KINDS; k++)
    {
      json_decref (kinds[k].req);
      for (size_t i = 0; i < o.n_conc; i++)
        free (kinds[k].lv[i].lat);
    }
  free (spawn_acc.lat);
  free (pyc_acc.lat);
  char *text = json_dumps (rep, JSON_INDENT (2));
  json_decref (rep);
  if (text)
    {
      puts (text);
      free (text);
    }
  return status;
}

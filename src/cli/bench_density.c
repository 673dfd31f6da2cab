/* `warren bench density` (docs/performance.md, "Density"): N idle sandboxes
 * created and destroyed at a fixed concurrency. Reports each phase's rate
 * per 10% bucket (a cost that grows with the number alive shows as a
 * falling rate), host memory and kernel slab per sandbox (MemAvailable and
 * Slab of this host's /proc/meminfo: run it on the node), and exec p99 on
 * a random 200 of them against the p99 on an empty node. */
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <warren/warren.h>

#define BUCKETS 10

static double
now_s (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static long long
meminfo_kb (const char *field)
{
  FILE *f = fopen ("/proc/meminfo", "re");
  if (f == NULL)
    return -1;
  char line[256];
  long long v = -1;
  size_t lf = strlen (field);
  while (fgets (line, sizeof line, f))
    if (strncmp (line, field, lf) == 0 && line[lf] == ':')
      {
        v = strtoll (line + lf + 1, NULL, 10);
        break;
      }
  fclose (f);
  return v;
}

struct phase
{
  const char *what; /* "create" | "destroy" */
  const char *host;
  const char *image;
  unsigned memory_mb;
  unsigned n, concurrency;
  char **ids;
  double *done_at; /* completion times, in completion order */
  unsigned next, done, failed, refused;
  char first_error[512];
  double t0;
  pthread_mutex_t lock;
};

static void *
phase_worker (void *arg)
{
  struct phase *p = arg;
  warren_error_t e;
  warren_client_t *c = warren_client_new (p->host, NULL, &e);
  if (c == NULL)
    return NULL;
  bool create = strcmp (p->what, "create") == 0;
  for (;;)
    {
      unsigned i = __atomic_fetch_add (&p->next, 1, __ATOMIC_RELAXED);
      if (i >= p->n)
        break;
      bool ok;
      if (create)
        {
          json_t *req = json_pack ("{s:I}", "memory_mb", (json_int_t)p->memory_mb);
          if (p->image)
            json_object_set_new (req, "image", json_string (p->image));
          json_t *sb = warren_sandbox_create (c, req, &e);
          json_decref (req);
          ok = sb != NULL;
          if (ok)
            p->ids[i] = strdup (json_string_value (json_object_get (sb, "id")));
          json_decref (sb);
        }
      else
        ok = p->ids[i] == NULL || warren_sandbox_delete (c, p->ids[i], &e) == 0;
      pthread_mutex_lock (&p->lock);
      if (ok)
        {
          p->done_at[p->done++] = now_s ();
          if (p->done % (p->n / BUCKETS ? p->n / BUCKETS : 1) == 0)
            fprintf (stderr, "density: %s %u/%u (%.0f/s)\n", p->what, p->done, p->n,
                     p->done / (now_s () - p->t0));
        }
      else
        {
          p->failed++;
          if (strcmp (e.code, WARREN_E_EXHAUSTED) == 0)
            p->refused++;
          if (p->first_error[0] == '\0')
            snprintf (p->first_error, sizeof p->first_error, "%s: %s", e.code, e.message);
        }
      pthread_mutex_unlock (&p->lock);
    }
  warren_client_free (c);
  return NULL;
}

/* run the phase; its report: rate overall and per 10% of the completions */
static json_t *
phase_run (struct phase *p)
{
  pthread_mutex_init (&p->lock, NULL);
  p->next = p->done = p->failed = p->refused = 0;
  p->first_error[0] = '\0';
  p->t0 = now_s ();
  pthread_t th[256];
  unsigned nt = p->concurrency;
  for (unsigned k = 0; k < nt; k++)
    if (pthread_create (&th[k], NULL, phase_worker, p) != 0)
      nt = k;
  for (unsigned k = 0; k < nt; k++)
    pthread_join (th[k], NULL);
  double total = now_s () - p->t0;
  pthread_mutex_destroy (&p->lock);
  json_t *buckets = json_array ();
  double prev = p->t0, first = 0, last = 0;
  for (unsigned b = 0; b < BUCKETS && p->done >= BUCKETS; b++)
    {
      unsigned lo = p->done * b / BUCKETS, hi = p->done * (b + 1) / BUCKETS;
      double end = p->done_at[hi - 1];
      double rate = end > prev ? (double)(hi - lo) / (end - prev) : 0;
      json_array_append_new (buckets, json_real (rate));
      if (b == 0)
        first = rate;
      last = rate;
      prev = end;
    }
  json_t *r = json_pack ("{s:I,s:I,s:I,s:f,s:f,s:o}", "ok", (json_int_t)p->done, "failed",
                         (json_int_t)p->failed, "refused_429", (json_int_t)p->refused, "rate_per_s",
                         total > 0 ? p->done / total : 0.0, "seconds", total, "rate_per_s_by_10pct",
                         buckets);
  json_object_set_new (r, "last_over_first", json_real (first > 0 ? last / first : 0));
  if (p->first_error[0])
    json_object_set_new (r, "first_error", json_string (p->first_error));
  return r;
}

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* the p99 of t[0..got), which it frees */
static double
p99_free (double *t, unsigned got)
{
  double p = 0;
  if (got)
    {
      qsort (t, got, sizeof *t, cmp_double);
      p = t[(size_t)((got - 1) * 0.99)];
    }
  free (t);
  return p;
}

/* one exec of req in id: its time in ms appended to t when it succeeds */
static void
time_exec (warren_client_t *c, const char *id, json_t *req, double *t, unsigned *got)
{
  warren_error_t e;
  double t0 = now_s ();
  json_t *r = warren_exec (c, id, req, &e);
  if (r)
    t[(*got)++] = (now_s () - t0) * 1e3;
  json_decref (r);
}

/* p99 in ms of `true` execs on ids chosen at random among n */
static double
exec_p99_ms (warren_client_t *c, char **ids, unsigned n, unsigned samples)
{
  double *t = calloc (samples, sizeof *t);
  unsigned got = 0;
  json_t *req = json_pack ("{s:[s]}", "cmd", "true");
  for (unsigned k = 0; k < samples && t; k++)
    {
      const char *id = ids[(unsigned)random () % n];
      if (id == NULL)
        continue;
      time_exec (c, id, req, t, &got);
    }
  json_decref (req);
  return p99_free (t, got);
}

/* p99 in ms of the first `true` exec in each of `samples` fresh sandboxes,
 * made and destroyed one at a time: the empty-node baseline for execs on a
 * random few of many (each of those is a first exec too: a sandbox's first
 * exec pays its cold caches, its agent's copy-on-write faults, the first
 * lookups in its root) */
static double
first_exec_p99_ms (warren_client_t *c, const json_t *create_req, unsigned samples)
{
  double *t = calloc (samples, sizeof *t);
  unsigned got = 0;
  json_t *req = json_pack ("{s:[s]}", "cmd", "true");
  for (unsigned k = 0; k < samples && t; k++)
    {
      warren_error_t e;
      json_t *sb = warren_sandbox_create (c, (json_t *)create_req, &e);
      if (sb == NULL)
        break;
      const char *id = json_string_value (json_object_get (sb, "id"));
      time_exec (c, id, req, t, &got);
      warren_sandbox_delete (c, id, NULL);
      json_decref (sb);
    }
  json_decref (req);
  return p99_free (t, got);
}

static void
usage_density (FILE *f)
{
  fprintf (f, "Usage: warren bench density [-n N] [-c CONCURRENCY] [--memory MB] [--image REF]\n"
              "                            [--exec-samples K] [--json]\n"
              "Create N idle sandboxes (default 2000, 64 MB, 16 at a time), measure host memory\n"
              "and slab per sandbox (run it on the node) and exec p99 on a random K of them\n"
              "against an empty node, then destroy them; rates per 10%% bucket. JSON on stdout,\n"
              "progress on stderr.\n");
}

int wr_cli_bench_density (warren_client_t *c, int argc, char **argv);

int
wr_cli_bench_density (warren_client_t *c, int argc, char **argv)
{
  struct phase p = { .n = 2000, .concurrency = 16, .memory_mb = 64 };
  unsigned samples = 200;
  static const struct option opts[] = {
    { "count", required_argument, NULL, 'n' },
    { "concurrency", required_argument, NULL, 'c' },
    { "memory", required_argument, NULL, 'm' },
    { "image", required_argument, NULL, 'i' },
    { "exec-samples", required_argument, NULL, 'e' },
    { "json", no_argument, NULL, 'j' },
    { "help", no_argument, NULL, 'h' },
    { 0 },
  };
  optind = 0;
  int opt;
  while ((opt = getopt_long (argc, argv, "+hn:c:", opts, NULL)) != -1)
    switch (opt)
      {
      case 'n':
        p.n = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'c':
        p.concurrency = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'm':
        p.memory_mb = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'i':
        p.image = optarg;
        break;
      case 'e':
        samples = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'j': /* the report is JSON either way */
        break;
      case 'h':
        usage_density (stdout);
        return 0;
      default:
        usage_density (stderr);
        return 2;
      }
  if (p.n < BUCKETS || p.n > 1000000 || p.concurrency < 1 || p.concurrency > 256 || samples < 1
      || samples > 100000)
    {
      fprintf (stderr, "warren bench density: -n in [10, 1000000], -c in [1, 256], "
                       "--exec-samples in [1, 100000]\n");
      return 2;
    }
  p.host = warren_client_host (c);
  srandom ((unsigned)getpid ());
  /* exec p99 on an empty node: one sandbox */
  warren_error_t e;
  json_t *req = json_pack ("{s:I}", "memory_mb", (json_int_t)p.memory_mb);
  if (p.image)
    json_object_set_new (req, "image", json_string (p.image));
  json_t *one = warren_sandbox_create (c, req, &e);
  if (one == NULL)
    {
      fprintf (stderr, "warren bench density: create: %s\n", e.message);
      json_decref (req);
      return 1;
    }
  char *one_id = strdup (json_string_value (json_object_get (one, "id")));
  json_decref (one);
  fprintf (stderr, "density: exec p99 on an empty node (%u execs)\n", samples);
  double p99_empty = exec_p99_ms (c, &one_id, 1, samples);
  warren_sandbox_delete (c, one_id, NULL);
  free (one_id);
  fprintf (stderr, "density: first exec p99 in %u fresh sandboxes on an empty node\n", samples);
  double p99_empty_first = first_exec_p99_ms (c, req, samples);
  json_decref (req);
  sleep (1); /* let the kernel finish that teardown before the baseline */
  long long avail0 = meminfo_kb ("MemAvailable"), slab0 = meminfo_kb ("Slab");
  p.ids = calloc (p.n, sizeof *p.ids);
  p.done_at = calloc (p.n, sizeof *p.done_at);
  if (p.ids == NULL || p.done_at == NULL)
    return 1;
  p.what = "create";
  json_t *created = phase_run (&p);
  unsigned alive = p.done;
  sleep (1);
  long long avail1 = meminfo_kb ("MemAvailable"), slab1 = meminfo_kb ("Slab");
  /* compact the ids of the live ones for sampling */
  char **live = calloc (p.n, sizeof *live);
  unsigned nl = 0;
  for (unsigned k = 0; k < p.n; k++)
    if (p.ids[k])
      live[nl++] = p.ids[k];
  fprintf (stderr, "density: exec p99 on a random %u of %u alive\n", samples, nl);
  double p99_loaded = nl ? exec_p99_ms (c, live, nl, samples) : 0;
  /* the empty node's measure with this many alive: one sandbox, warm */
  fprintf (stderr, "density: exec p99 on one of %u alive\n", nl);
  double p99_warm = nl ? exec_p99_ms (c, live, 1, samples) : 0;
  free (live);
  p.what = "destroy";
  json_t *destroyed = phase_run (&p);
  for (unsigned k = 0; k < p.n; k++)
    free (p.ids[k]);
  free (p.ids);
  free (p.done_at);
  json_t *report
      = json_pack ("{s:s,s:I,s:I,s:I,s:I,s:o,s:o}", "bench", "density", "n", (json_int_t)p.n,
                   "alive", (json_int_t)alive, "concurrency", (json_int_t)p.concurrency,
                   "memory_mb", (json_int_t)p.memory_mb, "create", created, "destroy", destroyed);
  if (alive && avail0 > 0 && avail1 > 0)
    json_object_set_new (report, "host_kib_per_sandbox",
                         json_real ((double)(avail0 - avail1) / alive));
  if (alive && slab0 > 0 && slab1 > 0)
    json_object_set_new (report, "slab_kib_per_sandbox",
                         json_real ((double)(slab1 - slab0) / alive));
  json_object_set_new (report, "exec_p99_ms",
                       json_pack ("{s:f,s:f,s:f,s:f,s:f}", "empty_node", p99_empty, "alive",
                                  p99_loaded, "ratio", p99_empty > 0 ? p99_loaded / p99_empty : 0.0,
                                  "empty_node_first_exec", p99_empty_first, "ratio_first_exec",
                                  p99_empty_first > 0 ? p99_loaded / p99_empty_first : 0.0));
  json_t *x = json_object_get (report, "exec_p99_ms");
  json_object_set_new (x, "alive_one_warm", json_real (p99_warm));
  json_object_set_new (x, "ratio_one_warm", json_real (p99_empty > 0 ? p99_warm / p99_empty : 0.0));
  char *s = json_dumps (report, JSON_INDENT (2) | JSON_REAL_PRECISION (4));
  printf ("%s\n", s);
  free (s);
  json_decref (report);
  return alive == p.n ? 0 : 1;
}

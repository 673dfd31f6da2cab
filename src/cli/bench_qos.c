/* `warren bench qos` (docs/performance.md, "CPU QoS"): exec p99 in a
 * latency sandbox on a quiet node against the same while B best-effort
 * sandboxes (default 50) burn CPU, one busy loop each. The burners are
 * started once and then stopped and continued (SIGSTOP/SIGCONT through an
 * exec) between phases, so quiet and loaded phases interleave over R
 * rounds and drift on the node (other work, caches) falls on both alike.
 * --control also measures B latency-class burners the same way: what the
 * QoS class buys. Each phase also reports burners_cpus, the CPUs' worth
 * the burners used while it was measured. JSON on stdout, progress on
 * stderr. */
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <warren/warren.h>

#include "cli/bench.h"
#include "cli/bench_floor.h"
#include "common/util.h"

struct qos_run
{
  warren_client_t *c;
  const char *image;
  unsigned burners, rounds, samples; /* samples per phase per round */
  char **ids;                        /* burners' sandboxes */
  unsigned n_ids;
  char err[512];
};

static char *
create_one (struct qos_run *q, const char *qos)
{
  warren_error_t e;
  json_t *req = json_pack ("{s:s,s:I}", "qos", qos, "memory_mb", (json_int_t)64);
  if (q->image)
    json_object_set_new (req, "image", json_string (q->image));
  json_t *sb = warren_sandbox_create (q->c, req, &e);
  json_decref (req);
  if (sb == NULL)
    {
      snprintf (q->err, sizeof q->err, "create (%s): %s", qos, e.message);
      return NULL;
    }
  char *id = strdup (json_string_value (json_object_get (sb, "id")));
  json_decref (sb);
  return id;
}

static int
sh (struct qos_run *q, const char *id, const char *cmd)
{
  warren_error_t e;
  json_t *req = json_pack ("{s:s}", "shell", cmd);
  json_t *r = warren_exec (q->c, id, req, &e);
  json_decref (req);
  int rc = r ? (int)json_integer_value (json_object_get (r, "exit_code")) : -1;
  if (r == NULL)
    snprintf (q->err, sizeof q->err, "exec: %s", e.message);
  json_decref (r);
  return rc;
}

/* One switcher thread: burners next, next+1, ... each with its own client. */
struct burn_job
{
  struct qos_run *q;
  const char *cmd;
  atomic_uint next;
  atomic_bool failed;
  pthread_mutex_t mu;
};

static void *
burn_worker (void *arg)
{
  struct burn_job *j = arg;
  warren_error_t e;
  warren_client_t *c = warren_client_new (warren_client_host (j->q->c), NULL, &e);
  json_t *req = json_pack ("{s:s}", "shell", j->cmd);
  if (c == NULL)
    atomic_store (&j->failed, true);
  for (unsigned k;
       c && !atomic_load (&j->failed) && (k = atomic_fetch_add (&j->next, 1)) < j->q->n_ids;)
    {
      json_t *r = warren_exec (c, j->q->ids[k], req, &e);
      if (r == NULL || json_integer_value (json_object_get (r, "exit_code")) != 0)
        {
          pthread_mutex_lock (&j->mu);
          snprintf (j->q->err, sizeof j->q->err, "burner switch: %s",
                    r ? "non-zero exit" : e.message);
          pthread_mutex_unlock (&j->mu);
          atomic_store (&j->failed, true);
        }
      json_decref (r);
    }
  json_decref (req);
  warren_client_free (c);
  return NULL;
}

/* every burner stopped (quiet) or running (loaded). In parallel: a
 * best-effort sandbox's agent runs idle-class, and on a busy host each
 * switch exec waits for idle CPU; one after another they took minutes. */
static int
burn (struct qos_run *q, bool on)
{
  struct burn_job j
      = { .q = q,
          .cmd = on ? "kill -CONT $(cat /tmp/burn.pid)" : "kill -STOP $(cat /tmp/burn.pid)" };
  pthread_mutex_init (&j.mu, NULL);
  pthread_t th[16];
  unsigned n = 0;
  for (unsigned i = 0; i < WR_ARRAY_SIZE (th) && i < q->n_ids; i++)
    if (pthread_create (&th[i], NULL, burn_worker, &j) == 0)
      n++;
  for (unsigned i = 0; i < n; i++)
    pthread_join (th[i], NULL);
  pthread_mutex_destroy (&j.mu);
  return n == 0 || atomic_load (&j.failed) ? -1 : 0;
}

/* the burners' CPU time so far (cgroup usage through the API), seconds */
static double
burners_cpu_s (struct qos_run *q)
{
  double t = 0;
  for (unsigned k = 0; k < q->n_ids; k++)
    {
      warren_error_t e;
      json_t *sb = warren_sandbox_get (q->c, q->ids[k], &e);
      t += (double)json_integer_value (
               json_object_get (json_object_get (sb, "usage"), "cpu_usage_ns"))
           / 1e9;
      json_decref (sb);
    }
  return t;
}

/* samples `true` execs into id, latencies appended to lat */
static int
measure (struct qos_run *q, const char *id, double *lat, size_t *n)
{
  json_t *req = json_pack ("{s:[s]}", "cmd", "true");
  int r = 0;
  for (unsigned k = 0; k < q->samples && r == 0; k++)
    {
      warren_error_t e;
      uint64_t t0 = wr_now_ns ();
      json_t *out = warren_exec (q->c, id, req, &e);
      if (out == NULL)
        {
          snprintf (q->err, sizeof q->err, "exec: %s", e.message);
          r = -1;
        }
      else
        lat[(*n)++] = (double)(wr_now_ns () - t0) / 1e6;
      json_decref (out);
    }
  json_decref (req);
  return r;
}

static void
drop_burners (struct qos_run *q)
{
  for (unsigned k = 0; k < q->n_ids; k++)
    {
      warren_sandbox_delete (q->c, q->ids[k], NULL);
      free (q->ids[k]);
    }
  q->n_ids = 0;
}

/* the latency figures only: execs are sequential, a rate means nothing */
static json_t *
latency_json (const wr_bench_stats_t *s)
{
  json_t *j = wr_bench_stats_json (s);
  json_object_del (j, "rate_per_s");
  json_object_del (j, "wall_s");
  json_object_del (j, "concurrency");
  return j;
}

/* quiet vs loaded with burners of class qos: {"quiet":{stats},"loaded":{stats},"p99_ratio"} */
static json_t *
scenario (struct qos_run *q, const char *lat_id, const char *qos)
{
  for (unsigned k = 0; k < q->burners; k++)
    {
      char *id = create_one (q, qos);
      if (id == NULL)
        return NULL;
      q->ids[q->n_ids++] = id;
      /* the loop's pid kept for SIGSTOP/SIGCONT; it starts stopped */
      if (sh (q, id,
              "sh -c 'kill -STOP $$; while :; do :; done' >/dev/null 2>&1 & "
              "echo $! > /tmp/burn.pid")
          != 0)
        return NULL;
      if ((k + 1) % 10 == 0)
        fprintf (stderr, "qos: %u/%u %s burners\n", k + 1, q->burners, qos);
    }
  size_t cap = (size_t)q->rounds * q->samples, nq = 0, nl = 0;
  _cleanup_free_ double *quiet = calloc (cap, sizeof (double));
  _cleanup_free_ double *loaded = calloc (cap, sizeof (double));
  if (quiet == NULL || loaded == NULL)
    return NULL;
  /* what the burners used while each phase was measured: ~0 quiet; loaded,
   * whatever CPU the host leaves idle (their class takes no more) */
  double cpu[2] = { 0, 0 }, wall[2] = { 0, 0 };
  for (unsigned r = 0; r < q->rounds; r++)
    {
      fprintf (stderr, "qos: %s round %u/%u\n", qos, r + 1, q->rounds);
      for (int on = 0; on < 2; on++)
        {
          if (burn (q, on) < 0)
            return NULL;
          double c0 = burners_cpu_s (q);
          uint64_t t0 = wr_now_ns ();
          if (measure (q, lat_id, on ? loaded : quiet, on ? &nl : &nq) < 0)
            return NULL;
          wall[on] += (double)(wr_now_ns () - t0) / 1e9;
          cpu[on] += burners_cpu_s (q) - c0;
        }
    }
  burn (q, false);
  wr_bench_stats_t sq, sl;
  wr_bench_stats_compute (quiet, nq, 1, 1, &sq);
  wr_bench_stats_compute (loaded, nl, 1, 1, &sl);
  json_t *jq = latency_json (&sq), *jl = latency_json (&sl);
  json_object_set_new (jq, "burners_cpus", json_real (wall[0] > 0 ? cpu[0] / wall[0] : 0));
  json_object_set_new (jl, "burners_cpus", json_real (wall[1] > 0 ? cpu[1] / wall[1] : 0));
  return json_pack ("{s:s,s:I,s:o,s:o,s:f}", "burners_qos", qos, "burners", (json_int_t)q->burners,
                    "quiet", jq, "loaded", jl, "p99_ratio",
                    sq.p99_ms > 0 ? sl.p99_ms / sq.p99_ms : 0.0);
}

static void
usage_qos (FILE *f)
{
  fprintf (f, "Usage: warren bench qos [-b BURNERS] [-r ROUNDS] [-n SAMPLES] [--control]\n"
              "                        [--image REF]\n"
              "exec p99 in a latency sandbox, quiet vs while BURNERS (default 50) best-effort\n"
              "sandboxes burn CPU, interleaved over ROUNDS (default 4) of SAMPLES (default 100)\n"
              "execs per phase. --control: the same with latency-class burners. JSON on stdout,\n"
              "progress on stderr. Target (issue 13): p99 ratio <= 1.5.\n");
}

int
wr_cli_bench_qos (warren_client_t *c, int argc, char **argv)
{
  struct qos_run q = { .c = c, .burners = 50, .rounds = 4, .samples = 100 };
  bool control = false;
  static const struct option opts[] = {
    { "burners", required_argument, NULL, 'b' }, { "rounds", required_argument, NULL, 'r' },
    { "samples", required_argument, NULL, 'n' }, { "control", no_argument, NULL, 'C' },
    { "image", required_argument, NULL, 'i' },   { "json", no_argument, NULL, 'j' },
    { "help", no_argument, NULL, 'h' },          { 0 },
  };
  optind = 0;
  int opt;
  while ((opt = getopt_long (argc, argv, "+hb:r:n:", opts, NULL)) != -1)
    switch (opt)
      {
      case 'b':
        q.burners = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'r':
        q.rounds = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'n':
        q.samples = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'C':
        control = true;
        break;
      case 'i':
        q.image = optarg;
        break;
      case 'j': /* the report is JSON either way */
        break;
      case 'h':
        usage_qos (stdout);
        return 0;
      default:
        usage_qos (stderr);
        return 2;
      }
  if (q.burners < 1 || q.burners > 10000 || q.rounds < 1 || q.rounds > 1000 || q.samples < 1
      || q.samples > 100000)
    {
      fprintf (stderr, "warren bench qos: -b in [1, 10000], -r in [1, 1000], -n in [1, 100000]\n");
      return 2;
    }
  _cleanup_free_ char **ids = calloc (q.burners, sizeof *ids);
  if (ids == NULL)
    return 1;
  q.ids = ids;
  _cleanup_free_ char *lat = create_one (&q, "latency");
  json_t *report = json_pack ("{s:s}", "bench", "qos");
  int rc = 1;
  if (lat)
    {
      json_t *be = scenario (&q, lat, "best-effort");
      drop_burners (&q);
      if (be)
        {
          json_object_set_new (report, "best_effort", be);
          rc = 0;
        }
      if (be && control)
        {
          json_t *ctl = scenario (&q, lat, "latency");
          drop_burners (&q);
          if (ctl)
            json_object_set_new (report, "control_latency_burners", ctl);
          else
            rc = 1;
        }
      warren_sandbox_delete (c, lat, NULL);
    }
  if (q.err[0])
    json_object_set_new (report, "error", json_string (q.err));
  char *s = json_dumps (report, JSON_INDENT (2) | JSON_REAL_PRECISION (4));
  printf ("%s\n", s);
  free (s);
  json_decref (report);
  return rc;
}

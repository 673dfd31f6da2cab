/* `warren bench pause` (docs/performance.md, "Pause"): in each of N
 * sandboxes in turn, a working set of SIZE MB (compressible text in the
 * sandbox's tmpfs, charged to its memory cgroup) is written and read back,
 * then the sandbox is paused at once and resumed. Reports the sandbox's
 * memory before, while paused and after resume, the fraction given back,
 * and pause and resume latency as the client sees them (median and range),
 * with the daemon's own freeze/reclaim split; the data is checked after
 * every resume. JSON on stdout, progress on stderr. Run it against a daemon
 * started with --zram-size (else only clean cache can leave RAM). */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <warren/warren.h>

#include "cli/bench.h"
#include "cli/bench_floor.h"
#include "common/util.h"

static double
ms_since (uint64_t t0)
{
  return (double)(wr_now_ns () - t0) / 1e6;
}

static double
memory_bytes (warren_client_t *c, const char *id)
{
  warren_error_t e;
  json_t *sb = warren_sandbox_get (c, id, &e);
  double v = sb ? (double)json_integer_value (
                 json_object_get (json_object_get (sb, "usage"), "memory_bytes"))
                : -1;
  json_decref (sb);
  return v;
}

/* {"median","min","max"} of v[0..n), sorted in place */
static json_t *
spread (double *v, size_t n)
{
  wr_bench_stats_t s;
  wr_bench_stats_compute (v, n, 1, 1, &s);
  return json_pack ("{s:f,s:f,s:f}", "median", n ? s.p50_ms : 0.0, "min", n ? s.min_ms : 0.0, "max",
                    n ? s.max_ms : 0.0);
}

static void
usage_pause (FILE *f)
{
  fprintf (f, "Usage: warren bench pause [-n N] [--size MB] [--image REF]\n"
              "In each of N sandboxes (default 5) in turn: write and read back a working set\n"
              "of MB (default 200) in its tmpfs, pause, measure, resume, check the data.\n"
              "Reports memory given back and pause/resume latency (median, min, max).\n"
              "Run against warrend --zram-size. JSON on stdout, progress on stderr.\n");
}

struct round
{
  double before, paused, resumed, pause_ms, resume_ms, freeze_ms, reclaim_ms;
  bool intact;
};

/* one sandbox: create, fill, pause, resume, check, delete */
static int
one_round (warren_client_t *c, const char *image, unsigned size_mb, struct round *ret, char *errbuf,
           size_t errlen)
{
  warren_error_t e;
  json_t *req = json_pack ("{s:I}", "memory_mb", (json_int_t)(size_mb * 2 + 128));
  if (image)
    json_object_set_new (req, "image", json_string (image));
  json_t *sb = warren_sandbox_create (c, req, &e);
  json_decref (req);
  if (sb == NULL)
    {
      snprintf (errbuf, errlen, "create: %s", e.message);
      return -1;
    }
  _cleanup_free_ char *id = strdup (json_string_value (json_object_get (sb, "id")));
  json_decref (sb);
  int r = -1;
  /* od -x of random bytes: ~3.2x the input, compressible like real text */
  char sh[512];
  snprintf (sh, sizeof sh,
            "head -c %um /dev/urandom | od -x | head -c %um > /tmp/ws && "
            "md5sum /tmp/ws | cut -d' ' -f1 > /tmp/ws.md5",
            size_mb / 3 + 1, size_mb);
  json_t *ex = json_pack ("{s:s,s:I}", "shell", sh, "timeout_s", (json_int_t)600);
  json_t *out = warren_exec (c, id, ex, &e);
  json_decref (ex);
  if (out == NULL || json_integer_value (json_object_get (out, "exit_code")) != 0)
    {
      snprintf (errbuf, errlen, "writing the working set: %s", out ? "non-zero exit" : e.message);
      json_decref (out);
      goto out;
    }
  json_decref (out);
  ret->before = memory_bytes (c, id);
  uint64_t t0 = wr_now_ns ();
  json_t *p = warren_sandbox_pause (c, id, &e);
  ret->pause_ms = ms_since (t0);
  if (p == NULL)
    {
      snprintf (errbuf, errlen, "pause: %s", e.message);
      goto out;
    }
  json_decref (p);
  json_t *info = warren_sandbox_get (c, id, &e);
  json_t *pi = info ? json_object_get (info, "pause") : NULL;
  ret->freeze_ms = json_number_value (json_object_get (pi, "freeze_ms"));
  ret->reclaim_ms = json_number_value (json_object_get (pi, "reclaim_ms"));
  ret->paused = info ? (double)json_integer_value (
                    json_object_get (json_object_get (info, "usage"), "memory_bytes"))
                     : -1;
  json_decref (info);
  t0 = wr_now_ns ();
  p = warren_sandbox_resume (c, id, &e);
  ret->resume_ms = ms_since (t0);
  if (p == NULL)
    {
      snprintf (errbuf, errlen, "resume: %s", e.message);
      goto out;
    }
  json_decref (p);
  ret->resumed = memory_bytes (c, id);
  ex = json_pack ("{s:s}", "shell", "md5sum /tmp/ws | cut -d' ' -f1 | cmp -s - /tmp/ws.md5");
  out = warren_exec (c, id, ex, &e);
  json_decref (ex);
  ret->intact = out && json_integer_value (json_object_get (out, "exit_code")) == 0;
  json_decref (out);
  r = 0;
out:
  warren_sandbox_delete (c, id, NULL);
  return r;
}

int
wr_cli_bench_pause (warren_client_t *c, int argc, char **argv)
{
  unsigned n = 5, size_mb = 200;
  const char *image = NULL;
  static const struct option opts[] = {
    { "count", required_argument, NULL, 'n' }, { "size", required_argument, NULL, 's' },
    { "image", required_argument, NULL, 'i' }, { "json", no_argument, NULL, 'j' },
    { "help", no_argument, NULL, 'h' },        { 0 },
  };
  optind = 0;
  int opt;
  while ((opt = getopt_long (argc, argv, "+hn:", opts, NULL)) != -1)
    switch (opt)
      {
      case 'n':
        n = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 's':
        size_mb = (unsigned)strtoul (optarg, NULL, 10);
        break;
      case 'i':
        image = optarg;
        break;
      case 'j': /* the report is JSON either way */
        break;
      case 'h':
        usage_pause (stdout);
        return 0;
      default:
        usage_pause (stderr);
        return 2;
      }
  if (n < 1 || n > 1000 || size_mb < 8 || size_mb > 65536)
    {
      fprintf (stderr, "warren bench pause: -n in [1, 1000], --size in [8, 65536] MB\n");
      return 2;
    }
  _cleanup_free_ struct round *rs = calloc (n, sizeof *rs);
  _cleanup_free_ double *v = calloc (n, sizeof *v);
  if (rs == NULL || v == NULL)
    return 1;
  unsigned done = 0, intact = 0;
  char errbuf[512] = "";
  for (unsigned k = 0; k < n; k++)
    {
      fprintf (stderr, "pause: sandbox %u/%u (%u MB working set)\n", k + 1, n, size_mb);
      if (one_round (c, image, size_mb, &rs[done], errbuf, sizeof errbuf) < 0)
        {
          fprintf (stderr, "pause: %s\n", errbuf);
          break;
        }
      fprintf (stderr,
               "pause:   %.0f -> %.0f MB paused, %.0f MB after resume; pause %.0f ms, "
               "resume %.0f ms\n",
               rs[done].before / 1048576, rs[done].paused / 1048576, rs[done].resumed / 1048576,
               rs[done].pause_ms, rs[done].resume_ms);
      intact += rs[done].intact;
      done++;
    }
  json_t *report = json_pack ("{s:s,s:I,s:I,s:I,s:I}", "bench", "pause", "sandboxes", (json_int_t)n,
                              "completed", (json_int_t)done, "working_set_mb", (json_int_t)size_mb,
                              "data_intact", (json_int_t)intact);
  if (errbuf[0])
    json_object_set_new (report, "error", json_string (errbuf));
#define SPREAD(field, scale)                                                                       \
  ({                                                                                               \
    for (unsigned k = 0; k < done; k++)                                                            \
      v[k] = rs[k].field / (scale);                                                                \
    spread (v, done);                                                                              \
  })
  json_object_set_new (report, "memory_before_mb", SPREAD (before, 1048576));
  json_object_set_new (report, "memory_paused_mb", SPREAD (paused, 1048576));
  json_object_set_new (report, "memory_resumed_mb", SPREAD (resumed, 1048576));
  for (unsigned k = 0; k < done; k++)
    v[k] = rs[k].before > 0 ? 1 - rs[k].paused / rs[k].before : 0;
  json_object_set_new (report, "given_back_fraction", spread (v, done));
  json_object_set_new (report, "pause_ms", SPREAD (pause_ms, 1));
  json_object_set_new (report, "pause_freeze_ms", SPREAD (freeze_ms, 1));
  json_object_set_new (report, "pause_reclaim_ms", SPREAD (reclaim_ms, 1));
  json_object_set_new (report, "resume_ms", SPREAD (resume_ms, 1));
#undef SPREAD
  char *s = json_dumps (report, JSON_INDENT (2) | JSON_REAL_PRECISION (4));
  printf ("%s\n", s);
  free (s);
  json_decref (report);
  return done == n && intact == n ? 0 : 1;
}

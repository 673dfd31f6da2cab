/* warren bench net (issue 12, docs/network.md): create+destroy with
 * "network": "none" against "allow=RULE" in the same run, alternating in
 * rounds so both see the same machine load, and the latency of live policy
 * updates (PATCH /v1/sandboxes/{id}). Targets: allow= creates at >= 0.7x
 * the rate of none; an update applied within 10 ms (round trip, p50). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <warren/warren.h>

#include "common/util.h"

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double
pct (double *v, size_t n, double p)
{
  qsort (v, n, sizeof *v, cmp_double);
  return n ? v[(size_t)((double)(n - 1) * p)] : 0;
}

/* CPU seconds (user + system, all its threads, exited ones included) of
 * process pid so far, < 0 when unreadable */
static double
proc_cpu_s (long pid)
{
  char path[64], buf[1024];
  snprintf (path, sizeof path, "/proc/%ld/stat", pid);
  FILE *f = pid > 0 ? fopen (path, "re") : NULL;
  size_t r = f ? fread (buf, 1, sizeof buf - 1, f) : 0;
  if (f)
    fclose (f);
  buf[r] = 0;
  char *p = strrchr (buf, ')');
  unsigned long long ut, st;
  /* after the command: state and 10 fields, then utime and stime */
  if (p == NULL
      || sscanf (p + 2, "%*c %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu %llu", &ut, &st) != 2)
    return -1;
  return (double)(ut + st) / (double)sysconf (_SC_CLK_TCK);
}

/* n create+destroy of req; seconds spent, < 0 on failure */
static double
creates (warren_client_t *c, json_t *req, unsigned n, warren_error_t *e)
{
  uint64_t t0 = wr_now_ns ();
  for (unsigned i = 0; i < n; i++)
    {
      json_t *sb = warren_sandbox_create (c, req, e);
      if (sb == NULL)
        return -1;
      int r = warren_sandbox_delete (c, json_string_value (json_object_get (sb, "id")), e);
      json_decref (sb);
      if (r < 0)
        return -1;
    }
  return (double)(wr_now_ns () - t0) / 1e9;
}

int
wr_cli_bench_net (warren_client_t *c, int argc, char **argv)
{
  unsigned n = 100, updates = 200;
  long daemon_pid = 0;               /* --daemon-pid: its CPU per create, whatever the load */
  const char *rule = "192.0.2.1:80"; /* TEST-NET-1: never a real host */
  for (int i = 1; i < argc; i++)
    {
      if (strcmp (argv[i], "-n") == 0 && i + 1 < argc)
        n = (unsigned)strtoul (argv[++i], NULL, 10);
      else if (strcmp (argv[i], "--updates") == 0 && i + 1 < argc)
        updates = (unsigned)strtoul (argv[++i], NULL, 10);
      else if (strcmp (argv[i], "--rule") == 0 && i + 1 < argc)
        rule = argv[++i];
      else if (strcmp (argv[i], "--daemon-pid") == 0 && i + 1 < argc)
        daemon_pid = strtol (argv[++i], NULL, 10);
      else
        {
          fprintf (stderr, "usage: warren bench net [-n N] [--updates M] [--rule RULE] "
                           "[--daemon-pid PID]\n"
                           "create+destroy rate with network none vs allow=RULE (same run,\n"
                           "alternating rounds of 10), and live policy update latency. With\n"
                           "the pid of a local warrend: its CPU time per create of each kind.\n");
          return strcmp (argv[i], "--help") == 0 ? 0 : 2;
        }
    }
  if (n < 10)
    n = 10;
  char allow[512];
  snprintf (allow, sizeof allow, "allow=%s", rule);
  json_t *none_req = json_pack ("{s:s}", "network", "none");
  json_t *allow_req = json_pack ("{s:s}", "network", allow);
  warren_error_t e;
  double t_none = 0, t_allow = 0, cpu_none = 0, cpu_allow = 0;
  int rc = 1;
  /* warm-up: the first networked sandbox creates the daemon's table */
  if (creates (c, allow_req, 2, &e) < 0 || creates (c, none_req, 2, &e) < 0)
    goto fail;
  for (unsigned done = 0; done < n; done += 10)
    {
      double c0 = proc_cpu_s (daemon_pid);
      double a = creates (c, none_req, 10, &e);
      double c1 = proc_cpu_s (daemon_pid);
      double b = a < 0 ? -1 : creates (c, allow_req, 10, &e);
      double c2 = proc_cpu_s (daemon_pid);
      if (a < 0 || b < 0)
        goto fail;
      cpu_none += c1 - c0;
      cpu_allow += c2 - c1;
      t_none += a;
      t_allow += b;
    }
  unsigned total = (n + 9) / 10 * 10;
  double *lat = calloc (updates ? updates : 1, sizeof *lat);
  json_t *sb = warren_sandbox_create (c, allow_req, &e);
  if (sb == NULL)
    {
      free (lat);
      goto fail;
    }
  const char *id = json_string_value (json_object_get (sb, "id"));
  char path[128];
  snprintf (path, sizeof path, "/v1/sandboxes/%s", id);
  int r = 0;
  for (unsigned i = 0; i < updates && r == 0; i++)
    {
      json_t *body
          = json_pack ("{s:{s:s}}", "network", i % 2 ? "deny" : "allow", "198.51.100.7:443");
      uint64_t t0 = wr_now_ns ();
      json_t *out = NULL;
      r = warren_request (c, "PATCH", path, body, &out, &e);
      lat[i] = (double)(wr_now_ns () - t0) / 1e6;
      json_decref (out);
      json_decref (body);
    }
  warren_sandbox_delete (c, id, NULL);
  json_decref (sb);
  if (r < 0)
    {
      free (lat);
      goto fail;
    }
  double rate_none = total / t_none, rate_allow = total / t_allow;
  double p50 = pct (lat, updates, 0.5), p99 = pct (lat, updates, 0.99);
  free (lat);
  json_t *rep = json_pack ("{s:s,s:s,s:I,s:f,s:f,s:f,s:I,s:f,s:f,s:{s:b,s:b}}", "benchmark", "net",
                           "rule", rule, "creates_each", (json_int_t)total, "none_per_s", rate_none,
                           "allow_per_s", rate_allow, "allow_vs_none", rate_allow / rate_none,
                           "updates", (json_int_t)updates, "update_p50_ms", p50, "update_p99_ms",
                           p99, "targets", "allow_vs_none>=0.7", rate_allow / rate_none >= 0.7,
                           "update_p50<=10ms", p50 <= 10.0);
  if (daemon_pid > 0 && proc_cpu_s (daemon_pid) >= 0)
    json_object_set_new (rep, "daemon_cpu_ms_per_create",
                         json_pack ("{s:f,s:f,s:f}", "none", cpu_none * 1e3 / total, "allow",
                                    cpu_allow * 1e3 / total, "allow_extra",
                                    (cpu_allow - cpu_none) * 1e3 / total));
  char *s = json_dumps (rep, JSON_INDENT (2));
  printf ("%s\n", s);
  free (s);
  json_decref (rep);
  rc = 0;
  goto out;
fail:
  fprintf (stderr, "warren bench net: %s\n", e.message);
out:
  json_decref (none_req);
  json_decref (allow_req);
  return rc;
}

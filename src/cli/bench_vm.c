/* `warren bench vm [--n N] [--backend microvm|vm|both] [--image REF]`:
 * boot-to-agent-ready and restore-to-agent-ready of the VM backends through
 * the daemon API (docs/vm.md, docs/performance.md).
 *
 * "Ready" is the moment the first exec (`cat /proc/cmdline`) returns, timed
 * from the create request. Each sample is classified from inside the guest:
 * a restored clone still carries its template's kernel command line
 * (warren.hostname=warren), a booted VM its own id. Boot samples use a fresh
 * memory size each, so no snapshot exists for them and none is built (the
 * daemon builds a template on a configuration's second boot). The
 * accelerator is read from the guest's kernel log ("Hypervisor detected:
 * KVM"). */
#include "cli/bench.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/bench_floor.h"
#include "common/util.h"

int wr_cli_bench_vm (warren_client_t *c, int argc, char **argv);

static json_t *
summary (double *v, size_t n)
{
  if (n == 0)
    return json_null ();
  qsort (v, n, sizeof *v, wr_bench_cmp_double);
  double sum = 0;
  for (size_t i = 0; i < n; i++)
    sum += v[i];
  return json_pack ("{s:I,s:f,s:f,s:f,s:f}", "n", (json_int_t)n, "median_ms", v[n / 2], "mean_ms",
                    sum / (double)n, "min_ms", v[0], "max_ms", v[n - 1]);
}

/* One create + first exec. ret_restored: the guest came from a snapshot. */
static int
sample (warren_client_t *c, const char *backend, const char *image, int mem_mb, double *ret_ms,
        bool *ret_restored, char *accel, size_t accel_len)
{
  json_t *req = json_pack ("{s:s,s:i}", "backend", backend, "memory_mb", mem_mb);
  if (image)
    json_object_set_new (req, "image", json_string (image));
  warren_error_t err;
  uint64_t t0 = wr_now_ns ();
  json_t *sb = warren_sandbox_create (c, req, &err);
  json_decref (req);
  if (sb == NULL)
    {
      fprintf (stderr, "warren bench vm: create %s: %s\n", backend, err.message);
      return -1;
    }
  char id[160];
  snprintf (id, sizeof id, "%s", json_string_value (json_object_get (sb, "id")) ?: "");
  json_decref (sb);
  json_t *ex = json_pack ("{s:[s,s],s:i}", "cmd", "cat", "/proc/cmdline", "timeout_s", 300);
  json_t *r = warren_exec (c, id, ex, &err);
  double ms = (double)(wr_now_ns () - t0) / 1e6;
  json_decref (ex);
  int rc = -1;
  if (r && json_integer_value (json_object_get (r, "exit_code")) == 0)
    {
      const char *out = json_string_value (json_object_get (r, "stdout")) ?: "";
      *ret_restored = strstr (out, "warren.hostname=warren ") != NULL
                      || (strstr (out, "warren.hostname=warren\n") != NULL);
      *ret_ms = ms;
      rc = 0;
    }
  else
    fprintf (stderr, "warren bench vm: exec in %s: %s\n", id, r ? "failed" : err.message);
  json_decref (r);
  if (rc == 0 && accel[0] == '\0')
    {
      json_t *dq = json_pack ("{s:s}", "shell",
                              "dmesg 2>/dev/null | grep -q 'Hypervisor detected: KVM' && echo kvm "
                              "|| (dmesg >/dev/null 2>&1 && echo tcg || echo unknown)");
      json_t *dr = warren_exec (c, id, dq, NULL);
      const char *o = dr ? json_string_value (json_object_get (dr, "stdout")) : NULL;
      if (o)
        snprintf (accel, accel_len, "%.*s", (int)strcspn (o, "\n"), o);
      json_decref (dr);
      json_decref (dq);
    }
  warren_sandbox_delete (c, id, NULL);
  return rc;
}

static json_t *
bench_backend (warren_client_t *c, const char *backend, const char *image, size_t n)
{
  double *boot = calloc (n, sizeof *boot), *rest = calloc (n, sizeof *rest);
  size_t nb = 0, nr = 0;
  char accel[16] = "";
  unsigned base = 256 + (unsigned)(wr_now_ns () / 1000 % 1000) * 4;
  bool failed = false;
  fprintf (stderr, "warren bench vm: %s: %zu boots\n", backend, n);
  for (size_t i = 0; i < n && !failed; i++)
    {
      double ms;
      bool restored = false;
      if (sample (c, backend, image, (int)(base + 4 * i), &ms, &restored, accel, sizeof accel) < 0)
        failed = true;
      else if (!restored)
        boot[nb++] = ms;
    }
  /* restore: boot one configuration twice (the second builds its template),
   * then wait until creates come from the snapshot */
  int rmem = (int)(base + 4 * n + 64);
  fprintf (stderr, "warren bench vm: %s: waiting for a snapshot\n", backend);
  bool have = false;
  uint64_t deadline = wr_now_ms () + 600000;
  while (!failed && !have && wr_now_ms () < deadline)
    {
      double ms;
      bool restored = false;
      if (sample (c, backend, image, rmem, &ms, &restored, accel, sizeof accel) < 0)
        failed = true;
      have = restored;
      if (!have)
        {
          struct timespec ts = { 1, 0 };
          nanosleep (&ts, NULL);
        }
    }
  fprintf (stderr, "warren bench vm: %s: %zu restores\n", backend, n);
  for (size_t i = 0; i < n && have && !failed; i++)
    {
      double ms;
      bool restored = false;
      if (sample (c, backend, image, rmem, &ms, &restored, accel, sizeof accel) < 0)
        failed = true;
      else if (restored)
        rest[nr++] = ms;
    }
  json_t *o = json_pack ("{s:s,s:s,s:o,s:o}", "backend", backend, "accel",
                         accel[0] ? accel : "unknown", "boot_to_agent_ready", summary (boot, nb),
                         "restore_to_agent_ready", summary (rest, nr));
  if (failed)
    json_object_set_new (o, "error", json_string ("a sample failed (see stderr)"));
  free (boot);
  free (rest);
  return o;
}

int
wr_cli_bench_vm (warren_client_t *c, int argc, char **argv)
{
  static const struct option opts[] = {
    { "n", required_argument, NULL, 'n' },
    { "backend", required_argument, NULL, 'b' },
    { "image", required_argument, NULL, 'i' },
    { NULL, 0, NULL, 0 },
  };
  size_t n = 5;
  const char *which = "both", *image = NULL;
  int ch;
  optind = 1;
  while ((ch = getopt_long (argc, argv, "", opts, NULL)) != -1)
    switch (ch)
      {
      case 'n':
        n = strtoul (optarg, NULL, 10);
        if (n < 1 || n > 1000)
          {
            fprintf (stderr, "warren bench vm: --n must be in [1, 1000]\n");
            return 2;
          }
        break;
      case 'b':
        which = optarg;
        if (strcmp (which, "microvm") && strcmp (which, "vm") && strcmp (which, "both"))
          {
            fprintf (stderr, "warren bench vm: --backend microvm|vm|both\n");
            return 2;
          }
        break;
      case 'i':
        image = optarg;
        break;
      default:
        fprintf (stderr, "usage: warren bench vm [--n N] [--backend microvm|vm|both] "
                         "[--image REF]\n");
        return 2;
      }
  warren_client_set_timeout (c, 600000);
  json_t *results = json_array ();
  int rc = 0;
  if (strcmp (which, "vm") != 0)
    json_array_append_new (results, bench_backend (c, "microvm", image, n));
  if (strcmp (which, "microvm") != 0)
    json_array_append_new (results, bench_backend (c, "vm", image, n));
  size_t i;
  json_t *r;
  json_array_foreach (results, i, r) if (json_object_get (r, "error")) rc = 1;
  json_t *rep = json_pack ("{s:s,s:o,s:{s:s,s:s}}", "bench", "vm", "results", results, "targets",
                           "microvm_boot_kvm", "<= 150 ms", "microvm_restore_kvm", "<= 30 ms");
  char *s = json_dumps (rep, JSON_INDENT (2));
  puts (s);
  free (s);
  json_decref (rep);
  return rc;
}

/* `warren bench fork` (docs/performance.md): one sandbox set up with a
 * SIZE MB writable layer forked into N children, against N fresh sandboxes
 * each redoing the setup. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <warren/warren.h>

static double
now_s (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void
usage_fork (FILE *f)
{
  fprintf (f, "Usage: warren bench fork [-n N] [--size-mb MB] [--image REF]\n"
              "Set up one sandbox (write MB to its writable layer), fork it into N children,\n"
              "then create N fresh sandboxes that each redo the setup; JSON report.\n");
}

/* create a sandbox and write size_mb into it; returns its id (caller frees) */
static char *
setup (warren_client_t *c, const char *image, unsigned size_mb, warren_error_t *e)
{
  json_t *req = json_pack ("{s:I,s:I}", "disk_mb", (json_int_t)(size_mb * 2 + 64), "memory_mb",
                           (json_int_t)(size_mb * 2 + 256));
  if (image)
    json_object_set_new (req, "image", json_string (image));
  json_t *sb = warren_sandbox_create (c, req, e);
  json_decref (req);
  if (sb == NULL)
    return NULL;
  char *id = strdup (json_string_value (json_object_get (sb, "id")));
  json_decref (sb);
  char cmd[128];
  snprintf (cmd, sizeof cmd, "dd if=/dev/zero of=/setup.bin bs=1M count=%u 2>/dev/null", size_mb);
  json_t *ex = json_pack ("{s:s,s:i}", "shell", cmd, "timeout_s", 600);
  json_t *r = warren_exec (c, id, ex, e);
  json_decref (ex);
  bool ok = r && json_integer_value (json_object_get (r, "exit_code")) == 0;
  json_decref (r);
  if (!ok)
    {
      if (r != NULL || e->message[0] == '\0')
        snprintf (e->message, sizeof e->message, "the setup command failed");
      warren_sandbox_delete (c, id, NULL);
      free (id);
      return NULL;
    }
  return id;
}

int
wr_cli_bench_fork (warren_client_t *c, int argc, char **argv)
{
  unsigned n = 16, size_mb = 100;
  const char *image = NULL;
  static const struct option opts[] = {
    { "count", required_argument, NULL, 'n' },
    { "size-mb", required_argument, NULL, 's' },
    { "image", required_argument, NULL, 'i' },
    { "help", no_argument, NULL, 'h' },
    { 0 },
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
      case 'h':
        usage_fork (stdout);
        return 0;
      default:
        usage_fork (stderr);
        return 2;
      }
  if (n < 1 || n > 256 || size_mb < 1 || size_mb > 4096)
    {
      fprintf (stderr, "warren bench fork: -n in [1, 256], --size-mb in [1, 4096]\n");
      return 2;
    }
  warren_error_t e;
  double t0 = now_s ();
  char *parent = setup (c, image, size_mb, &e);
  if (parent == NULL)
    {
      fprintf (stderr, "warren bench fork: setup: %s\n", e.message);
      return 1;
    }
  double t_setup = now_s () - t0;
  t0 = now_s ();
  json_t *f = warren_sandbox_fork (c, parent, n, NULL, &e);
  double t_fork = now_s () - t0;
  if (f == NULL)
    {
      fprintf (stderr, "warren bench fork: fork: %s\n", e.message);
      warren_sandbox_delete (c, parent, NULL);
      free (parent);
      return 1;
    }
  double snap_ms
      = json_number_value (json_object_get (json_object_get (f, "timing_ms"), "snapshot"));
  size_t i;
  json_t *s;
  json_array_foreach (json_object_get (f, "sandboxes"), i, s)
      warren_sandbox_delete (c, json_string_value (json_object_get (s, "id")), NULL);
  json_decref (f);
  warren_sandbox_delete (c, parent, NULL);
  free (parent);
  /* the alternative: N fresh sandboxes, each redoing the setup */
  char **fresh = calloc (n, sizeof *fresh);
  int rc = 0;
  t0 = now_s ();
  for (unsigned k = 0; k < n && rc == 0; k++)
    if ((fresh[k] = setup (c, image, size_mb, &e)) == NULL)
      {
        fprintf (stderr, "warren bench fork: fresh %u: %s\n", k, e.message);
        rc = 1;
      }
  double t_fresh = now_s () - t0;
  for (unsigned k = 0; k < n; k++)
    if (fresh[k])
      {
        warren_sandbox_delete (c, fresh[k], NULL);
        free (fresh[k]);
      }
  free (fresh);
  if (rc)
    return rc;
  json_t *rep = json_pack ("{s:s,s:I,s:I,s:f,s:f,s:f,s:f,s:f}", "benchmark", "fork", "children",
                           (json_int_t)n, "size_mb", (json_int_t)size_mb, "setup_one_s", t_setup,
                           "fork_s", t_fork, "fork_snapshot_s", snap_ms / 1e3, "fresh_with_setup_s",
                           t_fresh, "fork_speedup", t_fork > 0 ? t_fresh / t_fork : 0.0);
  char *txt = json_dumps (rep, JSON_INDENT (2));
  puts (txt ? txt : "{}");
  free (txt);
  json_decref (rep);
  return 0;
}

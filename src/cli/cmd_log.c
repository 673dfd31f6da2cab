/* Trajectory log verbs (docs/rl.md): log, replay. */
#include "cli/cli.h"

#include <getopt.h>
#include <string.h>

#include "common/util.h"

/* What an event did, in one line. */
static void
event_what (json_t *ev, char *buf, size_t n)
{
  const char *kind = json_string_value (json_object_get (ev, "kind"));
  json_t *rq = json_object_get (ev, "request");
  json_t *res = json_object_get (ev, "result");
  if (strcmp (kind, "exec") == 0)
    {
      const char *sh = json_string_value (json_object_get (rq, "shell"));
      if (sh)
        snprintf (buf, n, "%s", sh);
      else
        {
          size_t off = 0, i;
          json_t *a;
          buf[0] = '\0';
          json_array_foreach (json_object_get (rq, "cmd"), i, a)
          {
            int w = snprintf (buf + off, n - off, "%s%s", i ? " " : "", json_string_value (a));
            if (w < 0 || (size_t)w >= n - off)
              break;
            off += (size_t)w;
          }
        }
    }
  else if (strcmp (kind, "file") == 0)
    {
      json_t *size = json_object_get (rq, "size");
      snprintf (buf, n, "%s %s", json_string_value (json_object_get (rq, "op")),
                json_string_value (json_object_get (rq, "path")));
      if (size)
        {
          char sz[32];
          cli_size ((double)json_integer_value (size), sz, sizeof sz);
          size_t l = strlen (buf);
          snprintf (buf + l, n - l, " (%s)", sz);
        }
    }
  else if (strcmp (kind, "create") == 0)
    snprintf (buf, n, "%s", json_string_value (json_object_get (res, "image")));
  else if (strcmp (kind, "checkpoint") == 0 || strcmp (kind, "restore") == 0)
    snprintf (buf, n, "%s", json_string_value (json_object_get (res, "name")) ?: "");
  else if (strcmp (kind, "fork") == 0)
    snprintf (buf, n, "%lld children",
              (long long)json_integer_value (json_object_get (res, "count")));
  else
    snprintf (buf, n, "%s", json_string_value (json_object_get (res, "reason")) ?: "");
}

static void
event_outcome (json_t *ev, char *buf, size_t n)
{
  json_t *res = json_object_get (ev, "result");
  json_t *err = json_object_get (res, "error");
  buf[0] = '\0';
  if (json_is_object (err))
    snprintf (buf, n, "error %s", json_string_value (json_object_get (err, "code")));
  else if (json_is_null (res))
    snprintf (buf, n, "running");
  else if (json_object_get (res, "exit_code"))
    snprintf (buf, n, "exit %lld%s (%lld ms)",
              (long long)json_integer_value (json_object_get (res, "exit_code")),
              json_is_true (json_object_get (res, "timed_out")) ? ", timed out" : "",
              (long long)json_integer_value (json_object_get (res, "duration_ms")));
  else if (json_object_get (res, "status"))
    snprintf (buf, n, "%lld", (long long)json_integer_value (json_object_get (res, "status")));
  if (json_object_get (ev, "replayed_from"))
    {
      size_t l = strlen (buf);
      json_t *rerun = json_object_get (ev, "rerun");
      snprintf (buf + l, n - l, " [replayed from %lld%s]",
                (long long)json_integer_value (json_object_get (ev, "replayed_from")),
                json_is_false (json_object_get (rerun, "same")) ? ", diverged" : "");
    }
}

int
cmd_log (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[]
      = { { "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' }, { 0 } };
  bool as_json = false;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    if (opt == 'j')
      as_json = true;
    else if (opt == 'h')
      return cli_help ("log", stdout), 0;
    else
      return cli_bad_option ("log", argv);
  if (argc - optind != 1)
    return cli_usage ("log", "expected one sandbox ID");
  const char *id = argv[optind];
  if (!warren_id_valid (id))
    return cli_usage ("log", "invalid sandbox id '%.64s' (expected [a-z0-9-])", id);
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *log = warren_sandbox_log (c, id, &e);
  if (log == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (log);
  double t0 = json_number_value (json_object_get (log, "created_at"));
  json_t *parent = json_object_get (log, "forked_from");
  json_t *inherited = json_object_get (log, "inherited");
  if (json_is_object (parent))
    {
      /* provenance: the ancestors' events up to the fork, oldest first */
      printf ("forked from %s at its seq %lld; inherited:\n",
              json_string_value (json_object_get (parent, "id")),
              (long long)json_integer_value (json_object_get (parent, "seq")));
      if (json_array_size (inherited))
        t0 = json_number_value (json_object_get (json_array_get (inherited, 0), "at"));
    }
  printf ("%-6s %-9s %-8s %-16s %-40s %s\n", "SEQ", "AT", "KIND", "STEP", "WHAT", "RESULT");
  size_t i, n_inherited = json_array_size (inherited);
  json_t *ev;
  for (i = 0; i < n_inherited + json_array_size (json_object_get (log, "events")); i++)
    {
      if (i == n_inherited && n_inherited)
        printf ("-- %s --\n", id);
      ev = i < n_inherited ? json_array_get (inherited, i)
                           : json_array_get (json_object_get (log, "events"), i - n_inherited);
      char what[256], outcome[128], at[32];
      event_what (ev, what, sizeof what);
      event_outcome (ev, outcome, sizeof outcome);
      snprintf (at, sizeof at, "+%.3fs", json_number_value (json_object_get (ev, "at")) - t0);
      const char *step = json_string_value (json_object_get (ev, "step"));
      _cleanup_free_ char *pstep = cli_printable (step ? step : "-");
      _cleanup_free_ char *pwhat = cli_printable (what);
      printf ("%-6lld %-9s %-8s %-16s %-40s %s\n",
              (long long)json_integer_value (json_object_get (ev, "seq")), at,
              json_string_value (json_object_get (ev, "kind")), pstep, pwhat, outcome);
    }
  return 0;
}

int
cmd_replay (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { { "until", required_argument, NULL, 'u' },
                                        { "json", no_argument, NULL, 'j' },
                                        { "help", no_argument, NULL, 'h' },
                                        { 0 } };
  bool as_json = false;
  const char *until = NULL;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    if (opt == 'j')
      as_json = true;
    else if (opt == 'u')
      until = optarg;
    else if (opt == 'h')
      return cli_help ("replay", stdout), 0;
    else
      return cli_bad_option ("replay", argv);
  if (argc - optind != 1)
    return cli_usage ("replay", "expected one sandbox ID");
  const char *id = argv[optind];
  if (!warren_id_valid (id))
    return cli_usage ("replay", "invalid sandbox id '%.64s' (expected [a-z0-9-])", id);
  if (until && (*until == '\0' || strlen (until) > 256))
    return cli_usage ("replay", "--until: expected a step id of 1 to 256 bytes");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *sb = warren_sandbox_replay (c, id, until, &e);
  if (sb == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (sb);
  json_t *info = json_object_get (sb, "replay");
  json_int_t diverged = json_integer_value (json_object_get (info, "diverged"));
  if (diverged)
    cli_errorf ("%lld of %lld replayed commands gave other results than the original",
                (long long)diverged,
                (long long)json_integer_value (json_object_get (info, "events")));
  printf ("%s\n", json_string_value (json_object_get (sb, "id")));
  return 0;
}

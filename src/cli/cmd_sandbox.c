/* Sandbox lifecycle verbs: create, ls, inspect, rm, pause, resume, pack. */
#include "cli/cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static bool
ref_ok (const char *verb, const char *what, const char *ref)
{
  if (ref == NULL || *ref == '\0' || strlen (ref) > 1024)
    {
      cli_usage (verb, "bad %s", what);
      return false;
    }
  return true;
}

static json_t *
utf8_or_complain (const char *s, const char *what)
{
  json_t *j = json_string (s);
  if (j == NULL)
    cli_errorf ("%s is not valid UTF-8", what);
  return j;
}

int
cli_create_opt (int opt, const char *arg, json_t *req, const char *verb)
{
  uint64_t u;
  double d;
  json_t *v;
  switch (opt)
    {
    case 'B':
      if (strcmp (arg, "fncall") && strcmp (arg, "container") && strcmp (arg, "microvm")
          && strcmp (arg, "vm"))
        return cli_usage (verb, "--backend must be fncall, container, microvm or vm"), -1;
      json_object_set_new (req, "backend", json_string (arg));
      return 1;
    case 'I':
      if (!ref_ok (verb, "--image", arg) || !(v = utf8_or_complain (arg, "--image")))
        return -1;
      json_object_set_new (req, "image", v);
      return 1;
    case 'L':
      {
        if (!ref_ok (verb, "--layer", arg) || !(v = utf8_or_complain (arg, "--layer")))
          return -1;
        json_t *layers = json_object_get (req, "layers");
        if (layers == NULL)
          json_object_set_new (req, "layers", layers = json_array ());
        json_array_append_new (layers, v);
        return 1;
      }
    case 'M':
      if (!cli_parse_u64 (arg, 1, 1u << 24, &u))
        return cli_usage (verb, "--memory: expected megabytes, got '%.32s'", arg), -1;
      json_object_set_new (req, "memory_mb", json_integer ((json_int_t)u));
      return 1;
    case 'D':
      if (!cli_parse_u64 (arg, 1, 1u << 30, &u))
        return cli_usage (verb, "--disk: expected megabytes, got '%.32s'", arg), -1;
      json_object_set_new (req, "disk_mb", json_integer ((json_int_t)u));
      return 1;
    case 'C':
      if (!cli_parse_seconds (arg, 4096, &d))
        return cli_usage (verb, "--cpus: expected a positive number, got '%.32s'", arg), -1;
      json_object_set_new (req, "cpus", json_real (d));
      return 1;
    case 'T':
      if (!cli_parse_u64 (arg, 1, 1ull << 31, &u))
        return cli_usage (verb, "--ttl: expected seconds, got '%.32s'", arg), -1;
      json_object_set_new (req, "ttl_s", json_integer ((json_int_t)u));
      return 1;
    case 'N':
      if (strcmp (arg, "none") && strcmp (arg, "host") && strncmp (arg, "allow=", 6))
        return cli_usage (verb, "--net must be none, host or allow=RULE[,RULE...]"), -1;
      json_object_set_new (req, "network", json_string (arg));
      return 1;
    case CLI_OPT_NET_GROUP:
      json_object_set_new (req, "net_group", json_string (arg));
      return 1;
    case CLI_OPT_NET_RATE:
    case CLI_OPT_NET_CONNS:
      {
        bool rate = opt == CLI_OPT_NET_RATE;
        if (!cli_parse_u64 (arg, 0, rate ? 100000000 : 1000000, &u))
          return cli_usage (verb, "--%s: expected %s (0: unlimited), got '%.32s'",
                            rate ? "net-rate" : "net-conns", rate ? "kbit/s" : "a count", arg),
                 -1;
        json_t *lim = json_object_get (req, "net_limits");
        if (lim == NULL)
          json_object_set_new (req, "net_limits", lim = json_object ());
        json_object_set_new (lim, rate ? "egress_kbps" : "connections",
                             json_integer ((json_int_t)u));
        return 1;
      }
    case CLI_OPT_QOS:
      if (strcmp (arg, "latency") && strcmp (arg, "best-effort"))
        return cli_usage (verb, "--qos must be latency or best-effort"), -1;
      json_object_set_new (req, "qos", json_string (arg));
      return 1;
    case CLI_OPT_IDLE_PAUSE:
      if (!cli_parse_u64 (arg, 0, 30 * 86400, &u))
        return cli_usage (verb, "--idle-pause: expected seconds, got '%.32s'", arg), -1;
      json_object_set_new (req, "idle_pause_s", json_integer ((json_int_t)u));
      return 1;
    case CLI_OPT_SEED:
    case CLI_OPT_EPOCH:
      {
        bool seed = opt == CLI_OPT_SEED;
        if (!cli_parse_u64 (arg, 0, seed ? UINT32_MAX : 1ull << 40, &u))
          return cli_usage (verb, "--%s: expected a non-negative integer, got '%.32s'",
                            seed ? "seed" : "epoch", arg),
                 -1;
        json_t *det = json_object_get (req, "deterministic");
        if (det == NULL)
          json_object_set_new (req, "deterministic", det = json_object ());
        json_object_set_new (det, seed ? "seed" : "epoch", json_integer ((json_int_t)u));
        return 1;
      }
    default:
      return 0;
    }
}

int
cmd_create (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { CLI_CREATE_LONGOPTS,
                                        { "json", no_argument, NULL, 'j' },
                                        { "help", no_argument, NULL, 'h' },
                                        { 0 } };
  json_auto_t *req = json_object ();
  bool as_json = false;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    {
      int r = cli_create_opt (opt, optarg, req, "create");
      if (r < 0)
        return CLI_EXIT_USAGE;
      if (r > 0)
        continue;
      if (opt == 'j')
        as_json = true;
      else if (opt == 'h')
        return cli_help ("create", stdout), 0;
      else
        return cli_bad_option ("create", argv);
    }
  if (optind < argc)
    return cli_usage ("create", "unexpected argument '%.64s'", argv[optind]);
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *sb = warren_sandbox_create (c, req, &e);
  if (sb == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (sb);
  const char *id = json_string_value (json_object_get (sb, "id"));
  if (id == NULL || !warren_id_valid (id))
    {
      cli_errorf ("the daemon answered without a valid sandbox id");
      return CLI_EXIT_FAIL;
    }
  puts (id);
  return 0;
}

/* Parse a verb that only takes --help and --json plus positionals. */
static int
simple_opts (const char *verb, int argc, char **argv, bool *as_json)
{
  static const struct option opts[]
      = { { "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' }, { 0 } };
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    {
      if (opt == 'j' && as_json)
        *as_json = true;
      else if (opt == 'h')
        {
          cli_help (verb, stdout);
          return 0;
        }
      else if (opt == 'j')
        return cli_usage (verb, "--json is not an option of this command");
      else
        return cli_bad_option (verb, argv);
    }
  return -1;
}

static int
need_id (const char *verb, const char *id)
{
  if (!warren_id_valid (id))
    return cli_usage (verb, "invalid sandbox id '%.64s' (expected [a-z0-9-])", id);
  return 0;
}

int
cmd_ls (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int r = simple_opts ("ls", argc, argv, &as_json);
  if (r >= 0)
    return r;
  if (optind < argc)
    return cli_usage ("ls", "unexpected argument '%.64s'", argv[optind]);
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *list = warren_sandbox_list (c, &e);
  if (list == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (list);
  size_t n = json_array_size (list);
  char **rows = calloc (n * 5 + 5, sizeof *rows);
  if (rows == NULL)
    abort ();
  static const char *hdr[] = { "ID", "BACKEND", "IMAGE", "STATE", "AGE" };
  int w[5];
  for (int k = 0; k < 5; k++)
    {
      rows[k] = strdup (hdr[k]);
      w[k] = (int)strlen (hdr[k]);
    }
  for (size_t i = 0; i < n; i++)
    {
      json_t *sb = json_array_get (list, i);
      char age[32];
      cli_age (json_number_value (json_object_get (sb, "created_at")), age, sizeof age);
      char **row = rows + (i + 1) * 5;
      row[0] = cli_printable (json_string_value (json_object_get (sb, "id")));
      row[1] = cli_printable (json_string_value (json_object_get (sb, "backend")));
      row[2] = cli_printable (json_string_value (json_object_get (sb, "image")));
      row[3] = cli_printable (json_string_value (json_object_get (sb, "state")));
      row[4] = strdup (age);
      for (int k = 0; k < 5; k++)
        if ((int)strlen (row[k]) > w[k])
          w[k] = (int)strlen (row[k]);
    }
  for (size_t i = 0; i <= n; i++)
    {
      char **row = rows + i * 5;
      printf ("%-*s  %-*s  %-*s  %-*s  %s\n", w[0], row[0], w[1], row[1], w[2], row[2], w[3],
              row[3], row[4]);
      for (int k = 0; k < 5; k++)
        free (row[k]);
    }
  free (rows);
  return 0;
}

int
cmd_inspect (cli_t *cli, int argc, char **argv)
{
  int r = simple_opts ("inspect", argc, argv, NULL);
  if (r >= 0)
    return r;
  if (argc - optind != 1)
    return cli_usage ("inspect", "expected one sandbox id");
  if (need_id ("inspect", argv[optind]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *sb = warren_sandbox_get (c, argv[optind], &e);
  if (sb == NULL)
    return cli_fail (&e, NULL);
  return cli_print_json (sb);
}

int
cmd_rm (cli_t *cli, int argc, char **argv)
{
  int r = simple_opts ("rm", argc, argv, NULL);
  if (r >= 0)
    return r;
  if (optind >= argc)
    return cli_usage ("rm", "expected at least one sandbox id");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  int status = 0;
  for (int i = optind; i < argc; i++)
    {
      if (!warren_id_valid (argv[i]))
        {
          cli_errorf ("invalid sandbox id '%.64s'", argv[i]);
          status = CLI_EXIT_FAIL;
          continue;
        }
      warren_error_t e;
      if (warren_sandbox_delete (c, argv[i], &e) < 0)
        status = cli_fail (&e, argv[i]);
      else
        puts (argv[i]);
    }
  return status;
}

static int
pause_resume (cli_t *cli, int argc, char **argv, bool pause)
{
  const char *verb = pause ? "pause" : "resume";
  int r = simple_opts (verb, argc, argv, NULL);
  if (r >= 0)
    return r;
  if (argc - optind != 1)
    return cli_usage (verb, "expected one sandbox id");
  if (need_id (verb, argv[optind]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *sb = pause ? warren_sandbox_pause (c, argv[optind], &e)
                          : warren_sandbox_resume (c, argv[optind], &e);
  if (sb == NULL)
    return cli_fail (&e, NULL);
  puts (argv[optind]);
  return 0;
}

int
cmd_pause (cli_t *cli, int argc, char **argv)
{
  return pause_resume (cli, argc, argv, true);
}

int
cmd_resume (cli_t *cli, int argc, char **argv)
{
  return pause_resume (cli, argc, argv, false);
}

int
cmd_pack (cli_t *cli, int argc, char **argv)
{
  int r = simple_opts ("pack", argc, argv, NULL);
  if (r >= 0)
    return r;
  if (argc - optind != 2)
    return cli_usage ("pack", "expected ID NAME[:TAG]");
  if (need_id ("pack", argv[optind]) || !ref_ok ("pack", "image name", argv[optind + 1]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *img = warren_sandbox_pack (c, argv[optind], argv[optind + 1], &e);
  if (img == NULL)
    return cli_fail (&e, NULL);
  const char *name = json_string_value (json_object_get (img, "name"));
  const char *digest = json_string_value (json_object_get (img, "digest"));
  if (name && digest)
    {
      char *pn = cli_printable (name), *pd = cli_printable (digest);
      printf ("%s %s\n", pn, pd);
      free (pn);
      free (pd);
      return 0;
    }
  return cli_print_json (img);
}

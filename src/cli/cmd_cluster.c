/* Cluster verbs, answered by a warren-gateway (docs/cluster.md):
 * node ls | drain | undrain, project create. */
#include "cli/cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static int
node_ls (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[]
      = { { "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' }, { 0 } };
  bool as_json = false;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    {
      if (opt == 'h')
        return cli_help ("node ls", stdout), 0;
      if (opt != 'j')
        return cli_bad_option ("node ls", argv);
      as_json = true;
    }
  if (optind != argc)
    return cli_usage ("node ls", "unexpected argument");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_t *resp = NULL;
  if (warren_request (c, "GET", "/v1/nodes", NULL, &resp, &e) < 0)
    return cli_fail (&e, NULL);
  json_t *nodes = json_object_get (resp, "nodes");
  if (as_json)
    {
      int r = cli_print_json (nodes);
      json_decref (resp);
      return r;
    }
  printf ("%-20s %-8s %-28s %9s %10s %s\n", "NAME", "STATE", "ADDRESS", "SANDBOXES", "FREE_MB",
          "LABELS");
  size_t i;
  json_t *n;
  json_array_foreach (nodes, i, n)
  {
    char labels[512] = "";
    size_t off = 0;
    const char *k;
    json_t *v;
    json_object_foreach (json_object_get (n, "labels"), k, v)
    {
      int w = snprintf (labels + off, sizeof labels - off, "%s%s=%s", off ? "," : "", k,
                        json_string_value (v) ? json_string_value (v) : "");
      if (w < 0 || (size_t)w >= sizeof labels - off)
        break;
      off += (size_t)w;
    }
    _cleanup_free_ char *name = cli_printable (json_string_value (json_object_get (n, "name")));
    _cleanup_free_ char *addr = cli_printable (json_string_value (json_object_get (n, "address")));
    _cleanup_free_ char *lab = cli_printable (off ? labels : "-");
    printf ("%-20s %-8s %-28s %9lld %10lld %s\n", name,
            json_string_value (json_object_get (n, "state")) ?: "?", addr,
            (long long)json_integer_value (json_object_get (n, "sandboxes")),
            (long long)json_integer_value (json_object_get (n, "memory_free_mb")), lab);
  }
  json_decref (resp);
  return 0;
}

static int
node_drain (cli_t *cli, const char *verb, int argc, char **argv)
{
  if (argc != 2 || argv[1][0] == '-')
    {
      if (argc == 2 && (strcmp (argv[1], "--help") == 0 || strcmp (argv[1], "-h") == 0))
        return cli_help (verb, stdout), 0;
      return cli_usage (verb, "expected NAME");
    }
  const char *name = argv[1];
  for (const char *p = name; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '-'))
      return cli_usage (verb, "bad node name");
  if (strlen (name) > 64)
    return cli_usage (verb, "bad node name");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  char path[128];
  snprintf (path, sizeof path, "/v1/nodes/%s/%s", name,
            strcmp (verb, "node drain") == 0 ? "drain" : "undrain");
  warren_error_t e;
  json_t *resp = NULL;
  if (warren_request (c, "POST", path, NULL, &resp, &e) < 0)
    return cli_fail (&e, NULL);
  json_decref (resp);
  return 0;
}

int
cmd_node (cli_t *cli, int argc, char **argv)
{
  if (argc < 2 || strcmp (argv[1], "--help") == 0 || strcmp (argv[1], "-h") == 0)
    {
      cli_help ("node", argc < 2 ? stderr : stdout);
      return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
  if (strcmp (argv[1], "ls") == 0)
    return node_ls (cli, argc - 1, argv + 1);
  if (strcmp (argv[1], "drain") == 0)
    return node_drain (cli, "node drain", argc - 1, argv + 1);
  if (strcmp (argv[1], "undrain") == 0)
    return node_drain (cli, "node undrain", argc - 1, argv + 1);
  return cli_usage ("node", "unknown subcommand '%.64s'", argv[1]);
}

static int
project_create (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = {
    { "max-sandboxes", required_argument, NULL, 's' },
    { "max-memory", required_argument, NULL, 'm' },
    { "priority", required_argument, NULL, 'p' },
    { "json", no_argument, NULL, 'j' },
    { "help", no_argument, NULL, 'h' },
    { 0 },
  };
  const char *verb = "project create";
  uint64_t max_sb = 0, max_mem = 0, prio = 0;
  bool have_sb = false, as_json = false;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (opt)
      {
      case 's':
        if (!cli_parse_u64 (optarg, 0, 1u << 30, &max_sb))
          return cli_usage (verb, "--max-sandboxes wants a count");
        have_sb = true;
        break;
      case 'm':
        if (!cli_parse_u64 (optarg, 0, 1ull << 40, &max_mem))
          return cli_usage (verb, "--max-memory wants megabytes");
        break;
      case 'p':
        if (!cli_parse_u64 (optarg, 0, 1000, &prio))
          return cli_usage (verb, "--priority wants 0..1000");
        break;
      case 'j':
        as_json = true;
        break;
      case 'h':
        return cli_help (verb, stdout), 0;
      default:
        return cli_bad_option (verb, argv);
      }
  if (argc - optind != 1)
    return cli_usage (verb, "expected NAME");
  if (!have_sb)
    return cli_usage (verb, "--max-sandboxes is required");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  json_t *req
      = json_pack ("{s:s,s:I,s:I,s:I}", "name", argv[optind], "max_sandboxes", (json_int_t)max_sb,
                   "max_memory_mb", (json_int_t)max_mem, "priority", (json_int_t)prio);
  if (req == NULL)
    return cli_usage (verb, "NAME must be UTF-8");
  warren_error_t e;
  json_t *resp = NULL;
  int r = warren_request (c, "POST", "/v1/projects", req, &resp, &e);
  json_decref (req);
  if (r < 0)
    return cli_fail (&e, NULL);
  if (as_json)
    r = cli_print_json (resp);
  else
    printf ("%s\n", json_string_value (json_object_get (resp, "token")) ?: "");
  json_decref (resp);
  return r < 0 ? CLI_EXIT_FAIL : 0;
}

int
cmd_project (cli_t *cli, int argc, char **argv)
{
  if (argc < 2 || strcmp (argv[1], "--help") == 0 || strcmp (argv[1], "-h") == 0)
    {
      cli_help ("project", argc < 2 ? stderr : stdout);
      return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
  if (strcmp (argv[1], "create") == 0)
    return project_create (cli, argc - 1, argv + 1);
  return cli_usage ("project", "unknown subcommand '%.64s'", argv[1]);
}

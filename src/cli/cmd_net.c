/* warren net (live policy, named services) and warren port (docs/network.md). */
#include "cli/cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static int
request (cli_t *cli, const char *method, const char *path, json_t *body, json_t **ret)
{
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    {
      json_decref (body);
      return CLI_EXIT_FAIL;
    }
  warren_error_t e;
  int r = warren_request (c, method, path, body, ret, &e);
  json_decref (body);
  return r < 0 ? cli_fail (&e, NULL) : 0;
}

static int
service (cli_t *cli, int argc, char **argv)
{
  const char *verb = "net service";
  if (argc < 1)
    return cli_usage (verb, "add, ls or rm");
  json_t *out = NULL;
  int r;
  if (strcmp (argv[0], "add") == 0)
    {
      if (argc < 3)
        return cli_usage (verb, "add NAME HOST[:PORT]...");
      json_t *targets = json_array ();
      for (int i = 2; i < argc; i++)
        json_array_append_new (targets, json_string (argv[i]));
      r = request (cli, "POST", "/v1/net/services",
                   json_pack ("{s:s,s:o}", "name", argv[1], "targets", targets), &out);
    }
  else if (strcmp (argv[0], "rm") == 0 && argc == 2)
    {
      char path[256];
      if (strlen (argv[1]) > 64 || strpbrk (argv[1], "/?#%"))
        return cli_usage (verb, "bad service name");
      snprintf (path, sizeof path, "/v1/net/services/%s", argv[1]);
      r = request (cli, "DELETE", path, NULL, &out);
    }
  else if (strcmp (argv[0], "ls") == 0)
    {
      bool as_json = argc == 2 && strcmp (argv[1], "--json") == 0;
      if (argc > 2 || (argc == 2 && !as_json))
        return cli_usage (verb, "ls [--json]");
      r = request (cli, "GET", "/v1/net/services", NULL, &out);
      if (r == 0 && as_json)
        cli_print_json (out);
      else if (r == 0)
        {
          size_t i, k;
          json_t *s, *t;
          printf ("%-20s %s\n", "NAME", "TARGETS");
          json_array_foreach (json_object_get (out, "services"), i, s)
          {
            char *name = cli_printable (json_string_value (json_object_get (s, "name")));
            printf ("%-20s", name);
            free (name);
            json_array_foreach (json_object_get (s, "targets"), k, t)
            {
              char *p = cli_printable (json_string_value (t));
              printf (" %s", p);
              free (p);
            }
            printf ("\n");
          }
        }
    }
  else
    return cli_usage (verb, "add NAME HOST[:PORT]... | ls [--json] | rm NAME");
  json_decref (out);
  return r;
}

int
cmd_net (cli_t *cli, int argc, char **argv)
{
  if (argc >= 2 && strcmp (argv[1], "service") == 0)
    return service (cli, argc - 2, argv + 2);
  static const struct option opts[] = { { "allow", required_argument, NULL, 'a' },
                                        { "deny", required_argument, NULL, 'd' },
                                        { "net-rate", required_argument, NULL, CLI_OPT_NET_RATE },
                                        { "net-conns", required_argument, NULL, CLI_OPT_NET_CONNS },
                                        { "json", no_argument, NULL, 'j' },
                                        { "help", no_argument, NULL, 'h' },
                                        { 0 } };
  json_t *change = json_object ();
  json_auto_t *limits = json_object (); /* {"net_limits": ...} of the PATCH */
  bool as_json = false;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    switch (opt)
      {
      case 'a':
      case 'd':
        json_object_set_new (change, opt == 'a' ? "allow" : "deny", json_string (optarg));
        break;
      case CLI_OPT_NET_RATE:
      case CLI_OPT_NET_CONNS:
        if (cli_create_opt (opt, optarg, limits, "net") < 0)
          {
            json_decref (change);
            return CLI_EXIT_USAGE;
          }
        break;
      case 'j':
        as_json = true;
        break;
      case 'h':
        json_decref (change);
        cli_help ("net", stdout);
        return 0;
      default:
        json_decref (change);
        return cli_bad_option ("net", argv);
      }
  json_t *net_limits = json_object_get (limits, "net_limits");
  if (argc - optind != 1 || (json_object_size (change) == 0 && net_limits == NULL)
      || !warren_id_valid (argv[optind]))
    {
      json_decref (change);
      return cli_usage ("net",
                        "ID [--allow RULES] [--deny RULES] [--net-rate KBPS] [--net-conns N]");
    }
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    {
      json_decref (change);
      return CLI_EXIT_FAIL;
    }
  warren_error_t e;
  json_t *out = NULL;
  if (net_limits == NULL)
    out = warren_sandbox_set_network (c, argv[optind], change, &e);
  else
    {
      /* the policy and the limits in one PATCH */
      char path[128];
      snprintf (path, sizeof path, "/v1/sandboxes/%s", argv[optind]);
      json_t *body = json_pack ("{s:O}", "net_limits", net_limits);
      if (json_object_size (change))
        json_object_set (body, "network", change);
      if (warren_request (c, "PATCH", path, body, &out, &e) < 0)
        out = NULL;
      json_decref (body);
    }
  json_decref (change);
  int r = out ? 0 : cli_fail (&e, NULL);
  if (r == 0 && as_json)
    cli_print_json (out);
  else if (r == 0)
    printf ("%s\n", json_string_value (json_object_get (out, "network")));
  json_decref (out);
  return r;
}

int
cmd_port (cli_t *cli, int argc, char **argv)
{
  uint64_t port;
  if (argc == 2 && (strcmp (argv[1], "--help") == 0 || strcmp (argv[1], "-h") == 0))
    return cli_help ("port", stdout), 0;
  if (argc != 3 || !warren_id_valid (argv[1]) || !cli_parse_u64 (argv[2], 1, 65535, &port))
    return cli_usage ("port", "ID PORT");
  char path[128];
  snprintf (path, sizeof path, "/v1/sandboxes/%s", argv[1]);
  json_t *out = NULL;
  int r = request (cli, "GET", path, NULL, &out); /* the sandbox must exist */
  json_decref (out);
  if (r != 0)
    return r;
  const char *host = warren_client_host (cli_client (cli));
  if (strncmp (host, "unix:", 5) == 0)
    printf ("%s /v1/sandboxes/%s/proxy/%llu/\n", host, argv[1], (unsigned long long)port);
  else
    printf ("%s%s/v1/sandboxes/%s/proxy/%llu/\n", strstr (host, "://") ? "" : "http://", host,
            argv[1], (unsigned long long)port);
  return 0;
}

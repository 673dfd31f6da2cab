/* fork, checkpoint, restore, diff (docs/cli.md). */
#include "cli/cli.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --json, --help and the verb's own options; returns >= 0 to exit with */
static int
opts (const char *verb, int argc, char **argv, bool *as_json, long *count, const char **path)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "help", no_argument, NULL, 'h' },
                                     { "count", required_argument, NULL, 'n' },
                                     { "path", required_argument, NULL, 'p' },
                                     { 0 } };
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, count ? "hn:" : "h", o, NULL)) != -1)
    {
      if (opt == 'h')
        {
          cli_help (verb, stdout);
          return 0;
        }
      else if (opt == 'j')
        *as_json = true;
      else if (opt == 'n' && count)
        {
          char *end;
          *count = strtol (optarg, &end, 10);
          if (*end || end == optarg)
            return cli_usage (verb, "-n takes a number");
        }
      else if (opt == 'p' && path)
        *path = optarg;
      else
        return cli_bad_option (verb, argv);
    }
  return -1;
}

static int
ids_ok (const char *verb, const char *id)
{
  if (!warren_id_valid (id))
    {
      cli_usage (verb, "invalid sandbox id");
      return 0;
    }
  return 1;
}

int
cmd_fork (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  long count = -1;
  int r = opts ("fork", argc, argv, &as_json, &count, NULL);
  if (r >= 0)
    return r;
  if (argc - optind != 1 || count < 0)
    return cli_usage ("fork", "expected ID -n N");
  if (!ids_ok ("fork", argv[optind]))
    return CLI_EXIT_USAGE;
  if (count < 1 || count > 100000)
    return cli_usage ("fork", "-n must be at least 1");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *res = warren_sandbox_fork (c, argv[optind], (unsigned)count, NULL, &e);
  if (res == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (res);
  size_t i;
  json_t *s;
  json_array_foreach (json_object_get (res, "sandboxes"), i, s)
      puts (json_string_value (json_object_get (s, "id")));
  return 0;
}

int
cmd_checkpoint (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int r = opts ("checkpoint", argc, argv, &as_json, NULL, NULL);
  if (r >= 0)
    return r;
  int n = argc - optind;
  if (n < 1 || n > 2)
    return cli_usage ("checkpoint", "expected ID [NAME]");
  if (!ids_ok ("checkpoint", argv[optind]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *res
      = warren_sandbox_checkpoint (c, argv[optind], n == 2 ? argv[optind + 1] : NULL, &e);
  if (res == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (res);
  char *p = cli_printable (json_string_value (json_object_get (res, "name")));
  puts (p ? p : "");
  free (p);
  return 0;
}

int
cmd_restore (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int r = opts ("restore", argc, argv, &as_json, NULL, NULL);
  if (r >= 0)
    return r;
  if (argc - optind != 2)
    return cli_usage ("restore", "expected ID NAME");
  if (!ids_ok ("restore", argv[optind]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *res = warren_sandbox_restore (c, argv[optind], argv[optind + 1], &e);
  if (res == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (res);
  printf ("%s restored to %s (%lld paths)\n", argv[optind], argv[optind + 1],
          (long long)json_integer_value (json_object_get (res, "changes")));
  return 0;
}

int
cmd_diff (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  const char *path = NULL;
  int r = opts ("diff", argc, argv, &as_json, NULL, &path);
  if (r >= 0)
    return r;
  int n = argc - optind;
  if (n < 1 || n > 3)
    return cli_usage ("diff", "expected ID [FROM] [TO]");
  if (!ids_ok ("diff", argv[optind]))
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *res = warren_sandbox_diff (c, argv[optind], n >= 2 ? argv[optind + 1] : NULL,
                                          n >= 3 ? argv[optind + 2] : NULL, path, &e);
  if (res == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (res);
  /* one line per path (A/M/D, size, path), then the text diffs */
  size_t i;
  json_t *ch;
  json_array_foreach (json_object_get (res, "changes"), i, ch)
  {
    const char *kind = json_string_value (json_object_get (ch, "kind"));
    char *p = cli_printable (json_string_value (json_object_get (ch, "path")));
    json_t *size = json_object_get (ch, "size");
    char sz[32] = "-";
    if (json_is_integer (size))
      snprintf (sz, sizeof sz, "%lld", (long long)json_integer_value (size));
    printf ("%c %10s %s%s\n", kind ? (char)(kind[0] - 32) : '?', sz, p ? p : "",
            strcmp (json_string_value (json_object_get (ch, "type")), "dir") == 0 ? "/" : "");
    free (p);
  }
  json_array_foreach (json_object_get (res, "changes"), i, ch)
  {
    const char *d = json_string_value (json_object_get (ch, "diff"));
    if (d && strcmp (json_string_value (json_object_get (ch, "kind")), "modified") == 0)
      fputs (d, stdout);
  }
  if (json_is_true (json_object_get (res, "truncated")))
    fprintf (stderr, "warren: diff truncated\n");
  return 0;
}

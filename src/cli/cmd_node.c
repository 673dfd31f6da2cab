/* Image, pool and node verbs. */
#include "cli/cli.h"

#include <getopt.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* --help / --json only; returns an exit status to stop with, or -1 to go on. */
static int
opts_json (const char *verb, int argc, char **argv, bool *as_json)
{
  static const struct option opts[]
      = { { "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' }, { 0 } };
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    {
      if (opt == 'h')
        return cli_help (verb, stdout), 0;
      if (opt == 'j' && as_json)
        *as_json = true;
      else
        return cli_bad_option (verb, argv);
    }
  return -1;
}

static bool
ref_ok (const char *verb, const char *ref)
{
  if (*ref == '\0' || strlen (ref) > 1024)
    {
      cli_usage (verb, "bad image reference");
      return false;
    }
  return true;
}

/* opts_json, then exactly nargs arguments if >= 0 (else usage), the first an image
 * reference when ref; an exit status to stop with, or -1 to go on. */
static int
verb_args (const char *verb, int argc, char **argv, bool *as_json, int nargs, const char *usage,
           bool ref)
{
  int r = opts_json (verb, argc, argv, as_json);
  if (r >= 0)
    return r;
  if (nargs >= 0 && argc - optind != nargs)
    return cli_usage (verb, "%s", usage);
  if (ref && !ref_ok (verb, argv[optind]))
    return CLI_EXIT_USAGE;
  return -1;
}

/* A verb that GETs one JSON document: after verb_args, get's answer (the
 * client in *ret_c when asked), or NULL with *status the exit status. */
static json_t *
get_json (cli_t *cli, const char *verb, int argc, char **argv, int nargs, bool *as_json,
          json_t *(*get) (warren_client_t *, warren_error_t *), warren_client_t **ret_c,
          int *status)
{
  *status = verb_args (verb, argc, argv, as_json, nargs, "unexpected argument", false);
  if (*status >= 0)
    return NULL;
  *status = CLI_EXIT_FAIL;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return NULL;
  warren_error_t e;
  json_t *j = get (c, &e);
  if (j == NULL)
    *status = cli_fail (&e, NULL);
  if (ret_c)
    *ret_c = c;
  return j;
}

/* "GROUP", "GROUP --help": the group's help; -1 to go on to a subcommand. */
static int
group_help (const char *group, int argc, char **argv)
{
  if (argc < 2 || strcmp (argv[1], "--help") == 0 || strcmp (argv[1], "-h") == 0)
    {
      cli_help (group, argc < 2 ? stderr : stdout);
      return argc < 2 ? CLI_EXIT_USAGE : 0;
    }
  return -1;
}

int
cli_daemon_path (warren_client_t *c, const char *verb, const char *what, const char **path,
                 char **abs)
{
  /* over a unix socket the daemon shares our filesystem but not our cwd */
  if (strncmp (warren_client_host (c), "unix:", 5) == 0)
    {
      *abs = realpath (*path, NULL);
      if (*abs == NULL)
        {
          cli_errorf ("cannot access %s: %s", *path, strerror (errno));
          return CLI_EXIT_FAIL;
        }
      *path = *abs;
    }
  else if ((*path)[0] != '/')
    return cli_usage (verb, "%s must be absolute on the daemon's host", what);
  return -1;
}

static void
print_image_line (const json_t *img)
{
  char *n = cli_printable (json_string_value (json_object_get (img, "name")));
  char *d = cli_printable (json_string_value (json_object_get (img, "digest")));
  printf ("%s %s\n", n, d);
  free (n);
  free (d);
}

static int
image_import (cli_t *cli, int argc, char **argv)
{
  int r = verb_args ("image import", argc, argv, NULL, 2, "expected NAME[:TAG] PATH", true);
  if (r >= 0)
    return r;
  const char *name = argv[optind], *path = argv[optind + 1];
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  _cleanup_free_ char *abs = NULL;
  r = cli_daemon_path (c, "image import", "PATH", &path, &abs);
  if (r >= 0)
    return r;
  warren_error_t e;
  json_auto_t *img = warren_image_import (c, name, path, &e);
  if (img == NULL)
    return cli_fail (&e, NULL);
  print_image_line (img);
  return 0;
}

static int
image_ls (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int status;
  json_auto_t *list
      = get_json (cli, "image ls", argc, argv, 0, &as_json, warren_image_list, NULL, &status);
  if (list == NULL)
    return status;
  if (as_json)
    return cli_print_json (list);
  int wn = 4;
  size_t i;
  json_t *img;
  json_array_foreach (list, i, img)
  {
    const char *n = json_string_value (json_object_get (img, "name"));
    if (n && (int)strlen (n) > wn)
      wn = (int)strlen (n) > 80 ? 80 : (int)strlen (n);
  }
  printf ("%-*s  %-19s  %6s  %10s  %s\n", wn, "NAME", "DIGEST", "LAYERS", "SIZE", "CREATED");
  json_array_foreach (list, i, img)
  {
    char *n = cli_printable (json_string_value (json_object_get (img, "name")));
    char *d = cli_printable (json_string_value (json_object_get (img, "digest")));
    if (strlen (d) > 19)
      d[19] = '\0';
    json_t *layers = json_object_get (img, "layers");
    long long nl = json_is_array (layers) ? (long long)json_array_size (layers)
                                          : (long long)json_integer_value (layers);
    char size[32], age[32];
    cli_size (json_number_value (json_object_get (img, "size")), size, sizeof size);
    cli_age (json_number_value (json_object_get (img, "created_at")), age, sizeof age);
    printf ("%-*s  %-19s  %6lld  %10s  %s\n", wn, n, d, nl, size, age);
    free (n);
    free (d);
  }
  return 0;
}

static int
image_inspect (cli_t *cli, int argc, char **argv)
{
  int r = verb_args ("image inspect", argc, argv, NULL, 1, "expected one image reference", true);
  if (r >= 0)
    return r;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *img = warren_image_inspect (c, argv[optind], &e);
  if (img == NULL)
    return cli_fail (&e, NULL);
  return cli_print_json (img);
}

static int
image_rm (cli_t *cli, int argc, char **argv)
{
  int r = opts_json ("image rm", argc, argv, NULL);
  if (r >= 0)
    return r;
  if (optind >= argc)
    return cli_usage ("image rm", "expected at least one image reference");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  int status = 0;
  for (int i = optind; i < argc; i++)
    {
      warren_error_t e;
      if (warren_image_rm (c, argv[i], &e) < 0)
        {
          char *p = cli_printable (argv[i]);
          status = cli_fail (&e, p);
          free (p);
        }
      else
        puts (argv[i]);
    }
  return status;
}

int
cmd_image (cli_t *cli, int argc, char **argv)
{
  int h = group_help ("image", argc, argv);
  if (h >= 0)
    return h;
  const char *sub = argv[1];
  int more = cli_image_more (cli, sub, argc - 1, argv + 1);
  if (more >= 0)
    return more;
  if (strcmp (sub, "import") == 0)
    return image_import (cli, argc - 1, argv + 1);
  if (strcmp (sub, "ls") == 0 || strcmp (sub, "list") == 0)
    return image_ls (cli, argc - 1, argv + 1);
  if (strcmp (sub, "inspect") == 0)
    return image_inspect (cli, argc - 1, argv + 1);
  if (strcmp (sub, "rm") == 0)
    return image_rm (cli, argc - 1, argv + 1);
  return cli_usage ("image", "unknown image command '%.64s'", sub);
}

static int
pool_ls (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int status;
  json_auto_t *p
      = get_json (cli, "pool ls", argc, argv, -1, &as_json, warren_pools_get, NULL, &status);
  if (p == NULL)
    return status;
  json_t *pools = json_object_get (p, "pools");
  if (as_json || !json_is_array (pools))
    return cli_print_json (p); /* unknown shape: show it as is */
  printf ("%-40s  %6s  %6s\n", "IMAGE", "SIZE", "READY");
  size_t i;
  json_t *pl;
  json_array_foreach (pools, i, pl)
  {
    char *img = cli_printable (json_string_value (json_object_get (pl, "image")));
    printf ("%-40s  %6lld  %6lld\n", img,
            (long long)json_integer_value (json_object_get (pl, "size")),
            (long long)json_integer_value (json_object_get (pl, "ready")));
    free (img);
  }
  return 0;
}

static int
pool_set (cli_t *cli, int argc, char **argv)
{
  int r = verb_args ("pool set", argc, argv, NULL, 2, "expected IMAGE N", true);
  if (r >= 0)
    return r;
  uint64_t n;
  if (!cli_parse_u64 (argv[optind + 1], 0, 1000000, &n))
    return cli_usage ("pool set", "N must be an integer in [0, 1000000]");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *res = warren_pool_set (c, argv[optind], (unsigned)n, &e);
  if (res == NULL)
    return cli_fail (&e, NULL);
  return 0;
}

int
cmd_pool (cli_t *cli, int argc, char **argv)
{
  int h = group_help ("pool", argc, argv);
  if (h >= 0)
    return h;
  if (strcmp (argv[1], "ls") == 0 || strcmp (argv[1], "list") == 0)
    return pool_ls (cli, argc - 1, argv + 1);
  if (strcmp (argv[1], "set") == 0)
    return pool_set (cli, argc - 1, argv + 1);
  return cli_usage ("pool", "unknown pool command '%.64s'", argv[1]);
}

int
cmd_health (cli_t *cli, int argc, char **argv)
{
  bool as_json = false;
  int st;
  warren_client_t *c = NULL;
  json_auto_t *h = get_json (cli, "health", argc, argv, -1, &as_json, warren_healthz, &c, &st);
  if (h == NULL)
    return st;
  const char *status = json_string_value (json_object_get (h, "status"));
  bool ok = status && strcmp (status, "ok") == 0;
  if (as_json)
    cli_print_json (h);
  else
    {
      char *s = cli_printable (status),
           *v = cli_printable (json_string_value (json_object_get (h, "version")));
      printf ("%s: %s, %lld sandboxes, version %s\n", warren_client_host (c), s,
              (long long)json_integer_value (json_object_get (h, "sandboxes")), v);
      free (s);
      free (v);
    }
  return ok ? 0 : CLI_EXIT_FAIL;
}

int
cmd_metrics (cli_t *cli, int argc, char **argv)
{
  int r = opts_json ("metrics", argc, argv, NULL);
  if (r >= 0)
    return r;
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  _cleanup_free_ char *text = warren_metrics (c, &e);
  if (text == NULL)
    return cli_fail (&e, NULL);
  fputs (text, stdout);
  return 0;
}

/* warren image tag | pull | push | build | gc, with a progress bar on a terminal
 * and plain lines otherwise (docs/cli.md, docs/images.md). */
#include "cli/cli.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

struct progress
{
  bool tty;
  char what[32];
  int last_pct;
  bool drawn;
};

static void
progress_cb (void *ud, const char *what, uint64_t done, uint64_t total)
{
  struct progress *p = ud;
  int pct = total ? (int)(done * 100 / total) : 0;
  if (pct > 100)
    pct = 100;
  bool new_step = strncmp (p->what, what, sizeof p->what - 1) != 0;
  if (!new_step && pct == p->last_pct)
    return;
  if (p->tty)
    {
      if (new_step && p->drawn)
        fputc ('\n', stderr);
      int w = pct * 30 / 100;
      char unit[64];
      if (strcmp (what, "download") == 0)
        snprintf (unit, sizeof unit, "%.1f/%.1f MB", done / 1e6, total / 1e6);
      else
        snprintf (unit, sizeof unit, "%llu/%llu", (unsigned long long)done,
                  (unsigned long long)total);
      fprintf (stderr, "\r%-9.9s [%.*s%*s] %3d%% %s\033[K", what, w,
               "##############################", 30 - w, "", pct, unit);
      p->drawn = true;
    }
  else if (new_step || pct == 100 || pct / 10 != p->last_pct / 10)
    fprintf (stderr, "%s %llu/%llu\n", what, (unsigned long long)done, (unsigned long long)total);
  snprintf (p->what, sizeof p->what, "%s", what);
  p->last_pct = pct;
  fflush (stderr);
}

static void
progress_end (struct progress *p)
{
  if (p->tty && p->drawn)
    fputc ('\n', stderr);
}

static int
print_result (const json_t *img, bool as_json)
{
  if (as_json)
    return cli_print_json (img);
  char *name = cli_printable (json_string_value (json_object_get (img, "name")));
  printf ("%s %s\n", name, json_string_value (json_object_get (img, "digest")));
  free (name);
  return 0;
}

struct image_flags
{
  bool as_json, quiet, insecure, upload;
  const char *file, *context;
};

/* Parse the flags of table o (a subset of --json, --quiet (no progress),
 * --insecure, --file, --context, --upload, --help) into f. Returns optind, or < 0 with
 * *ret the exit status to stop with. */
static int
image_opts (const char *verb, int argc, char **argv, const struct option *o, const char *shortopts,
            struct image_flags *f, int *ret)
{
  optind = 1;
  int c;
  while ((c = getopt_long (argc, argv, shortopts, o, NULL)) != -1)
    switch (c)
      {
      case 'j':
        f->as_json = true;
        break;
      case 'q':
        f->quiet = true;
        break;
      case 'i':
        f->insecure = true;
        break;
      case 'f':
        f->file = optarg;
        break;
      case 'c':
        f->context = optarg;
        break;
      case 'u':
        f->upload = true;
        break;
      case 'h':
        cli_help (verb, stdout);
        *ret = 0;
        return -1;
      default:
        *ret = cli_bad_option (verb, argv);
        return -1;
      }
  return optind;
}

/* Common flags: --json, --quiet. Returns optind or < 0. */
static int
simple_opts (const char *verb, int argc, char **argv, bool *as_json, bool *quiet, int *ret)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  struct image_flags f = { 0 };
  int i = image_opts (verb, argc, argv, o, "qh", &f, ret);
  *as_json = f.as_json;
  *quiet = f.quiet;
  return i;
}

static int
image_tag (cli_t *cli, int argc, char **argv)
{
  bool as_json = false, quiet = false;
  int ret, i = simple_opts ("image tag", argc, argv, &as_json, &quiet, &ret);
  if (i < 0)
    return ret;
  if (argc - i != 2)
    return cli_usage ("image tag", "expected SRC DST");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *img = warren_image_tag (c, argv[i], argv[i + 1], &e);
  if (img == NULL)
    return cli_fail (&e, NULL);
  return print_result (img, as_json);
}

static int
image_gc (cli_t *cli, int argc, char **argv)
{
  bool as_json = false, quiet = false;
  int ret, i = simple_opts ("image gc", argc, argv, &as_json, &quiet, &ret);
  if (i < 0)
    return ret;
  if (argc != i)
    return cli_usage ("image gc", "no arguments expected");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  warren_error_t e;
  json_auto_t *r = warren_image_gc (c, &e);
  if (r == NULL)
    return cli_fail (&e, NULL);
  if (as_json)
    return cli_print_json (r);
  printf ("removed %lld layers, %lld images; %lld layers, %lld images left\n",
          (long long)json_integer_value (json_object_get (r, "removed_layers")),
          (long long)json_integer_value (json_object_get (r, "removed_images")),
          (long long)json_integer_value (json_object_get (r, "layers")),
          (long long)json_integer_value (json_object_get (r, "images")));
  return 0;
}

/* a registry on loopback: plain HTTP is what the user means */
static bool
on_loopback (const char *ref)
{
  return strncmp (ref, "127.", 4) == 0 || strncmp (ref, "localhost", 9) == 0
         || strncmp (ref, "[::1]", 5) == 0;
}

static int
image_pull (cli_t *cli, int argc, char **argv)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "insecure", no_argument, NULL, 'i' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  struct image_flags f = { 0 };
  int ret;
  if (image_opts ("image pull", argc, argv, o, "qh", &f, &ret) < 0)
    return ret;
  bool as_json = f.as_json, quiet = f.quiet, insecure = f.insecure;
  if (argc - optind < 1 || argc - optind > 2)
    return cli_usage ("image pull", "expected REF [NAME[:TAG]]");
  const char *ref = argv[optind];
  insecure = insecure || on_loopback (ref);
  warren_client_t *cl = cli_client (cli);
  if (cl == NULL)
    return CLI_EXIT_FAIL;
  struct progress p = { .tty = isatty (2), .last_pct = -1 };
  warren_error_t e;
  json_auto_t *img = warren_image_pull (cl, ref, argc - optind == 2 ? argv[optind + 1] : NULL,
                                        insecure, quiet ? NULL : progress_cb, &p, &e);
  progress_end (&p);
  if (img == NULL)
    return cli_fail (&e, NULL);
  return print_result (img, as_json);
}

static int
image_push (cli_t *cli, int argc, char **argv)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "insecure", no_argument, NULL, 'i' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  struct image_flags f = { 0 };
  int ret;
  if (image_opts ("image push", argc, argv, o, "qh", &f, &ret) < 0)
    return ret;
  bool insecure = f.insecure;
  if (argc - optind != 2)
    return cli_usage ("image push", "expected REF HOST[:PORT]/NAME[:TAG]");
  const char *target = argv[optind + 1];
  insecure = insecure || on_loopback (target);
  warren_client_t *cl = cli_client (cli);
  if (cl == NULL)
    return CLI_EXIT_FAIL;
  struct progress p = { .tty = isatty (2), .last_pct = -1 };
  warren_error_t e;
  json_auto_t *r = warren_image_push (cl, argv[optind], target, insecure,
                                      f.quiet ? NULL : progress_cb, &p, &e);
  progress_end (&p);
  if (r == NULL)
    return cli_fail (&e, NULL);
  if (f.as_json)
    return print_result (r, true);
  printf ("pushed %s to %s (%s): %lld blobs uploaded, %lld already there\n",
          json_string_value (json_object_get (r, "ref")),
          json_string_value (json_object_get (r, "target")),
          json_string_value (json_object_get (r, "digest")),
          (long long)json_integer_value (json_object_get (r, "uploaded")),
          (long long)json_integer_value (json_object_get (r, "skipped")));
  return 0;
}

static int
image_build (cli_t *cli, int argc, char **argv)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "file", required_argument, NULL, 'f' },
                                     { "context", required_argument, NULL, 'c' },
                                     { "upload", no_argument, NULL, 'u' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  struct image_flags fl = { 0 };
  int ret;
  if (image_opts ("image build", argc, argv, o, "qhf:c:", &fl, &ret) < 0)
    return ret;
  bool as_json = fl.as_json, quiet = fl.quiet;
  const char *file = fl.file, *context = fl.context;
  if (argc - optind != 1 || file == NULL)
    return cli_usage ("image build", "expected NAME[:TAG] -f SPEC [--context DIR] [--upload]");
  int fd = strcmp (file, "-") == 0 ? dup (0) : open (file, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    {
      cli_errorf ("cannot open %s: %s", file, strerror (errno));
      return CLI_EXIT_FAIL;
    }
  size_t len = 0;
  _cleanup_free_ char *spec = cli_slurp (fd, file, 256 << 10, &len);
  close (fd);
  if (spec == NULL)
    return CLI_EXIT_FAIL;
  if (memchr (spec, '\0', len))
    {
      cli_errorf ("%s is not a text file", file);
      return CLI_EXIT_FAIL;
    }
  warren_client_t *cl = cli_client (cli);
  if (cl == NULL)
    return CLI_EXIT_FAIL;
  /* Over a unix socket the daemon reads the context itself (it shares our
   * filesystem: resolve it here); over TCP, or with --upload, the context
   * is ours and goes up as a tar (docs/api.md, Uploads). Default: the
   * spec's directory. */
  _cleanup_free_ char *abs = NULL;
  bool local = strncmp (warren_client_host (cl), "unix:", 5) == 0;
  bool upload = fl.upload || !local;
  if (context == NULL && (local || upload) && strcmp (file, "-") != 0)
    {
      _cleanup_free_ char *f = realpath (file, NULL);
      char *slash = f ? strrchr (f, '/') : NULL;
      if (slash)
        {
          *slash = '\0';
          abs = strdup (f[0] ? f : "/");
        }
    }
  else if (context && !upload)
    {
      int r = cli_daemon_path (cl, "image build", "--context", &context, &abs);
      if (r >= 0)
        return r;
    }
  if (abs)
    context = abs;
  struct progress p = { .tty = isatty (2), .last_pct = -1 };
  warren_error_t e;
  json_auto_t *img = upload && context ? warren_image_build_upload (
                         cl, argv[optind], spec, context, quiet ? NULL : progress_cb, &p, &e)
                                       : warren_image_build (cl, argv[optind], spec, context,
                                                             quiet ? NULL : progress_cb, &p, &e);
  progress_end (&p);
  if (img == NULL)
    return cli_fail (&e, NULL);
  if (!as_json && !quiet)
    {
      size_t i;
      json_t *st;
      json_array_foreach (json_object_get (img, "steps"), i, st)
      {
        char *t = cli_printable (json_string_value (json_object_get (st, "step")));
        fprintf (stderr, "step %zu%s: %.100s\n", i + 1,
                 json_is_true (json_object_get (st, "cached")) ? " (cached)" : "", t);
        free (t);
      }
    }
  return print_result (img, as_json);
}

/* image import: with a progress bar on a terminal, and through an upload
 * over TCP or with --upload (the other cases are cmd_node.c's image_import) */
static int
image_import_progress (cli_t *cli, int argc, char **argv)
{
  static const struct option o[] = { { "json", no_argument, NULL, 'j' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "upload", no_argument, NULL, 'u' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  struct image_flags f = { 0 };
  int ret, i = image_opts ("image import", argc, argv, o, "qh", &f, &ret);
  if (i < 0)
    return ret;
  if (argc - i != 2)
    return cli_usage ("image import", "expected NAME[:TAG] PATH [--upload]");
  const char *path = argv[i + 1];
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  bool upload = f.upload || strncmp (warren_client_host (c), "unix:", 5) != 0;
  _cleanup_free_ char *abs = NULL;
  if (!upload && (ret = cli_daemon_path (c, "image import", "PATH", &path, &abs)) >= 0)
    return ret;
  struct progress p = { .tty = isatty (2), .last_pct = -1 };
  warren_progress_fn fn = f.quiet || !p.tty ? NULL : progress_cb;
  warren_error_t e;
  json_auto_t *img = upload ? warren_image_import_upload (c, argv[i], path, fn, &p, &e)
                            : warren_image_import_progress (c, argv[i], path, fn, &p, &e);
  progress_end (&p);
  if (img == NULL)
    return cli_fail (&e, NULL);
  return print_result (img, f.as_json);
}

/* Is this an import cmd_node.c's plain image_import cannot do? */
static bool
import_here (cli_t *cli, int argc, char **argv)
{
  if (isatty (2))
    return true;
  for (int i = 1; i < argc && strcmp (argv[i], "--") != 0; i++)
    if (strcmp (argv[i], "--upload") == 0 || strcmp (argv[i], "--json") == 0)
      return true;
  for (int i = 1; i < argc; i++)
    if (strcmp (argv[i], "-h") == 0 || strcmp (argv[i], "--help") == 0)
      return false;
  warren_client_t *c = cli_client (cli);
  return c && strncmp (warren_client_host (c), "unix:", 5) != 0;
}

int
cli_image_more (cli_t *cli, const char *sub, int argc, char **argv)
{
  if (strcmp (sub, "tag") == 0)
    return image_tag (cli, argc, argv);
  if (strcmp (sub, "pull") == 0)
    return image_pull (cli, argc, argv);
  if (strcmp (sub, "push") == 0)
    return image_push (cli, argc, argv);
  if (strcmp (sub, "build") == 0)
    return image_build (cli, argc, argv);
  if (strcmp (sub, "gc") == 0)
    return image_gc (cli, argc, argv);
  if (strcmp (sub, "defaults") == 0)
    return cli_image_defaults (cli, argc, argv);
  if (strcmp (sub, "import") == 0 && import_here (cli, argc, argv))
    return image_import_progress (cli, argc, argv);
  return -1;
}

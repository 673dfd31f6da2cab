/* warren image defaults [--lang LIST]: build (cached, from Debian packages)
 * and import the default image base:bookworm and the language images
 * lang-LANG:bookworm into the daemon WARREN_HOST names (docs/images.md,
 * "Default and language images").
 *
 * The root file systems come from scripts/mk-debian-rootfs.sh and
 * scripts/mk-lang-rootfs.sh (cached tarballs under /var/cache/warren); they
 * travel to the daemon through /v1/uploads, so a TCP daemon works too. A
 * language image is base:bookworm plus one layer (an image build: FROM the
 * base, COPY the layer's tree), so all of them share the base layer. What
 * was imported is remembered in the daemon as the tag
 * warren-defaults:<cache key>: a second run with the same tarballs and
 * images finds the tag on the same manifest and imports nothing. */
#include "cli/cli.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"

extern char **environ;

#define DEFAULT_IMAGE "base:bookworm"
#define MAX_LANGS 32

/* The directory holding mk-debian-rootfs.sh: $WARREN_SCRIPTS_DIR, else
 * next to an installed warren (PREFIX/bin -> PREFIX/share/warren/scripts),
 * else the source tree's scripts/ (B/bin/warren -> scripts/). */
static char *
scripts_dir (void)
{
  const char *env = getenv ("WARREN_SCRIPTS_DIR");
  if (env && *env)
    return strdup (env);
  char self[PATH_MAX];
  ssize_t n = readlink ("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0)
    return NULL;
  self[n] = '\0';
  char *slash = strrchr (self, '/');
  if (slash == NULL)
    return NULL;
  *slash = '\0';
  static const char *const rel[] = { "/../share/warren/scripts", "/../../scripts" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (rel); i++)
    {
      char cand[PATH_MAX + 64];
      snprintf (cand, sizeof cand, "%s%s/mk-debian-rootfs.sh", self, rel[i]);
      if (access (cand, R_OK) == 0)
        {
          *strrchr (cand, '/') = '\0';
          return realpath (cand, NULL);
        }
    }
  return NULL;
}

/* Run `bash DIR/SCRIPT ARGS...` with stderr passed through; returns its
 * stdout's last line (trimmed) or NULL after printing why. *ret_status gets
 * the exit status (-1 if it did not run). */
static char *
run_script (const char *dir, const char *script, const char *arg1, const char *arg2,
            int *ret_status)
{
  *ret_status = -1;
  char path[PATH_MAX];
  snprintf (path, sizeof path, "%s/%s", dir, script);
  int p[2];
  if (pipe2 (p, O_CLOEXEC) < 0)
    {
      cli_errorf ("pipe: %s", strerror (errno));
      return NULL;
    }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init (&fa);
  posix_spawn_file_actions_adddup2 (&fa, p[1], 1);
  char *argv[] = { "bash", path, (char *)arg1, (char *)arg2, NULL };
  pid_t pid;
  int r = posix_spawnp (&pid, "bash", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy (&fa);
  close (p[1]);
  if (r != 0)
    {
      close (p[0]);
      cli_errorf ("cannot run %s: %s", path, strerror (r));
      return NULL;
    }
  size_t len = 0;
  char *out = cli_slurp (p[0], script, 1 << 20, &len);
  close (p[0]);
  int st;
  while (waitpid (pid, &st, 0) < 0 && errno == EINTR)
    ;
  *ret_status = WIFEXITED (st) ? WEXITSTATUS (st) : 128 + WTERMSIG (st);
  if (out == NULL)
    return NULL;
  while (len > 0 && (out[len - 1] == '\n' || out[len - 1] == ' '))
    out[--len] = '\0';
  char *last = strrchr (out, '\n');
  if (last)
    memmove (out, last + 1, strlen (last + 1) + 1);
  return out;
}

/* "warren-defaults:<the tarball's name without .tar.zst>": the tag that
 * says which cached tarball an image was made from. */
static void
marker_tag (const char *tarball, char *buf, size_t n)
{
  const char *base = strrchr (tarball, '/') ? strrchr (tarball, '/') + 1 : tarball;
  size_t len = strlen (base);
  if (len > 8 && strcmp (base + len - 8, ".tar.zst") == 0)
    len -= 8;
  snprintf (buf, n, "warren-defaults:%.*s", (int)len, base);
}

static const char *
digest_of (const json_t *img)
{
  return json_string_value (json_object_get (img, "digest"));
}

/* The image ref, or NULL when it does not exist (other errors too: then
 * the import that follows says what is wrong). */
static json_t *
inspect_quiet (warren_client_t *c, const char *ref)
{
  warren_error_t e;
  return warren_image_inspect (c, ref, &e);
}

/* Is ref the image marker names (same manifest)? */
static bool
up_to_date (warren_client_t *c, const char *ref, const char *marker, json_t **ret_img)
{
  json_t *img = inspect_quiet (c, ref);
  json_auto_t *m = inspect_quiet (c, marker);
  bool same = img && m && digest_of (img) && digest_of (m)
              && strcmp (digest_of (img), digest_of (m)) == 0;
  if (ret_img)
    *ret_img = img;
  else
    json_decref (img);
  return same;
}

/* Does img's layer list start with base's? */
static bool
stacked_on (const json_t *img, const json_t *base)
{
  const json_t *il = json_object_get (img, "layers"), *bl = json_object_get (base, "layers");
  if (!json_is_array (il) || !json_is_array (bl) || json_array_size (il) <= json_array_size (bl))
    return false;
  for (size_t i = 0; i < json_array_size (bl); i++)
    if (!json_equal (json_array_get (il, i), json_array_get (bl, i)))
      return false;
  return true;
}

static int
tag_marker (warren_client_t *c, const char *ref, const char *marker)
{
  warren_error_t e;
  json_auto_t *t = warren_image_tag (c, ref, marker, &e);
  return t ? 0 : cli_fail (&e, "tag");
}

static int
import_base (warren_client_t *c, const char *dir, bool quiet, json_t **ret_base)
{
  int st;
  _cleanup_free_ char *tarball = run_script (dir, "mk-debian-rootfs.sh", NULL, NULL, &st);
  if (tarball == NULL || st != 0 || *tarball != '/')
    {
      cli_errorf ("building the default image's root file system failed (exit %d)", st);
      return CLI_EXIT_FAIL;
    }
  char marker[256];
  marker_tag (tarball, marker, sizeof marker);
  if (up_to_date (c, DEFAULT_IMAGE, marker, ret_base))
    {
      if (!quiet)
        fprintf (stderr, "defaults: %s is up to date (%s)\n", DEFAULT_IMAGE, tarball);
      printf ("%s %s\n", DEFAULT_IMAGE, digest_of (*ret_base));
      return 0;
    }
  json_decref (*ret_base);
  *ret_base = NULL;
  if (!quiet)
    fprintf (stderr, "defaults: importing %s from %s\n", DEFAULT_IMAGE, tarball);
  warren_error_t e;
  json_t *img = warren_image_import_upload (c, DEFAULT_IMAGE, tarball, NULL, NULL, &e);
  if (img == NULL)
    return cli_fail (&e, "import " DEFAULT_IMAGE);
  *ret_base = img;
  printf ("%s %s\n", DEFAULT_IMAGE, digest_of (img));
  return tag_marker (c, DEFAULT_IMAGE, marker);
}

static int
import_lang (warren_client_t *c, const char *dir, const char *lang, const json_t *base, bool quiet)
{
  int st;
  _cleanup_free_ char *layer = run_script (dir, "mk-lang-rootfs.sh", lang, NULL, &st);
  if (layer == NULL || st != 0 || *layer != '/')
    {
      cli_errorf ("building the %s layer failed (exit %d)", lang, st);
      return CLI_EXIT_FAIL;
    }
  char name[128], marker[256];
  snprintf (name, sizeof name, "lang-%s:bookworm", lang);
  marker_tag (layer, marker, sizeof marker);
  json_auto_t *img = NULL;
  if (up_to_date (c, name, marker, &img) && stacked_on (img, base))
    {
      if (!quiet)
        fprintf (stderr, "defaults: %s is up to date (%s)\n", name, layer);
      printf ("%s %s\n", name, digest_of (img));
      return 0;
    }
  if (!quiet)
    fprintf (stderr, "defaults: building %s: %s on %s\n", name, layer, DEFAULT_IMAGE);
  /* FROM by digest: the layer goes on exactly the base just checked */
  char spec[512];
  snprintf (spec, sizeof spec, "FROM %s@%s\nCOPY . /\nLABEL warren.lang=%s\n", DEFAULT_IMAGE,
            digest_of (base), lang);
  warren_error_t e;
  char upload[33];
  if (warren_upload_path (c, layer, NULL, NULL, upload, &e) < 0)
    return cli_fail (&e, "upload");
  json_auto_t *req = json_pack ("{s:s,s:s,s:s,s:b}", "name", name, "spec", spec, "context_upload",
                                upload, "stream", true);
  json_auto_t *built = req ? warren_image_op (c, "/v1/images/build", req, NULL, NULL, &e) : NULL;
  if (built == NULL)
    return req ? cli_fail (&e, name) : CLI_EXIT_FAIL;
  printf ("%s %s\n", name, digest_of (built));
  return tag_marker (c, name, marker);
}

/* Split LIST (comma-separated) into the images its languages run in; each
 * must be known to mk-lang-rootfs.sh, which names a language's image
 * (go_test runs in go's, --image). Languages in the base image are dropped,
 * an image named twice is imported once. Returns the count (langs[] owned
 * by the caller), or -1 after printing why. */
static int
parse_langs (const char *dir, char *list, char **langs)
{
  int n = 0;
  for (char *save = NULL, *l = strtok_r (list, ",", &save); l; l = strtok_r (NULL, ",", &save))
    {
      if (strspn (l, "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen (l))
        {
          cli_usage ("image defaults", "bad language name '%.64s'", l);
          goto fail;
        }
      int st;
      _cleanup_free_ char *pkgs = run_script (dir, "mk-lang-rootfs.sh", "--packages", l, &st);
      if (pkgs == NULL || st != 0)
        {
          cli_usage ("image defaults", "unknown language '%.64s' (warren image defaults --list)",
                     l);
          goto fail;
        }
      if (*pkgs == '\0')
        continue; /* python, bash, c, cpp: in the base image */
      char *image = run_script (dir, "mk-lang-rootfs.sh", "--image", l, &st);
      if (image == NULL || st != 0 || *image == '\0')
        {
          free (image);
          cli_errorf ("mk-lang-rootfs.sh names no image for '%.64s'", l);
          goto fail;
        }
      bool dup = false;
      for (int k = 0; k < n; k++)
        dup |= strcmp (langs[k], image) == 0;
      if (dup)
        {
          free (image);
          continue;
        }
      if (n == MAX_LANGS)
        {
          free (image);
          cli_usage ("image defaults", "at most %d languages", MAX_LANGS);
          goto fail;
        }
      langs[n++] = image;
    }
  return n;
fail:
  while (n > 0)
    free (langs[--n]);
  return -1;
}

int
cli_image_defaults (cli_t *cli, int argc, char **argv)
{
  static const struct option o[] = { { "lang", required_argument, NULL, 'l' },
                                     { "list", no_argument, NULL, 'L' },
                                     { "quiet", no_argument, NULL, 'q' },
                                     { "help", no_argument, NULL, 'h' },
                                     { NULL, 0, NULL, 0 } };
  _cleanup_free_ char *list = NULL;
  bool quiet = false, show = false;
  optind = 1;
  int ch;
  while ((ch = getopt_long (argc, argv, "l:qh", o, NULL)) != -1)
    switch (ch)
      {
      case 'l':
        free (list);
        list = strdup (optarg);
        break;
      case 'L':
        show = true;
        break;
      case 'q':
        quiet = true;
        break;
      case 'h':
        cli_help ("image defaults", stdout);
        return 0;
      default:
        return cli_bad_option ("image defaults", argv);
      }
  if (optind != argc)
    return cli_usage ("image defaults", "unexpected argument '%.64s'", argv[optind]);
  _cleanup_free_ char *dir = scripts_dir ();
  if (dir == NULL)
    {
      cli_errorf ("cannot find mk-debian-rootfs.sh: set WARREN_SCRIPTS_DIR");
      return CLI_EXIT_FAIL;
    }
  if (show)
    {
      int st;
      _cleanup_free_ char *all = run_script (dir, "mk-lang-rootfs.sh", "--list", NULL, &st);
      if (all == NULL || st != 0)
        return CLI_EXIT_FAIL;
      puts (all);
      return 0;
    }
  char *langs[MAX_LANGS];
  int n = 0;
  if (list && (n = parse_langs (dir, list, langs)) < 0)
    return CLI_EXIT_USAGE;
  warren_client_t *c = cli_client (cli);
  int r = CLI_EXIT_FAIL;
  json_auto_t *base = NULL;
  if (c)
    r = import_base (c, dir, quiet, &base);
  for (int i = 0; i < n && r == 0; i++)
    r = import_lang (c, dir, langs[i], base, quiet);
  for (int i = 0; i < n; i++)
    free (langs[i]);
  return r;
}

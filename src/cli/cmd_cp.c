/* warren cp: stream one file into or out of a sandbox. */
#include "cli/cli.h"

#include <fcntl.h>
#include <getopt.h>
#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

/* "ID:PATH" -> true with id filled; anything else is a local path. */
static bool
split_remote (const char *arg, char id[static 129], const char **ret_path)
{
  const char *colon = strchr (arg, ':');
  if (colon == NULL || colon == arg || colon - arg > 128)
    return false;
  memcpy (id, arg, (size_t)(colon - arg));
  id[colon - arg] = '\0';
  if (!warren_id_valid (id))
    return false;
  *ret_path = colon + 1;
  return true;
}

/* The last component of p, ignoring trailing slashes; NULL when none. */
static char *
last_name (const char *p)
{
  _cleanup_free_ char *copy = strdup (p);
  if (copy == NULL)
    abort ();
  size_t n = strlen (copy);
  while (n > 1 && copy[n - 1] == '/')
    copy[--n] = '\0';
  const char *b = strrchr (copy, '/');
  b = b ? b + 1 : copy;
  if (*b == '\0' || strcmp (b, ".") == 0 || strcmp (b, "..") == 0)
    return NULL;
  return strdup (b);
}

static int
upload (warren_client_t *c, const char *src, const char *id, const char *rpath)
{
  bool from_stdin = strcmp (src, "-") == 0;
  _cleanup_close_ int fd = -1;
  int mode = -1;
  if (!from_stdin)
    {
      fd = open (src, O_RDONLY | O_CLOEXEC | O_NOCTTY);
      if (fd < 0)
        {
          cli_errorf ("cannot open %s: %s", src, strerror (errno));
          return CLI_EXIT_FAIL;
        }
      struct stat st;
      if (fstat (fd, &st) < 0)
        {
          cli_errorf ("cannot stat %s: %s", src, strerror (errno));
          return CLI_EXIT_FAIL;
        }
      if (S_ISDIR (st.st_mode))
        {
          cli_errorf ("%s is a directory (cp copies single files)", src);
          return CLI_EXIT_FAIL;
        }
      mode = (int)(st.st_mode & 07777);
    }
  _cleanup_free_ char *full = NULL;
  if (rpath[strlen (rpath) - 1] == '/')
    {
      _cleanup_free_ char *name = from_stdin ? NULL : last_name (src);
      if (name == NULL)
        return cli_usage ("cp", "%s ends in '/': give the file name", rpath);
      if (asprintf (&full, "%s%s", rpath, name) < 0)
        abort ();
      rpath = full;
    }
  warren_error_t e;
  if (warren_file_put_fd (c, id, rpath, from_stdin ? STDIN_FILENO : fd, mode, 0, &e) < 0)
    return cli_fail (&e, NULL);
  return 0;
}

static int
download (warren_client_t *c, const char *id, const char *rpath, const char *dst)
{
  warren_error_t e;
  if (strcmp (dst, "-") == 0)
    {
      if (warren_file_get_fd (c, id, rpath, STDOUT_FILENO, NULL, &e) < 0)
        return cli_fail (&e, NULL);
      return 0;
    }
  _cleanup_free_ char *full = NULL;
  struct stat st;
  bool exists = stat (dst, &st) == 0;
  if ((exists && S_ISDIR (st.st_mode)) || dst[strlen (dst) - 1] == '/')
    {
      _cleanup_free_ char *name = last_name (rpath);
      if (name == NULL)
        return cli_usage ("cp", "cannot tell a file name from '%.64s'", rpath);
      if (asprintf (&full, "%s%s%s", dst, dst[strlen (dst) - 1] == '/' ? "" : "/", name) < 0)
        abort ();
      dst = full;
      exists = stat (dst, &st) == 0;
    }
  if (exists && !S_ISREG (st.st_mode))
    {
      /* A device or fifo (/dev/stdout, a named pipe): write straight into it. */
      _cleanup_close_ int fd = open (dst, O_WRONLY | O_CLOEXEC | O_NOCTTY);
      if (fd < 0)
        {
          cli_errorf ("cannot open %s: %s", dst, strerror (errno));
          return CLI_EXIT_FAIL;
        }
      if (warren_file_get_fd (c, id, rpath, fd, NULL, &e) < 0)
        return cli_fail (&e, NULL);
      return 0;
    }
  /* Write a temp file next to dst and rename it over: a failed transfer never
   * leaves a truncated file behind. */
  _cleanup_free_ char *dcopy = strdup (dst), *bcopy = strdup (dst), *tmp = NULL;
  if (dcopy == NULL || bcopy == NULL
      || asprintf (&tmp, "%s/.%s.warren-XXXXXX", dirname (dcopy), basename (bcopy)) < 0)
    abort ();
  _cleanup_close_ int fd = mkostemp (tmp, O_CLOEXEC);
  if (fd < 0)
    {
      cli_errorf ("cannot create %s: %s", dst, strerror (errno));
      return CLI_EXIT_FAIL;
    }
  mode_t mask = umask (0);
  umask (mask);
  int r = warren_file_get_fd (c, id, rpath, fd, NULL, &e);
  if (r == 0 && exists)
    r = fchmod (fd, st.st_mode & 07777);
  else if (r == 0)
    r = fchmod (fd, 0666 & ~mask);
  if (r == 0 && rename (tmp, dst) < 0)
    {
      cli_errorf ("cannot write %s: %s", dst, strerror (errno));
      unlink (tmp);
      return CLI_EXIT_FAIL;
    }
  if (r < 0)
    {
      unlink (tmp);
      return cli_fail (&e, NULL);
    }
  return 0;
}

int
cmd_cp (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { { "help", no_argument, NULL, 'h' }, { 0 } };
  int opt;
  optind = 0;
  /* No '+': "-" is an operand, and options may follow the operands. */
  while ((opt = getopt_long (argc, argv, "h", opts, NULL)) != -1)
    {
      if (opt == 'h')
        return cli_help ("cp", stdout), 0;
      return cli_bad_option ("cp", argv);
    }
  if (argc - optind != 2)
    return cli_usage ("cp", "expected SRC DST");
  const char *src = argv[optind], *dst = argv[optind + 1];
  char sid[129], did[129];
  const char *spath = NULL, *dpath = NULL;
  bool sremote = split_remote (src, sid, &spath), dremote = split_remote (dst, did, &dpath);
  if (sremote == dremote)
    return cli_usage ("cp", sremote ? "both sides are in sandboxes; copy through a local file"
                                    : "one side must be ID:PATH");
  const char *rpath = sremote ? spath : dpath;
  if (rpath[0] != '/' || strlen (rpath) > 4096)
    return cli_usage ("cp", "the sandbox path must be absolute, got '%.64s'", rpath);
  if (*(sremote ? dst : src) == '\0')
    return cli_usage ("cp", "empty local path");
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  return sremote ? download (c, sid, spath, dst) : upload (c, src, did, dpath);
}

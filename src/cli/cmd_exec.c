/* Command verbs: exec (streaming), run (create + exec + remove), call. */
#include "cli/cli.h"

#include <fcntl.h>
#include <getopt.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

#define STDIN_MAX (64u << 20)

enum
{
  OPT_TIMEOUT = 1000,
  OPT_ENV,
  OPT_CWD,
  OPT_STDIN_FILE,
  OPT_HELP,
  OPT_STEP, /* trajectory log: a client step id (docs/rl.md) */
};

#define EXEC_LONGOPTS                                                                              \
  { "timeout", required_argument, NULL, OPT_TIMEOUT },                                             \
      { "env", required_argument, NULL, OPT_ENV }, { "cwd", required_argument, NULL, OPT_CWD },    \
      { "stdin", no_argument, NULL, 'i' }, { "interactive", no_argument, NULL, 'i' },              \
      { "step", required_argument, NULL, OPT_STEP },                                               \
  {                                                                                                \
    "help", no_argument, NULL, 'h'                                                                 \
  }

struct exec_opts
{
  double timeout; /* 0 = daemon default */
  bool stdin_all;
};

/* Handle one exec flag into req; 1 handled, 0 not ours, -1 bad value. */
static int
exec_opt (int opt, const char *arg, json_t *req, struct exec_opts *o, const char *verb)
{
  switch (opt)
    {
    case OPT_TIMEOUT:
      if (!cli_parse_seconds (arg, 86400, &o->timeout))
        return cli_usage (verb, "--timeout: expected seconds in (0, 86400], got '%.32s'", arg), -1;
      json_object_set_new (req, "timeout_s", json_real (o->timeout));
      return 1;
    case OPT_ENV:
      return cli_add_env (req, arg, verb) ? 1 : -1;
    case OPT_CWD:
      {
        json_t *v = json_string (arg);
        if (v == NULL || *arg == '\0' || strlen (arg) > 4096)
          {
            json_decref (v);
            return cli_usage (verb, "bad --cwd"), -1;
          }
        json_object_set_new (req, "cwd", v);
        return 1;
      }
    case 'i':
      o->stdin_all = true;
      return 1;
    case OPT_STEP: /* trajectory log */
      if (*arg == '\0' || strlen (arg) > 256)
        return cli_usage (verb, "--step: expected 1 to 256 bytes"), -1;
      json_object_set_new (req, "step", json_string (arg));
      return 1;
    default:
      return 0;
    }
}

/* Split "[--] CMD [ARG...]" off argv[start..]; returns the CMD index or -1. */
static int
cmd_start (int argc, char **argv, int start)
{
  if (start < argc && strcmp (argv[start], "--") == 0)
    start++;
  return start < argc ? start : -1;
}

static bool
attach_stdin (json_t *req, int fd, const char *what)
{
  size_t len;
  _cleanup_free_ char *data = cli_slurp (fd, what, STDIN_MAX, &len);
  if (data == NULL)
    return false;
  warren_error_t e;
  if (warren_json_set_bytes (req, "stdin", data, len, &e) < 0)
    {
      cli_fail (&e, NULL);
      return false;
    }
  return true;
}

/* exec and run: the command after argv[after] ("[--] CMD [ARG...]") and, when
 * asked, stdin into req; then the client. NULL with *status set to stop. */
static warren_client_t *
cmd_request (cli_t *cli, int argc, char **argv, int after, const char *verb, const char *what,
             json_t *req, const struct exec_opts *o, int *status)
{
  *status = CLI_EXIT_USAGE;
  int ci = cmd_start (argc, argv, after + 1);
  if (ci < 0)
    {
      *status = cli_usage (verb, "expected a command after the %s", what);
      return NULL;
    }
  json_auto_t *cmd = cli_cmd_request (argc - ci, argv + ci);
  if (cmd == NULL)
    return NULL;
  json_object_update (req, cmd);
  *status = CLI_EXIT_OWN;
  if (o->stdin_all && !attach_stdin (req, STDIN_FILENO, "stdin"))
    return NULL;
  return cli_client (cli);
}

/* The end of the command's stderr, to avoid repeating an error message the
 * sandbox already printed there. */
struct tail
{
  char buf[1024];
  size_t len;
};

static void
tail_add (struct tail *t, const void *data, size_t len)
{
  if (len >= sizeof t->buf - 1)
    {
      memcpy (t->buf, (const char *)data + len - (sizeof t->buf - 1), sizeof t->buf - 1);
      t->len = sizeof t->buf - 1;
    }
  else
    {
      if (t->len + len > sizeof t->buf - 1)
        {
          size_t drop = t->len + len - (sizeof t->buf - 1);
          memmove (t->buf, t->buf + drop, t->len - drop);
          t->len -= drop;
        }
      memcpy (t->buf + t->len, data, len);
      t->len += len;
    }
  t->buf[t->len] = '\0';
}

static int
write_out (void *ud, int stream, const void *data, size_t len)
{
  if (stream == WARREN_STDERR)
    tail_add (ud, data, len);
  int r = wr_write_all (stream == WARREN_STDERR ? STDERR_FILENO : STDOUT_FILENO, data, len);
  return r < 0 ? -1 : 0;
}

/* Print what the result says beyond the exit code; return the shell status. */
static int
report (const json_t *res, double timeout, const struct tail *t)
{
  const char *msg = json_string_value (json_object_get (res, "error"));
  if (msg && *msg && !(t && strstr (t->buf, msg)))
    {
      char *p = cli_printable (msg);
      cli_errorf ("%s", p);
      free (p);
    }
  if (json_is_true (json_object_get (res, "timed_out")))
    {
      if (timeout > 0)
        cli_errorf ("command timed out after %g s", timeout);
      else
        cli_errorf ("command timed out");
    }
  if (json_is_true (json_object_get (res, "truncated")))
    cli_errorf ("output was truncated by the daemon's output cap");
  return warren_result_status (res);
}

static int
failed_request (const warren_error_t *e)
{
  if (cli_interrupted)
    {
      cli_errorf ("interrupted");
      return 128 + cli_interrupted;
    }
  if (strcmp (e->code, WARREN_E_TOO_LARGE) == 0)
    cli_errorf ("%s (stdin travels inline, up to ~1 MiB; use 'warren cp' for larger input)",
                e->message);
  else
    cli_fail (e, NULL);
  return warren_err_is_infra (e) ? CLI_EXIT_INFRA : CLI_EXIT_OWN;
}

static int
stream_exec (warren_client_t *c, const char *id, json_t *req, double timeout)
{
  warren_client_set_cancel_flag (c, &cli_interrupted);
  warren_error_t e;
  struct tail t = { .len = 0 };
  json_auto_t *res = warren_exec_stream (c, id, req, write_out, &t, &e);
  warren_client_set_cancel_flag (c, NULL);
  if (res == NULL)
    return failed_request (&e);
  return report (res, timeout, &t);
}

/* The flags of exec, or of run when create is given (its create flags go
 * there), up to the first argument. An exit status to stop with, or -1. */
static int
exec_flags (const char *verb, int argc, char **argv, const struct option *opts, json_t *create,
            json_t *req, struct exec_opts *o)
{
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+ih", opts, NULL)) != -1)
    {
      if (create && opt == 'I')
        return cli_usage (verb, "the image is the first argument of run, not --image");
      int r = create ? cli_create_opt (opt, optarg, create, verb) : 0;
      if (r == 0)
        r = exec_opt (opt, optarg, req, o, verb);
      if (r < 0)
        return CLI_EXIT_USAGE;
      if (r > 0)
        continue;
      if (opt == 'h')
        return cli_help (verb, stdout), 0;
      return cli_bad_option (verb, argv);
    }
  return -1;
}

int
cmd_exec (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { EXEC_LONGOPTS, { 0 } };
  json_auto_t *req = json_object ();
  struct exec_opts o = { 0 };
  int pr = exec_flags ("exec", argc, argv, opts, NULL, req, &o);
  if (pr >= 0)
    return pr;
  if (optind >= argc)
    return cli_usage ("exec", "expected ID -- CMD [ARG...]");
  const char *id = argv[optind];
  if (!warren_id_valid (id))
    return cli_usage ("exec", "invalid sandbox id '%.64s' (expected [a-z0-9-])", id);
  int status;
  warren_client_t *c
      = cmd_request (cli, argc, argv, optind, "exec", "sandbox id", req, &o, &status);
  if (c == NULL)
    return status;
  cli_trap_signals ();
  return stream_exec (c, id, req, o.timeout);
}

int
cmd_run (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { CLI_CREATE_LONGOPTS, EXEC_LONGOPTS, { 0 } };
  json_auto_t *create = json_object ();
  json_auto_t *req = json_object ();
  struct exec_opts o = { 0 };
  int pr = exec_flags ("run", argc, argv, opts, create, req, &o);
  if (pr >= 0)
    return pr;
  if (optind >= argc)
    return cli_usage ("run", "expected IMAGE -- CMD [ARG...]");
  const char *image = argv[optind];
  json_t *iv = json_string (image);
  if (iv == NULL || *image == '\0' || strlen (image) > 1024)
    {
      json_decref (iv);
      return cli_usage ("run", "bad image reference");
    }
  json_object_set_new (create, "image", iv);
  int rc;
  warren_client_t *c = cmd_request (cli, argc, argv, optind, "run", "image", req, &o, &rc);
  if (c == NULL)
    return rc;

  /* Signals are trapped before the create, which is never cancelled: a create
   * abandoned half way could leave a sandbox whose id we never learned. */
  cli_trap_signals ();
  warren_error_t e;
  json_auto_t *sb = warren_sandbox_create (c, create, &e);
  if (sb == NULL)
    return failed_request (&e);
  const char *sid = json_string_value (json_object_get (sb, "id"));
  if (sid == NULL || !warren_id_valid (sid))
    {
      cli_errorf ("the daemon answered without a valid sandbox id");
      return CLI_EXIT_OWN;
    }
  _cleanup_free_ char *id = strdup (sid);
  int status;
  if (cli_interrupted)
    {
      cli_errorf ("interrupted");
      status = 128 + cli_interrupted;
    }
  else
    status = stream_exec (c, id, req, o.timeout);
  if (warren_sandbox_delete (c, id, &e) < 0 && strcmp (e.code, WARREN_E_NOT_FOUND) != 0)
    {
      char what[160];
      snprintf (what, sizeof what, "removing sandbox %s", id);
      cli_fail (&e, what);
    }
  return status;
}

int
cmd_call (cli_t *cli, int argc, char **argv)
{
  static const struct option opts[] = { { "image", required_argument, NULL, 'I' },
                                        { "memory", required_argument, NULL, 'M' },
                                        { "timeout", required_argument, NULL, OPT_TIMEOUT },
                                        { "env", required_argument, NULL, OPT_ENV },
                                        { "stdin", required_argument, NULL, OPT_STDIN_FILE },
                                        { "python", required_argument, NULL, 'P' },
                                        { "mode", required_argument, NULL, 'm' },
                                        { "help", no_argument, NULL, 'h' },
                                        { 0 } };
  json_auto_t *req = json_object ();
  struct exec_opts o = { 0 };
  const char *stdin_file = NULL, *code = NULL;
  int opt;
  optind = 0;
  while ((opt = getopt_long (argc, argv, "+h", opts, NULL)) != -1)
    {
      int r = 0;
      if (opt == 'I' || opt == 'M')
        r = cli_create_opt (opt, optarg, req, "call");
      else if (opt == OPT_TIMEOUT || opt == OPT_ENV)
        r = exec_opt (opt, optarg, req, &o, "call");
      else if (opt == OPT_STDIN_FILE)
        {
          stdin_file = optarg;
          r = 1;
        }
      else if (opt == 'P' || opt == 'm')
        {
          /* fncall Python form: code runs in the pool's preloaded interpreter */
          if (opt == 'P')
            code = optarg;
          else
            json_object_set_new (req, "mode", json_string (optarg));
          r = 1;
        }
      if (r < 0)
        return CLI_EXIT_USAGE;
      if (r > 0)
        continue;
      if (opt == 'h')
        return cli_help ("call", stdout), 0;
      return cli_bad_option ("call", argv);
    }
  int ci = cmd_start (argc, argv, optind);
  if (code)
    {
      if (ci >= 0)
        return cli_usage ("call", "--python CODE takes no command");
      json_object_set_new (req, "lang", json_string ("python"));
      json_object_set_new (req, "code", json_string (code));
    }
  else
    {
      if (ci < 0)
        return cli_usage ("call", "expected -- CMD [ARG...] (or --python CODE)");
      json_auto_t *cmd = cli_cmd_request (argc - ci, argv + ci);
      if (cmd == NULL)
        return CLI_EXIT_USAGE;
      json_object_update (req, cmd);
    }
  if (stdin_file)
    {
      bool is_std = strcmp (stdin_file, "-") == 0;
      _cleanup_close_ int fd = is_std ? -1 : open (stdin_file, O_RDONLY | O_CLOEXEC | O_NOCTTY);
      if (!is_std && fd < 0)
        {
          cli_errorf ("cannot open %s: %s", stdin_file, strerror (errno));
          return CLI_EXIT_OWN;
        }
      if (!attach_stdin (req, is_std ? STDIN_FILENO : fd, stdin_file))
        return CLI_EXIT_OWN;
    }
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_OWN;
  cli_trap_signals ();
  warren_client_set_cancel_flag (c, &cli_interrupted);
  warren_error_t e;
  json_auto_t *res = warren_call (c, req, &e);
  warren_client_set_cancel_flag (c, NULL);
  if (res == NULL)
    return failed_request (&e);
  static const struct
  {
    const char *key;
    int fd;
  } outs[] = { { "stdout", STDOUT_FILENO }, { "stderr", STDERR_FILENO } };
  struct tail t = { .len = 0 };
  for (size_t i = 0; i < WR_ARRAY_SIZE (outs); i++)
    {
      _cleanup_free_ void *data = NULL;
      size_t len = 0;
      if (warren_result_bytes (res, outs[i].key, &data, &len, &e) < 0)
        {
          cli_fail (&e, NULL);
          return CLI_EXIT_OWN;
        }
      if (outs[i].fd == STDERR_FILENO)
        tail_add (&t, data, len);
      int w = len ? wr_write_all (outs[i].fd, data, len) : 0;
      if (w < 0 && outs[i].fd == STDOUT_FILENO)
        {
          cli_errorf ("writing output: %s", strerror (-w));
          return CLI_EXIT_OWN;
        }
    }
  return report (res, o.timeout, &t);
}

/* warren: command line front end of libwarren (docs/cli.md). */
#include "cli/cli.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/bench.h"
#include "common/util.h"

struct help
{
  const char *verb;
  const char *text;
};

#define CREATE_FLAGS                                                                               \
  "  --backend B     container | microvm | vm (default: container)\n"                              \
  "  --image REF     image NAME[:TAG] (default: the daemon's default image)\n"                     \
  "  --layer REF     extra layer image stacked on top (repeatable)\n"                              \
  "  --memory MB     memory limit\n"                                                               \
  "  --cpus N        CPU limit (fractions allowed)\n"                                              \
  "  --disk MB       writable layer size\n"                                                        \
  "  --ttl SEC       destroy the sandbox after SEC seconds\n"                                      \
  "  --net MODE      none (loopback only, default) | host | allow=RULE,...\n"                      \
  "  --net-group G   with allow=: sandboxes of group G reach each other\n"                         \
  "  --net-rate KBPS with allow=: what the sandbox may send, in kbit/s (default unlimited)\n"      \
  "  --net-conns N   with allow=: connections it may have open at once (default unlimited)\n"      \
  "  --seed N        deterministic sandbox: fixed hostname, uptime from 0, PYTHONHASHSEED=N\n"     \
  "  --epoch T       with --seed: SOURCE_DATE_EPOCH=T (default 0)\n"                               \
  "  --qos CLASS     latency (default) | best-effort: yields the CPU to latency sandboxes\n"       \
  "  --idle-pause S  pause after S seconds without requests; the next one resumes it\n"

#define EXEC_FLAGS                                                                                 \
  "  --timeout S     kill the command after S seconds (default 600); exit status 124\n"            \
  "  --env K=V       environment variable (repeatable)\n"                                          \
  "  --cwd DIR       working directory inside the sandbox\n"                                       \
  "  -i, --stdin     send warren's whole stdin as the command's stdin\n"                           \
  "  --step ID       client step id: a repeat answers from the trajectory log\n"

static const struct help helps[] = {
  { "create", "Usage: warren create [FLAGS]\n"
              "Create a sandbox and print its id.\n" CREATE_FLAGS
              "  --json          print the whole sandbox object\n" },
  { "exec", "Usage: warren exec [--timeout S] [--env K=V]... [--cwd DIR] [-i] ID -- CMD [ARG...]\n"
            "Run CMD in sandbox ID, streaming its stdout/stderr as produced. Exits with the\n"
            "command's status (128+N when killed by signal N, 124 on timeout, 125 when\n"
            "warren itself failed).\n" EXEC_FLAGS },
  { "run", "Usage: warren run [CREATE FLAGS] [EXEC FLAGS] IMAGE -- CMD [ARG...]\n"
           "Create a sandbox from IMAGE, run CMD in it (streaming), then remove it, also\n"
           "on error or interrupt. Exits with the command's status.\n" CREATE_FLAGS EXEC_FLAGS },
  { "call", "Usage: warren call [--image REF] [--timeout S] [--memory MB] [--stdin FILE]\n"
            "                   [--env K=V]... -- CMD [ARG...]\n"
            "       warren call [--image REF] ... --python CODE [--mode fork|reuse]\n"
            "Run CMD as one stateless job in a warm fncall pool; prints its output and exits\n"
            "with its status. --stdin FILE sends FILE ('-' for warren's stdin). --python runs\n"
            "CODE in the pool's preloaded interpreter (docs/fncall.md).\n" },
  { "cp", "Usage: warren cp SRC DST\n"
          "Copy a file into or out of a sandbox; exactly one side is ID:PATH. '-' is\n"
          "stdin (SRC) or stdout (DST). Binary safe, streamed. A DST ending in '/' or\n"
          "naming a local directory receives the source's base name. Write ./a:b for a\n"
          "local file whose name contains ':'.\n" },
  { "ls", "Usage: warren ls [--json]\nList sandboxes: ID BACKEND IMAGE STATE AGE.\n" },
  { "inspect", "Usage: warren inspect ID\nPrint a sandbox as JSON.\n" },
  { "rm", "Usage: warren rm ID...\n"
          "Remove sandboxes; keeps going after a failure and exits 1 if any failed.\n" },
  { "pause", "Usage: warren pause ID\n"
             "Freeze a sandbox and reclaim its memory (into the node's compressed swap when\n"
             "warrend runs with --zram-size). Any exec or file request resumes it.\n" },
  { "resume", "Usage: warren resume ID\nPrefetch a paused sandbox's memory and thaw it.\n" },
  { "pack", "Usage: warren pack ID NAME[:TAG]\n"
            "Snapshot the sandbox's writable layer into a new image.\n" },
  { "image",
    "Usage: warren image import NAME[:TAG] PATH | ls [--json] | inspect REF | rm REF...\n"
    "       warren image tag SRC DST | pull REF [NAME] | build NAME[:TAG] -f SPEC [--context DIR]"
    " | gc\n"
    "       warren image defaults [--lang LIST]\n" },
  { "image defaults",
    "Usage: warren image defaults [--lang LIST] [--list] [--quiet]\n"
    "Build (cached, from Debian packages) and import base:bookworm and, for each language\n"
    "of LIST (comma-separated, e.g. go,java,nodejs,rust), lang-LANG:bookworm: the base plus\n"
    "that toolchain's layer. python, bash, c and cpp are in the base; a test framework runs\n"
    "in its language's image (go_test in lang-go, junit in lang-java, typescript and jest\n"
    "in lang-nodejs). A second run imports nothing. --list: the known languages.\n" },
  { "image tag",
    "Usage: warren image tag SRC DST [--json]\nPoint DST (NAME[:TAG]) at SRC's manifest.\n" },
  { "image pull",
    "Usage: warren image pull [--insecure] [--quiet] [--json] HOST[:PORT]/REPO[:TAG|@DIGEST] "
    "[NAME[:TAG]]\n"
    "Pull from an OCI registry over plain HTTP (--insecure; implied for loopback).\n" },
  { "image push",
    "Usage: warren image push [--insecure] [--quiet] [--json] REF HOST[:PORT]/NAME[:TAG]\n"
    "Push a stored image (its EROFS layers, docs/images.md) to an OCI registry; blobs the\n"
    "registry has are skipped. Plain HTTP with --insecure (implied for loopback).\n" },
  { "image build",
    "Usage: warren image build NAME[:TAG] -f SPEC [--context DIR] [--upload] [--quiet] [--json]\n"
    "Build from FROM/RUN/COPY/ENV/WORKDIR/USER/LABEL steps (docs/images.md); steps are cached.\n"
    "The context defaults to the spec's directory; over http (or --upload) it is local and\n"
    "sent as a tar through /v1/uploads.\n" },
  { "image gc", "Usage: warren image gc [--json]\nRemove manifests and layers nothing uses.\n" },
  { "image import", "Usage: warren image import [--upload] [--json] NAME[:TAG] PATH\n"
                    "Import a rootfs directory or a .tar/.tar.gz/.tar.zst (an OCI layout or\n"
                    "docker-save archive where the daemon supports it). Over a unix socket the\n"
                    "daemon reads PATH (made absolute here); over http, or with --upload, PATH\n"
                    "is local and sent through /v1/uploads (a directory as a tar).\n" },
  { "image ls",
    "Usage: warren image ls [--json]\nList images: NAME DIGEST LAYERS SIZE CREATED.\n" },
  { "image inspect", "Usage: warren image inspect REF\nPrint an image as JSON.\n" },
  { "image rm", "Usage: warren image rm REF...\nRemove images; exits 1 if any failed.\n" },
  { "pool", "Usage: warren pool ls [--json] | set IMAGE N\n"
            "Show or set warm pool sizes (N = 0 disables the pool of IMAGE).\n" },
  { "pool ls", "Usage: warren pool ls [--json]\nShow warm pools.\n" },
  { "pool set", "Usage: warren pool set IMAGE N\nKeep N ready sandboxes of IMAGE.\n" },
  { "health", "Usage: warren health [--json]\nCheck the daemon; exit 0 when it reports ok.\n" },
  { "metrics", "Usage: warren metrics\nPrint the daemon's Prometheus metrics.\n" },
  /* cluster verbs (cmd_cluster.c), answered by a warren-gateway */
  { "node", "Usage: warren node ls [--json] | drain NAME | undrain NAME\n"
            "Cluster nodes, through a gateway (docs/cluster.md).\n" },
  { "node ls", "Usage: warren node ls [--json]\n"
               "List nodes: NAME STATE ADDRESS SANDBOXES FREE_MB LABELS.\n" },
  { "node drain", "Usage: warren node drain NAME\n"
                  "No new sandboxes are placed on NAME; its sandboxes keep running.\n" },
  { "node undrain", "Usage: warren node undrain NAME\nPlace sandboxes on NAME again.\n" },
  /* trajectory log (cmd_log.c, docs/rl.md) */
  { "net", "Usage: warren net ID [--allow RULES] [--deny RULES] [--net-rate KBPS] [--net-conns N]\n"
           "       warren net service add NAME HOST[:PORT]... | ls [--json] | rm NAME\n"
           "Change a live sandbox's network policy (RULES: comma-separated service names,\n"
           "HOST:PORT, HOST:*, CIDR[:PORTS]) or its egress limits (kbit/s it may send,\n"
           "connections it may have open; 0: unlimited), or manage named services\n"
           "(docs/network.md).\n" },
  { "net service", "Usage: warren net service add NAME HOST[:PORT]... | ls [--json] | rm NAME\n"
                   "Named services for allow= rules, kept by the daemon.\n" },
  { "port", "Usage: warren port ID PORT\n"
            "Print the daemon's URL that proxies HTTP to PORT inside the sandbox\n"
            "(authenticated like the rest of the API).\n" },
  { "log", "Usage: warren log [--json] ID\n"
           "Print a sandbox's trajectory log: every exec, file change and lifecycle event in\n"
           "order with its result (also after the sandbox is gone, within the retention).\n" },
  { "replay", "Usage: warren replay [--until STEP] [--json] ID\n"
              "Create a sandbox from ID's image and re-run ID's logged execs and file changes up\n"
              "to step STEP (all of them without --until); print the new id. Its steps up to\n"
              "STEP answer with the recorded results, new ones run live.\n" },
  /* group fork, checkpoints, diffs (cmd_fork.c, docs/cli.md) */
  { "fork", "Usage: warren fork [--json] ID -n N\n"
            "N new sandboxes starting from ID's current file system (ID is frozen while its\n"
            "writable layer is snapshot, then runs on); prints their ids.\n" },
  { "checkpoint", "Usage: warren checkpoint [--json] ID [NAME]\n"
                  "Snapshot ID's file system as NAME (default ckpt-N); see warren inspect ID.\n" },
  { "restore", "Usage: warren restore [--json] ID NAME\n"
               "Put ID's file system back to checkpoint NAME; processes keep running.\n" },
  { "diff", "Usage: warren diff [--json] [--path P] ID [FROM] [TO]\n"
            "Paths added (A), modified (M) or deleted (D) with sizes, then unified diffs of\n"
            "text files. FROM and TO: image, now or a checkpoint (defaults: image, now).\n" },
  { "project", "Usage: warren project create NAME --max-sandboxes N [--max-memory MB]"
               " [--priority P] [--json]\n" },
  { "project create",
    "Usage: warren project create NAME --max-sandboxes N [--max-memory MB] [--priority P]"
    " [--json]\n"
    "Create a project with a quota and print its token (shown once). Requests made with\n"
    "that token count against the quota.\n" },
};

static const char main_usage[]
    = "Usage: warren [--host HOST] [--token-file FILE] COMMAND [ARGS...]\n"
      "\n"
      "Sandboxes:  create, ls, inspect, rm, exec, run, cp, pause, resume, pack\n"
      "Network:    net ID --allow | --deny, net service add | ls | rm, port\n"
      "Functions:  call\n"
      "Images:     image import | ls | inspect | rm | tag | pull | push | build | gc | defaults\n"
      "Node:       pool ls | set, health, metrics, bench\n"
      "RL:         log, replay, fork, checkpoint, restore, diff\n"
      "Cluster:    node ls | drain | undrain, project create (through a gateway)\n"
      "\n"
      "Options:\n"
      "  --host HOST        unix:/path/sock, http://host:port or tcp:host:port, or a\n"
      "                     comma-separated list of gateways to fail over between\n"
      "                     (env WARREN_HOST; default unix:$WARREN_ROOT/warrend.sock,\n"
      "                     else unix:/var/lib/warren/warrend.sock)\n"
      "  --token-file FILE  bearer token for TCP (env WARREN_TOKEN_FILE, or the token\n"
      "                     itself in WARREN_TOKEN)\n"
      "  --version          print the version\n"
      "  -h, --help         this help; 'warren COMMAND --help' for a command\n";

void
cli_help (const char *verb, FILE *f)
{
  for (size_t i = 0; i < WR_ARRAY_SIZE (helps); i++)
    if (strcmp (helps[i].verb, verb) == 0)
      {
        fputs (helps[i].text, f);
        return;
      }
  fputs (main_usage, f);
}

void
cli_errorf (const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  fputs ("warren: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
}

int
cli_fail (const warren_error_t *e, const char *prefix)
{
  const char *hint = "";
  if (strcmp (e->code, WARREN_E_UNAUTHORIZED) == 0)
    hint = " (check --token-file / WARREN_TOKEN)";
  if (prefix)
    cli_errorf ("%s: %s%s", prefix, e->message, hint);
  else
    cli_errorf ("%s%s", e->message, hint);
  return warren_err_is_infra (e) ? CLI_EXIT_INFRA : CLI_EXIT_FAIL;
}

int
cli_usage (const char *verb, const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  fputs ("warren: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
  fprintf (stderr, "Try 'warren %s%s--help'.\n", verb ? verb : "", verb && *verb ? " " : "");
  return CLI_EXIT_USAGE;
}

int
cli_bad_option (const char *verb, char **argv)
{
  const char *a = optind > 0 ? argv[optind - 1] : "";
  if (optopt && a[0] == '-' && a[1] != '-')
    return cli_usage (verb, "unknown option '-%c' or missing value", optopt);
  return cli_usage (verb, "unknown option '%.64s' or missing value", a);
}

warren_client_t *
cli_client (cli_t *cli)
{
  if (cli->client)
    return cli->client;
  warren_error_t e;
  cli->client = warren_client_new (cli->host, cli->token, &e);
  if (cli->client == NULL)
    cli_fail (&e, NULL);
  return cli->client;
}

bool
cli_parse_u64 (const char *s, uint64_t min, uint64_t max, uint64_t *ret)
{
  if (s == NULL || *s < '0' || *s > '9')
    return false;
  errno = 0;
  char *end;
  unsigned long long v = strtoull (s, &end, 10);
  if (errno || *end || v < min || v > max)
    return false;
  *ret = v;
  return true;
}

bool
cli_parse_seconds (const char *s, double max, double *ret)
{
  if (s == NULL || *s == '\0')
    return false;
  char *end;
  errno = 0;
  double v = strtod (s, &end);
  if (errno || *end || !isfinite (v) || v <= 0 || v > max)
    return false;
  *ret = v;
  return true;
}

char *
cli_printable (const char *s)
{
  char *out = strdup (s ? s : "-");
  if (out == NULL)
    abort ();
  for (char *p = out; *p; p++)
    if ((unsigned char)*p < 0x20 || *p == 0x7f)
      *p = '?';
  return out;
}

int
cli_print_json (const json_t *j)
{
  char *s = json_dumps (j, JSON_INDENT (2) | JSON_ENCODE_ANY);
  if (s == NULL)
    {
      cli_errorf ("cannot format the response");
      return CLI_EXIT_FAIL;
    }
  puts (s);
  free (s);
  return 0;
}

void
cli_age (double t, char *buf, size_t n)
{
  struct timespec now;
  clock_gettime (CLOCK_REALTIME, &now);
  double d = (double)now.tv_sec + now.tv_nsec / 1e9 - t;
  if (!(t > 0) || !isfinite (d))
    snprintf (buf, n, "-");
  else if (d < 0)
    snprintf (buf, n, "0s");
  else if (d < 120)
    snprintf (buf, n, "%.0fs", d);
  else if (d < 7200)
    snprintf (buf, n, "%.0fm", d / 60);
  else if (d < 172800)
    snprintf (buf, n, "%.0fh", d / 3600);
  else
    snprintf (buf, n, "%.0fd", d / 86400);
}

void
cli_size (double b, char *buf, size_t n)
{
  static const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
  size_t i = 0;
  while (b >= 1024 && i + 1 < WR_ARRAY_SIZE (u))
    b /= 1024, i++;
  snprintf (buf, n, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

json_t *
cli_cmd_request (int argc, char **argv)
{
  json_t *req = json_object ();
  json_t *cmd = json_array ();
  json_object_set_new (req, "cmd", cmd);
  for (int i = 0; i < argc; i++)
    {
      json_t *a = json_string (argv[i]);
      if (a == NULL)
        {
          cli_errorf ("argument %d of the command is not valid UTF-8", i + 1);
          json_decref (req);
          return NULL;
        }
      json_array_append_new (cmd, a);
    }
  return req;
}

bool
cli_add_env (json_t *req, const char *kv, const char *verb)
{
  const char *eq = strchr (kv, '=');
  bool ok = eq && eq != kv && !(kv[0] >= '0' && kv[0] <= '9');
  for (const char *p = kv; ok && p < eq; p++)
    ok = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9')
         || *p == '_';
  if (!ok)
    {
      cli_usage (verb, "bad --env '%.64s': expected NAME=VALUE", kv);
      return false;
    }
  json_t *env = json_object_get (req, "env");
  if (env == NULL)
    {
      env = json_object ();
      json_object_set_new (req, "env", env);
    }
  char name[256];
  if ((size_t)(eq - kv) >= sizeof name)
    {
      cli_usage (verb, "--env name too long");
      return false;
    }
  memcpy (name, kv, (size_t)(eq - kv));
  name[eq - kv] = '\0';
  json_t *v = json_string (eq + 1);
  if (v == NULL)
    {
      cli_errorf ("--env %s: value is not valid UTF-8", name);
      return false;
    }
  json_object_set_new (env, name, v);
  return true;
}

char *
cli_slurp (int fd, const char *what, size_t max, size_t *ret_len)
{
  size_t len = 0, cap = 65536;
  char *buf = malloc (cap + 1); /* + 1: always NUL terminated for text callers */
  if (buf == NULL)
    abort ();
  for (;;)
    {
      if (len == cap)
        {
          if (cap > max)
            {
              cli_errorf ("%s is larger than %zu bytes", what, max);
              free (buf);
              return NULL;
            }
          cap *= 2;
          char *nb = realloc (buf, cap + 1);
          if (nb == NULL)
            abort ();
          buf = nb;
        }
      ssize_t n = read (fd, buf + len, cap - len);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        {
          cli_errorf ("reading %s: %s", what, strerror (errno));
          free (buf);
          return NULL;
        }
      if (n == 0)
        break;
      len += (size_t)n;
    }
  if (len > max)
    {
      cli_errorf ("%s is larger than %zu bytes", what, max);
      free (buf);
      return NULL;
    }
  buf[len] = '\0';
  *ret_len = len;
  return buf;
}

volatile sig_atomic_t cli_interrupted;

static void
on_signal (int sig)
{
  cli_interrupted = sig;
}

void
cli_trap_signals (void)
{
  struct sigaction sa = { .sa_handler = on_signal };
  sigemptyset (&sa.sa_mask);
  /* No SA_RESTART: blocking calls return EINTR and libwarren's poll loop
   * notices the cancel flag right away. */
  sigaction (SIGINT, &sa, NULL);
  sigaction (SIGTERM, &sa, NULL);
  sigaction (SIGHUP, &sa, NULL);
}

static char *
read_token_file (const char *path)
{
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0)
    {
      cli_errorf ("cannot read token file %s: %s", path, strerror (errno));
      return NULL;
    }
  size_t len;
  char *tok = cli_slurp (fd, "the token file", 4096, &len);
  if (tok == NULL)
    return NULL;
  while (len > 0
         && (tok[len - 1] == '\n' || tok[len - 1] == '\r' || tok[len - 1] == ' '
             || tok[len - 1] == '\t'))
    len--;
  tok[len] = '\0';
  if (len == 0 || strlen (tok) != len || strpbrk (tok, " \t\r\n"))
    {
      cli_errorf ("token file %s: expected one token on one line", path);
      free (tok);
      return NULL;
    }
  return tok;
}

int cmd_node (cli_t *cli, int argc, char **argv);    /* cmd_cluster.c */
int cmd_project (cli_t *cli, int argc, char **argv); /* cmd_cluster.c */

struct verb
{
  const char *name;
  int (*fn) (cli_t *, int, char **);
};

static int
cmd_bench (cli_t *cli, int argc, char **argv)
{
  /* bench prints its own help and measures floors without a daemon; it gets
   * the client anyway (creating one does not connect). */
  warren_client_t *c = cli_client (cli);
  if (c == NULL)
    return CLI_EXIT_FAIL;
  return wr_cli_bench (c, argc, argv);
}

static const struct verb verbs[] = {
  { "create", cmd_create },   { "ls", cmd_ls },
  { "inspect", cmd_inspect }, { "rm", cmd_rm },
  { "pause", cmd_pause },     { "resume", cmd_resume },
  { "pack", cmd_pack },       { "exec", cmd_exec },
  { "run", cmd_run },         { "call", cmd_call },
  { "cp", cmd_cp },           { "image", cmd_image },
  { "pool", cmd_pool },       { "health", cmd_health },
  { "metrics", cmd_metrics }, { "bench", cmd_bench },
  { "node", cmd_node },       { "project", cmd_project },
  { "net", cmd_net },         { "port", cmd_port },
  { "log", cmd_log },         { "replay", cmd_replay }, /* trajectory log */
  { "fork", cmd_fork },       { "checkpoint", cmd_checkpoint },
  { "restore", cmd_restore }, { "diff", cmd_diff },
};

int
main (int argc, char **argv)
{
  cli_t cli = { 0 };
  opterr = 0; /* cli_bad_option says it once, with the verb's help hint */
  _cleanup_free_ char *token = NULL;
  const char *token_file = getenv ("WARREN_TOKEN_FILE");
  int i = 1;
  for (; i < argc && argv[i][0] == '-'; i++)
    {
      const char *a = argv[i];
      const char *val = NULL;
      if (strcmp (a, "--") == 0)
        {
          i++;
          break;
        }
      if (strcmp (a, "--version") == 0 || strcmp (a, "-V") == 0)
        {
          printf ("warren %s\n", warren_version ());
          return 0;
        }
      if (strcmp (a, "--help") == 0 || strcmp (a, "-h") == 0)
        {
          fputs (main_usage, stdout);
          return 0;
        }
      bool is_host = strncmp (a, "--host", 6) == 0 && (a[6] == '\0' || a[6] == '=');
      bool is_tok = strncmp (a, "--token-file", 12) == 0 && (a[12] == '\0' || a[12] == '=');
      if (!is_host && !is_tok)
        return cli_usage ("", "unknown option '%.64s'", a);
      const char *eq = strchr (a, '=');
      if (eq)
        val = eq + 1;
      else if (i + 1 < argc)
        val = argv[++i];
      else
        return cli_usage ("", "%s needs a value", a);
      if (is_host)
        cli.host = val;
      else
        token_file = val;
    }
  if (i >= argc)
    {
      fputs (main_usage, stderr);
      return CLI_EXIT_USAGE;
    }
  if (strcmp (argv[i], "help") == 0)
    {
      cli_help (i + 1 < argc ? argv[i + 1] : "", stdout);
      return 0;
    }
  if (strcmp (argv[i], "version") == 0)
    {
      printf ("warren %s\n", warren_version ());
      return 0;
    }
  const struct verb *v = NULL;
  for (size_t k = 0; k < WR_ARRAY_SIZE (verbs); k++)
    if (strcmp (verbs[k].name, argv[i]) == 0)
      v = &verbs[k];
  if (v == NULL)
    return cli_usage ("", "unknown command '%.64s'", argv[i]);
  if (token_file && *token_file)
    {
      token = read_token_file (token_file);
      if (token == NULL)
        return CLI_EXIT_FAIL;
      cli.token = token;
    }
  /* Output written by the command goes out promptly even into a pipe. */
  setvbuf (stdout, NULL, _IOLBF, 0);
  int r = v->fn (&cli, argc - i, argv + i);
  warren_client_free (cli.client);
  if (token)
    explicit_bzero (token, strlen (token));
  if (fflush (stdout) != 0 && r == 0)
    {
      cli_errorf ("writing output: %s", strerror (errno));
      r = CLI_EXIT_FAIL;
    }
  return r;
}

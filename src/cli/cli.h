/* The `warren` CLI: one function per verb over libwarren. */
#ifndef WR_CLI_H
#define WR_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <warren/warren.h>

/* Exit statuses of warren itself (exec/run/call otherwise exit with the
 * command's own status). */
#define CLI_EXIT_FAIL 1  /* the request failed */
#define CLI_EXIT_USAGE 2 /* bad command line */
#define CLI_EXIT_TIMEOUT 124
#define CLI_EXIT_OWN 125 /* exec/run/call: warren failed, not the command */
/* The platform failed, not the request or the task (warren_err_is_infra):
 * EX_TEMPFAIL, retry later. Any verb. */
#define CLI_EXIT_INFRA 75

typedef struct cli
{
  const char *host;
  const char
      *token; /* from --token-file / $WARREN_TOKEN_FILE; NULL: libwarren reads $WARREN_TOKEN */
  warren_client_t *client;
} cli_t;

/* The client, created on first use; NULL after printing why. */
warren_client_t *cli_client (cli_t *cli);

/* "warren: <message>" on stderr. */
void cli_errorf (const char *fmt, ...) __attribute__ ((format (printf, 1, 2)));
/* Print e as "warren: [prefix: ]message"; returns CLI_EXIT_INFRA for an
 * infra failure (warren_err_is_infra), else CLI_EXIT_FAIL. */
int cli_fail (const warren_error_t *e, const char *prefix);
/* Usage error for verb: message, then a hint; returns CLI_EXIT_USAGE. */
int cli_usage (const char *verb, const char *fmt, ...) __attribute__ ((format (printf, 2, 3)));
/* The option getopt just refused (unknown, or missing its value). */
int cli_bad_option (const char *verb, char **argv);
/* Print the help of verb (e.g. "exec", "image import") to f. */
void cli_help (const char *verb, FILE *f);

bool cli_parse_u64 (const char *s, uint64_t min, uint64_t max, uint64_t *ret);
bool cli_parse_seconds (const char *s, double max, double *ret);
/* A copy of s with control characters replaced, safe to print in a table. */
char *cli_printable (const char *s);
/* Pretty JSON on stdout. */
int cli_print_json (const json_t *j);
/* "5s", "3m", "2h", "4d" since the epoch timestamp t (seconds, float). */
void cli_age (double t, char *buf, size_t n);
void cli_size (double bytes, char *buf, size_t n);
/* Build {"cmd":[argv...]}; NULL after printing why (arguments must be UTF-8). */
json_t *cli_cmd_request (int argc, char **argv);
/* K=V into obj["env"]; false after printing why. */
bool cli_add_env (json_t *req, const char *kv, const char *verb);
/* Read a whole fd (max bytes); NULL after printing why. */
char *cli_slurp (int fd, const char *what, size_t max, size_t *ret_len);

/* A path the daemon will open (verb's argument what): resolved here when the
 * daemon shares our filesystem (unix socket; *abs then owns it), else it must
 * be absolute. Returns an exit status to stop with, or -1 to go on. */
int cli_daemon_path (warren_client_t *c, const char *verb, const char *what, const char **path,
                     char **abs);

/* SIGINT/SIGTERM/SIGHUP set cli_interrupted (the signal number) instead of
 * killing warren, so run can remove its sandbox and exec can drop its stream. */
extern volatile sig_atomic_t cli_interrupted;
void cli_trap_signals (void);

int cmd_create (cli_t *cli, int argc, char **argv);
int cmd_net (cli_t *cli, int argc, char **argv);  /* cmd_net.c */
int cmd_port (cli_t *cli, int argc, char **argv); /* cmd_net.c */
int cmd_ls (cli_t *cli, int argc, char **argv);
int cmd_inspect (cli_t *cli, int argc, char **argv);
int cmd_rm (cli_t *cli, int argc, char **argv);
int cmd_pause (cli_t *cli, int argc, char **argv);
int cmd_resume (cli_t *cli, int argc, char **argv);
int cmd_pack (cli_t *cli, int argc, char **argv);
int cmd_exec (cli_t *cli, int argc, char **argv);
int cmd_run (cli_t *cli, int argc, char **argv);
int cmd_call (cli_t *cli, int argc, char **argv);
int cmd_cp (cli_t *cli, int argc, char **argv);
int cmd_log (cli_t *cli, int argc, char **argv);    /* cmd_log.c: trajectory log */
int cmd_replay (cli_t *cli, int argc, char **argv); /* cmd_log.c */
int cmd_fork (cli_t *cli, int argc, char **argv);   /* cmd_fork.c */
int cmd_checkpoint (cli_t *cli, int argc, char **argv);
int cmd_restore (cli_t *cli, int argc, char **argv);
int cmd_diff (cli_t *cli, int argc, char **argv);
int cmd_image (cli_t *cli, int argc, char **argv);
/* image tag | pull | build | gc (cmd_image2.c); -1 when sub is not one of them */
int cli_image_more (cli_t *cli, const char *sub, int argc, char **argv);
/* warren image defaults (cmd_defaults.c) */
int cli_image_defaults (cli_t *cli, int argc, char **argv);
int cmd_pool (cli_t *cli, int argc, char **argv);
int cmd_health (cli_t *cli, int argc, char **argv);
int cmd_metrics (cli_t *cli, int argc, char **argv);

/* Shared by create and run: handle one create flag into req. Returns 1 when
 * opt was a create flag, 0 when not, -1 on a bad value (already printed). */
int cli_create_opt (int opt, const char *arg, json_t *req, const char *verb);
/* --seed / --epoch: "deterministic" in the create request (docs/api.md) */
#define CLI_OPT_SEED 3000
#define CLI_OPT_EPOCH 3001
#define CLI_OPT_QOS 3002
#define CLI_OPT_IDLE_PAUSE 3003
#define CLI_OPT_NET_GROUP 3004
#define CLI_OPT_NET_RATE 3005  /* "net_limits": {"egress_kbps"} */
#define CLI_OPT_NET_CONNS 3006 /* "net_limits": {"connections"} */
#define CLI_CREATE_LONGOPTS                                                                        \
  { "backend", required_argument, NULL, 'B' }, { "image", required_argument, NULL, 'I' },          \
      { "layer", required_argument, NULL, 'L' }, { "memory", required_argument, NULL, 'M' },       \
      { "cpus", required_argument, NULL, 'C' }, { "disk", required_argument, NULL, 'D' },          \
      { "ttl", required_argument, NULL, 'T' }, { "seed", required_argument, NULL, CLI_OPT_SEED },  \
      { "epoch", required_argument, NULL, CLI_OPT_EPOCH },                                         \
      { "qos", required_argument, NULL, CLI_OPT_QOS },                                             \
      { "idle-pause", required_argument, NULL, CLI_OPT_IDLE_PAUSE },                               \
      { "net-group", required_argument, NULL, CLI_OPT_NET_GROUP },                                 \
      { "net-rate", required_argument, NULL, CLI_OPT_NET_RATE },                                   \
      { "net-conns", required_argument, NULL, CLI_OPT_NET_CONNS },                                 \
  {                                                                                                \
    "net", required_argument, NULL, 'N'                                                            \
  }

#endif

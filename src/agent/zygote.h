/* fncall support in the agent (docs/fncall.md): an EXEC with a "call"
 * object runs as a per-call uid with rlimits, its own seccomp filter and a
 * fresh scratch directory as cwd, and every trace it leaves (processes and
 * files of that uid) is swept before EXIT is sent, so the next call on the
 * same sandbox starts clean. */
#ifndef WR_AGENT_ZYGOTE_H
#define WR_AGENT_ZYGOTE_H

#include <stdbool.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <jansson.h>

#include "common/err.h"

struct ag_call
{
  bool on;
  uid_t uid;
  gid_t gid;
  char scratch[128];
  bool seccomp;
  int n_lim;
  struct
  {
    int res;
    rlim_t v;
  } lim[6];
};

/* Parse body["call"]; c->on stays false when absent. */
int ag_call_parse (json_t *body, struct ag_call *c, wr_err_t *err);
/* Create the scratch dir (wiping a stale one) owned by the call uid. */
int ag_call_prepare (const struct ag_call *c, wr_err_t *err);
/* vfork-style spawn: the child drops to the call's ids and limits and execs
 * file. fds[3] become 0,1,2. Returns the pid or -errno (exec failures too). */
pid_t ag_call_spawn (const struct ag_call *c, const char *file, char **argv, char **envp,
                     const int fds[3]);
/* SIGKILL every process of the call uid and remove its files from the
 * scratch dir and the world-writable temp dirs. */
void ag_call_cleanup (const struct ag_call *c);

#endif

/* Process state in a group fork through CRIU (docs/rl.md, "Process state
 * in a fork"). Not built: this says what blocks it on this node. */
#ifndef WRD_CRIU_H
#define WRD_CRIU_H

#include "common/err.h"

/* Fill err (WR_E_UNSUPPORTED) with what keeps a fork of a sandbox of this
 * backend from carrying its processes on this node: a guest backend, criu
 * not installed, the failure `criu check` reports here, or, where the check
 * passes, the restore into a child's namespaces that is not built. Always
 * returns -1. The check runs once per criu binary (under 0.1 s here) and is
 * remembered. */
int wrd_criu_fork_blocker (const char *backend, wr_err_t *err);

#endif

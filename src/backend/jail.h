/* The jail QEMU runs in (docs/vm.md "Jail"): its own uid/gid, mount, pid,
 * net, ipc and uts namespaces, a root holding only the files it needs, no
 * capabilities, no_new_privs, and a log pump that caps what it writes. */
#ifndef WR_BACKEND_JAIL_H
#define WR_BACKEND_JAIL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include <stdint.h>

#include "../common/err.h"

#define WR_JAIL_MAX_RO 80
#define WR_JAIL_LOG_CAP (1 << 20) /* bytes kept of console.log and of qemu.log */
#define WR_JAIL_FD_INCOMING 3     /* snapshot state for -incoming fd:3 */
#define WR_JAIL_FD_CONSOLE 4      /* console pipe: -serial file:/proc/self/fd/4 */

struct wr_jail
{
  uid_t uid;
  gid_t gid;
  const char *root;               /* an empty directory to build the new root on */
  const char *state_dir;          /* bound read-write at its own path; QEMU's cwd */
  const char *ro[WR_JAIL_MAX_RO]; /* files/dirs bound read-only at their own path */
  size_t n_ro;
  bool kvm; /* bind /dev/kvm */
};

/* Per-VM host uid (= gid) from [WARREN_VM_UID_BASE, +65536), derived from a
 * hash of key and probed past ids in use or known to the host's user and
 * group databases; released by wr_jail_uid_put. */
int wr_jail_uid_get (const char *key, uid_t *ret_uid, wr_err_t *err);
void wr_jail_uid_put (const char *key);
/* an adopted VM keeps the uid it runs as */
void wr_jail_uid_claim (const char *key, uid_t uid);

/* In the forked child (async-signal-safe only), already in new namespaces:
 * build the root, pivot into it, chdir to the state dir, drop to uid/gid
 * with no capabilities and no_new_privs. Returns -errno. */
int wr_jail_enter (const struct wr_jail *j);

/* In the child after wr_jail_enter: fork the log pump, which copies
 * con_r to con_out and err_r to err_out, each up to WR_JAIL_LOG_CAP, then
 * drains. Closes the read ends in the caller. Returns -errno. */
int wr_jail_pump (int con_r, int con_out, int err_r, int err_out);

#endif

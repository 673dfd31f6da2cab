/* Comparing and restoring sandbox file systems (docs/api.md, Checkpoints
 * and diffs). A state is a stack of overlay layer directories, top-most
 * first: the image's EROFS layers, a checkpoint's packed layer on top of
 * them, or the live writable upper. Lookups follow overlayfs' rules
 * (whiteouts, opaque directories) through directory fds, never following a
 * symlink, so no layer content can point the daemon elsewhere. */
#ifndef WRD_FSDIFF_H
#define WRD_FSDIFF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <jansson.h>

#include "common/err.h"
#include "image/store.h"

struct fsd_state
{
  int fd[WR_MAX_LAYERS + 1]; /* O_RDONLY directory fds, owned */
  size_t n;
  size_t unshared; /* the top-most layers that the other state lacks */
};

enum fsd_kind
{
  FSD_ADDED = 'A',
  FSD_MODIFIED = 'M',
  FSD_DELETED = 'D',
};

struct fsd_change
{
  char *path; /* relative, no leading slash */
  enum fsd_kind kind;
  struct stat old_st, new_st; /* valid as the kind says */
};

struct fsd_changes
{
  struct fsd_change *v;
  size_t n, cap;
  bool truncated; /* stopped at FSD_MAX_CHANGES */
};

#define FSD_MAX_CHANGES 100000

void fsd_state_init (struct fsd_state *s);
/* Push a directory (dup'ed) as the next layer down. */
int fsd_state_push (struct fsd_state *s, int dirfd, wr_err_t *err);
void fsd_state_clear (struct fsd_state *s);

/* Every path whose content differs between a and b. */
int fsd_compare (const struct fsd_state *a, const struct fsd_state *b, struct fsd_changes *ret,
                 wr_err_t *err);
void fsd_changes_free (struct fsd_changes *c);

/* JSON for the API: {"changes":[{"path","kind","type","size","old_size",
 * "diff"}],"summary":{...},"truncated"}. prefix: only paths under it (NULL:
 * all); text: unified diffs of modified text files. */
json_t *fsd_changes_json (const struct fsd_state *a, const struct fsd_state *b,
                          const struct fsd_changes *c, const char *prefix, bool text);

/* Unified diff (3 lines of context) of two texts, or NULL when either is
 * binary (a NUL byte) or too large to diff here. */
char *fsd_unified_diff (const char *a, size_t alen, const char *b, size_t blen, const char *path);

/* Make the tree under root_fd (the live sandbox root, reached through
 * /proc/PID/root) equal to state `to` wherever c says it differs from it.
 * Ids of `to` are the sandbox's own; host = id + *_base. Called with the
 * sandbox frozen. */
int fsd_apply (int root_fd, const struct fsd_state *to, const struct fsd_changes *c,
               uint32_t uid_base, uint32_t gid_base, wr_err_t *err);

/* What fsd_apply would write, as a pax tar at out_fd for an agent to apply
 * inside a guest (the FILE op "apply", docs/protocol.md): first an OCI
 * ".wh.NAME" entry for every path that goes or changes type, then `to`'s
 * entries (directories with all they hold), ids as `to` has them. */
int fsd_patch_tar (const struct fsd_state *to, const struct fsd_changes *c, int out_fd,
                   wr_err_t *err);

/* A diff path filter: absolute or relative, no "..", no empty or "."
 * components beyond slashes; normalised into buf without leading slash. */
int fsd_path_normalise (const char *in, char *buf, size_t len, wr_err_t *err);

#endif

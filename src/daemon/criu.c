/* What blocks process state in a group fork (criu.h, docs/rl.md).
 *
 * Debian's criu is asked, not assumed: `criu check` initializes the same
 * kernel feature detection a dump and a restore need, so its first error is
 * the blocker a dump would hit. The answer is kept per criu binary (device,
 * inode, mtime), so installing or upgrading criu is seen without a restart. */
#include "daemon/criu.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "image/internal.h"

static struct
{
  bool valid;
  dev_t dev;
  ino_t ino;
  struct timespec mtime;
  char why[512];
} cache;

/* criu's path in the daemon's default PATH, or false */
static bool
find_criu (char *path, size_t size, struct stat *st)
{
  char dirs[] = WR_DEFAULT_PATH;
  char *save = NULL;
  for (char *dir = strtok_r (dirs, ":", &save); dir; dir = strtok_r (NULL, ":", &save))
    {
      snprintf (path, size, "%s/criu", dir);
      if (stat (path, st) == 0 && S_ISREG (st->st_mode) && access (path, X_OK) == 0)
        return true;
    }
  return false;
}

/* criu's messages are "Error (criu/FILE.c:LINE): TEXT", newlines already
 * spaces (wr_read_tail). Keep the first and the last TEXT that is not a
 * probe helper's "exited, status=N": the first says what failed, the last
 * what criu gave up on. */
static void
summarize_check (char *out, size_t size, const char *log)
{
  char first[256] = "", last[256] = "";
  for (const char *p = strstr (log, "Error ("); p; p = strstr (p + 1, "Error ("))
    {
      const char *text = strstr (p, "): ");
      if (text == NULL)
        break;
      text += 3;
      const char *end = strstr (text, "Error (");
      size_t len = end ? (size_t)(end - text) : strlen (text);
      while (len > 0 && (text[len - 1] == ' ' || text[len - 1] == '.'))
        len--;
      if (len == 0 || strncmp (text, "exited, status=", 15) == 0)
        continue;
      snprintf (first[0] ? last : first, sizeof first, "%.*s", (int)len, text);
    }
  if (first[0] == '\0')
    snprintf (out, size, "%s", log[0] ? log : "no message");
  else if (last[0] == '\0')
    snprintf (out, size, "%s", first);
  else
    snprintf (out, size, "%s (%s)", first, last);
}

static void
probe (const char *path, char *why, size_t size)
{
  char a1[] = "check";
  char *const argv[] = { (char *)path, a1, NULL };
  char log[1024];
  wr_err_t err;
  int status = wr_run_capture (argv, log, sizeof log, &err);
  if (status < 0)
    snprintf (why, size, "%s cannot be run: %s", path, err.msg);
  else if (!WIFEXITED (status) || WEXITSTATUS (status) != 0)
    {
      char summary[400];
      summarize_check (summary, sizeof summary, log);
      snprintf (why, size, "`criu check` fails on this kernel: %s", summary);
    }
  else
    snprintf (why, size,
              "`criu check` passes, but dumping a sandbox's task processes and restoring "
              "them into a child's user, pid and mount namespaces is not built");
}

int
wrd_criu_fork_blocker (const char *backend, wr_err_t *err)
{
  if (strcmp (backend, "container") != 0)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "fork with \"processes\": true (CRIU) is not supported by the %s backend: "
                     "its processes live in a guest kernel that a host criu cannot checkpoint; "
                     "fork copies the file system only (docs/rl.md)",
                     backend);
  char path[64];
  struct stat st;
  if (!find_criu (path, sizeof path, &st))
    {
      cache.valid = false;
      return wr_error (err, 0, WR_E_UNSUPPORTED,
                       "fork with \"processes\": true (CRIU) is not supported on this node: "
                       "criu is not installed; fork copies the file system only (docs/rl.md)");
    }
  if (!cache.valid || cache.dev != st.st_dev || cache.ino != st.st_ino
      || cache.mtime.tv_sec != st.st_mtim.tv_sec || cache.mtime.tv_nsec != st.st_mtim.tv_nsec)
    {
      probe (path, cache.why, sizeof cache.why);
      cache.dev = st.st_dev;
      cache.ino = st.st_ino;
      cache.mtime = st.st_mtim;
      cache.valid = true;
    }
  return wr_error (err, 0, WR_E_UNSUPPORTED,
                   "fork with \"processes\": true (CRIU) is not supported on this node: %s; "
                   "fork copies the file system only (docs/rl.md)",
                   cache.why);
}

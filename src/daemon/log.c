/* warrend's one log function (log.h). */
#include "daemon/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const char *const level_names[] = { "error", "warning", "info", "debug" };
static atomic_int max_level = WRD_LOG_INFO;
static atomic_int log_fd = 2;

int
wrd_log_level_parse (const char *name)
{
  if (name && strcmp (name, "warn") == 0)
    return WRD_LOG_WARN;
  for (int i = 0; name && i < (int)(sizeof level_names / sizeof level_names[0]); i++)
    if (strcmp (name, level_names[i]) == 0)
      return i;
  return -1;
}

void
wrd_log_set_level (enum wrd_log_level max)
{
  atomic_store (&max_level, (int)max);
}

void
wrd_log_set_fd (int fd)
{
  atomic_store (&log_fd, fd);
}

void
wrd_log (enum wrd_log_level level, const char *fmt, ...)
{
  if ((int)level > atomic_load (&max_level) || (int)level < 0 || level > WRD_LOG_DEBUG)
    return;
  int saved = errno;
  /* One buffer and one write: lines from the loop and the worker threads
   * never interleave. */
  char line[4096];
  int n = snprintf (line, sizeof line, "warrend: %s: ", level_names[level]);
  va_list ap;
  va_start (ap, fmt);
  errno = saved; /* for %m */
  int m = vsnprintf (line + n, sizeof line - (size_t)n, fmt, ap);
  va_end (ap);
  size_t len = m < 0 ? (size_t)n : (size_t)n + (size_t)m;
  if (len > sizeof line - 2)
    len = sizeof line - 2;
  if (len == 0 || line[len - 1] != '\n')
    line[len++] = '\n';
  ssize_t w;
  do
    w = write (atomic_load (&log_fd), line, len);
  while (w < 0 && errno == EINTR);
  errno = saved;
}

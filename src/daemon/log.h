/* warrend's one log function. Every message the daemon prints goes through
 * wrd_log with a level, one line per call, to stderr (or the fd set for
 * tests); `--log-level` drops the levels below it. Library code (src/lib,
 * src/image, src/common) never logs: it returns errors (docs/errors.md). */
#ifndef WRD_LOG_H
#define WRD_LOG_H

enum wrd_log_level
{
  WRD_LOG_ERROR, /* the daemon or one of its tasks failed */
  WRD_LOG_WARN,  /* something went wrong and was worked around or retried */
  WRD_LOG_INFO,  /* lifecycle: serving, sandboxes re-adopted, cluster joins */
  WRD_LOG_DEBUG,
};

/* "error", "warning" (or "warn"), "info", "debug"; -1 for anything else. */
int wrd_log_level_parse (const char *name);
/* Print levels up to and including max (default WRD_LOG_INFO). */
void wrd_log_set_level (enum wrd_log_level max);
/* Where lines go (default 2); for tests. */
void wrd_log_set_fd (int fd);
/* "warrend: LEVEL: message\n" in one write(2), cut at 4 KiB; a trailing
 * newline in fmt is not doubled. Thread-safe, keeps errno. */
void wrd_log (enum wrd_log_level level, const char *fmt, ...)
    __attribute__ ((format (printf, 2, 3)));

#endif

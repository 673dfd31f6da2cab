/* warrend's log function (src/daemon/log.c): levels, one line per call. */
#include <string.h>
#include <unistd.h>

#include "daemon/log.h"
#include "tap.h"

static char out[16384];

/* Log through fn into a pipe and return what came out. */
static const char *
capture (void (*fn) (void))
{
  int p[2];
  if (pipe (p) < 0)
    return "";
  wrd_log_set_fd (p[1]);
  fn ();
  wrd_log_set_fd (2);
  close (p[1]);
  tap_read_all (p[0], out, sizeof out);
  close (p[0]);
  return out;
}

static void
levels (void)
{
  wrd_log_set_level (WRD_LOG_WARN);
  wrd_log (WRD_LOG_INFO, "dropped %d", 1);
  wrd_log (WRD_LOG_DEBUG, "dropped");
  wrd_log (WRD_LOG_WARN, "pool %s: %s", "busybox:latest", "no space");
  wrd_log (WRD_LOG_ERROR, "already ends in a newline\n");
  wrd_log_set_level (WRD_LOG_INFO);
}

static void
long_line (void)
{
  static char big[10000];
  memset (big, 'x', sizeof big - 1);
  wrd_log (WRD_LOG_INFO, "%s", big);
}

int
main (void)
{
  TAP_OK (TAP_C_EQ (wrd_log_level_parse ("error"), WRD_LOG_ERROR)
              && TAP_C_EQ (wrd_log_level_parse ("warning"), WRD_LOG_WARN)
              && TAP_C_EQ (wrd_log_level_parse ("warn"), WRD_LOG_WARN)
              && TAP_C_EQ (wrd_log_level_parse ("info"), WRD_LOG_INFO)
              && TAP_C_EQ (wrd_log_level_parse ("debug"), WRD_LOG_DEBUG),
          "level names parse");
  TAP_OK (TAP_C_EQ (wrd_log_level_parse ("loud"), -1) && TAP_C_EQ (wrd_log_level_parse (NULL), -1),
          "unknown level names are refused");
  const char *s = capture (levels);
  TAP_EQ_STR (s,
              "warrend: warning: pool busybox:latest: no space\n"
              "warrend: error: already ends in a newline\n",
              "levels below the threshold are dropped, one line per call: [%s]", s);
  s = capture (long_line);
  size_t n = strlen (s);
  TAP_OK (TAP_C_EQ (n, 4095) && TAP_C_EQ (s[n - 1], '\n') && strchr (s, '\n') == s + n - 1,
          "a long message is cut to one 4 KiB line (%zu bytes)", n);
  return TAP_DONE ();
}

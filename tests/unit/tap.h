/* Tiny TAP helpers for the C unit tests (tests/run counts "ok"/"not ok"). */
#ifndef WR_TAP_H
#define WR_TAP_H
#include <stdio.h>
#include <stdlib.h>

static int tap_n, tap_failed;
#define TAP_OK(cond, ...)                                                                          \
  do                                                                                               \
    {                                                                                              \
      int tap_c_ = !!(cond);                                                                       \
      tap_n++;                                                                                     \
      if (tap_c_)                                                                                  \
        printf ("ok %d - ", tap_n);                                                                \
      else                                                                                         \
        {                                                                                          \
          tap_failed++;                                                                            \
          printf ("not ok %d - ", tap_n);                                                          \
        }                                                                                          \
      printf (__VA_ARGS__);                                                                        \
      printf ("%s\n", tap_c_ ? "" : "  (" #cond ")");                                              \
      fflush (stdout);                                                                             \
    }                                                                                              \
  while (0)
#define TAP_SKIP(reason, ...)                                                                      \
  do                                                                                               \
    {                                                                                              \
      tap_n++;                                                                                     \
      printf ("ok %d - ", tap_n);                                                                  \
      printf (__VA_ARGS__);                                                                        \
      printf (" # SKIP %s\n", reason);                                                             \
    }                                                                                              \
  while (0)
#define TAP_DONE() (printf ("1..%d\n", tap_n), tap_failed ? 1 : 0)
#endif

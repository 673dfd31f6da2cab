/* tap.h checks itself: failing assertions run in a child whose stdout is a
 * pipe, and the parent asserts the child's TAP output names both operands,
 * the source expressions and the file:line. */
#include <stdbool.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tap.h"

static char out[16384];

/* Run fn in a child with stdout captured into out; returns its exit status. */
static int
capture (void (*fn) (void))
{
  int p[2];
  if (pipe (p) < 0)
    return -1;
  fflush (stdout);
  pid_t pid = fork ();
  if (pid < 0)
    return -1;
  if (pid == 0)
    {
      dup2 (p[1], STDOUT_FILENO);
      close (p[0]);
      close (p[1]);
      tap_n = tap_failed = 0;
      fn ();
      _exit (TAP_DONE ());
    }
  close (p[1]);
  tap_read_all (p[0], out, sizeof out);
  close (p[0]);
  int st;
  if (waitpid (pid, &st, 0) < 0 || !WIFEXITED (st))
    return -1;
  return WEXITSTATUS (st);
}

static void
failing (void)
{
  int got_count = 41;
  TAP_EQ_INT (got_count, 42, "int line\nsecond line");
  size_t got_size = 7;
  TAP_LT_UINT (got_size, 5u, "uint");
  const char *name = "alpine\n", *none = NULL;
  TAP_EQ_STR (name, "busybox", "str");
  TAP_EQ_STR (none, "want-null", "str NULL");
  TAP_HAS_STR (name, "needle", "has");
  TAP_EQ_MEM ("abcXef", 6, "abcdef", 6, "mem");
  TAP_EQ (got_size, (size_t)9, "generic uint");
  TAP_NE ("same", "same", "generic str");
  TAP_OK (got_count == 0, "plain");
  TAP_OK (got_count > 0 && TAP_C_EQ (got_count, 40) && TAP_C_EQ_STR (name, "x"), "clauses");
}

static void
passing (void)
{
  int three = 3;
  TAP_EQ_INT (three, 3, "int");
  TAP_GE_INT (three, -1, "signed compare");
  TAP_EQ_STR (NULL, NULL, "NULL equals NULL");
  TAP_NE_STR ("a", NULL, "a string is not NULL");
  TAP_HAS_STR ("haystack", "st", "substring");
  TAP_EQ_MEM ("ab", 2, "ab", 2, "mem");
  TAP_EQ ("x", "x", "generic str");
  TAP_EQ (three, 3, "generic int");
  TAP_OK (TAP_C_EQ (three, 4) || TAP_C_EQ (three, 3), "a failed clause rescued by ||");
  TAP_OK ((three = 7) == 7, "the condition runs before the description: %d", three);
  TAP_SKIP ("no reason", "skipped");
}

static bool
has (const char *s)
{
  return strstr (out, s) != NULL;
}

int
main (void)
{
  int rc = capture (failing);
  TAP_EQ_INT (rc, 1, "a failing test exits 1");
  TAP_OK (has ("not ok 1 - int line|second line\n"), "failure: one TAP line per test");
  TAP_OK (has ("failed at tests/unit/test_tap.c:") || has ("failed at test_tap.c:"),
          "failure: file:line");
  TAP_OK (has ("got_count == 42\n#     got:  41\n#     want: 42\n"),
          "TAP_EQ_INT prints the expressions and both operands");
  TAP_OK (has ("got_size < 5u\n#     got:  7\n#     want: < 5\n"),
          "TAP_LT_UINT prints the operator with the wanted value");
  TAP_OK (has ("#     got:  \"alpine\\n\"\n#     want: \"busybox\"\n"),
          "TAP_EQ_STR quotes and escapes both strings");
  TAP_OK (has ("#     got:  NULL\n#     want: \"want-null\"\n"), "TAP_EQ_STR shows NULL");
  TAP_OK (has ("#     want: contains \"needle\"\n"), "TAP_HAS_STR shows the needle");
  TAP_OK (has ("first difference at byte 3:\n#     got:  58 65 66\n#     want: 64 65 66\n"),
          "TAP_EQ_MEM shows the first differing bytes");
  TAP_OK (has ("#     got:  7\n#     want: 9\n"), "TAP_EQ picks the unsigned compare for size_t");
  TAP_OK (has ("#     want: != \"same\"\n"), "TAP_NE picks the string compare for strings");
  TAP_OK (has ("failed at ") && has (": got_count == 0\n"), "TAP_OK prints the condition");
  TAP_OK (has ("not ok 10 - clauses\n#   failed at ")
              && has ("#   got_count == 40\n#     got:  41\n#     want: 40\n")
              && !has ("name == \"x\""),
          "a failed clause prints its operands, later clauses are short-circuited");
  TAP_OK (has ("1..10\n") && !has ("\nok "), "all ten fail, the plan counts them");
  if (tap_failed)
    TAP_DIAG ("the failing child printed: %s", out);

  rc = capture (passing);
  TAP_EQ_INT (rc, 0, "a passing test exits 0");
  TAP_OK (has ("ok 10 - the condition runs before the description: 7\n")
              && has ("ok 11 - skipped # SKIP no reason\n") && has ("1..11\n") && !has ("not ok")
              && !has ("#   failed"),
          "passing assertions (and a clause rescued by ||) print only ok lines");
  if (tap_failed)
    TAP_DIAG ("the passing child printed: %s", out);
  return TAP_DONE ();
}

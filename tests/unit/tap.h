/* tap.h: the one assertion header for Warren's C unit tests.
 *
 * Each assertion prints one TAP line, "ok N - description" or "not ok N -
 * description" (tests/run counts those; newlines in the description show as
 * '|'). A failure adds "#" lines: file:line, the condition and, for every
 * comparison that failed, its source text and both operands, so a log shows
 * what was got and what was wanted.
 *
 * Assertions (fmt, ... is the description):
 *   TAP_OK (cond, fmt, ...)
 *   TAP_EQ_INT (got, want, fmt, ...)       intmax_t; also TAP_NE_ _LT_ _LE_ _GT_ _GE_INT
 *   TAP_EQ_UINT (got, want, fmt, ...)      uintmax_t; also TAP_NE_ _LT_ _LE_ _GT_ _GE_UINT
 *   TAP_EQ_STR (got, want, fmt, ...)       NULL-safe (NULL equals only NULL); TAP_NE_STR
 *   TAP_HAS_STR (hay, needle, fmt, ...)    strstr (hay, needle), NULL-safe
 *   TAP_EQ_MEM (got, got_len, want, want_len, fmt, ...)   same length and bytes
 *   TAP_EQ, TAP_NE (got, want, fmt, ...)   _Generic on got: strings, unsigned or signed
 *   TAP_SKIP (reason, fmt, ...)            "ok N - ... # SKIP reason"
 * Clauses, for one test made of several comparisons: inside TAP_OK's
 * condition they are plain truth values that keep && short-circuiting
 * (`r.exit && TAP_C_EQ (code, 0) && TAP_C_EQ_STR (out, "hi\n")`), and the
 * failing ones print their operands under the test's "not ok" line:
 *   TAP_C_EQ, TAP_C_NE, TAP_C_LT, TAP_C_LE, TAP_C_GT, TAP_C_GE (got, want)   _Generic
 *   TAP_C_EQ_STR, TAP_C_NE_STR, TAP_C_HAS_STR, TAP_C_EQ_MEM
 * Others:
 *   TAP_DIAG (fmt, ...)                    a "# ..." line, not counted
 *   return TAP_DONE ();                    prints the plan; 1 if anything failed
 *   tap_read_all (fd, buf, size)           read a pipe to EOF (captured output)
 *   tap_soft_fail_to (&failures)           a helper thread's failures are counted, no TAP lines
 *   tap_mkdtemp (buf, size, "prefix")      mkdtemp under $TMPDIR (tests/run's per-run
 *                                          directory, removed after the run) or /tmp
 *
 * Every assertion evaluates each operand once and is worth 1 on success, 0
 * on failure: `if (!TAP_EQ_INT (...)) return;`. Integers compare as intmax_t
 * or uintmax_t as the macro says (TAP_EQ/TAP_NE and the clauses pick from
 * got's type after promotion, so bool, char and short are int). */
#ifndef WR_TAP_H
#define WR_TAP_H
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int tap_n, tap_failed;
/* Set in a helper thread (a fake server) by tap_soft_fail_to (). */
static _Thread_local int *tap_soft_failures_;
/* What failed clauses said, printed under the next "not ok" line. */
static _Thread_local char tap_pending_[4096];
static _Thread_local size_t tap_pending_len_;

enum tap_op_
{
  TAP_OP_EQ_,
  TAP_OP_NE_,
  TAP_OP_LT_,
  TAP_OP_LE_,
  TAP_OP_GT_,
  TAP_OP_GE_,
};
static const char *const tap_op_str_[] = { "==", "!=", "<", "<=", ">", ">=" };
/* "want:" shows the operator unless it is ==: "got: 12", "want: < 10". */
static const char *const tap_want_op_[] = { "", "!= ", "< ", "<= ", "> ", ">= " };

static inline void __attribute__ ((format (printf, 1, 2))) tap_note_ (const char *fmt, ...)
{
  size_t room = sizeof tap_pending_ - tap_pending_len_;
  va_list ap;
  va_start (ap, fmt);
  int n = vsnprintf (tap_pending_ + tap_pending_len_, room, fmt, ap);
  va_end (ap);
  if (n > 0)
    tap_pending_len_ += (size_t)n < room ? (size_t)n : room - 1;
}

/* A value as a quoted C string with escapes, cut after 256 bytes. */
static inline void
tap_note_str_ (const char *label, const char *op, const char *s)
{
  tap_note_ ("#     %s %s", label, op);
  if (!s)
    {
      tap_note_ ("NULL\n");
      return;
    }
  size_t len = strlen (s), show = len > 256 ? 256 : len;
  tap_note_ ("\"");
  for (size_t i = 0; i < show; i++)
    {
      unsigned char c = (unsigned char)s[i];
      if (c == '"' || c == '\\')
        tap_note_ ("\\%c", c);
      else if (c == '\n')
        tap_note_ ("\\n");
      else if (c == '\t')
        tap_note_ ("\\t");
      else if (c < 0x20 || c >= 0x7f)
        tap_note_ ("\\x%02x", c);
      else
        tap_note_ ("%c", c);
    }
  tap_note_ ("\"");
  if (show < len)
    tap_note_ ("... (%zu bytes)", len);
  tap_note_ ("\n");
}

static inline void
tap_note_hex_ (const char *label, const unsigned char *p, size_t len, size_t from)
{
  tap_note_ ("#     %s", label);
  for (size_t i = from; i < len && i < from + 16; i++)
    tap_note_ (" %02x", p[i]);
  tap_note_ ("%s\n", len > from + 16 ? " ..." : "");
}

/* ---- clauses: a truth value; a failure is noted for the next TAP line ---- */

/* cmp is <0, 0 or >0 as got is below, equal to or above want. */
static inline int
tap_holds_ (int cmp, enum tap_op_ op)
{
  switch (op)
    {
    case TAP_OP_EQ_:
      return cmp == 0;
    case TAP_OP_NE_:
      return cmp != 0;
    case TAP_OP_LT_:
      return cmp < 0;
    case TAP_OP_LE_:
      return cmp <= 0;
    case TAP_OP_GT_:
      return cmp > 0;
    default:
      return cmp >= 0;
    }
}

static inline int
tap_c_int_ (intmax_t got, intmax_t want, enum tap_op_ op, const char *ge, const char *we)
{
  if (tap_holds_ ((got > want) - (got < want), op))
    return 1;
  tap_note_ ("#   %s %s %s\n#     got:  %jd\n#     want: %s%jd\n", ge, tap_op_str_[op], we, got,
             tap_want_op_[op], want);
  return 0;
}

static inline int
tap_c_uint_ (uintmax_t got, uintmax_t want, enum tap_op_ op, const char *ge, const char *we)
{
  if (tap_holds_ ((got > want) - (got < want), op))
    return 1;
  tap_note_ ("#   %s %s %s\n#     got:  %ju\n#     want: %s%ju\n", ge, tap_op_str_[op], we, got,
             tap_want_op_[op], want);
  return 0;
}

/* Strings: == and != (any other op means !=); NULL equals only NULL. */
static inline int
tap_c_str_ (const char *got, const char *want, enum tap_op_ op, const char *ge, const char *we)
{
  int same = (got && want) ? strcmp (got, want) == 0 : got == want;
  if (op == TAP_OP_EQ_ ? same : !same)
    return 1;
  tap_note_ ("#   %s %s %s\n", ge, tap_op_str_[op], we);
  tap_note_str_ ("got: ", "", got);
  tap_note_str_ ("want:", tap_want_op_[op], want);
  return 0;
}

static inline int
tap_c_has_ (const char *hay, const char *needle, const char *he, const char *ne)
{
  if (hay && needle && strstr (hay, needle))
    return 1;
  tap_note_ ("#   %s contains %s\n", he, ne);
  tap_note_str_ ("got: ", "", hay);
  tap_note_str_ ("want:", "contains ", needle);
  return 0;
}

static inline int
tap_c_mem_ (const void *got, size_t got_len, const void *want, size_t want_len, const char *ge,
            const char *we)
{
  const unsigned char *g = got, *w = want;
  size_t common = got_len < want_len ? got_len : want_len, at = 0;
  if ((!g && got_len) || (!w && want_len))
    common = 0, at = 1; /* NULL with a length: never equal */
  while (at < common && g[at] == w[at])
    at++;
  if (got_len == want_len && at == common)
    return 1;
  tap_note_ ("#   %s == %s\n#     got:  %zu bytes\n#     want: %zu bytes\n", ge, we, got_len,
             want_len);
  if (at < common)
    {
      tap_note_ ("#     first difference at byte %zu:\n", at);
      tap_note_hex_ ("got: ", g, got_len, at);
      tap_note_hex_ ("want:", w, want_len, at);
    }
  return 0;
}

/* ---- assertions ---- */

/* One TAP line (or, in soft mode, only a failure note), then on failure
 * file:line, the expression and what the clauses noted. Returns ok. */
static inline int __attribute__ ((format (printf, 5, 6)))
tap_ok_ (int ok, const char *expr, const char *file, int line, const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  for (char *c = msg; *c; c++)
    if (*c == '\n')
      *c = '|';
  if (tap_soft_failures_)
    {
      if (!ok)
        {
          (*tap_soft_failures_)++;
          printf ("# soft check failed (counted by the test) - %s\n", msg);
        }
    }
  else
    {
      tap_n++;
      if (!ok)
        tap_failed++;
      printf ("%sok %d - %s\n", ok ? "" : "not ", tap_n, msg);
    }
  if (!ok)
    printf ("#   failed at %s:%d%s%s\n%.*s", file, line, *expr ? ": " : "", expr,
            (int)tap_pending_len_, tap_pending_);
  tap_pending_len_ = 0;
  fflush (stdout);
  return ok;
}

/* From now on this thread's assertions print no TAP line: a failure prints
 * its diagnostics and adds one to *failures, which the test asserts on from
 * the main thread (TAP numbering stays in one thread). NULL ends it. */
static inline void
tap_soft_fail_to (int *failures)
{
  tap_soft_failures_ = failures;
}

static inline int __attribute__ ((format (printf, 2, 3)))
tap_skip_ (const char *reason, const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  printf ("ok %d - %s # SKIP %s\n", ++tap_n, msg, reason);
  fflush (stdout);
  return 1;
}

static inline void __attribute__ ((format (printf, 1, 2))) tap_diag_ (const char *fmt, ...)
{
  char msg[1024];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  for (char *c = msg; *c; c++)
    if (*c == '\n')
      *c = '|';
  printf ("# %s\n", msg);
  fflush (stdout);
}

/* Test helper: read fd to EOF into buf (NUL terminated, cut to size - 1);
 * returns the length. For tests that capture output through a pipe. */
static inline size_t
tap_read_all (int fd, char *buf, size_t size)
{
  size_t n = 0;
  ssize_t r;
  while (n < size - 1 && (r = read (fd, buf + n, size - 1 - n)) > 0)
    n += (size_t)r;
  buf[n] = '\0';
  return n;
}

/* Clauses. _Generic on got's type after promotion (char arrays become
 * strings; bool, char and short become int). */
#define TAP_C_INT_(got, op, want) tap_c_int_ ((intmax_t)(got), (intmax_t)(want), op, #got, #want)
#define TAP_C_UINT_(got, op, want)                                                                 \
  tap_c_uint_ ((uintmax_t)(got), (uintmax_t)(want), op, #got, #want)
#define TAP_C_NUM_FN_(got)                                                                         \
  _Generic((got) + 0, unsigned int                                                                 \
           : tap_c_uint_, unsigned long                                                            \
           : tap_c_uint_, unsigned long long                                                       \
           : tap_c_uint_, int                                                                      \
           : tap_c_int_, long                                                                      \
           : tap_c_int_, long long                                                                 \
           : tap_c_int_)
#define TAP_C_ANY_FN_(got)                                                                         \
  _Generic ((got) + 0,                                                                             \
      char *: tap_c_str_,                                                                          \
      const char *: tap_c_str_,                                                                    \
      unsigned int: tap_c_uint_,                                                                   \
      unsigned long: tap_c_uint_,                                                                  \
      unsigned long long: tap_c_uint_,                                                             \
      int: tap_c_int_,                                                                             \
      long: tap_c_int_,                                                                            \
      long long: tap_c_int_)
#define TAP_C_EQ(got, want) TAP_C_ANY_FN_ (got) ((got), (want), TAP_OP_EQ_, #got, #want)
#define TAP_C_NE(got, want) TAP_C_ANY_FN_ (got) ((got), (want), TAP_OP_NE_, #got, #want)
#define TAP_C_LT(got, want) TAP_C_NUM_FN_ (got) ((got), (want), TAP_OP_LT_, #got, #want)
#define TAP_C_LE(got, want) TAP_C_NUM_FN_ (got) ((got), (want), TAP_OP_LE_, #got, #want)
#define TAP_C_GT(got, want) TAP_C_NUM_FN_ (got) ((got), (want), TAP_OP_GT_, #got, #want)
#define TAP_C_GE(got, want) TAP_C_NUM_FN_ (got) ((got), (want), TAP_OP_GE_, #got, #want)
#define TAP_C_EQ_STR(got, want) tap_c_str_ ((got), (want), TAP_OP_EQ_, #got, #want)
#define TAP_C_NE_STR(got, want) tap_c_str_ ((got), (want), TAP_OP_NE_, #got, #want)
#define TAP_C_HAS_STR(hay, needle) tap_c_has_ ((hay), (needle), #hay, #needle)
#define TAP_C_EQ_MEM(got, got_len, want, want_len)                                                 \
  tap_c_mem_ ((got), (got_len), (want), (want_len), #got, #want)

/* Assertions: a clause and a TAP line (the clause prints the expression).
 * The condition is evaluated before the description's arguments, which may
 * show what it computed: TAP_OK (stat (p, &st) == 0, "uid %u", st.st_uid). */
#define TAP_OK(cond, ...)                                                                          \
  ({                                                                                               \
    int tap_ok_c_ = !!(cond);                                                                      \
    tap_ok_ (tap_ok_c_, #cond, __FILE__, __LINE__, __VA_ARGS__);                                   \
  })
#define TAP_ASSERT_(clause, ...)                                                                   \
  ({                                                                                               \
    int tap_ok_c_ = (clause);                                                                      \
    tap_ok_ (tap_ok_c_, "", __FILE__, __LINE__, __VA_ARGS__);                                      \
  })
#define TAP_EQ_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_EQ_, want), __VA_ARGS__)
#define TAP_NE_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_NE_, want), __VA_ARGS__)
#define TAP_LT_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_LT_, want), __VA_ARGS__)
#define TAP_LE_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_LE_, want), __VA_ARGS__)
#define TAP_GT_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_GT_, want), __VA_ARGS__)
#define TAP_GE_INT(got, want, ...) TAP_ASSERT_ (TAP_C_INT_ (got, TAP_OP_GE_, want), __VA_ARGS__)
#define TAP_EQ_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_EQ_, want), __VA_ARGS__)
#define TAP_NE_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_NE_, want), __VA_ARGS__)
#define TAP_LT_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_LT_, want), __VA_ARGS__)
#define TAP_LE_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_LE_, want), __VA_ARGS__)
#define TAP_GT_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_GT_, want), __VA_ARGS__)
#define TAP_GE_UINT(got, want, ...) TAP_ASSERT_ (TAP_C_UINT_ (got, TAP_OP_GE_, want), __VA_ARGS__)
#define TAP_EQ_STR(got, want, ...) TAP_ASSERT_ (TAP_C_EQ_STR (got, want), __VA_ARGS__)
#define TAP_NE_STR(got, want, ...) TAP_ASSERT_ (TAP_C_NE_STR (got, want), __VA_ARGS__)
#define TAP_HAS_STR(hay, needle, ...) TAP_ASSERT_ (TAP_C_HAS_STR (hay, needle), __VA_ARGS__)
#define TAP_EQ_MEM(got, got_len, want, want_len, ...)                                              \
  TAP_ASSERT_ (TAP_C_EQ_MEM (got, got_len, want, want_len), __VA_ARGS__)
#define TAP_EQ(got, want, ...) TAP_ASSERT_ (TAP_C_EQ (got, want), __VA_ARGS__)
#define TAP_NE(got, want, ...) TAP_ASSERT_ (TAP_C_NE (got, want), __VA_ARGS__)

/* A new directory $TMPDIR/PREFIX-XXXXXX (or under /tmp) in buf; NULL on error. */
static inline char *
tap_mkdtemp (char *buf, size_t size, const char *prefix)
{
  const char *t = getenv ("TMPDIR");
  if (t == NULL || t[0] != '/')
    t = "/tmp";
  if ((size_t)snprintf (buf, size, "%s/%s-XXXXXX", t, prefix) >= size)
    return NULL;
  return mkdtemp (buf);
}

#define TAP_SKIP(reason, ...) tap_skip_ ((reason), __VA_ARGS__)
#define TAP_DIAG(...) tap_diag_ (__VA_ARGS__)
#define TAP_DONE() (printf ("1..%d\n", tap_n), fflush (stdout), tap_failed ? 1 : 0)
#endif

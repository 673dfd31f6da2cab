/* tap.h: the one assertion header for Warren's C unit tests.
 *
 * Each assertion prints one TAP line, "ok N - description" or "not ok N -
 * description" (tests/run counts those), with newlines in the description
 * shown as '|'. A failure adds "#" diagnostics: the file:line, the source
 * expressions and, for comparisons, both operands, so the log shows what was
 * got and what was wanted without rerunning under a debugger.
 *
 *   TAP_OK (cond, fmt, ...)                       cond is true
 *   TAP_EQ_INT (got, want, fmt, ...)              signed integers (intmax_t);
 *     TAP_NE_INT, TAP_LT_INT, TAP_LE_INT, TAP_GT_INT, TAP_GE_INT
 *   TAP_EQ_UINT (got, want, fmt, ...)             unsigned (uintmax_t); also _NE_ _LT_ _LE_ _GT_
 * _GE_ TAP_EQ_STR (got, want, fmt, ...)              C strings, NULL-safe (NULL equals only NULL);
 *     TAP_NE_STR
 *   TAP_HAS_STR (haystack, needle, fmt, ...)      strstr (haystack, needle) != NULL, NULL-safe
 *   TAP_EQ_MEM (got, got_len, want, want_len, fmt, ...)   same length and bytes
 *   TAP_EQ (got, want, fmt, ...), TAP_NE          pick INT, UINT or STR from got's type
 *   TAP_SKIP (reason, fmt, ...)                   "ok N - ... # SKIP reason"
 *   TAP_DIAG (fmt, ...)                           a "# ..." line (not counted)
 *   return TAP_DONE ();                           the plan; exit status 1 if anything failed
 *
 * Every assertion evaluates each operand exactly once and is an expression
 * worth 1 on success and 0 on failure: `if (!TAP_EQ_INT (...)) return;`.
 * Operands compare as given, so `TAP_EQ_INT (n, -1, ...)` with a size_t n
 * compares (intmax_t) n: use TAP_EQ_UINT for sizes that may exceed INTMAX_MAX. */
#ifndef WR_TAP_H
#define WR_TAP_H
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tap_n, tap_failed;

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

/* The TAP line itself; returns ok. The description is flattened to one line. */
static inline int __attribute__ ((format (printf, 2, 0)))
tap_line_ (int ok, const char *fmt, va_list ap)
{
  char msg[1024];
  vsnprintf (msg, sizeof msg, fmt, ap);
  for (char *c = msg; *c; c++)
    if (*c == '\n')
      *c = '|';
  tap_n++;
  if (!ok)
    tap_failed++;
  printf ("%sok %d - %s\n", ok ? "" : "not ", tap_n, msg);
  return ok;
}

static inline void
tap_at_ (const char *file, int line, const char *what)
{
  printf ("#   failed at %s:%d: %s\n", file, line, what);
}

/* A value as a quoted C string with escapes, cut after 256 bytes. */
static inline void
tap_print_str_ (const char *label, const char *s, const char *op)
{
  printf ("#     %s %s", label, op);
  if (!s)
    {
      printf ("NULL\n");
      return;
    }
  size_t len = strlen (s), show = len > 256 ? 256 : len;
  putchar ('"');
  for (size_t i = 0; i < show; i++)
    {
      unsigned char c = (unsigned char)s[i];
      if (c == '"' || c == '\\')
        printf ("\\%c", c);
      else if (c == '\n')
        printf ("\\n");
      else if (c == '\t')
        printf ("\\t");
      else if (c < 0x20 || c >= 0x7f)
        printf ("\\x%02x", c);
      else
        putchar (c);
    }
  putchar ('"');
  if (show < len)
    printf ("... (%zu bytes)", len);
  putchar ('\n');
}

static inline void
tap_flush_ (void)
{
  fflush (stdout);
}

static inline int __attribute__ ((format (printf, 5, 6)))
tap_ok_ (int ok, const char *expr, const char *file, int line, const char *fmt, ...)
{
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    tap_at_ (file, line, expr);
  tap_flush_ ();
  return ok;
}

static inline int
tap_holds_int_ (intmax_t a, enum tap_op_ op, intmax_t b)
{
  switch (op)
    {
    case TAP_OP_EQ_:
      return a == b;
    case TAP_OP_NE_:
      return a != b;
    case TAP_OP_LT_:
      return a < b;
    case TAP_OP_LE_:
      return a <= b;
    case TAP_OP_GT_:
      return a > b;
    default:
      return a >= b;
    }
}

static inline int
tap_holds_uint_ (uintmax_t a, enum tap_op_ op, uintmax_t b)
{
  switch (op)
    {
    case TAP_OP_EQ_:
      return a == b;
    case TAP_OP_NE_:
      return a != b;
    case TAP_OP_LT_:
      return a < b;
    case TAP_OP_LE_:
      return a <= b;
    case TAP_OP_GT_:
      return a > b;
    default:
      return a >= b;
    }
}

/* The failure header: "failed at f:l: got_expr OP want_expr". */
static inline void
tap_cmp_at_ (const char *file, int line, const char *ge, enum tap_op_ op, const char *we)
{
  printf ("#   failed at %s:%d: %s %s %s\n", file, line, ge, tap_op_str_[op], we);
}

/* "want:" shows the operator unless it is ==: "got: 12", "want: < 10". */
static inline const char *
tap_want_op_ (enum tap_op_ op)
{
  static const char *const pre[] = { "", "!= ", "< ", "<= ", "> ", ">= " };
  return pre[op];
}

static inline int __attribute__ ((format (printf, 8, 9)))
tap_cmp_int_ (intmax_t got, intmax_t want, enum tap_op_ op, const char *ge, const char *we,
              const char *file, int line, const char *fmt, ...)
{
  int ok = tap_holds_int_ (got, op, want);
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    {
      tap_cmp_at_ (file, line, ge, op, we);
      printf ("#     got:  %jd\n#     want: %s%jd\n", got, tap_want_op_ (op), want);
    }
  tap_flush_ ();
  return ok;
}

static inline int __attribute__ ((format (printf, 8, 9)))
tap_cmp_uint_ (uintmax_t got, uintmax_t want, enum tap_op_ op, const char *ge, const char *we,
               const char *file, int line, const char *fmt, ...)
{
  int ok = tap_holds_uint_ (got, op, want);
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    {
      tap_cmp_at_ (file, line, ge, op, we);
      printf ("#     got:  %ju\n#     want: %s%ju\n", got, tap_want_op_ (op), want);
    }
  tap_flush_ ();
  return ok;
}

/* Strings: only == and != mean something; NULL equals only NULL. */
static inline int __attribute__ ((format (printf, 8, 9)))
tap_cmp_str_ (const char *got, const char *want, enum tap_op_ op, const char *ge, const char *we,
              const char *file, int line, const char *fmt, ...)
{
  int same = (got && want) ? strcmp (got, want) == 0 : got == want;
  int ok = op == TAP_OP_NE_ ? !same : same;
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    {
      tap_cmp_at_ (file, line, ge, op, we);
      tap_print_str_ ("got: ", got, "");
      tap_print_str_ ("want:", want, tap_want_op_ (op));
    }
  tap_flush_ ();
  return ok;
}

static inline int __attribute__ ((format (printf, 7, 8)))
tap_has_str_ (const char *hay, const char *needle, const char *he, const char *ne, const char *file,
              int line, const char *fmt, ...)
{
  int ok = hay && needle && strstr (hay, needle) != NULL;
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    {
      printf ("#   failed at %s:%d: %s contains %s\n", file, line, he, ne);
      tap_print_str_ ("got: ", hay, "");
      tap_print_str_ ("want:", needle, "contains ");
    }
  tap_flush_ ();
  return ok;
}

static inline void
tap_print_hex_ (const char *label, const unsigned char *p, size_t len, size_t from)
{
  printf ("#     %s", label);
  for (size_t i = from; i < len && i < from + 16; i++)
    printf (" %02x", p[i]);
  if (len > from + 16)
    printf (" ...");
  putchar ('\n');
}

static inline int __attribute__ ((format (printf, 9, 10)))
tap_eq_mem_ (const void *got, size_t got_len, const void *want, size_t want_len, const char *ge,
             const char *we, const char *file, int line, const char *fmt, ...)
{
  const unsigned char *g = got, *w = want;
  size_t common = got_len < want_len ? got_len : want_len, at = 0;
  if (g && w)
    while (at < common && g[at] == w[at])
      at++;
  int ok = got_len == want_len && (at == common || !g || !w) && (g || !got_len) && (w || !want_len);
  va_list ap;
  va_start (ap, fmt);
  tap_line_ (ok, fmt, ap);
  va_end (ap);
  if (!ok)
    {
      printf ("#   failed at %s:%d: %s == %s\n", file, line, ge, we);
      printf ("#     got:  %zu bytes\n#     want: %zu bytes\n", got_len, want_len);
      if (g && w && at < common)
        {
          printf ("#     first difference at byte %zu:\n", at);
          tap_print_hex_ ("got: ", g, got_len, at);
          tap_print_hex_ ("want:", w, want_len, at);
        }
    }
  tap_flush_ ();
  return ok;
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
  tap_flush_ ();
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
  tap_flush_ ();
}

#define TAP_OK(cond, ...) tap_ok_ (!!(cond), #cond, __FILE__, __LINE__, __VA_ARGS__)

#define TAP_CMP_INT_(got, op, want, ...)                                                           \
  tap_cmp_int_ ((intmax_t)(got), (intmax_t)(want), op, #got, #want, __FILE__, __LINE__, __VA_ARGS__)
#define TAP_EQ_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_EQ_, want, __VA_ARGS__)
#define TAP_NE_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_NE_, want, __VA_ARGS__)
#define TAP_LT_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_LT_, want, __VA_ARGS__)
#define TAP_LE_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_LE_, want, __VA_ARGS__)
#define TAP_GT_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_GT_, want, __VA_ARGS__)
#define TAP_GE_INT(got, want, ...) TAP_CMP_INT_ (got, TAP_OP_GE_, want, __VA_ARGS__)

#define TAP_CMP_UINT_(got, op, want, ...)                                                          \
  tap_cmp_uint_ ((uintmax_t)(got), (uintmax_t)(want), op, #got, #want, __FILE__, __LINE__,         \
                 __VA_ARGS__)
#define TAP_EQ_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_EQ_, want, __VA_ARGS__)
#define TAP_NE_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_NE_, want, __VA_ARGS__)
#define TAP_LT_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_LT_, want, __VA_ARGS__)
#define TAP_LE_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_LE_, want, __VA_ARGS__)
#define TAP_GT_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_GT_, want, __VA_ARGS__)
#define TAP_GE_UINT(got, want, ...) TAP_CMP_UINT_ (got, TAP_OP_GE_, want, __VA_ARGS__)

#define TAP_EQ_STR(got, want, ...)                                                                 \
  tap_cmp_str_ ((got), (want), TAP_OP_EQ_, #got, #want, __FILE__, __LINE__, __VA_ARGS__)
#define TAP_NE_STR(got, want, ...)                                                                 \
  tap_cmp_str_ ((got), (want), TAP_OP_NE_, #got, #want, __FILE__, __LINE__, __VA_ARGS__)
#define TAP_HAS_STR(hay, needle, ...)                                                              \
  tap_has_str_ ((hay), (needle), #hay, #needle, __FILE__, __LINE__, __VA_ARGS__)
#define TAP_EQ_MEM(got, got_len, want, want_len, ...)                                              \
  tap_eq_mem_ ((got), (got_len), (want), (want_len), #got, #want, __FILE__, __LINE__, __VA_ARGS__)

/* _Generic on got's type (after promotion, so char arrays are strings and
 * bool/char/short are int): strings, unsigned or signed integers. */
#define TAP_CMP_FN_(got)                                                                           \
  _Generic ((got) + 0,                                                                             \
      char *: tap_cmp_str_,                                                                        \
      const char *: tap_cmp_str_,                                                                  \
      unsigned int: tap_cmp_uint_,                                                                 \
      unsigned long: tap_cmp_uint_,                                                                \
      unsigned long long: tap_cmp_uint_,                                                           \
      int: tap_cmp_int_,                                                                           \
      long: tap_cmp_int_,                                                                          \
      long long: tap_cmp_int_)
#define TAP_EQ(got, want, ...)                                                                     \
  TAP_CMP_FN_ (got) ((got), (want), TAP_OP_EQ_, #got, #want, __FILE__, __LINE__, __VA_ARGS__)
#define TAP_NE(got, want, ...)                                                                     \
  TAP_CMP_FN_ (got) ((got), (want), TAP_OP_NE_, #got, #want, __FILE__, __LINE__, __VA_ARGS__)

#define TAP_SKIP(reason, ...) tap_skip_ ((reason), __VA_ARGS__)
#define TAP_DIAG(...) tap_diag_ (__VA_ARGS__)
#define TAP_DONE() (printf ("1..%d\n", tap_n), fflush (stdout), tap_failed ? 1 : 0)
#endif

/* Unit tests for wr_grow (src/common/util.c): the one grow-by-doubling
 * helper behind the daemon's and the agent's growing arrays. */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "common/util.h"
#include "tap.h"

#if defined(__SANITIZE_ADDRESS__)
/* The failure test asks for more than any allocator gives: ASan must answer
 * NULL as glibc does, not abort the test. */
const char *
__asan_default_options (void)
{
  return "allocator_may_return_null=1";
}
#endif

struct item
{
  uint64_t a, b;
};

static void
test_growth (void)
{
  struct item *v = NULL;
  size_t cap = 0;
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 1, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)8)
              && v != NULL,
          "an empty array grows to the first capacity");
  struct item *before = v;
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 8, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)8)
              && v == before,
          "no reallocation while it fits");

  /* fill one element at a time, as the callers do, and check every
   * element survives each move */
  int ok = 1;
  size_t caps[16], n_caps = 0;
  for (size_t n = 0; n < 1000; n++)
    {
      size_t old = cap;
      ok &= wr_grow (&v, &cap, n + 1, sizeof *v, 8) == 0;
      if (cap != old && n_caps < WR_ARRAY_SIZE (caps))
        caps[n_caps++] = cap;
      v[n] = (struct item){ n, ~n };
    }
  for (size_t n = 0; n < 1000; n++)
    ok &= v[n].a == n && v[n].b == ~n;
  TAP_OK (ok, "1000 appends keep every element");
  TAP_OK (TAP_C_EQ (n_caps, (size_t)7) && TAP_C_EQ (caps[0], (size_t)16)
              && TAP_C_EQ (caps[6], (size_t)1024) && TAP_C_EQ (cap, (size_t)1024),
          "capacity doubles: 8, 16, ... 1024");
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 5000, sizeof *v, 8), 0) && TAP_C_EQ (cap, (size_t)5000)
              && v[999].a == 999,
          "a need beyond the doubled capacity is met exactly");
  free (v);

  char *s = NULL;
  size_t scap = 0;
  TAP_OK (TAP_C_EQ (wr_grow (&s, &scap, 300, 1, 256), 0) && TAP_C_EQ (scap, (size_t)300),
          "a first need beyond the first capacity is met exactly");
  free (s);
}

static void
test_failure (void)
{
  size_t cap = 0;
  uint32_t *v = NULL;
  TAP_EQ (wr_grow (&v, &cap, 4, sizeof *v, 4), 0, "a small array");
  memcpy (v, (uint32_t[]){ 1, 2, 3, 4 }, 4 * sizeof *v);
  uint32_t *before = v;

  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, SIZE_MAX / 2, sizeof *v, 4), -EOVERFLOW)
              && TAP_C_EQ (cap, (size_t)4) && v == before,
          "need * elem past SIZE_MAX: -EOVERFLOW, array and capacity untouched");
  /* 2^63 bytes, more than PTRDIFF_MAX: every allocator refuses, and the
   * size itself does not overflow */
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, (size_t)PTRDIFF_MAX / 4 + 1, sizeof *v, 4), -ENOMEM)
              && TAP_C_EQ (cap, (size_t)4) && v == before,
          "allocation failure: -ENOMEM, array and capacity untouched");
  TAP_OK (v[0] == 1 && v[1] == 2 && v[2] == 3 && v[3] == 4, "the old elements are intact");
  TAP_EQ (wr_grow (&v, &cap, 5, 0, 4), -EINVAL, "elem 0: -EINVAL");
  TAP_OK (TAP_C_EQ (wr_grow (&v, &cap, 5, sizeof *v, 4), 0) && TAP_C_EQ (cap, (size_t)8)
              && v[3] == 4,
          "after a failure the array still grows");
  free (v);
}

int
main (void)
{
  test_growth ();
  test_failure ();
  return TAP_DONE ();
}

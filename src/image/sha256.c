#include "sha256.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 5)
#include <cpuid.h>
#include <immintrin.h>
#define WR_SHA_NI 1
#endif

static const uint32_t K[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t
ror (uint32_t x, unsigned n)
{
  return (x >> n) | (x << (32 - n));
}

static void
compress (struct wr_sha256 *c, const uint8_t *p)
{
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8
           | p[4 * i + 3];
  for (int i = 16; i < 64; i++)
    {
      uint32_t s0 = ror (w[i - 15], 7) ^ ror (w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = ror (w[i - 2], 17) ^ ror (w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
  uint32_t a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3];
  uint32_t e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
  for (int i = 0; i < 64; i++)
    {
      uint32_t t1
          = h + (ror (e, 6) ^ ror (e, 11) ^ ror (e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
      uint32_t t2 = (ror (a, 2) ^ ror (a, 13) ^ ror (a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = cc;
      cc = b;
      b = a;
      a = t1 + t2;
    }
  c->h[0] += a;
  c->h[1] += b;
  c->h[2] += cc;
  c->h[3] += d;
  c->h[4] += e;
  c->h[5] += f;
  c->h[6] += g;
  c->h[7] += h;
}

#ifdef WR_SHA_NI
/* The x86 SHA extensions (SHA-NI): about 10x the portable rounds, which is
 * what hashing a fork's or an import's layer costs (docs/performance.md).
 * Four rounds per step, the message schedule with sha256msg1/msg2. */
__attribute__ ((target ("sha,sse4.1"))) static void
compress_ni (uint32_t state[8], const uint8_t *p, size_t blocks)
{
  const __m128i mask = _mm_set_epi64x (0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i tmp = _mm_loadu_si128 ((const __m128i *)&state[0]);
  __m128i s1 = _mm_loadu_si128 ((const __m128i *)&state[4]);
  tmp = _mm_shuffle_epi32 (tmp, 0xB1);       /* CDAB */
  s1 = _mm_shuffle_epi32 (s1, 0x1B);         /* EFGH */
  __m128i s0 = _mm_alignr_epi8 (tmp, s1, 8); /* ABEF */
  s1 = _mm_blend_epi16 (s1, tmp, 0xF0);      /* CDGH */
  for (; blocks > 0; blocks--, p += 64)
    {
      __m128i abef = s0, cdgh = s1, w[4];
      for (int g = 0; g < 16; g++)
        {
          if (g < 4)
            w[g] = _mm_shuffle_epi8 (_mm_loadu_si128 ((const __m128i *)(p + 16 * g)), mask);
          else
            {
              __m128i t = _mm_sha256msg1_epu32 (w[g & 3], w[(g + 1) & 3]);
              t = _mm_add_epi32 (t, _mm_alignr_epi8 (w[(g + 3) & 3], w[(g + 2) & 3], 4));
              w[g & 3] = _mm_sha256msg2_epu32 (t, w[(g + 3) & 3]);
            }
          __m128i m = _mm_add_epi32 (w[g & 3], _mm_loadu_si128 ((const __m128i *)&K[4 * g]));
          s1 = _mm_sha256rnds2_epu32 (s1, s0, m);
          s0 = _mm_sha256rnds2_epu32 (s0, s1, _mm_shuffle_epi32 (m, 0x0E));
        }
      s0 = _mm_add_epi32 (s0, abef);
      s1 = _mm_add_epi32 (s1, cdgh);
    }
  tmp = _mm_shuffle_epi32 (s0, 0x1B);   /* FEBA */
  s1 = _mm_shuffle_epi32 (s1, 0xB1);    /* DCHG */
  s0 = _mm_blend_epi16 (tmp, s1, 0xF0); /* DCBA */
  s1 = _mm_alignr_epi8 (s1, tmp, 8);    /* HGFE */
  _mm_storeu_si128 ((__m128i *)&state[0], s0);
  _mm_storeu_si128 ((__m128i *)&state[4], s1);
}

static int use_ni = -1; /* unknown until the first block */

static bool
have_ni (void)
{
  if (use_ni < 0)
    {
      /* cpuid directly: clang 14's __builtin_cpu_supports has no "sha" */
      unsigned a, b, c, d;
      bool sse41 = __get_cpuid (1, &a, &b, &c, &d) && (c & (1u << 19));
      bool sha = __get_cpuid_count (7, 0, &a, &b, &c, &d) && (b & (1u << 29));
      use_ni = sse41 && sha;
    }
  return use_ni > 0;
}
#endif

static void
compress_blocks (struct wr_sha256 *c, const uint8_t *p, size_t blocks)
{
#ifdef WR_SHA_NI
  if (have_ni ())
    {
      compress_ni (c->h, p, blocks);
      return;
    }
#endif
  for (; blocks > 0; blocks--, p += 64)
    compress (c, p);
}

bool
wr_sha256_accel (int on)
{
#ifdef WR_SHA_NI
  if (on == 0)
    use_ni = 0;
  else if (on > 0)
    use_ni = -1;
  return have_ni ();
#else
  (void)on;
  return false;
#endif
}

void
wr_sha256_init (struct wr_sha256 *c)
{
  static const uint32_t iv[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
  memcpy (c->h, iv, sizeof iv);
  c->len = 0;
  c->fill = 0;
}

void
wr_sha256_update (struct wr_sha256 *c, const void *data, size_t len)
{
  const uint8_t *p = data;
  c->len += len;
  if (c->fill > 0)
    {
      size_t n = 64 - c->fill < len ? 64 - c->fill : len;
      memcpy (c->buf + c->fill, p, n);
      c->fill += n;
      p += n;
      len -= n;
      if (c->fill < 64)
        return;
      compress_blocks (c, c->buf, 1);
      c->fill = 0;
    }
  compress_blocks (c, p, len / 64);
  p += len & ~(size_t)63;
  len &= 63;
  memcpy (c->buf, p, len);
  c->fill = len;
}

void
wr_sha256_final (struct wr_sha256 *c, uint8_t out[32])
{
  uint64_t bits = c->len * 8;
  uint8_t pad[72] = { 0x80 };
  size_t padlen = (c->fill < 56 ? 56 : 120) - c->fill;
  for (int i = 0; i < 8; i++)
    pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
  wr_sha256_update (c, pad, padlen + 8);
  for (int i = 0; i < 8; i++)
    {
      out[4 * i] = (uint8_t)(c->h[i] >> 24);
      out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
      out[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
      out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

void
wr_sha256_to_hex (const uint8_t digest[32], char hex[65])
{
  static const char x[] = "0123456789abcdef";
  for (int i = 0; i < 32; i++)
    {
      hex[2 * i] = x[digest[i] >> 4];
      hex[2 * i + 1] = x[digest[i] & 15];
    }
  hex[64] = '\0';
}

void
wr_sha256_hex (const void *data, size_t len, char hex[65])
{
  struct wr_sha256 c;
  uint8_t d[32];
  wr_sha256_init (&c);
  wr_sha256_update (&c, data, len);
  wr_sha256_final (&c, d);
  wr_sha256_to_hex (d, hex);
}

int
wr_sha256_fd (int fd, char hex[65])
{
  enum
  {
    BUFSZ = 1 << 17
  };
  uint8_t *buf = malloc (BUFSZ);
  if (buf == NULL)
    return -ENOMEM;
  struct wr_sha256 c;
  uint8_t d[32];
  off_t off = 0;
  wr_sha256_init (&c);
  for (;;)
    {
      ssize_t n = pread (fd, buf, BUFSZ, off);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          int r = -errno;
          free (buf);
          return r;
        }
      if (n == 0)
        break;
      wr_sha256_update (&c, buf, (size_t)n);
      off += n;
    }
  free (buf);
  wr_sha256_final (&c, d);
  wr_sha256_to_hex (d, hex);
  return 0;
}

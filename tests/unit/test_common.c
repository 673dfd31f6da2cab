/* Unit tests for src/common: base64, UTF-8 validation, frame parsing, errors. */
#include <string.h>
#include <stdint.h>
#include <sys/random.h>

#include "common/b64.h"
#include "common/err.h"
#include "common/proto.h"
#include "common/util.h"
#include "tap.h"

static void
test_b64 (void)
{
  static const char *vec[][2] = { { "", "" },
                                  { "f", "Zg==" },
                                  { "fo", "Zm8=" },
                                  { "foo", "Zm9v" },
                                  { "foob", "Zm9vYg==" },
                                  { "fooba", "Zm9vYmE=" },
                                  { "foobar", "Zm9vYmFy" } };
  int ok = 1;
  for (size_t i = 0; i < WR_ARRAY_SIZE (vec); i++)
    {
      char out[64];
      wr_b64_encode (vec[i][0], strlen (vec[i][0]), out);
      ok &= strcmp (out, vec[i][1]) == 0;
      char dec[64];
      long n = wr_b64_decode (vec[i][1], strlen (vec[i][1]), dec);
      ok &= n == (long)strlen (vec[i][0]) && memcmp (dec, vec[i][0], (size_t)n) == 0;
    }
  TAP_OK (ok, "base64 RFC 4648 vectors");
  uint8_t raw[1000], back[1000];
  char enc[1400];
  int rt = 1;
  for (size_t len = 0; len < 300; len++)
    {
      getrandom (raw, len, 0);
      wr_b64_encode (raw, len, enc);
      long n = wr_b64_decode (enc, strlen (enc), back);
      rt &= n == (long)len && memcmp (raw, back, len) == 0;
    }
  TAP_OK (rt, "base64 round trips for lengths 0..299");
  char junk[16];
  TAP_OK (TAP_C_LT (wr_b64_decode ("abc", 3, junk), 0)
              && TAP_C_LT (wr_b64_decode ("ab!d", 4, junk), 0)
              && wr_b64_decode ("a=bc", 4, junk) < 0 && wr_b64_decode ("ab=c", 4, junk) < 0,
          "base64 rejects bad length, bad characters, misplaced padding");
}

static void
test_utf8 (void)
{
  TAP_OK (wr_utf8_valid ("hello", 5) && wr_utf8_valid ("h\xc3\xa9", 3)
              && wr_utf8_valid ("\xf0\x9f\x98\x80", 4),
          "utf8 accepts ascii, 2 and 4 byte sequences");
  TAP_OK (!wr_utf8_valid ("\xff", 1) && !wr_utf8_valid ("a\0b", 3) && !wr_utf8_valid ("\xc3", 1)
              && !wr_utf8_valid ("\xc0\x80", 2) && !wr_utf8_valid ("\xed\xa0\x80", 3),
          "utf8 rejects invalid, NUL, truncated, overlong, surrogates");
}

static void
test_frames (void)
{
  uint8_t buf[64];
  wr_frame_hdr_encode (buf, 5, 42, WR_MSG_STDOUT);
  memcpy (buf + WR_FRAME_HDR, "hello", 5);
  struct wr_frame f;
  int n = wr_frame_parse (buf, WR_FRAME_HDR + 5, &f);
  TAP_OK (TAP_C_EQ (n, WR_FRAME_HDR + 5) && TAP_C_EQ (f.stream, 42)
              && TAP_C_EQ (f.type, WR_MSG_STDOUT) && TAP_C_EQ (f.len, 5)
              && TAP_C_EQ_MEM (f.payload, 5, "hello", 5),
          "frame round trip");
  TAP_OK (TAP_C_EQ (wr_frame_parse (buf, WR_FRAME_HDR + 4, &f), 0)
              && TAP_C_EQ (wr_frame_parse (buf, 3, &f), 0),
          "partial frames need more bytes");
  wr_frame_hdr_encode (buf, WR_FRAME_MAX + 1, 1, WR_MSG_DATA);
  TAP_EQ (wr_frame_parse (buf, sizeof buf, &f), -EPROTO, "oversized length rejected");
  wr_frame_hdr_encode (buf, 0, 1, 99);
  TAP_EQ (wr_frame_parse (buf, sizeof buf, &f), -EPROTO, "unknown type rejected");
  wr_frame_hdr_encode (buf, 0, 1, WR_MSG_PING);
  buf[10] = 1;
  TAP_EQ (wr_frame_parse (buf, sizeof buf, &f), -EPROTO, "non-zero padding rejected");
  /* random garbage never crashes and never claims more than it has */
  int sane = 1;
  for (int i = 0; i < 100000; i++)
    {
      uint8_t g[32];
      getrandom (g, sizeof g, 0);
      size_t avail = (size_t)(g[31] % 32);
      int r = wr_frame_parse (g, avail, &f);
      sane &= r <= (int)avail;
    }
  TAP_OK (sane, "100000 random headers parsed safely");
}

static void
test_errors (void)
{
  wr_err_t err;
  int r = wr_error (&err, ENOENT, WR_E_NOT_FOUND, "open %s", "/x");
  TAP_OK (TAP_C_EQ (r, -ENOENT) && TAP_C_EQ_STR (err.msg, "open /x: No such file or directory")
              && TAP_C_EQ (wr_err_http_status (&err), 404),
          "wr_error formats errno and maps not_found to 404");
  wr_error_wrap (&err, "layer %d", 3);
  TAP_EQ (strncmp (err.msg, "layer 3: open /x", 16), 0, "wr_error_wrap prefixes context");
  TAP_EQ (wr_error (NULL, 0, WR_E_INVALID, "x"), -EIO, "NULL err is allowed");
  TAP_OK (TAP_C_EQ (wr_code_http_status (WR_E_GONE), 410)
              && TAP_C_EQ (wr_code_http_status (WR_E_EXHAUSTED), 429)
              && TAP_C_EQ (wr_code_http_status ("bogus"), 400),
          "code to status mapping");
}

int
main (void)
{
  test_b64 ();
  test_utf8 ();
  test_frames ();
  test_errors ();
  return TAP_DONE ();
}

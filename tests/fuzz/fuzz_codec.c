/* The API's binary-safety codecs (src/common/b64.c): base64 round trips,
 * decoding of arbitrary text into a buffer of the documented size, and
 * wr_utf8_valid agreeing with jansson about what can travel as a JSON
 * string. */
#include <assert.h>
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/b64.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  char *enc = malloc (wr_b64_encoded_len (size) + 1);
  uint8_t *dec = malloc (3 * (wr_b64_encoded_len (size) / 4) + 3);
  wr_b64_encode (data, size, enc);
  assert (strlen (enc) == wr_b64_encoded_len (size));
  long n = wr_b64_decode (enc, strlen (enc), dec);
  assert (n == (long)size && memcmp (dec, data, size) == 0);
  free (dec);
  free (enc);

  /* the input as base64 text: out needs 3*(len/4)+3 bytes */
  uint8_t *out = malloc (3 * (size / 4) + 3);
  n = wr_b64_decode ((const char *)data, size, out);
  assert (n < 0 || (size_t)n <= 3 * (size / 4));
  free (out);

  bool valid = wr_utf8_valid (data, size);
  json_t *s = json_stringn ((const char *)data, size);
  if (valid)
    assert (s != NULL);
  else if (s != NULL)
    assert (memchr (data, 0, size) != NULL); /* jansson takes NUL, the API does not */
  json_decref (s);
  return 0;
}

/* Base64 (RFC 4648, standard alphabet, padded) and UTF-8 validation: the
 * API's binary-safety rule (docs/api.md) uses both, in the daemon and in
 * the client library alike. */
#ifndef WR_B64_H
#define WR_B64_H

#include <stdbool.h>
#include <stddef.h>

size_t wr_b64_encoded_len (size_t n); /* without the NUL */
/* Encode n bytes into out (wr_b64_encoded_len(n)+1 bytes); NUL terminated. */
void wr_b64_encode (const void *in, size_t n, char *out);
/* Decode; returns decoded length or -1 on invalid input. out needs
 * 3*(len/4)+3 bytes. Whitespace is not accepted. */
long wr_b64_decode (const char *in, size_t len, void *out);
/* True when buf is valid UTF-8 without NUL bytes (so it can travel as a JSON string). */
bool wr_utf8_valid (const void *buf, size_t n);

#endif

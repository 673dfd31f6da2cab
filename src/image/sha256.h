/* Small self-contained SHA-256 (FIPS 180-4) for content addressing. */
#ifndef WR_SHA256_H
#define WR_SHA256_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct wr_sha256
{
  uint32_t h[8];
  uint64_t len; /* bytes hashed so far */
  uint8_t buf[64];
  size_t fill;
};

void wr_sha256_init (struct wr_sha256 *c);
void wr_sha256_update (struct wr_sha256 *c, const void *data, size_t len);
void wr_sha256_final (struct wr_sha256 *c, uint8_t out[32]);
/* One-shot helpers; hex is 64 lowercase chars + NUL. */
void wr_sha256_hex (const void *data, size_t len, char hex[65]);
void wr_sha256_to_hex (const uint8_t digest[32], char hex[65]);
/* The SHA-NI rounds where the CPU has them: on < 0 asks, 0 forces the
 * portable code (tests), > 0 detects again; true while they are used. */
bool wr_sha256_accel (int on);
/* Hash a whole file from its start (pread, does not move the offset). */
int wr_sha256_fd (int fd, char hex[65]);

#endif

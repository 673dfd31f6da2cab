#include "proto.h"
#include "util.h"

#include <errno.h>
#include <string.h>
#include <sys/uio.h>

static void
put_le32 (uint8_t *p, uint32_t v)
{
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

static uint32_t
get_le32 (const uint8_t *p)
{
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void
wr_frame_hdr_encode (uint8_t out[WR_FRAME_HDR], uint32_t len, uint32_t stream, uint8_t type)
{
  put_le32 (out, len);
  put_le32 (out + 4, stream);
  out[8] = type;
  out[9] = out[10] = out[11] = 0;
}

int
wr_frame_parse (const uint8_t *buf, size_t avail, struct wr_frame *f)
{
  if (avail < WR_FRAME_HDR)
    return 0;
  uint32_t len = get_le32 (buf);
  uint8_t type = buf[8];
  if (len > WR_FRAME_MAX || type < WR_MSG_HELLO || type > WR_MSG_LAST || buf[9] || buf[10]
      || buf[11])
    return -EPROTO;
  if (avail - WR_FRAME_HDR < len)
    return 0;
  f->len = len;
  f->stream = get_le32 (buf + 4);
  f->type = type;
  f->payload = buf + WR_FRAME_HDR;
  return (int)(WR_FRAME_HDR + len);
}

int
wr_frame_write (int fd, uint32_t stream, uint8_t type, const void *payload, uint32_t len)
{
  if (len > WR_FRAME_MAX)
    return -EMSGSIZE;
  uint8_t hdr[WR_FRAME_HDR];
  wr_frame_hdr_encode (hdr, len, stream, type);
  struct iovec iov[2] = { { hdr, sizeof hdr }, { (void *)payload, len } };
  size_t total = sizeof hdr + len, done = 0;
  int cnt = len ? 2 : 1;
  struct iovec *v = iov;
  while (done < total)
    {
      ssize_t n = writev (fd, v, cnt);
      if (n < 0)
        {
          if (errno == EINTR)
            continue;
          return -errno;
        }
      done += (size_t)n;
      while (cnt > 0 && (size_t)n >= v->iov_len)
        {
          n -= (ssize_t)v->iov_len;
          v++;
          cnt--;
        }
      if (cnt > 0)
        {
          v->iov_base = (char *)v->iov_base + n;
          v->iov_len -= (size_t)n;
        }
    }
  return 0;
}

const char *
wr_msg_name (uint8_t type)
{
  static const char *names[]
      = { "?",    "HELLO", "EXEC",   "STDIN", "SIGNAL", "STDOUT", "STDERR", "EXIT",
          "FILE", "DATA",  "RESULT", "ERROR", "PING",   "PONG",   "LIMITS" };
  return type < WR_ARRAY_SIZE (names) ? names[type] : "?";
}

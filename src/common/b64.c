#include "b64.h"

#include <stdint.h>

static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t
wr_b64_encoded_len (size_t n)
{
  return (n + 2) / 3 * 4;
}

void
wr_b64_encode (const void *in, size_t n, char *out)
{
  const uint8_t *p = in;
  size_t i = 0;
  for (; i + 3 <= n; i += 3)
    {
      uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
      *out++ = alphabet[v >> 18];
      *out++ = alphabet[(v >> 12) & 63];
      *out++ = alphabet[(v >> 6) & 63];
      *out++ = alphabet[v & 63];
    }
  if (n - i == 1)
    {
      uint32_t v = (uint32_t)p[i] << 16;
      *out++ = alphabet[v >> 18];
      *out++ = alphabet[(v >> 12) & 63];
      *out++ = '=';
      *out++ = '=';
    }
  else if (n - i == 2)
    {
      uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8;
      *out++ = alphabet[v >> 18];
      *out++ = alphabet[(v >> 12) & 63];
      *out++ = alphabet[(v >> 6) & 63];
      *out++ = '=';
    }
  *out = '\0';
}

static int
val (unsigned char c)
{
  if (c >= 'A' && c <= 'Z')
    return c - 'A';
  if (c >= 'a' && c <= 'z')
    return c - 'a' + 26;
  if (c >= '0' && c <= '9')
    return c - '0' + 52;
  if (c == '+')
    return 62;
  if (c == '/')
    return 63;
  return -1;
}

long
wr_b64_decode (const char *in, size_t len, void *out)
{
  uint8_t *o = out;
  if (len % 4 != 0)
    return -1;
  for (size_t i = 0; i < len; i += 4)
    {
      int a = val (in[i]), b = val (in[i + 1]);
      if (a < 0 || b < 0)
        return -1;
      bool last = i + 4 == len;
      int c = in[i + 2] == '=' && last ? -2 : val (in[i + 2]);
      int d = in[i + 3] == '=' && last ? -2 : val (in[i + 3]);
      if (c == -1 || d == -1 || (c == -2 && d != -2))
        return -1;
      uint32_t v = (uint32_t)a << 18 | (uint32_t)b << 12 | (uint32_t)(c < 0 ? 0 : c) << 6
                   | (uint32_t)(d < 0 ? 0 : d);
      *o++ = (uint8_t)(v >> 16);
      if (c >= 0)
        *o++ = (uint8_t)(v >> 8);
      if (d >= 0)
        *o++ = (uint8_t)v;
    }
  return (long)(o - (uint8_t *)out);
}

bool
wr_utf8_valid (const void *buf, size_t n)
{
  const uint8_t *s = buf;
  size_t i = 0;
  while (i < n)
    {
      uint8_t c = s[i];
      if (c == 0)
        return false;
      if (c < 0x80)
        {
          i++;
          continue;
        }
      size_t len;
      uint32_t cp;
      if ((c & 0xe0) == 0xc0)
        len = 2, cp = c & 0x1f;
      else if ((c & 0xf0) == 0xe0)
        len = 3, cp = c & 0x0f;
      else if ((c & 0xf8) == 0xf0)
        len = 4, cp = c & 0x07;
      else
        return false;
      if (i + len > n)
        return false;
      for (size_t k = 1; k < len; k++)
        {
          if ((s[i + k] & 0xc0) != 0x80)
            return false;
          cp = cp << 6 | (s[i + k] & 0x3f);
        }
      if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)
          || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return false;
      i += len;
    }
  return true;
}

/* wr_frame_parse (src/common/proto.c): split a byte stream into frames the
 * way both peers do, and check every frame against its re-encoded header. */
#include <assert.h>
#include <stdint.h>
#include <string.h>

#include "common/proto.h"

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  size_t off = 0;
  while (off < size)
    {
      struct wr_frame f;
      int n = wr_frame_parse (data + off, size - off, &f);
      if (n <= 0)
        break;
      assert ((size_t)n == WR_FRAME_HDR + f.len && (size_t)n <= size - off);
      assert (f.payload == data + off + WR_FRAME_HDR);
      uint8_t hdr[WR_FRAME_HDR];
      wr_frame_hdr_encode (hdr, f.len, f.stream, f.type);
      assert (memcmp (hdr, data + off, WR_FRAME_HDR) == 0);
      assert (strcmp (wr_msg_name (f.type), "?") != 0);
      off += (size_t)n;
    }
  /* Every prefix shorter than a frame asks for more, never fails. */
  struct wr_frame f;
  for (size_t cut = 0; cut < WR_FRAME_HDR && cut <= size; cut++)
    assert (wr_frame_parse (data, cut, &f) == 0);
  return 0;
}

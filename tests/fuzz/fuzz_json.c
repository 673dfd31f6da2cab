/* The daemon's JSON request validators that sit behind the HTTP routes:
 * sandbox create (wrd_parse_create, src/daemon/sandbox.c) and fncall calls
 * (parse_call, src/daemon/fncall.c). The first byte picks the parser; the
 * rest is the request body. Exec requests are in fuzz_http. */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#include "daemon/fncall.c"
#pragma clang diagnostic pop

#include <stdlib.h>

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (size < 1)
    return 0;
  static struct wrd d = { .default_image = "busybox:latest" };
  json_t *req = json_loadb ((const char *)data + 1, size - 1, JSON_REJECT_DUPLICATES, NULL);
  if (req == NULL)
    return 0;
  wr_err_t err;
  if (data[0] & 1)
    {
      json_t *spec = NULL;
      if (wrd_parse_create (&d, req, &spec, &err) == 0)
        {
          free (json_dumps (spec, JSON_COMPACT));
          json_decref (spec);
        }
    }
  else
    {
      struct fn_call c = { 0 };
      const char *image;
      enum lang lang;
      unsigned mem;
      int mode;
      if (parse_call (&d, req, &c, &image, &lang, &mem, &mode, &err) == 0)
        free (json_dumps (c.body, JSON_COMPACT));
      json_decref (c.body);
      free (c.in);
    }
  json_decref (req);
  return 0;
}

/* The E2B compat API's own parsers (src/daemon/compat_e2b.c), fed what a
 * client of the envd routes sends. The first byte picks one:
 *   0  parse_multipart: POST /files bodies (the rest: Content-Type up to the
 *      first newline, then the body); every part must lie inside the body;
 *   1  gunzip_body: Content-Encoding: gzip uploads, at most 1 MiB out
 *      whatever the ratio (a gzip bomb ends as an error);
 *   2  request_message: a Connect request's message, plain or enveloped;
 *   3  abs_path: a path relative to the account's home. */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#include "daemon/compat_e2b.c"
#pragma clang diagnostic pop

#include <assert.h>
#include <stdlib.h>

static void
fuzz_multipart (const char *data, size_t n)
{
  const char *nl = memchr (data, '\n', n);
  if (nl == NULL)
    return;
  char *ctype = strndup (data, (size_t)(nl - data));
  const char *body = nl + 1;
  size_t blen = n - (size_t)(body - data);
  struct fop f = { 0 };
  snprintf (f.home, sizeof f.home, "/home/user");
  if (ctype && parse_multipart (ctype, body, blen, &f, "/q") == 0)
    for (size_t i = 0; i < f.n_parts; i++)
      assert (f.parts[i].data >= body && f.parts[i].data + f.parts[i].len <= body + blen);
  for (size_t i = 0; i < f.n_parts; i++)
    free (f.parts[i].path);
  free (f.parts);
  free (ctype);
}

static void
fuzz_gunzip (const char *data, size_t n)
{
  struct evbuffer *in = evbuffer_new (), *out = evbuffer_new ();
  evbuffer_add (in, data, n);
  (void)gunzip_body (in, out, 1 << 20);
  assert (evbuffer_get_length (out) <= 1 << 20);
  evbuffer_free (in);
  evbuffer_free (out);
}

static void
fuzz_message (const char *data, size_t n, bool enveloped)
{
  struct evhttp_request *req = evhttp_request_new (NULL, NULL);
  evbuffer_add (evhttp_request_get_input_buffer (req), data, n);
  json_t *j = request_message (req, enveloped);
  assert (j == NULL || json_is_object (j));
  json_decref (j);
  evhttp_request_free (req);
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (size == 0)
    return 0;
  const char *p = (const char *)data + 1;
  size_t n = size - 1;
  switch (data[0] % 5)
    {
    case 0:
      fuzz_multipart (p, n);
      break;
    case 1:
      fuzz_gunzip (p, n);
      break;
    case 2:
    case 3:
      fuzz_message (p, n, data[0] % 5 == 3);
      break;
    case 4:
      {
        char *s = strndup (p, n);
        char *a = s ? abs_path ("/home/user", s) : NULL;
        assert (s == NULL || a != NULL);
        free (a);
        free (s);
        break;
      }
    }
  return 0;
}

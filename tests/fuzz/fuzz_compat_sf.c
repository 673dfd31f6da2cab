/* The SandboxFusion compat listener's own parsers (src/daemon/compat_sf.c):
 * what a client on the compat port sends and what a sandbox's run leaves
 * behind. The first byte picks one:
 *   0  tar_read: the archive of fetch_files a run wrote (the sandbox's
 *      bytes: hostile), then every file is checked to lie inside the input;
 *   1  head_parse: the body-limit filter's header scan, fed in pieces (the
 *      rest split at 0xff bytes) as a connection delivers them;
 *   2  parse_common: a /run_code JSON body's files, fetch_files and limits;
 *   3  sf_string: output bytes into a JSON string (must be valid UTF-8). */
#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Weverything"
#include "daemon/compat_sf.c"
#pragma clang diagnostic pop

#include <assert.h>
#include <stdlib.h>

static void
fuzz_tar (const char *buf, size_t n)
{
  struct sf_files f = { 0 };
  (void)tar_read (buf, n, &f);
  size_t total = 0;
  for (size_t i = 0; i < f.n; i++)
    {
      assert (f.v[i].name != NULL && f.v[i].len <= n);
      total += f.v[i].len;
    }
  assert (total <= n);
  files_free (&f);
}

static void
fuzz_head (const char *data, size_t n)
{
  /* the connection's buffer grows piece by piece; a complete head is taken
   * off its front, as sf_filter_in does */
  char *buf = malloc (n + 1);
  if (buf == NULL)
    return;
  struct sf_conn t = { 0 };
  size_t have = 0;
  for (size_t i = 0; i <= n; i++)
    {
      if (i < n && (uint8_t)data[i] != 0xff)
        {
          buf[have++] = data[i];
          continue;
        }
      long long len;
      bool chunked;
      size_t end;
      while (have && (end = head_parse (&t, buf, have, &len, &chunked)) != 0)
        {
          assert (end <= have && strlen (t.path) < sizeof t.path);
          memmove (buf, buf + end, have - end);
          have -= end;
        }
      assert (t.scanned <= have);
    }
  free (buf);
}

static void
fuzz_body (const char *data, size_t n)
{
  json_t *body = json_loadb (data, n, 0, NULL);
  if (body == NULL)
    return;
  struct sf_req r = { 0 };
  struct sf_refusal why = { 0 };
  json_t *b64 = NULL;
  if (parse_common (&r, body, &b64, &why))
    {
      assert (r.memory_mb >= 16 && r.memory_mb <= 65536);
      for (size_t i = 0; i < r.files.n; i++)
        assert (path_ok (r.files.v[i].name));
      json_decref (b64);
    }
  else
    assert (why.msg[0] != '\0');
  files_free (&r.files);
  json_decref (r.fetch);
  json_decref (body);
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  if (size == 0)
    return 0;
  const char *p = (const char *)data + 1;
  size_t n = size - 1;
  switch (data[0] % 4)
    {
    case 0:
      fuzz_tar (p, n);
      break;
    case 1:
      fuzz_head (p, n);
      break;
    case 2:
      fuzz_body (p, n);
      break;
    case 3:
      {
        json_t *s = sf_string (p, n);
        assert (s && json_is_string (s));
        json_decref (s);
        break;
      }
    }
  return 0;
}

/* libwarren's HTTP client vs libcurl for one exec round trip over the unix
 * socket (docs/performance.md, "libwarren and libcurl"): alternating blocks,
 * p50 of each block, median and range over the blocks. Build and run:
 *   cc -O2 -o /tmp/cb scripts/bench-libcurl-client.c -Iinclude build/lib/libwarren.a \
 *      -lcurl -ljansson
 *   /tmp/cb ROOT/warrend.sock BLOCKS PER_BLOCK   (needs busybox:latest imported) */
#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <warren/warren.h>

static double
now (void)
{
  struct timespec t;
  clock_gettime (CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
static int
cmp (const void *a, const void *b)
{
  double x = *(double *)a, y = *(double *)b;
  return x < y ? -1 : x > y;
}
struct buf
{
  char *p;
  size_t n;
};
static size_t
wr (char *d, size_t s, size_t n, void *u)
{
  struct buf *b = u;
  b->p = realloc (b->p, b->n + s * n + 1);
  memcpy (b->p + b->n, d, s * n);
  b->n += s * n;
  b->p[b->n] = 0;
  return s * n;
}

int
main (int argc, char **argv)
{
  const char *sock = argv[1];
  int blocks = atoi (argv[2]), per = atoi (argv[3]);
  char host[600];
  snprintf (host, sizeof host, "unix:%s", sock);
  warren_error_t err;
  warren_client_t *c = warren_client_new (host, NULL, &err);
  json_t *creq = json_pack ("{s:s}", "image", "busybox:latest");
  json_t *sb = warren_sandbox_create (c, creq, &err);
  if (!sb)
    {
      fprintf (stderr, "create: %s\n", err.message);
      return 1;
    }
  const char *id = json_string_value (json_object_get (sb, "id"));
  json_t *ereq = json_pack ("{s:[s]}", "cmd", "true");
  char url[256];
  snprintf (url, sizeof url, "http://localhost/v1/sandboxes/%s/exec", id);
  char *body = json_dumps (ereq, JSON_COMPACT);
  curl_global_init (CURL_GLOBAL_DEFAULT);
  CURL *h = curl_easy_init ();
  struct curl_slist *hd = curl_slist_append (NULL, "Content-Type: application/json");
  curl_easy_setopt (h, CURLOPT_UNIX_SOCKET_PATH, sock);
  curl_easy_setopt (h, CURLOPT_URL, url);
  curl_easy_setopt (h, CURLOPT_HTTPHEADER, hd);
  curl_easy_setopt (h, CURLOPT_POSTFIELDS, body);
  curl_easy_setopt (h, CURLOPT_WRITEFUNCTION, wr);
  double *t = calloc (per, sizeof *t), medw[64], medc[64];
  for (int b = 0; b < blocks; b++)
    for (int k = 0; k < 2; k++)
      {
        for (int i = 0; i < per; i++)
          {
            double t0 = now ();
            if (k == 0)
              {
                json_t *r = warren_exec (c, id, ereq, &err);
                if (!r)
                  {
                    fprintf (stderr, "exec: %s\n", err.message);
                    return 1;
                  }
                json_decref (r);
              }
            else
              {
                struct buf bb = { 0 };
                curl_easy_setopt (h, CURLOPT_WRITEDATA, &bb);
                if (curl_easy_perform (h) != CURLE_OK)
                  {
                    fprintf (stderr, "curl failed\n");
                    return 1;
                  }
                json_t *r = json_loadb (bb.p, bb.n, 0, NULL);
                if (!r || json_integer_value (json_object_get (r, "exit_code")) != 0)
                  {
                    fprintf (stderr, "bad: %s\n", bb.p);
                    return 1;
                  }
                json_decref (r);
                free (bb.p);
              }
            t[i] = now () - t0;
          }
        qsort (t, per, sizeof *t, cmp);
        (k ? medc : medw)[b] = t[per / 2];
      }
  qsort (medw, blocks, sizeof *medw, cmp);
  qsort (medc, blocks, sizeof *medc, cmp);
  double ratio[64];
  for (int b = 0; b < blocks; b++)
    ratio[b] = medc[b] / medw[b];
  printf ("{\"blocks\":%d,\"per_block\":%d,\"libwarren_p50_ms\":{\"median\":%.3f,\"min\":%.3f,"
          "\"max\":%.3f},"
          "\"libcurl_p50_ms\":{\"median\":%.3f,\"min\":%.3f,\"max\":%.3f},\"curl_over_libwarren_"
          "median\":%.2f}\n",
          blocks, per, medw[blocks / 2], medw[0], medw[blocks - 1], medc[blocks / 2], medc[0],
          medc[blocks - 1], medc[blocks / 2] / medw[blocks / 2]);
  (void)ratio;
  warren_sandbox_delete (c, id, &err);
  return 0;
}

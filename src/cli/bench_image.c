/* `warren bench image`: the image store's figures (docs/performance.md).
 *
 * - import: time to import a 10 MB (and with --large a 1 GB) single-layer
 *   image, and to the first sandbox that runs on it (create + exec true);
 * - layers: create latency (p50, create + delete) with 1, 3 and 8 layers;
 * - density: page cache and disk used by 100 sandboxes that each read the
 *   whole 10 MB layer, against 100 private copies.
 * The daemon must share this host's filesystem (the tarballs are written to
 * /var/tmp and imported by path). */
#include "cli/cli.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

static double
now_s (void)
{
  return (double)wr_now_ns () / 1e9;
}

/* One regular file "name" of size bytes (pseudo-random, seeded) in a plain
 * ustar archive. */
static int
write_tar (const char *path, const char *name, uint64_t size, uint64_t seed)
{
  int fd = open (path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return -errno;
  char h[512] = { 0 };
  snprintf (h, 100, "%s", name);
  snprintf (h + 100, 8, "%07o", 0644);
  snprintf (h + 108, 8, "%07o", 0);
  snprintf (h + 116, 8, "%07o", 0);
  snprintf (h + 124, 12, "%011llo", (unsigned long long)size);
  snprintf (h + 136, 12, "%011o", 1700000000);
  h[156] = '0';
  memcpy (h + 257, "ustar", 6);
  memcpy (h + 263, "00", 2);
  memset (h + 148, ' ', 8);
  unsigned sum = 0;
  for (int i = 0; i < 512; i++)
    sum += (unsigned char)h[i];
  snprintf (h + 148, 8, "%06o", sum);
  int r = wr_write_all (fd, h, 512);
  static uint64_t buf[1 << 17]; /* 1 MiB */
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t left = size; r == 0 && left > 0;)
    {
      for (size_t i = 0; i < WR_ARRAY_SIZE (buf); i++)
        {
          x ^= x << 13;
          x ^= x >> 7;
          x ^= x << 17;
          buf[i] = x;
        }
      size_t n = left < sizeof buf ? (size_t)left : sizeof buf;
      r = wr_write_all (fd, buf, n);
      left -= n;
    }
  char zero[1024] = { 0 };
  size_t pad = (size_t)((512 - size % 512) % 512);
  if (r == 0)
    r = wr_write_all (fd, zero, pad);
  if (r == 0)
    r = wr_write_all (fd, zero, 1024);
  close (fd);
  return r;
}

static long long
meminfo_kb (const char *key)
{
  FILE *f = fopen ("/proc/meminfo", "re");
  if (!f)
    return -1;
  char line[256];
  long long v = -1;
  size_t kl = strlen (key);
  while (fgets (line, sizeof line, f))
    if (strncmp (line, key, kl) == 0 && line[kl] == ':')
      v = atoll (line + kl + 1);
  fclose (f);
  return v;
}

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double
median (double *v, size_t n)
{
  qsort (v, n, sizeof *v, cmp_double);
  return n ? v[n / 2] : 0;
}

static json_t *
create_req (const char *image, const char *const *layers, size_t n)
{
  json_t *l = json_array ();
  for (size_t i = 0; i < n; i++)
    json_array_append_new (l, json_string (layers[i]));
  return json_pack ("{s:s,s:o}", "image", image, "layers", l);
}

static int
create_exec (warren_client_t *c, json_t *req, const char *cmd, char id[140], warren_error_t *e)
{
  json_t *sb = warren_sandbox_create (c, req, e);
  if (sb == NULL)
    return -1;
  snprintf (id, 140, "%s", json_string_value (json_object_get (sb, "id")));
  json_decref (sb);
  if (cmd)
    {
      json_t *x = json_pack ("{s:s}", "shell", cmd);
      json_t *res = warren_exec (c, id, x, e);
      json_decref (x);
      int code = res ? (int)json_integer_value (json_object_get (res, "exit_code")) : -1;
      json_decref (res);
      if (code != 0)
        {
          if (res)
            snprintf (e->message, sizeof e->message, "'%s' exited with %d", cmd, code);
          return -1;
        }
    }
  return 0;
}

static json_t *
import_case (warren_client_t *c, const char *dir, const char *base, const char *label,
             uint64_t bytes, warren_error_t *e)
{
  char tar[4096], name[128];
  snprintf (tar, sizeof tar, "%s/%s.tar", dir, label);
  snprintf (name, sizeof name, "bench-image-%s:latest", label);
  fprintf (stderr, "bench image: writing a %s tarball\n", label);
  int r = write_tar (tar, "data", bytes, (uint64_t)wr_now_ns ());
  if (r < 0)
    {
      snprintf (e->message, sizeof e->message, "write %s: %s", tar, strerror (-r));
      return NULL;
    }
  double t0 = now_s ();
  json_t *img = warren_image_import (c, name, tar, e);
  double t1 = now_s ();
  unlink (tar);
  if (img == NULL)
    return NULL;
  json_decref (img);
  const char *layers[1] = { name };
  json_t *req = create_req (base, layers, 1);
  char id[140];
  r = create_exec (c, req, "true", id, e);
  double t2 = now_s ();
  json_decref (req);
  if (r < 0)
    return NULL;
  /* reading every byte once: what a sandbox pays the first time */
  json_t *x = json_pack ("{s:s}", "shell", "cat /data > /dev/null");
  double t3 = now_s ();
  json_t *res = warren_exec (c, id, x, e);
  double t4 = now_s ();
  json_decref (x);
  json_decref (res);
  warren_sandbox_delete (c, id, e);
  return json_pack ("{s:s,s:I,s:f,s:f,s:f}", "image", name, "bytes", (json_int_t)bytes, "import_s",
                    t1 - t0, "first_sandbox_s", t2 - t1, "read_all_s", t4 - t3);
}

int wr_cli_bench_image (warren_client_t *c, int argc, char **argv);

int
wr_cli_bench_image (warren_client_t *c, int argc, char **argv)
{
  bool large = false;
  const char *base = "busybox:latest";
  unsigned count = 30, density = 100;
  for (int i = 1; i < argc; i++)
    {
      if (strcmp (argv[i], "--large") == 0)
        large = true;
      else if (strcmp (argv[i], "--image") == 0 && i + 1 < argc)
        base = argv[++i];
      else if (strcmp (argv[i], "--count") == 0 && i + 1 < argc)
        count = (unsigned)atoi (argv[++i]);
      else if (strcmp (argv[i], "--sandboxes") == 0 && i + 1 < argc)
        density = (unsigned)atoi (argv[++i]);
      else
        {
          fprintf (stderr, "usage: warren bench image [--large] [--image REF] [--count N] "
                           "[--sandboxes N]\n");
          return strcmp (argv[i], "--help") == 0 ? 0 : 2;
        }
    }
  if (count < 3 || count > 10000 || density < 1 || density > 5000)
    {
      fprintf (stderr, "warren bench image: --count 3..10000, --sandboxes 1..5000\n");
      return 2;
    }
  warren_client_set_timeout (c, 3600 * 1000);
  char dir[] = "/var/tmp/warren-bench-image-XXXXXX";
  if (mkdtemp (dir) == NULL || chmod (dir, 0755) < 0)
    {
      fprintf (stderr, "warren bench image: mkdtemp: %s\n", strerror (errno));
      return 1;
    }
  warren_error_t e = { 0 };
  json_t *report = json_object ();
  int status = 0;
  json_t *imports = json_array ();
  json_object_set_new (report, "import", imports);
  json_t *small = import_case (c, dir, base, "10mb", 10u << 20, &e);
  if (small == NULL)
    goto fail;
  json_array_append_new (imports, small);
  if (large)
    {
      json_t *big = import_case (c, dir, base, "1gb", 1ull << 30, &e);
      if (big == NULL)
        goto fail;
      json_array_append_new (imports, big);
    }

  /* create latency by layer count: 7 small layers on the base */
  {
    char names[7][64];
    const char *lp[7];
    for (int i = 0; i < 7; i++)
      {
        char tar[4200];
        snprintf (tar, sizeof tar, "%s/l%d.tar", dir, i);
        snprintf (names[i], sizeof names[i], "bench-image-layer%d:latest", i);
        lp[i] = names[i];
        char fname[32];
        snprintf (fname, sizeof fname, "layer%d", i);
        if (write_tar (tar, fname, 4096, (uint64_t)i + 1) < 0)
          goto fail;
        json_t *img = warren_image_import (c, names[i], tar, &e);
        unlink (tar);
        if (img == NULL)
          goto fail;
        json_decref (img);
      }
    json_t *lat = json_object ();
    json_object_set_new (report, "create_by_layers", lat);
    static const size_t ks[] = { 1, 3, 8 };
    double p50[3];
    fprintf (stderr, "bench image: create latency with 1, 3, 8 layers (%u each)\n", count);
    for (size_t k = 0; k < 3; k++)
      {
        json_t *req = create_req (base, lp, ks[k] - 1);
        double *v = calloc (count, sizeof *v);
        for (unsigned i = 0; i < count + 3; i++)
          {
            char id[140];
            double t0 = now_s ();
            int r = create_exec (c, req, NULL, id, &e);
            double t1 = now_s ();
            if (r < 0)
              {
                free (v);
                json_decref (req);
                goto fail;
              }
            warren_sandbox_delete (c, id, &e);
            if (i >= 3) /* warm-up: the first creates mount the layers */
              v[i - 3] = (t1 - t0) * 1000;
          }
        p50[k] = median (v, count);
        char key[16];
        snprintf (key, sizeof key, "%zu", ks[k]);
        json_object_set_new (
            lat, key, json_pack ("{s:f,s:f}", "create_p50_ms", p50[k], "create_min_ms", v[0]));
        free (v);
        json_decref (req);
      }
    double spread = (p50[2] - p50[0]) / p50[0];
    json_object_set_new (lat, "spread_8_vs_1", json_real (spread));
    json_object_set_new (lat, "target", json_string ("8 layers within 10% of 1 layer"));
    json_object_set_new (lat, "met", json_boolean (spread <= 0.10));
  }

  /* density: N sandboxes reading the whole 10 MB layer */
  {
    fprintf (stderr, "bench image: %u sandboxes reading one 10 MB layer\n", density);
    const char *layers[1] = { "bench-image-10mb:latest" };
    json_t *req = create_req (base, layers, 1);
    char (*ids)[140] = calloc (density, sizeof *ids);
    sync ();
    long long cached0 = meminfo_kb ("Cached"), shmem0 = meminfo_kb ("Shmem");
    long long avail0 = meminfo_kb ("MemAvailable");
    unsigned made = 0;
    double t0 = now_s ();
    for (; made < density; made++)
      if (create_exec (c, req, "cat /data > /dev/null", ids[made], &e) < 0)
        break;
    double t1 = now_s ();
    long long cached1 = meminfo_kb ("Cached"), shmem1 = meminfo_kb ("Shmem");
    long long avail1 = meminfo_kb ("MemAvailable");
    for (unsigned i = 0; i < made; i++)
      warren_sandbox_delete (c, ids[i], NULL);
    free (ids);
    json_decref (req);
    if (made < density)
      goto fail;
    json_t *img = warren_image_inspect (c, layers[0], &e);
    json_int_t layer_bytes = img ? json_integer_value (json_object_get (img, "size")) : 0;
    json_decref (img);
    double page_cache_mb = (double)((cached1 - shmem1) - (cached0 - shmem0)) / 1024.0;
    double private_mb = 10.0 * density;
    json_object_set_new (report, "density",
                         json_pack ("{s:i,s:f,s:f,s:f,s:f,s:I,s:f,s:s,s:b}", "sandboxes",
                                    (int)density, "create_and_read_s", t1 - t0,
                                    "page_cache_growth_mb", page_cache_mb, "mem_available_drop_mb",
                                    (double)(avail0 - avail1) / 1024.0, "if_private_copies_mb",
                                    private_mb, "layer_disk_bytes", layer_bytes,
                                    "disk_if_private_copies_mb", private_mb, "target",
                                    "the layer's pages held once (growth ~10 MB, not ~1000 MB)",
                                    "met", page_cache_mb < 3 * 10.0 + 5));
  }
  goto out;
fail:
  status = 1;
  json_object_set_new (report, "error", json_string (e.message[0] ? e.message : "failed"));
out:
  for (int i = 0; i < 7; i++)
    {
      char n[64];
      snprintf (n, sizeof n, "bench-image-layer%d:latest", i);
      warren_image_rm (c, n, NULL);
    }
  warren_image_rm (c, "bench-image-10mb:latest", NULL);
  warren_image_rm (c, "bench-image-1gb:latest", NULL);
  rmdir (dir);
  char *s = json_dumps (report, JSON_INDENT (2) | JSON_REAL_PRECISION (6));
  json_decref (report);
  if (s)
    puts (s);
  free (s);
  return status;
}

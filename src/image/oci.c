/* OCI image layouts and docker-save archives (docs/images.md).
 *
 * Both are a manifest naming a config blob and an ordered list of layer
 * tarballs whose deletions are OCI whiteout files. Every blob is checked
 * against its digest before use; each layer becomes one EROFS layer with
 * the whiteouts converted (WR_STAGE_OCI), and the image is committed in one
 * transaction, so a bad blob anywhere leaves the store as it was. */
#include "store.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include "../common/util.h"
#include "internal.h"
#include "sha256.h"

#define MAX_JSON (4u << 20)

static void
staged_free_all (struct wr_staged_layer **v, size_t n)
{
  for (size_t i = 0; i < n; i++)
    wr_layer_stage_free (v[i]);
}

/* Open rel beneath dfd: no absolute paths, no escape through ".." or
 * symlinks (symlinks inside the tree are fine: old docker-save archives
 * link duplicate layers). */
static int
open_beneath (int dfd, const char *rel, int flags, wr_err_t *err)
{
  struct open_how how = { .flags = (uint64_t)(flags | O_CLOEXEC | O_NOCTTY),
                          .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS };
  int fd = (int)syscall (SYS_openat2, dfd, rel, &how, sizeof how);
  if (fd < 0)
    return wr_error (err, errno, errno == ENOENT ? WR_E_INVALID : WR_E_INVALID,
                     "cannot open '%.300s' in the image: %s", rel,
                     errno == EXDEV ? "it points outside the image" : strerror (errno));
  return fd;
}

static int
read_json_at (int dfd, const char *rel, json_t **ret, char hex[65], wr_err_t *err)
{
  _cleanup_close_ int fd = open_beneath (dfd, rel, O_RDONLY, err);
  if (fd < 0)
    return fd;
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wr_sys_error (err, "stat %s", rel);
  if (!S_ISREG (st.st_mode) || st.st_size > MAX_JSON)
    return wr_error (err, 0, WR_E_INVALID, "'%.300s' is not a regular file under 4 MiB", rel);
  _cleanup_free_ char *buf = malloc ((size_t)st.st_size + 1);
  if (buf == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  ssize_t n = wr_read_all (fd, buf, (size_t)st.st_size);
  if (n < 0)
    return wr_sys_error (err, "read %s", rel);
  size_t len = (size_t)n;
  buf[len] = '\0';
  if (hex)
    wr_sha256_hex (buf, len, hex);
  json_error_t jerr;
  *ret = json_loadb (buf, len, 0, &jerr);
  if (*ret == NULL)
    return wr_error (err, 0, WR_E_INVALID, "'%.300s' is not valid JSON: %s", rel, jerr.text);
  return 0;
}

static bool
hex64 (const char *s)
{
  if (s == NULL || strlen (s) != 64)
    return false;
  for (int i = 0; i < 64; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return false;
  return true;
}

/* "sha256:<hex>" -> hex, or NULL */
static const char *
sha256_of (const char *digest)
{
  if (digest && strncmp (digest, "sha256:", 7) == 0 && hex64 (digest + 7))
    return digest + 7;
  return NULL;
}

static int
verify_fd (int fd, const char *want_hex, const char *what, wr_err_t *err)
{
  char hex[65];
  int r = wr_sha256_fd (fd, hex);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "hash %s", what);
  if (strcmp (hex, want_hex) != 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "digest mismatch for %s: content is sha256:%.12s..., expected sha256:%.12s...",
                     what, hex, want_hex);
  return 0;
}

/* Map an OCI image config ({"config":{"Env","WorkingDir","User",
 * "Entrypoint","Cmd","Labels"}}) onto ours. */
static json_t *
map_config (json_t *oci)
{
  json_t *c = json_object_get (oci, "config");
  if (!json_is_object (c))
    c = json_object_get (oci, "container_config");
  json_t *out = json_object ();
  if (!json_is_object (c))
    return out;
  json_t *env = json_object_get (c, "Env");
  if (json_is_array (env))
    {
      json_t *e = json_array ();
      size_t i;
      json_t *v;
      json_array_foreach (env, i, v)
      {
        const char *s = json_string_value (v);
        if (s && strchr (s, '=') > s)
          json_array_append (e, v);
      }
      json_object_set_new (out, "env", e);
    }
  const char *wd = json_string_value (json_object_get (c, "WorkingDir"));
  if (wd && wd[0] == '/')
    json_object_set_new (out, "workdir", json_string (wd));
  const char *user = json_string_value (json_object_get (c, "User"));
  if (user && user[0])
    json_object_set_new (out, "user", json_string (user));
  json_t *ep = json_array ();
  json_t *parts[2] = { json_object_get (c, "Entrypoint"), json_object_get (c, "Cmd") };
  for (int k = 0; k < 2; k++)
    {
      size_t i;
      json_t *v;
      if (json_is_array (parts[k]))
        json_array_foreach (parts[k], i, v) if (json_is_string (v)) json_array_append (ep, v);
    }
  json_object_set_new (out, "entrypoint", json_array_size (ep) ? ep : json_null ());
  if (!json_array_size (ep))
    json_decref (ep);
  json_t *labels = json_object_get (c, "Labels");
  if (json_is_object (labels))
    {
      json_t *l = json_object ();
      const char *k;
      json_t *v;
      json_object_foreach (labels, k, v) if (json_is_string (v)) json_object_set (l, k, v);
      json_object_set_new (out, "labels", l);
    }
  return out;
}

int
wr_oci_commit (struct wr_store *s, const char *ref, json_t *oci_config, const int *fds,
               const char *const *blobs, size_t n, wr_progress_fn progress, void *ud,
               struct wr_image **ret, wr_err_t *err)
{
  int r = wr_layers_check (n, "the image", err);
  if (r < 0)
    return r;
  struct wr_staged_layer *staged[WR_MAX_LAYERS] = { NULL };
  struct wr_layer_ref refs[WR_MAX_LAYERS];
  char have[WR_MAX_LAYERS][72];
  memset (refs, 0, sizeof refs);
  struct wr_store_limits lim;
  wr_store_get_limits (s, &lim);
  uint64_t unpacked = 0;
  for (size_t i = 0; i < n; i++)
    {
      if (progress)
        progress (ud, "layer", i, n);
      if (blobs[i] && wr_blob_layer (s, blobs[i], have[i], NULL) == 1)
        {
          /* already stored: the commit re-checks it under the lock */
          refs[i].digest = have[i];
          continue;
        }
      if (fds[i] < 0)
        {
          r = wr_error (err, 0, WR_E_INTERNAL, "layer %zu was not fetched", i);
          goto out;
        }
      char label[96];
      snprintf (label, sizeof label, "layer %.80s", blobs[i] ? blobs[i] : "?");
      r = wr_layer_stage_fd (s, fds[i], label, WR_STAGE_OCI, &staged[i], err);
      if (r < 0)
        {
          wr_error_wrap (err, "layer %zu of %zu", i + 1, n);
          goto out;
        }
      /* the blob was verified before; what was extracted must be the same
       * bytes, or the cache would map the blob to other content */
      if (blobs[i] && strcmp (staged[i]->source, blobs[i]) != 0)
        {
          r = wr_error (err, 0, WR_E_INVALID,
                        "layer %zu changed while it was read: extracted %.19s..., verified "
                        "%.19s...",
                        i + 1, staged[i]->source, blobs[i]);
          goto out;
        }
      unpacked += staged[i]->unpacked;
      if (lim.image_bytes && unpacked > lim.image_bytes)
        {
          r = wr_error (err, EFBIG, WR_E_TOO_LARGE,
                        "the image's layers unpack to more than %llu bytes (at layer %zu); see "
                        "'Limits' in docs/images.md",
                        (unsigned long long)lim.image_bytes, i + 1);
          goto out;
        }
      if (blobs[i])
        snprintf (staged[i]->blob, sizeof staged[i]->blob, "%s", blobs[i]);
      refs[i].staged = staged[i];
    }
  if (progress)
    progress (ud, "layer", n, n);
  {
    json_t *cfg = map_config (oci_config);
    r = wr_image_commit (s, ref, refs, n, cfg, ret, err);
    json_decref (cfg);
  }
out:
  staged_free_all (staged, n);
  return r;
}

static void
close_all (int *fds, size_t n)
{
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0)
      close (fds[i]);
}

/* Pick one image manifest out of an index: the host's platform when
 * platforms are given, else the first. */
static json_t *
index_pick (json_t *index)
{
  json_t *ms = json_object_get (index, "manifests");
  size_t i;
  json_t *m;
  json_array_foreach (ms, i, m)
  {
    json_t *p = json_object_get (m, "platform");
    const char *os = json_string_value (json_object_get (p, "os"));
    const char *arch = json_string_value (json_object_get (p, "architecture"));
    if (p == NULL
        || ((!os || strcmp (os, "linux") == 0) && (!arch || strcmp (arch, WR_OCI_ARCH) == 0)))
      return m;
  }
  return NULL;
}

static int
open_blob (int dfd, const char *digest, const char *what, int *ret_fd, wr_err_t *err)
{
  const char *hex = sha256_of (digest);
  if (hex == NULL)
    return wr_error (err, 0, WR_E_INVALID, "%s has an invalid digest '%.80s'", what,
                     digest ? digest : "(none)");
  char rel[128];
  snprintf (rel, sizeof rel, "blobs/sha256/%s", hex);
  _cleanup_close_ int fd = open_beneath (dfd, rel, O_RDONLY, err);
  if (fd < 0)
    return wr_error_wrap (err, "%s %s is missing", what, digest);
  struct stat st;
  if (fstat (fd, &st) < 0 || !S_ISREG (st.st_mode))
    return wr_error (err, 0, WR_E_INVALID, "%s %s is not a regular file", what, digest);
  int r = verify_fd (fd, hex, what, err);
  if (r < 0)
    return r;
  *ret_fd = TAKE_FD (fd);
  return 0;
}

static int
json_blob (int dfd, const char *digest, const char *what, json_t **ret, wr_err_t *err)
{
  _cleanup_close_ int fd = -1;
  int r = open_blob (dfd, digest, what, &fd, err);
  if (r < 0)
    return r;
  char hex[65];
  char rel[128];
  snprintf (rel, sizeof rel, "blobs/sha256/%s", digest + 7);
  return read_json_at (dfd, rel, ret, hex, err);
}

static int
import_oci_layout (struct wr_store *s, const char *ref, int dfd, wr_progress_fn progress, void *ud,
                   struct wr_image **ret, wr_err_t *err)
{
  _cleanup_ (json_decrefp) json_t *layout = NULL;
  _cleanup_ (json_decrefp) json_t *index = NULL;
  int r = read_json_at (dfd, "oci-layout", &layout, NULL, err);
  if (r < 0)
    return r;
  if (!json_is_string (json_object_get (layout, "imageLayoutVersion")))
    return wr_error (err, 0, WR_E_INVALID, "oci-layout has no imageLayoutVersion");
  r = read_json_at (dfd, "index.json", &index, NULL, err);
  if (r < 0)
    return r;
  _cleanup_ (json_decrefp) json_t *manifest = NULL;
  json_t *cur = json_incref (index);
  for (int depth = 0;; depth++)
    {
      json_t *desc = index_pick (cur);
      json_decref (cur);
      if (desc == NULL)
        return wr_error (err, 0, WR_E_INVALID, "image index has no manifest for linux/%s",
                         WR_OCI_ARCH);
      const char *mt = json_string_value (json_object_get (desc, "mediaType"));
      json_t *next = NULL;
      r = json_blob (dfd, json_string_value (json_object_get (desc, "digest")), "manifest", &next,
                     err);
      if (r < 0)
        return r;
      bool is_index = (mt && strstr (mt, "index")) || (mt && strstr (mt, "manifest.list"))
                      || json_is_array (json_object_get (next, "manifests"));
      if (!is_index)
        {
          manifest = next;
          break;
        }
      if (depth >= 3)
        {
          json_decref (next);
          return wr_error (err, 0, WR_E_INVALID, "image indexes nested too deep");
        }
      cur = next;
    }
  return wr_oci_from_manifest_dir (s, ref, dfd, manifest, progress, ud, ret, err);
}

int
wr_oci_from_manifest_dir (struct wr_store *s, const char *ref, int dfd, json_t *manifest,
                          wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err)
{
  json_t *layers = json_object_get (manifest, "layers");
  if (!json_is_array (layers))
    return wr_error (err, 0, WR_E_INVALID, "image manifest has no layer list");
  _cleanup_ (json_decrefp) json_t *config = NULL;
  int r = json_blob (
      dfd, json_string_value (json_object_get (json_object_get (manifest, "config"), "digest")),
      "config", &config, err);
  if (r < 0)
    return r;
  size_t n = json_array_size (layers);
  r = wr_layers_check (n, "the image manifest", err);
  if (r < 0)
    return r;
  int fds[WR_MAX_LAYERS];
  const char *blobs[WR_MAX_LAYERS];
  for (size_t i = 0; i < n; i++)
    fds[i] = -1;
  for (size_t i = 0; i < n; i++)
    {
      json_t *l = json_array_get (layers, i);
      blobs[i] = json_string_value (json_object_get (l, "digest"));
      const char *mt = json_string_value (json_object_get (l, "mediaType"));
      if (mt && !strstr (mt, "tar") && !strstr (mt, "layer"))
        {
          close_all (fds, n);
          return wr_error (err, 0, WR_E_UNSUPPORTED, "layer %zu has unsupported media type %s",
                           i + 1, mt);
        }
      char what[32];
      snprintf (what, sizeof what, "layer %zu", i + 1);
      /* hashed here even when the layer is stored: the cache lookup in
       * wr_oci_commit is then on a digest these bytes really have */
      r = open_blob (dfd, blobs[i], what, &fds[i], err);
      if (r < 0)
        {
          close_all (fds, n);
          return r;
        }
    }
  r = wr_oci_commit (s, ref, config, fds, blobs, n, progress, ud, ret, err);
  close_all (fds, n);
  return r;
}

/* Run a WR_UNPACK_PROBE or WR_UNPACK_DIFF_ID pass over fd in the confined
 * helper, in an empty directory of its own. */
static int
confined_pass (struct wr_store *s, int fd, unsigned mode, const struct wr_extract_limits *lim,
               struct wr_extract_stats *xs, wr_err_t *err)
{
  char dir[4096];
  int r = wr_store_tmpdir (s, "probe", dir, sizeof dir, err);
  if (r < 0)
    return r;
  _cleanup_close_ int dfd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  r = dfd < 0 ? wr_sys_error (err, "open %s", dir) : wr_unpack (fd, dfd, -1, mode, lim, xs, err);
  rmdir (dir);
  return r;
}

/* A docker-save layer file must be what the config's rootfs.diff_ids says
 * (the sha256 of the uncompressed tar) and, when stored as
 * blobs/sha256/<hex>, what its name says. ret_key: "sha256:<hex>" of the
 * file's bytes, the only digest the layer cache may be keyed on. */
static int
verify_docker_layer (struct wr_store *s, int fd, const char *path, const char *diff_id,
                     const struct wr_extract_limits *lim, const char *what, char ret_key[72],
                     wr_err_t *err)
{
  char hex[65];
  int r = wr_sha256_fd (fd, hex);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "hash %s", what);
  const char *slash = strrchr (path, '/');
  const char *named = slash && strstr (path, "sha256/") && hex64 (slash + 1) ? slash + 1 : NULL;
  if (named && strcmp (named, hex) != 0)
    return wr_error (err, 0, WR_E_INVALID,
                     "digest mismatch for %s: content is sha256:%.12s..., its name says "
                     "sha256:%.12s...",
                     what, hex, named);
  if (strcmp (hex, diff_id) != 0)
    {
      /* a compressed layer: its diff id is that of the tar inside */
      struct wr_extract_stats xs;
      r = confined_pass (s, fd, WR_UNPACK_DIFF_ID, lim, &xs, err);
      if (r < 0)
        return wr_error_wrap (err, "%s", what);
      const char *unpacked = xs.uncompressed;
      if (strcmp (unpacked, diff_id) != 0)
        return wr_error (err, 0, WR_E_INVALID,
                         "digest mismatch for %s: content is sha256:%.12s..., the config's "
                         "diff_id is sha256:%.12s...",
                         what, unpacked, diff_id);
    }
  snprintf (ret_key, 72, "sha256:%s", hex);
  return 0;
}

/* docker save: manifest.json = [{"Config":"x.json","RepoTags":[...],"Layers":["y/layer.tar"]}].
 * Layer files are plain tars whose sha256 is the config's rootfs.diff_ids[i]
 * (or, in newer archives, their blobs/sha256/<hex> name). */
static int
import_docker_dir (struct wr_store *s, const char *ref, int dfd, wr_progress_fn progress, void *ud,
                   struct wr_image **ret, wr_err_t *err)
{
  _cleanup_ (json_decrefp) json_t *mf = NULL;
  int r = read_json_at (dfd, "manifest.json", &mf, NULL, err);
  if (r < 0)
    return r;
  json_t *m = json_array_get (mf, 0);
  const char *cfgpath = json_string_value (json_object_get (m, "Config"));
  json_t *layers = json_object_get (m, "Layers");
  if (cfgpath == NULL || !json_is_array (layers))
    return wr_error (err, 0, WR_E_INVALID,
                     "manifest.json is not a docker-save manifest (no Config or Layers)");
  _cleanup_ (json_decrefp) json_t *config = NULL;
  char chex[65];
  r = read_json_at (dfd, cfgpath, &config, chex, err);
  if (r < 0)
    return r;
  /* "<hex>.json" or "blobs/sha256/<hex>": the name is the digest */
  {
    const char *base = strrchr (cfgpath, '/') ? strrchr (cfgpath, '/') + 1 : cfgpath;
    char want[65] = "";
    if (strlen (base) >= 64)
      snprintf (want, sizeof want, "%.64s", base);
    if (hex64 (want) && strcmp (want, chex) != 0)
      return wr_error (err, 0, WR_E_INVALID, "digest mismatch for config %s", cfgpath);
  }
  json_t *diff_ids = json_object_get (json_object_get (config, "rootfs"), "diff_ids");
  size_t n = json_array_size (layers);
  r = wr_layers_check (n, "manifest.json", err);
  if (r < 0)
    return r;
  if (json_array_size (diff_ids) != n)
    return wr_error (err, 0, WR_E_INVALID,
                     "config lists %zu layer digests (rootfs.diff_ids) for %zu layers",
                     json_array_size (diff_ids), n);
  int fds[WR_MAX_LAYERS];
  char keys[WR_MAX_LAYERS][72];
  const char *blobs[WR_MAX_LAYERS];
  struct wr_extract_limits lim;
  wr_store_extract_limits (s, false, &lim);
  for (size_t i = 0; i < n; i++)
    fds[i] = -1;
  for (size_t i = 0; i < n; i++)
    {
      const char *lp = json_string_value (json_array_get (layers, i));
      const char *want = sha256_of (json_string_value (json_array_get (diff_ids, i)));
      if (lp == NULL || want == NULL)
        {
          close_all (fds, n);
          return wr_error (err, 0, WR_E_INVALID, "layer %zu has no path or digest", i + 1);
        }
      fds[i] = open_beneath (dfd, lp, O_RDONLY, err);
      if (fds[i] < 0)
        {
          close_all (fds, n);
          return wr_error_wrap (err, "layer %zu", i + 1);
        }
      char what[4200];
      snprintf (what, sizeof what, "layer %zu (%.300s)", i + 1, lp);
      r = verify_docker_layer (s, fds[i], lp, want, &lim, what, keys[i], err);
      if (r < 0)
        {
          close_all (fds, n);
          return r;
        }
      /* the layer cache is keyed on the digest of the bytes just hashed */
      blobs[i] = keys[i];
    }
  r = wr_oci_commit (s, ref, config, fds, blobs, n, progress, ud, ret, err);
  close_all (fds, n);
  return r;
}

static int
import_dir_fd (struct wr_store *s, const char *ref, const char *path, int dfd,
               wr_progress_fn progress, void *ud, struct wr_image **ret, wr_err_t *err)
{
  if (faccessat (dfd, "oci-layout", F_OK, AT_SYMLINK_NOFOLLOW) == 0
      && faccessat (dfd, "index.json", F_OK, AT_SYMLINK_NOFOLLOW) == 0)
    return import_oci_layout (s, ref, dfd, progress, ud, ret, err);
  if (faccessat (dfd, "manifest.json", F_OK, AT_SYMLINK_NOFOLLOW) == 0)
    return import_docker_dir (s, ref, dfd, progress, ud, ret, err);
  if (progress)
    progress (ud, "rootfs", 0, 1);
  int r = wr_image_import (s, ref, path, ret, err);
  if (r == 0 && progress)
    progress (ud, "rootfs", 1, 1);
  return r;
}

int
wr_image_import_any (struct wr_store *s, const char *ref, const char *path, wr_progress_fn progress,
                     void *ud, struct wr_image **ret, wr_err_t *err)
{
  if (!wr_ref_valid (ref) || strchr (ref, '@'))
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "invalid image name '%.300s' (want name[:tag], lowercase)",
                     ref ? ref : "(null)");
  if (path == NULL || path[0] == '\0')
    return wr_error (err, EINVAL, WR_E_INVALID, "import path is empty");
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0)
    return wr_error (err, errno, errno == ENOENT ? WR_E_NOT_FOUND : WR_E_INVALID,
                     "cannot open import source %s", path);
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wr_sys_error (err, "stat %s", path);
  if (S_ISDIR (st.st_mode))
    return import_dir_fd (s, ref, path, fd, progress, ud, ret, err);
  if (!S_ISREG (st.st_mode))
    return wr_error (err, 0, WR_E_INVALID, "import source %s is neither a directory nor a file",
                     path);
  fcntl (fd, F_SETFL, 0);
  struct wr_extract_limits lim;
  wr_store_extract_limits (s, true, &lim);
  struct wr_extract_stats probe;
  int pr = confined_pass (s, fd, WR_UNPACK_PROBE, &lim, &probe, err);
  if (pr < 0)
    return wr_error_wrap (err, "import %s", path);
  if (!probe.image_archive)
    {
      if (progress)
        progress (ud, "rootfs", 0, 1);
      int r = wr_image_import (s, ref, path, ret, err);
      if (r == 0 && progress)
        progress (ud, "rootfs", 1, 1);
      return r;
    }
  /* an image archive: unpack it (safely) and import the directory */
  char work[4096];
  int r = wr_store_tmpdir (s, "archive", work, sizeof work, err);
  if (r < 0)
    return r;
  _cleanup_close_ int wfd = open (work, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  if (wfd < 0)
    r = wr_sys_error (err, "open %s", work);
  else
    {
      if (progress)
        progress (ud, "unpack", 0, 1);
      struct wr_extract_stats xs;
      r = wr_unpack (fd, wfd, -1, 0, &lim, &xs, err);
      if (r < 0)
        {
          if (err && (err->errnum == ENOSPC || err->errnum == EDQUOT))
            err->code = WR_E_EXHAUSTED;
          wr_error_wrap (err, "import %s", path);
        }
      else
        r = import_dir_fd (s, ref, work, wfd, progress, ud, ret, err);
    }
  char *slash = strrchr (work, '/');
  *slash = '\0';
  _cleanup_close_ int pfd = open (work, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd >= 0)
    wr_rm_rf_at (pfd, slash + 1);
  return r;
}

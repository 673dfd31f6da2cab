/* OCI whiteout conversion, multi-layer commits, tags, blob mappings, and
 * OCI layout / docker-save imports built with tar(1) (TAP). */
#include "image/internal.h"
#include "image/sha256.h"
#include "image/store.h"

#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/util.h"
#include "tap.h"

static char base[256], root[300];

static int sh (const char *fmt, ...) __attribute__ ((format (printf, 1, 2)));
static int
sh (const char *fmt, ...)
{
  char cmd[8192];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (cmd, sizeof cmd, fmt, ap);
  va_end (ap);
  return system (cmd);
}

static int
count_dir (const char *path)
{
  _cleanup_closedir_ DIR *d = opendir (path);
  int n = 0;
  struct dirent *de;
  while (d && (de = readdir (d)))
    n += de->d_name[0] != '.';
  return n;
}

static int
extract (const char *tar, const char *dir, unsigned flags, struct wr_extract_stats *xs,
         wr_err_t *err)
{
  sh ("rm -rf %s && mkdir -p %s", dir, dir);
  _cleanup_close_ int fd = open (tar, O_RDONLY | O_CLOEXEC);
  _cleanup_close_ int dfd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  return wr_tar_extract_ex (fd, dfd, flags, NULL, xs, err);
}

static void
test_whiteouts (void)
{
  char src[400], tar[400], out[400], p[600];
  snprintf (src, sizeof src, "%s/wsrc", base);
  snprintf (tar, sizeof tar, "%s/w.tar", base);
  snprintf (out, sizeof out, "%s/wout", base);
  sh ("mkdir -p %s/d/sub && touch %s/.wh.gone %s/d/.wh..wh..opq %s/d/sub/.wh.x %s/d/keep"
      " && tar -C %s -cf %s .",
      src, src, src, src, src, src, tar);
  struct wr_extract_stats xs;
  wr_err_t err;
  int r = extract (tar, out, WR_EXTRACT_OCI_WHITEOUTS, &xs, &err);
  TAP_EQ (r, 0, "extract with whiteouts (%s)", r ? err.msg : "ok");
  TAP_EQ (xs.whiteouts, 3, "3 whiteouts converted (%llu)", (unsigned long long)xs.whiteouts);
  struct stat st;
  snprintf (p, sizeof p, "%s/gone", out);
  TAP_OK (TAP_C_EQ (lstat (p, &st), 0) && S_ISCHR (st.st_mode)
              && TAP_C_EQ (st.st_rdev, makedev (0, 0)),
          ".wh.gone -> 0/0 char device gone");
  snprintf (p, sizeof p, "%s/d/sub/x", out);
  TAP_OK (TAP_C_EQ (lstat (p, &st), 0) && S_ISCHR (st.st_mode), "nested whiteout");
  snprintf (p, sizeof p, "%s/.wh.gone", out);
  TAP_LT_INT (lstat (p, &st), 0, "no .wh. file left");
  snprintf (p, sizeof p, "%s/d", out);
  char v[8] = "";
  TAP_OK (TAP_C_EQ (getxattr (p, "user.overlay.opaque", v, sizeof v), 1) && TAP_C_EQ (v[0], 'y'),
          ".wh..wh..opq -> user.overlay.opaque=y");
  snprintf (p, sizeof p, "%s/d/.wh..wh..opq", out);
  TAP_LT_INT (lstat (p, &st), 0, "no opaque marker file left");
  snprintf (p, sizeof p, "%s/d/keep", out);
  TAP_OK (TAP_C_EQ (lstat (p, &st), 0) && S_ISREG (st.st_mode), "siblings kept");

  /* a plain rootfs tarball: .wh. files are just files */
  r = extract (tar, out, 0, &xs, &err);
  snprintf (p, sizeof p, "%s/.wh.gone", out);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (lstat (p, &st), 0) && S_ISREG (st.st_mode)
              && TAP_C_EQ (xs.whiteouts, 0),
          "without the flag .wh. files stay files");

  /* invalid whiteouts */
  static const char *const bad[] = { ".wh..wh.x", ".wh." };
  for (size_t i = 0; i < WR_ARRAY_SIZE (bad); i++)
    {
      sh ("rm -rf %s && mkdir -p %s && touch '%s/%s' && tar -C %s -cf %s .", src, src, src, bad[i],
          src, tar);
      r = extract (tar, out, WR_EXTRACT_OCI_WHITEOUTS, &xs, &err);
      TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID)
                  && TAP_C_HAS_STR (err.msg, "whiteout"),
              "whiteout '%s' rejected (%s)", bad[i], r < 0 ? err.msg : "accepted");
    }
  /* a whiteout trying to leave the tree is still a '..' path */
  sh ("rm -rf %s && mkdir -p %s/a && cd %s && tar --transform 's,a/x,../.wh.x,' -cf %s a "
      "2>/dev/null; touch %s/a/x && tar -C %s --transform 's,^a/x$,a/../../.wh.x,' -cf %s a/x",
      src, src, src, tar, src, src, tar);
  r = extract (tar, out, WR_EXTRACT_OCI_WHITEOUTS, &xs, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, ".."), "whiteout with .. rejected (%s)",
          r < 0 ? err.msg : "accepted");
  /* overlay xattrs carried by the archive are dropped even for OCI layers */
  sh ("rm -rf %s && mkdir -p %s/o && setfattr -n user.overlay.redirect -v /x %s/o 2>/dev/null;"
      " python3 -c \"import os; os.setxattr('%s/o', 'user.overlay.opaque', b'y')\" && "
      "tar --xattrs --xattrs-include='*' -C %s -cf %s .",
      src, src, src, src, src, tar);
  r = extract (tar, out, WR_EXTRACT_OCI_WHITEOUTS, &xs, &err);
  snprintf (p, sizeof p, "%s/o", out);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_LT (getxattr (p, "user.overlay.opaque", v, sizeof v), 0),
          "an archive's own user.overlay.opaque xattr is dropped");
}

static void
test_commit (struct wr_store *s)
{
  char dir[400], p[600], layers[400];
  snprintf (dir, sizeof dir, "%s/c1", base);
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  sh ("mkdir -p %s && echo one > %s/one", dir, dir);
  wr_err_t err;
  struct wr_staged_layer *a = NULL, *b = NULL;
  TAP_EQ (wr_layer_stage (s, dir, 0, &a, &err), 0, "stage a");
  sh ("echo two > %s/two", dir);
  TAP_EQ (wr_layer_stage (s, dir, 0, &b, &err), 0, "stage b");
  int before = count_dir (layers);
  TAP_EQ (count_dir (layers), before, "staged layers are not in ROOT/layers");

  /* a commit naming a missing layer fails and renames nothing */
  struct wr_layer_ref refs[3] = { { .staged = a },
                                  { .digest = "sha256:"
                                              "0000000000000000000000000000000000000000000000000000"
                                              "000000000000" },
                                  { .staged = b } };
  struct wr_image *img = NULL;
  int r = wr_image_commit (s, "multi:1", refs, 3, NULL, &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "missing layer: not_found (%s)", r < 0 ? err.msg : "ok");
  TAP_EQ (count_dir (layers), before, "and no layer file left behind");
  TAP_LT_INT (wr_image_resolve (s, "multi:1", &img, NULL), 0, "and no image");

  /* duplicates are kept once, at the top-most position */
  struct wr_layer_ref ok[3] = { { .staged = a }, { .staged = b }, { .staged = a } };
  r = wr_image_commit (s, "multi:1", ok, 3, NULL, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (img->n_layers, 2) && TAP_C_EQ_STR (img->layers[0], b->digest)
              && TAP_C_EQ_STR (img->layers[1], a->digest),
          "commit: duplicate layer kept once, top-most (%s)", r ? err.msg : "ok");
  TAP_EQ (count_dir (layers), before + 2, "two layer files");
  wr_image_free (img);
  img = NULL;

  /* tags */
  r = wr_image_tag (s, "multi:1", "multi:2", &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->name, "multi:2"), "tag");
  wr_image_free (img);
  img = NULL;
  TAP_OK (TAP_C_LT (wr_image_tag (s, "ghost:1", "x:1", NULL, &err), 0)
              && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "tag of an unknown image: not_found");
  TAP_OK (TAP_C_LT (wr_image_tag (s, "multi:1", "Bad:1", NULL, &err), 0)
              && TAP_C_EQ_STR (err.code, WR_E_INVALID),
          "tag to a bad name: invalid_argument");

  /* blob mappings follow their layer */
  snprintf (a->blob, sizeof a->blob, "sha256:%064d", 7);
  struct wr_layer_ref withblob[1] = { { .staged = a } };
  TAP_EQ (wr_image_commit (s, "blobbed:1", withblob, 1, NULL, NULL, &err), 0, "commit with blob");
  char have[72];
  TAP_OK (TAP_C_EQ (wr_blob_layer (s, a->blob, have, &err), 1) && TAP_C_EQ_STR (have, a->digest),
          "blob maps to its layer");
  wr_image_remove (s, "blobbed:1", NULL);
  wr_image_remove (s, "multi:1", NULL);
  wr_image_remove (s, "multi:2", NULL);
  TAP_EQ (wr_blob_layer (s, a->blob, have, &err), 0, "mapping gone with the layer");
  TAP_EQ (count_dir (layers), before, "gc removed both layers");
  wr_layer_stage_free (a);
  wr_layer_stage_free (b);
  snprintf (p, sizeof p, "%s/tmp", root);
  TAP_EQ (count_dir (p), 0, "staged work dirs removed");
}

static void
test_oci_layout (struct wr_store *s)
{
  /* build an OCI layout with the shell: one layer, whiteout + opaque */
  char d[400];
  snprintf (d, sizeof d, "%s/oci", base);
  int r = sh (
      "set -e; d=%s; rm -rf $d; mkdir -p $d/blobs/sha256 $d/l/etc $d/l/opt;"
      " echo hi > $d/l/etc/hi; touch $d/l/etc/.wh.motd $d/l/opt/.wh..wh..opq;"
      " tar -C $d/l -cf - . | gzip -n > $d/layer; L=$(sha256sum < $d/layer | cut -c1-64);"
      " LS=$(stat -c %%s $d/layer); mv $d/layer $d/blobs/sha256/$L;"
      " printf '{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"Env\":[\"A=1\"],"
      "\"WorkingDir\":\"/etc\"},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[]}}' > $d/c;"
      " C=$(sha256sum < $d/c | cut -c1-64); CS=$(stat -c %%s $d/c); mv $d/c $d/blobs/sha256/$C;"
      " printf '{\"schemaVersion\":2,\"config\":{\"digest\":\"sha256:'$C'\",\"size\":'$CS'},"
      "\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\","
      "\"digest\":\"sha256:'$L'\",\"size\":'$LS'}]}' > $d/m;"
      " M=$(sha256sum < $d/m | cut -c1-64); MS=$(stat -c %%s $d/m); mv $d/m $d/blobs/sha256/$M;"
      " printf '{\"imageLayoutVersion\":\"1.0.0\"}' > $d/oci-layout;"
      " printf '{\"schemaVersion\":2,\"manifests\":[{\"digest\":\"sha256:'$M'\",\"size\":'$MS'}]}'"
      " > $d/index.json; rm -rf $d/l",
      d);
  TAP_EQ (r, 0, "made an OCI layout");
  wr_err_t err;
  struct wr_image *img = NULL;
  r = wr_image_import_any (s, "ocil:1", d, NULL, NULL, &img, &err);
  TAP_EQ (r, 0, "import OCI layout (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      TAP_EQ (img->n_layers, 1, "one layer");
      TAP_EQ_STR (json_string_value (json_object_get (img->config, "workdir")), "/etc",
                  "WorkingDir mapped");
      TAP_EQ_STR (json_string_value (json_array_get (json_object_get (img->config, "env"), 0)),
                  "A=1", "Env mapped");
      /* the layer holds the converted whiteout */
      const char *dir = NULL;
      r = wr_layer_acquire (s, img->layers[0], &dir, &err);
      char p[4200];
      struct stat st;
      snprintf (p, sizeof p, "%s/etc/motd", dir ? dir : "/nonexistent");
      TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (lstat (p, &st), 0) && S_ISCHR (st.st_mode)
                  && TAP_C_EQ (st.st_rdev, 0),
              "whiteout in the EROFS layer is a 0/0 char device");
      char v[4] = "";
      snprintf (p, sizeof p, "%s/opt", dir ? dir : "/nonexistent");
      TAP_OK (TAP_C_EQ (getxattr (p, "user.overlay.opaque", v, sizeof v), 1)
                  && TAP_C_EQ (v[0], 'y'),
              "opaque xattr in the EROFS layer");
      if (r == 0)
        wr_layer_release (s, img->layers[0]);
      wr_image_free (img);
    }
  /* tamper with the layer blob: digest mismatch, nothing stored */
  char layers[400];
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  int before = count_dir (layers);
  wr_image_remove (s, "ocil:1", NULL);
  before = count_dir (layers);
  sh ("cd %s/blobs/sha256 && for f in *; do if gzip -t $f 2>/dev/null; then "
      "printf x >> $f; fi; done",
      d);
  r = wr_image_import_any (s, "ocil:2", d, NULL, NULL, &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "digest mismatch"),
          "tampered blob rejected (%s)", r < 0 ? err.msg : "accepted");
  TAP_EQ (count_dir (layers), before, "nothing stored");
}

/* A docker-save directory: every layer listed in manifest.json with the
 * config's diff ids. spec: "path=tarfile[:diffid-of-tarfile]" per layer,
 * written by a small python helper so the JSON stays readable. */
static int
docker_dir (const char *d, const char *layers_py)
{
  return sh (
      "set -e; rm -rf %s; mkdir -p %s; cd %s; python3 - <<'PY'\n"
      "import hashlib, json, os, shutil\n"
      "def sha(p): return 'sha256:' + hashlib.sha256(open(p, 'rb').read()).hexdigest()\n"
      "layers = %s\n"
      "paths, diff_ids = [], []\n"
      "for path, src, claim in layers:\n"
      "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n"
      "    shutil.copy(src, path)\n"
      "    paths.append(path); diff_ids.append(claim or sha(src))\n"
      "cfg = json.dumps({'config': {}, 'rootfs': {'type': 'layers', 'diff_ids': diff_ids}})\n"
      "open('c.json', 'w').write(cfg)\n"
      "json.dump([{'Config': 'c.json', 'Layers': paths}], open('manifest.json', 'w'))\n"
      "PY",
      d, d, d, layers_py);
}

static bool
layer_file_says (struct wr_store *s, const char *layer, const char *file, const char *want)
{
  const char *dir = NULL;
  if (wr_layer_acquire (s, layer, &dir, NULL) < 0)
    return false;
  char p[4200], buf[64] = "";
  snprintf (p, sizeof p, "%s/%s", dir, file);
  FILE *f = fopen (p, "r");
  if (f)
    {
      if (fgets (buf, sizeof buf, f) == NULL)
        buf[0] = '\0';
      fclose (f);
    }
  wr_layer_release (s, layer);
  return strcmp (buf, want) == 0;
}

/* issue 9: an archive claiming a victim layer's diff id while shipping
 * other bytes must neither be stored nor poison the layer cache. */
static void
test_docker_save_cache_poisoning (struct wr_store *s)
{
  char d[400], victim[400], evil[400], py[2000];
  snprintf (victim, sizeof victim, "%s/victim.tar", base);
  snprintf (evil, sizeof evil, "%s/evil.tar", base);
  sh ("set -e; cd %s; rm -rf pv pe; mkdir pv pe; echo genuine > pv/f; echo poisoned > pe/f;"
      " tar -C pv -cf victim.tar f; tar -C pe -cf evil.tar f; gzip -nk victim.tar",
      base);
  _cleanup_free_ char *claim = NULL;
  {
    _cleanup_close_ int fd = open (victim, O_RDONLY | O_CLOEXEC);
    char hex[65] = "";
    wr_sha256_fd (fd, hex);
    if (asprintf (&claim, "sha256:%s", hex) < 0)
      return;
  }
  snprintf (d, sizeof d, "%s/save-evil", base);
  wr_err_t err;
  char layers[400];
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  int before = count_dir (layers);

  /* the attacker comes first: a blob named by its own digest, claiming the
   * victim's diff id */
  char evil_hex[65] = "";
  {
    _cleanup_close_ int fd = open (evil, O_RDONLY | O_CLOEXEC);
    wr_sha256_fd (fd, evil_hex);
  }
  snprintf (py, sizeof py, "[('blobs/sha256/%s', '%s', '%s')]", evil_hex, evil, claim);
  TAP_EQ (docker_dir (d, py), 0, "made a docker-save dir lying about its diff id");
  int r = wr_image_import_any (s, "evil:1", d, NULL, NULL, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID)
              && TAP_C_HAS_STR (err.msg, "digest mismatch") && TAP_C_HAS_STR (err.msg, "diff_id"),
          "content not matching its claimed diff id is rejected (%s)", r < 0 ? err.msg : "stored");
  TAP_EQ (count_dir (layers), before, "nothing stored");
  /* same lie in a classic layout (<id>/layer.tar) */
  snprintf (py, sizeof py, "[('x/layer.tar', '%s', '%s')]", evil, claim);
  docker_dir (d, py);
  r = wr_image_import_any (s, "evil:2", d, NULL, NULL, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "digest mismatch"),
          "classic layout: rejected too (%s)", r < 0 ? err.msg : "stored");

  /* the genuine image gets its own content */
  snprintf (py, sizeof py, "[('v/layer.tar', '%s', None)]", victim);
  docker_dir (d, py);
  struct wr_image *img = NULL;
  r = wr_image_import_any (s, "victim:1", d, NULL, NULL, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && layer_file_says (s, img->layers[0], "f", "genuine\n"),
          "victim imported with its own bytes (%s)", r ? err.msg : "ok");
  char vlayer[72] = "";
  if (r == 0)
    snprintf (vlayer, sizeof vlayer, "%s", img->layers[0]);
  wr_image_free (img);
  img = NULL;

  /* the attacker after the victim: the cached layer is not replaced */
  snprintf (py, sizeof py, "[('blobs/sha256/%s', '%s', '%s')]", evil_hex, evil, claim);
  docker_dir (d, py);
  r = wr_image_import_any (s, "evil:3", d, NULL, NULL, NULL, &err);
  TAP_LT_INT (r, 0, "lie rejected with the victim stored (%s)", r < 0 ? err.msg : "stored");
  snprintf (py, sizeof py, "[('w/layer.tar', '%s', None)]", victim);
  docker_dir (d, py);
  r = wr_image_import_any (s, "victim:2", d, NULL, NULL, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->layers[0], vlayer)
              && layer_file_says (s, img->layers[0], "f", "genuine\n"),
          "victim re-import reuses the genuine layer (%s)", r ? err.msg : "ok");
  wr_image_free (img);
  img = NULL;

  /* a compressed layer named by its own digest: checked against the diff
   * id of the tar inside */
  char gz[400], gz_hex[65] = "";
  snprintf (gz, sizeof gz, "%s.gz", victim);
  {
    _cleanup_close_ int fd = open (gz, O_RDONLY | O_CLOEXEC);
    wr_sha256_fd (fd, gz_hex);
  }
  snprintf (py, sizeof py, "[('blobs/sha256/%s', '%s', '%s')]", gz_hex, gz, claim);
  docker_dir (d, py);
  r = wr_image_import_any (s, "victim:gz", d, NULL, NULL, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && layer_file_says (s, img->layers[0], "f", "genuine\n"),
          "gzip layer matching its diff id accepted (%s)", r ? err.msg : "ok");
  wr_image_free (img);
  img = NULL;
  snprintf (py, sizeof py, "[('blobs/sha256/%s', '%s', 'sha256:%s')]", gz_hex, gz, evil_hex);
  docker_dir (d, py);
  r = wr_image_import_any (s, "evil:gz", d, NULL, NULL, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "diff_id"),
          "gzip layer with a wrong diff id rejected (%s)", r < 0 ? err.msg : "stored");

  /* a file swapped between its check and its extraction (a directory the
   * caller controls): what is extracted is hashed as it is read */
  {
    _cleanup_close_ int fd = open (evil, O_RDONLY | O_CLOEXEC);
    const char *blobs[1] = { claim };
    int fds[1] = { fd };
    json_t *cfg = json_object ();
    wr_image_remove (s, "victim:1", NULL);
    wr_image_remove (s, "victim:2", NULL);
    wr_image_remove (s, "victim:gz", NULL);
    r = wr_oci_commit (s, "swapped:1", cfg, fds, blobs, 1, NULL, NULL, NULL, &err);
    json_decref (cfg);
    char have[72];
    TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "changed while it was read")
                && TAP_C_EQ (wr_blob_layer (s, claim, have, NULL), 0),
            "bytes differing from the verified digest are not cached under it (%s)",
            r < 0 ? err.msg : "stored");
  }
}

/* An OCI layout in d with n one-file layers of size bytes each. */
static int
oci_layers (const char *d, int n, int size)
{
  return sh (
      "set -e; rm -rf %s; mkdir -p %s; cd %s; python3 - <<'PY'\n"
      "import gzip, hashlib, io, json, os, tarfile\n"
      "os.makedirs('blobs/sha256')\n"
      "def put(b):\n"
      "    d = hashlib.sha256(b).hexdigest(); open('blobs/sha256/' + d, 'wb').write(b)\n"
      "    return {'digest': 'sha256:' + d, 'size': len(b)}\n"
      "layers = []\n"
      "for i in range(%d):\n"
      "    bio = io.BytesIO()\n"
      "    with tarfile.open(fileobj=bio, mode='w') as t:\n"
      "        data = (b'%%d' %% i).ljust(%d, b'.'); ti = tarfile.TarInfo('f%%d' %% i)\n"
      "        ti.size = len(data)\n"
      "        t.addfile(ti, io.BytesIO(data))\n"
      "    l = put(bio.getvalue()); l['mediaType'] = 'application/vnd.oci.image.layer.v1.tar'\n"
      "    layers.append(l)\n"
      "cfg = put(json.dumps({'config': {}}).encode())\n"
      "m = put(json.dumps({'schemaVersion': 2, 'config': cfg, 'layers': layers}).encode())\n"
      "json.dump({'imageLayoutVersion': '1.0.0'}, open('oci-layout', 'w'))\n"
      "json.dump({'schemaVersion': 2, 'manifests': [m]}, open('index.json', 'w'))\n"
      "PY",
      d, d, d, n, size);
}

/* issue 9: one layer limit, WR_MAX_LAYERS, at import and at commit */
static void
test_layer_limit (struct wr_store *s)
{
  char d[400];
  snprintf (d, sizeof d, "%s/many", base);
  int r = oci_layers (d, WR_MAX_LAYERS + 6, 1);
  TAP_EQ (r, 0, "made an OCI layout with %d layers", WR_MAX_LAYERS + 6);
  char layers[400];
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  int before = count_dir (layers);
  wr_err_t err;
  r = wr_image_import_any (s, "many:1", d, NULL, NULL, NULL, &err);
  char want[64];
  snprintf (want, sizeof want, "at most %d", WR_MAX_LAYERS);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID)
              && TAP_C_HAS_STR (err.msg, "layers") && TAP_C_HAS_STR (err.msg, want),
          "%d layers refused at import (%s)", WR_MAX_LAYERS + 6, r < 0 ? err.msg : "accepted");
  TAP_EQ (count_dir (layers), before, "nothing stored");

  /* stacking one more layer on a full image (pack, build COPY) */
  char dir[400];
  snprintf (dir, sizeof dir, "%s/c1", base);
  struct wr_staged_layer *a = NULL;
  TAP_EQ (wr_layer_stage (s, dir, 0, &a, &err), 0, "stage a layer");
  struct wr_image *img = NULL;
  struct wr_layer_ref one[1] = { { .staged = a } };
  TAP_EQ (wr_image_commit (s, "one:1", one, 1, NULL, &img, &err), 0, "commit it");
  const char *base_layers[WR_MAX_LAYERS];
  for (size_t i = 0; i < WR_MAX_LAYERS; i++)
    base_layers[i] = img ? img->layers[0] : "";
  struct wr_import_opts o = { .base_layers = base_layers, .n_base_layers = WR_MAX_LAYERS };
  r = wr_image_import_ex (s, "full:1", dir, &o, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID) && TAP_C_HAS_STR (err.msg, want),
          "a layer on %d layers refused (%s)", WR_MAX_LAYERS, r < 0 ? err.msg : "accepted");
  struct wr_layer_ref refs[WR_MAX_LAYERS + 1];
  for (size_t i = 0; i <= WR_MAX_LAYERS; i++)
    refs[i] = (struct wr_layer_ref){ .digest = img ? img->layers[0] : "" };
  r = wr_image_commit (s, "full:2", refs, WR_MAX_LAYERS + 1, NULL, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID),
          "commit of %d layers refused (%s)", WR_MAX_LAYERS + 1, r < 0 ? err.msg : "accepted");
  wr_image_free (img);
  wr_layer_stage_free (a);
  wr_image_remove (s, "one:1", NULL);

  /* the image bytes limit holds across layers */
  TAP_EQ (oci_layers (d, 3, 600), 0, "made a 3-layer OCI layout of 600-byte files");
  struct wr_store_limits dflt, l;
  wr_store_get_limits (s, &dflt);
  l = dflt;
  l.image_bytes = 1000;
  wr_store_set_limits (s, &l);
  r = wr_image_import_any (s, "three:1", d, NULL, NULL, NULL, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_TOO_LARGE)
              && TAP_C_HAS_STR (err.msg, "at layer 2"),
          "an image unpacking past image_bytes is refused (%s)", r < 0 ? err.msg : "accepted");
  TAP_EQ (count_dir (layers), before, "nothing stored");
  wr_store_set_limits (s, &dflt);
  r = wr_image_import_any (s, "three:1", d, NULL, NULL, NULL, &err);
  TAP_EQ (r, 0, "and accepted under the default limits (%s)", r ? err.msg : "ok");
  struct wr_image *conf = NULL, *here = NULL;
  wr_image_resolve (s, "three:1", &conf, NULL);
  /* the fuzzing mode (no helper) builds the same layers */
  wr_store_set_unpack_in_process (s, true);
  r = wr_image_import_any (s, "three:2", d, NULL, NULL, &here, &err);
  wr_store_set_unpack_in_process (s, false);
  TAP_OK (TAP_C_EQ (r, 0) && conf && here && TAP_C_EQ (conf->n_layers, 3)
              && TAP_C_EQ (here->n_layers, 3) && TAP_C_EQ_STR (conf->layers[2], here->layers[2]),
          "unpacking in process gives the same layers (%s)", r ? err.msg : "ok");
  wr_image_free (conf);
  wr_image_free (here);
  wr_image_remove (s, "three:2", NULL);
  wr_image_remove (s, "three:1", NULL);
}

/* the expansion ratio stops a compression bomb while it is written, and the
 * uncompressed digest (a docker-save diff id) is that of the tar inside */
static void
test_ratio (void)
{
  char tar[400], out[400];
  snprintf (tar, sizeof tar, "%s/zeros.tar.gz", base);
  snprintf (out, sizeof out, "%s/zout", base);
  sh ("set -e; cd %s; rm -rf z; mkdir z; truncate -s 8M z/zeros; tar -C z -cf zeros.tar zeros;"
      " gzip -nk zeros.tar",
      base);
  struct wr_extract_limits lim = { .max_ratio = 100, .ratio_grace = 1 << 20 };
  struct wr_extract_stats xs;
  wr_err_t err;
  sh ("rm -rf %s && mkdir -p %s", out, out);
  _cleanup_close_ int fd = open (tar, O_RDONLY | O_CLOEXEC);
  _cleanup_close_ int dfd = open (out, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int r = wr_tar_extract_ex (fd, dfd, 0, &lim, &xs, &err);
  struct stat st;
  char p[500];
  snprintf (p, sizeof p, "%s/zeros", out);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_TOO_LARGE)
              && TAP_C_HAS_STR (err.msg, "expands more than")
              && (TAP_C_LT (stat (p, &st), 0) || TAP_C_LT (st.st_size, (4 << 20))),
          "8 MiB of zeros from ~8 KiB of gzip stopped early (%s)", r < 0 ? err.msg : "accepted");
  r = extract (tar, out, 0, &xs, &err); /* defaults: under the 64 MiB grace */
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (xs.bytes, 8 << 20),
          "the default limits let 8 MiB through (%s)", r ? err.msg : "ok");
  char want[65] = "", got[65] = "";
  snprintf (p, sizeof p, "%s/zeros.tar", base);
  _cleanup_close_ int pfd = open (p, O_RDONLY | O_CLOEXEC);
  wr_sha256_fd (pfd, want);
  r = wr_tar_sha256 (fd, NULL, got, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (got, want),
          "uncompressed digest of a .tar.gz is the tar's");
}

/* Archives are parsed by the confined helper: it writes as its own host ids
 * (WARREN_UNPACK_UID_BASE + the archive's), never as root, and the digest of
 * what it read is the daemon's. */
static void
test_confined_unpack (void)
{
  char tar[400], out[400], p[500];
  snprintf (tar, sizeof tar, "%s/owned.tar", base);
  snprintf (out, sizeof out, "%s/owned", base);
  sh ("set -e; cd %s; rm -rf o %s; mkdir o %s; echo x > o/f; chown 1000:1001 o/f; chmod 4755 o/f;"
      " tar --numeric-owner -C o -cf owned.tar .",
      base, out, out);
  _cleanup_close_ int fd = open (tar, O_RDONLY | O_CLOEXEC);
  _cleanup_close_ int dfd = open (out, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  struct wr_extract_stats xs;
  wr_err_t err;
  int r = wr_unpack (fd, dfd, -1, 0, NULL, &xs, &err);
  TAP_EQ (r, 0, "unpack in the helper (%s)", r ? err.msg : "ok");
  uint32_t b = wr_unpack_uid_base ();
  struct stat st;
  snprintf (p, sizeof p, "%s/f", out);
  TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_uid, b + 1000)
              && TAP_C_EQ (st.st_gid, b + 1001) && TAP_C_EQ ((st.st_mode & 07777), 04755),
          "files belong to the helper's range on the host (%u:%u, mode %o; base %u)",
          (unsigned)st.st_uid, (unsigned)st.st_gid, (unsigned)(st.st_mode & 07777), b);
  TAP_OK (TAP_C_EQ (fstat (dfd, &st), 0) && TAP_C_EQ (st.st_uid, b),
          "the staging root is the helper's root");
  char want[65] = "";
  wr_sha256_fd (fd, want);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (xs.source, want) && TAP_C_EQ (xs.entries, 2),
          "the digest is of the bytes the daemon fed it");
  /* ids outside the helper's 65536 cannot be written */
  sh ("cd %s && chown 70000 o/f && tar --numeric-owner -C o -cf owned.tar . && rm -rf %s/*", base,
      out);
  r = wr_unpack (fd, dfd, -1, 0, NULL, &xs, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "chown"), "uid 70000 is refused (%s)",
          r < 0 ? err.msg : "accepted");
  /* in its chroot the host's files are gone, and a call outside the
   * allow-list kills it */
  sh ("rm -rf %s/*", out);
  r = wr_unpack (fd, dfd, -1, WR_UNPACK_SELFTEST, NULL, &xs, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_HAS_STR (err.msg, "killed by signal 31")
              && TAP_C_HAS_STR (err.msg, "seccomp"),
          "socket(2) in the helper: killed by its seccomp filter (%s)",
          r < 0 ? err.msg : "allowed");
}

int
main (void)
{
  if (geteuid () != 0)
    {
      TAP_SKIP ("needs root", "oci");
      return TAP_DONE ();
    }
  if (unshare (CLONE_NEWNS) < 0 || mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    {
      TAP_SKIP ("no private mount namespace", "oci");
      return TAP_DONE ();
    }
  if (tap_mkdtemp (base, sizeof base, "wr-oci-test") == NULL)
    return 1;
  snprintf (root, sizeof root, "%s/root", base);
  test_whiteouts ();
  test_ratio ();
  test_confined_unpack ();
  char dbp[400];
  snprintf (dbp, sizeof dbp, "%s/db", base);
  sqlite3 *db = NULL;
  sqlite3_open_v2 (dbp, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                   NULL);
  struct wr_store *s = NULL;
  wr_err_t err;
  int r = wr_store_open (root, db, -1, &s, &err);
  TAP_EQ (r, 0, "open store (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      test_commit (s);
      test_oci_layout (s);
      test_docker_save_cache_poisoning (s);
      test_layer_limit (s);
      wr_store_close (s);
    }
  sqlite3_close (db);
  sh ("rm -rf %s", base);
  return TAP_DONE ();
}

/* Image store: sha256, references, imports (dir, tar, tar.gz, tar.zst),
 * hostile archives, resolve/list/remove/gc, layer mounts (file-backed, loop,
 * idmapped), crash recovery, disk full. Runs as root in a private mount
 * namespace so nothing it mounts is visible outside. */
#include "image/sha256.h"
#include "image/store.h"
#include "image/internal.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "common/util.h"
#include "daemon/guest_upper.h"
#include "tap.h"

static char base[256]; /* scratch dir for everything */
static char root[300]; /* store root */

static int sh (const char *fmt, ...) __attribute__ ((format (printf, 1, 2)));
static int
sh (const char *fmt, ...)
{
  char cmd[8192];
  va_list ap;
  va_start (ap, fmt);
  vsnprintf (cmd, sizeof cmd, fmt, ap);
  va_end (ap);
  int st = system (cmd);
  return WIFEXITED (st) ? WEXITSTATUS (st) : -1;
}

static int
count_entries (const char *path)
{
  DIR *d = opendir (path);
  if (d == NULL)
    return -1;
  int n = 0;
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    if (strcmp (de->d_name, ".") && strcmp (de->d_name, ".."))
      n++;
  closedir (d);
  return n;
}

static int
count_rows (sqlite3 *db, const char *table)
{
  char sql[128];
  snprintf (sql, sizeof sql, "SELECT count(*) FROM %s", table);
  sqlite3_stmt *st;
  if (sqlite3_prepare_v2 (db, sql, -1, &st, NULL) != SQLITE_OK)
    return -1;
  int n = sqlite3_step (st) == SQLITE_ROW ? sqlite3_column_int (st, 0) : -1;
  sqlite3_finalize (st);
  return n;
}

static int
mount_count (const char *dir)
{
  FILE *f = fopen ("/proc/self/mountinfo", "re");
  char line[4096];
  int n = 0;
  size_t len = strlen (dir);
  while (f && fgets (line, sizeof line, f))
    {
      /* field 5 is the mount point */
      char *p = line;
      for (int i = 0; i < 4 && p; i++)
        p = strchr (p, ' ') ? strchr (p, ' ') + 1 : NULL;
      if (p && strncmp (p, dir, len) == 0 && p[len] == ' ')
        n++;
    }
  if (f)
    fclose (f);
  return n;
}

static bool
read_eq (const char *path, const char *want)
{
  char buf[256] = "";
  int fd = open (path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return false;
  ssize_t n = read (fd, buf, sizeof buf - 1);
  close (fd);
  if (n < 0)
    return false;
  buf[n] = '\0';
  return strcmp (buf, want) == 0;
}

/* ---- sha256 and references ---- */

static void
test_sha256 (void)
{
  char hex[65];
  wr_sha256_hex ("", 0, hex);
  TAP_EQ_STR (hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
              "sha256 of empty string");
  wr_sha256_hex ("abc", 3, hex);
  TAP_EQ_STR (hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
              "sha256 of abc");
  const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  wr_sha256_hex (m, strlen (m), hex);
  TAP_EQ_STR (hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
              "sha256 of the 448-bit vector");
  /* one million 'a' fed in odd-sized pieces exercises buffering */
  struct wr_sha256 c;
  uint8_t d[32];
  char chunk[997];
  memset (chunk, 'a', sizeof chunk);
  wr_sha256_init (&c);
  size_t left = 1000000;
  while (left)
    {
      size_t n = left < sizeof chunk ? left : sizeof chunk;
      wr_sha256_update (&c, chunk, n);
      left -= n;
    }
  wr_sha256_final (&c, d);
  wr_sha256_to_hex (d, hex);
  TAP_EQ_STR (hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0",
              "sha256 of a million a");
}

/* The SHA-NI rounds (where the CPU has them) agree with the portable ones
 * on every length around the block and buffering edges. */
static void
test_sha256_accel (void)
{
  if (!wr_sha256_accel (-1))
    {
      TAP_SKIP ("this CPU has no SHA extensions", "SHA-NI and portable rounds agree");
      return;
    }
  size_t size = 3 * 65536 + 77;
  uint8_t *buf = malloc (size);
  for (size_t i = 0; i < size; i++)
    buf[i] = (uint8_t)(i * 2654435761u >> 13);
  static const size_t lens[]
      = { 0, 1, 55, 56, 63, 64, 65, 127, 128, 129, 1000, 65536, 3 * 65536 + 77 };
  bool same = true;
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++)
    for (size_t piece = 1; piece <= 4096; piece *= 64)
      {
        char hex[2][65];
        for (int fast = 0; fast < 2; fast++)
          {
            wr_sha256_accel (fast);
            struct wr_sha256 c;
            uint8_t d[32];
            wr_sha256_init (&c);
            for (size_t off = 0; off < lens[i]; off += piece)
              wr_sha256_update (&c, buf + off, lens[i] - off < piece ? lens[i] - off : piece);
            wr_sha256_final (&c, d);
            wr_sha256_to_hex (d, hex[fast]);
          }
        if (strcmp (hex[0], hex[1]) != 0)
          {
            same = false;
            TAP_DIAG ("length %zu in pieces of %zu: %s vs %s", lens[i], piece, hex[0], hex[1]);
          }
      }
  TAP_OK (same && wr_sha256_accel (-1), "SHA-NI and portable rounds agree");
  free (buf);
}

static void
test_refs (void)
{
  static const char *good[] = {
    "busybox",
    "busybox:latest",
    "a/b-c_d.e:V1.2-x_y",
    "x",
    "org/team/img:t",
    "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "img@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
  };
  static const char *bad[] = {
    "",
    "Busybox",
    "-a",
    "a-",
    "a/",
    "/a",
    "a//b",
    "a:",
    "a:b:c",
    "a:t@x",
    "a b",
    "a;rm",
    "a:"
    "toolongtagxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "sha256:E3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "sha256:abc",
    "img@sha256:e3b0",
    "a:t!",
    "../x",
    "a..b:../x",
  };
  bool ok = true;
  for (size_t i = 0; i < WR_ARRAY_SIZE (good); i++)
    if (!wr_ref_valid (good[i]))
      {
        ok = false;
        TAP_DIAG ("rejected good ref %s", good[i]);
      }
  TAP_OK (ok, "valid references accepted");
  ok = true;
  for (size_t i = 0; i < WR_ARRAY_SIZE (bad); i++)
    if (wr_ref_valid (bad[i]))
      {
        ok = false;
        TAP_DIAG ("accepted bad ref %s", bad[i]);
      }
  TAP_OK (ok, "invalid references rejected");
  char longname[260];
  memset (longname, 'a', 201);
  longname[201] = '\0';
  bool too_long = !wr_ref_valid (longname);
  longname[200] = '\0';
  bool max_ok = wr_ref_valid (longname);
  TAP_OK (too_long && max_ok, "name length limit is 200");
  TAP_OK (!wr_ref_valid (NULL), "NULL reference rejected");
}

/* ---- fixtures ---- */

static char src[400];

static void
make_tree (void)
{
  snprintf (src, sizeof src, "%s/src", base);
  sh ("mkdir -p %s/etc %s/bin %s/home/user %s/empty && echo hello > %s/etc/greeting"
      " && printf 'x%%.0s' $(seq 1 5000) > %s/bin/tool && chmod 4755 %s/bin/tool"
      " && ln -s /etc/greeting %s/abs-link && ln -s ../etc/greeting %s/bin/rel-link"
      " && ln %s/etc/greeting %s/etc/hardlink && echo mine > %s/home/user/file"
      " && chown -R 1000:1000 %s/home/user && touch -d @1000000000 %s/etc/greeting",
      src, src, src, src, src, src, src, src, src, src, src, src, src, src);
  setxattr (src, "user.test", "v", 1, 0);
  char p[512];
  snprintf (p, sizeof p, "%s/bin/tool", src);
  setxattr (p, "user.test", "tool", 4, 0);
}

static sqlite3 *
open_db (void)
{
  char p[400];
  snprintf (p, sizeof p, "%s/state.db", base);
  sqlite3 *db;
  if (sqlite3_open_v2 (p, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                       NULL)
      != SQLITE_OK)
    return NULL;
  sqlite3_exec (db, "PRAGMA journal_mode=WAL", NULL, NULL, NULL);
  sqlite3_busy_timeout (db, 5000);
  return db;
}

/* ---- imports ---- */

static char dir_layer[72], tar_layer[72];

static void
test_import_formats (struct wr_store *s)
{
  wr_err_t err;
  struct wr_image *img = NULL;
  int r = wr_image_import (s, "tree", src, &img, &err);
  TAP_EQ (r, 0, "import from a directory (%s)", r ? err.msg : "ok");
  if (r < 0)
    return;
  TAP_OK (TAP_C_EQ (img->n_layers, 1) && TAP_C_EQ (strncmp (img->layers[0], "sha256:", 7), 0)
              && TAP_C_EQ (strlen (img->layers[0]), 71),
          "one sha256 layer");
  TAP_EQ_STR (img->name, "tree:latest", "tag defaults to latest (%s)", img->name);
  TAP_OK (json_is_string (json_object_get (img->config, "workdir"))
              && json_is_array (json_object_get (img->config, "env")),
          "default config");
  char layer_file[600];
  snprintf (layer_file, sizeof layer_file, "%s/layers/sha256/%s.erofs", root, img->layers[0] + 7);
  int fd = open (layer_file, O_RDONLY | O_CLOEXEC);
  char hex[65] = "";
  if (fd >= 0)
    {
      wr_sha256_fd (fd, hex);
      close (fd);
    }
  TAP_EQ_STR (hex, img->layers[0] + 7, "layer digest is the sha256 of its file");
  snprintf (dir_layer, sizeof dir_layer, "%s", img->layers[0]);
  char mdigest[72];
  snprintf (mdigest, sizeof mdigest, "%s", img->digest);
  wr_image_free (img);

  /* identical content -> identical layer and manifest digests */
  r = wr_image_import (s, "tree:again", src, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->layers[0], dir_layer)
              && TAP_C_EQ_STR (img->digest, mdigest),
          "re-import of the same directory gives the same digests");
  wr_image_free (img);

  /* a tarball of the very same tree extracts to the same layer */
  char p0[400];
  snprintf (p0, sizeof p0, "%s/same.tar", base);
  sh ("tar --xattrs -C %s -cf %s .", src, p0);
  r = wr_image_import (s, "same", p0, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->layers[0], dir_layer),
          "tar of a directory gives the directory's layer digest (%s)", r ? err.msg : "ok");
  if (r == 0)
    wr_image_free (img);
  TAP_EQ (wr_image_remove (s, "same", &err), 0, "remove same");

  /* the format tests use a slightly different tree: their own layer */
  TAP_EQ (sh ("cp -a %s %s/src2 && echo extra > %s/src2/extra"
              " && tar --xattrs -C %s/src2 -cf %s/t.tar . && gzip -c %s/t.tar > %s/t.tgz"
              " && zstd -q -c %s/t.tar > %s/t.tzst && cp %s/t.tar %s/t.weird.gz",
              src, base, base, base, base, base, base, base, base, base, base),
          0, "archives created with tar, gzip, zstd");
  static const char *files[] = { "t.tar", "t.tgz", "t.tzst", "t.weird.gz" };
  char first[72] = "";
  bool same = true;
  for (size_t i = 0; i < WR_ARRAY_SIZE (files); i++)
    {
      char p[400], ref[64];
      snprintf (p, sizeof p, "%s/%s", base, files[i]);
      snprintf (ref, sizeof ref, "fmt:v%zu", i);
      r = wr_image_import (s, ref, p, &img, &err);
      TAP_EQ (r, 0, "import %s (%s)", files[i], r ? err.msg : "ok");
      if (r == 0)
        {
          if (!first[0])
            snprintf (first, sizeof first, "%s", img->layers[0]);
          same = same && strcmp (first, img->layers[0]) == 0;
          TAP_EQ (img->skipped_special, 0, "nothing skipped in %s", files[i]);
          wr_image_free (img);
        }
    }
  TAP_OK (same && first[0] && TAP_C_NE_STR (first, dir_layer),
          "plain, gzip and zstd archives of one tree give one layer digest");
  snprintf (tar_layer, sizeof tar_layer, "%s", first);
  TAP_OK (TAP_C_GE (count_entries (root), 0)
              && TAP_C_EQ (count_entries (strcat (strcpy ((char[400]){ 0 }, root), "/tmp")), 0),
          "no leftovers in ROOT/tmp after imports");
}

static void
test_layer_content (struct wr_store *s)
{
  wr_err_t err;
  const char *dir = NULL, *dir2 = NULL;
  int r = wr_layer_acquire (s, tar_layer, &dir, &err);
  TAP_EQ (r, 0, "acquire the tar layer (%s)", r ? err.msg : "ok");
  if (r < 0)
    return;
  r = wr_layer_acquire (s, tar_layer, &dir2, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (dir, dir2), "second acquire returns the same dir");
  TAP_EQ (mount_count (dir), 1, "layer mounted exactly once (%d)", mount_count (dir));
  char p[600];
  struct stat st, st2;
  snprintf (p, sizeof p, "%s/etc/greeting", dir);
  TAP_OK (read_eq (p, "hello\n"), "file content readable through the mount");
  TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_mtime, 1000000000), "mtime preserved");
  snprintf (p, sizeof p, "%s/etc/hardlink", dir);
  TAP_OK (TAP_C_EQ (stat (p, &st2), 0) && TAP_C_EQ (st2.st_ino, st.st_ino)
              && TAP_C_EQ (st.st_nlink, 2),
          "hard link preserved");
  snprintf (p, sizeof p, "%s/bin/tool", dir);
  TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ ((st.st_mode & 07777), 04755)
              && TAP_C_EQ (st.st_size, 5000),
          "setuid mode and size preserved");
  char xv[16] = "";
  TAP_OK (TAP_C_EQ (getxattr (p, "user.test", xv, sizeof xv), 4) && TAP_C_EQ_MEM (xv, 4, "tool", 4),
          "xattr preserved");
  snprintf (p, sizeof p, "%s/home/user/file", dir);
  TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_uid, 1000) && TAP_C_EQ (st.st_gid, 1000),
          "ownership preserved");
  char target[64] = "";
  snprintf (p, sizeof p, "%s/abs-link", dir);
  TAP_OK (TAP_C_GT (readlink (p, target, sizeof target - 1), 0)
              && TAP_C_EQ_STR (target, "/etc/greeting"),
          "absolute symlink kept as a symlink");
  snprintf (p, sizeof p, "%s/newfile", dir);
  TAP_OK (TAP_C_LT (open (p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600), 0) && TAP_C_EQ (errno, EROFS),
          "layer mount is read-only");
  wr_layer_release (s, tar_layer);
  wr_layer_release (s, tar_layer);
  TAP_OK (
      TAP_C_LT (wr_layer_acquire (
                    s, "sha256:0000000000000000000000000000000000000000000000000000000000000000",
                    &dir, &err),
                0)
          && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
      "acquire of an unknown layer: not_found");
}

static void
test_resolve_list (struct wr_store *s)
{
  wr_err_t err;
  struct wr_image *img = NULL;
  int r = wr_image_resolve (s, "tree", &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->name, "tree:latest"), "resolve name");
  if (r < 0)
    return;
  char digest[72], ref[200];
  snprintf (digest, sizeof digest, "%s", img->digest);
  wr_image_free (img);
  r = wr_image_resolve (s, "tree:again", &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->digest, digest), "resolve name:tag");
  wr_image_free (img);
  snprintf (ref, sizeof ref, "tree@%s", digest);
  r = wr_image_resolve (s, ref, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->digest, digest)
              && TAP_C_EQ (strncmp (img->name, "tree:", 5), 0),
          "resolve name@digest");
  wr_image_free (img);
  r = wr_image_resolve (s, digest, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->digest, digest), "resolve by manifest digest");
  wr_image_free (img);
  snprintf (ref, sizeof ref, "tree:again@%s", digest);
  r = wr_image_resolve (s, ref, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ_STR (img->name, "tree:again"), "resolve name:tag@digest");
  wr_image_free (img);
  snprintf (ref, sizeof ref, "tree:nope@%s", digest);
  r = wr_image_resolve (s, ref, &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "name:tag@digest with another tag");
  snprintf (ref, sizeof ref, "fmt@%s", digest);
  r = wr_image_resolve (s, ref, &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "name@digest of another name: not_found");
  r = wr_image_resolve (s, "nope:1", &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND)
              && TAP_C_EQ_STR (err.msg, "image nope:1 not found: No such file or directory"),
          "unknown image: not_found (%s)", err.msg);
  r = wr_image_resolve (s, "Bad Ref", &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID),
          "invalid reference: invalid_argument");

  json_t *list = NULL;
  r = wr_image_list (s, &list, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (json_array_size (list), 6),
          "list has one entry per tag (%zu)", json_array_size (list));
  json_t *e = json_array_get (list, 0);
  TAP_OK (json_is_string (json_object_get (e, "name"))
              && json_is_string (json_object_get (e, "digest"))
              && json_is_array (json_object_get (e, "layers"))
              && TAP_C_GT (json_integer_value (json_object_get (e, "size")), 0)
              && TAP_C_GT (json_integer_value (json_object_get (e, "created")), 0),
          "list entries carry name, digest, layers, size, created");
  json_decref (list);
}

/* ---- hostile archives ---- */

static const char hostile_py[]
    = "import tarfile, io, sys, os\n"
      "d = sys.argv[1]; sentinel = sys.argv[2]\n"
      "def add(t, name, data=b'x', **kw):\n"
      "    i = tarfile.TarInfo(name)\n"
      "    for k, v in kw.items(): setattr(i, k, v)\n"
      "    if i.type == tarfile.REGTYPE: i.size = len(data); t.addfile(i, io.BytesIO(data))\n"
      "    else: t.addfile(i)\n"
      "def mk(fn, *entries):\n"
      "    with tarfile.open(os.path.join(d, fn), 'w', format=tarfile.GNU_FORMAT) as t:\n"
      "        add(t, 'ok', b'fine')\n"
      "        for e in entries: add(t, *e[:2], **e[2]) if len(e) > 2 else add(t, *e)\n"
      "mk('dotdot.tar', ('../escape', b'pwned'))\n"
      "mk('dotdot2.tar', ('a/../../escape', b'pwned'))\n"
      "mk('abs.tar', (sentinel + '/abs', b'pwned'))\n"
      "mk('symlink-sentinel.tar', ('evil', b'', dict(type=tarfile.SYMTYPE, linkname=sentinel)),"
      "   ('evil/passwd', b'pwned'))\n"
      "mk('symlink-etc.tar', ('evil', b'', dict(type=tarfile.SYMTYPE, linkname='/etc')),"
      "   ('evil/passwd', b'pwned'))\n"
      "mk('symlink-dir.tar', ('evil', b'', dict(type=tarfile.SYMTYPE, linkname='/etc')),"
      "   ('evil/', b'', dict(type=tarfile.DIRTYPE, mode=0o777)))\n"
      "mk('hardlink-abs.tar', ('x', b'', dict(type=tarfile.LNKTYPE, linkname='/etc/shadow')))\n"
      "mk('hardlink-dotdot.tar', ('x', b'', dict(type=tarfile.LNKTYPE, "
      "linkname='../../../etc/shadow')))\n"
      "mk('hardlink-via-symlink.tar', ('evil', b'', dict(type=tarfile.SYMTYPE, linkname='/etc')),"
      "   ('x', b'', dict(type=tarfile.LNKTYPE, linkname='evil/shadow')))\n"
      "mk('hardlink-missing.tar', ('x', b'', dict(type=tarfile.LNKTYPE, linkname='nothere')))\n"
      "mk('device.tar', ('dev/null', b'', dict(type=tarfile.CHRTYPE, devmajor=1, devminor=3)),"
      "   ('dev/sda', b'', dict(type=tarfile.BLKTYPE, devmajor=8, devminor=0)),"
      "   ('fifo', b'', dict(type=tarfile.FIFOTYPE)), ('dev/keep', b'kept'))\n"
      "mk('big.tar', ('big', os.urandom(300000)))\n"
      "b = open(os.path.join(d, 'big.tar'), 'rb').read()\n"
      "open(os.path.join(d, 'truncated.tar'), 'wb').write(b[:150000])\n"
      "open(os.path.join(d, 'garbage.bin'), 'wb').write(os.urandom(20000))\n"
      "open(os.path.join(d, 'empty.bin'), 'wb').close()\n";

static void
test_hostile (struct wr_store *s, sqlite3 *db)
{
  char hdir[400], sentinel[400];
  snprintf (hdir, sizeof hdir, "%s/hostile", base);
  snprintf (sentinel, sizeof sentinel, "%s/sentinel", base);
  mkdir (hdir, 0700);
  mkdir (sentinel, 0700);
  char py[400];
  snprintf (py, sizeof py, "%s/gen.py", base);
  FILE *f = fopen (py, "we");
  fputs (hostile_py, f);
  fclose (f);
  if (sh ("python3 %s %s %s", py, hdir, sentinel) != 0)
    {
      TAP_SKIP ("python3 tarfile unavailable", "hostile archives");
      return;
    }
  sh ("gzip -c %s/truncated.tar > %s/truncated-gz.tgz && head -c 2000 %s/truncated-gz.tgz"
      " > %s/cut.tgz",
      hdir, hdir, hdir, hdir);

  char passwd_before[65], passwd_after[65];
  int pfd = open ("/etc/passwd", O_RDONLY | O_CLOEXEC);
  wr_sha256_fd (pfd, passwd_before);
  close (pfd);

  static const char *rejected[] = {
    "dotdot.tar",
    "dotdot2.tar",
    "abs.tar",
    "symlink-sentinel.tar",
    "hardlink-abs.tar",
    "hardlink-dotdot.tar",
    "hardlink-via-symlink.tar",
    "hardlink-missing.tar",
    "truncated.tar",
    "cut.tgz",
    "garbage.bin",
    "empty.bin",
    /* last, and only because the sentinel variant above held */
    "symlink-etc.tar",
  };
  char tmpdir[400], layersdir[400];
  snprintf (tmpdir, sizeof tmpdir, "%s/tmp", root);
  snprintf (layersdir, sizeof layersdir, "%s/layers/sha256", root);
  int layers0 = count_entries (layersdir), rows0 = count_rows (db, "layers"),
      tags0 = count_rows (db, "tags"), images0 = count_rows (db, "images");
  for (size_t i = 0; i < WR_ARRAY_SIZE (rejected); i++)
    {
      if (strcmp (rejected[i], "symlink-etc.tar") == 0 && count_entries (sentinel) != 0)
        {
          TAP_SKIP ("sentinel variant wrote outside the layer", "symlink to /etc");
          continue;
        }
      char p[600];
      snprintf (p, sizeof p, "%s/%s", hdir, rejected[i]);
      wr_err_t err = { 0 };
      struct wr_image *img = NULL;
      int r = wr_image_import (s, "hostile:x", p, &img, &err);
      TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID), "%s rejected: %s",
              rejected[i], r < 0 ? err.msg : "IMPORTED");
      if (r == 0)
        wr_image_free (img);
      TAP_OK (TAP_C_EQ (count_entries (tmpdir), 0) && TAP_C_EQ (count_entries (layersdir), layers0)
                  && TAP_C_EQ (count_rows (db, "layers"), rows0)
                  && TAP_C_EQ (count_rows (db, "tags"), tags0)
                  && TAP_C_EQ (count_rows (db, "images"), images0),
              "%s: store unchanged", rejected[i]);
    }
  TAP_EQ (count_entries (sentinel), 0, "nothing written through symlinks or absolute paths");
  char esc[400];
  snprintf (esc, sizeof esc, "%s/escape", base);
  TAP_LT_INT (access (esc, F_OK), 0, "no ../escape written");
  pfd = open ("/etc/passwd", O_RDONLY | O_CLOEXEC);
  wr_sha256_fd (pfd, passwd_after);
  close (pfd);
  TAP_EQ_STR (passwd_before, passwd_after, "/etc/passwd untouched");

  /* a directory entry over an earlier symlink replaces the symlink (as tar
   * does); it must never chmod the symlink's target */
  struct stat etc0, etc1;
  stat ("/etc", &etc0);
  char sd[600];
  snprintf (sd, sizeof sd, "%s/symlink-dir.tar", hdir);
  wr_err_t serr;
  int sr = wr_image_import (s, "symdir", sd, NULL, &serr);
  stat ("/etc", &etc1);
  TAP_OK (TAP_C_EQ (sr, 0) && TAP_C_EQ (etc0.st_mode, etc1.st_mode),
          "directory entry replacing a symlink: imported, /etc mode untouched (%s)",
          sr ? serr.msg : "ok");
  wr_image_remove (s, "symdir", NULL);

  /* device nodes and fifos: skipped and counted, the rest imported */
  char p[600];
  snprintf (p, sizeof p, "%s/device.tar", hdir);
  wr_err_t err;
  struct wr_image *img = NULL;
  int r = wr_image_import (s, "devices", p, &img, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (img->skipped_special, 3),
          "device nodes and fifos skipped and counted (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      const char *dir;
      if (wr_layer_acquire (s, img->layers[0], &dir, &err) == 0)
        {
          char q[600];
          struct stat st;
          snprintf (q, sizeof q, "%s/dev/null", dir);
          bool no_dev = lstat (q, &st) < 0;
          snprintf (q, sizeof q, "%s/dev/keep", dir);
          TAP_OK (no_dev && read_eq (q, "kept"), "device absent, regular file present");
          wr_layer_release (s, img->layers[0]);
        }
      else
        TAP_OK (false, "acquire device layer: %s", err.msg);
      wr_image_free (img);
    }
  r = wr_image_remove (s, "devices", &err);
  TAP_EQ (r, 0, "remove devices image");

  /* not a file or directory */
  r = wr_image_import (s, "x", "/dev/null", &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID),
          "character device source rejected");
  r = wr_image_import (s, "x", "/nonexistent/path", &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND), "missing source: not_found");
  r = wr_image_import (s,
                       "x@sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                       src, &img, &err);
  TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_INVALID),
          "import to a digest ref rejected");
}

/* ---- remove, gc ---- */

static bool
layer_file_exists (const char *digest)
{
  char p[600];
  snprintf (p, sizeof p, "%s/layers/sha256/%s.erofs", root, digest + 7);
  return access (p, F_OK) == 0;
}

static void
test_remove_gc (struct wr_store *s, sqlite3 *db)
{
  wr_err_t err;
  /* the four fmt:* tags share one manifest */
  TAP_EQ (wr_image_remove (s, "fmt:v0", &err), 0, "remove one tag");
  struct wr_image *img = NULL;
  TAP_OK (TAP_C_EQ (wr_image_resolve (s, "fmt:v1", &img, &err), 0) && layer_file_exists (tar_layer),
          "other tags and the layer stay");
  wr_image_free (img);
  TAP_OK (TAP_C_LT (wr_image_remove (s, "fmt:v0", &err), 0)
              && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "removing a missing tag: not_found");

  /* a layer in use survives the removal of its last image */
  const char *acq = NULL;
  char dir[600] = "/nonexistent"; /* acq is only valid until the release */
  TAP_EQ (wr_layer_acquire (s, tar_layer, &acq, &err), 0, "acquire before removal");
  if (acq)
    snprintf (dir, sizeof dir, "%s", acq);
  TAP_OK (TAP_C_EQ (wr_image_remove (s, "fmt:v1", &err), 0)
              && TAP_C_EQ (wr_image_remove (s, "fmt:v2", &err), 0)
              && TAP_C_LT (wr_image_remove (s, "fmt", &err), 0),
          "remove more tags");
  char digest[72];
  TAP_EQ (wr_image_resolve (s, "fmt:v3", &img, &err), 0, "last tag resolves");
  snprintf (digest, sizeof digest, "%s", img->digest);
  wr_image_free (img);
  TAP_EQ (wr_image_remove (s, digest, &err), 0, "remove by manifest digest");
  TAP_LT_INT (wr_image_resolve (s, "fmt:v3", &img, &err), 0, "its tags are gone");
  TAP_OK (layer_file_exists (tar_layer) && TAP_C_EQ (mount_count (dir), 1),
          "acquired layer kept and still mounted");
  wr_layer_release (s, tar_layer);
  TAP_OK (!layer_file_exists (tar_layer), "last release collects a removed image's layer");
  TAP_EQ (mount_count (dir), 0, "and unmounts it");
  TAP_EQ (wr_store_gc (s, &err), 0, "gc");
  TAP_OK (layer_file_exists (dir_layer), "layers still referenced kept");

  /* moving a tag to new content collects the old manifest and layer */
  int images0 = count_rows (db, "images");
  char p[400];
  snprintf (p, sizeof p, "%s/t.tar", base);
  TAP_EQ (wr_image_import (s, "tree:again", p, NULL, &err), 0, "retag tree:again to the tar");
  TAP_EQ (count_rows (db, "images"), images0 + 1, "new manifest stored (%d)",
          count_rows (db, "images"));
  TAP_OK (TAP_C_EQ (wr_image_remove (s, "tree:again", &err), 0)
              && TAP_C_EQ (count_rows (db, "images"), images0) && !layer_file_exists (tar_layer),
          "removing it drops its manifest and layer");
}

/* ---- mounts: loop fallback, idmap ---- */

static int
make_userns (void)
{
  int pipefd[2];
  if (pipe2 (pipefd, O_CLOEXEC) < 0)
    return -1;
  pid_t pid = fork ();
  if (pid == 0)
    {
      if (unshare (CLONE_NEWUSER) < 0)
        _exit (1);
      close (pipefd[1]);
      char c;
      read (pipefd[0], &c, 1); /* wait until the parent is done */
      _exit (0);
    }
  close (pipefd[0]);
  char p[64];
  usleep (50000);
  snprintf (p, sizeof p, "/proc/%d/uid_map", pid);
  int ok = wr_write_file_at (AT_FDCWD, p, "0 100000 65536\n") == 0;
  snprintf (p, sizeof p, "/proc/%d/setgroups", pid);
  wr_write_file_at (AT_FDCWD, p, "deny");
  snprintf (p, sizeof p, "/proc/%d/gid_map", pid);
  ok = ok && wr_write_file_at (AT_FDCWD, p, "0 100000 65536\n") == 0;
  snprintf (p, sizeof p, "/proc/%d/ns/user", pid);
  int fd = ok ? open (p, O_RDONLY | O_CLOEXEC) : -1;
  close (pipefd[1]);
  waitpid (pid, NULL, 0);
  return fd;
}

static void
test_mount_variants (struct wr_store *s, sqlite3 *db)
{
  wr_err_t err;
  struct wr_store *s2 = NULL;
  wr_store_close (s); /* a store per root; reopened by the caller */
  int userns = make_userns ();
  if (userns < 0)
    {
      TAP_SKIP ("cannot create a user namespace", "idmapped layers");
      return;
    }
  int r = wr_store_open (root, db, userns, &s2, &err);
  close (userns);
  TAP_EQ (r, 0, "open store with a userns (%s)", r ? err.msg : "ok");
  if (r < 0)
    return;
  const char *dir;
  r = wr_layer_acquire (s2, dir_layer, &dir, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_HAS_STR (dir, "/mnt/idmap/"), "idmapped acquire (%s)",
          r ? err.msg : dir);
  if (r == 0)
    {
      char p[600];
      struct stat st;
      snprintf (p, sizeof p, "%s/etc/greeting", dir);
      TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_uid, 100000) && read_eq (p, "hello\n"),
              "root-owned file appears as host uid 100000 (%u)", (unsigned)st.st_uid);
      snprintf (p, sizeof p, "%s/home/user/file", dir);
      TAP_OK (TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ (st.st_uid, 101000)
                  && TAP_C_EQ (st.st_gid, 101000),
              "uid 1000 appears as 101000");
      wr_layer_release (s2, dir_layer);
    }
  json_t *desc = NULL;
  TAP_OK (TAP_C_EQ (wr_store_describe (s2, &desc, &err), 0)
              && json_is_true (json_object_get (desc, "idmapped"))
              && TAP_C_EQ (json_integer_value (json_object_get (desc, "mounted")), 1),
          "describe reports the mount");
  json_decref (desc);
  char mdir[400];
  snprintf (mdir, sizeof mdir, "%s/mnt/idmap/%s", root, dir_layer + 7);
  wr_store_close (s2);
  TAP_EQ (mount_count (mdir), 0, "close unmounts everything");

  /* loop device fallback */
  r = wr_store_open (root, db, -1, &s2, &err);
  if (r < 0)
    {
      TAP_OK (false, "reopen: %s", err.msg);
      return;
    }
  wr_store_set_force_loop (s2, 1);
  r = wr_layer_acquire (s2, dir_layer, &dir, &err);
  if (r < 0 && (err.errnum == ENOENT || err.errnum == ENXIO || err.errnum == EACCES))
    TAP_SKIP (err.msg, "loop device fallback");
  else
    {
      char p[600];
      snprintf (p, sizeof p, "%s/etc/greeting", dir);
      TAP_OK (TAP_C_EQ (r, 0) && read_eq (p, "hello\n"), "loop device fallback mount (%s)",
              r ? err.msg : "ok");
      if (r == 0)
        wr_layer_release (s2, dir_layer);
    }
  wr_store_close (s2);
}

/* ---- crash recovery ---- */

static void
test_recovery (sqlite3 *db)
{
  wr_err_t err;
  char p[600];
  snprintf (p, sizeof p, "%s/tmp/import-dead/rootfs/x", root);
  sh ("mkdir -p $(dirname %s) && echo junk > %s", p, p);
  snprintf (p, sizeof p, "%s/layers/sha256/%064d.erofs", root, 7);
  sh ("echo orphan > %s && echo junk > %s/layers/sha256/notalayer", p, root);
  int layers_rows = count_rows (db, "layers");

  /* an image whose layer file vanished */
  struct wr_store *s = NULL;
  TAP_EQ (wr_store_open (root, db, -1, &s, &err), 0, "open");
  char q[400];
  snprintf (q, sizeof q, "%s/hostile/big.tar", base);
  struct wr_image *img = NULL;
  int r = wr_image_import (s, "doomed", q, &img, &err);
  TAP_EQ (r, 0, "import doomed");
  char lf[600];
  snprintf (lf, sizeof lf, "%s/layers/sha256/%s.erofs", root, r == 0 ? img->layers[0] + 7 : "x");
  wr_image_free (img);
  wr_store_close (s);
  unlink (lf);
  sh ("mkdir -p %s/tmp/import-dead2", root);

  r = wr_store_open (root, db, -1, &s, &err);
  TAP_EQ (r, 0, "reopen after simulated crash (%s)", r ? err.msg : "ok");
  if (r < 0)
    return;
  char tmp[400];
  snprintf (tmp, sizeof tmp, "%s/tmp", root);
  TAP_EQ (count_entries (tmp), 0, "ROOT/tmp emptied");
  TAP_LT_INT (access (p, F_OK), 0, "orphan layer file removed");
  TAP_OK (TAP_C_LT (wr_image_resolve (s, "doomed", &img, &err), 0)
              && TAP_C_EQ_STR (err.code, WR_E_NOT_FOUND),
          "image with a missing layer dropped");
  TAP_EQ (count_rows (db, "layers"), layers_rows, "missing layer's row dropped");
  json_t *d = NULL;
  wr_store_describe (s, &d, &err);
  json_t *rec = json_object_get (d, "recovered");
  TAP_OK (TAP_C_EQ (json_integer_value (json_object_get (rec, "tmp_entries")), 1)
              && TAP_C_EQ (json_integer_value (json_object_get (rec, "orphan_layers")), 0)
              && TAP_C_EQ (json_integer_value (json_object_get (rec, "missing_layers")), 1)
              && TAP_C_EQ (json_integer_value (json_object_get (rec, "dropped_images")), 1),
          "recovery counted");
  json_decref (d);
  TAP_EQ (wr_image_resolve (s, "tree", &img, &err), 0, "healthy images survive recovery");
  wr_image_free (img);
  wr_store_close (s);

  /* kill -9 in the middle of an import */
  pid_t pid = fork ();
  if (pid == 0)
    {
      sqlite3 *cdb = open_db ();
      struct wr_store *cs;
      if (wr_store_open (root, cdb, -1, &cs, NULL) < 0)
        _exit (1);
      for (int i = 0; i < 100; i++)
        wr_image_import (cs, "killed", q, NULL, NULL);
      _exit (0);
    }
  usleep (150000);
  kill (pid, SIGKILL);
  waitpid (pid, NULL, 0);
  r = wr_store_open (root, db, -1, &s, &err);
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (count_entries (tmp), 0),
          "store consistent after kill -9 mid-import");
  if (r == 0)
    {
      /* every row has its file, every file its row */
      char ld[400];
      snprintf (ld, sizeof ld, "%s/layers/sha256", root);
      TAP_EQ (count_entries (ld), count_rows (db, "layers"), "layer files match rows (%d/%d)",
              count_entries (ld), count_rows (db, "layers"));
      wr_image_remove (s, "killed", NULL);
      wr_store_close (s);
    }
}

/* ---- concurrency ---- */

struct imp
{
  struct wr_store *s;
  const char *path;
  int r;
};

static void *
import_thread (void *arg)
{
  struct imp *im = arg;
  wr_err_t err;
  for (int i = 0; i < 3 && im->r == 0; i++)
    im->r = wr_image_import (im->s, "threaded", im->path, NULL, &err);
  return NULL;
}

static void
test_threads (sqlite3 *db)
{
  wr_err_t err;
  struct wr_store *s;
  if (wr_store_open (root, db, -1, &s, &err) < 0)
    {
      TAP_OK (false, "open: %s", err.msg);
      return;
    }
  char p[400];
  snprintf (p, sizeof p, "%s/t.tgz", base);
  struct imp im = { s, p, 0 };
  pthread_t t;
  pthread_create (&t, NULL, import_thread, &im);
  int lookups = 0, bad = 0;
  void *res;
  while (pthread_tryjoin_np (t, &res) == EBUSY)
    {
      struct wr_image *img;
      if (wr_image_resolve (s, "tree", &img, &err) < 0)
        bad++;
      else
        wr_image_free (img);
      json_t *l;
      if (wr_image_list (s, &l, &err) < 0)
        bad++;
      else
        json_decref (l);
      lookups++;
      usleep (1000);
    }
  TAP_OK (TAP_C_EQ (im.r, 0) && TAP_C_EQ (bad, 0) && TAP_C_GT (lookups, 0),
          "imports in a thread while the main thread reads (%d lookups)", lookups);
  wr_image_remove (s, "threaded", NULL);
  wr_store_close (s);
}

/* ---- disk full ---- */

static void
test_disk_full (void)
{
  char small[400];
  snprintf (small, sizeof small, "%s/small", base);
  mkdir (small, 0700);
  if (mount ("tmpfs", small, "tmpfs", 0, "size=1m") < 0)
    {
      TAP_SKIP ("cannot mount tmpfs", "disk full");
      return;
    }
  sqlite3 *db;
  sqlite3_open (":memory:", &db);
  struct wr_store *s;
  wr_err_t err;
  char sroot[500];
  snprintf (sroot, sizeof sroot, "%s/root", small);
  int r = wr_store_open (sroot, db, -1, &s, &err);
  TAP_EQ (r, 0, "store on a 1 MiB tmpfs (in-memory db)");
  if (r == 0)
    {
      char big[500];
      snprintf (big, sizeof big, "%s/bigsrc", base);
      sh ("mkdir -p %s && head -c 3000000 /dev/urandom > %s/blob && tar -C %s -cf %s/big2.tar .",
          big, big, big, base);
      snprintf (big, sizeof big, "%s/big2.tar", base);
      r = wr_image_import (s, "big", big, NULL, &err);
      TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_EXHAUSTED)
                  && TAP_C_EQ (err.errnum, ENOSPC),
              "disk full: resource_exhausted (%s)", r < 0 ? err.msg : "imported?");
      char t[600];
      snprintf (t, sizeof t, "%s/tmp", sroot);
      TAP_EQ (count_entries (t), 0, "nothing left after disk full");
      /* a small import still works afterwards */
      r = wr_image_import (s, "small", src, NULL, &err);
      TAP_EQ (r, 0, "store usable after disk full (%s)", r ? err.msg : "ok");
      wr_store_close (s);
    }
  sqlite3_close (db);
  umount2 (small, MNT_DETACH);
}

static void
test_busybox (void)
{
  char bb[400];
  snprintf (bb, sizeof bb, "%s/busybox", base);
  if (access ("scripts/mk-busybox-rootfs.sh", X_OK) < 0 || access ("/bin/busybox", X_OK) < 0)
    {
      TAP_SKIP ("scripts/mk-busybox-rootfs.sh or busybox-static missing", "busybox image");
      return;
    }
  TAP_EQ (sh ("scripts/mk-busybox-rootfs.sh %s", bb), 0, "build the busybox rootfs");
  sqlite3 *db = open_db ();
  struct wr_store *s;
  wr_err_t err;
  if (wr_store_open (root, db, -1, &s, &err) < 0)
    {
      TAP_OK (false, "open: %s", err.msg);
      return;
    }
  struct wr_image *img = NULL;
  int r = wr_image_import (s, "busybox:latest", bb, &img, &err);
  TAP_EQ (r, 0, "import busybox:latest (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      const char *dir;
      if (wr_layer_acquire (s, img->layers[0], &dir, &err) == 0)
        {
          char p[600], t[64] = "";
          struct stat st;
          snprintf (p, sizeof p, "%s/bin/sh", dir);
          bool link_ok = readlink (p, t, sizeof t - 1) > 0 && strcmp (t, "/bin/busybox") == 0;
          snprintf (p, sizeof p, "%s/tmp", dir);
          TAP_OK (link_ok && TAP_C_EQ (stat (p, &st), 0) && TAP_C_EQ ((st.st_mode & 07777), 01777),
                  "busybox layer has /bin/sh and a 1777 /tmp");
          wr_layer_release (s, img->layers[0]);
        }
      else
        TAP_OK (false, "acquire busybox: %s", err.msg);
      wr_image_free (img);
    }
  wr_store_close (s);
  sqlite3_close (db);
}

/* ---- limits (issue 9): found while writing, nothing left behind ---- */

static void
test_limits (struct wr_store *s, sqlite3 *db)
{
  struct wr_store_limits dflt, l;
  wr_store_get_limits (s, &dflt);
  TAP_OK (TAP_C_EQ (dflt.layer_bytes, 8ull << 30) && TAP_C_EQ (dflt.image_bytes, 32ull << 30)
              && TAP_C_EQ (dflt.entries, 1000000) && TAP_C_EQ (dflt.ratio, 100)
              && !dflt.private_redirects,
          "default limits: 8 GiB a layer, 32 GiB an image, 1e6 entries, ratio 100");
  char d[400], tmp[400], layers[400];
  snprintf (d, sizeof d, "%s/lim", base);
  snprintf (tmp, sizeof tmp, "%s/tmp", root);
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  TAP_EQ (sh ("set -e; d=%s; rm -rf $d; mkdir -p $d/big $d/ok $d/many $d/sp;"
              " head -c 2097152 /dev/urandom > $d/big/f; head -c 524288 /dev/urandom > $d/ok/f;"
              " for i in $(seq 100); do : > $d/many/$i; done; truncate -s 1G $d/sp/f;"
              " for t in big ok many; do tar -C $d/$t -cf $d/$t.tar .; done;"
              " tar -S -C $d/sp -cf $d/sp.tar .",
              d),
          0, "made the limit tarballs");
  int nlayers = count_entries (layers), rows = count_rows (db, "layers");
  l = dflt;
  l.layer_bytes = 1 << 20;
  l.entries = 50;
  wr_store_set_limits (s, &l);
  static const struct
  {
    const char *tar, *msg;
  } cases[] = {
    { "big", "more than 1048576 bytes" },
    { "sp", "more than 1048576 bytes" }, /* a 1 GiB hole is 1 GiB for mkfs.erofs */
    { "many", "more than 50 entries" },
  };
  for (size_t i = 0; i < WR_ARRAY_SIZE (cases); i++)
    {
      char p[500];
      snprintf (p, sizeof p, "%s/%s.tar", d, cases[i].tar);
      wr_err_t err;
      int r = wr_image_import (s, "lim:1", p, NULL, &err);
      TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, WR_E_TOO_LARGE)
                  && TAP_C_HAS_STR (err.msg, cases[i].msg),
              "%s.tar refused (%s)", cases[i].tar, r < 0 ? err.msg : "accepted");
    }
  TAP_OK (TAP_C_EQ (count_entries (tmp), 0) && TAP_C_EQ (count_entries (layers), nlayers)
              && TAP_C_EQ (count_rows (db, "layers"), rows),
          "nothing left in ROOT/tmp or ROOT/layers");
  char p[500];
  snprintf (p, sizeof p, "%s/ok.tar", d);
  wr_err_t err;
  int r = wr_image_import (s, "lim:1", p, NULL, &err);
  TAP_EQ (r, 0, "a layer under the limits is fine (%s)", r ? err.msg : "ok");
  wr_store_set_limits (s, &dflt);
  snprintf (p, sizeof p, "%s/many.tar", d);
  r = wr_image_import (s, "lim:2", p, NULL, &err);
  TAP_EQ (r, 0, "limits can be raised again (%s)", r ? err.msg : "ok");
  wr_image_remove (s, "lim:1", NULL);
  wr_image_remove (s, "lim:2", NULL);
}

/* A VM guest's exported layer (src/daemon/guest_upper.c) is hostile input:
 * the archives test_hostile and test_limits refuse are refused through the
 * daemon's guest path too, with nothing left behind, and a well-formed
 * stream with OCI whiteouts becomes one layer over the base. */
static void
test_guest_layer (struct wr_store *s, sqlite3 *db)
{
  char tar[600], tmp[400], layers[400];
  snprintf (tmp, sizeof tmp, "%s/tmp", root);
  snprintf (layers, sizeof layers, "%s/layers/sha256", root);
  struct wr_image *baseimg = NULL;
  wr_err_t err;
  snprintf (tar, sizeof tar, "%s/lim/ok.tar", base);
  if (wr_image_import (s, "guest-base:1", tar, &baseimg, &err) < 0)
    {
      TAP_OK (0, "guest layer: base image (%s)", err.msg);
      return;
    }
  int nlayers = count_entries (layers), rows = count_rows (db, "layers");
  static const struct
  {
    const char *file, *code;
  } bad[] = {
    { "hostile/dotdot.tar", WR_E_INVALID },
    { "hostile/abs.tar", WR_E_INVALID },
    { "hostile/symlink-sentinel.tar", WR_E_INVALID },
    { "hostile/hardlink-dotdot.tar", WR_E_INVALID },
    { "hostile/garbage.bin", WR_E_INVALID },
    { "lim/big.tar", WR_E_TOO_LARGE },
    { "lim/many.tar", WR_E_TOO_LARGE },
  };
  struct wr_store_limits dflt, l;
  wr_store_get_limits (s, &dflt);
  l = dflt;
  l.layer_bytes = 1 << 20;
  l.entries = 50;
  wr_store_set_limits (s, &l);
  for (size_t i = 0; i < WR_ARRAY_SIZE (bad); i++)
    {
      snprintf (tar, sizeof tar, "%s/%s", base, bad[i].file);
      int fd = open (tar, O_RDONLY | O_CLOEXEC);
      struct wr_image *img = NULL;
      int r = wrd_guest_layer_commit (s, fd, "warren-checkpoint/g:x", baseimg->layers,
                                      baseimg->n_layers, NULL, &img, &err);
      close (fd);
      TAP_OK (TAP_C_LT (r, 0) && TAP_C_EQ_STR (err.code, bad[i].code),
              "guest layer: %s refused (%s)", bad[i].file, r < 0 ? err.msg : "COMMITTED");
      wr_image_free (img);
    }
  wr_store_set_limits (s, &dflt);
  struct wr_image *none = NULL;
  TAP_OK (TAP_C_EQ (count_entries (tmp), 0) && TAP_C_EQ (count_entries (layers), nlayers)
              && TAP_C_EQ (count_rows (db, "layers"), rows)
              && TAP_C_LT (wr_image_resolve (s, "warren-checkpoint/g:x", &none, &err), 0),
          "guest layer: nothing left behind by the refusals");
  char d[400];
  snprintf (d, sizeof d, "%s/guest", base);
  TAP_EQ (sh ("set -e; d=%s; rm -rf $d; mkdir -p $d/t/sub; echo hi > $d/t/new;"
              " : > $d/t/.wh.f; : > $d/t/sub/.wh..wh..opq; tar -C $d/t -cf $d/g.tar .",
              d),
          0, "guest layer: made a stream with whiteouts");
  snprintf (tar, sizeof tar, "%s/g.tar", d);
  int fd = open (tar, O_RDONLY | O_CLOEXEC);
  struct wr_image *img = NULL;
  int r = wrd_guest_layer_commit (s, fd, "warren-checkpoint/g:ok", baseimg->layers,
                                  baseimg->n_layers, NULL, &img, &err);
  close (fd);
  bool wh = false, opq = false;
  if (r == 0)
    {
      const char *dir;
      if (wr_layer_acquire (s, img->layers[img->n_layers - 1], &dir, &err) == 0)
        {
          char p[4200], v[4];
          struct stat st;
          snprintf (p, sizeof p, "%s/f", dir);
          wh = lstat (p, &st) == 0 && S_ISCHR (st.st_mode) && st.st_rdev == 0;
          snprintf (p, sizeof p, "%s/sub", dir);
          opq = getxattr (p, "user.overlay.opaque", v, sizeof v) == 1 && v[0] == 'y';
          wr_layer_release (s, img->layers[img->n_layers - 1]);
        }
    }
  TAP_OK (TAP_C_EQ (r, 0) && TAP_C_EQ (img ? img->n_layers : 0, baseimg->n_layers + 1) && wh && opq,
          "guest layer: committed over the base, whiteout and opaque dir kept (%s)",
          r ? err.msg : "ok");
  wr_image_free (img);
  wr_image_free (baseimg);
  wr_image_remove (s, "warren-checkpoint/g:ok", NULL);
  wr_image_remove (s, "guest-base:1", NULL);
}

int
main (void)
{
  if (geteuid () != 0)
    {
      TAP_SKIP ("needs root", "image store");
      return TAP_DONE ();
    }
  /* private mount namespace: our mounts vanish with us */
  if (unshare (CLONE_NEWNS) < 0 || mount (NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
    {
      TAP_SKIP ("no private mount namespace", "image store");
      return TAP_DONE ();
    }
  if (tap_mkdtemp (base, sizeof base, "wr-store-test") == NULL)
    return 1;
  snprintf (root, sizeof root, "%s/root", base);

  test_sha256 ();
  test_sha256_accel ();
  test_refs ();
  make_tree ();

  sqlite3 *db = open_db ();
  struct wr_store *s = NULL;
  wr_err_t err;
  int r = wr_store_open (root, db, -1, &s, &err);
  TAP_EQ (r, 0, "open store (%s)", r ? err.msg : "ok");
  if (r == 0)
    {
      test_import_formats (s);
      test_layer_content (s);
      test_resolve_list (s);
      test_hostile (s, db);
      test_limits (s, db);
      test_guest_layer (s, db);
      test_remove_gc (s, db);
      test_mount_variants (s, db); /* closes s */
      test_recovery (db);
      test_threads (db);
    }
  test_disk_full ();
  test_busybox ();
  sqlite3_close (db);
  sh ("rm -rf %s", base);
  return TAP_DONE ();
}

/* Image store: content-addressed EROFS layers, manifests and tags in SQLite,
 * refcounted layer mounts (docs/images.md). */
#include "store.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>

#include "../backend/container.h"
#include "../common/util.h"
#include "internal.h"
#include "sha256.h"

#define DIGEST_PREFIX "sha256:"

struct layer_mount
{
  char hex[65];
  unsigned refs;
  bool base_mounted; /* ROOT/mnt/layers/<hex> */
  bool idmapped;     /* ROOT/mnt/idmap/<hex> */
  bool gc_pending;   /* gc wanted it while in use: collect at the last release */
  char *dir;         /* what acquire hands out */
  struct layer_mount *next;
};

struct wr_store
{
  char *root;
  sqlite3 *db; /* the store's own connection when the database is a file */
  bool own_db;
  int userns_fd;
  int force_loop;
  bool unpack_in_process;
  struct wr_store_limits limits;
  pthread_mutex_t lock; /* db, mounts, and the layers directory */
  struct layer_mount *mounts;
  struct
  {
    unsigned tmp_entries, orphan_layers, missing_layers, dropped_images;
  } recovered;
};

/* ---- small helpers ---- */

static void
stmt_finalizep (sqlite3_stmt **st)
{
  if (*st)
    sqlite3_finalize (*st);
}
#define _cleanup_stmt_ _cleanup_ (stmt_finalizep)

/* json_decrefp comes with jansson */
#define _cleanup_json_ _cleanup_ (json_decrefp)

static void
unlockp (pthread_mutex_t **m)
{
  if (*m)
    pthread_mutex_unlock (*m);
}
#define LOCK_GUARD(s)                                                                              \
  pthread_mutex_lock (&(s)->lock);                                                                 \
  _cleanup_ (unlockp) pthread_mutex_t *_guard WR_UNUSED = &(s)->lock

static int
db_error (sqlite3 *db, wr_err_t *err, const char *what)
{
  return wr_error (err, 0, WR_E_INTERNAL, "sqlite %s: %s", what, sqlite3_errmsg (db));
}

static int
db_exec (sqlite3 *db, const char *sql, wr_err_t *err)
{
  char *msg = NULL;
  if (sqlite3_exec (db, sql, NULL, NULL, &msg) != SQLITE_OK)
    {
      int r = wr_error (err, 0, WR_E_INTERNAL, "sqlite: %s: %s", sql, msg ? msg : "error");
      sqlite3_free (msg);
      return r;
    }
  return 0;
}

static int
db_prepare (sqlite3 *db, const char *sql, sqlite3_stmt **st, wr_err_t *err)
{
  if (sqlite3_prepare_v2 (db, sql, -1, st, NULL) != SQLITE_OK)
    return db_error (db, err, sql);
  return 0;
}

static void
rollback (sqlite3 *db)
{
  if (!sqlite3_get_autocommit (db))
    sqlite3_exec (db, "ROLLBACK", NULL, NULL, NULL);
}

static bool
is_hex64 (const char *s)
{
  for (int i = 0; i < 64; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return false;
  return s[64] == '\0';
}

/* "sha256:<64 lowercase hex>" -> pointer to the hex part, or NULL */
static const char *
digest_hex (const char *d)
{
  if (d == NULL || strncmp (d, DIGEST_PREFIX, 7) != 0 || !is_hex64 (d + 7))
    return NULL;
  return d + 7;
}

/* ---- references ---- */

struct ref
{
  char name[201];
  char tag[129];
  char digest[72]; /* "" or "sha256:<hex>" */
  bool has_tag;
};

static bool
name_valid (const char *n, size_t len)
{
  if (len == 0 || len > 200)
    return false;
  for (size_t i = 0; i < len; i++)
    {
      char c = n[i];
      bool alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
      bool sep = c == '.' || c == '_' || c == '-' || c == '/';
      if (!alnum && !sep)
        return false;
      if (sep && (i == 0 || i == len - 1))
        return false;
      if (c == '/' && n[i - 1] == '/')
        return false;
    }
  return true;
}

static bool
tag_valid (const char *t, size_t len)
{
  if (len == 0 || len > 128)
    return false;
  for (size_t i = 0; i < len; i++)
    {
      char c = t[i];
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'
            || c == '.' || c == '-'))
        return false;
    }
  return true;
}

static int
ref_parse (const char *s, struct ref *r)
{
  memset (r, 0, sizeof *r);
  if (s == NULL || strlen (s) > 512)
    return -EINVAL;
  if (strncmp (s, DIGEST_PREFIX, 7) == 0)
    {
      if (!digest_hex (s))
        return -EINVAL;
      memcpy (r->digest, s, 7 + 64 + 1);
      return 0;
    }
  const char *at = strchr (s, '@');
  size_t namelen = at ? (size_t)(at - s) : strlen (s);
  if (at)
    {
      if (!digest_hex (at + 1))
        return -EINVAL;
      memcpy (r->digest, at + 1, 7 + 64 + 1);
    }
  /* names never contain ':', so the first one starts the tag */
  const char *colon = memchr (s, ':', namelen);
  size_t nlen = colon ? (size_t)(colon - s) : namelen;
  if (!name_valid (s, nlen))
    return -EINVAL;
  memcpy (r->name, s, nlen);
  if (colon)
    {
      size_t tlen = namelen - nlen - 1;
      if (!tag_valid (colon + 1, tlen))
        return -EINVAL;
      memcpy (r->tag, colon + 1, tlen);
      r->has_tag = true;
    }
  else
    strcpy (r->tag, "latest");
  return 0;
}

int
wr_ref_valid (const char *ref)
{
  struct ref r;
  return ref_parse (ref, &r) == 0;
}

/* ---- open, schema, recovery ---- */

/* buf = ROOT/sub[/name][suffix] */
static int
store_path (const struct wr_store *s, char *buf, size_t size, const char *sub, const char *name,
            const char *suffix)
{
  int n = snprintf (buf, size, "%s/%s%s%s%s", s->root, sub, name ? "/" : "", name ? name : "",
                    suffix ? suffix : "");
  return n < 0 || (size_t)n >= size ? -ENAMETOOLONG : 0;
}

static const char schema_sql[]
    = "BEGIN;"
      "CREATE TABLE IF NOT EXISTS layers (digest TEXT PRIMARY KEY, size INTEGER NOT NULL,"
      " created_at INTEGER NOT NULL);"
      "CREATE TABLE IF NOT EXISTS images (digest TEXT PRIMARY KEY, manifest TEXT NOT NULL,"
      " created_at INTEGER NOT NULL);"
      "CREATE TABLE IF NOT EXISTS tags (name TEXT NOT NULL, tag TEXT NOT NULL,"
      " digest TEXT NOT NULL, PRIMARY KEY (name, tag));"
      /* blob_layers replaced blobs, whose docker-save rows were keyed on
       * claimed (unverified) diff ids: a cache, so it simply starts over */
      "DROP TABLE IF EXISTS blobs;"
      "CREATE TABLE IF NOT EXISTS blob_layers (blob TEXT PRIMARY KEY, layer TEXT NOT NULL);"
      "CREATE INDEX IF NOT EXISTS tags_digest ON tags (digest);"
      "COMMIT;";

/* Parse a manifest's layer list into hex digests. */
static int
manifest_layers (const char *text, json_t **ret_json, wr_err_t *err)
{
  json_error_t jerr;
  json_t *m = json_loads (text, 0, &jerr);
  if (m == NULL)
    return wr_error (err, 0, WR_E_INTERNAL, "corrupt manifest: %s", jerr.text);
  json_t *layers = json_object_get (m, "layers");
  size_t i;
  json_t *l;
  if (!json_is_array (layers) || json_integer_value (json_object_get (m, "schema")) != 1)
    {
      json_decref (m);
      return wr_error (err, 0, WR_E_INTERNAL, "corrupt manifest: no layers");
    }
  json_array_foreach (layers, i, l)
  {
    if (!digest_hex (json_string_value (l)))
      {
        json_decref (m);
        return wr_error (err, 0, WR_E_INTERNAL, "corrupt manifest: bad layer digest");
      }
  }
  *ret_json = m;
  return 0;
}

static int
layer_row_exists (struct wr_store *s, const char *digest, bool *ret, wr_err_t *err)
{
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (db_prepare (s->db, "SELECT 1 FROM layers WHERE digest = ?", &st, err) < 0)
    return -EIO;
  sqlite3_bind_text (st, 1, digest, -1, SQLITE_STATIC);
  int rc = sqlite3_step (st);
  if (rc != SQLITE_ROW && rc != SQLITE_DONE)
    return db_error (s->db, err, "select layer");
  *ret = rc == SQLITE_ROW;
  return 0;
}

/* Bring the database and the layers directory back in step after a crash:
 * temp files go, layer files without a row go, rows without a file go, and
 * so do images that reference a missing layer. */
static int
recover (struct wr_store *s, wr_err_t *err)
{
  char path[4096];
  _cleanup_close_ int tfd = -1;
  if (store_path (s, path, sizeof path, "tmp", NULL, NULL) < 0
      || (tfd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
    return wr_sys_error (err, "open %s", path);
  {
    _cleanup_closedir_ DIR *d = fdopendir (fcntl (tfd, F_DUPFD_CLOEXEC, 3));
    if (d == NULL)
      return wr_sys_error (err, "opendir %s", path);
    struct dirent *de;
    while ((de = readdir (d)) != NULL)
      {
        if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
          continue;
        int r = wr_rm_rf_at (tfd, de->d_name);
        if (r < 0)
          return wr_error (err, -r, WR_E_INTERNAL, "remove leftover %s/%s", path, de->d_name);
        s->recovered.tmp_entries++;
      }
  }

  if (store_path (s, path, sizeof path, "layers/sha256", NULL, NULL) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "root path too long");
  _cleanup_close_ int lfd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (lfd < 0)
    return wr_sys_error (err, "open %s", path);
  {
    _cleanup_closedir_ DIR *d = fdopendir (fcntl (lfd, F_DUPFD_CLOEXEC, 3));
    if (d == NULL)
      return wr_sys_error (err, "opendir %s", path);
    struct dirent *de;
    while ((de = readdir (d)) != NULL)
      {
        if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
          continue;
        char digest[80] = "";
        size_t len = strlen (de->d_name);
        bool keep = false;
        if (len == 70 && strcmp (de->d_name + 64, ".erofs") == 0)
          {
            snprintf (digest, sizeof digest, DIGEST_PREFIX "%.64s", de->d_name);
            if (digest_hex (digest) && layer_row_exists (s, digest, &keep, err) < 0)
              return -EIO;
          }
        if (!keep)
          {
            if (unlinkat (lfd, de->d_name, 0) < 0 && errno != ENOENT)
              return wr_sys_error (err, "remove orphan layer %s", de->d_name);
            s->recovered.orphan_layers++;
          }
      }
  }

  /* rows whose file is gone, then the images that needed them */
  if (db_exec (s->db, "BEGIN IMMEDIATE", err) < 0)
    return -EIO;
  {
    _cleanup_stmt_ sqlite3_stmt *st = NULL;
    _cleanup_stmt_ sqlite3_stmt *del = NULL;
    if (db_prepare (s->db, "SELECT digest FROM layers", &st, err) < 0
        || db_prepare (s->db, "DELETE FROM layers WHERE digest = ?", &del, err) < 0)
      goto fail;
    int rc;
    while ((rc = sqlite3_step (st)) == SQLITE_ROW)
      {
        const char *d = (const char *)sqlite3_column_text (st, 0);
        const char *hex = digest_hex (d);
        char name[80];
        if (hex)
          snprintf (name, sizeof name, "%s.erofs", hex);
        if (hex == NULL || faccessat (lfd, name, F_OK, AT_SYMLINK_NOFOLLOW) < 0)
          {
            sqlite3_bind_text (del, 1, d, -1, SQLITE_TRANSIENT);
            if (sqlite3_step (del) != SQLITE_DONE)
              {
                db_error (s->db, err, "delete layer");
                goto fail;
              }
            sqlite3_reset (del);
            s->recovered.missing_layers++;
          }
      }
    if (rc != SQLITE_DONE)
      {
        db_error (s->db, err, "scan layers");
        goto fail;
      }
  }
  {
    _cleanup_stmt_ sqlite3_stmt *st = NULL;
    if (db_prepare (s->db, "SELECT digest, manifest FROM images", &st, err) < 0)
      goto fail;
    int rc;
    while ((rc = sqlite3_step (st)) == SQLITE_ROW)
      {
        const char *d = (const char *)sqlite3_column_text (st, 0);
        const char *text = (const char *)sqlite3_column_text (st, 1);
        _cleanup_json_ json_t *m = NULL;
        bool ok = text && manifest_layers (text, &m, NULL) == 0;
        size_t i;
        json_t *l;
        if (ok)
          json_array_foreach (json_object_get (m, "layers"), i, l)
          {
            bool exists = false;
            if (layer_row_exists (s, json_string_value (l), &exists, err) < 0)
              goto fail;
            ok = ok && exists;
          }
        if (!ok)
          {
            _cleanup_stmt_ sqlite3_stmt *d1 = NULL;
            _cleanup_stmt_ sqlite3_stmt *d2 = NULL;
            if (db_prepare (s->db, "DELETE FROM images WHERE digest = ?", &d1, err) < 0
                || db_prepare (s->db, "DELETE FROM tags WHERE digest = ?", &d2, err) < 0)
              goto fail;
            sqlite3_bind_text (d1, 1, d, -1, SQLITE_TRANSIENT);
            sqlite3_bind_text (d2, 1, d, -1, SQLITE_TRANSIENT);
            if (sqlite3_step (d1) != SQLITE_DONE || sqlite3_step (d2) != SQLITE_DONE)
              {
                db_error (s->db, err, "drop broken image");
                goto fail;
              }
            s->recovered.dropped_images++;
          }
      }
    if (rc != SQLITE_DONE)
      {
        db_error (s->db, err, "scan images");
        goto fail;
      }
  }
  /* mappings are never replaced: drop the ones whose layer went */
  if (db_exec (s->db, "DELETE FROM blob_layers WHERE layer NOT IN (SELECT digest FROM layers)", err)
      < 0)
    goto fail;
  return db_exec (s->db, "COMMIT", err);
fail:
  rollback (s->db);
  return -EIO;
}

/* Mount points left by an earlier instance in this mount namespace. */
static void
clear_mount_dirs (struct wr_store *s, const char *sub)
{
  char path[4096];
  if (store_path (s, path, sizeof path, sub, NULL, NULL) < 0)
    return;
  _cleanup_closedir_ DIR *d = opendir (path);
  if (d == NULL)
    return;
  struct dirent *de;
  while ((de = readdir (d)) != NULL)
    {
      if (de->d_name[0] == '.')
        continue;
      char p[4096 + 300];
      snprintf (p, sizeof p, "%s/%s", path, de->d_name);
      while (umount2 (p, MNT_DETACH | UMOUNT_NOFOLLOW) == 0)
        ;
      rmdir (p);
    }
}

void
wr_store_close (struct wr_store *s)
{
  if (s == NULL)
    return;
  for (struct layer_mount *m = s->mounts, *next; m; m = next)
    {
      next = m->next;
      char p[4096];
      /* detach: sandboxes' overlays may still hold the mount */
      if (m->idmapped && store_path (s, p, sizeof p, "mnt/idmap", m->hex, NULL) == 0)
        {
          umount2 (p, MNT_DETACH);
          rmdir (p);
        }
      if (m->base_mounted && store_path (s, p, sizeof p, "mnt/layers", m->hex, NULL) == 0)
        {
          umount2 (p, MNT_DETACH);
          rmdir (p);
        }
      free (m->dir);
      free (m);
    }
  if (s->own_db)
    sqlite3_close_v2 (s->db);
  if (s->userns_fd >= 0)
    close (s->userns_fd);
  pthread_mutex_destroy (&s->lock);
  free (s->root);
  free (s);
}

static void
store_closep (struct wr_store **s)
{
  wr_store_close (*s);
}

static uint64_t
env_u64 (const char *name, uint64_t dflt)
{
  const char *v = getenv (name);
  char *end;
  if (v == NULL || v[0] < '0' || v[0] > '9')
    return dflt;
  unsigned long long n = strtoull (v, &end, 10);
  return *end == '\0' ? n : dflt;
}

static void
limits_from_env (struct wr_store_limits *l)
{
  l->layer_bytes = env_u64 ("WARREN_IMAGE_LAYER_BYTES", wr_extract_defaults.max_bytes);
  l->image_bytes = env_u64 ("WARREN_IMAGE_BYTES", 4 * wr_extract_defaults.max_bytes);
  l->entries = env_u64 ("WARREN_IMAGE_ENTRIES", wr_extract_defaults.max_entries);
  uint64_t ratio = env_u64 ("WARREN_IMAGE_RATIO", wr_extract_defaults.max_ratio);
  l->ratio = ratio > UINT32_MAX ? UINT32_MAX : (uint32_t)ratio;
  l->private_redirects = env_u64 ("WARREN_REGISTRY_PRIVATE_REDIRECTS", 0) == 1;
}

int
wr_store_open (const char *root, sqlite3 *db, int userns_fd, struct wr_store **ret, wr_err_t *err)
{
  if (root == NULL || root[0] != '/' || strlen (root) > 3000)
    return wr_error (err, EINVAL, WR_E_INVALID, "store root must be an absolute path");
  if (db == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "store needs a database handle");
  _cleanup_ (store_closep) struct wr_store *s = calloc (1, sizeof *s);
  if (s == NULL || (s->root = strdup (root)) == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  s->userns_fd = -1;
  limits_from_env (&s->limits);
  pthread_mutex_init (&s->lock, NULL);
  if (userns_fd >= 0 && (s->userns_fd = fcntl (userns_fd, F_DUPFD_CLOEXEC, 3)) < 0)
    return wr_sys_error (err, "dup userns fd");

  static const char *const dirs[]
      = { "", "/tmp", "/layers", "/layers/sha256", "/mnt", "/mnt/layers", "/mnt/idmap" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (dirs); i++)
    {
      char p[4096];
      snprintf (p, sizeof p, "%s%s", root, dirs[i]);
      int r = wr_mkdir_p (p, 0700);
      if (r < 0)
        return wr_error (err, -r, WR_E_INTERNAL, "create %s", p);
    }

  /* A worker thread commits imports while the event loop reads: give the
   * store its own connection so its transactions never interleave with the
   * daemon's statements on the shared handle. In-memory databases cannot be
   * reopened: share the handle then (the daemon must not hold a
   * transaction open across store calls). */
  const char *fname = sqlite3_db_filename (db, "main");
  if (fname && fname[0])
    {
      if (sqlite3_open_v2 (fname, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_FULLMUTEX, NULL)
          != SQLITE_OK)
        {
          int r = db_error (s->db, err, "open");
          sqlite3_close_v2 (s->db);
          s->db = NULL;
          return r;
        }
      s->own_db = true;
      sqlite3_busy_timeout (s->db, 10000);
    }
  else
    s->db = db;
  if (db_exec (s->db, schema_sql, err) < 0)
    {
      rollback (s->db);
      return -EIO;
    }
  clear_mount_dirs (s, "mnt/idmap");
  clear_mount_dirs (s, "mnt/layers");
  int r = recover (s, err);
  if (r < 0)
    return r;
  *ret = TAKE_PTR (s);
  return 0;
}

void
wr_store_get_limits (struct wr_store *s, struct wr_store_limits *ret)
{
  LOCK_GUARD (s);
  *ret = s->limits;
}

void
wr_store_set_limits (struct wr_store *s, const struct wr_store_limits *l)
{
  LOCK_GUARD (s);
  s->limits = *l;
}

void
wr_store_extract_limits (struct wr_store *s, bool image, struct wr_extract_limits *ret)
{
  LOCK_GUARD (s);
  *ret = (struct wr_extract_limits){
    .max_bytes = image ? s->limits.image_bytes : s->limits.layer_bytes,
    .max_entries = s->limits.entries,
    .max_ratio = s->limits.ratio,
    .ratio_grace = wr_extract_defaults.ratio_grace,
    .in_process = s->unpack_in_process,
  };
}

void
wr_store_set_unpack_in_process (struct wr_store *s, bool on)
{
  LOCK_GUARD (s);
  s->unpack_in_process = on;
}

void
wr_store_set_force_loop (struct wr_store *s, int on)
{
  s->force_loop = on;
}

int
wr_store_describe (struct wr_store *s, json_t **ret, wr_err_t *err)
{
  LOCK_GUARD (s);
  json_int_t counts[3] = { 0 };
  static const char *const q[] = { "SELECT count(*) FROM layers", "SELECT count(*) FROM images",
                                   "SELECT count(*) FROM tags" };
  for (int i = 0; i < 3; i++)
    {
      _cleanup_stmt_ sqlite3_stmt *st = NULL;
      if (db_prepare (s->db, q[i], &st, err) < 0)
        return -EIO;
      if (sqlite3_step (st) == SQLITE_ROW)
        counts[i] = sqlite3_column_int64 (st, 0);
    }
  json_int_t mounted = 0, acquired = 0;
  for (struct layer_mount *m = s->mounts; m; m = m->next)
    {
      mounted += m->base_mounted;
      acquired += m->refs > 0;
    }
  *ret = json_pack ("{s:s,s:I,s:I,s:I,s:I,s:I,s:b,s:{s:i,s:i,s:i,s:i}}", "root", s->root, "layers",
                    counts[0], "images", counts[1], "tags", counts[2], "mounted", mounted,
                    "acquired", acquired, "idmapped", s->userns_fd >= 0, "recovered", "tmp_entries",
                    (int)s->recovered.tmp_entries, "orphan_layers", (int)s->recovered.orphan_layers,
                    "missing_layers", (int)s->recovered.missing_layers, "dropped_images",
                    (int)s->recovered.dropped_images);
  return *ret ? 0 : wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
}

/* ---- images ---- */

void
wr_image_free (struct wr_image *img)
{
  if (img == NULL)
    return;
  free (img->layers);
  if (img->config)
    json_decref (img->config);
  free (img);
}

static void
image_freep (struct wr_image **img)
{
  wr_image_free (*img);
}

static json_t *
default_config (void)
{
  return json_pack ("{s:[s],s:s,s:s,s:n,s:{}}", "env", "PATH=" WR_DEFAULT_PATH, "workdir", "/",
                    "user", "0", "entrypoint", "labels");
}

/* Merge caller config over the defaults, checking every field's type. */
static int
build_config (const json_t *in, json_t **ret, wr_err_t *err)
{
  _cleanup_json_ json_t *c = default_config ();
  if (c == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  if (in == NULL || json_is_null (in))
    {
      *ret = TAKE_PTR (c);
      return 0;
    }
  if (!json_is_object (in))
    return wr_error (err, 0, WR_E_INVALID, "image config must be an object");
  const char *k;
  json_t *v;
  json_object_foreach ((json_t *)in, k, v)
  {
    bool ok;
    if (strcmp (k, "env") == 0 || strcmp (k, "entrypoint") == 0)
      {
        ok = json_is_array (v) || (strcmp (k, "entrypoint") == 0 && json_is_null (v));
        size_t i;
        json_t *e;
        if (json_is_array (v))
          json_array_foreach (v, i, e)
          {
            const char *sv = json_string_value (e);
            ok = ok && sv && (strcmp (k, "entrypoint") == 0 || strchr (sv, '=') > sv);
          }
      }
    else if (strcmp (k, "workdir") == 0)
      ok = json_is_string (v) && json_string_value (v)[0] == '/';
    else if (strcmp (k, "user") == 0)
      ok = json_is_string (v) && json_string_length (v) > 0;
    else if (strcmp (k, "labels") == 0)
      {
        ok = json_is_object (v);
        const char *lk;
        json_t *lv;
        if (ok)
          json_object_foreach (v, lk, lv) ok = ok && json_is_string (lv);
      }
    else
      return wr_error (err, 0, WR_E_INVALID, "unknown image config field \"%s\"", k);
    if (!ok)
      return wr_error (err, 0, WR_E_INVALID, "invalid image config field \"%s\"", k);
    json_object_set (c, k, v);
  }
  *ret = TAKE_PTR (c);
  return 0;
}

static int
layer_size (struct wr_store *s, const char *digest, json_int_t *ret)
{
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (sqlite3_prepare_v2 (s->db, "SELECT size FROM layers WHERE digest = ?", -1, &st, NULL)
      != SQLITE_OK)
    return -EIO;
  sqlite3_bind_text (st, 1, digest, -1, SQLITE_STATIC);
  *ret = sqlite3_step (st) == SQLITE_ROW ? sqlite3_column_int64 (st, 0) : 0;
  return 0;
}

static int
image_from_manifest (struct wr_store *s, const char *digest, const char *name, const char *text,
                     struct wr_image **ret, wr_err_t *err)
{
  _cleanup_json_ json_t *m = NULL;
  int r = manifest_layers (text, &m, err);
  if (r < 0)
    return r;
  _cleanup_ (image_freep) struct wr_image *img = calloc (1, sizeof *img);
  if (img == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  json_t *layers = json_object_get (m, "layers");
  img->n_layers = json_array_size (layers);
  img->layers = calloc (img->n_layers ? img->n_layers : 1, sizeof *img->layers);
  if (img->layers == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  for (size_t i = 0; i < img->n_layers; i++)
    {
      const char *l = json_string_value (json_array_get (layers, i));
      snprintf (img->layers[i], sizeof img->layers[i], "%s", l);
      json_int_t sz;
      if (layer_size (s, l, &sz) == 0)
        img->size += (uint64_t)sz;
    }
  json_t *config = json_object_get (m, "config");
  img->config = json_incref (json_is_object (config) ? config : json_object ());
  snprintf (img->digest, sizeof img->digest, "%s", digest);
  snprintf (img->name, sizeof img->name, "%s", name);
  *ret = TAKE_PTR (img);
  return 0;
}

static int
not_found (wr_err_t *err, const char *ref)
{
  return wr_error (err, ENOENT, WR_E_NOT_FOUND, "image %s not found", ref);
}

static int
resolve_locked (struct wr_store *s, const char *refstr, struct wr_image **ret, wr_err_t *err)
{
  struct ref ref;
  if (ref_parse (refstr, &ref) < 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid image reference '%.300s'",
                     refstr ? refstr : "(null)");
  char digest[72], name[sizeof ((struct wr_image *)0)->name];
  if (ref.name[0] && !ref.digest[0])
    {
      _cleanup_stmt_ sqlite3_stmt *st = NULL;
      if (db_prepare (s->db, "SELECT digest FROM tags WHERE name = ? AND tag = ?", &st, err) < 0)
        return -EIO;
      sqlite3_bind_text (st, 1, ref.name, -1, SQLITE_STATIC);
      sqlite3_bind_text (st, 2, ref.tag, -1, SQLITE_STATIC);
      if (sqlite3_step (st) != SQLITE_ROW)
        return not_found (err, refstr);
      snprintf (digest, sizeof digest, "%s", (const char *)sqlite3_column_text (st, 0));
      snprintf (name, sizeof name, "%s:%s", ref.name, ref.tag);
    }
  else
    {
      /* by digest: report the first tag naming it (within ref.name if given) */
      snprintf (digest, sizeof digest, "%s", ref.digest);
      _cleanup_stmt_ sqlite3_stmt *st = NULL;
      if (db_prepare (s->db,
                      "SELECT name, tag FROM tags WHERE digest = ?1 AND (?2 IS NULL OR name = ?2)"
                      " AND (?3 IS NULL OR tag = ?3) ORDER BY name, tag LIMIT 1",
                      &st, err)
          < 0)
        return -EIO;
      sqlite3_bind_text (st, 1, digest, -1, SQLITE_STATIC);
      if (ref.name[0])
        sqlite3_bind_text (st, 2, ref.name, -1, SQLITE_STATIC);
      if (ref.has_tag)
        sqlite3_bind_text (st, 3, ref.tag, -1, SQLITE_STATIC);
      if (sqlite3_step (st) == SQLITE_ROW)
        snprintf (name, sizeof name, "%s:%s", (const char *)sqlite3_column_text (st, 0),
                  (const char *)sqlite3_column_text (st, 1));
      else if (ref.name[0])
        return not_found (err, refstr);
      else
        snprintf (name, sizeof name, "%s", digest);
    }
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (db_prepare (s->db, "SELECT manifest FROM images WHERE digest = ?", &st, err) < 0)
    return -EIO;
  sqlite3_bind_text (st, 1, digest, -1, SQLITE_STATIC);
  if (sqlite3_step (st) != SQLITE_ROW)
    return not_found (err, refstr);
  return image_from_manifest (s, digest, name, (const char *)sqlite3_column_text (st, 0), ret, err);
}

int
wr_image_resolve (struct wr_store *s, const char *ref, struct wr_image **ret, wr_err_t *err)
{
  LOCK_GUARD (s);
  return resolve_locked (s, ref, ret, err);
}

int
wr_image_list (struct wr_store *s, json_t **ret, wr_err_t *err)
{
  LOCK_GUARD (s);
  _cleanup_json_ json_t *arr = json_array ();
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (arr == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  if (db_prepare (s->db,
                  "SELECT t.name, t.tag, t.digest, i.manifest, i.created_at FROM tags t"
                  " JOIN images i ON i.digest = t.digest ORDER BY t.name, t.tag",
                  &st, err)
      < 0)
    return -EIO;
  int rc;
  while ((rc = sqlite3_step (st)) == SQLITE_ROW)
    {
      char name[512];
      snprintf (name, sizeof name, "%s:%s", (const char *)sqlite3_column_text (st, 0),
                (const char *)sqlite3_column_text (st, 1));
      _cleanup_ (image_freep) struct wr_image *img = NULL;
      if (image_from_manifest (s, (const char *)sqlite3_column_text (st, 2), name,
                               (const char *)sqlite3_column_text (st, 3), &img, err)
          < 0)
        return -EIO;
      json_t *layers = json_array ();
      for (size_t i = 0; i < img->n_layers; i++)
        json_array_append_new (layers, json_string (img->layers[i]));
      json_array_append_new (arr, json_pack ("{s:s,s:s,s:o,s:I,s:I}", "name", name, "digest",
                                             img->digest, "layers", layers, "size",
                                             (json_int_t)img->size, "created",
                                             (json_int_t)sqlite3_column_int64 (st, 4)));
    }
  if (rc != SQLITE_DONE)
    return db_error (s->db, err, "list images");
  *ret = TAKE_PTR (arr);
  return 0;
}

/* ---- layer mounts ---- */

static struct layer_mount *
mount_find (struct wr_store *s, const char *hex)
{
  for (struct layer_mount *m = s->mounts; m; m = m->next)
    if (strcmp (m->hex, hex) == 0)
      return m;
  return NULL;
}

static int
mount_undo (struct wr_store *s, struct layer_mount *m, wr_err_t *err)
{
  char p[4096];
  if (m->idmapped)
    {
      store_path (s, p, sizeof p, "mnt/idmap", m->hex, NULL);
      if (umount2 (p, MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
        return wr_sys_error (err, "unmount %s", p);
      rmdir (p);
      m->idmapped = false;
    }
  if (m->base_mounted)
    {
      store_path (s, p, sizeof p, "mnt/layers", m->hex, NULL);
      if (umount2 (p, MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
        return wr_sys_error (err, "unmount %s", p);
      rmdir (p);
      m->base_mounted = false;
    }
  return 0;
}

static void
mount_unlink (struct wr_store *s, struct layer_mount *m)
{
  for (struct layer_mount **pp = &s->mounts; *pp; pp = &(*pp)->next)
    if (*pp == m)
      {
        *pp = m->next;
        break;
      }
  free (m->dir);
  free (m);
}

int
wr_layer_file (struct wr_store *s, const char *digest, char *buf, size_t size, wr_err_t *err)
{
  const char *hex = digest_hex (digest);
  if (hex == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid layer digest '%.100s'",
                     digest ? digest : "(null)");
  if (store_path (s, buf, size, "layers/sha256", hex, ".erofs") < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "store root path too long");
  return 0;
}

int
wr_layer_acquire (struct wr_store *s, const char *digest, const char **ret_dir, wr_err_t *err)
{
  const char *hex = digest_hex (digest);
  if (hex == NULL)
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid layer digest '%.100s'",
                     digest ? digest : "(null)");
  LOCK_GUARD (s);
  struct layer_mount *m = mount_find (s, hex);
  if (m && m->dir)
    {
      m->refs++;
      *ret_dir = m->dir;
      return 0;
    }
  bool exists;
  if (layer_row_exists (s, digest, &exists, err) < 0)
    return -EIO;
  if (!exists)
    return wr_error (err, ENOENT, WR_E_NOT_FOUND, "layer %s not found", digest);
  if (m == NULL)
    {
      m = calloc (1, sizeof *m);
      if (m == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      memcpy (m->hex, hex, 65);
      m->next = s->mounts;
      s->mounts = m;
    }
  char file[4096], base[4096], idm[4096];
  if (store_path (s, file, sizeof file, "layers/sha256", hex, ".erofs") < 0
      || store_path (s, base, sizeof base, "mnt/layers", hex, NULL) < 0
      || store_path (s, idm, sizeof idm, "mnt/idmap", hex, NULL) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INTERNAL, "store root too long");
  int r = 0;
  if (!m->base_mounted)
    {
      if (mkdir (base, 0700) < 0 && errno != EEXIST)
        r = wr_sys_error (err, "mkdir %s", base);
      else if ((r = wr_erofs_mount (file, base, s->force_loop, err)) == 0)
        m->base_mounted = true;
    }
  if (r == 0 && s->userns_fd >= 0 && !m->idmapped)
    {
      if (mkdir (idm, 0700) < 0 && errno != EEXIST)
        r = wr_sys_error (err, "mkdir %s", idm);
      else if ((r = wr_idmap_mount (s->userns_fd, base, idm, err)) == 0)
        m->idmapped = true;
    }
  if (r == 0 && (m->dir = strdup (s->userns_fd >= 0 ? idm : base)) == NULL)
    r = wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  if (r < 0)
    {
      mount_undo (s, m, NULL);
      mount_unlink (s, m);
      return r;
    }
  m->refs = 1;
  *ret_dir = m->dir;
  return 0;
}

static int gc_locked (struct wr_store *s, wr_err_t *err);

void
wr_layer_release (struct wr_store *s, const char *digest)
{
  const char *hex = digest_hex (digest);
  if (hex == NULL)
    return;
  LOCK_GUARD (s);
  struct layer_mount *m = mount_find (s, hex);
  /* stays mounted at 0 as a cache: the next sandbox skips the mount; gc and
   * close unmount unused layers. A layer whose image was removed while in
   * use goes now. */
  if (m && m->refs > 0 && --m->refs == 0 && m->gc_pending)
    gc_locked (s, NULL);
}

/* ---- gc ---- */

struct hexset
{
  char (*v)[65];
  size_t n, cap;
};

static bool
hexset_has (const struct hexset *h, const char *hex)
{
  for (size_t i = 0; i < h->n; i++)
    if (strcmp (h->v[i], hex) == 0)
      return true;
  return false;
}

static int
hexset_add (struct hexset *h, const char *hex)
{
  if (hexset_has (h, hex))
    return 0;
  if (h->n == h->cap)
    {
      size_t cap = h->cap ? h->cap * 2 : 16;
      void *nv = realloc (h->v, cap * sizeof *h->v);
      if (nv == NULL)
        return -ENOMEM;
      h->v = nv;
      h->cap = cap;
    }
  memcpy (h->v[h->n++], hex, 65);
  return 0;
}

static void
hexset_free (struct hexset *h)
{
  free (h->v);
}

/* Drop manifests no tag names, then layers no manifest uses and nobody has
 * acquired. Rows go first (one transaction), files after: a crash in
 * between leaves orphan files, which the next open removes. */
static int
gc_locked (struct wr_store *s, wr_err_t *err)
{
  __attribute__ ((cleanup (hexset_free))) struct hexset used = { 0 };
  __attribute__ ((cleanup (hexset_free))) struct hexset doomed = { 0 };
  if (db_exec (s->db, "BEGIN IMMEDIATE", err) < 0)
    return -EIO;
  if (db_exec (s->db, "DELETE FROM images WHERE digest NOT IN (SELECT digest FROM tags)", err) < 0)
    goto fail;

  {
    _cleanup_stmt_ sqlite3_stmt *st = NULL;
    if (db_prepare (s->db, "SELECT manifest FROM images", &st, err) < 0)
      goto fail;
    while (sqlite3_step (st) == SQLITE_ROW)
      {
        _cleanup_json_ json_t *m = NULL;
        if (manifest_layers ((const char *)sqlite3_column_text (st, 0), &m, err) < 0)
          goto fail;
        size_t i;
        json_t *l;
        json_array_foreach (json_object_get (m, "layers"), i, l)
        {
          if (hexset_add (&used, digest_hex (json_string_value (l))) < 0)
            {
              wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
              goto fail;
            }
        }
      }
  }
  {
    _cleanup_stmt_ sqlite3_stmt *st = NULL;
    _cleanup_stmt_ sqlite3_stmt *del = NULL;
    if (db_prepare (s->db, "SELECT digest FROM layers", &st, err) < 0
        || db_prepare (s->db, "DELETE FROM layers WHERE digest = ?", &del, err) < 0)
      goto fail;
    while (sqlite3_step (st) == SQLITE_ROW)
      {
        const char *d = (const char *)sqlite3_column_text (st, 0);
        const char *hex = digest_hex (d);
        if (hex == NULL || hexset_has (&used, hex))
          continue;
        struct layer_mount *m = mount_find (s, hex);
        if (m && m->refs > 0)
          {
            m->gc_pending = true; /* in use by a sandbox: never removed now */
            continue;
          }
        if (hexset_add (&doomed, hex) < 0)
          {
            wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
            goto fail;
          }
      }
    for (size_t i = 0; i < doomed.n; i++)
      {
        struct layer_mount *m = mount_find (s, doomed.v[i]);
        if (m)
          {
            if (mount_undo (s, m, err) < 0)
              goto fail;
            mount_unlink (s, m);
          }
        char d[80];
        snprintf (d, sizeof d, DIGEST_PREFIX "%s", doomed.v[i]);
        sqlite3_bind_text (del, 1, d, -1, SQLITE_TRANSIENT);
        if (sqlite3_step (del) != SQLITE_DONE)
          {
            db_error (s->db, err, "delete layer");
            goto fail;
          }
        sqlite3_reset (del);
      }
  }
  if (db_exec (s->db, "DELETE FROM blob_layers WHERE layer NOT IN (SELECT digest FROM layers)", err)
          < 0
      || db_exec (s->db, "COMMIT", err) < 0)
    goto fail;
  for (size_t i = 0; i < doomed.n; i++)
    {
      char p[4096];
      store_path (s, p, sizeof p, "layers/sha256", doomed.v[i], ".erofs");
      if (unlink (p) < 0 && errno != ENOENT)
        return wr_sys_error (err, "remove layer %s", p);
    }
  return 0;
fail:
  rollback (s->db);
  return -EIO;
}

int
wr_store_gc (struct wr_store *s, wr_err_t *err)
{
  LOCK_GUARD (s);
  return gc_locked (s, err);
}

int
wr_image_remove (struct wr_store *s, const char *refstr, wr_err_t *err)
{
  struct ref ref;
  if (ref_parse (refstr, &ref) < 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid image reference '%.300s'",
                     refstr ? refstr : "(null)");
  LOCK_GUARD (s);
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  const char *sql;
  if (!ref.digest[0])
    sql = "DELETE FROM tags WHERE name = ?1 AND tag = ?2";
  else if (!ref.name[0])
    sql = "DELETE FROM tags WHERE digest = ?3";
  else
    sql = "DELETE FROM tags WHERE name = ?1 AND digest = ?3 AND (?4 = 0 OR tag = ?2)";
  if (db_exec (s->db, "BEGIN IMMEDIATE", err) < 0)
    return -EIO;
  if (db_prepare (s->db, sql, &st, err) < 0)
    {
      rollback (s->db);
      return -EIO;
    }
  sqlite3_bind_text (st, 1, ref.name, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, ref.tag, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 3, ref.digest, -1, SQLITE_STATIC);
  sqlite3_bind_int (st, 4, ref.has_tag);
  if (sqlite3_step (st) != SQLITE_DONE)
    {
      int r = db_error (s->db, err, "remove tag");
      rollback (s->db);
      return r;
    }
  int changed = sqlite3_changes (s->db);
  if (ref.digest[0] && !ref.name[0])
    {
      /* by digest: the manifest goes even when no tag named it */
      _cleanup_stmt_ sqlite3_stmt *d = NULL;
      if (db_prepare (s->db, "DELETE FROM images WHERE digest = ?", &d, err) < 0)
        {
          rollback (s->db);
          return -EIO;
        }
      sqlite3_bind_text (d, 1, ref.digest, -1, SQLITE_STATIC);
      if (sqlite3_step (d) != SQLITE_DONE)
        {
          int r = db_error (s->db, err, "remove image");
          rollback (s->db);
          return r;
        }
      changed += sqlite3_changes (s->db);
    }
  if (changed == 0)
    {
      rollback (s->db);
      return not_found (err, refstr);
    }
  if (db_exec (s->db, "COMMIT", err) < 0)
    {
      rollback (s->db);
      return -EIO;
    }
  return gc_locked (s, err);
}

/* ---- import ---- */

/* A private work directory under ROOT/tmp, removed on every exit path. */
struct work
{
  char dir[4096];
  bool made;
};

static void
work_cleanup (struct work *w)
{
  if (w->made)
    {
      char *slash = strrchr (w->dir, '/');
      *slash = '\0';
      _cleanup_close_ int pfd = open (w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      *slash = '/';
      if (pfd >= 0)
        wr_rm_rf_at (pfd, slash + 1);
    }
}

static int
fsync_dir (const char *path)
{
  _cleanup_close_ int fd = open (path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || fsync (fd) < 0)
    return -errno;
  return 0;
}

static void
err_exhausted (wr_err_t *err)
{
  if (err && (err->errnum == ENOSPC || err->errnum == EDQUOT))
    err->code = WR_E_EXHAUSTED;
}

/* The slow part: touches no shared state, runs without the lock. src is
 * the open source (a directory, or a tarball read from its start). */
static int
build_layer (struct wr_store *s, int src, const char *path, unsigned flags, struct work *w,
             char hex[65], uint64_t *size, struct wr_extract_stats *xs, wr_err_t *err)
{
  memset (xs, 0, sizeof *xs);
  struct stat st;
  if (fstat (src, &st) < 0)
    return wr_sys_error (err, "stat %s", path);
  if (!S_ISDIR (st.st_mode) && !S_ISREG (st.st_mode))
    return wr_error (err, 0, WR_E_INVALID, "import source %s is neither a directory nor a file",
                     path);
  if (S_ISREG (st.st_mode))
    {
      fcntl (src, F_SETFL, 0);
      if (lseek (src, 0, SEEK_SET) < 0)
        return wr_sys_error (err, "seek %s", path);
    }

  if (store_path (s, w->dir, sizeof w->dir, "tmp", "import-XXXXXX", NULL) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INTERNAL, "store root too long");
  if (mkdtemp (w->dir) == NULL)
    return wr_sys_error (err, "mkdtemp %s", w->dir);
  w->made = true;

  char rootfs[4200], image[4200], srcdir[64];
  snprintf (rootfs, sizeof rootfs, "%s/rootfs", w->dir);
  snprintf (image, sizeof image, "%s/layer.erofs", w->dir);
  /* mkfs.erofs reads a directory by path: hand it the one we opened */
  snprintf (srcdir, sizeof srcdir, "/proc/%d/fd/%d", (int)getpid (), src);
  const char *tree = srcdir;
  if (S_ISREG (st.st_mode))
    {
      if (mkdir (rootfs, 0700) < 0)
        return wr_sys_error (err, "mkdir %s", rootfs);
      _cleanup_close_ int rfd = open (rootfs, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
      if (rfd < 0)
        return wr_sys_error (err, "open %s", rootfs);
      unsigned xflags = (flags & WR_STAGE_OCI) ? WR_EXTRACT_OCI_WHITEOUTS : 0;
      struct wr_extract_limits lim;
      wr_store_extract_limits (s, false, &lim);
      _cleanup_close_ int ofd
          = open (image, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
      if (ofd < 0)
        return wr_sys_error (err, "create %s", image);
      /* parsed and built by the confined helper, sealed by us */
      int r = wr_unpack (src, rfd, ofd, xflags, &lim, xs, err);
      if (r < 0)
        {
          err_exhausted (err);
          return wr_error_wrap (err, "import %s", path);
        }
      r = wr_erofs_seal (ofd, image, err);
      if (r < 0)
        {
          err_exhausted (err);
          return r;
        }
      tree = rootfs;
    }
  else
    {
      int r = wr_erofs_build (tree, image, err);
      if (r < 0)
        {
          err_exhausted (err);
          return r;
        }
    }
  _cleanup_close_ int ifd = open (image, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (ifd < 0 || fstat (ifd, &st) < 0)
    return wr_sys_error (err, "open %s", image);
  int r = wr_sha256_fd (ifd, hex);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "hash %s", image);
  *size = (uint64_t)st.st_size;
  /* the extracted tree is no longer needed: free the space before commit */
  if (tree == rootfs)
    wr_rm_rf_at (AT_FDCWD, rootfs);
  return 0;
}

int
wr_store_tmpdir (struct wr_store *s, const char *prefix, char *buf, size_t size, wr_err_t *err)
{
  char name[64];
  snprintf (name, sizeof name, "%.40s-XXXXXX", prefix);
  if (store_path (s, buf, size, "tmp", name, NULL) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INTERNAL, "store root too long");
  if (mkdtemp (buf) == NULL)
    {
      int r = wr_sys_error (err, "mkdtemp %s", buf);
      err_exhausted (err);
      return r;
    }
  return 0;
}

void
wr_layer_stage_free (struct wr_staged_layer *l)
{
  if (l == NULL)
    return;
  struct work w = { .made = l->dir[0] != '\0' };
  memcpy (w.dir, l->dir, sizeof w.dir);
  work_cleanup (&w);
  free (l);
}

int
wr_layer_stage (struct wr_store *s, const char *path, unsigned flags, struct wr_staged_layer **ret,
                wr_err_t *err)
{
  if (path == NULL || path[0] == '\0')
    return wr_error (err, EINVAL, WR_E_INVALID, "import path is empty");
  _cleanup_close_ int src = open (path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (src < 0)
    return wr_error (err, errno, errno == ENOENT ? WR_E_NOT_FOUND : WR_E_INVALID,
                     "cannot open import source %s", path);
  return wr_layer_stage_fd (s, src, path, flags, ret, err);
}

int
wr_layer_stage_fd (struct wr_store *s, int src, const char *label, unsigned flags,
                   struct wr_staged_layer **ret, wr_err_t *err)
{
  struct wr_staged_layer *l = calloc (1, sizeof *l);
  if (l == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  struct work w = { .made = false };
  char hex[65];
  struct wr_extract_stats xs;
  int r = build_layer (s, src, label, flags, &w, hex, &l->size, &xs, err);
  if (r < 0)
    {
      work_cleanup (&w);
      free (l);
      return r;
    }
  memcpy (l->dir, w.dir, sizeof l->dir);
  snprintf (l->digest, sizeof l->digest, DIGEST_PREFIX "%s", hex);
  if (xs.source[0])
    snprintf (l->source, sizeof l->source, DIGEST_PREFIX "%s", xs.source);
  l->unpacked = xs.bytes;
  l->skipped_special = xs.skipped_special;
  l->whiteouts = xs.whiteouts;
  *ret = l;
  return 0;
}

/* An EROFS layer as a registry holds it (docs/images.md, Push): src is a
 * verified blob; it is copied to a staged layer.erofs and its digest is
 * the store's layer digest. 1 (nothing staged) when that layer is stored. */
int
wr_layer_stage_erofs (struct wr_store *s, int src, struct wr_staged_layer **ret, wr_err_t *err)
{
  char hex[65];
  int r = wr_sha256_fd (src, hex);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "hash an EROFS layer");
  struct stat st;
  if (fstat (src, &st) < 0)
    return wr_sys_error (err, "stat an EROFS layer");
  struct wr_staged_layer *l = calloc (1, sizeof *l);
  if (l == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  r = wr_store_tmpdir (s, "layer", l->dir, sizeof l->dir, err);
  if (r < 0)
    {
      free (l);
      return r;
    }
  _cleanup_close_ int dfd = open (l->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  _cleanup_close_ int out
      = dfd < 0 ? -1 : openat (dfd, "layer.erofs", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0444);
  off_t off = 0;
  while (out >= 0 && off < st.st_size)
    {
      ssize_t n = copy_file_range (src, &off, out, NULL, (size_t)(st.st_size - off), 0);
      if (n <= 0)
        break;
    }
  if (out < 0 || off != st.st_size || fsync (out) < 0)
    {
      r = wr_sys_error (err, "stage an EROFS layer");
      wr_layer_stage_free (l);
      return r;
    }
  snprintf (l->digest, sizeof l->digest, DIGEST_PREFIX "%s", hex);
  snprintf (l->blob, sizeof l->blob, "%s", l->digest);
  l->size = (uint64_t)st.st_size;
  *ret = l;
  return 0;
}

static int
manifest_text (const char *const *layers, size_t n, json_t *config, char **ret_text,
               char ret_digest[72], wr_err_t *err)
{
  _cleanup_json_ json_t *arr = json_array ();
  for (size_t i = 0; arr && i < n; i++)
    json_array_append_new (arr, json_string (layers[i]));
  _cleanup_json_ json_t *m
      = arr ? json_pack ("{s:i,s:O,s:O}", "schema", 1, "layers", arr, "config", config) : NULL;
  char *text = m ? json_dumps (m, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
  if (text == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  char hex[65];
  wr_sha256_hex (text, strlen (text), hex);
  snprintf (ret_digest, 72, DIGEST_PREFIX "%s", hex);
  *ret_text = text;
  return 0;
}

/* Record the image under the lock: one transaction for layers, blob
 * mappings, manifest and tag. sizes[i] < 0: an existing layer that must
 * still be there. */
static int
commit_image (struct wr_store *s, const struct ref *ref, const char *const *layers, size_t n,
              const json_int_t *sizes, const char *const *blobs, const char *text,
              const char *digest, wr_err_t *err)
{
  long long now = (long long)time (NULL);
  if (db_exec (s->db, "BEGIN IMMEDIATE", err) < 0)
    return -EIO;
  _cleanup_stmt_ sqlite3_stmt *lst = NULL;
  _cleanup_stmt_ sqlite3_stmt *bst = NULL;
  _cleanup_stmt_ sqlite3_stmt *ist = NULL;
  _cleanup_stmt_ sqlite3_stmt *tst = NULL;
  if (db_prepare (s->db, "INSERT OR IGNORE INTO layers (digest, size, created_at) VALUES (?,?,?)",
                  &lst, err)
          < 0
      /* a blob maps to the layer first made from it, never replaced */
      || db_prepare (s->db, "INSERT OR IGNORE INTO blob_layers (blob, layer) VALUES (?,?)", &bst,
                     err)
             < 0
      || db_prepare (s->db,
                     "INSERT OR IGNORE INTO images (digest, manifest, created_at) VALUES (?,?,?)",
                     &ist, err)
             < 0
      || db_prepare (s->db, "INSERT OR REPLACE INTO tags (name, tag, digest) VALUES (?,?,?)", &tst,
                     err)
             < 0)
    goto fail;
  for (size_t i = 0; i < n; i++)
    {
      if (sizes[i] < 0)
        {
          bool exists;
          if (layer_row_exists (s, layers[i], &exists, err) < 0)
            goto fail;
          if (!exists)
            {
              wr_error (err, ENOENT, WR_E_NOT_FOUND, "layer %s not found", layers[i]);
              goto fail;
            }
        }
      else
        {
          sqlite3_bind_text (lst, 1, layers[i], -1, SQLITE_STATIC);
          sqlite3_bind_int64 (lst, 2, sizes[i]);
          sqlite3_bind_int64 (lst, 3, now);
          if (sqlite3_step (lst) != SQLITE_DONE)
            {
              db_error (s->db, err, "insert layer");
              goto fail;
            }
          sqlite3_reset (lst);
        }
      if (blobs && blobs[i] && blobs[i][0])
        {
          sqlite3_bind_text (bst, 1, blobs[i], -1, SQLITE_STATIC);
          sqlite3_bind_text (bst, 2, layers[i], -1, SQLITE_STATIC);
          if (sqlite3_step (bst) != SQLITE_DONE)
            {
              db_error (s->db, err, "insert blob");
              goto fail;
            }
          sqlite3_reset (bst);
        }
    }
  sqlite3_bind_text (ist, 1, digest, -1, SQLITE_STATIC);
  sqlite3_bind_text (ist, 2, text, -1, SQLITE_STATIC);
  sqlite3_bind_int64 (ist, 3, now);
  sqlite3_bind_text (tst, 1, ref->name, -1, SQLITE_STATIC);
  sqlite3_bind_text (tst, 2, ref->tag, -1, SQLITE_STATIC);
  sqlite3_bind_text (tst, 3, digest, -1, SQLITE_STATIC);
  if (sqlite3_step (ist) != SQLITE_DONE || sqlite3_step (tst) != SQLITE_DONE)
    {
      db_error (s->db, err, "insert image");
      goto fail;
    }
  if (db_exec (s->db, "COMMIT", err) < 0)
    goto fail;
  return 0;
fail:
  rollback (s->db);
  return -EIO;
}

int
wr_layers_check (size_t n, const char *what, wr_err_t *err)
{
  if (n == 0)
    return wr_error (err, EINVAL, WR_E_INVALID, "%s has no layers", what);
  if (n > WR_MAX_LAYERS)
    return wr_error (err, E2BIG, WR_E_INVALID, "%s has %zu layers, at most %d allowed", what, n,
                     WR_MAX_LAYERS);
  return 0;
}

int
wr_image_commit (struct wr_store *s, const char *refstr, const struct wr_layer_ref *in, size_t n,
                 const json_t *cfg, struct wr_image **ret, wr_err_t *err)
{
  struct ref ref;
  if (ref_parse (refstr, &ref) < 0 || ref.digest[0])
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "invalid image name '%.300s' (want name[:tag], lowercase)",
                     refstr ? refstr : "(null)");
  int r = wr_layers_check (n, "the image", err);
  if (r < 0)
    return r;
  _cleanup_json_ json_t *config = NULL;
  r = build_config (cfg, &config, err);
  if (r < 0)
    return r;

  /* The same layer twice (docker images often carry several identical
   * empty layers) would hand overlayfs one directory twice: keep the
   * top-most occurrence, the one that decides. */
  const char *layers[WR_MAX_LAYERS];
  json_int_t sizes[WR_MAX_LAYERS];
  const char *blobs[WR_MAX_LAYERS];
  struct wr_staged_layer *staged[WR_MAX_LAYERS];
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    {
      const char *d = in[i].staged ? in[i].staged->digest : in[i].digest;
      if (!digest_hex (d))
        return wr_error (err, EINVAL, WR_E_INVALID, "invalid layer digest '%.80s'",
                         d ? d : "(null)");
      bool later = false;
      for (size_t k = i + 1; k < n && !later; k++)
        later = strcmp (d, in[k].staged ? in[k].staged->digest : in[k].digest) == 0;
      if (later)
        continue;
      layers[m] = d;
      staged[m] = in[i].staged;
      sizes[m] = in[i].staged ? (json_int_t)in[i].staged->size : -1;
      blobs[m] = in[i].staged ? in[i].staged->blob : in[i].blob;
      m++;
    }
  _cleanup_free_ char *text = NULL;
  char mdigest[72];
  r = manifest_text (layers, m, config, &text, mdigest, err);
  if (r < 0)
    return r;

  char dir[4096];
  if (store_path (s, dir, sizeof dir, "layers/sha256", NULL, NULL) < 0)
    return wr_error (err, ENAMETOOLONG, WR_E_INTERNAL, "store root too long");
  LOCK_GUARD (s);
  bool fresh[WR_MAX_LAYERS] = { false };
  bool any_fresh = false;
  for (size_t i = 0; i < m; i++)
    {
      if (staged[i] == NULL)
        continue;
      char src[4200], dst[4096];
      snprintf (src, sizeof src, "%s/layer.erofs", staged[i]->dir);
      store_path (s, dst, sizeof dst, "layers/sha256", layers[i] + 7, ".erofs");
      /* identical content is already stored (maybe mounted): keep that file */
      if (access (dst, F_OK) == 0)
        continue;
      if (rename (src, dst) < 0)
        {
          r = wr_sys_error (err, "rename %s", dst);
          goto undo;
        }
      fresh[i] = any_fresh = true;
    }
  if (any_fresh && (r = fsync_dir (dir)) < 0)
    {
      r = wr_error (err, -r, WR_E_INTERNAL, "fsync %s", dir);
      goto undo;
    }
  r = commit_image (s, &ref, layers, m, sizes, blobs, text, mdigest, err);
  if (r < 0)
    goto undo;
  {
    /* a retag may leave the previous manifest unnamed: collect it now */
    wr_err_t gerr;
    gc_locked (s, &gerr);
  }
  if (ret)
    {
      char name[512];
      snprintf (name, sizeof name, "%s:%s", ref.name, ref.tag);
      r = image_from_manifest (s, mdigest, name, text, ret, err);
      if (r < 0)
        return r;
      for (size_t i = 0; i < m; i++)
        if (staged[i])
          (*ret)->skipped_special += staged[i]->skipped_special;
    }
  return 0;
undo:
  /* give the files back to their staged dirs: the caller may retry */
  for (size_t i = 0; i < m; i++)
    if (fresh[i])
      {
        char src[4200], dst[4096];
        snprintf (src, sizeof src, "%s/layer.erofs", staged[i]->dir);
        store_path (s, dst, sizeof dst, "layers/sha256", layers[i] + 7, ".erofs");
        if (rename (dst, src) < 0)
          unlink (dst);
      }
  return r;
}

int
wr_image_import_ex (struct wr_store *s, const char *refstr, const char *path,
                    const struct wr_import_opts *opts, struct wr_image **ret, wr_err_t *err)
{
  struct ref ref;
  if (ref_parse (refstr, &ref) < 0 || ref.digest[0])
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "invalid image name '%.300s' (want name[:tag], lowercase)",
                     refstr ? refstr : "(null)");
  size_t nbase = opts ? opts->n_base_layers : 0;
  if (wr_layers_check (nbase + 1, "the new image", err) < 0)
    return -E2BIG;
  for (size_t i = 0; i < nbase; i++)
    if (!digest_hex (opts->base_layers[i]))
      return wr_error (err, EINVAL, WR_E_INVALID, "invalid base layer digest");
  {
    /* check the config before the slow part */
    _cleanup_json_ json_t *config = NULL;
    int r = build_config (opts ? opts->config : NULL, &config, err);
    if (r < 0)
      return r;
  }
  struct wr_staged_layer *l = NULL;
  int r = wr_layer_stage (s, path, 0, &l, err);
  if (r < 0)
    return r;
  struct wr_layer_ref refs[WR_MAX_LAYERS];
  memset (refs, 0, sizeof refs);
  for (size_t i = 0; i < nbase; i++)
    refs[i].digest = opts->base_layers[i];
  refs[nbase].staged = l;
  r = wr_image_commit (s, refstr, refs, nbase + 1, opts ? opts->config : NULL, ret, err);
  wr_layer_stage_free (l);
  return r;
}

int
wr_image_import (struct wr_store *s, const char *ref, const char *path, struct wr_image **ret,
                 wr_err_t *err)
{
  return wr_image_import_ex (s, ref, path, NULL, ret, err);
}

int
wr_image_tag (struct wr_store *s, const char *src, const char *dst, struct wr_image **ret,
              wr_err_t *err)
{
  struct ref dref;
  if (ref_parse (dst, &dref) < 0 || dref.digest[0])
    return wr_error (err, EINVAL, WR_E_INVALID,
                     "invalid image name '%.300s' (want name[:tag], lowercase)",
                     dst ? dst : "(null)");
  LOCK_GUARD (s);
  _cleanup_ (image_freep) struct wr_image *img = NULL;
  int r = resolve_locked (s, src, &img, err);
  if (r < 0)
    return r;
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (db_prepare (s->db, "INSERT OR REPLACE INTO tags (name, tag, digest) VALUES (?,?,?)", &st, err)
      < 0)
    return -EIO;
  sqlite3_bind_text (st, 1, dref.name, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, dref.tag, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 3, img->digest, -1, SQLITE_STATIC);
  if (sqlite3_step (st) != SQLITE_DONE)
    return db_error (s->db, err, "insert tag");
  /* the tag may have named another manifest */
  wr_err_t gerr;
  gc_locked (s, &gerr);
  snprintf (img->name, sizeof img->name, "%s:%s", dref.name, dref.tag);
  if (ret)
    *ret = TAKE_PTR (img);
  return 0;
}

int
wr_blob_layer (struct wr_store *s, const char *blob, char ret_layer[72], wr_err_t *err)
{
  if (!digest_hex (blob))
    return wr_error (err, EINVAL, WR_E_INVALID, "invalid blob digest");
  LOCK_GUARD (s);
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (db_prepare (
          s->db,
          "SELECT b.layer FROM blob_layers b JOIN layers l ON l.digest = b.layer WHERE b.blob = ?",
          &st, err)
      < 0)
    return -EIO;
  sqlite3_bind_text (st, 1, blob, -1, SQLITE_STATIC);
  int rc = sqlite3_step (st);
  if (rc == SQLITE_DONE)
    return 0;
  if (rc != SQLITE_ROW)
    return db_error (s->db, err, "select blob");
  snprintf (ret_layer, 72, "%s", (const char *)sqlite3_column_text (st, 0));
  return 1;
}

const char *
wr_store_root (struct wr_store *s)
{
  return s->root;
}

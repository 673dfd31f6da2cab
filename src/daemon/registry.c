/* The sandbox registry: one SQLite database under the root, WAL mode.
 * Every state change of a sandbox is written before the API answers, so a
 * daemon killed at any point restarts knowing every sandbox it created. */
#include "daemon/daemon.h"
#include "daemon/log.h"

#include <stdio.h>
#include <string.h>

#include "common/util.h"

static const char schema[]
    = "CREATE TABLE IF NOT EXISTS sandboxes ("
      " id TEXT PRIMARY KEY, backend TEXT NOT NULL, image TEXT NOT NULL,"
      " state TEXT NOT NULL, pid INTEGER NOT NULL, start_time INTEGER NOT NULL,"
      " created_at REAL NOT NULL, expires_at REAL NOT NULL,"
      " spec TEXT NOT NULL, layers TEXT NOT NULL);"
      "CREATE TABLE IF NOT EXISTS pools (image TEXT PRIMARY KEY, size INTEGER NOT NULL);";

int
wrd_db_open (struct wrd *d, wr_err_t *err)
{
  char path[1100];
  snprintf (path, sizeof path, "%s/warren.db", d->root);
  int rc = sqlite3_open_v2 (
      path, &d->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, NULL);
  if (rc != SQLITE_OK)
    return wr_error (err, 0, WR_E_INTERNAL, "open %s: %s", path,
                     d->db ? sqlite3_errmsg (d->db) : sqlite3_errstr (rc));
  sqlite3_busy_timeout (d->db, 5000);
  char *msg = NULL;
  /* NORMAL in WAL mode: a committed transaction survives a daemon crash
   * (only an OS crash can lose the last ones). */
  rc = sqlite3_exec (d->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;", NULL, NULL,
                     &msg);
  if (rc == SQLITE_OK)
    rc = sqlite3_exec (d->db, schema, NULL, NULL, &msg);
  if (rc != SQLITE_OK)
    {
      int r = wr_error (err, 0, WR_E_INTERNAL, "init %s: %s", path, msg ? msg : "?");
      sqlite3_free (msg);
      return r;
    }
  return 0;
}

static int
db_err (struct wrd *d, wr_err_t *err, const char *what)
{
  return wr_error (err, 0, WR_E_INTERNAL, "registry %s: %s", what, sqlite3_errmsg (d->db));
}

int
wrd_db_put (struct wrd *d, struct sandbox *sb, wr_err_t *err)
{
  static const char sql[] = "INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?)";
  sqlite3_stmt *st = NULL;
  if (sqlite3_prepare_v2 (d->db, sql, -1, &st, NULL) != SQLITE_OK)
    return db_err (d, err, "prepare");
  _cleanup_free_ char *spec = json_dumps (sb->spec, JSON_COMPACT);
  json_t *layers = json_array ();
  for (size_t i = 0; i < sb->n_layers; i++)
    json_array_append_new (layers, json_string (sb->layers[i]));
  _cleanup_free_ char *ltext = json_dumps (layers, JSON_COMPACT);
  json_decref (layers);
  sqlite3_bind_text (st, 1, sb->id, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, sb->backend, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 3, sb->image, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 4, sb_state_name (sb->state), -1, SQLITE_STATIC);
  sqlite3_bind_int64 (st, 5, sb->c.pid);
  sqlite3_bind_int64 (st, 6, (sqlite3_int64)sb->c.start_time);
  sqlite3_bind_double (st, 7, sb->created_at);
  sqlite3_bind_double (st, 8, sb->expires_at);
  sqlite3_bind_text (st, 9, spec ? spec : "{}", -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 10, ltext ? ltext : "[]", -1, SQLITE_STATIC);
  int rc = sqlite3_step (st);
  sqlite3_finalize (st);
  if (rc != SQLITE_DONE)
    return db_err (d, err, "insert");
  return 0;
}

int
wrd_db_delete (struct wrd *d, const char *id, wr_err_t *err)
{
  sqlite3_stmt *st = NULL;
  if (sqlite3_prepare_v2 (d->db, "DELETE FROM sandboxes WHERE id=?", -1, &st, NULL) != SQLITE_OK)
    return db_err (d, err, "prepare");
  sqlite3_bind_text (st, 1, id, -1, SQLITE_STATIC);
  int rc = sqlite3_step (st);
  sqlite3_finalize (st);
  return rc == SQLITE_DONE ? 0 : db_err (d, err, "delete");
}

int
wrd_db_each (struct wrd *d, wrd_db_row_cb cb, void *ud, wr_err_t *err)
{
  sqlite3_stmt *st = NULL;
  if (sqlite3_prepare_v2 (d->db,
                          "SELECT id, backend, image, state, pid, start_time, created_at,"
                          " expires_at, spec, layers FROM sandboxes",
                          -1, &st, NULL)
      != SQLITE_OK)
    return db_err (d, err, "prepare");
  /* Collect first: callbacks may modify the table. */
  json_t *rows = json_array ();
  int rc;
  while ((rc = sqlite3_step (st)) == SQLITE_ROW)
    {
      json_t *spec = json_loads ((const char *)sqlite3_column_text (st, 8), 0, NULL);
      json_t *layers = json_loads ((const char *)sqlite3_column_text (st, 9), 0, NULL);
      json_array_append_new (
          rows, json_pack ("{s:s,s:s,s:s,s:s,s:I,s:I,s:f,s:f,s:o,s:o}", "id",
                           (const char *)sqlite3_column_text (st, 0), "backend",
                           (const char *)sqlite3_column_text (st, 1), "image",
                           (const char *)sqlite3_column_text (st, 2), "state",
                           (const char *)sqlite3_column_text (st, 3), "pid",
                           (json_int_t)sqlite3_column_int64 (st, 4), "start_time",
                           (json_int_t)sqlite3_column_int64 (st, 5), "created_at",
                           sqlite3_column_double (st, 6), "expires_at",
                           sqlite3_column_double (st, 7), "spec", spec ? spec : json_object (),
                           "layers", layers ? layers : json_array ()));
    }
  sqlite3_finalize (st);
  if (rc != SQLITE_DONE)
    {
      json_decref (rows);
      return db_err (d, err, "select");
    }
  size_t i;
  json_t *row;
  json_array_foreach (rows, i, row) cb (d, row, ud);
  json_decref (rows);
  return 0;
}

int
wrd_db_pool_put (struct wrd *d, const char *image, unsigned size, wr_err_t *err)
{
  sqlite3_stmt *st = NULL;
  const char *sql = size ? "INSERT OR REPLACE INTO pools VALUES (?, ?)"
                         : "DELETE FROM pools WHERE image=? AND ?>=0";
  if (sqlite3_prepare_v2 (d->db, sql, -1, &st, NULL) != SQLITE_OK)
    return db_err (d, err, "prepare");
  sqlite3_bind_text (st, 1, image, -1, SQLITE_STATIC);
  sqlite3_bind_int (st, 2, (int)size);
  int rc = sqlite3_step (st);
  sqlite3_finalize (st);
  return rc == SQLITE_DONE ? 0 : db_err (d, err, "pool");
}

int
wrd_pools_load (struct wrd *d, wr_err_t *err)
{
  sqlite3_stmt *st = NULL;
  if (sqlite3_prepare_v2 (d->db, "SELECT image, size FROM pools", -1, &st, NULL) != SQLITE_OK)
    return db_err (d, err, "prepare");
  json_t *pools = json_object ();
  while (sqlite3_step (st) == SQLITE_ROW)
    json_object_set_new (pools, (const char *)sqlite3_column_text (st, 0),
                         json_integer (sqlite3_column_int (st, 1)));
  sqlite3_finalize (st);
  const char *k;
  json_t *v;
  json_object_foreach (pools, k, v)
  {
    wr_err_t e;
    if (wrd_pool_set (d, k, (unsigned)json_integer_value (v), &e) < 0)
      wrd_log (WRD_LOG_WARN, "pool %s: %s\n", k, e.msg);
  }
  json_decref (pools);
  return 0;
}

/* The trajectory log (docs/rl.md). One SQLite database, ROOT/trajectory.db,
 * apart from the registry so its writes never wait on the registry's and it
 * can outlive the sandboxes it describes. WAL with synchronous=NORMAL: a
 * committed row survives kill -9 of the daemon (only an OS crash can lose
 * the last commits), at no fsync per exec.
 *
 * An exec or file change is inserted when it starts (so the log keeps the
 * order requests were issued in, and a repeated step id finds the running
 * one) and updated with its result when it ends. Rows without a result at
 * startup ran across a crash: they are marked interrupted. */
#include "daemon/trajlog.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <event2/event.h>

#include "common/proto.h"
#include "common/util.h"
#include "daemon/http_util.h"
#include "daemon/log.h"
#include "image/sha256.h"
#include "image/store.h"

struct wrd_traj
{
  sqlite3 *db;
  double retention_s;
  struct event *reap_ev;
  /* the statements of every exec, prepared once */
  sqlite3_stmt *insert, *update, *step;
};

struct wrd_traj_op
{
  struct wrd_traj *t;
  sqlite3_int64 seq;
  bool exec;
  int status;      /* file ops: the HTTP status on success */
  size_t keep;     /* output bytes kept per stream */
  uint64_t t0;     /* ns */
  uint64_t len[2]; /* all output bytes, per stream */
  struct wr_sha256 h[2];
  struct evbuffer *out[2];
};

static const char schema[]
    = "CREATE TABLE IF NOT EXISTS logs ("
      " id TEXT PRIMARY KEY, image TEXT NOT NULL, image_digest TEXT NOT NULL,"
      " backend TEXT NOT NULL, spec TEXT NOT NULL, created_at REAL NOT NULL,"
      " destroyed_at REAL, replay_of TEXT, parent TEXT, parent_seq INTEGER);"
      "CREATE TABLE IF NOT EXISTS events ("
      " seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox TEXT NOT NULL, kind TEXT NOT NULL,"
      " at REAL NOT NULL, step TEXT, request_hash TEXT, request TEXT, agent TEXT, input BLOB,"
      " result TEXT, stdout BLOB, stderr BLOB, replayed_from INTEGER, rerun TEXT);"
      "CREATE INDEX IF NOT EXISTS events_sandbox ON events (sandbox, seq);"
      "CREATE UNIQUE INDEX IF NOT EXISTS events_step ON events (sandbox, step)"
      " WHERE step IS NOT NULL;";

static void
stmt_freep (sqlite3_stmt **st)
{
  if (*st)
    sqlite3_finalize (*st);
}
#define _cleanup_stmt_ _cleanup_ (stmt_freep)

static void
json_freep (json_t **j)
{
  json_decref (*j);
}
#define _cleanup_json_ _cleanup_ (json_freep)

static double
now_s (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int
db_err (sqlite3 *db, wr_err_t *err, const char *what)
{
  return wr_error (err, 0, WR_E_INTERNAL, "trajectory log: %s: %s", what, sqlite3_errmsg (db));
}

static int
prepare (struct wrd_traj *t, const char *sql, sqlite3_stmt **st, wr_err_t *err)
{
  if (sqlite3_prepare_v2 (t->db, sql, -1, st, NULL) != SQLITE_OK)
    return db_err (t->db, err, "prepare");
  return 0;
}

/* A statement kept in *slot (prepared on first use, SQLITE_PREPARE_PERSISTENT),
 * reset when the caller's stmt_resetp cleanup runs. */
static sqlite3_stmt *
cached (struct wrd_traj *t, sqlite3_stmt **slot, const char *sql, wr_err_t *err)
{
  if (*slot == NULL
      && sqlite3_prepare_v3 (t->db, sql, -1, SQLITE_PREPARE_PERSISTENT, slot, NULL) != SQLITE_OK)
    {
      db_err (t->db, err, "prepare");
      return NULL;
    }
  return *slot;
}

static void
stmt_resetp (sqlite3_stmt **st)
{
  if (*st)
    {
      sqlite3_reset (*st);
      sqlite3_clear_bindings (*st);
    }
}
#define _reset_stmt_ _cleanup_ (stmt_resetp)

static void
bind_json (sqlite3_stmt *st, int i, const json_t *j)
{
  char *text = j ? json_dumps (j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
  if (text)
    sqlite3_bind_text (st, i, text, -1, free);
  else
    sqlite3_bind_null (st, i);
}

static json_t *
column_json (sqlite3_stmt *st, int i)
{
  const char *text = (const char *)sqlite3_column_text (st, i);
  json_t *j = text ? json_loads (text, 0, NULL) : NULL;
  return j ? j : json_null ();
}

/* ---- retention ---- */

/* A forked child's log refers to its parent's up to the fork: the parent's
 * is kept as long as a child's is (a chain goes one generation a pass). */
#define KEEP_PARENTS "id NOT IN (SELECT parent FROM logs WHERE parent IS NOT NULL)"

static void
reap (struct wrd_traj *t)
{
  _cleanup_stmt_ sqlite3_stmt *ev = NULL, *lg = NULL;
  double before = now_s () - t->retention_s;
  if (prepare (t,
               "DELETE FROM events WHERE sandbox IN (SELECT id FROM logs WHERE destroyed_at"
               " IS NOT NULL AND destroyed_at < ?1 AND " KEEP_PARENTS ")",
               &ev, NULL)
          < 0
      || prepare (t,
                  "DELETE FROM logs WHERE destroyed_at IS NOT NULL AND destroyed_at < ?1"
                  " AND " KEEP_PARENTS,
                  &lg, NULL)
             < 0)
    return;
  sqlite3_exec (t->db, "BEGIN", NULL, NULL, NULL);
  sqlite3_bind_double (ev, 1, before);
  sqlite3_bind_double (lg, 1, before);
  int rc = sqlite3_step (ev);
  if (rc == SQLITE_DONE)
    rc = sqlite3_step (lg);
  sqlite3_exec (t->db, rc == SQLITE_DONE ? "COMMIT" : "ROLLBACK", NULL, NULL, NULL);
  if (rc != SQLITE_DONE)
    wrd_log (WRD_LOG_WARN, "trajectory log reaper: %s", sqlite3_errmsg (t->db));
}

static void
reap_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  reap (arg);
}

int
wrd_traj_open (struct wrd *d, double retention_s, wr_err_t *err)
{
  struct wrd_traj *t = calloc (1, sizeof *t);
  if (t == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "trajectory log");
  t->retention_s = retention_s;
  char path[1100];
  snprintf (path, sizeof path, "%s/trajectory.db", d->root);
  int rc = sqlite3_open_v2 (path, &t->db,
                            SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, NULL);
  char *msg = NULL;
  if (rc == SQLITE_OK)
    rc = sqlite3_exec (t->db,
                       "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
                       " PRAGMA busy_timeout=5000;",
                       NULL, NULL, &msg);
  if (rc == SQLITE_OK)
    rc = sqlite3_exec (t->db, schema, NULL, NULL, &msg);
  /* a database from before fork provenance: add its columns (an error
   * here only says they are there) */
  if (rc == SQLITE_OK)
    {
      sqlite3_exec (t->db, "ALTER TABLE logs ADD COLUMN parent TEXT", NULL, NULL, NULL);
      sqlite3_exec (t->db, "ALTER TABLE logs ADD COLUMN parent_seq INTEGER", NULL, NULL, NULL);
    }
  /* What was running when the previous daemon died: its outcome is unknown. */
  if (rc == SQLITE_OK)
    rc = sqlite3_exec (t->db,
                       "UPDATE events SET result = json_object('error', json_object('code',"
                       " 'unavailable', 'message', 'warrend stopped while this ran: its outcome"
                       " is unknown'), 'infra_failure', json('true'), 'interrupted',"
                       " json('true')) WHERE result IS NULL",
                       NULL, NULL, &msg);
  if (rc != SQLITE_OK)
    {
      int r = wr_error (err, 0, WR_E_INTERNAL, "open %s: %s", path,
                        msg ? msg : (t->db ? sqlite3_errmsg (t->db) : sqlite3_errstr (rc)));
      sqlite3_free (msg);
      sqlite3_close (t->db);
      free (t);
      return r;
    }
  /* reaped within half the retention (at most a minute) of expiring */
  double period = fmin (fmax (retention_s / 2, 0.5), 60);
  t->reap_ev = event_new (d->base, -1, EV_PERSIST, reap_cb, t);
  struct timeval tv = { (time_t)period, (suseconds_t)((period - floor (period)) * 1e6) };
  if (t->reap_ev)
    event_add (t->reap_ev, &tv);
  reap (t);
  d->traj = t;
  return 0;
}

void
wrd_traj_close (struct wrd *d)
{
  struct wrd_traj *t = d->traj;
  if (t == NULL)
    return;
  if (t->reap_ev)
    event_free (t->reap_ev);
  sqlite3_finalize (t->insert);
  sqlite3_finalize (t->update);
  sqlite3_finalize (t->step);
  sqlite3_close (t->db);
  free (t);
  d->traj = NULL;
}

/* ---- appending ---- */

static sqlite3_int64
insert_event (struct wrd_traj *t, const char *sandbox, const char *kind, const char *step,
              const char *hash, const json_t *request, const json_t *agent, const void *input,
              size_t input_len, const json_t *result, wr_err_t *err)
{
  _reset_stmt_ sqlite3_stmt *st
      = cached (t, &t->insert,
                "INSERT INTO events (sandbox, kind, at, step, request_hash, request, agent, input,"
                " result) VALUES (?,?,?,?,?,?,?,?,?)",
                err);
  if (st == NULL)
    return -1;
  sqlite3_bind_text (st, 1, sandbox, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, kind, -1, SQLITE_STATIC);
  sqlite3_bind_double (st, 3, now_s ());
  sqlite3_bind_text (st, 4, step, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 5, hash, -1, SQLITE_STATIC);
  bind_json (st, 6, request);
  bind_json (st, 7, agent);
  if (input)
    sqlite3_bind_blob64 (st, 8, input, input_len, SQLITE_STATIC);
  bind_json (st, 9, result);
  if (sqlite3_step (st) != SQLITE_DONE)
    return db_err (t->db, err, "append");
  return sqlite3_last_insert_rowid (t->db);
}

int64_t
wrd_traj_lifecycle (struct wrd *d, struct sandbox *sb, const char *kind, json_t *detail)
{
  _cleanup_json_ json_t *res = detail ? detail : json_object ();
  struct wrd_traj *t = d->traj;
  if (t == NULL)
    return -1;
  wr_err_t err;
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (strcmp (kind, "create") == 0)
    {
      if (prepare (t,
                   "INSERT OR REPLACE INTO logs (id, image, image_digest, backend, spec,"
                   " created_at) VALUES (?,?,?,?,?,?)",
                   &st, &err)
          < 0)
        goto fail;
      sqlite3_bind_text (st, 1, sb->id, -1, SQLITE_STATIC);
      sqlite3_bind_text (st, 2, sb->image, -1, SQLITE_STATIC);
      sqlite3_bind_text (st, 3, sb->image_digest, -1, SQLITE_STATIC);
      sqlite3_bind_text (st, 4, sb->backend, -1, SQLITE_STATIC);
      bind_json (st, 5, sb->spec);
      sqlite3_bind_double (st, 6, sb->created_at);
      if (sqlite3_step (st) != SQLITE_DONE)
        {
          db_err (t->db, &err, "create");
          goto fail;
        }
      json_object_set_new (res, "image", json_string (sb->image));
      json_object_set_new (res, "image_digest", json_string (sb->image_digest));
      json_object_set_new (res, "backend", json_string (sb->backend));
    }
  else
    {
      /* only sandboxes handed to a client have a log (not pooled or
       * internal ones) */
      if (prepare (t,
                   "UPDATE logs SET destroyed_at = CASE WHEN ?2 THEN ?3 ELSE destroyed_at END"
                   " WHERE id = ?1 AND destroyed_at IS NULL",
                   &st, &err)
          < 0)
        goto fail;
      sqlite3_bind_text (st, 1, sb->id, -1, SQLITE_STATIC);
      sqlite3_bind_int (st, 2, strcmp (kind, "destroy") == 0);
      sqlite3_bind_double (st, 3, now_s ());
      if (sqlite3_step (st) != SQLITE_DONE)
        {
          db_err (t->db, &err, kind);
          goto fail;
        }
      if (sqlite3_changes (t->db) == 0)
        return -1;
    }
  sqlite3_int64 seq = insert_event (t, sb->id, kind, NULL, NULL, NULL, NULL, NULL, 0, res, &err);
  if (seq >= 0)
    return seq;
fail:
  wrd_log (WRD_LOG_ERROR, "%s %s: %s", kind, sb->id, err.msg);
  return -1;
}

void
wrd_traj_event_update (struct wrd *d, int64_t seq, json_t *add)
{
  _cleanup_json_ json_t *patch = add;
  struct wrd_traj *t = d->traj;
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  wr_err_t err;
  if (t == NULL || seq < 0 || patch == NULL)
    return;
  if (prepare (t, "UPDATE events SET result = json_patch(result, ?) WHERE seq = ?", &st, &err) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "log seq %lld: %s", (long long)seq, err.msg);
      return;
    }
  bind_json (st, 1, patch);
  sqlite3_bind_int64 (st, 2, seq);
  if (sqlite3_step (st) != SQLITE_DONE)
    wrd_log (WRD_LOG_ERROR, "log seq %lld: %s", (long long)seq, sqlite3_errmsg (t->db));
}

void
wrd_traj_forked (struct wrd *d, const char *child, const char *parent, int64_t fork_seq)
{
  struct wrd_traj *t = d->traj;
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  wr_err_t err;
  if (t == NULL || fork_seq < 0)
    return;
  if (prepare (t, "UPDATE logs SET parent = ?, parent_seq = ? WHERE id = ?", &st, &err) < 0)
    {
      wrd_log (WRD_LOG_ERROR, "fork %s: %s", child, err.msg);
      return;
    }
  sqlite3_bind_text (st, 1, parent, -1, SQLITE_STATIC);
  sqlite3_bind_int64 (st, 2, fork_seq);
  sqlite3_bind_text (st, 3, child, -1, SQLITE_STATIC);
  if (sqlite3_step (st) != SQLITE_DONE)
    wrd_log (WRD_LOG_ERROR, "fork %s: %s", child, sqlite3_errmsg (t->db));
}

/* ---- steps ---- */

/* A recorded step answered again: the result as first given, plus
 * "replayed": true. */
static void
reply_recorded (struct evhttp_request *req, bool exec, bool stream, sqlite3_stmt *st)
{
  json_t *r = column_json (st, 2);
  if (!json_is_object (r))
    {
      json_decref (r);
      wrd_reply_error_code (req, WR_E_INTERNAL, "the recorded result is unreadable");
      return;
    }
  json_object_set_new (r, "replayed", json_true ());
  json_object_set_new (r, "seq", json_integer (sqlite3_column_int64 (st, 0)));
  json_t *e = json_object_get (r, "error");
  if (json_is_object (e))
    {
      const char *code = json_string_value (json_object_get (e, "code"));
      wrd_reply_json (req, wr_code_http_status (code ? code : WR_E_INTERNAL), r);
      return;
    }
  if (!exec)
    {
      int status = (int)json_integer_value (json_object_get (r, "status"));
      json_object_del (r, "status");
      if (status == 204)
        {
          json_decref (r);
          wrd_reply_empty (req, 204);
        }
      else
        wrd_reply_json (req, status ? status : 200, r);
      return;
    }
  static const char *const names[2] = { "stdout", "stderr" };
  if (!stream)
    {
      for (int i = 0; i < 2; i++)
        wrd_json_set_bytes (r, names[i], sqlite3_column_blob (st, 3 + i),
                            (size_t)sqlite3_column_bytes (st, 3 + i));
      wrd_reply_json (req, 200, r);
      return;
    }
  struct evbuffer *b = evbuffer_new ();
  for (int i = 0; i < 2; i++)
    if (sqlite3_column_bytes (st, 3 + i) > 0)
      {
        json_t *line = json_pack ("{s:s}", "stream", names[i]);
        wrd_json_set_bytes (line, "data", sqlite3_column_blob (st, 3 + i),
                            (size_t)sqlite3_column_bytes (st, 3 + i));
        char *text = json_dumps (line, JSON_COMPACT);
        json_decref (line);
        if (text)
          evbuffer_add_printf (b, "%s\n", text);
        free (text);
      }
  char *text = json_dumps (r, JSON_COMPACT);
  json_decref (r);
  if (text)
    evbuffer_add_printf (b, "%s\n", text);
  free (text);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                     "application/x-ndjson");
  evhttp_send_reply (req, 200, "OK", b);
  evbuffer_free (b);
}

/* Look the step up: 1 answered, 0 new. */
static int
step_check (struct wrd_traj *t, struct evhttp_request *req, const char *sandbox, const char *step,
            const char *hash, bool exec, bool stream)
{
  wr_err_t err;
  _reset_stmt_ sqlite3_stmt *st
      = cached (t, &t->step,
                "SELECT seq, request_hash, result, stdout, stderr FROM events WHERE sandbox = ?"
                " AND step = ?",
                &err);
  if (st == NULL)
    {
      wrd_reply_error (req, &err);
      return 1;
    }
  sqlite3_bind_text (st, 1, sandbox, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, step, -1, SQLITE_STATIC);
  if (sqlite3_step (st) != SQLITE_ROW)
    return 0;
  char msg[512];
  const char *was = (const char *)sqlite3_column_text (st, 1);
  if (was == NULL || strcmp (was, hash) != 0)
    {
      snprintf (msg, sizeof msg,
                "step \"%.200s\" was already used with a different request (log seq %lld)", step,
                (long long)sqlite3_column_int64 (st, 0));
      wrd_reply_error_code (req, WR_E_CONFLICT, msg);
      return 1;
    }
  if (sqlite3_column_type (st, 2) == SQLITE_NULL)
    {
      snprintf (msg, sizeof msg, "step \"%.200s\" is still running; repeat it when it ended", step);
      wrd_reply_error_code (req, WR_E_CONFLICT, msg);
      return 1;
    }
  reply_recorded (req, exec, stream, st);
  return 1;
}

static int
step_valid (struct evhttp_request *req, const json_t *step)
{
  if (step == NULL || json_is_null (step))
    return 0;
  const char *s = json_string_value (step);
  if (s == NULL || s[0] == '\0' || strlen (s) > 256 || strlen (s) != json_string_length (step))
    {
      wrd_reply_error_code (req, WR_E_INVALID,
                            "field \"step\" must be a non-empty string of at most 256 bytes");
      return -1;
    }
  return 1;
}

static struct wrd_traj_op *
op_new (struct wrd_traj *t, sqlite3_int64 seq, bool exec, bool stepped)
{
  struct wrd_traj_op *op = calloc (1, sizeof *op);
  if (op == NULL)
    return NULL;
  op->t = t;
  op->seq = seq;
  op->exec = exec;
  op->keep = stepped ? SIZE_MAX : WRD_TRAJ_OUTPUT_CAP;
  op->t0 = wr_now_ns ();
  for (int i = 0; i < 2; i++)
    {
      wr_sha256_init (&op->h[i]);
      op->out[i] = evbuffer_new ();
    }
  return op;
}

int
wrd_traj_exec_begin (struct wrd *d, struct sandbox *sb, struct evhttp_request *req, json_t *body,
                     json_t *agent, const void *in, size_t in_len, bool stream,
                     struct wrd_traj_op **ret)
{
  *ret = NULL;
  struct wrd_traj *t = d->traj;
  if (t == NULL)
    return 0;
  json_t *sj = json_object_get (body, "step");
  int stepped = step_valid (req, sj);
  if (stepped < 0)
    return 1;
  const char *step = stepped ? json_string_value (sj) : NULL;
  /* the request as the client sent it, minus how it wants the answer */
  _cleanup_json_ json_t *request = json_deep_copy (body);
  json_object_del (request, "stream");
  char hash[65] = "";
  _cleanup_free_ char *canon = json_dumps (request, JSON_COMPACT | JSON_SORT_KEYS);
  if (canon)
    wr_sha256_hex (canon, strlen (canon), hash);
  if (step && step_check (t, req, sb->id, step, hash, true, stream))
    return 1;
  /* stdin is kept as bytes in the input column */
  json_object_del (request, "stdin");
  json_object_del (request, "stdin_encoding");
  if (in)
    json_object_set_new (request, "stdin_bytes", json_integer ((json_int_t)in_len));
  wr_err_t err;
  sqlite3_int64 seq
      = insert_event (t, sb->id, "exec", step, hash, request, agent, in, in_len, NULL, &err);
  if (seq < 0)
    {
      wrd_reply_error (req, &err);
      return 1;
    }
  *ret = op_new (t, seq, true, step != NULL);
  return 0;
}

int
wrd_traj_file_begin (struct wrd *d, struct sandbox *sb, struct evhttp_request *req, json_t *agent,
                     const char *step, struct evbuffer *data, int status, struct wrd_traj_op **ret)
{
  *ret = NULL;
  struct wrd_traj *t = d->traj;
  if (t == NULL)
    return 0;
  _cleanup_json_ json_t *sj = step ? json_string (step) : NULL;
  if (step_valid (req, sj) < 0)
    return 1;
  _cleanup_json_ json_t *request = json_deep_copy (agent);
  size_t n = data ? evbuffer_get_length (data) : 0;
  const void *bytes = n ? (const void *)evbuffer_pullup (data, -1) : (const void *)"";
  if (data)
    {
      char sum[65];
      wr_sha256_hex (bytes, n, sum);
      json_object_set_new (request, "size", json_integer ((json_int_t)n));
      json_object_set_new (request, "sha256", json_string (sum));
    }
  char hash[65] = "";
  _cleanup_free_ char *canon = json_dumps (request, JSON_COMPACT | JSON_SORT_KEYS);
  if (canon)
    wr_sha256_hex (canon, strlen (canon), hash);
  if (step && step_check (t, req, sb->id, step, hash, false, false))
    return 1;
  wr_err_t err;
  sqlite3_int64 seq = insert_event (t, sb->id, "file", step, hash, request, agent,
                                    data ? bytes : NULL, n, NULL, &err);
  if (seq < 0)
    {
      wrd_reply_error (req, &err);
      return 1;
    }
  *ret = op_new (t, seq, false, step != NULL);
  if (*ret)
    (*ret)->status = status;
  return 0;
}

void
wrd_traj_op_output (struct wrd_traj_op *op, int stream, const void *data, size_t len)
{
  if (op == NULL || len == 0)
    return;
  wr_sha256_update (&op->h[stream], data, len);
  op->len[stream] += len;
  size_t have = evbuffer_get_length (op->out[stream]);
  if (have < op->keep)
    evbuffer_add (op->out[stream], data, len < op->keep - have ? len : op->keep - have);
}

static void
op_free (struct wrd_traj_op *op)
{
  for (int i = 0; i < 2; i++)
    if (op->out[i])
      evbuffer_free (op->out[i]);
  free (op);
}

static void
op_finish (struct wrd_traj_op *op, json_t *res)
{
  static const char *const names[2] = { "stdout", "stderr" };
  if (op->exec)
    for (int i = 0; i < 2; i++)
      {
        uint8_t dg[32];
        char hex[65], key[64];
        wr_sha256_final (&op->h[i], dg);
        wr_sha256_to_hex (dg, hex);
        snprintf (key, sizeof key, "%s_sha256", names[i]);
        json_object_set_new (res, key, json_string (hex));
        snprintf (key, sizeof key, "%s_bytes", names[i]);
        json_object_set_new (res, key, json_integer ((json_int_t)op->len[i]));
        snprintf (key, sizeof key, "%s_log_truncated", names[i]);
        json_object_set_new (res, key, json_boolean (op->len[i] > op->keep));
      }
  if (json_object_get (res, "duration_ms") == NULL)
    json_object_set_new (res, "duration_ms",
                         json_integer ((json_int_t)((wr_now_ns () - op->t0) / 1000000)));
  wr_err_t err;
  _reset_stmt_ sqlite3_stmt *st
      = cached (op->t, &op->t->update,
                "UPDATE events SET result = ?, stdout = ?, stderr = ? WHERE seq = ?", &err);
  if (st == NULL)
    goto fail;
  bind_json (st, 1, res);
  for (int i = 0; i < 2; i++)
    {
      size_t n = evbuffer_get_length (op->out[i]);
      if (n)
        sqlite3_bind_blob64 (st, 2 + i, evbuffer_pullup (op->out[i], -1), n, SQLITE_STATIC);
    }
  sqlite3_bind_int64 (st, 4, op->seq);
  if (sqlite3_step (st) == SQLITE_DONE)
    return;
  db_err (op->t->db, &err, "result");
fail:
  wrd_log (WRD_LOG_ERROR, "%s", err.msg);
}

void
wrd_traj_op_done (struct wrd_traj_op *op, json_t *result)
{
  if (op == NULL)
    return;
  _cleanup_json_ json_t *res = json_deep_copy (result);
  static const char *const drop[]
      = { "stdout", "stderr", "stdout_encoding", "stderr_encoding", "path" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (drop); i++)
    json_object_del (res, drop[i]);
  if (!op->exec)
    json_object_set_new (res, "status", json_integer (op->status));
  op_finish (op, res);
  op_free (op);
}

void
wrd_traj_op_error (struct wrd_traj_op *op, const char *code, const char *message)
{
  if (op == NULL)
    return;
  _cleanup_json_ json_t *res = json_pack ("{s:{s:s,s:s},s:b}", "error", "code", code, "message",
                                          message, "infra_failure", wr_code_is_infra (code));
  op_finish (op, res);
  op_free (op);
}

/* ---- reading ---- */

static json_t *
event_json (sqlite3_stmt *st)
{
  /* seq, kind, at, step, request, result, stdout, stderr, replayed_from, rerun */
  json_t *ev
      = json_pack ("{s:I,s:s,s:f}", "seq", (json_int_t)sqlite3_column_int64 (st, 0), "kind",
                   (const char *)sqlite3_column_text (st, 1), "at", sqlite3_column_double (st, 2));
  const char *step = (const char *)sqlite3_column_text (st, 3);
  json_object_set_new (ev, "step", step ? json_string (step) : json_null ());
  json_object_set_new (ev, "request", column_json (st, 4));
  json_t *res = column_json (st, 5);
  if (json_is_object (res) && strcmp ((const char *)sqlite3_column_text (st, 1), "exec") == 0)
    {
      wrd_json_set_bytes (res, "stdout", sqlite3_column_blob (st, 6),
                          (size_t)sqlite3_column_bytes (st, 6));
      wrd_json_set_bytes (res, "stderr", sqlite3_column_blob (st, 7),
                          (size_t)sqlite3_column_bytes (st, 7));
    }
  json_object_set_new (ev, "result", res);
  if (sqlite3_column_type (st, 8) != SQLITE_NULL)
    {
      json_object_set_new (ev, "replayed_from", json_integer (sqlite3_column_int64 (st, 8)));
      json_object_set_new (ev, "rerun", column_json (st, 9));
    }
  return ev;
}

/* A sandbox's fork ancestry, root first, ending with itself: each link's
 * events up to seq upto (INT64_MAX for the sandbox itself) make its state. */
#define CHAIN_MAX 16
struct wr_chain
{
  struct
  {
    char id[65];
    int64_t upto;
  } link[CHAIN_MAX];
  size_t n;
};

static int
chain_load (struct wrd_traj *t, const char *id, struct wr_chain *ch, wr_err_t *err)
{
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (prepare (t, "SELECT parent, parent_seq FROM logs WHERE id = ?", &st, err) < 0)
    return -1;
  /* walked from the sandbox up, then reversed */
  char cur[65];
  int64_t upto = INT64_MAX;
  snprintf (cur, sizeof cur, "%s", id);
  ch->n = 0;
  for (;;)
    {
      if (ch->n == CHAIN_MAX)
        return wr_error (err, 0, WR_E_INVALID, "sandbox %s: forked more than %d generations deep",
                         id, CHAIN_MAX);
      snprintf (ch->link[ch->n].id, sizeof ch->link[ch->n].id, "%s", cur);
      ch->link[ch->n++].upto = upto;
      sqlite3_reset (st);
      sqlite3_bind_text (st, 1, cur, -1, SQLITE_TRANSIENT);
      if (sqlite3_step (st) != SQLITE_ROW || sqlite3_column_type (st, 0) == SQLITE_NULL)
        break;
      snprintf (cur, sizeof cur, "%s", (const char *)sqlite3_column_text (st, 0));
      upto = sqlite3_column_int64 (st, 1);
    }
  for (size_t a = 0, b = ch->n - 1; a < b; a++, b--)
    {
      __typeof__ (ch->link[0]) tmp = ch->link[a];
      ch->link[a] = ch->link[b];
      ch->link[b] = tmp;
    }
  return 0;
}

static int
log_json (struct wrd_traj *t, const char *id, json_t **ret, wr_err_t *err)
{
  _cleanup_stmt_ sqlite3_stmt *lg = NULL, *ev = NULL;
  if (prepare (t,
               "SELECT image, image_digest, backend, created_at, destroyed_at, replay_of FROM logs"
               " WHERE id = ?",
               &lg, err)
      < 0)
    return -1;
  sqlite3_bind_text (lg, 1, id, -1, SQLITE_STATIC);
  if (sqlite3_step (lg) != SQLITE_ROW)
    return wr_error (err, 0, WR_E_NOT_FOUND,
                     "sandbox %s: no trajectory log (never created here, or past retention)", id);
  json_t *j = json_pack (
      "{s:s,s:s,s:s,s:s,s:f}", "id", id, "image", (const char *)sqlite3_column_text (lg, 0),
      "image_digest", (const char *)sqlite3_column_text (lg, 1), "backend",
      (const char *)sqlite3_column_text (lg, 2), "created_at", sqlite3_column_double (lg, 3));
  bool gone = sqlite3_column_type (lg, 4) != SQLITE_NULL;
  json_object_set_new (j, "destroyed_at",
                       gone ? json_real (sqlite3_column_double (lg, 4)) : json_null ());
  json_object_set_new (j, "log_expires_at",
                       gone ? json_real (sqlite3_column_double (lg, 4) + t->retention_s)
                            : json_null ());
  const char *of = (const char *)sqlite3_column_text (lg, 5);
  json_object_set_new (j, "replay_of", of ? json_string (of) : json_null ());
  json_t *events = json_array ();
  json_object_set_new (j, "events", events);
  json_t *inherited = json_array ();
  json_object_set_new (j, "inherited", inherited);
  json_object_set_new (j, "forked_from", json_null ());
  if (prepare (t,
               "SELECT seq, kind, at, step, request, result, stdout, stderr, replayed_from, rerun"
               " FROM events WHERE sandbox = ?1 AND seq <= ?2 ORDER BY seq",
               &ev, err)
      < 0)
    {
      json_decref (j);
      return -1;
    }
  sqlite3_bind_text (ev, 1, id, -1, SQLITE_STATIC);
  sqlite3_bind_int64 (ev, 2, INT64_MAX);
  while (sqlite3_step (ev) == SQLITE_ROW)
    json_array_append_new (events, event_json (ev));
  /* Provenance: each ancestor's events up to its fork, oldest first. */
  struct wr_chain ch;
  if (chain_load (t, id, &ch, err) < 0)
    {
      json_decref (j);
      return -1;
    }
  if (ch.n > 1)
    json_object_set_new (j, "forked_from",
                         json_pack ("{s:s,s:I}", "id", ch.link[ch.n - 2].id, "seq",
                                    (json_int_t)ch.link[ch.n - 2].upto));
  for (size_t k = 0; k + 1 < ch.n; k++)
    {
      sqlite3_reset (ev);
      sqlite3_bind_text (ev, 1, ch.link[k].id, -1, SQLITE_TRANSIENT);
      sqlite3_bind_int64 (ev, 2, ch.link[k].upto);
      while (sqlite3_step (ev) == SQLITE_ROW)
        {
          json_t *e = event_json (ev);
          json_object_set_new (e, "sandbox", json_string (ch.link[k].id));
          json_array_append_new (inherited, e);
        }
    }
  *ret = j;
  return 0;
}

void
wrd_traj_http_log (struct wrd *d, struct evhttp_request *req, const char *id)
{
  wr_err_t err;
  json_t *j = NULL;
  if (d->traj == NULL)
    wrd_reply_error_code (req, WR_E_UNAVAILABLE, "the trajectory log is not open");
  else if (log_json (d->traj, id, &j, &err) < 0)
    wrd_reply_error (req, &err);
  else
    wrd_reply_json (req, 200, j);
}

/* ---- replay: a fresh sandbox fast-forwarded along the log ---- */

struct replay_event
{
  sqlite3_int64 seq;
  char kind[8];
  char *step, *hash, *request, *result;
  json_t *agent;
  void *input, *out[2];
  size_t input_len, out_len[2];
};

struct replay
{
  struct wrd *d;
  struct evhttp_request *req;
  char of[65];
  char *until;
  char image_digest[72];
  struct replay_event *ev;
  size_t n, next;
  size_t diverged;
  struct sandbox *sb;
  /* the event being re-run */
  struct wr_sha256 h[2];
  uint64_t len[2];
  /* events before first_live are in the checkpoint the replay starts from */
  size_t first_live, rerun;
  char checkpoint[160];
};

static char *
column_strdup (sqlite3_stmt *st, int i)
{
  const char *s = (const char *)sqlite3_column_text (st, i);
  return s ? strdup (s) : NULL;
}

static void *
column_memdup (sqlite3_stmt *st, int i, size_t *len)
{
  *len = (size_t)sqlite3_column_bytes (st, i);
  const void *p = sqlite3_column_blob (st, i);
  void *m = malloc (*len ? *len : 1);
  if (m && *len)
    memcpy (m, p, *len);
  return m;
}

static void
replay_free (struct replay *rp)
{
  for (size_t i = 0; i < rp->n; i++)
    {
      struct replay_event *e = &rp->ev[i];
      free (e->step);
      free (e->hash);
      free (e->request);
      free (e->result);
      json_decref (e->agent);
      free (e->input);
      free (e->out[0]);
      free (e->out[1]);
    }
  free (rp->ev);
  free (rp->until);
  free (rp);
}

/* Whether a checkpoint's image is still in the store as it was taken. */
static bool
checkpoint_usable (struct wrd *d, const char *kind, const json_t *res)
{
  /* failed, or (a checkpoint) never finished: warrend stopped meanwhile */
  if (json_object_get (res, "error")
      || (strcmp (kind, "checkpoint") == 0 && json_object_get (res, "digest") == NULL))
    return false;
  const char *ref = json_string_value (json_object_get (res, "image"));
  const char *digest = json_string_value (json_object_get (res, "digest"));
  struct wr_image *img = NULL;
  wr_err_t e;
  if (ref == NULL || wr_image_resolve (d->store, ref, &img, &e) < 0)
    return false;
  bool same = digest == NULL || strcmp (img->digest, digest) == 0;
  wr_image_free (img);
  return same;
}

/* The original's spec and its execs and file changes up to the step,
 * through its fork ancestry (a child's state starts as its parent's at the
 * fork). The replay starts from the latest usable checkpoint taken (or
 * restored) at or before the step: the events before it are copied, not
 * re-run. */
static int
replay_load (struct wrd *d, struct replay *rp, json_t **ret_spec, wr_err_t *err)
{
  struct wrd_traj *t = d->traj;
  _cleanup_stmt_ sqlite3_stmt *lg = NULL, *ev = NULL;
  struct wr_chain ch;
  if (chain_load (t, rp->of, &ch, err) < 0)
    return -1;
  if (prepare (t, "SELECT spec, image_digest FROM logs WHERE id = ?", &lg, err) < 0)
    return -1;
  sqlite3_bind_text (lg, 1, rp->of, -1, SQLITE_STATIC);
  if (sqlite3_step (lg) != SQLITE_ROW)
    return wr_error (err, 0, WR_E_NOT_FOUND,
                     "sandbox %s: no trajectory log (never created here, or past retention)",
                     rp->of);
  _cleanup_json_ json_t *spec = column_json (lg, 0);
  snprintf (rp->image_digest, sizeof rp->image_digest, "%s",
            (const char *)sqlite3_column_text (lg, 1));
  if (ch.n > 1)
    {
      /* a fork child's spec names the fork's snapshot, which is gone: start
       * from the root ancestor's image and layers */
      sqlite3_reset (lg);
      sqlite3_bind_text (lg, 1, ch.link[0].id, -1, SQLITE_TRANSIENT);
      if (sqlite3_step (lg) != SQLITE_ROW)
        return wr_error (err, 0, WR_E_NOT_FOUND, "sandbox %s was forked from %s, whose log is gone",
                         rp->of, ch.link[0].id);
      _cleanup_json_ json_t *root = column_json (lg, 0);
      json_object_set (spec, "image", json_object_get (root, "image"));
      json_object_set (spec, "layers", json_object_get (root, "layers"));
      snprintf (rp->image_digest, sizeof rp->image_digest, "%s",
                (const char *)sqlite3_column_text (lg, 1));
    }
  if (prepare (t,
               "SELECT seq, kind, step, request_hash, request, agent, input, result, stdout,"
               " stderr FROM events WHERE sandbox = ?1 AND seq <= ?2"
               " AND kind IN ('exec', 'file', 'checkpoint', 'restore')"
               " AND result IS NOT NULL ORDER BY seq",
               &ev, err)
      < 0)
    return -1;
  bool found = rp->until == NULL;
  ssize_t base = -1;                      /* the event the replay starts after */
  _cleanup_json_ json_t *base_res = NULL; /* its checkpoint */
  const char *lost = NULL;                /* a restore of a checkpoint that is gone */
  char lost_name[160] = "";
  for (size_t k = 0; k < ch.n && !(found && rp->until); k++)
    {
      sqlite3_reset (ev);
      sqlite3_bind_text (ev, 1, ch.link[k].id, -1, SQLITE_TRANSIENT);
      sqlite3_bind_int64 (ev, 2, ch.link[k].upto);
      while (!(found && rp->until) && sqlite3_step (ev) == SQLITE_ROW)
        {
          const char *kind = (const char *)sqlite3_column_text (ev, 1);
          if (strcmp (kind, "checkpoint") == 0 || strcmp (kind, "restore") == 0)
            {
              json_t *res = column_json (ev, 7);
              bool usable = checkpoint_usable (d, kind, res);
              if (usable)
                {
                  json_decref (base_res);
                  base_res = res;
                  base = (ssize_t)rp->n - 1;
                  lost = NULL;
                }
              else
                {
                  if (strcmp (kind, "restore") == 0)
                    {
                      snprintf (lost_name, sizeof lost_name, "%s",
                                json_string_value (json_object_get (res, "name")) ?: "?");
                      lost = lost_name;
                    }
                  json_decref (res);
                }
              continue;
            }
          struct replay_event *grown = realloc (rp->ev, (rp->n + 1) * sizeof *grown);
          if (grown == NULL)
            return wr_error (err, ENOMEM, WR_E_INTERNAL, "replay");
          rp->ev = grown;
          struct replay_event *e = &rp->ev[rp->n++];
          memset (e, 0, sizeof *e);
          e->seq = sqlite3_column_int64 (ev, 0);
          snprintf (e->kind, sizeof e->kind, "%s", kind);
          e->step = column_strdup (ev, 2);
          e->hash = column_strdup (ev, 3);
          e->request = column_strdup (ev, 4);
          e->agent = column_json (ev, 5);
          if (sqlite3_column_type (ev, 6) != SQLITE_NULL)
            e->input = column_memdup (ev, 6, &e->input_len);
          e->result = column_strdup (ev, 7);
          e->out[0] = column_memdup (ev, 8, &e->out_len[0]);
          e->out[1] = column_memdup (ev, 9, &e->out_len[1]);
          if (rp->until && e->step && strcmp (e->step, rp->until) == 0)
            found = true;
        }
    }
  if (!found)
    return wr_error (err, 0, WR_E_NOT_FOUND, "sandbox %s: no step \"%.200s\" in its log", rp->of,
                     rp->until);
  if (lost)
    return wr_error (err, 0, WR_E_CONFLICT,
                     "sandbox %s: its log restores checkpoint %s before that step, and the "
                     "checkpoint is gone (checkpoints go with their sandbox): the state after "
                     "the restore cannot be rebuilt",
                     rp->of, lost);
  rp->first_live = (size_t)(base + 1);
  if (base_res)
    {
      snprintf (rp->checkpoint, sizeof rp->checkpoint, "%s",
                json_string_value (json_object_get (base_res, "name")) ?: "");
      json_object_set (spec, "image", json_object_get (base_res, "image"));
      json_object_set_new (spec, "layers", json_array ());
      snprintf (rp->image_digest, sizeof rp->image_digest, "%s",
                json_string_value (json_object_get (base_res, "digest")) ?: "");
    }
  *ret_spec = json_incref (spec);
  return 0;
}

static void replay_next (struct replay *rp);

static void
replay_fail (struct replay *rp, const char *code, const char *message)
{
  char msg[700];
  snprintf (msg, sizeof msg, "replay of %s: %s", rp->of, message);
  if (rp->sb)
    {
      rp->sb->busy--;
      wrd_sandbox_destroy (rp->d, rp->sb, NULL);
    }
  wrd_reply_error_code (rp->req, code, msg);
  replay_free (rp);
}

/* Record the event in the new sandbox's log as the original's, so its
 * step answers with the recorded result; rerun says what running it again
 * gave. */
static void
replay_record (struct replay *rp, json_t *rerun)
{
  struct replay_event *e = &rp->ev[rp->next];
  struct wrd_traj *t = rp->d->traj;
  _cleanup_stmt_ sqlite3_stmt *st = NULL;
  if (prepare (t,
               "INSERT INTO events (sandbox, kind, at, step, request_hash, request, agent, input,"
               " result, stdout, stderr, replayed_from, rerun) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
               &st, NULL)
      < 0)
    return;
  sqlite3_bind_text (st, 1, rp->sb->id, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 2, e->kind, -1, SQLITE_STATIC);
  sqlite3_bind_double (st, 3, now_s ());
  sqlite3_bind_text (st, 4, e->step, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 5, e->hash, -1, SQLITE_STATIC);
  sqlite3_bind_text (st, 6, e->request, -1, SQLITE_STATIC);
  bind_json (st, 7, e->agent);
  if (e->input)
    sqlite3_bind_blob64 (st, 8, e->input, e->input_len, SQLITE_STATIC);
  sqlite3_bind_text (st, 9, e->result, -1, SQLITE_STATIC);
  for (int i = 0; i < 2; i++)
    if (e->out_len[i])
      sqlite3_bind_blob64 (st, 10 + i, e->out[i], e->out_len[i], SQLITE_STATIC);
  sqlite3_bind_int64 (st, 12, e->seq);
  bind_json (st, 13, rerun);
  if (sqlite3_step (st) != SQLITE_DONE)
    wrd_log (WRD_LOG_ERROR, "replay record: %s", sqlite3_errmsg (t->db));
}

static void
replay_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct replay *rp = ud;
  int i = type == WR_MSG_STDERR;
  wr_sha256_update (&rp->h[i], data, len);
  rp->len[i] += len;
}

static void
replay_on_done (void *ud, json_t *res)
{
  struct replay *rp = ud;
  struct replay_event *e = &rp->ev[rp->next];
  _cleanup_json_ json_t *rerun = json_object ();
  _cleanup_json_ json_t *was = e->result ? json_loads (e->result, 0, NULL) : NULL;
  bool same = true;
  if (strcmp (e->kind, "exec") == 0)
    {
      static const char *const names[2] = { "stdout", "stderr" };
      json_object_set (rerun, "exit_code", json_object_get (res, "exit_code"));
      same = json_equal (json_object_get (res, "exit_code"), json_object_get (was, "exit_code"));
      for (int i = 0; i < 2; i++)
        {
          uint8_t dg[32];
          char hex[65], key[64];
          wr_sha256_final (&rp->h[i], dg);
          wr_sha256_to_hex (dg, hex);
          snprintf (key, sizeof key, "%s_sha256", names[i]);
          json_object_set_new (rerun, key, json_string (hex));
          const char *had = json_string_value (json_object_get (was, key));
          same = same && had && strcmp (had, hex) == 0;
        }
    }
  json_object_set_new (rerun, "same", json_boolean (same));
  rp->diverged += !same;
  replay_record (rp, rerun);
  rp->next++;
  replay_next (rp);
}

static void
replay_on_error (void *ud, const char *code, const char *message)
{
  struct replay *rp = ud;
  /* the agent is gone: the sandbox is dead or being destroyed */
  rp->sb->busy--;
  rp->sb = NULL;
  replay_fail (rp, code, message);
}

static void
replay_next (struct replay *rp)
{
  static const struct agent_ops ops = { replay_on_data, replay_on_done, replay_on_error };
  struct sandbox *sb = rp->sb;
  if (rp->next == rp->n)
    {
      sb->busy--;
      _cleanup_stmt_ sqlite3_stmt *st = NULL;
      if (prepare (rp->d->traj, "UPDATE logs SET replay_of = ? WHERE id = ?", &st, NULL) == 0)
        {
          sqlite3_bind_text (st, 1, rp->of, -1, SQLITE_STATIC);
          sqlite3_bind_text (st, 2, sb->id, -1, SQLITE_STATIC);
          sqlite3_step (st);
        }
      json_t *j = wrd_sandbox_json (rp->d, sb, false);
      json_t *info = json_pack ("{s:s,s:I,s:I,s:b}", "of", rp->of, "events", (json_int_t)rp->n,
                                "diverged", (json_int_t)rp->diverged, "image_changed",
                                strcmp (rp->image_digest, sb->image_digest) != 0);
      json_object_set_new (info, "until", rp->until ? json_string (rp->until) : json_null ());
      json_object_set_new (info, "checkpoint",
                           rp->checkpoint[0] ? json_string (rp->checkpoint) : json_null ());
      json_object_set_new (info, "rerun", json_integer ((json_int_t)rp->rerun));
      json_object_set_new (j, "replay", info);
      json_object_set_new (j, "infra_failure", json_false ());
      wrd_reply_json (rp->req, 201, j);
      replay_free (rp);
      return;
    }
  struct replay_event *e = &rp->ev[rp->next];
  for (int i = 0; i < 2; i++)
    {
      wr_sha256_init (&rp->h[i]);
      rp->len[i] = 0;
    }
  bool exec = strcmp (e->kind, "exec") == 0;
  _cleanup_json_ json_t *was = e->result ? json_loads (e->result, 0, NULL) : NULL;
  if (rp->next < rp->first_live)
    {
      /* its effect is in the checkpoint the new sandbox starts from */
      json_t *from = json_pack ("{s:s}", "from_checkpoint", rp->checkpoint);
      replay_record (rp, from);
      json_decref (from);
      rp->next++;
      replay_next (rp);
      return;
    }
  if (json_object_get (was, "error"))
    {
      /* it never ran, or its outcome is unknown: recorded, not re-run */
      replay_record (rp, NULL);
      rp->next++;
      replay_next (rp);
      return;
    }
  rp->rerun++;
  if (!agent_conn_alive (sb->conn))
    {
      replay_on_error (rp, WR_E_GONE, "the new sandbox's agent is gone");
      return;
    }
  uint32_t sid = agent_request (sb->conn, exec ? WR_MSG_EXEC : WR_MSG_FILE, e->agent, &ops, rp);
  if (sid == 0)
    {
      replay_on_error (rp, WR_E_GONE, "the new sandbox's agent is gone");
      return;
    }
  /* the same frames the live request sent */
  if (exec && json_is_true (json_object_get (e->agent, "stdin")))
    {
      agent_send (sb->conn, sid, WR_MSG_STDIN, e->input ? e->input : "", e->input_len);
      agent_send (sb->conn, sid, WR_MSG_STDIN, "", 0);
    }
  else if (!exec && e->input)
    {
      agent_send (sb->conn, sid, WR_MSG_DATA, e->input, e->input_len);
      if (e->input_len)
        agent_send (sb->conn, sid, WR_MSG_DATA, "", 0);
    }
}

static void
replay_created (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct replay *rp = ud;
  if (sb == NULL)
    {
      replay_fail (rp, err->code ? err->code : WR_E_INTERNAL, err->msg);
      return;
    }
  rp->sb = sb;
  sb->busy++;
  replay_next (rp);
}

void
wrd_traj_http_replay (struct wrd *d, struct evhttp_request *req, const char *id)
{
  wr_err_t err;
  _cleanup_json_ json_t *body = NULL;
  if (d->traj == NULL)
    {
      wrd_reply_error_code (req, WR_E_UNAVAILABLE, "the trajectory log is not open");
      return;
    }
  if (wrd_read_json_body (req, false, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *until = json_object_get (body, "until");
  if (until && !json_is_null (until) && !json_is_string (until))
    {
      wrd_reply_error_code (req, WR_E_INVALID, "field \"until\" must be a step id (a string)");
      return;
    }
  struct replay *rp = calloc (1, sizeof *rp);
  if (rp == NULL)
    {
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  rp->d = d;
  rp->req = req;
  snprintf (rp->of, sizeof rp->of, "%s", id);
  if (json_is_string (until))
    rp->until = strdup (json_string_value (until));
  json_t *spec = NULL;
  if (replay_load (d, rp, &spec, &err) < 0)
    {
      wrd_reply_error (req, &err);
      replay_free (rp);
      return;
    }
  /* the original's create request, as it was normalised, without its
   * idempotency key (the node would answer the original sandbox) */
  json_t *labels = json_object_get (spec, "labels");
  if (json_is_object (labels))
    json_object_del (labels, "warren.idem");
  json_object_del (spec, "idempotency_key");
  int r = wrd_sandbox_create_async (d, spec, replay_created, rp, &err);
  json_decref (spec);
  if (r < 0)
    {
      wrd_reply_error (req, &err);
      replay_free (rp);
    }
}

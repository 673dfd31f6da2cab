/* The HTTP/JSON API (docs/api.md) on libevent's evhttp: routing, request
 * validation, exec (buffered or streamed NDJSON), files, images, pools. */
#include "daemon/daemon.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/queue.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <event2/util.h>

#include "common/b64.h"
#include "common/httpd.h"
#include "common/proto.h"
#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/http_util.h"
#include "daemon/fork.h"
#include "daemon/fncall.h"
#include "daemon/netsvc.h"
#include "daemon/trajlog.h"
#include "daemon/uploads.h"

#define JSON_BODY_MAX (1u << 20)
#define FILE_BODY_MAX (64u << 20)
#define DEFAULT_TIMEOUT_S 600
#define DEFAULT_CAP (1u << 20)
#define MAX_CAP (64u << 20)
/* A streamed exec holds its sandbox's agent while more than this waits for
 * the client. */
#define STREAM_QUEUE_MAX (4u << 20)

/* ---- replies ---- */

void
wrd_reply_json (struct evhttp_request *req, int status, json_t *j)
{
  struct evbuffer *b = evbuffer_new ();
  char *text = json_dumps (j, JSON_COMPACT);
  if (text)
    {
      evbuffer_add (b, text, strlen (text));
      evbuffer_add (b, "\n", 1);
      free (text);
    }
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, NULL, b);
  evbuffer_free (b);
  json_decref (j);
}

void
wrd_reply_error_code (struct evhttp_request *req, const char *code, const char *msg)
{
  /* whose failure it is, beside the error as the gateway puts it (err.c) */
  wrd_reply_json (req, wr_code_http_status (code),
                  json_pack ("{s:{s:s,s:s},s:b}", "error", "code", code, "message", msg,
                             "infra_failure", wr_code_is_infra (code)));
}

void
wrd_reply_error (struct evhttp_request *req, const wr_err_t *err)
{
  wrd_reply_error_code (req, err->code ? err->code : WR_E_INTERNAL, err->msg);
}

void
wrd_reply_empty (struct evhttp_request *req, int status)
{
  evhttp_send_reply (req, status, NULL, NULL);
}

/* Put bytes into a JSON object as text, or base64 with "<field>_encoding". */
void
wrd_json_set_bytes (json_t *o, const char *field, const void *data, size_t len)
{
  if (len == 0)
    {
      json_object_set_new (o, field, json_string (""));
      return;
    }
  if (wr_utf8_valid (data, len))
    {
      json_object_set_new (o, field, json_stringn (data, len));
      return;
    }
  char *enc = malloc (wr_b64_encoded_len (len) + 1);
  if (enc == NULL)
    return;
  wr_b64_encode (data, len, enc);
  json_object_set_new (o, field, json_string (enc));
  free (enc);
  char key[64];
  snprintf (key, sizeof key, "%s_encoding", field);
  json_object_set_new (o, key, json_string ("base64"));
}

int
wrd_read_json_body (struct evhttp_request *req, bool required, json_t **ret, wr_err_t *err)
{
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  size_t len = evbuffer_get_length (in);
  if (len > JSON_BODY_MAX)
    return wr_error (err, 0, WR_E_TOO_LARGE, "JSON body of %zu bytes is over the %u byte limit",
                     len, JSON_BODY_MAX);
  if (len == 0)
    {
      if (required)
        return wr_error (err, 0, WR_E_INVALID, "a JSON body is required");
      *ret = json_object ();
      return 0;
    }
  json_error_t jerr;
  json_t *j
      = json_loadb ((const char *)evbuffer_pullup (in, -1), len, JSON_REJECT_DUPLICATES, &jerr);
  if (j == NULL)
    return wr_error (err, 0, WR_E_INVALID, "malformed JSON at line %d column %d: %s", jerr.line,
                     jerr.column, jerr.text);
  if (!json_is_object (j))
    {
      json_decref (j);
      return wr_error (err, 0, WR_E_INVALID, "the JSON body must be an object");
    }
  *ret = j;
  return 0;
}

const char *
wrd_query_get (struct evkeyvalq *q, const char *key)
{
  return evhttp_find_header (q, key);
}

bool
wrd_query_flag (struct evkeyvalq *q, const char *key)
{
  const char *v = wrd_query_get (q, key);
  return v && (strcmp (v, "1") == 0 || strcmp (v, "true") == 0);
}

/* ---- exec ---- */

struct exec_ctx
{
  struct wrd *d;
  struct sandbox *sb;
  struct evhttp_request *req;
  struct evhttp_connection *evcon;
  bool stream;
  bool client_gone;
  struct evbuffer *out, *errb;
  size_t cap[2], got[2]; /* per stream (stdout, stderr): the request's caps */
  bool cut[2];           /* the daemon dropped bytes over a cap */
  bool holding;          /* holds the agent connection (agent_conn_hold) */
  uint32_t sid;
  uint64_t t0;
  struct event *hup_ev; /* watches the client socket for a hang-up */
  /* its trajectory log entry (trajlog.h) */
  struct wrd_traj_op *traj;
  /* buffered reply, produced piece by piece as the client reads */
  char *head; /* the result object without its closing brace */
  unsigned part;
  size_t off;
  const uint8_t *bytes[2];
  size_t len[2];
  bool text[2];
};

static void
exec_unwatch (struct exec_ctx *x)
{
  if (x->hup_ev)
    event_free (x->hup_ev);
  x->hup_ev = NULL;
}

static void
exec_release (struct exec_ctx *x)
{
  if (x->holding && x->sb)
    agent_conn_hold (x->sb->conn, false);
  x->holding = false;
}

static void
exec_ctx_free (struct exec_ctx *x)
{
  exec_release (x);
  exec_unwatch (x);
  wrd_traj_op_error (x->traj, WR_E_GONE, "the request ended without a result"); /* traj */
  if (x->evcon)
    evhttp_connection_set_closecb (x->evcon, NULL, NULL);
  if (x->sb)
    {
      x->sb->busy--;
      wrd_sandbox_touch (x->sb); /* idle-pause counts from here */
    }
  if (x->out)
    evbuffer_free (x->out);
  if (x->errb)
    evbuffer_free (x->errb);
  free (x->head);
  free (x);
}

/* Detach from the client connection before the reply's last byte: evhttp
 * may free the connection (and call its close callback) right away. */
static void
exec_detach (struct exec_ctx *x)
{
  if (x->evcon)
    evhttp_connection_set_closecb (x->evcon, NULL, NULL);
  x->evcon = NULL;
}

static void exec_stream_drained (struct evhttp_connection *evcon, void *arg);

/* One NDJSON line; evhttp calls exec_stream_drained whenever the client has
 * taken all queued lines. */
static void
stream_line (struct exec_ctx *x, json_t *j)
{
  char *text = json_dumps (j, JSON_COMPACT);
  json_decref (j);
  if (text == NULL)
    return;
  struct evbuffer *b = evbuffer_new ();
  evbuffer_add (b, text, strlen (text));
  evbuffer_add (b, "\n", 1);
  free (text);
  evhttp_send_reply_chunk_with_cb (x->req, b, exec_stream_drained, x);
  evbuffer_free (b);
}

/* evhttp's write callback: the client took everything queued. */
static void
exec_stream_drained (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  exec_release (arg);
}

/* A client that reads slower than the sandbox prints must not make the
 * daemon queue the difference: hold the agent until the client caught up. */
static void
exec_stream_backpressure (struct exec_ctx *x)
{
  if (x->holding || x->evcon == NULL)
    return;
  struct bufferevent *bev = evhttp_connection_get_bufferevent (x->evcon);
  size_t q = evbuffer_get_length (bufferevent_get_output (bev));
  if (q <= STREAM_QUEUE_MAX)
    return;
  x->holding = true; /* until exec_stream_drained */
  agent_conn_hold (x->sb->conn, true);
}

static void
exec_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct exec_ctx *x = ud;
  if (x->client_gone)
    return;
  /* The agent enforces the caps; the daemon does not rely on it. */
  int i = type == WR_MSG_STDERR;
  if (len > x->cap[i] - x->got[i])
    {
      len = x->cap[i] - x->got[i];
      x->cut[i] = true;
    }
  x->got[i] += len;
  wrd_traj_op_output (x->traj, i, data, len);
  if (len == 0)
    return;
  if (x->stream)
    {
      json_t *j = json_pack ("{s:s}", "stream", i ? "stderr" : "stdout");
      wrd_json_set_bytes (j, "data", data, len);
      stream_line (x, j);
      exec_stream_backpressure (x);
      return;
    }
  evbuffer_add (i ? x->errb : x->out, data, len);
}

/* JSON string escaping, done here so that a buffered reply never exists as
 * one escaped copy: a byte like 0x01 becomes six. */
static size_t
json_escaped_len (const uint8_t *p, size_t n)
{
  size_t len = 0;
  for (size_t i = 0; i < n; i++)
    len += p[i] == '"' || p[i] == '\\' || p[i] == '\n' || p[i] == '\r' || p[i] == '\t'
                   || p[i] == '\b' || p[i] == '\f'
               ? 2
           : p[i] < 0x20 ? 6
                         : 1;
  return len;
}

static void
json_escape_add (struct evbuffer *b, const uint8_t *p, size_t n)
{
  char out[6 * 1024 + 8];
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    {
      uint8_t c = p[i];
      const char *e = NULL;
      switch (c)
        {
        case '"':
          e = "\\\"";
          break;
        case '\\':
          e = "\\\\";
          break;
        case '\n':
          e = "\\n";
          break;
        case '\r':
          e = "\\r";
          break;
        case '\t':
          e = "\\t";
          break;
        case '\b':
          e = "\\b";
          break;
        case '\f':
          e = "\\f";
          break;
        default:
          break;
        }
      if (e)
        {
          out[k++] = e[0];
          out[k++] = e[1];
        }
      else if (c < 0x20)
        k += (size_t)snprintf (out + k, 7, "\\u%04x", c);
      else
        out[k++] = (char)c;
      if (k > sizeof out - 8)
        {
          evbuffer_add (b, out, k);
          k = 0;
        }
    }
  evbuffer_add (b, out, k);
}

static const char *const out_names[2] = { "stdout", "stderr" };
#define REPLY_PIECE (192u << 10) /* raw bytes per piece (a multiple of 3 for base64) */

static void exec_reply_more (struct evhttp_connection *evcon, void *arg);
static void exec_reply_end (struct evhttp_connection *evcon, void *arg);

/* The client went away in the middle of a buffered reply. */
static void
exec_reply_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct exec_ctx *x = arg;
  x->evcon = NULL;
  /* evhttp detached the unfinished request from the dying connection (or
   * frees it with the connection itself) */
  if (evhttp_request_get_connection (x->req) == NULL)
    evhttp_request_free (x->req);
  exec_ctx_free (x);
}

/* Send the next piece of a buffered reply: parts 0/1 are the stdout/stderr
 * fields, 2 the end. Called again (evhttp's write callback) when the client
 * has taken the previous piece, so the daemon holds the raw output plus one
 * escaped piece, whatever the output is. */
static void
exec_reply_more (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct exec_ctx *x = arg;
  struct evbuffer *b = evbuffer_new ();
  if (b == NULL)
    return;
  while (x->part < 2 && evbuffer_get_length (b) < REPLY_PIECE)
    {
      unsigned i = x->part;
      if (x->off == 0)
        evbuffer_add_printf (b, ",\"%s\":\"", out_names[i]);
      size_t n = x->len[i] - x->off < REPLY_PIECE ? x->len[i] - x->off : REPLY_PIECE;
      if (x->text[i])
        json_escape_add (b, x->bytes[i] + x->off, n);
      else if (n)
        {
          char *enc = malloc (wr_b64_encoded_len (n) + 1);
          if (enc == NULL)
            {
              evbuffer_free (b);
              return;
            }
          wr_b64_encode (x->bytes[i] + x->off, n, enc);
          evbuffer_add (b, enc, strlen (enc));
          free (enc);
        }
      x->off += n;
      if (x->off == x->len[i])
        {
          evbuffer_add (b, "\"", 1);
          if (!x->text[i])
            evbuffer_add_printf (b, ",\"%s_encoding\":\"base64\"", out_names[i]);
          x->part++;
          x->off = 0;
        }
    }
  if (x->part < 2)
    {
      evhttp_send_reply_chunk_with_cb (x->req, b, exec_reply_more, x);
      evbuffer_free (b);
      return;
    }
  evbuffer_add (b, "}\n", 2);
  evhttp_send_reply_chunk_with_cb (x->req, b, exec_reply_end, x);
  evbuffer_free (b);
}

/* The last piece reached the client: only now may evhttp close. */
static void
exec_reply_end (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct exec_ctx *x = arg;
  exec_detach (x);
  evhttp_send_reply_end (x->req);
  exec_ctx_free (x);
}

/* Reply with r (consumed) plus the buffered output. The length is known
 * up front, so this is a plain Content-Length reply, only written in
 * pieces. */
static void
exec_reply_buffered (struct exec_ctx *x, json_t *r)
{
  static const char *const drop[] = { "stdout", "stderr", "stdout_encoding", "stderr_encoding" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (drop); i++)
    json_object_del (r, drop[i]);
  char *text = json_dumps (r, JSON_COMPACT);
  json_decref (r);
  size_t hl = text ? strlen (text) : 0;
  if (hl < 2 || text[hl - 1] != '}')
    {
      free (text);
      exec_detach (x);
      wrd_reply_error_code (x->req, WR_E_INTERNAL, "cannot encode the exec result");
      exec_ctx_free (x);
      return;
    }
  text[--hl] = '\0';
  x->head = text;
  size_t total = hl + 2; /* "}\n" */
  struct evbuffer *bufs[2] = { x->out, x->errb };
  for (int i = 0; i < 2; i++)
    {
      x->len[i] = evbuffer_get_length (bufs[i]);
      x->bytes[i] = x->len[i] ? evbuffer_pullup (bufs[i], -1) : (const uint8_t *)"";
      x->text[i] = wr_utf8_valid (x->bytes[i], x->len[i]);
      total += strlen (out_names[i]) + 6; /* ,"stdout":"..." */
      if (x->text[i])
        total += json_escaped_len (x->bytes[i], x->len[i]);
      else
        total += wr_b64_encoded_len (x->len[i]) + strlen (out_names[i])
                 + strlen (",\"_encoding\":\"base64\"");
    }
  struct evkeyvalq *h = evhttp_request_get_output_headers (x->req);
  char cl[32];
  snprintf (cl, sizeof cl, "%zu", total);
  evhttp_add_header (h, "Content-Type", "application/json");
  evhttp_add_header (h, "Content-Length", cl);
  /* from here the reply owns x until its last piece or the client's close */
  evhttp_connection_set_closecb (x->evcon, exec_reply_closed, x);
  evhttp_send_reply_start (x->req, 200, "OK");
  struct evbuffer *b = evbuffer_new ();
  evbuffer_add (b, x->head, hl);
  evhttp_send_reply_chunk_with_cb (x->req, b, exec_reply_more, x);
  evbuffer_free (b);
}

static void
exec_on_done (void *ud, json_t *res)
{
  struct exec_ctx *x = ud;
  exec_unwatch (x);
  json_t *r = json_deep_copy (res);
  for (int i = 0; i < 2; i++)
    if (x->cut[i])
      json_object_set_new (r, i ? "stderr_truncated" : "stdout_truncated", json_true ());
  bool trunc = json_is_true (json_object_get (r, "stdout_truncated"))
               || json_is_true (json_object_get (r, "stderr_truncated"));
  json_object_set_new (r, "truncated", json_boolean (trunc));
  wrd_backend_exec_oom (x->d, x->sb, r);
  /* the command ran: whatever its exit, timeout or OOM, that is the task's */
  json_object_set_new (r, "infra_failure", json_false ());
  double secs = (double)(wr_now_ns () - x->t0) / 1e9;
  wrd_metrics_exec (x->d, secs, true);
  /* A command that could not start: say why where a shell user looks. */
  const char *why = json_string_value (json_object_get (r, "error"));
  if (why && evbuffer_get_length (x->errb) == 0)
    {
      if (x->stream)
        stream_line (x,
                     json_pack ("{s:s,s:s++}", "stream", "stderr", "data", "warren: ", why, "\n"));
      else
        evbuffer_add_printf (x->errb, "warren: %s\n", why);
    }
  wrd_traj_op_done (x->traj, r);
  x->traj = NULL;
  if (x->stream)
    {
      stream_line (x, r);
      exec_detach (x);
      evhttp_send_reply_end (x->req);
      exec_ctx_free (x);
    }
  else if (x->evcon == NULL)
    {
      /* the client is gone; replying frees the detached request */
      json_decref (r);
      wrd_reply_error_code (x->req, WR_E_GONE, "the client went away");
      exec_ctx_free (x);
    }
  else
    exec_reply_buffered (x, r);
}

static void
exec_on_error (void *ud, const char *code, const char *message)
{
  struct exec_ctx *x = ud;
  exec_unwatch (x);
  wrd_metrics_exec (x->d, (double)(wr_now_ns () - x->t0) / 1e9, false);
  wrd_traj_op_error (x->traj, code, message);
  x->traj = NULL;
  exec_detach (x);
  if (x->stream)
    {
      stream_line (x, json_pack ("{s:{s:s,s:s},s:b}", "error", "code", code, "message", message,
                                 "infra_failure", wr_code_is_infra (code)));
      evhttp_send_reply_end (x->req);
    }
  else
    wrd_reply_error_code (x->req, code, message);
  exec_ctx_free (x);
}

static void
exec_client_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct exec_ctx *x = arg;
  x->client_gone = true;
  x->evcon = NULL;
  exec_release (x);
  /* Nobody will read the output: stop the command. */
  if (x->sb && x->sb->conn && x->sid)
    agent_send (x->sb->conn, x->sid, WR_MSG_SIGNAL, "{\"signal\":9}", 12);
}

static void
exec_peer_cb (evutil_socket_t fd, short what WR_UNUSED, void *arg)
{
  struct exec_ctx *x = arg;
  char c;
  ssize_t n = recv (fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR)))
    {
      if (n > 0)
        exec_unwatch (x); /* a pipelined request: not a hang-up */
      return;
    }
  exec_unwatch (x);
  if (!x->client_gone && x->sb && x->sb->conn && x->sid)
    {
      x->client_gone = true;
      agent_send (x->sb->conn, x->sid, WR_MSG_SIGNAL, "{\"signal\":9}", 12);
    }
}

int
wrd_exec_env (struct sandbox *sb, json_t *req_env, json_t **ret, wr_err_t *err)
{
  json_t *env = json_array ();
  json_t *merged = json_object ();
  json_t *ienv = json_object_get (sb->img_conf, "env");
  size_t i;
  json_t *v;
  json_array_foreach (ienv, i, v)
  {
    const char *kv = json_string_value (v);
    const char *eq = kv ? strchr (kv, '=') : NULL;
    if (eq)
      {
        char key[257];
        snprintf (key, sizeof key, "%.*s", (int)(eq - kv), kv);
        json_object_set_new (merged, key, json_string (eq + 1));
      }
  }
  json_object_update (merged, json_object_get (sb->spec, "env"));
  if (req_env && !json_is_null (req_env))
    {
      if (!json_is_object (req_env))
        {
          json_decref (env);
          json_decref (merged);
          return wr_error (err, 0, WR_E_INVALID, "field \"env\" must be an object of strings");
        }
      const char *k;
      json_object_foreach (req_env, k, v)
      {
        if (!json_is_string (v) || k[0] == '\0' || strchr (k, '=') || strlen (k) > 256)
          {
            json_decref (env);
            json_decref (merged);
            return wr_error (err, 0, WR_E_INVALID, "field \"env\": bad entry \"%.64s\"", k);
          }
        json_object_set (merged, k, v);
      }
    }
  if (json_object_get (merged, "PATH") == NULL)
    json_object_set_new (merged, "PATH", json_string (WR_DEFAULT_PATH));
  if (json_object_get (merged, "HOME") == NULL)
    json_object_set_new (merged, "HOME", json_string ("/root"));
  const char *k;
  json_object_foreach (merged, k, v)
  {
    char *kv;
    if (asprintf (&kv, "%s=%s", k, json_string_value (v)) >= 0)
      {
        json_array_append_new (env, json_string (kv));
        free (kv);
      }
  }
  json_decref (merged);
  *ret = env;
  return 0;
}

/* Validate an exec request and turn it into the agent's EXEC body. Also
 * returns the decoded stdin (malloc'd) when there is one. */
static int
parse_exec (struct sandbox *sb, json_t *req, json_t **ret, char **ret_stdin, size_t *ret_stdin_len,
            wr_err_t *err)
{
  json_t *cmd = json_object_get (req, "cmd"), *shell = json_object_get (req, "shell");
  if (cmd && json_is_null (cmd))
    cmd = NULL;
  if (shell && json_is_null (shell))
    shell = NULL;
  if ((cmd == NULL) == (shell == NULL))
    return wr_error (err, 0, WR_E_INVALID, "exactly one of \"cmd\" or \"shell\" is required");
  json_t *a = json_object ();
  if (cmd)
    {
      if (!json_is_array (cmd) || json_array_size (cmd) == 0 || json_array_size (cmd) > 65536)
        {
          json_decref (a);
          return wr_error (err, 0, WR_E_INVALID,
                           "field \"cmd\" must be a non-empty array of strings");
        }
      size_t i;
      json_t *v;
      json_array_foreach (cmd, i,
                          v) if (!json_is_string (v)
                                 || json_string_length (v) != strlen (json_string_value (v)))
      {
        json_decref (a);
        return wr_error (err, 0, WR_E_INVALID, "field \"cmd\"[%zu] must be a string without NUL",
                         i);
      }
      json_object_set (a, "cmd", cmd);
    }
  else
    {
      if (!json_is_string (shell)
          || json_string_length (shell) != strlen (json_string_value (shell)))
        {
          json_decref (a);
          return wr_error (err, 0, WR_E_INVALID, "field \"shell\" must be a string without NUL");
        }
      json_object_set (a, "shell", shell);
    }
  json_t *env = NULL;
  if (wrd_exec_env (sb, json_object_get (req, "env"), &env, err) < 0)
    {
      json_decref (a);
      return -EINVAL;
    }
  json_object_set_new (a, "env", env);
  json_t *cwd = json_object_get (req, "cwd");
  const char *wd = json_string_value (json_object_get (sb->img_conf, "workdir"));
  if (cwd && !json_is_null (cwd))
    {
      if (!json_is_string (cwd) || json_string_value (cwd)[0] != '/'
          || json_string_length (cwd) > 4096)
        {
          json_decref (a);
          return wr_error (err, 0, WR_E_INVALID, "field \"cwd\" must be an absolute path");
        }
      wd = json_string_value (cwd);
    }
  json_object_set_new (a, "cwd", json_string (wd && wd[0] == '/' ? wd : "/"));
  double timeout = DEFAULT_TIMEOUT_S;
  json_t *t = json_object_get (req, "timeout_s");
  if (t && !json_is_null (t))
    {
      if (!json_is_number (t) || json_number_value (t) <= 0 || json_number_value (t) > 86400)
        {
          json_decref (a);
          return wr_error (err, 0, WR_E_INVALID, "field \"timeout_s\" must be in (0, 86400]");
        }
      timeout = json_number_value (t);
    }
  json_object_set_new (a, "timeout_ms", json_integer ((json_int_t)(timeout * 1000)));
  static const char *caps[] = { "stdout_cap", "stderr_cap" };
  for (size_t i = 0; i < 2; i++)
    {
      json_t *c = json_object_get (req, caps[i]);
      json_int_t v = DEFAULT_CAP;
      if (c && !json_is_null (c))
        {
          if (!json_is_integer (c) || json_integer_value (c) < 0
              || json_integer_value (c) > MAX_CAP)
            {
              json_decref (a);
              return wr_error (err, 0, WR_E_INVALID, "field \"%s\" must be in [0, %u]", caps[i],
                               MAX_CAP);
            }
          v = json_integer_value (c);
        }
      json_object_set_new (a, caps[i], json_integer (v));
    }
  json_t *in = json_object_get (req, "stdin");
  *ret_stdin = NULL;
  *ret_stdin_len = 0;
  if (in && !json_is_null (in))
    {
      if (!json_is_string (in))
        {
          json_decref (a);
          return wr_error (err, 0, WR_E_INVALID, "field \"stdin\" must be a string");
        }
      const char *enc = json_string_value (json_object_get (req, "stdin_encoding"));
      size_t n = json_string_length (in);
      char *buf = malloc (n + 4);
      if (enc && strcmp (enc, "base64") == 0)
        {
          long m = wr_b64_decode (json_string_value (in), n, buf);
          if (m < 0)
            {
              free (buf);
              json_decref (a);
              return wr_error (err, 0, WR_E_INVALID, "field \"stdin\" is not valid base64");
            }
          n = (size_t)m;
        }
      else
        memcpy (buf, json_string_value (in), n);
      *ret_stdin = buf;
      *ret_stdin_len = n;
      json_object_set_new (a, "stdin", json_true ());
    }
  *ret = a;
  return 0;
}

static int
sandbox_usable (struct sandbox *sb, wr_err_t *err)
{
  if (sb->state == SB_DEAD || !agent_conn_alive (sb->conn))
    return wr_error (err, 0, WR_E_GONE, "sandbox %s is dead (%s); delete it", sb->id,
                     wrd_sandbox_dead_reason (sb));
  /* paused (by hand, a job or idle-pause): resumed first, transparently */
  return wrd_sandbox_wake (sb->d, sb, err);
}

static void
handle_exec (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, struct evkeyvalq *q)
{
  wr_err_t err;
  json_t *body = NULL, *areq = NULL;
  if (sandbox_usable (sb, &err) < 0 || wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  char *in = NULL;
  size_t in_len = 0;
  if (parse_exec (sb, body, &areq, &in, &in_len, &err) < 0)
    {
      json_decref (body);
      wrd_reply_error (req, &err);
      return;
    }
  json_t *sv = json_object_get (body, "stream");
  if (sv && !json_is_null (sv) && !json_is_boolean (sv))
    {
      json_decref (body);
      json_decref (areq);
      free (in);
      wrd_reply_error_code (req, WR_E_INVALID, "field \"stream\" must be a boolean");
      return;
    }
  bool stream = json_is_true (sv) || wrd_query_flag (q, "stream");
  struct wrd_traj_op *traj = NULL;
  if (wrd_traj_exec_begin (d, sb, req, body, areq, in, in_len, stream, &traj) != 0)
    {
      json_decref (body); /* traj: a recorded step, answered */
      json_decref (areq);
      free (in);
      return;
    }
  struct exec_ctx *x = calloc (1, sizeof *x);
  x->d = d;
  x->sb = sb;
  x->req = req;
  x->traj = traj;
  x->stream = stream;
  x->out = evbuffer_new ();
  x->errb = evbuffer_new ();
  x->t0 = wr_now_ns ();
  x->cap[0] = (size_t)json_integer_value (json_object_get (areq, "stdout_cap"));
  x->cap[1] = (size_t)json_integer_value (json_object_get (areq, "stderr_cap"));
  /* one block per stream, so the reply reads it in place (pages are only
   * touched as output arrives) */
  if (!x->stream)
    {
      if (x->cap[0])
        evbuffer_expand (x->out, x->cap[0]);
      if (x->cap[1])
        evbuffer_expand (x->errb, x->cap[1]);
    }
  json_decref (body);
  sb->busy++;
  d->m.execs++;
  static const struct agent_ops ops = { exec_on_data, exec_on_done, exec_on_error };
  /* agent_conn closes an agent that sends more than both caps */
  x->sid = agent_request (sb->conn, WR_MSG_EXEC, areq, &ops, x);
  json_decref (areq);
  if (x->sid == 0)
    {
      free (in);
      exec_on_error (x, WR_E_GONE, "the sandbox agent is gone");
      return;
    }
  if (in)
    {
      agent_send (sb->conn, x->sid, WR_MSG_STDIN, in, in_len);
      agent_send (sb->conn, x->sid, WR_MSG_STDIN, "", 0);
      free (in);
    }
  x->evcon = evhttp_request_get_connection (req);
  evhttp_connection_set_closecb (x->evcon, exec_client_closed, x);
  /* evhttp does not read from a connection while its request is being
   * served, so it would not notice a client that gave up on a long exec:
   * watch the socket ourselves. */
  int cfd = bufferevent_getfd (evhttp_connection_get_bufferevent (x->evcon));
  if (cfd >= 0)
    {
      x->hup_ev = event_new (d->base, cfd, EV_READ, exec_peer_cb, x);
      if (x->hup_ev)
        event_add (x->hup_ev, NULL);
    }
  if (x->stream)
    {
      evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                         "application/x-ndjson");
      evhttp_send_reply_start (req, 200, "OK");
    }
}

/* ---- files ---- */

struct file_ctx
{
  struct wrd *d;
  struct sandbox *sb;
  struct evhttp_request *req;
  struct evbuffer *data;
  int op_status; /* HTTP status on success */
  bool raw;      /* reply with the bytes instead of the JSON result */
  char path[4100];
  struct wrd_traj_op *traj; /* changes are logged (trajlog.h) */
};

static void
file_ctx_free (struct file_ctx *f)
{
  if (f->sb)
    {
      f->sb->busy--;
      wrd_sandbox_touch (f->sb);
    }
  wrd_traj_op_error (f->traj, WR_E_GONE, "the request ended without a result"); /* traj */
  if (f->data)
    evbuffer_free (f->data);
  free (f);
}

static void
file_on_data (void *ud, uint8_t type WR_UNUSED, const uint8_t *data, size_t len)
{
  struct file_ctx *f = ud;
  evbuffer_add (f->data, data, len);
}

static void
file_on_done (void *ud, json_t *res)
{
  struct file_ctx *f = ud;
  wrd_traj_op_done (f->traj, res);
  f->traj = NULL;
  if (f->raw)
    {
      evhttp_add_header (evhttp_request_get_output_headers (f->req), "Content-Type",
                         "application/octet-stream");
      evhttp_send_reply (f->req, 200, "OK", f->data);
    }
  else if (f->op_status == 204)
    wrd_reply_empty (f->req, 204);
  else
    {
      json_t *r = json_deep_copy (res);
      if (f->op_status == 201)
        json_object_set_new (r, "path", json_string (f->path));
      json_object_set_new (r, "infra_failure", json_false ());
      wrd_reply_json (f->req, f->op_status, r);
    }
  file_ctx_free (f);
}

static void
file_on_error (void *ud, const char *code, const char *message)
{
  struct file_ctx *f = ud;
  char msg[600];
  snprintf (msg, sizeof msg, "%s: %s", f->path, message);
  wrd_traj_op_error (f->traj, code, msg);
  f->traj = NULL;
  wrd_reply_error_code (f->req, code, msg);
  file_ctx_free (f);
}

static void
handle_files (struct wrd *d, struct evhttp_request *req, struct sandbox *sb, struct evkeyvalq *q)
{
  wr_err_t err;
  if (sandbox_usable (sb, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  const char *path = wrd_query_get (q, "path");
  if (path == NULL || path[0] != '/' || strlen (path) > 4096)
    {
      wrd_reply_error_code (req, WR_E_INVALID, "query parameter \"path\" must be an absolute path");
      return;
    }
  const char *op = wrd_query_get (q, "op");
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  json_t *body = json_pack ("{s:s}", "path", path);
  struct file_ctx *f = calloc (1, sizeof *f);
  f->d = d;
  f->req = req; /* f->sb only once it counts in sb->busy (file_ctx_free) */
  f->data = evbuffer_new ();
  f->op_status = 200;
  snprintf (f->path, sizeof f->path, "%s", path);
  struct evbuffer *upload = NULL;
  if (m == EVHTTP_REQ_GET && (op == NULL || strcmp (op, "read") == 0))
    {
      json_object_set_new (body, "op", json_string ("read"));
      json_object_set_new (body, "max_bytes", json_integer (FILE_BODY_MAX));
      f->raw = true;
    }
  else if (m == EVHTTP_REQ_GET && (strcmp (op, "stat") == 0 || strcmp (op, "list") == 0))
    json_object_set_new (body, "op", json_string (op));
  else if (m == EVHTTP_REQ_PUT)
    {
      long mode = 0644;
      const char *ms = wrd_query_get (q, "mode");
      if (ms)
        {
          char *end;
          mode = strtol (ms, &end, 8);
          if (*end || mode < 0 || mode > 07777)
            {
              json_decref (body);
              file_ctx_free (f);
              wrd_reply_error_code (req, WR_E_INVALID, "query parameter \"mode\" must be octal");
              return;
            }
        }
      json_object_set_new (body, "op", json_string ("write"));
      /* without ?mode= an existing file keeps its mode (new files get 0644) */
      if (ms)
        json_object_set_new (body, "mode", json_integer (mode));
      json_object_set_new (body, "append", json_boolean (wrd_query_flag (q, "append")));
      upload = evhttp_request_get_input_buffer (req);
      f->op_status = 201;
    }
  else if (m == EVHTTP_REQ_POST && op && strcmp (op, "mkdir") == 0)
    {
      json_object_set_new (body, "op", json_string ("mkdir"));
      json_object_set_new (body, "parents", json_boolean (wrd_query_flag (q, "parents")));
      json_object_set_new (body, "mode", json_integer (0755));
      f->op_status = 201;
    }
  else if (m == EVHTTP_REQ_DELETE)
    {
      json_object_set_new (body, "op", json_string ("remove"));
      json_object_set_new (body, "recursive", json_boolean (wrd_query_flag (q, "recursive")));
      f->op_status = 204;
    }
  else
    {
      json_decref (body);
      file_ctx_free (f);
      wrd_reply_error_code (req, WR_E_INVALID, "unsupported file operation");
      return;
    }
  /* changes are logged; a repeated ?step= answers from the log */
  if (f->op_status != 200
      && wrd_traj_file_begin (d, sb, req, body, wrd_query_get (q, "step"), upload, f->op_status,
                              &f->traj)
             != 0)
    {
      json_decref (body); /* traj: answered from the log */
      file_ctx_free (f);
      return;
    }
  f->sb = sb;
  sb->busy++;
  d->m.files++;
  static const struct agent_ops ops = { file_on_data, file_on_done, file_on_error };
  uint32_t sid = agent_request (sb->conn, WR_MSG_FILE, body, &ops, f);
  json_decref (body);
  if (sid == 0)
    {
      file_on_error (f, WR_E_GONE, "the sandbox agent is gone");
      return;
    }
  if (upload)
    {
      size_t n = evbuffer_get_length (upload);
      agent_send (sb->conn, sid, WR_MSG_DATA, n ? evbuffer_pullup (upload, -1) : (const void *)"",
                  n);
      if (n)
        agent_send (sb->conn, sid, WR_MSG_DATA, "", 0);
    }
}

bool
wrd_http_host_paths_allowed (struct wrd *d, struct evhttp_request *req)
{
  return d->http.allow_host_paths || !wr_httpd_owns (d->tcp, req);
}

void
wrd_reply_host_path_refused (struct evhttp_request *req, const char *field)
{
  char msg[256];
  snprintf (msg, sizeof msg,
            "field \"%s\" names a path on the daemon's host: only clients of the owner-only unix "
            "socket may do that (or start warrend with --allow-host-paths)",
            field);
  wrd_reply_json (req, 403,
                  json_pack ("{s:{s:s,s:s}}", "error", "code", WRD_E_FORBIDDEN, "message", msg));
}

/* Import and build read host paths as root: not for TCP clients. */
static bool
host_path_refused (struct wrd *d, struct evhttp_request *req, const char *path)
{
  const char *field = NULL;
  if (strcmp (path, "/v1/images/import") == 0)
    field = "path";
  else if (strcmp (path, "/v1/images/build") == 0)
    field = "context";
  if (field == NULL || evhttp_request_get_command (req) != EVHTTP_REQ_POST
      || wrd_http_host_paths_allowed (d, req))
    return false;
  json_t *body = NULL;
  if (wrd_read_json_body (req, false, &body, NULL) < 0)
    return false; /* the route reports the malformed body */
  json_t *v = json_object_get (body, field);
  bool named = v && !json_is_null (v);
  json_decref (body);
  if (named)
    wrd_reply_host_path_refused (req, field);
  return named;
}

/* ---- routing ---- */

static bool
token_ok (struct wrd *d, struct evhttp_request *req)
{
  const char *h = evhttp_find_header (evhttp_request_get_input_headers (req), "Authorization");
  return h && wr_bearer_matches (h, strlen (h), d->token);
}

static void
create_done (struct wrd *d, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct evhttp_request *req = ud;
  if (sb == NULL)
    wrd_reply_error (req, err);
  else
    {
      json_t *j = wrd_sandbox_json (d, sb, false);
      json_object_set_new (j, "infra_failure", json_false ());
      wrd_reply_json (req, 201, j);
    }
}

/* A pause answers when its reclaim (on a worker) ended, with what it gave
 * back; the loop serves other requests meanwhile. */
struct pause_reply
{
  struct evhttp_request *req; /* NULL once the client went away */
  struct evhttp_connection *evcon;
};

static void
pause_reply_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  ((struct pause_reply *)arg)->req = NULL;
}

static void
pause_reply_send (struct wrd *d, struct sandbox *sb, void *arg)
{
  struct pause_reply *p = arg;
  if (p->req)
    {
      evhttp_connection_set_closecb (p->evcon, NULL, NULL);
      if (sb)
        wrd_reply_json (p->req, 200, wrd_sandbox_json (d, sb, false));
      else
        wrd_reply_error_code (p->req, WR_E_GONE, "the sandbox was destroyed while it paused");
    }
  free (p);
}

static bool
pause_reply_later (struct wrd *d WR_UNUSED, struct evhttp_request *req, struct sandbox *sb)
{
  struct pause_reply *p = calloc (1, sizeof *p);
  if (p == NULL)
    return false;
  p->req = req;
  p->evcon = evhttp_request_get_connection (req);
  if (wrd_sandbox_reclaim_wait (sb, pause_reply_send, p) == 0)
    {
      free (p);
      return false;
    }
  evhttp_connection_set_closecb (p->evcon, pause_reply_closed, p);
  return true;
}

static void
handle_sandboxes (struct wrd *d, struct evhttp_request *req, const char *rest, struct evkeyvalq *q)
{
  wr_err_t err;
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (rest == NULL)
    {
      if (m == EVHTTP_REQ_POST)
        {
          json_t *body;
          if (wrd_read_json_body (req, false, &body, &err) < 0)
            {
              wrd_reply_error (req, &err);
              return;
            }
          /* the header's key, as the body's: creates are deduplicated by it */
          const char *key
              = evhttp_find_header (evhttp_request_get_input_headers (req), "Idempotency-Key");
          if (key && json_is_object (body) && !json_object_get (body, "idempotency_key"))
            json_object_set_new (body, "idempotency_key", json_string (key));
          int r = wrd_sandbox_create_async (d, body, create_done, req, &err);
          json_decref (body);
          if (r < 0)
            wrd_reply_error (req, &err);
          return;
        }
      if (m == EVHTTP_REQ_GET)
        {
          json_t *a = json_array ();
          for (size_t i = 0; i < d->table_size; i++)
            for (struct sandbox *s = d->table[i]; s; s = s->hnext)
              if (s->state != SB_POOLED)
                json_array_append_new (a, wrd_sandbox_json (d, s, false));
          wrd_reply_json (req, 200, json_pack ("{s:o}", "sandboxes", a));
          return;
        }
      wrd_reply_error_code (req, WR_E_INVALID, "method not allowed");
      return;
    }
  const char *slash = strchr (rest, '/');
  size_t idlen = slash ? (size_t)(slash - rest) : strlen (rest);
  char id[65];
  if (!wr_id_valid (rest, idlen))
    {
      wrd_reply_error_code (req, WR_E_NOT_FOUND, "malformed sandbox id");
      return;
    }
  memcpy (id, rest, idlen);
  id[idlen] = '\0';
  /* the trajectory log outlives its sandbox (trajlog.h) */
  if (slash && strcmp (slash + 1, "log") == 0 && m == EVHTTP_REQ_GET)
    {
      wrd_traj_http_log (d, req, id);
      return;
    }
  if (slash && strcmp (slash + 1, "replay") == 0 && m == EVHTTP_REQ_POST)
    {
      wrd_traj_http_replay (d, req, id);
      return;
    }
  struct sandbox *sb = wrd_sandbox_find (d, id);
  if (sb == NULL || sb->state == SB_POOLED)
    {
      char msg[128];
      snprintf (msg, sizeof msg, "sandbox %s: no such sandbox", id);
      wrd_reply_error_code (req, WR_E_NOT_FOUND, msg);
      return;
    }
  const char *sub = slash ? slash + 1 : "";
  if (*sub == '\0')
    {
      if (m == EVHTTP_REQ_GET)
        wrd_reply_json (req, 200, wrd_sandbox_json (d, sb, true));
      else if (m == EVHTTP_REQ_DELETE)
        {
          if (wrd_sandbox_destroy (d, sb, &err) < 0)
            wrd_reply_error (req, &err);
          else
            wrd_reply_empty (req, 204);
        }
      else if (m == EVHTTP_REQ_PATCH)
        wrd_http_net_patch (d, req, sb); /* {"network": ...}: docs/network.md */
      else
        wrd_reply_error_code (req, WR_E_INVALID, "method not allowed");
      return;
    }
  if (strncmp (sub, "proxy/", 6) == 0)
    wrd_http_net_proxy (d, req, sb, sub + 6);
  else if (strcmp (sub, "exec") == 0 && m == EVHTTP_REQ_POST)
    handle_exec (d, req, sb, q);
  else if (strcmp (sub, "files") == 0)
    handle_files (d, req, sb, q);
  else if (strcmp (sub, "pack") == 0 && m == EVHTTP_REQ_POST)
    wrd_http_pack (d, req, sb);
  else if (wrd_http_fork_routes (d, req, sb, sub, q))
    ; /* fork, checkpoints, restore, diff (fork.c) */
  else if ((strcmp (sub, "pause") == 0 || strcmp (sub, "resume") == 0) && m == EVHTTP_REQ_POST)
    {
      bool pause = strcmp (sub, "pause") == 0;
      if (wrd_sandbox_pause (d, sb, pause, &err) < 0)
        wrd_reply_error (req, &err);
      else if (!pause || !pause_reply_later (d, req, sb))
        wrd_reply_json (req, 200, wrd_sandbox_json (d, sb, false));
    }
  else
    wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

static void
handle_pools (struct wrd *d, struct evhttp_request *req, const char *rest)
{
  wr_err_t err;
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (rest == NULL && m == EVHTTP_REQ_GET)
    {
      wrd_reply_json (req, 200, wrd_pools_json (d));
      return;
    }
  if (rest && m == EVHTTP_REQ_PUT)
    {
      json_t *body;
      if (wrd_read_json_body (req, true, &body, &err) < 0)
        {
          wrd_reply_error (req, &err);
          return;
        }
      json_t *size = json_object_get (body, "size");
      char *ref = evhttp_uridecode (rest, 0, NULL);
      if (!json_is_integer (size) || json_integer_value (size) < 0)
        wrd_reply_error_code (req, WR_E_INVALID, "field \"size\" must be a non-negative integer");
      else if (!wr_ref_valid (ref))
        wrd_reply_error_code (req, WR_E_INVALID, "malformed image reference");
      else if (wrd_pool_set (d, ref, (unsigned)json_integer_value (size), &err) < 0)
        wrd_reply_error (req, &err);
      else
        wrd_reply_json (req, 200, wrd_pools_json (d));
      free (ref);
      json_decref (body);
      return;
    }
  wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

static void
route (struct evhttp_request *req, void *arg, bool tcp)
{
  struct wrd *d = arg;
  d->m.http_requests++;
  if (tcp && !token_ok (d, req))
    {
      wrd_reply_error_code (req, WR_E_UNAUTHORIZED, "a valid bearer token is required");
      return;
    }
  if (d->stopping)
    {
      wrd_reply_error_code (req, WR_E_UNAVAILABLE, "warrend is shutting down");
      return;
    }
  const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri (req);
  const char *path = evhttp_uri_get_path (uri);
  struct evkeyvalq q = { 0 };
  TAILQ_INIT (&q);
  const char *qs = evhttp_uri_get_query (uri);
  if (qs && evhttp_parse_query_str (qs, &q) < 0)
    {
      wrd_reply_error_code (req, WR_E_INVALID, "malformed query string");
      return;
    }
  if (path == NULL)
    path = "/";
  if (tcp && host_path_refused (d, req, path))
    ;
  else if (strcmp (path, "/healthz") == 0)
    wrd_reply_json (req, 200,
                    json_pack ("{s:s,s:I,s:s}", "status", "ok", "sandboxes", (json_int_t)d->count,
                               "version", WARREN_VERSION));
  else if (strcmp (path, "/metrics") == 0)
    {
      char *text = wrd_metrics_text (d);
      struct evbuffer *b = evbuffer_new ();
      evbuffer_add (b, text, strlen (text));
      free (text);
      evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                         "text/plain; version=0.0.4");
      evhttp_send_reply (req, 200, "OK", b);
      evbuffer_free (b);
    }
  else if (strcmp (path, "/v1/sandboxes") == 0)
    handle_sandboxes (d, req, NULL, &q);
  else if (strncmp (path, "/v1/sandboxes/", 14) == 0)
    handle_sandboxes (d, req, path + 14, &q);
  else if (strcmp (path, "/v1/images") == 0)
    wrd_http_images (d, req, NULL, &q);
  else if (strncmp (path, "/v1/images/", 11) == 0)
    wrd_http_images (d, req, path + 11, &q);
  else if (strncmp (path, "/v1/uploads", 11) == 0 && (path[11] == '\0' || path[11] == '/'))
    wrd_http_uploads (d, req, path[11] ? path + 12 : NULL, &q);
  else if (strcmp (path, "/v1/calls") == 0)
    wrd_fncall_http_calls (d, req);
  else if (strcmp (path, "/v1/fncall/pools") == 0)
    wrd_fncall_http_pools (d, req);
  else if (strcmp (path, "/v1/net/services") == 0)
    wrd_http_net_services (d, req, NULL);
  else if (strncmp (path, "/v1/net/services/", 17) == 0)
    wrd_http_net_services (d, req, path + 17);
  else if (strcmp (path, "/v1/pools") == 0)
    handle_pools (d, req, NULL);
  else if (strncmp (path, "/v1/pools/", 10) == 0)
    handle_pools (d, req, path + 10);
  else
    wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
  evhttp_clear_headers (&q);
}

static void
route_unix (struct evhttp_request *req, void *arg)
{
  route (req, arg, false);
}

static void
route_tcp (struct evhttp_request *req, void *arg)
{
  route (req, arg, true);
}

static void
refused_tcp (struct evhttp_request *req, int status WR_UNUSED, const char *code, const char *msg,
             void *arg)
{
  struct wrd *d = arg;
  d->m.http_requests++;
  wrd_reply_error_code (req, code, msg);
}

static bool
authorized_tcp (void *arg, const char *value, size_t len)
{
  struct wrd *d = arg;
  return wr_bearer_matches (value, len, d->token);
}

static struct evhttp *
http_new_unix (struct wrd *d)
{
  struct evhttp *h = evhttp_new (d->base);
  evhttp_set_gencb (h, route_unix, d);
  evhttp_set_max_body_size (h, FILE_BODY_MAX + 4096);
  evhttp_set_max_headers_size (h, 64 * 1024);
  evhttp_set_allowed_methods (h, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_PUT
                                     | EVHTTP_REQ_DELETE | EVHTTP_REQ_HEAD | EVHTTP_REQ_PATCH);
  evhttp_set_timeout (h, 3600); /* a backstop against dead peers */
  return h;
}

int
wrd_http_listen (struct wrd *d, const char *spec, wr_err_t *err)
{
  if (strncmp (spec, "unix:", 5) == 0)
    {
      const char *path = spec + 5;
      struct sockaddr_un sa = { .sun_family = AF_UNIX };
      if (strlen (path) >= sizeof sa.sun_path)
        return wr_error (err, ENAMETOOLONG, WR_E_INVALID, "socket path %s", path);
      strcpy (sa.sun_path, path);
      int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0)
        return wr_sys_error (err, "socket");
      unlink (path);
      mode_t old = umask (0077); /* owner-only from the start: no window */
      int r = bind (fd, (struct sockaddr *)&sa, sizeof sa);
      umask (old);
      if (r < 0 || chmod (path, 0600) < 0 || listen (fd, 4096) < 0)
        {
          r = wr_sys_error (err, "listen on %s", path);
          close (fd);
          return r;
        }
      if (d->http_unix == NULL)
        d->http_unix = http_new_unix (d);
      struct evhttp_bound_socket *bs = evhttp_accept_socket_with_handle (d->http_unix, fd);
      if (bs == NULL)
        {
          close (fd);
          return wr_error (err, 0, WR_E_INTERNAL, "cannot serve %s", path);
        }
      return wr_accept_guard (d->http_unix, bs, err); /* no spinning on EMFILE */
    }
  if (strncmp (spec, "tcp:", 4) == 0)
    {
      if (d->token[0] == '\0')
        return wr_error (err, 0, WR_E_INVALID, "tcp listeners require --token-file");
      if (d->tcp == NULL)
        {
          struct wr_httpd_config cfg = {
            .max_connections = d->http.max_connections,
            .header_timeout_s = d->http.header_timeout_s,
            .idle_timeout_s = d->http.idle_timeout_s,
            .max_body = FILE_BODY_MAX + 4096,
            .authorized = authorized_tcp,
            .route = route_tcp,
            .refused = refused_tcp,
            .arg = d,
            .unauthorized = &d->m.http_unauthorized,
            .busy = &d->m.http_busy,
            .timeouts = &d->m.http_timeouts,
            .connections = &d->n_tcp_conns,
          };
          if (wr_httpd_new (d->base, &cfg, &d->tcp, err) < 0)
            return -1;
          d->http.max_connections = wr_httpd_config (d->tcp)->max_connections;
        }
      return wr_httpd_bind (d->tcp, spec, err);
    }
  return wr_error (err, 0, WR_E_INVALID, "listen spec must be unix:PATH or tcp:ADDR:PORT, got %s",
                   spec);
}

void
wrd_http_free (struct wrd *d)
{
  wr_accept_guards_free (d->http_unix);
  if (d->http_unix)
    evhttp_free (d->http_unix);
  d->http_unix = NULL;
  wr_httpd_free (d->tcp);
  d->tcp = NULL;
}

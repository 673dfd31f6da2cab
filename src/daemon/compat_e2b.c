/* E2B-compatible API (docs/e2b.md).
 *
 * The real `e2b` SDK, pointed at this listener with E2B_API_URL and
 * E2B_SANDBOX_URL, drives Warren unmodified. One port serves both of E2B's
 * APIs: the control API (POST /sandboxes and /v2/sandboxes, GET, DELETE,
 * /timeout, /pause, /resume, /connect, /refreshes; the contract of
 * e2b-dev/E2B spec/openapi.yml) and, for requests carrying an
 * `E2b-Sandbox-Id` header, the in-sandbox envd API: the Connect protocol in
 * JSON over HTTP/1.1 for process.Process and filesystem.Filesystem (unary
 * calls are plain JSON bodies; server streams are envelopes of a flags byte
 * and a big-endian length, ended by a 0x02 envelope carrying {} or
 * {"error":...}), GET/POST /files and /health.
 *
 * There is no second path into a sandbox: sandboxes are created, listed,
 * paused and destroyed by the daemon's own functions (sandbox.c), and every
 * command and file operation is an EXEC or FILE request on the sandbox's
 * agent connection, the same machinery as /v1/sandboxes/{id}/exec and
 * /files. A process's pid is this layer's handle for its agent stream, so
 * SendInput, CloseStdin and SendSignal become STDIN and SIGNAL frames.
 *
 * E2B state lives in the sandbox's labels (e2b.template, e2b.meta.*), so
 * listing and getting sandboxes needs nothing beyond the registry. */
#include "daemon/compat_e2b.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <zlib.h>

#include "common/b64.h"
#include "common/httpd.h"
#include "common/proto.h"
#include "common/util.h"
#include "daemon/agent_conn.h"
#include "daemon/http_util.h"
#include "daemon/log.h"

#define E2B_ENVD_VERSION "0.6.4" /* what the SDK checks features against */
#define E2B_USER "user"          /* E2B's default account: commands and files */
#define E2B_HOME "/home/user"    /* its home: relative paths, cwd */
#define E2B_USER_MAX 64
#define E2B_DEFAULT_TIMEOUT_S 300
#define E2B_MAX_TIMEOUT_S 86400
#define E2B_MAX_BODY (64u << 20)
#define E2B_OUT_CAP (64u << 20) /* per stream of a process (the API's maximum) */
#define E2B_LABEL_TEMPLATE "e2b.template"
#define E2B_LABEL_META "e2b.meta."
#define E2B_MAX_SUBS 8
#define E2B_WATCH_QUEUE 10000 /* events a polled watcher keeps until fetched */

struct e2b_proc;

/* A client stream following a process (Start or Connect). */
struct e2b_sub
{
  struct e2b_proc *p;
  struct evhttp_request *req;
  struct evhttp_connection *evcon;
  struct event *hup;
};

struct e2b_proc
{
  struct e2b_proc *next;
  uint32_t pid;
  char sbid[33];
  struct agent_conn *conn; /* of sbid, valid while the stream is (agent_conn fails it first) */
  uint32_t sid;
  json_t *config; /* {cmd, args, envs, cwd} as asked */
  char *tag;
  bool pty; /* output is "pty" bytes, input goes to the terminal */
  struct e2b_sub *subs[E2B_MAX_SUBS];
};

/* A directory watch: a WatchDir stream, or a watcher that
 * GetWatcherEvents polls; either way one FILE "watch" request on the
 * sandbox's agent (inotify in the sandbox, docs/protocol.md). */
struct e2b_watch
{
  struct e2b_watch *next;
  char id[24]; /* watcherId */
  char sbid[33];
  struct agent_conn *conn; /* valid while the request is pending */
  uint32_t sid;
  char *path;
  bool ready, polling;
  struct evhttp_request *req; /* the stream, or CreateWatcher's call until ready */
  struct evhttp_connection *evcon;
  struct event *hup;
  struct event *ping; /* keepalive messages every Keepalive-Ping-Interval s */
  int ping_s;
  json_t *events; /* polling: not yet fetched */
};

struct e2b
{
  struct wrd *d;
  struct evhttp *http;
  struct e2b_proc *procs;
  struct e2b_watch *watches;
  uint32_t next_pid, next_watch;
  bool keyed; /* a listener serving us asks for a token */
};

static struct e2b *g_e2b;

/* ---- replies ---- */

static void
reply_json (struct evhttp_request *req, int status, json_t *j)
{
  char *text = json_dumps (j, JSON_COMPACT);
  json_decref (j);
  struct evbuffer *b = evbuffer_new ();
  if (text)
    evbuffer_add (b, text, strlen (text));
  free (text);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type", "application/json");
  evhttp_send_reply (req, status, NULL, b);
  evbuffer_free (b);
}

/* The control API's and /files' error shape: {"code": status, "message"}. */
static void
reply_api_error (struct evhttp_request *req, int status, const char *msg)
{
  reply_json (req, status, json_pack ("{s:i,s:s}", "code", status, "message", msg));
}

static int
api_status (const char *code)
{
  wr_err_t e = { .code = code };
  return wr_err_http_status (&e);
}

/* Warren's error codes as Connect codes (connectrpc.com/docs/protocol). */
static const char *
connect_code (const char *code)
{
  static const char *const map[][2] = {
    { WR_E_INVALID, "invalid_argument" },     { WR_E_NOT_FOUND, "not_found" },
    { WR_E_CONFLICT, "already_exists" },      { WR_E_GONE, "unavailable" },
    { WR_E_EXHAUSTED, "resource_exhausted" }, { WR_E_UNAVAILABLE, "unavailable" },
    { WR_E_TIMEOUT, "deadline_exceeded" },    { WR_E_UNSUPPORTED, "unimplemented" },
    { WR_E_FORBIDDEN, "permission_denied" },  { WR_E_UNAUTHORIZED, "unauthenticated" },
  };
  for (size_t i = 0; code && i < sizeof map / sizeof map[0]; i++)
    if (strcmp (code, map[i][0]) == 0)
      return map[i][1];
  return "internal";
}

static int
connect_status (const char *ccode)
{
  static const struct
  {
    const char *code;
    int status;
  } map[] = {
    { "invalid_argument", 400 },    { "not_found", 404 },          { "already_exists", 409 },
    { "unavailable", 503 },         { "resource_exhausted", 429 }, { "deadline_exceeded", 504 },
    { "unimplemented", 501 },       { "permission_denied", 403 },  { "unauthenticated", 401 },
    { "failed_precondition", 400 },
  };
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (strcmp (ccode, map[i].code) == 0)
      return map[i].status;
  return 500;
}

/* A unary Connect error (ccode is already a Connect code). */
static void
reply_connect_error (struct evhttp_request *req, const char *ccode, const char *msg)
{
  reply_json (req, connect_status (ccode), json_pack ("{s:s,s:s}", "code", ccode, "message", msg));
}

static void
envelope_add (struct evbuffer *b, uint8_t flags, json_t *j)
{
  char *text = json_dumps (j, JSON_COMPACT);
  json_decref (j);
  size_t n = text ? strlen (text) : 0;
  uint8_t hdr[5] = { flags, (uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n };
  evbuffer_add (b, hdr, sizeof hdr);
  if (n)
    evbuffer_add (b, text, n);
  free (text);
}

/* One envelope as the next chunk of a streaming reply (takes j). */
static void
envelope_send (struct evhttp_request *req, uint8_t flags, json_t *j)
{
  struct evbuffer *b = evbuffer_new ();
  envelope_add (b, flags, j);
  evhttp_send_reply_chunk (req, b);
  evbuffer_free (b);
}

/* A streaming call that fails before its first message: one end-of-stream
 * envelope with the error, status 200 (the Connect streaming rule). */
static void
reply_stream_error (struct evhttp_request *req, const char *ccode, const char *msg)
{
  struct evbuffer *b = evbuffer_new ();
  envelope_add (b, 0x02, json_pack ("{s:{s:s,s:s}}", "error", "code", ccode, "message", msg));
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                     "application/connect+json");
  evhttp_send_reply (req, 200, NULL, b);
  evbuffer_free (b);
}

/* ---- small helpers ---- */

static void
iso_time (double t, char *buf, size_t len)
{
  time_t s = (time_t)t;
  struct tm tm;
  gmtime_r (&s, &tm);
  char base[32];
  strftime (base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf (buf, len, "%s.%03dZ", base, (int)((t - (double)s) * 1000) % 1000);
}

/* Relative paths are relative to the user's home, as in envd. */
static char *
abs_path (const char *home, const char *p)
{
  char *out = NULL;
  if (p == NULL || p[0] == '\0')
    return strdup (home);
  if (p[0] == '/')
    return strdup (p);
  if (p[0] == '~' && (p[1] == '/' || p[1] == '\0'))
    p += p[1] ? 2 : 1;
  if (asprintf (&out, "%s/%s", home, p) < 0)
    return NULL;
  return out;
}

/* The account a request acts as: `Authorization: Basic base64(NAME:)`
 * (the SDK's `user` option on RPCs), else ?username= (on /files), else
 * E2B's default user. */
static void
request_user (struct evhttp_request *req, const char *query_user, char out[E2B_USER_MAX])
{
  snprintf (out, E2B_USER_MAX, "%s", E2B_USER);
  const char *a = evhttp_find_header (evhttp_request_get_input_headers (req), "Authorization");
  if (a && strncasecmp (a, "Basic ", 6) == 0)
    {
      char raw[3 * E2B_USER_MAX];
      size_t len = strlen (a + 6);
      long n = len < 4 * E2B_USER_MAX - 8 ? wr_b64_decode (a + 6, len, raw) : -1;
      if (n > 0)
        {
          raw[n] = '\0';
          size_t name = strcspn (raw, ":");
          if (name > 0 && name < (size_t)n && name < E2B_USER_MAX)
            snprintf (out, E2B_USER_MAX, "%.*s", (int)name, raw);
        }
    }
  else if (query_user && query_user[0] && strlen (query_user) < E2B_USER_MAX)
    snprintf (out, E2B_USER_MAX, "%s", query_user);
}

static void
user_home (const char *user, char out[E2B_USER_MAX + 8])
{
  snprintf (out, E2B_USER_MAX + 8, strcmp (user, "root") == 0 ? "/root" : "/home/%s", user);
}

static const char *
base_name (const char *p)
{
  const char *s = strrchr (p, '/');
  return s && s[1] ? s + 1 : (s ? "/" : p);
}

static const char *
header (struct evhttp_request *req, const char *name)
{
  return evhttp_find_header (evhttp_request_get_input_headers (req), name);
}

/* The message of a Connect request: a plain JSON body (unary) or the
 * first enveloped message (a server-streaming call). */
static json_t *
request_message (struct evhttp_request *req, bool enveloped)
{
  struct evbuffer *ib = evhttp_request_get_input_buffer (req);
  size_t n = evbuffer_get_length (ib);
  const uint8_t *p = n ? evbuffer_pullup (ib, -1) : NULL;
  if (enveloped)
    {
      if (n < 5)
        return NULL;
      size_t len = (size_t)p[1] << 24 | (size_t)p[2] << 16 | (size_t)p[3] << 8 | p[4];
      if (len > n - 5)
        return NULL;
      p += 5;
      n = len;
    }
  if (n == 0)
    return json_object ();
  json_t *j = json_loadb ((const char *)p, n, 0, NULL);
  if (!json_is_object (j))
    {
      json_decref (j);
      return NULL;
    }
  return j;
}

/* ---- sandboxes (the control API) ---- */

static const char *
sb_template (struct sandbox *sb)
{
  const char *t = json_string_value (
      json_object_get (json_object_get (sb->spec, "labels"), E2B_LABEL_TEMPLATE));
  return t ? t : "base";
}

static bool
sb_is_e2b (struct sandbox *sb)
{
  return json_object_get (json_object_get (sb->spec, "labels"), E2B_LABEL_TEMPLATE) != NULL;
}

static json_t *
sb_metadata (struct sandbox *sb)
{
  json_t *m = json_object ();
  const char *k;
  json_t *v;
  json_object_foreach (json_object_get (sb->spec, "labels"), k, v)
  {
    if (strncmp (k, E2B_LABEL_META, strlen (E2B_LABEL_META)) == 0)
      json_object_set (m, k + strlen (E2B_LABEL_META), v);
  }
  return m;
}

static json_t *
e2b_sandbox_json (struct sandbox *sb, struct evhttp_request *req)
{
  char started[40], end[40];
  iso_time (sb->created_at, started, sizeof started);
  double e = sb->expires_at > 0 ? sb->expires_at : sb->created_at + E2B_MAX_TIMEOUT_S;
  iso_time (e, end, sizeof end);
  json_t *spec = sb->spec;
  double cpus = json_number_value (json_object_get (spec, "cpus"));
  json_t *j
      = json_pack ("{s:s,s:s,s:s,s:s,s:s,s:s,s:i,s:I,s:I,s:o,s:s,s:s,s:n,s:n}", "sandboxID", sb->id,
                   "templateID", sb_template (sb), "alias", sb_template (sb), "clientID", "warren",
                   "startedAt", started, "endAt", end, "cpuCount", cpus >= 1 ? (int)cpus : 1,
                   "memoryMB", json_integer_value (json_object_get (spec, "memory_mb")),
                   "diskSizeMB", json_integer_value (json_object_get (spec, "disk_mb")), "metadata",
                   sb_metadata (sb), "state", sb->state == SB_PAUSED ? "paused" : "running",
                   "envdVersion", E2B_ENVD_VERSION, "envdAccessToken", "domain");
  /* On a port that asks for a token, the SDK's envd requests must carry it
   * too: it sends X-Access-Token with the sandbox's envdAccessToken, so
   * that is the client's own key, handed back. */
  const char *key = g_e2b && g_e2b->keyed ? header (req, "X-API-Key") : NULL;
  if (key && key[0])
    json_object_set_new (j, "envdAccessToken", json_string (key));
  return j;
}

static struct sandbox *
find_e2b (struct e2b *s, const char *id)
{
  struct sandbox *sb = wrd_sandbox_find (s->d, id);
  if (sb == NULL || sb->state == SB_POOLED || sb->state == SB_DESTROYING)
    return NULL;
  return sb;
}

/* E2B's templates have the account `user` (home /home/user) that commands
 * and files default to. An image without it gets it at create, by a script
 * that needs nothing but a POSIX sh, mkdir and chown: the first id from
 * 1000 up that neither /etc/passwd nor /etc/group uses. */
static const char provision_script[]
    = "set -e\n"
      "used() { while IFS=: read -r n x i r; do [ \"$i\" = \"$1\" ] && return 0; done < \"$2\"; "
      "return 1; }\n"
      "field() { while IFS=: read -r n x i g r; do [ \"$n\" = user ] && eval echo \\$$1 && "
      "return 0; done < \"$2\"; return 1; }\n"
      "touch /etc/passwd /etc/group\n"
      "if ! field i /etc/passwd >/dev/null; then\n"
      "  id=1000\n"
      "  while used $id /etc/passwd || used $id /etc/group; do id=$((id+1)); done\n"
      "  field i /etc/group >/dev/null || echo \"user:x:$id:\" >> /etc/group\n"
      "  gid=$(field i /etc/group)\n"
      "  sh=/bin/sh; [ -x /bin/bash ] && sh=/bin/bash\n"
      "  echo \"user:x:$id:$gid::/home/user:$sh\" >> /etc/passwd\n"
      "  if [ -f /etc/shadow ]; then echo 'user:!:19000::::::' >> /etc/shadow; fi\n"
      "fi\n"
      "mkdir -p /home/user\n"
      "chown \"$(field i /etc/passwd):$(field g /etc/passwd)\" /home/user\n";

struct provision
{
  struct evhttp_request *req;
  char sbid[33];
  struct evbuffer *err;
};

static void
provision_reply (struct provision *pv, const char *problem)
{
  struct sandbox *sb = find_e2b (g_e2b, pv->sbid);
  if (problem)
    wrd_log (WRD_LOG_WARN, "e2b: sandbox %s has no account \"%s\": %s", pv->sbid, E2B_USER,
             problem);
  if (sb)
    reply_json (pv->req, 201, e2b_sandbox_json (sb, pv->req));
  else
    reply_api_error (pv->req, 500, "the sandbox went away while it was being created");
  evbuffer_free (pv->err);
  free (pv);
}

static void
provision_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct provision *pv = ud;
  if (type == WR_MSG_STDERR && evbuffer_get_length (pv->err) < 1024)
    evbuffer_add (pv->err, data, len);
}

static void
provision_done (void *ud, json_t *res)
{
  struct provision *pv = ud;
  if (json_integer_value (json_object_get (res, "exit_code")) == 0)
    return provision_reply (pv, NULL);
  evbuffer_add (pv->err, "", 1);
  const char *msg = (const char *)evbuffer_pullup (pv->err, -1);
  provision_reply (pv, msg && msg[0] ? msg : "the script failed");
}

static void
provision_error (void *ud, const char *code WR_UNUSED, const char *msg)
{
  provision_reply (ud, msg);
}

static void
create_done (struct wrd *d WR_UNUSED, struct sandbox *sb, wr_err_t *err, void *ud)
{
  struct evhttp_request *req = ud;
  if (sb == NULL)
    {
      reply_api_error (req, wr_err_http_status (err), err->msg);
      return;
    }
  struct provision *pv = sb->conn ? calloc (1, sizeof *pv) : NULL;
  if (pv == NULL || (pv->err = evbuffer_new ()) == NULL)
    {
      free (pv);
      reply_json (req, 201, e2b_sandbox_json (sb, req));
      return;
    }
  pv->req = req;
  snprintf (pv->sbid, sizeof pv->sbid, "%s", sb->id);
  /* answered once the account is there: the client's first command runs as it */
  json_t *b = json_pack ("{s:s,s:[s],s:s,s:i}", "shell", provision_script, "env",
                         "PATH=" WR_DEFAULT_PATH, "cwd", "/", "timeout_ms", 60000);
  static const struct agent_ops ops = { provision_data, provision_done, provision_error };
  if (agent_request (sb->conn, WR_MSG_EXEC, b, &ops, pv) == 0)
    provision_reply (pv, "the sandbox agent is gone");
  json_decref (b);
}

static int
timeout_of (json_t *body, long *ret)
{
  json_t *t = json_object_get (body, "timeout");
  if (t == NULL || json_is_null (t))
    return 0;
  if (!json_is_integer (t) || json_integer_value (t) < 0)
    return -1;
  long v = (long)json_integer_value (t);
  *ret = v > E2B_MAX_TIMEOUT_S ? E2B_MAX_TIMEOUT_S : v;
  return 0;
}

static void
handle_create (struct e2b *s, struct evhttp_request *req, json_t *body)
{
  const char *tmpl = json_string_value (json_object_get (body, "templateID"));
  if (tmpl == NULL || tmpl[0] == '\0')
    tmpl = "base";
  long timeout = E2B_DEFAULT_TIMEOUT_S;
  if (timeout_of (body, &timeout) < 0)
    {
      reply_api_error (req, 400, "timeout must be a non-negative integer (seconds)");
      return;
    }
  json_t *labels = json_pack ("{s:s}", E2B_LABEL_TEMPLATE, tmpl);
  const char *k;
  json_t *v;
  json_object_foreach (json_object_get (body, "metadata"), k, v)
  {
    char key[300];
    snprintf (key, sizeof key, "%s%s", E2B_LABEL_META, k);
    if (json_is_string (v))
      json_object_set (labels, key, v);
  }
  /* "base" (E2B's default template) is the daemon's default image */
  json_t *w
      = json_pack ("{s:o,s:I}", "labels", labels, "ttl_s", (json_int_t)(timeout ? timeout : 1));
  if (strcmp (tmpl, "base") != 0)
    json_object_set_new (w, "image", json_string (tmpl));
  json_t *envs = json_object_get (body, "envVars");
  if (json_is_object (envs))
    json_object_set (w, "env", envs);
  wr_err_t err;
  int r = wrd_sandbox_create_async (s->d, w, create_done, req, &err);
  json_decref (w);
  if (r < 0)
    reply_api_error (req, wr_err_http_status (&err), err.msg);
}

/* ?metadata=k%3Dv&k2%3Dv2 (already URL-decoded once by evhttp) and
 * ?state=running,paused */
static bool
list_match (struct sandbox *sb, const char *metadata, const char *state)
{
  if (state && state[0] && strstr (state, sb->state == SB_PAUSED ? "paused" : "running") == NULL)
    return false;
  if (metadata == NULL || metadata[0] == '\0')
    return true;
  _cleanup_free_ char *copy = strdup (metadata);
  json_t *meta = sb_metadata (sb);
  bool ok = true;
  char *save = NULL;
  for (char *pair = strtok_r (copy, "&", &save); pair && ok; pair = strtok_r (NULL, "&", &save))
    {
      _cleanup_free_ char *dec = evhttp_uridecode (pair, 0, NULL);
      char *eq = dec ? strchr (dec, '=') : NULL;
      if (eq == NULL)
        continue;
      *eq = '\0';
      _cleanup_free_ char *key = evhttp_uridecode (dec, 0, NULL);
      _cleanup_free_ char *val = evhttp_uridecode (eq + 1, 0, NULL);
      const char *have = json_string_value (json_object_get (meta, key ? key : dec));
      ok = have && strcmp (have, val ? val : eq + 1) == 0;
    }
  json_decref (meta);
  return ok;
}

static void
handle_list (struct e2b *s, struct evhttp_request *req)
{
  struct evkeyvalq q;
  evhttp_parse_query_str (evhttp_uri_get_query (evhttp_request_get_evhttp_uri (req)) ?: "", &q);
  const char *metadata = evhttp_find_header (&q, "metadata");
  const char *state = evhttp_find_header (&q, "state");
  json_t *a = json_array ();
  struct wrd *d = s->d;
  for (size_t i = 0; i < d->table_size; i++)
    for (struct sandbox *sb = d->table[i]; sb; sb = sb->hnext)
      if ((sb->state == SB_RUNNING || sb->state == SB_PAUSED) && sb_is_e2b (sb)
          && list_match (sb, metadata, state))
        json_array_append_new (a, e2b_sandbox_json (sb, req));
  evhttp_clear_headers (&q);
  reply_json (req, 200, a);
}

static void
set_timeout (struct e2b *s, struct sandbox *sb, long timeout)
{
  wr_err_t err;
  if (wrd_sandbox_set_ttl (s->d, sb, (double)(timeout ? timeout : 1), &err) < 0)
    wrd_log (WRD_LOG_WARN, "e2b: timeout of %s: %s", sb->id, err.msg);
}

/* /sandboxes/{id}[/action] */
static void
handle_sandbox (struct e2b *s, struct evhttp_request *req, const char *rest, json_t *body)
{
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  char id[65];
  size_t idlen = strcspn (rest, "/");
  snprintf (id, sizeof id, "%.*s", (int)(idlen < 64 ? idlen : 64), rest);
  const char *action = rest[idlen] == '/' ? rest + idlen + 1 : "";
  struct sandbox *sb = find_e2b (s, id);
  if (sb == NULL)
    {
      reply_api_error (req, 404, "sandbox not found");
      return;
    }
  wr_err_t err;
  long timeout = -1;
  if (timeout_of (body, &timeout) < 0)
    {
      reply_api_error (req, 400, "timeout must be a non-negative integer (seconds)");
      return;
    }
  if (action[0] == '\0' && m == EVHTTP_REQ_GET)
    reply_json (req, 200, e2b_sandbox_json (sb, req));
  else if (action[0] == '\0' && m == EVHTTP_REQ_DELETE)
    {
      if (wrd_sandbox_destroy (s->d, sb, &err) < 0)
        reply_api_error (req, wr_err_http_status (&err), err.msg);
      else
        evhttp_send_reply (req, 204, "No Content", NULL);
    }
  else if (m == EVHTTP_REQ_POST
           && (strcmp (action, "timeout") == 0 || strcmp (action, "refreshes") == 0))
    {
      if (timeout < 0 && strcmp (action, "refreshes") == 0)
        {
          json_t *dur = json_object_get (body, "duration");
          timeout = json_is_integer (dur) ? (long)json_integer_value (dur) : 60;
        }
      if (timeout < 0)
        {
          reply_api_error (req, 400, "timeout is required");
          return;
        }
      set_timeout (s, sb, timeout);
      evhttp_send_reply (req, 204, "No Content", NULL);
    }
  else if (m == EVHTTP_REQ_POST && strcmp (action, "pause") == 0)
    {
      if (sb->state == SB_PAUSED)
        reply_api_error (req, 409, "sandbox is already paused");
      else if (wrd_sandbox_pause (s->d, sb, true, &err) < 0)
        reply_api_error (req, wr_err_http_status (&err), err.msg);
      else
        evhttp_send_reply (req, 204, "No Content", NULL);
    }
  else if (m == EVHTTP_REQ_POST
           && (strcmp (action, "resume") == 0 || strcmp (action, "connect") == 0))
    {
      bool was_paused = sb->state == SB_PAUSED;
      if (strcmp (action, "resume") == 0 && !was_paused)
        {
          reply_api_error (req, 409, "sandbox is not paused");
          return;
        }
      if (was_paused && wrd_sandbox_pause (s->d, sb, false, &err) < 0)
        {
          reply_api_error (req, wr_err_http_status (&err), err.msg);
          return;
        }
      /* connect only ever extends the timeout */
      if (timeout >= 0
          && (sb->expires_at <= 0 || wr_now_ns () / 1e9 + (double)timeout > sb->expires_at
              || strcmp (action, "resume") == 0))
        set_timeout (s, sb, timeout);
      reply_json (req, was_paused ? 201 : 200, e2b_sandbox_json (sb, req));
    }
  else
    reply_api_error (req, 404, "no such route");
}

/* ---- processes ---- */

static struct e2b_proc *
proc_find (struct e2b *s, const char *sbid, json_t *selector)
{
  json_t *pid = json_object_get (selector, "pid");
  const char *tag = json_string_value (json_object_get (selector, "tag"));
  for (struct e2b_proc *p = s->procs; p; p = p->next)
    if (strcmp (p->sbid, sbid) == 0
        && ((json_is_integer (pid) && (json_int_t)p->pid == json_integer_value (pid))
            || (tag && p->tag && strcmp (tag, p->tag) == 0)))
      return p;
  return NULL;
}

static void
sub_free (struct e2b_sub *sub)
{
  if (sub->hup)
    event_free (sub->hup);
  if (sub->evcon)
    evhttp_connection_set_closecb (sub->evcon, NULL, NULL);
  free (sub);
}

static void
sub_detach (struct e2b_sub *sub)
{
  struct e2b_proc *p = sub->p;
  for (size_t i = 0; p && i < E2B_MAX_SUBS; i++)
    if (p->subs[i] == sub)
      p->subs[i] = NULL;
  sub_free (sub);
}

static void
sub_send (struct e2b_sub *sub, uint8_t flags, json_t *j)
{
  envelope_send (sub->req, flags, j);
}

static void
proc_broadcast (struct e2b_proc *p, json_t *event)
{
  for (size_t i = 0; i < E2B_MAX_SUBS; i++)
    if (p->subs[i])
      sub_send (p->subs[i], 0, json_pack ("{s:O}", "event", event));
  json_decref (event);
}

static void
proc_free (struct e2b *s, struct e2b_proc *p)
{
  for (struct e2b_proc **pp = &s->procs; *pp; pp = &(*pp)->next)
    if (*pp == p)
      {
        *pp = p->next;
        break;
      }
  for (size_t i = 0; i < E2B_MAX_SUBS; i++)
    if (p->subs[i])
      {
        sub_send (p->subs[i], 0x02, json_object ());
        evhttp_send_reply_end (p->subs[i]->req);
        sub_free (p->subs[i]);
      }
  json_decref (p->config);
  free (p->tag);
  free (p);
}

static void
proc_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct e2b_proc *p = ud;
  _cleanup_free_ char *b64 = malloc (wr_b64_encoded_len (len) + 1);
  if (b64 == NULL)
    return;
  wr_b64_encode (data, len, b64);
  proc_broadcast (p, json_pack ("{s:{s:s}}", "data",
                                p->pty                  ? "pty"
                                : type == WR_MSG_STDERR ? "stderr"
                                                        : "stdout",
                                b64));
}

static void
proc_on_done (void *ud, json_t *res)
{
  struct e2b_proc *p = ud;
  int code = (int)json_integer_value (json_object_get (res, "exit_code"));
  int sig = (int)json_integer_value (json_object_get (res, "signal"));
  const char *error = json_string_value (json_object_get (res, "error"));
  char status[64];
  if (sig)
    snprintf (status, sizeof status, "signal: %s", sig == 9 ? "killed" : strsignal (sig));
  else
    snprintf (status, sizeof status, "exit status %d", code);
  json_t *end = json_pack ("{s:i,s:b,s:s}", "exitCode", code, "exited", sig == 0, "status", status);
  if (error)
    json_object_set_new (end, "error", json_string (error));
  else if (json_is_true (json_object_get (res, "timed_out")))
    json_object_set_new (end, "error", json_string ("context deadline exceeded"));
  proc_broadcast (p, json_pack ("{s:o}", "end", end));
  proc_free (g_e2b, p);
}

static void
proc_on_error (void *ud, const char *code, const char *message)
{
  struct e2b_proc *p = ud;
  for (size_t i = 0; i < E2B_MAX_SUBS; i++)
    if (p->subs[i])
      {
        sub_send (
            p->subs[i], 0x02,
            json_pack ("{s:{s:s,s:s}}", "error", "code", connect_code (code), "message", message));
        evhttp_send_reply_end (p->subs[i]->req);
        sub_free (p->subs[i]);
        p->subs[i] = NULL;
      }
  proc_free (g_e2b, p);
}

/* The client of a stream went away: the process keeps running (envd's
 * rule: a disconnected handle can reconnect with Connect). */
static void
sub_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct e2b_sub *sub = arg;
  sub->evcon = NULL;
  sub_detach (sub);
}

static void
sub_hangup (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct e2b_sub *sub = arg;
  struct evhttp_connection *evcon = sub->evcon;
  sub_detach (sub);
  if (evcon)
    evhttp_connection_free (evcon);
}

/* Start a server stream's reply; closed runs when the client goes away
 * (hup catches a half close evhttp would only see at the next write). */
static void
stream_begin (struct e2b *s, struct evhttp_request *req,
              void (*closed) (struct evhttp_connection *, void *), event_callback_fn hup, void *arg,
              struct evhttp_connection **ret_evcon, struct event **ret_hup)
{
  struct evhttp_connection *evcon = evhttp_request_get_connection (req);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                     "application/connect+json");
  evhttp_send_reply_start (req, 200, "OK");
  evhttp_connection_set_closecb (evcon, closed, arg);
  int cfd = bufferevent_getfd (evhttp_connection_get_bufferevent (evcon));
  *ret_hup = cfd >= 0 ? event_new (s->d->base, cfd, EV_CLOSED, hup, arg) : NULL;
  if (*ret_hup)
    event_add (*ret_hup, NULL);
  *ret_evcon = evcon;
}

static struct e2b_sub *
sub_start (struct e2b *s, struct e2b_proc *p, struct evhttp_request *req)
{
  size_t slot = E2B_MAX_SUBS;
  for (size_t i = 0; i < E2B_MAX_SUBS && slot == E2B_MAX_SUBS; i++)
    if (p->subs[i] == NULL)
      slot = i;
  struct e2b_sub *sub = slot < E2B_MAX_SUBS ? calloc (1, sizeof *sub) : NULL;
  if (sub == NULL)
    {
      reply_stream_error (req, "resource_exhausted", "too many streams follow this process");
      return NULL;
    }
  sub->p = p;
  sub->req = req;
  p->subs[slot] = sub;
  stream_begin (s, req, sub_closed, sub_hangup, sub, &sub->evcon, &sub->hup);
  sub_send (sub, 0, json_pack ("{s:{s:{s:I}}}", "event", "start", "pid", (json_int_t)p->pid));
  return sub;
}

static struct sandbox *
usable (struct sandbox *sb, const char **ret_code, const char **ret_msg)
{
  if (sb == NULL)
    {
      *ret_code = "not_found";
      *ret_msg = "sandbox not found";
    }
  else if (sb->state == SB_PAUSED)
    {
      *ret_code = "unavailable";
      *ret_msg = "the sandbox is paused; connect to resume it";
    }
  else if (sb->state != SB_RUNNING || !agent_conn_alive (sb->conn))
    {
      *ret_code = "unavailable";
      *ret_msg = "the sandbox is not running";
    }
  else
    return sb;
  return NULL;
}

static void
process_start (struct e2b *s, struct sandbox *sb, struct evhttp_request *req, json_t *msg)
{
  json_t *cfg = json_object_get (msg, "process");
  const char *cmd = json_string_value (json_object_get (cfg, "cmd"));
  if (cmd == NULL || cmd[0] == '\0')
    {
      reply_stream_error (req, "invalid_argument", "process.cmd is required");
      return;
    }
  json_t *argv = json_pack ("[s]", cmd);
  json_t *args = json_object_get (cfg, "args"), *v;
  size_t i;
  json_array_foreach (args, i, v)
  {
    if (json_is_string (v))
      json_array_append (argv, v);
  }
  json_t *envs = json_object_get (cfg, "envs");
  json_t *env = NULL;
  wr_err_t err;
  char user[E2B_USER_MAX], home[E2B_USER_MAX + 8];
  request_user (req, NULL, user);
  user_home (user, home);
  /* the account's variables, as a login would set them; the client's win */
  json_t *uenv = json_pack ("{s:s,s:s,s:s}", "HOME", home, "USER", user, "LOGNAME", user);
  if (json_is_object (envs))
    json_object_update (uenv, envs);
  int er = wrd_exec_env (sb, uenv, &env, &err);
  json_decref (uenv);
  if (er < 0)
    {
      json_decref (argv);
      reply_stream_error (req, "invalid_argument", err.msg);
      return;
    }
  const char *cwd = json_string_value (json_object_get (cfg, "cwd"));
  _cleanup_free_ char *dir = abs_path (home, cwd);
  /* an absent "stdin" is an SDK older than the field: stdin was always open */
  json_t *sin = json_object_get (msg, "stdin");
  json_t *pty = json_object_get (msg, "pty");
  bool want_stdin = sin == NULL || json_is_true (sin) || pty;
  json_t *body = json_pack ("{s:o,s:o,s:s,s:I,s:I,s:b,s:s}", "cmd", argv, "env", env, "cwd", dir,
                            "stdout_cap", (json_int_t)E2B_OUT_CAP, "stderr_cap",
                            (json_int_t)E2B_OUT_CAP, "stdin", want_stdin, "user", user);
  if (json_is_object (pty))
    {
      /* one terminal for stdin, stdout and stderr, the process its session leader */
      json_t *size = json_object_get (pty, "size");
      json_int_t rows = json_integer_value (json_object_get (size, "rows"));
      json_int_t cols = json_integer_value (json_object_get (size, "cols"));
      json_object_set_new (body, "tty", json_true ());
      json_object_set_new (body, "rows", json_integer (rows > 0 && rows < 65536 ? rows : 24));
      json_object_set_new (body, "cols", json_integer (cols > 0 && cols < 65536 ? cols : 80));
    }
  /* the client's deadline (Connect-Timeout-Ms) bounds the process, as in envd */
  const char *tmo = header (req, "Connect-Timeout-Ms");
  if (tmo && atoll (tmo) > 0)
    json_object_set_new (body, "timeout_ms", json_integer (atoll (tmo)));
  struct e2b_proc *p = calloc (1, sizeof *p);
  if (p == NULL)
    {
      json_decref (body);
      reply_stream_error (req, "resource_exhausted", "out of memory");
      return;
    }
  p->pid = ++s->next_pid;
  snprintf (p->sbid, sizeof p->sbid, "%s", sb->id);
  p->conn = sb->conn;
  p->config = json_pack ("{s:s,s:o,s:o,s:s}", "cmd", cmd, "args",
                         args ? json_incref (args) : json_array (), "envs",
                         json_is_object (envs) ? json_copy (envs) : json_object (), "cwd", dir);
  const char *tag = json_string_value (json_object_get (msg, "tag"));
  p->tag = tag ? strdup (tag) : NULL;
  p->pty = json_is_object (pty);
  p->next = s->procs;
  s->procs = p;
  static const struct agent_ops ops = { proc_on_data, proc_on_done, proc_on_error };
  p->sid = agent_request (sb->conn, WR_MSG_EXEC, body, &ops, p);
  json_decref (body);
  if (p->sid == 0)
    {
      proc_free (s, p);
      reply_stream_error (req, "unavailable", "the sandbox agent is gone");
      return;
    }
  sub_start (s, p, req);
}

static int
signal_number (json_t *sig)
{
  if (json_is_integer (sig))
    return (int)json_integer_value (sig);
  const char *n = json_string_value (sig);
  if (n == NULL)
    return 0;
  if (strcmp (n, "SIGNAL_SIGKILL") == 0)
    return 9;
  if (strcmp (n, "SIGNAL_SIGTERM") == 0)
    return 15;
  return 0;
}

/* StreamInput, client streaming: envelopes {start: {process}}, then
 * {data: {input: {stdin|pty}}} and {keepalive}. evhttp hands us a request
 * once its body is complete, so over HTTP/1.1 the input reaches the
 * process when the client ends its stream (half duplex, as the Connect
 * protocol allows); the answer is one {} message and the end of stream. */
static void
stream_input (struct e2b *s, struct sandbox *sb, struct evhttp_request *req)
{
  struct evbuffer *ib = evhttp_request_get_input_buffer (req);
  size_t n = evbuffer_get_length (ib);
  const uint8_t *p = n ? evbuffer_pullup (ib, -1) : NULL;
  struct e2b_proc *proc = NULL;
  const char *bad = NULL;
  while (n && bad == NULL)
    {
      size_t len = n >= 5 ? (size_t)p[1] << 24 | (size_t)p[2] << 16 | (size_t)p[3] << 8 | p[4] : 0;
      json_t *m = n >= 5 && len <= n - 5 ? json_loadb ((const char *)p + 5, len, 0, NULL) : NULL;
      if (!json_is_object (m))
        bad = "malformed request envelope";
      json_t *start = json_object_get (m, "start"), *data = json_object_get (m, "data");
      const char *in
          = json_string_value (json_object_get (json_object_get (data, "input"), "stdin"))
                ?: json_string_value (json_object_get (json_object_get (data, "input"), "pty"));
      if (bad == NULL && start && proc == NULL)
        {
          proc = proc_find (s, sb->id, json_object_get (start, "process"));
          if (proc == NULL)
            bad = "process not found";
        }
      else if (bad == NULL && data && proc == NULL)
        bad = "the stream must begin with a start event";
      else if (bad == NULL && in && in[0])
        {
          size_t il = strlen (in);
          _cleanup_free_ char *raw = malloc (il / 4 * 3 + 4);
          long rn = raw ? wr_b64_decode (in, il, raw) : -1;
          if (rn < 0)
            bad = "input is not base64";
          else if (rn > 0)
            agent_send (proc->conn, proc->sid, WR_MSG_STDIN, raw, (size_t)rn);
        }
      json_decref (m);
      if (bad == NULL)
        {
          p += 5 + len;
          n -= 5 + len;
        }
    }
  if (bad == NULL && proc == NULL)
    bad = "the stream must begin with a start event";
  if (bad)
    {
      reply_stream_error (
          req, strcmp (bad, "process not found") == 0 ? "not_found" : "invalid_argument", bad);
      return;
    }
  struct evbuffer *b = evbuffer_new ();
  envelope_add (b, 0, json_object ());
  envelope_add (b, 0x02, json_object ());
  evhttp_add_header (evhttp_request_get_output_headers (req), "Content-Type",
                     "application/connect+json");
  evhttp_send_reply (req, 200, NULL, b);
  evbuffer_free (b);
}

static void
handle_process (struct e2b *s, struct sandbox *sb, struct evhttp_request *req, const char *method)
{
  if (strcmp (method, "StreamInput") == 0)
    {
      const char *ccode, *cmsg;
      if (usable (sb, &ccode, &cmsg) == NULL)
        reply_stream_error (req, ccode, cmsg);
      else
        stream_input (s, sb, req);
      return;
    }
  bool streaming = strcmp (method, "Start") == 0 || strcmp (method, "Connect") == 0;
  const char *ccode, *cmsg;
  json_t *msg = request_message (req, streaming);
  if (msg == NULL)
    {
      (streaming ? reply_stream_error : reply_connect_error) (req, "invalid_argument",
                                                              "malformed request message");
      return;
    }
  if (usable (sb, &ccode, &cmsg) == NULL)
    {
      (streaming ? reply_stream_error : reply_connect_error) (req, ccode, cmsg);
      json_decref (msg);
      return;
    }
  if (strcmp (method, "Start") == 0)
    {
      process_start (s, sb, req, msg);
      json_decref (msg);
      return;
    }
  if (strcmp (method, "List") == 0)
    {
      json_t *a = json_array ();
      for (struct e2b_proc *p = s->procs; p; p = p->next)
        if (strcmp (p->sbid, sb->id) == 0)
          {
            json_t *e = json_pack ("{s:O,s:I}", "config", p->config, "pid", (json_int_t)p->pid);
            if (p->tag)
              json_object_set_new (e, "tag", json_string (p->tag));
            json_array_append_new (a, e);
          }
      reply_json (req, 200, json_pack ("{s:o}", "processes", a));
      json_decref (msg);
      return;
    }
  struct e2b_proc *p = proc_find (s, sb->id, json_object_get (msg, "process"));
  if (p == NULL && strcmp (method, "Update") != 0)
    {
      (streaming ? reply_stream_error : reply_connect_error) (req, "not_found",
                                                              "process not found");
      json_decref (msg);
      return;
    }
  if (strcmp (method, "Connect") == 0)
    sub_start (s, p, req);
  else if (strcmp (method, "SendSignal") == 0)
    {
      int sig = signal_number (json_object_get (msg, "signal"));
      char b[32];
      int n = snprintf (b, sizeof b, "{\"signal\":%d}", sig);
      if (sig <= 0 || sig >= 65)
        reply_connect_error (req, "invalid_argument", "unknown signal");
      else
        {
          agent_send (p->conn, p->sid, WR_MSG_SIGNAL, b, (size_t)n);
          reply_json (req, 200, json_object ());
        }
    }
  else if (strcmp (method, "SendInput") == 0 || strcmp (method, "CloseStdin") == 0)
    {
      const char *in
          = json_string_value (json_object_get (json_object_get (msg, "input"), "stdin"));
      if (in == NULL)
        in = json_string_value (json_object_get (json_object_get (msg, "input"), "pty"));
      size_t len = in ? strlen (in) : 0;
      _cleanup_free_ char *raw = malloc (len / 4 * 3 + 4);
      long n = in && raw ? wr_b64_decode (in, len, raw) : 0;
      if (n < 0)
        reply_connect_error (req, "invalid_argument", "input is not base64");
      else
        {
          /* an empty STDIN frame closes stdin: never send one for SendInput */
          if (strcmp (method, "CloseStdin") == 0)
            agent_send (p->conn, p->sid, WR_MSG_STDIN, "", 0);
          else if (n > 0)
            agent_send (p->conn, p->sid, WR_MSG_STDIN, raw, (size_t)n);
          reply_json (req, 200, json_object ());
        }
    }
  else if (strcmp (method, "Update") == 0 && p)
    {
      json_t *size = json_object_get (json_object_get (msg, "pty"), "size");
      json_int_t rows = json_integer_value (json_object_get (size, "rows"));
      json_int_t cols = json_integer_value (json_object_get (size, "cols"));
      char b[64];
      int n = snprintf (b, sizeof b, "{\"rows\":%lld,\"cols\":%lld}", (long long)rows,
                        (long long)cols);
      if (!p->pty)
        reply_connect_error (req, "failed_precondition", "the process has no pty");
      else if (rows <= 0 || rows > 65535 || cols <= 0 || cols > 65535)
        reply_connect_error (req, "invalid_argument", "pty.size wants rows and cols in [1, 65535]");
      else
        {
          /* a SIGNAL frame without "signal" resizes the exec's pty */
          agent_send (p->conn, p->sid, WR_MSG_SIGNAL, b, (size_t)n);
          reply_json (req, 200, json_object ());
        }
    }
  else if (strcmp (method, "Update") == 0)
    reply_connect_error (req, "not_found", "process not found");
  else
    reply_connect_error (req, "unimplemented", "no such process call");
  json_decref (msg);
}

/* ---- files ---- */

struct fop;
typedef void (*fop_done_fn) (struct fop *f, json_t *res, const char *code, const char *msg);

/* One FILE request, or a short chain of them, for one client request. */
struct fop
{
  struct e2b *s;
  struct evhttp_request *req;
  char sbid[33];
  char user[E2B_USER_MAX], home[E2B_USER_MAX + 8]; /* who creates what this writes */
  char *path, *path2;
  struct evbuffer *data; /* read: what arrived */
  fop_done_fn done;
  int step;
  unsigned depth, max_depth;
  json_t *acc;  /* accumulated entries or results */
  json_t *todo; /* ListDir: [ [path, depth], ... ] */
  /* POST /files: the parts still to write */
  struct upload_part
  {
    char *path;
    const char *data;
    size_t len;
  } * parts;
  size_t n_parts, i_part;
  struct evbuffer *body; /* keeps the parts' bytes alive */
};

static void
fop_free (struct fop *f)
{
  free (f->path);
  free (f->path2);
  if (f->data)
    evbuffer_free (f->data);
  json_decref (f->acc);
  json_decref (f->todo);
  for (size_t i = 0; i < f->n_parts; i++)
    free (f->parts[i].path);
  free (f->parts);
  if (f->body)
    evbuffer_free (f->body);
  free (f);
}

static void
fop_on_data (void *ud, uint8_t type WR_UNUSED, const uint8_t *data, size_t len)
{
  struct fop *f = ud;
  if (f->data == NULL)
    f->data = evbuffer_new ();
  evbuffer_add (f->data, data, len);
}

static void
fop_on_done (void *ud, json_t *res)
{
  struct fop *f = ud;
  f->done (f, res, NULL, NULL);
}

static void
fop_on_error (void *ud, const char *code, const char *message)
{
  struct fop *f = ud;
  f->done (f, NULL, code, message);
}

/* Send one FILE request (body is consumed); write data when not NULL. */
static void
fop_send (struct fop *f, json_t *body, const void *data, size_t len, bool write)
{
  struct sandbox *sb = find_e2b (f->s, f->sbid);
  const char *ccode, *cmsg;
  if (usable (sb, &ccode, &cmsg) == NULL)
    {
      json_decref (body);
      f->done (f, NULL, ccode[0] == 'n' ? WR_E_NOT_FOUND : WR_E_UNAVAILABLE, cmsg);
      return;
    }
  static const struct agent_ops ops = { fop_on_data, fop_on_done, fop_on_error };
  uint32_t sid = agent_request (sb->conn, WR_MSG_FILE, body, &ops, f);
  json_decref (body);
  if (sid == 0)
    {
      f->done (f, NULL, WR_E_UNAVAILABLE, "the sandbox agent is gone");
      return;
    }
  if (write)
    {
      agent_send (sb->conn, sid, WR_MSG_DATA, data, len);
      if (len)
        agent_send (sb->conn, sid, WR_MSG_DATA, "", 0);
    }
}

static void
fop_file (struct fop *f, const char *op, const char *path, bool flag)
{
  json_t *b = json_pack ("{s:s,s:s}", "op", op, "path", path);
  if (strcmp (op, "mkdir") == 0)
    {
      json_object_set_new (b, "parents", json_boolean (flag));
      json_object_set_new (b, "user", json_string (f->user)); /* what it creates is theirs */
    }
  if (strcmp (op, "stat") == 0 || strcmp (op, "list") == 0)
    json_object_set_new (b, "names", json_true ()); /* owner names */
  if (strcmp (op, "remove") == 0)
    json_object_set_new (b, "recursive", json_boolean (flag));
  fop_send (f, b, NULL, 0, false);
}

static struct fop *
fop_new (struct e2b *s, struct sandbox *sb, struct evhttp_request *req, fop_done_fn done)
{
  struct fop *f = calloc (1, sizeof *f);
  if (f == NULL)
    return NULL;
  f->s = s;
  f->req = req;
  snprintf (f->sbid, sizeof f->sbid, "%s", sb->id);
  f->done = done;
  struct evkeyvalq q;
  evhttp_parse_query_str (evhttp_uri_get_query (evhttp_request_get_evhttp_uri (req)) ?: "", &q);
  request_user (req, evhttp_find_header (&q, "username"), f->user);
  evhttp_clear_headers (&q);
  user_home (f->user, f->home);
  return f;
}

static void
perm_string (unsigned mode, const char *type, char out[11])
{
  out[0] = strcmp (type, "dir") == 0 ? 'd' : strcmp (type, "symlink") == 0 ? 'l' : '-';
  const char *rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; i++)
    out[1 + i] = (mode & (1u << (8 - i))) ? rwx[i] : '-';
  out[10] = '\0';
}

/* A Warren stat object as a filesystem.EntryInfo. */
static json_t *
entry_info (json_t *st, const char *path)
{
  const char *type = json_string_value (json_object_get (st, "type"));
  type = type ? type : "other";
  const char *ft = strcmp (type, "dir") == 0       ? "FILE_TYPE_DIRECTORY"
                   : strcmp (type, "file") == 0    ? "FILE_TYPE_FILE"
                   : strcmp (type, "symlink") == 0 ? "FILE_TYPE_SYMLINK"
                                                   : "FILE_TYPE_UNSPECIFIED";
  unsigned mode = (unsigned)json_integer_value (json_object_get (st, "mode"));
  char perms[11], mtime[40], owner[E2B_USER_MAX], group[E2B_USER_MAX];
  perm_string (mode, type, perms);
  iso_time (json_number_value (json_object_get (st, "mtime")), mtime, sizeof mtime);
  json_int_t uid = json_integer_value (json_object_get (st, "uid"));
  json_int_t gid = json_integer_value (json_object_get (st, "gid"));
  /* names from the sandbox's accounts (FILE "names"), else the ids */
  const char *uname = json_string_value (json_object_get (st, "user"));
  const char *gname = json_string_value (json_object_get (st, "group"));
  snprintf (owner, sizeof owner, "%lld", (long long)uid);
  snprintf (group, sizeof group, "%lld", (long long)gid);
  if (uname || uid == 0)
    snprintf (owner, sizeof owner, "%s", uname ? uname : "root");
  if (gname || gid == 0)
    snprintf (group, sizeof group, "%s", gname ? gname : "root");
  json_t *e = json_pack (
      "{s:s,s:s,s:s,s:I,s:I,s:s,s:s,s:s,s:s}", "name", base_name (path), "type", ft, "path", path,
      "size", json_integer_value (json_object_get (st, "size")), "mode", (json_int_t)mode,
      "permissions", perms, "owner", owner, "group", group, "modifiedTime", mtime);
  json_t *target = json_object_get (st, "target");
  const char *tv = json_string_value (target);
  if (tv && tv[0] == '/')
    json_object_set (e, "symlinkTarget", target);
  else if (tv)
    {
      /* envd reports where the link points as an absolute path */
      const char *slash = strrchr (path, '/');
      int dl = slash && slash != path ? (int)(slash - path) : 0;
      json_object_set_new (e, "symlinkTarget", json_sprintf ("%.*s/%s", dl, path, tv));
    }
  return e;
}

static void
fop_fail_connect (struct fop *f, const char *code, const char *msg)
{
  reply_connect_error (f->req, connect_code (code), msg);
  fop_free (f);
}

static void
stat_done (struct fop *f, json_t *res, const char *code, const char *msg)
{
  if (code)
    return fop_fail_connect (f, code, msg);
  reply_json (f->req, 200, json_pack ("{s:o}", "entry", entry_info (res, f->path)));
  fop_free (f);
}

static void
remove_done (struct fop *f, json_t *res WR_UNUSED, const char *code, const char *msg)
{
  if (code && strcmp (code, WR_E_NOT_FOUND) != 0) /* envd: removing nothing succeeds */
    return fop_fail_connect (f, code, msg);
  reply_json (f->req, 200, json_object ());
  fop_free (f);
}

/* MakeDir: stat (exists -> already_exists, as envd), mkdir -p, stat. */
static void
mkdir_done (struct fop *f, json_t *res, const char *code, const char *msg)
{
  f->step++;
  if (f->step == 1)
    {
      if (code == NULL)
        return fop_fail_connect (f, WR_E_CONFLICT, "directory already exists");
      if (strcmp (code, WR_E_NOT_FOUND) != 0)
        return fop_fail_connect (f, code, msg);
      return fop_file (f, "mkdir", f->path, true);
    }
  if (code)
    return fop_fail_connect (f, code, msg);
  if (f->step == 2)
    return fop_file (f, "stat", f->path, false);
  reply_json (f->req, 200, json_pack ("{s:o}", "entry", entry_info (res, f->path)));
  fop_free (f);
}

/* ListDir: breadth first down to depth. */
static void list_next (struct fop *f);

static void
list_done (struct fop *f, json_t *res, const char *code, const char *msg)
{
  if (code)
    {
      if (f->step == 0 || strcmp (code, WR_E_NOT_FOUND) != 0)
        return fop_fail_connect (f, code, msg);
    }
  else
    {
      /* depth-first, as envd's directory walk: a directory's entries
       * follow its own */
      size_t i, pos = json_array_size (f->acc);
      json_t *st;
      json_array_foreach (f->acc, i, st)
      {
        const char *ep = json_string_value (json_object_get (st, "path"));
        if (ep && strcmp (ep, f->path2) == 0)
          pos = i + 1;
      }
      json_array_foreach (json_object_get (res, "entries"), i, st)
      {
        const char *name = json_string_value (json_object_get (st, "name"));
        if (name == NULL || strcmp (name, ".") == 0 || strcmp (name, "..") == 0)
          continue;
        _cleanup_free_ char *child = NULL;
        if (asprintf (&child, "%s%s%s", f->path2, strcmp (f->path2, "/") ? "/" : "", name) < 0)
          continue;
        json_array_insert_new (f->acc, pos++, entry_info (st, child));
        const char *type = json_string_value (json_object_get (st, "type"));
        if (type && strcmp (type, "dir") == 0 && f->depth < f->max_depth)
          json_array_append_new (f->todo, json_pack ("[s,I]", child, (json_int_t)f->depth + 1));
      }
    }
  f->step++;
  list_next (f);
}

static void
list_next (struct fop *f)
{
  if (json_array_size (f->todo) == 0)
    {
      reply_json (f->req, 200, json_pack ("{s:O}", "entries", f->acc));
      fop_free (f);
      return;
    }
  json_t *t = json_array_get (f->todo, 0);
  free (f->path2);
  f->path2 = strdup (json_string_value (json_array_get (t, 0)));
  f->depth = (unsigned)json_integer_value (json_array_get (t, 1));
  json_array_remove (f->todo, 0);
  fop_file (f, "list", f->path2, false);
}

/* Move: the agent has no rename, so it is `mv` run by the agent (EXEC),
 * then a stat of the destination. */
static void
move_exec_done (void *ud, json_t *res)
{
  struct fop *f = ud;
  if (json_integer_value (json_object_get (res, "exit_code")) != 0)
    {
      const char *err = f->data ? (const char *)evbuffer_pullup (f->data, -1) : "";
      bool missing = err && strstr (err, "No such file");
      return fop_fail_connect (f, missing ? WR_E_NOT_FOUND : WR_E_INVALID,
                               missing ? "source not found" : "move failed");
    }
  f->done = stat_done;
  free (f->path);
  f->path = strdup (f->path2);
  fop_file (f, "stat", f->path, false);
}

static void
move_exec_error (void *ud, const char *code, const char *message)
{
  fop_fail_connect (ud, code, message);
}

static void
move_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  if (type == WR_MSG_STDERR)
    fop_on_data (ud, type, data, len);
}

/* ---- directory watches ---- */

static void
watch_free (struct e2b *s, struct e2b_watch *w)
{
  for (struct e2b_watch **pp = &s->watches; *pp; pp = &(*pp)->next)
    if (*pp == w)
      {
        *pp = w->next;
        break;
      }
  if (w->hup)
    event_free (w->hup);
  if (w->ping)
    event_free (w->ping);
  if (w->evcon)
    evhttp_connection_set_closecb (w->evcon, NULL, NULL);
  json_decref (w->events);
  free (w->path);
  free (w);
}

/* End the agent's watch (any DATA frame does) and forget it. */
static void
watch_stop (struct e2b *s, struct e2b_watch *w)
{
  agent_send (w->conn, w->sid, WR_MSG_DATA, "", 0);
  agent_cancel (w->conn, w->sid);
  watch_free (s, w);
}

static void
watch_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct e2b_watch *w = arg;
  w->evcon = NULL;
  w->req = NULL;
  watch_stop (g_e2b, w);
}

static void
watch_hangup (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct e2b_watch *w = arg;
  struct evhttp_connection *evcon = w->evcon;
  watch_stop (g_e2b, w);
  if (evcon)
    evhttp_connection_free (evcon);
}

static const char *
watch_event_type (const char *t)
{
  static const char *const map[][2] = {
    { "create", "EVENT_TYPE_CREATE" }, { "write", "EVENT_TYPE_WRITE" },
    { "remove", "EVENT_TYPE_REMOVE" }, { "rename", "EVENT_TYPE_RENAME" },
    { "chmod", "EVENT_TYPE_CHMOD" },
  };
  for (size_t i = 0; t && i < sizeof map / sizeof map[0]; i++)
    if (strcmp (t, map[i][0]) == 0)
      return map[i][1];
  return NULL;
}

static void
watch_send (struct e2b_watch *w, uint8_t flags, json_t *j)
{
  envelope_send (w->req, flags, j);
}

/* A watch may be quiet for long: keepalive messages keep proxies (and the
 * SDK, which asks for them) from taking the stream for dead. */
static void
watch_ping (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct e2b_watch *w = arg;
  watch_send (w, 0, json_pack ("{s:{}}", "keepalive"));
}

/* false: the client had left, w is gone */
static bool
watch_ready (struct e2b_watch *w)
{
  w->ready = true;
  if (w->polling)
    {
      reply_json (w->req, 200, json_pack ("{s:s}", "watcherId", w->id));
      w->req = NULL;
      return true;
    }
  if (evhttp_request_get_connection (w->req) == NULL)
    {
      /* the client left while the agent set the watch up: the reply only
       * frees the request (evhttp detached it), and the watch goes */
      reply_stream_error (w->req, "canceled", "the client went away");
      w->req = NULL;
      watch_stop (g_e2b, w);
      return false;
    }
  stream_begin (g_e2b, w->req, watch_closed, watch_hangup, w, &w->evcon, &w->hup);
  watch_send (w, 0, json_pack ("{s:{}}", "start")); /* oneof fields at the top */
  if (w->ping_s > 0 && (w->ping = event_new (g_e2b->d->base, -1, EV_PERSIST, watch_ping, w)))
    {
      struct timeval tv = { .tv_sec = w->ping_s };
      event_add (w->ping, &tv);
    }
  return true;
}

static void
watch_on_data (void *ud, uint8_t msg_type WR_UNUSED, const uint8_t *data, size_t len)
{
  struct e2b_watch *w = ud;
  json_t *j = json_loadb ((const char *)data, len, 0, NULL);
  if (!w->ready && json_is_true (json_object_get (j, "ready")) && !watch_ready (w))
    {
      json_decref (j);
      return;
    }
  size_t i;
  json_t *ev;
  json_array_foreach (json_object_get (j, "events"), i, ev)
  {
    const char *name = json_string_value (json_object_get (ev, "name"));
    const char *type = watch_event_type (json_string_value (json_object_get (ev, "type")));
    if (name == NULL || type == NULL || !w->ready)
      continue;
    json_t *fe = json_pack ("{s:s,s:s}", "name", name, "type", type);
    json_t *st = json_object_get (ev, "entry");
    if (json_is_object (st))
      {
        _cleanup_free_ char *full = NULL;
        if (asprintf (&full, "%s%s%s", w->path, strcmp (w->path, "/") ? "/" : "", name) >= 0)
          json_object_set_new (fe, "entry", entry_info (st, full));
      }
    if (w->polling && json_array_size (w->events) < E2B_WATCH_QUEUE)
      json_array_append_new (w->events, fe);
    else if (w->polling)
      json_decref (fe); /* nobody fetched them: the oldest are kept */
    else
      watch_send (w, 0, json_pack ("{s:o}", "filesystem", fe));
  }
  json_decref (j);
}

/* The agent ended the watch on its own: an error (the sandbox went away,
 * events were lost), or a RESULT we did not ask for. */
static void
watch_on_end (struct e2b_watch *w, const char *code, const char *message)
{
  struct e2b *s = g_e2b;
  const char *cc = code ? connect_code (code) : NULL;
  if (!w->ready && w->req)
    (w->polling ? reply_connect_error : reply_stream_error) (w->req, cc ? cc : "internal",
                                                             message ? message : "watch ended");
  else if (w->req)
    {
      watch_send (w, 0x02,
                  cc ? json_pack ("{s:{s:s,s:s}}", "error", "code", cc, "message", message)
                     : json_object ());
      evhttp_send_reply_end (w->req);
    }
  watch_free (s, w);
}

static void
watch_on_done (void *ud, json_t *res WR_UNUSED)
{
  watch_on_end (ud, NULL, NULL);
}

static void
watch_on_error (void *ud, const char *code, const char *message)
{
  watch_on_end (ud, code, message);
}

static void
watch_start (struct e2b *s, struct sandbox *sb, struct evhttp_request *req, json_t *msg,
             bool polling)
{
  struct e2b_watch *w = calloc (1, sizeof *w);
  char user[E2B_USER_MAX], home[E2B_USER_MAX + 8];
  request_user (req, NULL, user);
  user_home (user, home);
  if (w == NULL
      || (w->path = abs_path (home, json_string_value (json_object_get (msg, "path")))) == NULL)
    {
      free (w);
      (polling ? reply_connect_error : reply_stream_error) (req, "resource_exhausted",
                                                            "out of memory");
      return;
    }
  snprintf (w->id, sizeof w->id, "w%u", ++s->next_watch);
  snprintf (w->sbid, sizeof w->sbid, "%s", sb->id);
  w->polling = polling;
  w->req = req;
  const char *ping = header (req, "Keepalive-Ping-Interval");
  w->ping_s = ping && atoi (ping) > 0 ? (atoi (ping) < 3600 ? atoi (ping) : 3600) : 0;
  w->events = json_array ();
  w->conn = sb->conn;
  w->next = s->watches;
  s->watches = w;
  json_t *body = json_pack ("{s:s,s:s,s:b,s:b}", "op", "watch", "path", w->path, "recursive",
                            json_is_true (json_object_get (msg, "recursive")), "entry",
                            json_is_true (json_object_get (msg, "includeEntry")));
  static const struct agent_ops ops = { watch_on_data, watch_on_done, watch_on_error };
  w->sid = agent_request (sb->conn, WR_MSG_FILE, body, &ops, w);
  json_decref (body);
  if (w->sid == 0)
    {
      watch_on_end (w, WR_E_UNAVAILABLE, "the sandbox agent is gone");
      return;
    }
  /* a watch lives as long as its client: no bound on its events */
  agent_set_data_limit (w->conn, w->sid, SIZE_MAX);
}

static struct e2b_watch *
watch_find (struct e2b *s, const char *sbid, const char *id)
{
  for (struct e2b_watch *w = s->watches; w && id; w = w->next)
    if (w->polling && w->ready && strcmp (w->sbid, sbid) == 0 && strcmp (w->id, id) == 0)
      return w;
  return NULL;
}

/* CreateWatcher is watch_start; GetWatcherEvents and RemoveWatcher. */
static void
watcher_call (struct e2b *s, struct sandbox *sb, struct evhttp_request *req, const char *method,
              json_t *msg)
{
  struct e2b_watch *w
      = watch_find (s, sb->id, json_string_value (json_object_get (msg, "watcherId")));
  if (w == NULL)
    reply_connect_error (req, "not_found", "watcher not found");
  else if (strcmp (method, "GetWatcherEvents") == 0)
    {
      reply_json (req, 200, json_pack ("{s:O}", "events", w->events));
      json_array_clear (w->events);
    }
  else
    {
      watch_stop (s, w);
      reply_json (req, 200, json_object ());
    }
}

static void
handle_filesystem (struct e2b *s, struct sandbox *sb, struct evhttp_request *req,
                   const char *method)
{
  const char *ccode, *cmsg;
  bool streaming = strcmp (method, "WatchDir") == 0;
  json_t *msg = request_message (req, streaming);
  if (msg == NULL || usable (sb, &ccode, &cmsg) == NULL)
    {
      (streaming ? reply_stream_error : reply_connect_error) (
          req, msg ? ccode : "invalid_argument", msg ? cmsg : "malformed request message");
      json_decref (msg);
      return;
    }
  const char *p = json_string_value (json_object_get (msg, "path"));
  struct fop *f = NULL;
  if (strcmp (method, "Stat") == 0 || strcmp (method, "Remove") == 0
      || strcmp (method, "MakeDir") == 0 || strcmp (method, "ListDir") == 0)
    {
      f = fop_new (s, sb, req, stat_done);
      if (f)
        f->path = abs_path (f->home, p);
    }
  if (f && strcmp (method, "Stat") == 0)
    fop_file (f, "stat", f->path, false);
  else if (f && strcmp (method, "Remove") == 0)
    {
      f->done = remove_done;
      fop_file (f, "remove", f->path, true);
    }
  else if (f && strcmp (method, "MakeDir") == 0)
    {
      f->done = mkdir_done;
      fop_file (f, "stat", f->path, false);
    }
  else if (f && strcmp (method, "ListDir") == 0)
    {
      json_t *dj = json_object_get (msg, "depth");
      f->max_depth = json_is_integer (dj) && json_integer_value (dj) > 0
                         ? (unsigned)json_integer_value (dj)
                         : 1;
      f->done = list_done;
      f->acc = json_array ();
      f->todo = json_pack ("[[s,i]]", f->path, 1);
      list_next (f);
    }
  else if (strcmp (method, "Move") == 0)
    {
      struct fop *m = fop_new (s, sb, req, stat_done);
      if (m)
        {
          m->path = abs_path (m->home, json_string_value (json_object_get (msg, "source")));
          m->path2 = abs_path (m->home, json_string_value (json_object_get (msg, "destination")));
          json_t *env = NULL;
          wrd_exec_env (sb, NULL, &env, NULL);
          json_t *b = json_pack ("{s:[s,s,s,s],s:o,s:s,s:i}", "cmd", "mv", "-T", m->path, m->path2,
                                 "env", env ? env : json_array (), "cwd", "/", "timeout_ms", 60000);
          static const struct agent_ops ops = { move_on_data, move_exec_done, move_exec_error };
          if (agent_request (sb->conn, WR_MSG_EXEC, b, &ops, m) == 0)
            fop_fail_connect (m, WR_E_UNAVAILABLE, "the sandbox agent is gone");
          json_decref (b);
        }
      else
        reply_connect_error (req, "resource_exhausted", "out of memory");
    }
  else if (f == NULL
           && (strcmp (method, "Stat") == 0 || strcmp (method, "ListDir") == 0
               || strcmp (method, "MakeDir") == 0 || strcmp (method, "Remove") == 0))
    reply_connect_error (req, "resource_exhausted", "out of memory");
  else if (streaming || strcmp (method, "CreateWatcher") == 0)
    watch_start (s, sb, req, msg, !streaming);
  else if (strcmp (method, "GetWatcherEvents") == 0 || strcmp (method, "RemoveWatcher") == 0)
    watcher_call (s, sb, req, method, msg);
  else
    reply_connect_error (req, "unimplemented", "no such filesystem call");
  json_decref (msg);
}

/* GET /files?path=P -> the bytes */
static void
download_done (struct fop *f, json_t *res WR_UNUSED, const char *code, const char *msg)
{
  if (code)
    {
      int st = strcmp (code, WR_E_NOT_FOUND) == 0 ? 404 : api_status (code);
      reply_api_error (f->req, st, msg);
    }
  else
    {
      evhttp_add_header (evhttp_request_get_output_headers (f->req), "Content-Type",
                         "application/octet-stream");
      evhttp_send_reply (f->req, 200, "OK", f->data);
    }
  fop_free (f);
}

/* POST /files: mkdir -p of each part's directory, then the write. */
static void
upload_step (struct fop *f, json_t *res WR_UNUSED, const char *code, const char *msg)
{
  if (code)
    {
      reply_api_error (f->req, api_status (code), msg);
      fop_free (f);
      return;
    }
  if (f->step > 0 && f->step % 2 == 0 && f->i_part < f->n_parts) /* a write is done */
    {
      struct upload_part *u = &f->parts[f->i_part];
      json_array_append_new (f->acc, json_pack ("{s:s,s:s,s:s}", "name", base_name (u->path),
                                                "type", "file", "path", u->path));
      f->i_part++;
    }
  if (f->i_part == f->n_parts)
    {
      reply_json (f->req, 200, json_incref (f->acc));
      fop_free (f);
      return;
    }
  struct upload_part *u = &f->parts[f->i_part];
  if (f->step++ % 2 == 0)
    {
      _cleanup_free_ char *dir = strdup (u->path);
      char *slash = dir ? strrchr (dir, '/') : NULL;
      if (slash)
        *(slash == dir ? slash + 1 : slash) = '\0';
      fop_file (f, "mkdir", dir ? dir : "/", true);
      return;
    }
  json_t *b = json_pack ("{s:s,s:s,s:b,s:s}", "op", "write", "path", u->path, "append", 0, "user",
                         f->user);
  fop_send (f, b, u->len ? u->data : "", u->len, true);
}

/* Split a multipart/form-data body into (filename, bytes) parts. */
static int
parse_multipart (const char *ctype, const char *body, size_t n, struct fop *f, const char *qpath)
{
  const char *b = strstr (ctype, "boundary=");
  if (b == NULL)
    return -1;
  b += 9;
  char delim[256];
  size_t blen = strcspn (b, ";");
  if (b[0] == '"')
    {
      b++;
      blen = strcspn (b, "\"");
    }
  if (blen == 0 || blen > 200)
    return -1;
  int dl = snprintf (delim, sizeof delim, "--%.*s", (int)blen, b);
  const char *p = memmem (body, n, delim, (size_t)dl);
  while (p)
    {
      p += dl;
      if ((size_t)(p - body) + 2 > n || (p[0] == '-' && p[1] == '-'))
        break;
      const char *hend = memmem (p, n - (size_t)(p - body), "\r\n\r\n", 4);
      if (hend == NULL)
        return -1;
      const char *data = hend + 4;
      char next_delim[260];
      int nl = snprintf (next_delim, sizeof next_delim, "\r\n%s", delim);
      const char *end = memmem (data, n - (size_t)(data - body), next_delim, (size_t)nl);
      if (end == NULL)
        return -1;
      /* filename="..." in the part's headers */
      _cleanup_free_ char *hdrs = strndup (p, (size_t)(hend - p));
      char *fn = hdrs ? strstr (hdrs, "filename=\"") : NULL;
      char *name = NULL;
      if (fn)
        {
          fn += 10;
          char *q = strchr (fn, '"');
          if (q)
            *q = '\0';
          name = fn;
        }
      const char *target = name && name[0] ? name : qpath;
      if (f->n_parts == 1 && qpath && qpath[0] && name == NULL)
        target = qpath;
      struct upload_part *np = realloc (f->parts, (f->n_parts + 1) * sizeof *np);
      if (np == NULL)
        return -1;
      f->parts = np;
      f->parts[f->n_parts].path = abs_path (f->home, target);
      f->parts[f->n_parts].data = data;
      f->parts[f->n_parts].len = (size_t)(end - data);
      f->n_parts++;
      p = end + 2;
    }
  return f->n_parts ? 0 : -1;
}

/* Content-Encoding: gzip (the SDK's gzip uploads): inflate into out,
 * at most max bytes. */
static int
gunzip_body (struct evbuffer *in, struct evbuffer *out, size_t max)
{
  z_stream z = { 0 };
  if (inflateInit2 (&z, 16 + MAX_WBITS) != Z_OK)
    return -1;
  size_t n = evbuffer_get_length (in);
  z.next_in = n ? evbuffer_pullup (in, -1) : NULL;
  z.avail_in = (uInt)n;
  int r = Z_OK;
  uint8_t buf[64 << 10];
  while (r == Z_OK)
    {
      z.next_out = buf;
      z.avail_out = sizeof buf;
      r = inflate (&z, Z_NO_FLUSH);
      size_t got = sizeof buf - z.avail_out;
      if ((r != Z_OK && r != Z_STREAM_END) || evbuffer_get_length (out) + got > max)
        r = Z_DATA_ERROR;
      else
        evbuffer_add (out, buf, got);
      if (r == Z_OK && z.avail_in == 0 && got == 0)
        r = Z_DATA_ERROR; /* truncated */
    }
  inflateEnd (&z);
  return r == Z_STREAM_END ? 0 : -1;
}

static void
handle_files (struct e2b *s, struct sandbox *sb, struct evhttp_request *req)
{
  const char *ccode, *cmsg;
  if (usable (sb, &ccode, &cmsg) == NULL)
    {
      reply_api_error (req, connect_status (ccode) == 404 ? 404 : 502, cmsg);
      return;
    }
  struct evkeyvalq q;
  evhttp_parse_query_str (evhttp_uri_get_query (evhttp_request_get_evhttp_uri (req)) ?: "", &q);
  const char *qpath = evhttp_find_header (&q, "path");
  struct fop *f = fop_new (s, sb, req, download_done);
  if (f == NULL)
    {
      evhttp_clear_headers (&q);
      reply_api_error (req, 503, "out of memory");
      return;
    }
  if (evhttp_request_get_command (req) == EVHTTP_REQ_GET)
    {
      f->path = abs_path (f->home, qpath);
      f->data = evbuffer_new ();
      evhttp_clear_headers (&q);
      fop_send (f, json_pack ("{s:s,s:s}", "op", "read", "path", f->path), NULL, 0, false);
      return;
    }
  /* POST: multipart/form-data (files), or the raw bytes (octet-stream) */
  f->done = upload_step;
  f->acc = json_array ();
  f->body = evbuffer_new ();
  const char *cenc = header (req, "Content-Encoding");
  if (cenc && strcasecmp (cenc, "gzip") == 0)
    {
      if (gunzip_body (evhttp_request_get_input_buffer (req), f->body, E2B_MAX_BODY) < 0)
        {
          evhttp_clear_headers (&q);
          reply_api_error (req, 400, "the body is not valid gzip (or inflates beyond 64 MiB)");
          fop_free (f);
          return;
        }
    }
  else if (cenc && cenc[0] && strcasecmp (cenc, "identity") != 0)
    {
      evhttp_clear_headers (&q);
      reply_api_error (req, 415, "Content-Encoding: only gzip is accepted");
      fop_free (f);
      return;
    }
  else
    evbuffer_add_buffer (f->body, evhttp_request_get_input_buffer (req));
  size_t n = evbuffer_get_length (f->body);
  const char *body = n ? (const char *)evbuffer_pullup (f->body, -1) : "";
  const char *ctype = header (req, "Content-Type");
  int r = 0;
  if (ctype && strncasecmp (ctype, "multipart/form-data", 19) == 0)
    r = parse_multipart (ctype, body, n, f, qpath);
  else if (qpath && (f->parts = calloc (1, sizeof *f->parts)))
    {
      f->parts[0] = (struct upload_part){ abs_path (f->home, qpath), body, n };
      f->n_parts = 1;
    }
  else
    r = -1;
  evhttp_clear_headers (&q);
  if (r < 0)
    {
      reply_api_error (req, 400, "expected a multipart/form-data body with files, or ?path=");
      fop_free (f);
      return;
    }
  upload_step (f, NULL, NULL, NULL);
}

/* ---- routing ---- */

/* The sandbox an envd request is for: the E2b-Sandbox-Id header, else a
 * Host of the form PORT-ID.DOMAIN (E2B's own URL scheme). */
static bool
envd_sandbox_id (struct evhttp_request *req, char id[65])
{
  const char *h = header (req, "E2b-Sandbox-Id");
  if (h && h[0])
    {
      snprintf (id, 65, "%s", h);
      return true;
    }
  const char *host = header (req, "Host");
  const char *dash = host ? strchr (host, '-') : NULL;
  if (dash && dash > host && strspn (host, "0123456789") == (size_t)(dash - host))
    {
      size_t n = strcspn (dash + 1, ".:");
      if (n && n < 65)
        {
          snprintf (id, 65, "%.*s", (int)n, dash + 1);
          return true;
        }
    }
  return false;
}

bool
wrd_compat_e2b_route (struct evhttp_request *req)
{
  struct e2b *s = g_e2b;
  if (s == NULL)
    return false;
  const char *uri = evhttp_request_get_uri (req);
  size_t plen = strcspn (uri, "?#");
  char path[512];
  if (plen >= sizeof path)
    return false;
  memcpy (path, uri, plen);
  path[plen] = '\0';
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  char id[65];
  bool envd = envd_sandbox_id (req, id);
  if (envd || strcmp (path, "/health") == 0)
    {
      struct sandbox *sb = envd ? find_e2b (s, id) : NULL;
      if (strcmp (path, "/health") == 0)
        {
          if (envd && sb == NULL)
            reply_api_error (req, 502, "sandbox not found");
          else
            evhttp_send_reply (req, 204, "No Content", NULL);
          return true;
        }
      if (strcmp (path, "/files") == 0 && (m == EVHTTP_REQ_GET || m == EVHTTP_REQ_POST))
        {
          handle_files (s, sb, req);
          return true;
        }
      if (m == EVHTTP_REQ_POST && strncmp (path, "/process.Process/", 17) == 0)
        {
          handle_process (s, sb, req, path + 17);
          return true;
        }
      if (m == EVHTTP_REQ_POST && strncmp (path, "/filesystem.Filesystem/", 23) == 0)
        {
          handle_filesystem (s, sb, req, path + 23);
          return true;
        }
      if (!envd)
        return false;
      reply_api_error (req, 404, "no such envd route");
      return true;
    }
  const char *rest = NULL;
  if (strncmp (path, "/v2/sandboxes", 13) == 0)
    rest = path + 13;
  else if (strncmp (path, "/sandboxes", 10) == 0)
    rest = path + 10;
  if (rest == NULL || (rest[0] != '\0' && rest[0] != '/'))
    return false;
  json_t *body = NULL;
  struct evbuffer *ib = evhttp_request_get_input_buffer (req);
  size_t n = evbuffer_get_length (ib);
  if (n)
    {
      body = json_loadb ((const char *)evbuffer_pullup (ib, -1), n, 0, NULL);
      if (!json_is_object (body))
        {
          json_decref (body);
          reply_api_error (req, 400, "the body must be a JSON object");
          return true;
        }
    }
  if (body == NULL)
    body = json_object ();
  if (rest[0] == '\0' || strcmp (rest, "/") == 0)
    {
      if (m == EVHTTP_REQ_POST)
        handle_create (s, req, body);
      else if (m == EVHTTP_REQ_GET)
        handle_list (s, req);
      else
        reply_api_error (req, 405, "method not allowed");
    }
  else
    handle_sandbox (s, req, rest + 1, body);
  json_decref (body);
  return true;
}

static void
e2b_gencb (struct evhttp_request *req, void *arg WR_UNUSED)
{
  if (!wrd_compat_e2b_route (req))
    reply_api_error (req, 404, "not found");
}

int
wrd_compat_e2b_attach (struct wrd *d, wr_err_t *err)
{
  if (g_e2b)
    return 0;
  struct e2b *s = calloc (1, sizeof *s);
  if (s == NULL)
    return wr_sys_error (err, "e2b");
  s->d = d;
  s->next_pid = 1000;
  g_e2b = s;
  return 0;
}

void
wrd_compat_e2b_keyed (void)
{
  if (g_e2b)
    g_e2b->keyed = true;
}

int
wrd_compat_e2b_start (struct wrd *d, const char *listen_spec, wr_err_t *err)
{
  if (wrd_compat_e2b_attach (d, err) < 0)
    return -1;
  struct e2b *s = g_e2b;
  s->http = evhttp_new (d->base);
  if (s->http == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "evhttp_new");
  evhttp_set_gencb (s->http, e2b_gencb, s);
  evhttp_set_max_body_size (s->http, E2B_MAX_BODY);
  evhttp_set_max_headers_size (s->http, WR_HTTPD_HEADER_MAX);
  evhttp_set_allowed_methods (s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_DELETE
                                           | EVHTTP_REQ_PUT | EVHTTP_REQ_HEAD);
  evhttp_set_timeout (s->http, 3600);
  if (wr_http_serve_tcp (s->http, listen_spec, "--listen-e2b", 1024, NULL, err) < 0)
    return -1;
  wrd_log (WRD_LOG_INFO, "E2B API on %s", listen_spec);
  return 0;
}

void
wrd_compat_e2b_stop (struct wrd *d WR_UNUSED)
{
  struct e2b *s = g_e2b;
  if (s == NULL)
    return;
  while (s->watches)
    {
      struct e2b_watch *w = s->watches;
      if (w->evcon)
        evhttp_connection_set_closecb (w->evcon, NULL, NULL);
      w->evcon = NULL;
      agent_cancel (w->conn, w->sid);
      watch_on_end (w, WR_E_UNAVAILABLE, "the daemon is shutting down");
    }
  while (s->procs)
    {
      struct e2b_proc *p = s->procs;
      struct sandbox *sb = find_e2b (s, p->sbid);
      if (sb && sb->conn == p->conn)
        agent_cancel (p->conn, p->sid);
      proc_free (s, p);
    }
  if (s->http)
    {
      wr_accept_guards_free (s->http);
      evhttp_free (s->http);
    }
  free (s);
  g_e2b = NULL;
}

/* fncall: warm pools of container sandboxes that run one stateless call at
 * a time (fncall.h, docs/fncall.md).
 *
 * A pool is keyed by (image, language, memory). Its members are internal
 * sandboxes; each serves calls one after the other:
 *  - cmd calls are one agent EXEC with a "call" object: the agent spawns the
 *    command as the member's call uid with rlimits, a seccomp filter and a
 *    fresh scratch dir, and sweeps the uid's processes and files before it
 *    answers (src/agent/zygote.c);
 *  - Python calls are frames on the stdin of the member's zygote, a
 *    long-running exec of src/zygote/pyzygote.py; results come back on its
 *    stdout. The zygote runs calls in the pool's mode (fork or reuse), which
 *    the pool's owner sets (PUT /v1/fncall/pools, --fncall-pool); a call can
 *    only restate it.
 * Calls wait in a bounded FIFO per pool; a member that dies mid-call has its
 * call retried once on another member. */
#include "daemon/fncall.h"
#include "daemon/log.h"

#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>

#include "common/b64.h"
#include "common/proto.h"
#include "common/util.h"
#include "daemon/backends.h"
#include "daemon/http_util.h"

#define DEFAULT_TIMEOUT_S 30.0
#define MAX_TIMEOUT_S 3600.0
#define DEFAULT_MEMORY_MB 256
#define DEFAULT_CAP (1u << 20)
#define MAX_CAP (16u << 20)
#define CALL_NPROC 64
#define CALL_FSIZE (64ull << 20)
#define CALL_NOFILE 256
#define SCRATCH "/tmp/.wr-call"
#define UID_FIRST 10000
#define UID_COUNT 50000
#define ZYGOTE_GRACE_MS 5000 /* watchdog beyond the call's own timeout */
#define ZYGOTE_START_MS 30000
#define MAX_ZYGOTE_FRAME (64u << 20)
/* A reuse member's zygote replaces its worker (a fork in the sandbox) every
 * max_calls calls; the member itself goes after this many times as many:
 * rebuilding a sandbox and its interpreter every 1,000 sub-millisecond
 * calls cost a reuse pool a fifth of its throughput. */
#define REUSE_MEMBER_FACTOR 16
#define DEFAULT_PRELOAD "json,math,re,collections,itertools,functools,random,string,base64"

enum lang
{
  LANG_CMD,
  LANG_PYTHON,
};

enum member_state
{
  M_STARTING, /* Python zygote not ready yet */
  M_IDLE,
  M_BUSY,
};

struct fn_call;
struct fn_pool;

struct fn_member
{
  struct fn_pool *pool;
  struct sandbox *sb;
  enum member_state state;
  unsigned uid;
  uint32_t zsid;         /* the zygote's exec stream */
  struct evbuffer *zbuf; /* zygote stdout not parsed yet */
  long zpid;             /* zygote pid inside the sandbox */
  bool reuse;            /* the mode its zygote was started in */
  struct fn_call *cur;
  struct event *watchdog;
  unsigned calls;
  uint64_t idle_since_ms, started_ms;
  struct fn_member *next;
};

struct fn_pool
{
  char key[400];
  char image[256];
  enum lang lang;
  bool reuse; /* Python calls share a long-lived worker (set by the owner only) */
  unsigned memory_mb;
  unsigned size, min; /* members wanted while busy / kept when idle */
  bool configured;
  struct fn_member *members;
  unsigned n_members;
  struct fn_call *qhead, *qtail;
  unsigned qlen;
  uint64_t last_call_ms;
  unsigned start_failures; /* in a row */
  char last_error[300];
  uint64_t calls, retries, rejected, replaced, failed;
  uint64_t abandoned; /* calls whose caller hung up before the answer */
  struct fn_pool *next;
};

struct fn_call
{
  struct wrd *d;
  struct evhttp_request *req;
  struct evhttp_connection *evcon;
  struct event *hangup; /* the caller's socket closed (EV_CLOSED) */
  struct fn_pool *pool;
  struct fn_member *m;
  json_t *body; /* agent EXEC body (cmd) or zygote request (python) */
  char *in;     /* decoded stdin (cmd) */
  size_t in_len;
  double timeout_s;
  struct evbuffer *out, *err;
  uint32_t sid;
  unsigned tries;
  int want_reuse; /* the mode the caller restated: -1 none, 0 fork, 1 reuse */
  bool client_gone, queued;
  uint64_t t0_ns, start_ns;
  struct fn_call *qnext;
};

/* A call's stdin staged in-process (wrd_fncall_stage): named by a random
 * ref, taken by the one call whose body says "stdin_ref". */
struct fn_staged
{
  char ref[WRD_FNCALL_REF_LEN + 1];
  char *data;
  size_t len;
  struct fn_staged *next;
};

struct wrd_fncall
{
  struct wrd_fncall_config cfg;
  struct fn_staged *staged;
  char *zygote; /* script text, NULL when not found */
  char zygote_path[PATH_MAX];
  char preload[512];
  struct fn_pool *pools;
  struct event *fill_ev, *tick_ev;
  unsigned next_uid;
};

static void pool_dispatch (struct wrd *d, struct fn_pool *p);
static void fill_kick (struct wrd *d);
static void member_kill (struct wrd *d, struct fn_member *m, const char *why);

/* ---- replies ---- */

static void
call_free (struct fn_call *c)
{
  if (c->evcon)
    evhttp_connection_set_closecb (c->evcon, NULL, NULL);
  if (c->hangup)
    event_free (c->hangup);
  json_decref (c->body);
  free (c->in);
  if (c->out)
    evbuffer_free (c->out);
  if (c->err)
    evbuffer_free (c->err);
  free (c);
}

static void call_fail (struct fn_call *c, const char *code, const char *fmt, ...)
    __attribute__ ((format (printf, 3, 4)));
static void
call_fail (struct fn_call *c, const char *code, const char *fmt, ...)
{
  if (!c->client_gone)
    {
      char msg[600];
      va_list ap;
      va_start (ap, fmt);
      vsnprintf (msg, sizeof msg, fmt, ap);
      va_end (ap);
      wrd_reply_error_code (c->req, code, msg);
    }
  if (c->pool)
    c->pool->failed++;
  call_free (c);
}

static void
call_reply (struct fn_call *c, json_t *r)
{
  if (c->client_gone)
    {
      json_decref (r);
      call_free (c);
      return;
    }
  size_t n = evbuffer_get_length (c->out);
  wrd_json_set_bytes (r, "stdout", evbuffer_pullup (c->out, -1), n);
  n = evbuffer_get_length (c->err);
  wrd_json_set_bytes (r, "stderr", evbuffer_pullup (c->err, -1), n);
  bool trunc = json_is_true (json_object_get (r, "stdout_truncated"))
               || json_is_true (json_object_get (r, "stderr_truncated"));
  json_object_set_new (r, "truncated", json_boolean (trunc));
  if (!json_is_boolean (json_object_get (r, "timed_out")))
    json_object_set_new (r, "timed_out", json_false ());
  /* the call ran: its exit, timeout or OOM is the task's (err.c) */
  json_object_set_new (r, "infra_failure", json_false ());
  uint64_t now = wr_now_ns ();
  json_object_set_new (r, "fncall",
                       json_pack ("{s:s,s:s,s:I,s:I,s:I}", "pool", c->pool->key, "sandbox",
                                  c->m && c->m->sb ? c->m->sb->id : "", "queued_ms",
                                  (json_int_t)((c->start_ns - c->t0_ns) / 1000000), "total_ms",
                                  (json_int_t)((now - c->t0_ns) / 1000000), "attempts",
                                  (json_int_t)c->tries));
  wrd_metrics_exec (c->d, (double)(now - c->t0_ns) / 1e9, true);
  wrd_reply_json (c->req, 200, r);
  call_free (c);
}

/* The caller went away: a queued call is dropped, a running one is
 * stopped so that its member serves the next call now, not after the
 * call's own timeout. */
static void
client_closed (struct evhttp_connection *evcon WR_UNUSED, void *arg)
{
  struct fn_call *c = arg;
  c->client_gone = true;
  c->evcon = NULL;
  if (c->hangup)
    {
      event_free (c->hangup); /* its fd is evhttp's, and may be closed now */
      c->hangup = NULL;
    }
  if (c->pool)
    c->pool->abandoned++;
  if (c->queued)
    {
      struct fn_pool *p = c->pool;
      for (struct fn_call **l = &p->qhead; *l; l = &(*l)->qnext)
        if (*l == c)
          {
            *l = c->qnext;
            if (p->qtail == c)
              {
                p->qtail = NULL;
                for (struct fn_call *x = p->qhead; x; x = x->qnext)
                  p->qtail = x;
              }
            p->qlen--;
            break;
          }
      call_free (c);
      return;
    }
  struct fn_member *m = c->m;
  if (m == NULL)
    return; /* between members (a retry being queued): call_lost frees it */
  /* A command: SIGKILL its process group; the agent sweeps the call uid and
   * answers, and the member takes the next call. */
  if (c->sid && m->sb && m->sb->conn)
    {
      agent_send (m->sb->conn, c->sid, WR_MSG_SIGNAL, "{\"signal\":9}", 12);
      return;
    }
  /* A Python call runs in the zygote, which reads no request until the call
   * ends: the member is replaced (call_lost frees the call). */
  if (m->cur == c)
    {
      struct fn_pool *p = c->pool;
      member_kill (c->d, m, "its caller hung up"); /* frees c */
      p->replaced--;                               /* the caller's doing, not damage */
    }
}

/* evhttp does not read a connection while it answers it, so its close
 * callback fires only once the answer is written: without this, a call
 * whose caller hung up would hold its member until its own timeout. Watch
 * the socket for the peer's close (EPOLLRDHUP), as compat_sf.c does. */
static void
client_hangup (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct fn_call *c = arg;
  struct evhttp_connection *evcon = c->evcon;
  wrd_log (WRD_LOG_DEBUG, "fncall: the caller hung up; stopping its call");
  evhttp_connection_set_closecb (evcon, NULL, NULL);
  client_closed (evcon, c);       /* may free c */
  evhttp_connection_free (evcon); /* and the request it holds: never answered */
}

/* ---- members ---- */

static void
member_unlink (struct fn_member *m)
{
  struct fn_pool *p = m->pool;
  for (struct fn_member **l = &p->members; *l; l = &(*l)->next)
    if (*l == m)
      {
        *l = m->next;
        p->n_members--;
        return;
      }
}

/* A call's member went away under it: retry once elsewhere. */
static void
call_lost (struct wrd *d, struct fn_call *c, const char *why)
{
  struct fn_pool *p = c->pool;
  c->m = NULL;
  c->sid = 0;
  if (c->client_gone)
    {
      call_free (c);
      return;
    }
  if (c->tries >= 2)
    {
      call_fail (c, WR_E_UNAVAILABLE,
                 "the fncall sandbox running this call failed twice (%s); the call was not "
                 "completed",
                 why);
      return;
    }
  p->retries++;
  evbuffer_drain (c->out, evbuffer_get_length (c->out));
  evbuffer_drain (c->err, evbuffer_get_length (c->err));
  c->qnext = p->qhead;
  p->qhead = c;
  if (p->qtail == NULL)
    p->qtail = c;
  p->qlen++;
  c->queued = true;
  (void)d;
}

/* Destroying a sandbox frees its agent connection, and member_kill often
 * runs inside that connection's callbacks: destroy on the next loop turn
 * (our streams are cancelled first, so nothing calls back meanwhile). */
static void
destroy_later_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct sandbox *sb = arg;
  wr_err_t err;
  if (wrd_sandbox_destroy (sb->d, sb, &err) < 0)
    wrd_log (WRD_LOG_WARN, "fncall: destroy %s: %s\n", sb->id, err.msg);
}

static void
member_kill (struct wrd *d, struct fn_member *m, const char *why)
{
  struct fn_pool *p = m->pool;
  struct fn_call *c = m->cur;
  m->cur = NULL;
  if (m->sb && m->sb->conn)
    {
      if (m->zsid)
        agent_cancel (m->sb->conn, m->zsid);
      if (c && c->sid)
        agent_cancel (m->sb->conn, c->sid);
    }
  if (m->watchdog)
    event_free (m->watchdog);
  if (m->zbuf)
    evbuffer_free (m->zbuf);
  member_unlink (m);
  if (m->sb)
    {
      static const struct timeval now = { 0, 0 };
      if (event_base_once (d->base, -1, EV_TIMEOUT, destroy_later_cb, m->sb, &now) < 0)
        wrd_sandbox_destroy (d, m->sb, NULL);
    }
  free (m);
  p->replaced++;
  if (c)
    call_lost (d, c, why);
  fill_kick (d);
  pool_dispatch (d, p);
}

static void
member_done (struct wrd *d, struct fn_member *m)
{
  struct fn_pool *p = m->pool;
  m->cur = NULL;
  if (m->watchdog)
    evtimer_del (m->watchdog);
  m->calls++;
  unsigned max = d->fncall->cfg.max_calls * (m->reuse ? REUSE_MEMBER_FACTOR : 1);
  if ((max && m->calls >= max) || m->reuse != p->reuse)
    {
      member_kill (d, m, "retired");
      p->replaced--; /* planned, not damage */
      return;
    }
  m->state = M_IDLE;
  m->idle_since_ms = wr_now_ms ();
  pool_dispatch (d, p);
}

static void
watchdog_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct fn_member *m = arg;
  struct wrd *d = m->sb->d;
  if (m->state == M_STARTING)
    {
      snprintf (m->pool->last_error, sizeof m->pool->last_error,
                "the Python zygote did not start within %d s", ZYGOTE_START_MS / 1000);
      m->pool->start_failures++;
    }
  member_kill (d, m, "it stopped answering");
}

static void
watchdog_arm (struct fn_member *m, uint64_t ms)
{
  if (m->watchdog == NULL)
    m->watchdog = evtimer_new (m->sb->d->base, watchdog_cb, m);
  struct timeval tv = { (time_t)(ms / 1000), (suseconds_t)(ms % 1000) * 1000 };
  evtimer_add (m->watchdog, &tv);
}

/* ---- the Python zygote channel ---- */

static void zygote_result (struct wrd *d, struct fn_member *m, json_t *hdr, const uint8_t *body);

static void
zygote_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct fn_member *m = ud;
  struct wrd *d = m->sb->d;
  if (type == WR_MSG_STDERR)
    {
      wrd_log (WRD_LOG_WARN, "fncall zygote %s: %.*s", m->sb->id, (int)(len > 2000 ? 2000 : len),
               (const char *)data);
      return;
    }
  evbuffer_add (m->zbuf, data, len);
  for (;;)
    {
      size_t have = evbuffer_get_length (m->zbuf);
      if (have < 4)
        return;
      uint8_t *h = evbuffer_pullup (m->zbuf, 4);
      uint32_t n
          = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
      if (n > MAX_ZYGOTE_FRAME)
        {
          member_kill (d, m, "its zygote sent a malformed frame");
          return;
        }
      if (have < 4 + (size_t)n)
        return;
      uint8_t *p = evbuffer_pullup (m->zbuf, 4 + (ssize_t)n);
      json_t *hdr = json_loadb ((const char *)p + 4, n, 0, NULL);
      json_int_t ol = json_integer_value (json_object_get (hdr, "out_len"));
      json_int_t el = json_integer_value (json_object_get (hdr, "err_len"));
      if (hdr == NULL || ol < 0 || el < 0 || ol > MAX_ZYGOTE_FRAME || el > MAX_ZYGOTE_FRAME)
        {
          json_decref (hdr);
          member_kill (d, m, "its zygote sent a malformed frame");
          return;
        }
      size_t total = 4 + (size_t)n + (size_t)ol + (size_t)el;
      if (have < total)
        {
          json_decref (hdr);
          return;
        }
      p = evbuffer_pullup (m->zbuf, (ssize_t)total);
      /* zygote_result may free m: copy what it needs first */
      struct evbuffer *z = m->zbuf;
      uint8_t *body = malloc ((size_t)ol + (size_t)el + 1);
      memcpy (body, p + 4 + n, (size_t)ol + (size_t)el);
      evbuffer_drain (z, total);
      json_object_set_new (hdr, "out_len", json_integer (ol));
      zygote_result (d, m, hdr, body);
      json_decref (hdr);
      free (body);
      return; /* one result per call; anything more is a protocol error caught next time */
    }
}

static void
zygote_on_done (void *ud, json_t *res)
{
  struct fn_member *m = ud;
  struct wrd *d = m->sb->d;
  m->zsid = 0;
  const char *why = json_string_value (json_object_get (res, "error"));
  if (m->state == M_STARTING)
    {
      struct fn_pool *p = m->pool;
      p->start_failures++;
      snprintf (p->last_error, sizeof p->last_error,
                "the Python zygote of image %s exited before it was ready (%s)", p->image,
                why ? why : "exit status " /* completed below */);
      if (why == NULL)
        snprintf (p->last_error, sizeof p->last_error,
                  "the Python zygote of image %s exited before it was ready (exit %lld)", p->image,
                  json_integer_value (json_object_get (res, "exit_code")));
    }
  member_kill (d, m, "its zygote exited");
}

static void
zygote_on_error (void *ud, const char *code, const char *message)
{
  struct fn_member *m = ud;
  m->zsid = 0;
  if (m->state == M_STARTING)
    {
      m->pool->start_failures++;
      snprintf (m->pool->last_error, sizeof m->pool->last_error, "zygote: %s: %s", code, message);
    }
  member_kill (m->sb->d, m, "its agent connection was lost");
}

static int
zygote_start (struct wrd *d, struct fn_member *m, wr_err_t *err)
{
  struct wrd_fncall *f = d->fncall;
  if (f->zygote == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED,
                     "Python calls are not available: pyzygote.py was not found (warrend "
                     "--fncall-zygote PATH)");
  char uid[16], scratch[64] = SCRATCH, worker_calls[16];
  snprintf (uid, sizeof uid, "%u", m->uid);
  snprintf (worker_calls, sizeof worker_calls, "%u", f->cfg.max_calls);
  json_t *env = json_pack ("[s,s,s]", "PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                           "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8");
  json_t *body
      = json_pack ("{s:[s,s,s,s,s,s,s,s,s,s,s,s],s:o,s:s,s:b,s:I,s:I}", "cmd", "python3", "-I",
                   "-S", "-u", "-c", f->zygote, uid, uid, scratch, f->preload,
                   m->reuse ? "reuse" : "fork", worker_calls, "env", env, "cwd", "/", "stdin", 1,
                   "stdout_cap", (json_int_t)INT64_MAX / 2, "stderr_cap", (json_int_t)(1 << 20));
  static const struct agent_ops ops = { zygote_on_data, zygote_on_done, zygote_on_error };
  m->zbuf = evbuffer_new ();
  m->zsid = agent_request (m->sb->conn, WR_MSG_EXEC, body, &ops, m);
  json_decref (body);
  if (m->zsid == 0)
    return wr_error (err, 0, WR_E_UNAVAILABLE, "the pool sandbox's agent is gone");
  watchdog_arm (m, ZYGOTE_START_MS);
  return 0;
}

/* ---- pools ---- */

static const char *
lang_name (enum lang l)
{
  return l == LANG_PYTHON ? "python" : "cmd";
}

static void
pool_key (char *buf, size_t len, const char *image, enum lang lang, unsigned memory_mb)
{
  snprintf (buf, len, "%s|%s|%u", image, lang_name (lang), memory_mb);
}

static struct fn_pool *
pool_get (struct wrd *d, const char *image, enum lang lang, unsigned memory_mb, bool create,
          wr_err_t *err)
{
  struct wrd_fncall *f = d->fncall;
  char key[400];
  pool_key (key, sizeof key, image, lang, memory_mb);
  for (struct fn_pool *p = f->pools; p; p = p->next)
    if (strcmp (p->key, key) == 0)
      return p;
  if (!create)
    return NULL;
  struct wr_image *img = NULL;
  if (wr_image_resolve (d->store, image, &img, err) < 0)
    return NULL;
  wr_image_free (img);
  struct fn_pool *p = calloc (1, sizeof *p);
  if (p == NULL)
    {
      wr_error (err, ENOMEM, WR_E_INTERNAL, "fncall pool");
      return NULL;
    }
  snprintf (p->key, sizeof p->key, "%s", key);
  snprintf (p->image, sizeof p->image, "%s", image);
  p->lang = lang;
  p->memory_mb = memory_mb;
  p->size = f->cfg.default_size;
  p->min = 0;
  p->next = f->pools;
  f->pools = p;
  return p;
}

/* Build one member (blocking: one sandbox creation, a few ms). */
static int
member_add (struct wrd *d, struct fn_pool *p, wr_err_t *err)
{
  struct wrd_fncall *f = d->fncall;
  /* The sandbox holds the call's memory plus the agent (and zygote). */
  unsigned sb_mem = p->memory_mb + (p->lang == LANG_PYTHON ? 128 : 32);
  json_t *req
      = json_pack ("{s:s,s:I,s:I,s:f,s:s}", "image", p->image, "memory_mb", (json_int_t)sb_mem,
                   "pids_max", (json_int_t)(CALL_NPROC * 2 + 32), "cpus", 2.0, "network", "none");
  struct sandbox *sb = NULL;
  int r = wrd_sandbox_build_internal (d, req, &sb, err);
  json_decref (req);
  if (r < 0)
    {
      p->start_failures++;
      snprintf (p->last_error, sizeof p->last_error, "%s", err ? err->msg : "create failed");
      return r;
    }
  struct fn_member *m = calloc (1, sizeof *m);
  m->pool = p;
  m->sb = sb;
  m->uid = UID_FIRST + (f->next_uid++ % UID_COUNT);
  m->reuse = p->reuse;
  m->started_ms = m->idle_since_ms = wr_now_ms ();
  m->next = p->members;
  p->members = m;
  p->n_members++;
  if (p->lang == LANG_PYTHON)
    {
      m->state = M_STARTING;
      r = zygote_start (d, m, err);
      if (r < 0)
        {
          snprintf (p->last_error, sizeof p->last_error, "%s", err ? err->msg : "zygote");
          p->start_failures++;
          m->cur = NULL;
          member_unlink (m);
          wrd_sandbox_destroy (d, m->sb, NULL);
          if (m->zbuf)
            evbuffer_free (m->zbuf);
          if (m->watchdog)
            event_free (m->watchdog);
          free (m);
          return r;
        }
    }
  else
    {
      m->state = M_IDLE;
      p->start_failures = 0;
    }
  return 0;
}

static unsigned
pool_count (struct fn_pool *p, enum member_state s)
{
  unsigned n = 0;
  for (struct fn_member *m = p->members; m; m = m->next)
    n += m->state == s;
  return n;
}

/* Too many creations failed in a row: answer the waiting calls instead of
 * letting them wait for a member that will not come. */
static bool
pool_broken (struct fn_pool *p)
{
  return p->start_failures >= 3;
}

static void
pool_fail_queue (struct fn_pool *p)
{
  while (p->qhead)
    {
      struct fn_call *c = p->qhead;
      p->qhead = c->qnext;
      p->qlen--;
      c->queued = false;
      call_fail (c, WR_E_UNAVAILABLE, "fncall pool %s cannot start a sandbox: %s", p->key,
                 p->last_error);
    }
  p->qtail = NULL;
}

static void call_start (struct wrd *d, struct fn_member *m, struct fn_call *c);

static void
pool_dispatch (struct wrd *d, struct fn_pool *p)
{
  while (p->qhead)
    {
      struct fn_member *idle = NULL;
      for (struct fn_member *m = p->members; m; m = m->next)
        if (m->state == M_IDLE)
          {
            idle = m;
            break;
          }
      if (idle == NULL)
        break;
      struct fn_call *c = p->qhead;
      p->qhead = c->qnext;
      if (p->qhead == NULL)
        p->qtail = NULL;
      p->qlen--;
      c->queued = false;
      call_start (d, idle, c);
    }
  if (p->qhead)
    {
      if (pool_broken (p) && p->n_members == 0)
        pool_fail_queue (p);
      else
        fill_kick (d);
    }
}

static void
fill_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct wrd *d = arg;
  struct wrd_fncall *f = d->fncall;
  if (d->stopping)
    return;
  for (struct fn_pool *p = f->pools; p; p = p->next)
    {
      /* Pools in use grow to size; idle ones are kept at their minimum. */
      bool in_use = p->qlen > 0 || wr_now_ms () - p->last_call_ms < (uint64_t)f->cfg.idle_s * 1000;
      unsigned want = in_use && p->size > p->min ? p->size : p->min;
      if (p->n_members >= want)
        continue;
      if (pool_broken (p) && p->qlen == 0)
        continue; /* wait for demand before trying again */
      wr_err_t err;
      if (member_add (d, p, &err) < 0)
        {
          wrd_log (WRD_LOG_WARN, "fncall pool %s: %s\n", p->key, err.msg);
          if (pool_broken (p) && pool_count (p, M_IDLE) + pool_count (p, M_BUSY) == 0)
            pool_fail_queue (p);
          struct timeval tv = { 0, 200000 }; /* back off */
          evtimer_add (f->fill_ev, &tv);
          return;
        }
      pool_dispatch (d, p);
      fill_kick (d); /* one sandbox per turn: calls are served in between */
      return;
    }
}

static void
fill_kick (struct wrd *d)
{
  struct wrd_fncall *f = d->fncall;
  if (f->fill_ev && !evtimer_pending (f->fill_ev, NULL))
    {
      struct timeval tv = { 0, 0 };
      evtimer_add (f->fill_ev, &tv);
    }
}

/* Once a second: shrink pools idle for idle_s down to their minimum. */
static void
tick_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct wrd *d = arg;
  struct wrd_fncall *f = d->fncall;
  uint64_t now = wr_now_ms ();
  uint64_t idle_ms = (uint64_t)f->cfg.idle_s * 1000;
  for (struct fn_pool *p = f->pools; p; p = p->next)
    {
      if (p->qlen || now - p->last_call_ms < idle_ms)
        continue;
      for (struct fn_member *m = p->members, *next; m && p->n_members > p->min; m = next)
        {
          next = m->next;
          if (m->state == M_IDLE && now - m->idle_since_ms >= idle_ms)
            {
              member_kill (d, m, "idle");
              p->replaced--;
            }
        }
    }
  fill_kick (d);
}

/* ---- running a call ---- */

static void
cmd_on_data (void *ud, uint8_t type, const uint8_t *data, size_t len)
{
  struct fn_call *c = ud;
  evbuffer_add (type == WR_MSG_STDERR ? c->err : c->out, data, len);
}

static void
cmd_on_done (void *ud, json_t *res)
{
  struct fn_call *c = ud;
  struct fn_member *m = c->m;
  struct wrd *d = c->d;
  json_t *r = json_deep_copy (res);
  c->sid = 0;
  const char *why = json_string_value (json_object_get (r, "error"));
  if (why && evbuffer_get_length (c->err) == 0)
    evbuffer_add_printf (c->err, "warren: %s\n", why);
  bool oom = wrd_backend_exec_oom (d, m->sb, r);
  json_object_set_new (r, "mode", json_string ("fork"));
  call_reply (c, r);
  if (oom)
    member_kill (d, m, "out of memory"); /* the agent may have been hit too */
  else
    member_done (d, m);
}

static void
cmd_on_error (void *ud, const char *code, const char *message)
{
  struct fn_call *c = ud;
  struct fn_member *m = c->m;
  c->sid = 0;
  if (strcmp (code, WR_E_GONE) == 0)
    {
      member_kill (c->d, m, "its agent exited");
      return;
    }
  /* A refused request (bad argument): the member is fine. */
  struct wrd *d = c->d;
  call_fail (c, code, "%s", message);
  member_done (d, m);
}

static void
zygote_result (struct wrd *d, struct fn_member *m, json_t *hdr, const uint8_t *body)
{
  if (m->state == M_STARTING)
    {
      if (!json_is_true (json_object_get (hdr, "ready")))
        {
          member_kill (d, m, "its zygote did not start");
          return;
        }
      m->zpid = (long)json_integer_value (json_object_get (hdr, "pid"));
      m->pool->start_failures = 0;
      if (m->watchdog)
        evtimer_del (m->watchdog);
      m->state = M_IDLE;
      m->idle_since_ms = wr_now_ms ();
      pool_dispatch (d, m->pool);
      return;
    }
  struct fn_call *c = m->cur;
  if (c == NULL)
    {
      member_kill (d, m, "its zygote answered a call it did not have");
      return;
    }
  const char *zerr = json_string_value (json_object_get (hdr, "error"));
  if (zerr)
    {
      /* the zygote caught an internal failure: answer, and do not trust it again */
      char msg[400];
      snprintf (msg, sizeof msg, "%s", zerr);
      m->cur = NULL;
      c->m = NULL;
      call_fail (c, WR_E_INTERNAL, "fncall: %s", msg);
      member_kill (d, m, "zygote error");
      return;
    }
  size_t ol = (size_t)json_integer_value (json_object_get (hdr, "out_len"));
  size_t el = (size_t)json_integer_value (json_object_get (hdr, "err_len"));
  evbuffer_add (c->out, body, ol);
  evbuffer_add (c->err, body + ol, el);
  json_t *r = json_object ();
  static const char *keep[] = { "exit_code",        "signal",      "timed_out", "stdout_truncated",
                                "stderr_truncated", "duration_ms", "usage",     "mode" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (keep); i++)
    {
      json_t *v = json_object_get (hdr, keep[i]);
      if (v)
        json_object_set (r, keep[i], v);
    }
  json_t *usage = json_object_get (r, "usage");
  if (json_is_object (usage))
    json_object_set_new (usage, "oom_killed", json_false ());
  call_reply (c, r);
  member_done (d, m);
}

static void
call_start (struct wrd *d, struct fn_member *m, struct fn_call *c)
{
  struct fn_pool *p = m->pool;
  m->state = M_BUSY;
  m->cur = c;
  c->m = m;
  c->tries++;
  c->start_ns = wr_now_ns ();
  p->calls++;
  p->last_call_ms = wr_now_ms ();
  if (p->lang == LANG_CMD)
    {
      json_t *call = json_object_get (c->body, "call");
      json_object_set_new (call, "uid", json_integer (m->uid));
      json_object_set_new (call, "gid", json_integer (m->uid));
      static const struct agent_ops ops = { cmd_on_data, cmd_on_done, cmd_on_error };
      c->sid = agent_request (m->sb->conn, WR_MSG_EXEC, c->body, &ops, c);
      if (c->sid == 0)
        {
          member_kill (d, m, "its agent is gone");
          return;
        }
      if (c->in)
        agent_send (m->sb->conn, c->sid, WR_MSG_STDIN, c->in, c->in_len);
      if (json_is_true (json_object_get (c->body, "stdin")))
        agent_send (m->sb->conn, c->sid, WR_MSG_STDIN, "", 0);
      /* the agent enforces the timeout; this only catches a hung agent */
      watchdog_arm (m, (uint64_t)(c->timeout_s * 1000) + ZYGOTE_GRACE_MS);
      return;
    }
  if (c->want_reuse >= 0 && c->want_reuse != m->reuse)
    {
      /* the owner switched the pool's mode while this call waited */
      m->cur = NULL;
      c->m = NULL;
      call_fail (c, WR_E_CONFLICT,
                 "fncall pool %s now runs calls in %s mode (changed by its owner); the call "
                 "asked for %s",
                 p->key, m->reuse ? "reuse" : "fork", m->reuse ? "fork" : "reuse");
      member_done (d, m);
      return;
    }
  json_object_set_new (c->body, "mode", json_string (m->reuse ? "reuse" : "fork"));
  /* the frame right after its length prefix, copied once into the agent's
   * output buffer (the zygote passes a reuse request on as it is) */
  char *text = json_dumps (c->body, JSON_COMPACT);
  size_t n = text ? strlen (text) : 0;
  uint8_t *frame = text ? malloc (n + 4) : NULL;
  if (frame == NULL)
    {
      free (text);
      m->cur = NULL;
      c->m = NULL;
      call_fail (c, WR_E_INTERNAL, "out of memory");
      member_done (d, m);
      return;
    }
  frame[0] = (uint8_t)n, frame[1] = (uint8_t)(n >> 8), frame[2] = (uint8_t)(n >> 16),
  frame[3] = (uint8_t)(n >> 24);
  memcpy (frame + 4, text, n);
  free (text);
  int r = agent_send (m->sb->conn, m->zsid, WR_MSG_STDIN, frame, n + 4);
  free (frame);
  if (r < 0)
    {
      member_kill (d, m, "its agent is gone");
      return;
    }
  watchdog_arm (m, (uint64_t)(c->timeout_s * 1000) + ZYGOTE_GRACE_MS);
}

/* ---- request parsing ---- */

static int
get_uint (json_t *req, const char *field, json_int_t def, json_int_t min, json_int_t max,
          json_int_t *ret, wr_err_t *err)
{
  json_t *v = json_object_get (req, field);
  if (v == NULL || json_is_null (v))
    {
      *ret = def;
      return 0;
    }
  if (!json_is_integer (v) || json_integer_value (v) < min || json_integer_value (v) > max)
    return wr_error (err, 0, WR_E_INVALID, "field \"%s\" must be an integer in [%lld, %lld]", field,
                     (long long)min, (long long)max);
  *ret = json_integer_value (v);
  return 0;
}

static bool
nul_free (json_t *s)
{
  return json_is_string (s) && strlen (json_string_value (s)) == json_string_length (s);
}

static int
decode_stdin (json_t *req, char **ret, size_t *ret_len, wr_err_t *err)
{
  json_t *in = json_object_get (req, "stdin");
  *ret = NULL;
  *ret_len = 0;
  if (in == NULL || json_is_null (in))
    return 0;
  if (!json_is_string (in))
    return wr_error (err, 0, WR_E_INVALID, "field \"stdin\" must be a string");
  const char *enc = json_string_value (json_object_get (req, "stdin_encoding"));
  size_t n = json_string_length (in);
  char *buf = malloc (n + 4);
  if (buf == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "stdin");
  if (enc && strcmp (enc, "base64") == 0)
    {
      long k = wr_b64_decode (json_string_value (in), n, buf);
      if (k < 0)
        {
          free (buf);
          return wr_error (err, 0, WR_E_INVALID, "field \"stdin\" is not valid base64");
        }
      n = (size_t)k;
    }
  else if (enc && strcmp (enc, "utf-8") != 0)
    {
      free (buf);
      return wr_error (err, 0, WR_E_INVALID, "field \"stdin_encoding\" must be utf-8 or base64");
    }
  else
    memcpy (buf, json_string_value (in), n);
  *ret = buf;
  *ret_len = n;
  return 0;
}

static int
env_array (struct wrd *d, json_t *req_env, json_t **ret, wr_err_t *err)
{
  (void)d;
  json_t *env = json_object ();
  json_object_set_new (env, "PATH", json_string (WR_DEFAULT_PATH));
  json_object_set_new (env, "HOME", json_string (SCRATCH));
  json_object_set_new (env, "TMPDIR", json_string (SCRATCH));
  json_object_set_new (env, "LANG", json_string ("C.UTF-8"));
  if (req_env && !json_is_null (req_env))
    {
      if (!json_is_object (req_env) || json_object_size (req_env) > 1024)
        {
          json_decref (env);
          return wr_error (err, 0, WR_E_INVALID, "field \"env\" must be an object of strings");
        }
      const char *k;
      json_t *v;
      json_object_foreach (req_env, k, v)
      {
        if (!nul_free (v) || k[0] == '\0' || strchr (k, '=') || strlen (k) > 256
            || json_string_length (v) > 65536)
          {
            json_decref (env);
            return wr_error (err, 0, WR_E_INVALID, "field \"env\": bad entry \"%.64s\"", k);
          }
        json_object_set (env, k, v);
      }
    }
  json_t *a = json_array ();
  const char *k;
  json_t *v;
  json_object_foreach (env, k, v)
  {
    char *kv;
    if (asprintf (&kv, "%s=%s", k, json_string_value (v)) >= 0)
      {
        json_array_append_new (a, json_string (kv));
        free (kv);
      }
  }
  json_decref (env);
  *ret = a;
  return 0;
}

/* ---- staged stdin ---- */

int
wrd_fncall_stage (struct wrd *d, char *data, size_t len, char ret_ref[WRD_FNCALL_REF_LEN + 1],
                  wr_err_t *err)
{
  struct wrd_fncall *f = d->fncall;
  struct fn_staged *st = f ? calloc (1, sizeof *st) : NULL;
  if (st == NULL)
    {
      free (data);
      return f ? wr_error (err, ENOMEM, WR_E_INTERNAL, "staged stdin")
               : wr_error (err, 0, WR_E_UNSUPPORTED, "fncall is not enabled on this node");
    }
  if (wr_random_hex (st->ref, WRD_FNCALL_REF_LEN) < 0)
    {
      free (data);
      free (st);
      return wr_sys_error (err, "random ref");
    }
  st->data = data;
  st->len = len;
  st->next = f->staged;
  f->staged = st;
  memcpy (ret_ref, st->ref, WRD_FNCALL_REF_LEN + 1);
  return 0;
}

static struct fn_staged *
staged_unlink (struct wrd_fncall *f, const char *ref)
{
  for (struct fn_staged **pp = &f->staged; *pp; pp = &(*pp)->next)
    if (strcmp ((*pp)->ref, ref) == 0)
      {
        struct fn_staged *st = *pp;
        *pp = st->next;
        return st;
      }
  return NULL;
}

void
wrd_fncall_unstage (struct wrd *d, const char *ref)
{
  struct fn_staged *st = d->fncall && ref && ref[0] ? staged_unlink (d->fncall, ref) : NULL;
  if (st)
    {
      free (st->data);
      free (st);
    }
}

/* "stdin_ref": the call takes the staged bytes as its stdin (and the
 * stage is gone: a ref serves one call). */
static int
take_staged (struct wrd *d, json_t *req, char **ret, size_t *ret_len, wr_err_t *err)
{
  json_t *v = json_object_get (req, "stdin_ref");
  if (v == NULL || json_is_null (v))
    return 0;
  if (*ret)
    return wr_error (err, 0, WR_E_INVALID, "\"stdin\" and \"stdin_ref\" exclude each other");
  struct fn_staged *st
      = json_is_string (v) ? staged_unlink (d->fncall, json_string_value (v)) : NULL;
  if (st == NULL)
    return wr_error (err, 0, WR_E_INVALID,
                     "field \"stdin_ref\" names no staged input (refs are made in-process "
                     "by wrd_fncall_stage and serve one call)");
  *ret = st->data;
  *ret_len = st->len;
  free (st);
  return 0;
}

/* Validate a call; fills the pool coordinates and the body sent to the agent
 * (cmd) or the zygote (python). */
static int
parse_call (struct wrd *d, json_t *req, struct fn_call *c, const char **ret_image,
            enum lang *ret_lang, unsigned *ret_mem, int *ret_mode, wr_err_t *err)
{
  if (!json_is_object (req))
    return wr_error (err, 0, WR_E_INVALID, "request body must be a JSON object");
  const char *image = d->default_image;
  json_t *v = json_object_get (req, "image");
  if (v && !json_is_null (v))
    {
      if (!json_is_string (v) || !wr_ref_valid (json_string_value (v)))
        return wr_error (err, 0, WR_E_INVALID, "field \"image\" must be an image reference");
      image = json_string_value (v);
    }
  enum lang lang = LANG_CMD;
  v = json_object_get (req, "lang");
  if (v && !json_is_null (v))
    {
      const char *l = json_string_value (v);
      if (l && strcmp (l, "python") == 0)
        lang = LANG_PYTHON;
      else if (l == NULL || (strcmp (l, "cmd") != 0 && strcmp (l, "shell") != 0))
        return wr_error (err, 0, WR_E_INVALID, "field \"lang\" must be \"python\" or \"cmd\"");
    }
  *ret_mode = -1;
  v = json_object_get (req, "mode");
  if (v && !json_is_null (v))
    {
      const char *mo = json_string_value (v);
      if (mo && strcmp (mo, "fork") == 0)
        *ret_mode = 0;
      else if (mo && strcmp (mo, "reuse") == 0)
        *ret_mode = 1;
      else
        return wr_error (err, 0, WR_E_INVALID, "field \"mode\" must be \"fork\" or \"reuse\"");
      if (*ret_mode == 1 && lang != LANG_PYTHON)
        return wr_error (err, 0, WR_E_INVALID,
                         "\"mode\":\"reuse\" is for Python calls; commands always run as a "
                         "fresh process");
    }
  json_int_t mem, cpu_s, out_cap, err_cap;
  if (get_uint (req, "memory_mb", DEFAULT_MEMORY_MB, 16, 65536, &mem, err) < 0
      || get_uint (req, "stdout_cap", DEFAULT_CAP, 0, MAX_CAP, &out_cap, err) < 0
      || get_uint (req, "stderr_cap", DEFAULT_CAP, 0, MAX_CAP, &err_cap, err) < 0)
    return -EINVAL;
  double timeout = DEFAULT_TIMEOUT_S;
  v = json_object_get (req, "timeout_s");
  if (v && !json_is_null (v))
    {
      if (!json_is_number (v) || !(json_number_value (v) > 0)
          || json_number_value (v) > MAX_TIMEOUT_S)
        return wr_error (err, 0, WR_E_INVALID, "field \"timeout_s\" must be in (0, %g]",
                         MAX_TIMEOUT_S);
      timeout = json_number_value (v);
    }
  /* RLIMIT_CPU counts every thread of a process: a wall-clock timeout T
   * lets k threads use k x T of CPU. The default backstop never fires
   * before the timeout (a multi-threaded build was killed by SIGXCPU and
   * reported as its own failure, not as the time limit). */
  long ncpu = sysconf (_SC_NPROCESSORS_ONLN);
  double cpu_default = ceil (timeout * (double)(ncpu > 0 ? ncpu : 1)) + 1;
  if (get_uint (req, "cpu_s", (json_int_t)(cpu_default < 86400 ? cpu_default : 86400), 1, 86400,
                &cpu_s, err)
      < 0)
    return -EINVAL;
  c->timeout_s = timeout;
  json_t *limits = json_pack ("{s:I,s:I,s:I,s:I,s:I}", "cpu_s", cpu_s, "as_bytes",
                              (json_int_t)mem << 20, "nproc", (json_int_t)CALL_NPROC, "fsize_bytes",
                              (json_int_t)CALL_FSIZE, "nofile", (json_int_t)CALL_NOFILE);
  json_t *env = NULL;
  if (env_array (d, json_object_get (req, "env"), &env, err) < 0)
    {
      json_decref (limits);
      return -EINVAL;
    }
  if (decode_stdin (req, &c->in, &c->in_len, err) < 0
      || take_staged (d, req, &c->in, &c->in_len, err) < 0)
    {
      json_decref (limits);
      json_decref (env);
      return -EINVAL;
    }
  json_t *cmd = json_object_get (req, "cmd"), *shell = json_object_get (req, "shell"),
         *code = json_object_get (req, "code");
  if (cmd && json_is_null (cmd))
    cmd = NULL;
  if (shell && json_is_null (shell))
    shell = NULL;
  if (code && json_is_null (code))
    code = NULL;
  int r = 0;
  if (lang == LANG_PYTHON)
    {
      if (cmd || shell || !nul_free (code) || json_string_length (code) > (8u << 20))
        r = wr_error (err, 0, WR_E_INVALID,
                      "a Python call needs \"code\" (a string without NUL, <= 8 MiB) and no "
                      "\"cmd\"/\"shell\"");
      else
        {
          /* only the caller's variables: the zygote's environment has the rest */
          json_t *uenv = json_object_get (req, "env");
          /* "mode" is the member's, added when the call starts */
          c->body = json_pack ("{s:O,s:f,s:I,s:I,s:o,s:o}", "code", code, "timeout_s", timeout,
                               "out_cap", out_cap, "err_cap", err_cap, "limits", limits, "env",
                               json_is_object (uenv) ? json_deep_copy (uenv) : json_object ());
          json_object_set_new (c->body, "timeout_ms", json_integer ((json_int_t)(timeout * 1000)));
          limits = NULL;
          if (c->in_len)
            {
              char *b = malloc (wr_b64_encoded_len (c->in_len) + 1);
              wr_b64_encode (c->in, c->in_len, b);
              json_object_set_new (c->body, "stdin_b64", json_string (b));
              free (b);
            }
        }
    }
  else if ((cmd == NULL) == (shell == NULL) || code)
    r = wr_error (err, 0, WR_E_INVALID,
                  "exactly one of \"cmd\" or \"shell\" is required (or \"lang\":\"python\" "
                  "with \"code\")");
  else if (cmd
           && (!json_is_array (cmd) || json_array_size (cmd) == 0 || json_array_size (cmd) > 65536))
    r = wr_error (err, 0, WR_E_INVALID, "field \"cmd\" must be a non-empty array of strings");
  else if (shell && !nul_free (shell))
    r = wr_error (err, 0, WR_E_INVALID, "field \"shell\" must be a string without NUL");
  else
    {
      size_t i;
      json_t *a;
      json_array_foreach (cmd, i, a) if (!nul_free (a))
      {
        r = wr_error (err, 0, WR_E_INVALID, "field \"cmd\"[%zu] must be a string without NUL", i);
        break;
      }
      if (r == 0)
        {
          c->body = json_pack ("{s:O,s:o,s:s,s:I,s:I,s:I,s:b,s:{s:s,s:b,s:o}}",
                               cmd ? "cmd" : "shell", cmd ? cmd : shell, "env", env, "cwd", "/",
                               "timeout_ms", (json_int_t)(timeout * 1000), "stdout_cap", out_cap,
                               "stderr_cap", err_cap, "stdin", c->in != NULL, "call", "scratch",
                               SCRATCH, "seccomp", 1, "rlimits", limits);
          env = limits = NULL;
        }
    }
  json_decref (limits);
  json_decref (env); /* NULL when the cmd body took it */
  if (r < 0)
    return r;
  if (lang == LANG_PYTHON)
    {
      free (c->in);
      c->in = NULL;
    }
  *ret_image = image;
  *ret_lang = lang;
  *ret_mem = (unsigned)mem;
  return 0;
}

void
wrd_fncall_http_calls (struct wrd *d, struct evhttp_request *req)
{
  wr_err_t err;
  struct wrd_fncall *f = d->fncall;
  if (evhttp_request_get_command (req) != EVHTTP_REQ_POST)
    {
      wrd_reply_error_code (req, WR_E_INVALID, "method not allowed (POST /v1/calls)");
      return;
    }
  if (f == NULL)
    {
      wrd_reply_error_code (req, WR_E_UNSUPPORTED, "fncall is not enabled on this node");
      return;
    }
  json_t *body = NULL;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  struct fn_call *c = calloc (1, sizeof *c);
  c->d = d;
  c->req = req;
  c->out = evbuffer_new ();
  c->err = evbuffer_new ();
  c->t0_ns = c->start_ns = wr_now_ns ();
  const char *image = NULL;
  enum lang lang = LANG_CMD;
  unsigned mem = 0;
  int mode = -1;
  if (parse_call (d, body, c, &image, &lang, &mem, &mode, &err) < 0)
    {
      json_decref (body);
      call_free (c);
      wrd_reply_error (req, &err);
      return;
    }
  if (lang == LANG_PYTHON && f->zygote == NULL)
    {
      json_decref (body);
      call_free (c);
      wrd_reply_error_code (req, WR_E_UNSUPPORTED,
                            "Python calls are not available: pyzygote.py was not found (start "
                            "warrend with --fncall-zygote PATH)");
      return;
    }
  struct fn_pool *p = pool_get (d, image, lang, mem, true, &err);
  json_decref (body);
  if (p == NULL)
    {
      call_free (c);
      wrd_reply_error (req, &err);
      return;
    }
  /* The pool's owner chose its isolation mode; a caller may only restate it
   * (a call that could pick reuse could share a worker with other calls). */
  if (mode >= 0 && (mode == 1) != p->reuse)
    {
      call_free (c);
      char msg[600];
      snprintf (msg, sizeof msg,
                "fncall pool %s runs calls in %s mode; the mode is set by the pool's owner (PUT "
                "/v1/fncall/pools or warrend --fncall-pool), not by a call",
                p->key, p->reuse ? "reuse" : "fork");
      wrd_reply_error_code (req, WR_E_CONFLICT, msg);
      return;
    }
  c->pool = p;
  c->want_reuse = mode;
  if (p->qlen >= f->cfg.max_queue)
    {
      p->rejected++;
      c->pool = NULL;
      call_free (c);
      char msg[600];
      snprintf (msg, sizeof msg,
                "fncall queue for image %s is full (%u waiting, %u sandboxes busy); retry later",
                p->image, p->qlen, p->n_members);
      wrd_reply_error_code (req, WR_E_EXHAUSTED, msg);
      return;
    }
  if (pool_broken (p) && p->n_members == 0)
    p->start_failures = 2; /* demand again: allow one more attempt before failing */
  c->evcon = evhttp_request_get_connection (req);
  evhttp_connection_set_closecb (c->evcon, client_closed, c);
  int cfd = bufferevent_getfd (evhttp_connection_get_bufferevent (c->evcon));
  if (cfd >= 0 && (c->hangup = event_new (d->base, cfd, EV_CLOSED, client_hangup, c)))
    event_add (c->hangup, NULL);
  c->queued = true;
  if (p->qtail)
    p->qtail->qnext = c;
  else
    p->qhead = c;
  p->qtail = c;
  p->qlen++;
  p->last_call_ms = wr_now_ms ();
  /* A cold key pays for its first sandbox right here. */
  if (p->n_members == 0)
    {
      if (member_add (d, p, &err) < 0)
        {
          wrd_log (WRD_LOG_WARN, "fncall pool %s: %s\n", p->key, err.msg);
          if (pool_broken (p))
            {
              pool_fail_queue (p);
              return;
            }
        }
    }
  pool_dispatch (d, p);
}

/* ---- pool management ---- */

static json_t *
pools_json (struct wrd *d)
{
  json_t *a = json_array ();
  for (struct fn_pool *p = d->fncall->pools; p; p = p->next)
    {
      json_t *ms = json_array ();
      for (struct fn_member *m = p->members; m; m = m->next)
        json_array_append_new (
            ms, json_pack ("{s:s,s:s,s:I,s:I,s:I,s:I,s:s}", "sandbox", m->sb->id, "state",
                           m->state == M_STARTING ? "starting"
                           : m->state == M_IDLE   ? "idle"
                                                  : "busy",
                           "calls", (json_int_t)m->calls, "uid", (json_int_t)m->uid, "pid",
                           (json_int_t)m->sb->c.pid, "zygote_pid", (json_int_t)m->zpid, "mode",
                           m->reuse ? "reuse" : "fork"));
      json_array_append_new (
          a, json_pack ("{s:s,s:s,s:s,s:I,s:s,s:I,s:I,s:b,s:o,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:s}",
                        "key", p->key, "image", p->image, "lang", lang_name (p->lang), "memory_mb",
                        (json_int_t)p->memory_mb, "mode", p->reuse ? "reuse" : "fork", "size",
                        (json_int_t)p->size, "min", (json_int_t)p->min, "configured", p->configured,
                        "members", ms, "queued", (json_int_t)p->qlen, "calls", (json_int_t)p->calls,
                        "retries", (json_int_t)p->retries, "rejected", (json_int_t)p->rejected,
                        "replaced", (json_int_t)p->replaced, "failed", (json_int_t)p->failed,
                        "abandoned", (json_int_t)p->abandoned, "last_error", p->last_error));
    }
  struct wrd_fncall *f = d->fncall;
  return json_pack ("{s:o,s:{s:I,s:I,s:I,s:I,s:b}}", "pools", a, "config", "default_size",
                    (json_int_t)f->cfg.default_size, "max_queue", (json_int_t)f->cfg.max_queue,
                    "max_calls", (json_int_t)f->cfg.max_calls, "idle_s", (json_int_t)f->cfg.idle_s,
                    "python", f->zygote != NULL);
}

int
wrd_fncall_pool_set (struct wrd *d, const char *image, const char *lang, unsigned memory_mb,
                     unsigned size, const char *mode, wr_err_t *err)
{
  if (d->fncall == NULL)
    return wr_error (err, 0, WR_E_UNSUPPORTED, "fncall is not enabled on this node");
  if (image == NULL || !wr_ref_valid (image))
    return wr_error (err, 0, WR_E_INVALID, "\"image\" must be an image reference");
  enum lang l = LANG_CMD;
  if (lang && strcmp (lang, "python") == 0)
    l = LANG_PYTHON;
  else if (lang && strcmp (lang, "cmd") != 0)
    return wr_error (err, 0, WR_E_INVALID, "\"lang\" must be \"python\" or \"cmd\"");
  if (size > 256)
    return wr_error (err, 0, WR_E_INVALID, "pool size %u is too large (max 256)", size);
  if (memory_mb == 0)
    memory_mb = DEFAULT_MEMORY_MB;
  if (memory_mb < 16 || memory_mb > 65536)
    return wr_error (err, 0, WR_E_INVALID, "\"memory_mb\" must be in [16, 65536]");
  if (mode && strcmp (mode, "fork") != 0 && strcmp (mode, "reuse") != 0)
    return wr_error (err, 0, WR_E_INVALID, "\"mode\" must be \"fork\" or \"reuse\"");
  if (mode && strcmp (mode, "reuse") == 0 && l != LANG_PYTHON)
    return wr_error (err, 0, WR_E_INVALID, "\"reuse\" is for Python pools");
  struct fn_pool *p = pool_get (d, image, l, memory_mb, true, err);
  if (p == NULL)
    return -ENOENT;
  p->configured = true;
  p->size = size ? size : d->fncall->cfg.default_size;
  p->min = size;
  if (mode)
    p->reuse = strcmp (mode, "reuse") == 0;
  p->start_failures = 0;
  /* members started in the other mode go now (busy ones when their call ends) */
  for (struct fn_member *m = p->members, *next; m; m = next)
    {
      next = m->next;
      if (m->reuse != p->reuse && m->state != M_BUSY)
        {
          member_kill (d, m, "pool mode changed");
          p->replaced--;
        }
    }
  /* shrink at once when the size went down */
  for (struct fn_member *m = p->members, *next; m && p->n_members > p->size; m = next)
    {
      next = m->next;
      if (m->state != M_BUSY)
        {
          member_kill (d, m, "pool resized");
          p->replaced--;
        }
    }
  fill_kick (d);
  return 0;
}

int
wrd_fncall_pool_arg (struct wrd *d, const char *arg, wr_err_t *err)
{
  char buf[512];
  snprintf (buf, sizeof buf, "%s", arg);
  char *eq = strchr (buf, '=');
  if (eq == NULL)
    return wr_error (err, 0, WR_E_INVALID,
                     "--fncall-pool wants REF=N[,python][,reuse][,memory=MB]");
  *eq = '\0';
  char *rest = eq + 1, *save = NULL;
  char *tok = strtok_r (rest, ",", &save);
  char *end;
  long size = tok ? strtol (tok, &end, 10) : -1;
  if (tok == NULL || *end || size < 0)
    return wr_error (err, 0, WR_E_INVALID, "--fncall-pool %s: bad size", arg);
  const char *lang = "cmd", *mode = NULL;
  unsigned mem = 0;
  while ((tok = strtok_r (NULL, ",", &save)) != NULL)
    if (strcmp (tok, "python") == 0)
      lang = "python";
    else if (strcmp (tok, "reuse") == 0 || strcmp (tok, "fork") == 0)
      mode = tok;
    else if (strncmp (tok, "memory=", 7) == 0)
      mem = (unsigned)strtoul (tok + 7, NULL, 10);
    else
      return wr_error (err, 0, WR_E_INVALID, "--fncall-pool %s: unknown option \"%s\"", arg, tok);
  return wrd_fncall_pool_set (d, buf, lang, mem, (unsigned)size, mode, err);
}

void
wrd_fncall_http_pools (struct wrd *d, struct evhttp_request *req)
{
  wr_err_t err;
  if (d->fncall == NULL)
    {
      wrd_reply_error_code (req, WR_E_UNSUPPORTED, "fncall is not enabled on this node");
      return;
    }
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (m == EVHTTP_REQ_GET)
    {
      wrd_reply_json (req, 200, pools_json (d));
      return;
    }
  if (m != EVHTTP_REQ_PUT && m != EVHTTP_REQ_POST)
    {
      wrd_reply_error_code (req, WR_E_INVALID, "method not allowed (GET or PUT)");
      return;
    }
  json_t *body = NULL;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *size = json_object_get (body, "size"), *mem = json_object_get (body, "memory_mb");
  int r;
  if (!json_is_integer (size) || json_integer_value (size) < 0
      || (mem && !json_is_null (mem)
          && (!json_is_integer (mem) || json_integer_value (mem) < 0
              || json_integer_value (mem) > 65536)))
    r = wr_error (
        &err, 0, WR_E_INVALID,
        "PUT /v1/fncall/pools wants {\"image\",\"size\",\"lang\",\"memory_mb\",\"mode\"}");
  else
    r = wrd_fncall_pool_set (
        d, json_string_value (json_object_get (body, "image")),
        json_string_value (json_object_get (body, "lang")), (unsigned)json_integer_value (mem),
        (unsigned)(json_integer_value (size) > 1000 ? 1000 : json_integer_value (size)),
        json_string_value (json_object_get (body, "mode")), &err);
  json_decref (body);
  if (r < 0)
    wrd_reply_error (req, &err);
  else
    wrd_reply_json (req, 200, pools_json (d));
}

/* ---- init ---- */

static char *
load_zygote (const char *explicit_path, char *ret_path, size_t len)
{
  char cands[4][PATH_MAX];
  size_t n = 0;
  if (explicit_path)
    snprintf (cands[n++], PATH_MAX, "%s", explicit_path);
  else
    {
      const char *env = getenv ("WARREN_PYZYGOTE");
      if (env && env[0])
        snprintf (cands[n++], PATH_MAX, "%s", env);
      char exe[PATH_MAX];
      ssize_t k = readlink ("/proc/self/exe", exe, sizeof exe - 1);
      if (k > 0)
        {
          exe[k] = '\0';
          char *slash = strrchr (exe, '/');
          if (slash)
            *slash = '\0';
          snprintf (cands[n++], PATH_MAX, "%s/../share/warren/pyzygote.py", exe);
          snprintf (cands[n++], PATH_MAX, "%s/../../src/zygote/pyzygote.py", exe);
        }
    }
  for (size_t i = 0; i < n; i++)
    {
      char *text = NULL;
      size_t tl = 0;
      if (wr_read_file_at (AT_FDCWD, cands[i], &text, &tl, 1 << 20) == 0)
        {
          if (strlen (text) != tl || tl == 0)
            {
              free (text);
              continue;
            }
          snprintf (ret_path, len, "%s", cands[i]);
          return text;
        }
    }
  return NULL;
}

int
wrd_fncall_init (struct wrd *d, const struct wrd_fncall_config *cfg, wr_err_t *err)
{
  struct wrd_fncall *f = calloc (1, sizeof *f);
  if (f == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "fncall");
  if (cfg)
    f->cfg = *cfg;
  if (f->cfg.default_size == 0)
    f->cfg.default_size = 2;
  if (f->cfg.max_queue == 0)
    f->cfg.max_queue = 1024;
  if (f->cfg.max_calls == 0)
    f->cfg.max_calls = 1000;
  if (f->cfg.idle_s == 0)
    f->cfg.idle_s = 60;
  snprintf (f->preload, sizeof f->preload, "%s", f->cfg.preload ? f->cfg.preload : DEFAULT_PRELOAD);
  for (const char *s = f->preload; *s; s++)
    if (!(*s == ',' || *s == '.' || *s == '_' || (*s >= 'a' && *s <= 'z')
          || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9')))
      {
        free (f);
        return wr_error (err, 0, WR_E_INVALID, "--fncall-preload: bad module list \"%s\"",
                         cfg->preload);
      }
  f->zygote = load_zygote (f->cfg.zygote, f->zygote_path, sizeof f->zygote_path);
  if (f->zygote == NULL && f->cfg.zygote)
    {
      free (f);
      return wr_error (err, ENOENT, WR_E_INVALID, "--fncall-zygote %s: cannot read it",
                       cfg->zygote);
    }
  f->cfg.zygote = NULL;
  f->cfg.preload = NULL;
  f->fill_ev = evtimer_new (d->base, fill_cb, d);
  event_priority_set (f->fill_ev, 2);
  f->tick_ev = event_new (d->base, -1, EV_PERSIST, tick_cb, d);
  struct timeval tv = { 1, 0 };
  evtimer_add (f->tick_ev, &tv);
  d->fncall = f;
  return 0;
}

void
wrd_fncall_shutdown (struct wrd *d)
{
  struct wrd_fncall *f = d->fncall;
  if (f == NULL)
    return;
  while (f->staged)
    wrd_fncall_unstage (d, f->staged->ref);
  for (struct fn_pool *p = f->pools, *pn; p; p = pn)
    {
      pn = p->next;
      while (p->qhead)
        {
          struct fn_call *c = p->qhead;
          p->qhead = c->qnext;
          c->queued = false;
          call_fail (c, WR_E_UNAVAILABLE, "warrend is shutting down");
        }
      while (p->members)
        {
          struct fn_member *m = p->members;
          struct fn_call *c = m->cur;
          m->cur = NULL;
          if (m->sb && m->sb->conn)
            {
              if (m->zsid)
                agent_cancel (m->sb->conn, m->zsid);
              if (c && c->sid)
                agent_cancel (m->sb->conn, c->sid);
            }
          if (c)
            call_fail (c, WR_E_UNAVAILABLE, "warrend is shutting down");
          if (m->watchdog)
            event_free (m->watchdog);
          if (m->zbuf)
            evbuffer_free (m->zbuf);
          member_unlink (m);
          if (m->sb)
            wrd_sandbox_destroy (d, m->sb, NULL);
          free (m);
        }
      free (p);
    }
  if (f->fill_ev)
    event_free (f->fill_ev);
  if (f->tick_ev)
    event_free (f->tick_ev);
  free (f->zygote);
  free (f);
  d->fncall = NULL;
}

/* /v1/uploads (docs/api.md, Uploads): chunked uploads in the spirit of the
 * OCI distribution blob upload. POST creates one, PATCH (or PUT) appends a chunk at
 * the offset the client names (a wrong one is 416 with the current size, so
 * a client resumes from there), GET reports the size, DELETE drops it;
 * import and build consume one by id (wrd_upload_take).
 *
 * An upload is an O_TMPFILE file (mode 0600) in ROOT/uploads held open by
 * the daemon: it has no name, so nothing is left behind by a crash and no
 * path can be raced; where the filesystem has no O_TMPFILE, a file created
 * O_EXCL and unlinked at once. Ids are 128 random bits (in cluster mode
 * "NODE-" takes the place of the first hex digits, so a gateway routes by
 * the id as for sandboxes); an upload belongs
 * to the credential that created it (the TCP bearer token, by its sha256,
 * or the owner-only unix socket, which may touch any). Idle uploads are
 * reaped by a timer. State is per process: warrend serves one daemon. */
#include "daemon/uploads.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>

#include "common/util.h"
#include "daemon/cluster.h" /* cluster mode: node-named ids */
#include "daemon/http_util.h"
#include "daemon/log.h"
#include "image/internal.h" /* wr_unpack: the confined extractor */
#include "image/sha256.h"

#define DEFAULT_MAX_OPEN 64
#define DEFAULT_MAX_TOTAL (64ull << 30)
#define DEFAULT_IDLE_S 3600

struct upload
{
  char id[33];    /* 32 hex; cluster mode: "NODE-" and the rest hex */
  char owner[65]; /* "unix", or the sha256 (hex) of the Authorization header */
  int fd;
  uint64_t size;
  uint64_t used_ns; /* last PATCH or GET */
  struct upload *next;
};

static struct
{
  struct wrd *d;
  int dirfd; /* ROOT/uploads */
  struct upload *head;
  unsigned n;
  uint64_t total;
  struct event *reaper;
  /* limits (env, read once) */
  unsigned max_open;
  uint64_t max_total, max_bytes; /* max_bytes 0: the store's image byte limit */
  uint64_t idle_s;
} U = { .dirfd = -1 };

static uint64_t
env_u64 (const char *name, uint64_t dflt)
{
  const char *v = getenv (name);
  char *end;
  if (v == NULL || v[0] < '0' || v[0] > '9')
    return dflt;
  unsigned long long n = strtoull (v, &end, 10);
  return *end == '\0' && n > 0 ? n : dflt;
}

static uint64_t
upload_cap (void)
{
  if (U.max_bytes)
    return U.max_bytes;
  struct wr_store_limits l;
  wr_store_get_limits (U.d->store, &l);
  return l.image_bytes;
}

static void
upload_free (struct upload *u)
{
  if (u->fd >= 0)
    close (u->fd);
  free (u);
}

static void
unlink_upload (struct upload *u)
{
  for (struct upload **p = &U.head; *p; p = &(*p)->next)
    if (*p == u)
      {
        *p = u->next;
        U.n--;
        U.total -= u->size;
        return;
      }
}

static void
reap_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg WR_UNUSED)
{
  uint64_t now = wr_now_ns ();
  for (struct upload **p = &U.head; *p;)
    {
      struct upload *u = *p;
      if (now - u->used_ns >= U.idle_s * 1000000000ull)
        {
          wrd_log (WRD_LOG_INFO, "upload %s expired after %llu s idle (%llu bytes)", u->id,
                   (unsigned long long)U.idle_s, (unsigned long long)u->size);
          *p = u->next;
          U.n--;
          U.total -= u->size;
          upload_free (u);
        }
      else
        p = &u->next;
    }
}

/* Lazily: ROOT/uploads (owner-only, leftovers of a crash removed), limits,
 * the reaper. */
static int
uploads_init (struct wrd *d, wr_err_t *err)
{
  if (U.dirfd >= 0)
    return 0;
  _cleanup_close_ int root = open (d->root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root < 0)
    return wr_sys_error (err, "open %s", d->root);
  if (mkdirat (root, "uploads", 0700) < 0 && errno != EEXIST)
    return wr_sys_error (err, "mkdir %s/uploads", d->root);
  _cleanup_close_ int dfd
      = openat (root, "uploads", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0 || fchmod (dfd, 0700) < 0)
    return wr_sys_error (err, "open %s/uploads", d->root);
  /* only the fallback ever names a file here, for an instant */
  int dup = fcntl (dfd, F_DUPFD_CLOEXEC, 3);
  _cleanup_closedir_ DIR *dir = dup >= 0 ? fdopendir (dup) : NULL;
  for (struct dirent *de; dir && (de = readdir (dir)) != NULL;)
    if (strcmp (de->d_name, ".") != 0 && strcmp (de->d_name, "..") != 0)
      wr_rm_rf_at (dfd, de->d_name);
  U.d = d;
  U.max_open = (unsigned)env_u64 ("WARREN_UPLOADS_MAX", DEFAULT_MAX_OPEN);
  U.max_total = env_u64 ("WARREN_UPLOAD_TOTAL_BYTES", DEFAULT_MAX_TOTAL);
  U.max_bytes = env_u64 ("WARREN_UPLOAD_MAX_BYTES", 0);
  U.idle_s = env_u64 ("WARREN_UPLOAD_IDLE_S", DEFAULT_IDLE_S);
  U.reaper = event_new (d->base, -1, EV_PERSIST, reap_cb, NULL);
  if (U.reaper == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "upload reaper");
  uint64_t period = U.idle_s / 4;
  struct timeval tv = { .tv_sec = period < 1 ? 1 : period > 60 ? 60 : (time_t)period };
  event_add (U.reaper, &tv);
  U.dirfd = TAKE_FD (dfd);
  return 0;
}

static bool
from_unix_socket (struct evhttp_request *req)
{
  struct evhttp_connection *evcon = evhttp_request_get_connection (req);
  struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent (evcon) : NULL;
  evutil_socket_t fd = bev ? bufferevent_getfd (bev) : -1;
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  return fd >= 0 && getsockname (fd, (struct sockaddr *)&ss, &len) == 0 && ss.ss_family == AF_UNIX;
}

static void
owner_of (struct evhttp_request *req, char owner[65])
{
  if (from_unix_socket (req))
    {
      snprintf (owner, 65, "unix");
      return;
    }
  const char *h = evhttp_find_header (evhttp_request_get_input_headers (req), "Authorization");
  /* a gateway (holding the node token) names its client: uploads of one
   * project are not another's through the gateways */
  const char *via = evhttp_find_header (evhttp_request_get_input_headers (req), "Warren-Owner");
  char both[1024];
  int n = snprintf (both, sizeof both, "%s\n%s", h ? h : "", via ? via : "");
  if (via && n > 0 && (size_t)n < sizeof both)
    wr_sha256_hex (both, (size_t)n, owner);
  else
    wr_sha256_hex (h ? h : "", h ? strlen (h) : 0, owner);
}

/* The caller's upload id, or NULL (unknown and foreign ids alike). */
static struct upload *
find_upload (struct evhttp_request *req, const char *id)
{
  char owner[65];
  owner_of (req, owner);
  for (struct upload *u = U.head; u; u = u->next)
    if (strcmp (u->id, id) == 0)
      return strcmp (owner, "unix") == 0 || strcmp (owner, u->owner) == 0 ? u : NULL;
  return NULL;
}

static int
not_found (const char *id, wr_err_t *err)
{
  return wr_error (err, 0, WR_E_NOT_FOUND,
                   "no upload %.64s (expired, consumed, removed or never created)", id);
}

static int
new_file (char id[33], wr_err_t *err)
{
  int fd = openat (U.dirfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL))
    {
      /* no O_TMPFILE here: a private name, gone at once */
      fd = openat (U.dirfd, id, O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd >= 0)
        unlinkat (U.dirfd, id, 0);
    }
  if (fd < 0)
    return wr_error (err, errno,
                     errno == ENOSPC || errno == EDQUOT ? WR_E_EXHAUSTED : WR_E_INTERNAL,
                     "create an upload file");
  return fd;
}

static json_t *
upload_json (const struct upload *u)
{
  return json_pack ("{s:s,s:I,s:I,s:I,s:I}", "id", u->id, "size", (json_int_t)u->size, "max_bytes",
                    (json_int_t)upload_cap (), "chunk_max", (json_int_t)WRD_UPLOAD_CHUNK_MAX,
                    "expires_after_s", (json_int_t)U.idle_s);
}

static void
handle_create (struct evhttp_request *req)
{
  wr_err_t err;
  json_t *body = NULL;
  if (wrd_read_json_body (req, false, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  json_t *sv = json_object_get (body, "size");
  json_int_t declared = json_integer_value (sv);
  bool bad = sv && !json_is_null (sv) && (!json_is_integer (sv) || declared < 0);
  json_decref (body);
  char msg[256];
  if (bad)
    wrd_reply_error_code (req, WR_E_INVALID, "\"size\" is the upload's total bytes, if known");
  else if ((uint64_t)declared > upload_cap ())
    {
      snprintf (msg, sizeof msg, "an upload of %lld bytes is over the %llu byte limit",
                (long long)declared, (unsigned long long)upload_cap ());
      wrd_reply_error_code (req, WR_E_TOO_LARGE, msg);
    }
  else if (U.n >= U.max_open)
    {
      snprintf (msg, sizeof msg, "%u uploads are open (the limit); finish or delete one", U.n);
      wrd_reply_error_code (req, WR_E_EXHAUSTED, msg);
    }
  else if (U.total + (uint64_t)declared > U.max_total)
    {
      snprintf (msg, sizeof msg, "uploads hold %llu bytes; %lld more are over the %llu byte limit",
                (unsigned long long)U.total, (long long)declared, (unsigned long long)U.max_total);
      wrd_reply_error_code (req, WR_E_EXHAUSTED, msg);
    }
  else
    {
      struct upload *u = calloc (1, sizeof *u);
      char rnd[33];
      if (u == NULL || wr_random_hex (rnd, 32) < 0 || (u->fd = new_file (rnd, &err)) < 0)
        {
          if (u && u->fd < 0)
            wrd_reply_error (req, &err);
          else
            wrd_reply_error_code (req, WR_E_INTERNAL, "cannot create an upload");
          free (u);
          return;
        }
      const char *prefix = wrd_cluster_id_prefix ();
      /* 32 characters either way: clients keep their id buffers */
      snprintf (u->id, sizeof u->id, "%s%s", prefix ? prefix : "",
                rnd + (prefix ? strlen (prefix) : 0));
      owner_of (req, u->owner);
      u->used_ns = wr_now_ns ();
      u->next = U.head;
      U.head = u;
      U.n++;
      char loc[96];
      snprintf (loc, sizeof loc, "/v1/uploads/%s", u->id);
      evhttp_add_header (evhttp_request_get_output_headers (req), "Location", loc);
      wrd_reply_json (req, 201, upload_json (u));
    }
}

/* The chunk's offset: ?offset=N, or Content-Range "[bytes ]START-END[/TOTAL|*]"
 * (END inclusive, must match the body). -1 when neither or malformed. */
static int64_t
chunk_offset (struct evhttp_request *req, struct evkeyvalq *q, size_t len)
{
  const char *o = wrd_query_get (q, "offset");
  const char *cr = evhttp_find_header (evhttp_request_get_input_headers (req), "Content-Range");
  char *end;
  if (o)
    {
      if (o[0] < '0' || o[0] > '9')
        return -1;
      unsigned long long v = strtoull (o, &end, 10);
      return *end || v > INT64_MAX ? -1 : (int64_t)v;
    }
  if (cr == NULL)
    return -1;
  if (strncmp (cr, "bytes ", 6) == 0)
    cr += 6;
  if (cr[0] < '0' || cr[0] > '9')
    return -1;
  unsigned long long a = strtoull (cr, &end, 10);
  if (*end != '-' || end[1] < '0' || end[1] > '9')
    return -1;
  unsigned long long b = strtoull (end + 1, &end, 10);
  if ((*end != '\0' && *end != '/') || b < a || b - a + 1 != len || a > INT64_MAX)
    return -1;
  return (int64_t)a;
}

static void
reply_size_header (struct evhttp_request *req, const struct upload *u)
{
  char v[64];
  snprintf (v, sizeof v, "0-%lld", (long long)u->size - 1);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Range", u->size ? v : "0-0");
  snprintf (v, sizeof v, "%llu", (unsigned long long)u->size);
  evhttp_add_header (evhttp_request_get_output_headers (req), "Upload-Offset", v);
}

static int
append (struct upload *u, struct evbuffer *in, size_t len, wr_err_t *err)
{
  struct evbuffer_iovec vec[64];
  uint64_t off = u->size;
  while (len > 0)
    {
      int n = evbuffer_peek (in, -1, NULL, vec, 64);
      if (n <= 0)
        break;
      int use = n > 64 ? 64 : n;
      ssize_t w = pwritev (u->fd, (struct iovec *)vec, use, (off_t)off);
      if (w < 0 && errno == EINTR)
        continue;
      if (w <= 0)
        {
          int e = w < 0 ? errno : EIO;
          if (ftruncate (u->fd, (off_t)u->size) < 0)
            { /* the size we report stays the truth either way */
            }
          return wr_error (err, e, e == ENOSPC || e == EDQUOT ? WR_E_EXHAUSTED : WR_E_INTERNAL,
                           "write upload %s", u->id);
        }
      evbuffer_drain (in, (size_t)w);
      off += (uint64_t)w;
      len -= (size_t)w;
    }
  U.total += off - u->size;
  u->size = off;
  return 0;
}

static void
handle_patch (struct evhttp_request *req, struct upload *u, struct evkeyvalq *q)
{
  struct evbuffer *in = evhttp_request_get_input_buffer (req);
  size_t len = evbuffer_get_length (in);
  int64_t off = chunk_offset (req, q, len);
  char msg[256];
  u->used_ns = wr_now_ns ();
  if (off < 0)
    {
      wrd_reply_error_code (req, WR_E_INVALID,
                            "a chunk needs its offset: ?offset=N or Content-Range: START-END "
                            "(END inclusive, matching the body)");
      return;
    }
  if (len > WRD_UPLOAD_CHUNK_MAX)
    {
      snprintf (msg, sizeof msg, "a chunk of %zu bytes is over the %u byte limit", len,
                WRD_UPLOAD_CHUNK_MAX);
      wrd_reply_error_code (req, WR_E_TOO_LARGE, msg);
      return;
    }
  if ((uint64_t)off != u->size)
    {
      snprintf (msg, sizeof msg,
                "upload %s has %llu bytes: the next chunk starts at offset %llu, not %lld", u->id,
                (unsigned long long)u->size, (unsigned long long)u->size, (long long)off);
      reply_size_header (req, u);
      wrd_reply_json (req, 416,
                      json_pack ("{s:{s:s,s:s},s:I}", "error", "code", WR_E_INVALID, "message", msg,
                                 "size", (json_int_t)u->size));
      return;
    }
  if (u->size + len > upload_cap ())
    {
      /* it can never be imported: drop it now rather than at expiry */
      snprintf (msg, sizeof msg, "upload %s would exceed the %llu byte limit; it was removed",
                u->id, (unsigned long long)upload_cap ());
      unlink_upload (u);
      upload_free (u);
      wrd_reply_error_code (req, WR_E_TOO_LARGE, msg);
      return;
    }
  if (U.total + len > U.max_total)
    {
      snprintf (msg, sizeof msg,
                "uploads hold %llu bytes, the daemon's limit is %llu: retry later or delete some",
                (unsigned long long)U.total, (unsigned long long)U.max_total);
      wrd_reply_error_code (req, WR_E_EXHAUSTED, msg);
      return;
    }
  wr_err_t err;
  if (append (u, in, len, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  reply_size_header (req, u);
  wrd_reply_json (req, 202, json_pack ("{s:s,s:I}", "id", u->id, "size", (json_int_t)u->size));
}

static void
handle_list (struct evhttp_request *req)
{
  char owner[65];
  owner_of (req, owner);
  bool all = strcmp (owner, "unix") == 0;
  json_t *list = json_array ();
  uint64_t now = wr_now_ns ();
  for (struct upload *u = U.head; u; u = u->next)
    if (all || strcmp (owner, u->owner) == 0)
      json_array_append_new (list, json_pack ("{s:s,s:I,s:I}", "id", u->id, "size",
                                              (json_int_t)u->size, "idle_s",
                                              (json_int_t)((now - u->used_ns) / 1000000000ull)));
  wrd_reply_json (req, 200,
                  json_pack ("{s:o,s:I,s:I,s:I,s:I,s:I,s:I}", "uploads", list, "open",
                             (json_int_t)U.n, "max_open", (json_int_t)U.max_open, "total_bytes",
                             (json_int_t)U.total, "max_total_bytes", (json_int_t)U.max_total,
                             "max_bytes", (json_int_t)upload_cap (), "expires_after_s",
                             (json_int_t)U.idle_s));
}

void
wrd_http_uploads (struct wrd *d, struct evhttp_request *req, const char *rest, struct evkeyvalq *q)
{
  wr_err_t err;
  if (uploads_init (d, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  enum evhttp_cmd_type m = evhttp_request_get_command (req);
  if (rest == NULL || rest[0] == '\0')
    {
      if (m == EVHTTP_REQ_POST)
        handle_create (req);
      else if (m == EVHTTP_REQ_GET)
        handle_list (req);
      else
        wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
      return;
    }
  struct upload *u = find_upload (req, rest);
  if (u == NULL)
    {
      not_found (rest, &err);
      wrd_reply_error (req, &err);
      return;
    }
  /* PUT is the same as PATCH: every HTTP stack in the way (evhttp's
   * allowed methods, proxies, the gateway) passes it */
  if (m == EVHTTP_REQ_PATCH || m == EVHTTP_REQ_PUT)
    handle_patch (req, u, q);
  else if (m == EVHTTP_REQ_GET)
    {
      u->used_ns = wr_now_ns ();
      reply_size_header (req, u);
      wrd_reply_json (req, 200, upload_json (u));
    }
  else if (m == EVHTTP_REQ_DELETE)
    {
      unlink_upload (u);
      upload_free (u);
      wrd_reply_empty (req, 204);
    }
  else
    wrd_reply_error_code (req, WR_E_NOT_FOUND, "no such route");
}

int
wrd_upload_take (struct wrd *d, struct evhttp_request *req, const char *id, int *ret_fd,
                 wr_err_t *err)
{
  if (id == NULL || uploads_init (d, err) < 0)
    return id == NULL ? wr_error (err, 0, WR_E_INVALID, "an upload id is required") : -1;
  struct upload *u = find_upload (req, id);
  if (u == NULL)
    return not_found (id, err);
  unlink_upload (u);
  *ret_fd = TAKE_FD (u->fd);
  u->fd = -1;
  upload_free (u);
  return 0;
}

int
wrd_upload_extract (struct wrd *d, int fd, char *dir, size_t size, wr_err_t *err)
{
  int r = wr_store_tmpdir (d->store, "context", dir, size, err);
  if (r < 0)
    return r;
  _cleanup_close_ int dfd = open (dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0)
    r = wr_sys_error (err, "open %s", dir);
  else
    {
      struct wr_extract_limits lim;
      wr_store_extract_limits (d->store, false, &lim);
      struct wr_extract_stats xs;
      r = wr_unpack (fd, dfd, -1, 0, &lim, &xs, err);
      if (r < 0)
        wr_error_wrap (err, "the uploaded build context");
    }
  if (r < 0)
    {
      wrd_upload_rmdir (dir);
      dir[0] = '\0';
    }
  return r;
}

void
wrd_upload_rmdir (const char *dir)
{
  if (dir == NULL || dir[0] == '\0')
    return;
  char parent[4096];
  snprintf (parent, sizeof parent, "%s", dir);
  char *slash = strrchr (parent, '/');
  if (slash == NULL)
    return;
  *slash = '\0';
  _cleanup_close_ int pfd = open (parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd >= 0)
    wr_rm_rf_at (pfd, slash + 1);
}

/* FILE requests: read, write, stat, list, mkdir, remove inside the sandbox
 * root. Every path goes through ag_open_in_root / ag_open_parent_in_root;
 * final components are opened with O_NOFOLLOW relative to a resolved
 * directory fd, so nothing here ever touches a path outside the root. */
#include "agent/agent.h"
#include "common/b64.h"
#include "common/proto.h"
#include "common/util.h"

#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>

#define LIST_MAX_ENTRIES 100000

struct fread
{
  struct ag_req r;
  int fd;
  uint64_t left; /* bytes still allowed */
  bool truncated;
  json_t *result;
};

struct fwrite
{
  struct ag_req r;
  int fd;
};

/* Names are bytes; JSON strings are UTF-8. Non-UTF-8 names travel base64
 * with a "<key>_encoding":"base64" sibling, like the HTTP API does. */
static int
set_bytes (json_t *o, const char *key, const char *s, size_t n)
{
  if (wr_utf8_valid (s, n))
    return json_object_set_new (o, key, json_stringn (s, n));
  _cleanup_free_ char *enc = malloc (wr_b64_encoded_len (n) + 1);
  if (enc == NULL)
    return -1;
  wr_b64_encode (s, n, enc);
  char ekey[64];
  snprintf (ekey, sizeof ekey, "%s_encoding", key);
  json_object_set_new (o, ekey, json_string ("base64"));
  return json_object_set_new (o, key, json_string (enc));
}

json_t *
ag_stat_json (const char *name, const struct stat *st)
{
  const char *type = S_ISREG (st->st_mode)   ? "file"
                     : S_ISDIR (st->st_mode) ? "dir"
                     : S_ISLNK (st->st_mode) ? "symlink"
                                             : "other";
  json_t *o
      = json_pack ("{s:s,s:I,s:i,s:I,s:I,s:I}", "type", type, "size", (json_int_t)st->st_size,
                   "mode", (int)(st->st_mode & 07777), "mtime", (json_int_t)st->st_mtim.tv_sec,
                   "uid", (json_int_t)st->st_uid, "gid", (json_int_t)st->st_gid);
  if (o)
    set_bytes (o, "name", name, strlen (name));
  return o;
}

static const char *
base_name (const char *path)
{
  size_t len = strlen (path);
  while (len > 1 && path[len - 1] == '/')
    len--;
  const char *b = path + len;
  while (b > path && b[-1] != '/')
    b--;
  return *b ? b : "/";
}

static int
get_uint (json_t *body, const char *key, uint64_t def, uint64_t max, uint64_t *ret, wr_err_t *err)
{
  json_t *v = json_object_get (body, key);
  if (v == NULL || json_is_null (v))
    {
      *ret = def;
      return 0;
    }
  if (!json_is_integer (v) || json_integer_value (v) < 0 || (uint64_t)json_integer_value (v) > max)
    return wr_error (err, EINVAL, WR_E_INVALID, "\"%s\" must be an integer in [0, %llu]", key,
                     (unsigned long long)max);
  *ret = (uint64_t)json_integer_value (v);
  return 0;
}

static int
get_bool (json_t *body, const char *key, bool *ret, wr_err_t *err)
{
  json_t *v = json_object_get (body, key);
  if (v == NULL || json_is_null (v))
    *ret = false;
  else if (json_is_boolean (v))
    *ret = json_is_true (v);
  else
    return wr_error (err, EINVAL, WR_E_INVALID, "\"%s\" must be a boolean", key);
  return 0;
}

/* ---- read ---- */

static void
fread_free (struct fread *f)
{
  ag_req_unlink (&f->r);
  if (f->fd >= 0)
    close (f->fd);
  json_decref (f->result);
  ag_defer_free (f);
}

static int
op_read (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  uint64_t max;
  if (get_uint (body, "max_bytes", 0, INT64_MAX, &max, err) < 0)
    return -EINVAL;
  /* O_NONBLOCK: opening a FIFO must not hang the agent (rejected below). */
  _cleanup_close_ int fd
      = ag_open_in_root (ag.rootfd, path, O_RDONLY | O_NONBLOCK | O_NOCTTY, ag.use_openat2, err);
  if (fd < 0)
    {
      if (err->errnum == EISDIR)
        return wr_error (err, EISDIR, WR_E_INVALID, "%s: is a directory", path);
      return fd;
    }
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wr_sys_error (err, "fstat %s", path);
  if (S_ISDIR (st.st_mode))
    return wr_error (err, EISDIR, WR_E_INVALID, "%s: is a directory", path);
  if (!S_ISREG (st.st_mode))
    return wr_error (err, EINVAL, WR_E_INVALID, "%s: not a regular file", path);
  int fl = fcntl (fd, F_GETFL);
  if (fl >= 0)
    fcntl (fd, F_SETFL, fl & ~O_NONBLOCK);
  struct fread *f = calloc (1, sizeof *f);
  if (f == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  f->r.stream = stream;
  f->r.kind = AG_REQ_READ;
  f->fd = TAKE_FD (fd);
  f->left = max ? max : UINT64_MAX;
  f->result = ag_stat_json (base_name (path), &st);
  ag_req_link (&f->r);
  return 0;
}

static bool
fread_step (struct fread *f)
{
  static uint8_t buf[AG_CHUNK];
  if (f->r.orphan)
    {
      fread_free (f);
      return false;
    }
  size_t want = f->left < sizeof buf ? (size_t)f->left : sizeof buf;
  ssize_t n = 0;
  if (want > 0)
    {
      do
        n = read (f->fd, buf, want);
      while (n < 0 && errno == EINTR);
      if (n < 0)
        {
          ag_send_errorf (f->r.stream, errno, ag_errno_code (errno), "read");
          fread_free (f);
          return false;
        }
    }
  else
    {
      /* Limit reached: one more byte tells whether the file had more. */
      char c;
      f->truncated = read (f->fd, &c, 1) == 1;
    }
  if (n > 0)
    {
      ag_send (f->r.stream, WR_MSG_DATA, buf, (size_t)n);
      f->left -= (uint64_t)n;
      return true;
    }
  json_object_set_new (f->result, "truncated", json_boolean (f->truncated));
  ag_send_json (f->r.stream, WR_MSG_RESULT, json_incref (f->result));
  fread_free (f);
  return false;
}

bool
ag_file_pump (void)
{
  bool more = false;
  for (int round = 0; round < 16; round++)
    {
      more = false;
      for (struct ag_req *r = ag.reqs, *next; r; r = next)
        {
          next = r->next;
          if (r->kind != AG_REQ_READ && r->kind != AG_REQ_EXPORT)
            continue;
          if (ag.outq_bytes >= AG_OUTQ_LOW && !r->orphan)
            return false; /* resumed when the queue drains */
          if (r->kind == AG_REQ_EXPORT ? ag_export_step (r) : fread_step ((struct fread *)r))
            more = true;
        }
      if (!more)
        break;
    }
  return more;
}

/* ---- write ---- */

static void
fwrite_free (struct fwrite *f)
{
  ag_req_unlink (&f->r);
  if (f->fd >= 0)
    close (f->fd);
  ag_defer_free (f);
}

static int
op_write (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  uint64_t mode;
  bool append, has_mode = json_object_get (body, "mode") != NULL;
  struct ag_user owner;
  bool has_owner;
  if (get_uint (body, "mode", 0644, 07777, &mode, err) < 0
      || get_bool (body, "append", &append, err) < 0
      || ag_user_of (body, &owner, &has_owner, err) < 0)
    return -EINVAL;
  char base[NAME_MAX + 1];
  _cleanup_close_ int dfd = ag_open_parent_in_root (ag.rootfd, path, base, ag.use_openat2, err);
  if (dfd < 0)
    return dfd;
  int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC
              | (append ? O_APPEND : O_TRUNC);
  _cleanup_close_ int fd = openat (dfd, base, flags, (mode_t)mode);
  if (fd < 0)
    {
      if (errno == ELOOP)
        return wr_error (err, ELOOP, WR_E_INVALID, "%s: is a symlink", path);
      return wr_error (err, errno, ag_errno_code (errno), "%s", path);
    }
  struct stat st;
  if (fstat (fd, &st) < 0)
    return wr_sys_error (err, "fstat %s", path);
  if (!S_ISREG (st.st_mode))
    return wr_error (err, EINVAL, WR_E_INVALID, "%s: not a regular file", path);
  if (has_mode && fchmod (fd, (mode_t)mode) < 0)
    return wr_error (err, errno, ag_errno_code (errno), "chmod %s", path);
  /* "user": the file is theirs, whoever owned it before (as envd does) */
  if (has_owner && fchown (fd, owner.uid, owner.gid) < 0)
    return wr_error (err, errno, ag_errno_code (errno), "chown %s", path);
  int fl = fcntl (fd, F_GETFL);
  if (fl >= 0)
    fcntl (fd, F_SETFL, fl & ~O_NONBLOCK);
  struct fwrite *f = calloc (1, sizeof *f);
  if (f == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  f->r.stream = stream;
  f->r.kind = AG_REQ_WRITE;
  f->fd = TAKE_FD (fd);
  ag_req_link (&f->r);
  return 0;
}

void
ag_file_data (struct ag_req *r, const uint8_t *data, size_t len)
{
  if (r->kind == AG_REQ_WATCH)
    {
      ag_fwatch_stop (r);
      return;
    }
  if (r->kind == AG_REQ_APPLY)
    {
      ag_apply_data (r, data, len);
      return;
    }
  if (r->kind != AG_REQ_WRITE)
    return;
  struct fwrite *f = (struct fwrite *)r;
  if (len > 0)
    {
      int w = wr_write_all (f->fd, data, len);
      if (w < 0)
        {
          ag_send_errorf (r->stream, -w, ag_errno_code (-w), "write");
          fwrite_free (f);
        }
      return;
    }
  struct stat st;
  if (fstat (f->fd, &st) < 0)
    ag_send_errorf (r->stream, errno, WR_E_INTERNAL, "fstat");
  else
    ag_send_json (r->stream, WR_MSG_RESULT, json_pack ("{s:I}", "size", (json_int_t)st.st_size));
  fwrite_free (f);
}

void
ag_file_orphan (struct ag_req *r)
{
  /* A half-written file stays as it is; a read just stops. */
  if (r->kind == AG_REQ_WRITE)
    fwrite_free ((struct fwrite *)r);
  else if (r->kind == AG_REQ_WATCH)
    ag_fwatch_orphan (r);
  else if (r->kind == AG_REQ_EXPORT)
    ag_export_orphan (r);
  else if (r->kind == AG_REQ_APPLY)
    ag_apply_orphan (r);
  else
    fread_free ((struct fread *)r);
}

/* ---- stat, list, mkdir, remove ---- */

/* "names": true adds the owner's user and group names */
static bool
want_names (json_t *body, struct ag_names *n)
{
  if (!json_is_true (json_object_get (body, "names")))
    return false;
  ag_names_load (n);
  return true;
}

static int
op_stat (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  _cleanup_close_ int fd
      = ag_open_in_root (ag.rootfd, path, O_PATH | O_NOFOLLOW, ag.use_openat2, err);
  if (fd < 0)
    return fd;
  struct stat st;
  if (fstatat (fd, "", &st, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0)
    return wr_sys_error (err, "stat %s", path);
  json_t *o = ag_stat_json (base_name (path), &st);
  if (o && S_ISLNK (st.st_mode))
    {
      char target[PATH_MAX];
      ssize_t n = readlinkat (fd, "", target, sizeof target);
      if (n >= 0)
        set_bytes (o, "target", target, (size_t)n);
    }
  _cleanup_ (ag_names_free) struct ag_names names = { 0 };
  if (o && want_names (body, &names))
    ag_names_add (&names, o);
  ag_send_json (stream, WR_MSG_RESULT, o);
  return 0;
}

static int
cmp_str (const void *a, const void *b)
{
  return strcmp (*(char *const *)a, *(char *const *)b);
}

struct names
{
  char **v;
  size_t n;
};

static void
names_free (struct names *ns)
{
  for (size_t i = 0; i < ns->n; i++)
    free (ns->v[i]);
  free (ns->v);
}

static int
op_list (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  int fd = ag_open_in_root (ag.rootfd, path, O_RDONLY | O_DIRECTORY, ag.use_openat2, err);
  if (fd < 0)
    return fd;
  _cleanup_closedir_ DIR *d = fdopendir (fd);
  if (d == NULL)
    {
      close (fd);
      return wr_sys_error (err, "opendir %s", path);
    }
  _cleanup_ (names_free) struct names ns = { 0 };
  size_t cap = 0;
  bool truncated = false;
  struct dirent *de;
  errno = 0;
  while ((de = readdir (d)) != NULL)
    {
      if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
        continue;
      if (ns.n == LIST_MAX_ENTRIES)
        {
          truncated = true;
          break;
        }
      if (ns.n == cap)
        {
          cap = cap ? cap * 2 : 64;
          char **nv = realloc (ns.v, cap * sizeof *nv);
          if (nv == NULL)
            return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
          ns.v = nv;
        }
      if ((ns.v[ns.n] = strdup (de->d_name)) == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      ns.n++;
    }
  if (ns.n > 1) /* qsort wants a non-NULL base even for 0 items (UBSan, fuzz_agent) */
    qsort (ns.v, ns.n, sizeof *ns.v, cmp_str);
  json_t *entries = json_array ();
  size_t approx = 0;
  _cleanup_ (ag_names_free) struct ag_names names = { 0 };
  bool with_names = want_names (body, &names);
  for (size_t i = 0; i < ns.n; i++)
    {
      struct stat st;
      if (fstatat (dirfd (d), ns.v[i], &st, AT_SYMLINK_NOFOLLOW) < 0)
        continue; /* removed meanwhile */
      /* Keep the answer inside one frame: ~120 bytes of fields + the name. */
      approx += (with_names ? 200 : 128) + strlen (ns.v[i]) * 2;
      if (approx > WR_FRAME_MAX - 4096)
        {
          truncated = true;
          break;
        }
      json_t *o = ag_stat_json (ns.v[i], &st);
      if (o && with_names)
        ag_names_add (&names, o);
      json_array_append_new (entries, o);
    }
  ag_send_json (stream, WR_MSG_RESULT,
                json_pack ("{s:o,s:b}", "entries", entries, "truncated", truncated));
  return 0;
}

static int
mkdir_one (const char *path, mode_t mode, bool exist_ok, const struct ag_user *owner, wr_err_t *err)
{
  char base[NAME_MAX + 1];
  _cleanup_close_ int dfd = ag_open_parent_in_root (ag.rootfd, path, base, ag.use_openat2, err);
  if (dfd < 0)
    return dfd;
  if (mkdirat (dfd, base, mode) == 0)
    {
      /* only what we created changes owner */
      if (owner && fchownat (dfd, base, owner->uid, owner->gid, AT_SYMLINK_NOFOLLOW) < 0)
        return wr_error (err, errno, ag_errno_code (errno), "chown %s", path);
      return 0;
    }
  int e = errno;
  if (e == EEXIST && exist_ok)
    {
      /* Fine if it is (or, via a symlink inside the root, leads to) a dir. */
      _cleanup_close_ int fd
          = ag_open_in_root (ag.rootfd, path, O_PATH | O_DIRECTORY, ag.use_openat2, err);
      return fd < 0 ? fd : 0;
    }
  return wr_error (err, e, ag_errno_code (e), "mkdir %s", path);
}

static int
op_mkdir (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  uint64_t mode;
  bool parents;
  struct ag_user owner;
  bool has_owner;
  if (get_uint (body, "mode", 0755, 07777, &mode, err) < 0
      || get_bool (body, "parents", &parents, err) < 0
      || ag_user_of (body, &owner, &has_owner, err) < 0)
    return -EINVAL;
  const struct ag_user *own = has_owner ? &owner : NULL;
  if (parents)
    {
      /* Each prefix is resolved from the root again, so a symlink created
       * concurrently in the middle cannot lead outside. */
      _cleanup_free_ char *prefix = strdup (path);
      if (prefix == NULL)
        return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      size_t len = strlen (prefix);
      for (size_t i = 1; i <= len; i++)
        {
          if (prefix[i] != '/' && prefix[i] != '\0')
            continue;
          if (prefix[i - 1] == '/')
            continue;
          char saved = prefix[i];
          prefix[i] = '\0';
          const char *b = base_name (prefix);
          if (strcmp (b, ".") != 0 && strcmp (b, "..") != 0
              && mkdir_one (prefix, (mode_t)mode, true, own, err) < 0)
            return -EINVAL;
          prefix[i] = saved;
        }
    }
  else if (mkdir_one (path, (mode_t)mode, false, own, err) < 0)
    return -EINVAL;
  ag_send_json (stream, WR_MSG_RESULT, json_object ());
  return 0;
}

static int
op_remove (uint32_t stream, const char *path, json_t *body, wr_err_t *err)
{
  bool recursive;
  if (get_bool (body, "recursive", &recursive, err) < 0)
    return -EINVAL;
  char base[NAME_MAX + 1];
  _cleanup_close_ int dfd = ag_open_parent_in_root (ag.rootfd, path, base, ag.use_openat2, err);
  if (dfd < 0)
    return dfd;
  struct stat st;
  if (fstatat (dfd, base, &st, AT_SYMLINK_NOFOLLOW) < 0)
    return wr_error (err, errno, ag_errno_code (errno), "%s", path);
  int r;
  if (S_ISDIR (st.st_mode) && recursive)
    r = wr_rm_rf_at (dfd, base); /* never follows symlinks or crosses mounts */
  else
    r = unlinkat (dfd, base, S_ISDIR (st.st_mode) ? AT_REMOVEDIR : 0) < 0 ? -errno : 0;
  if (r < 0)
    {
      if (r == -ENOTEMPTY || r == -EEXIST)
        return wr_error (err, ENOTEMPTY, WR_E_CONFLICT, "%s: directory not empty", path);
      return wr_error (err, -r, ag_errno_code (-r), "remove %s", path);
    }
  ag_send_json (stream, WR_MSG_RESULT, json_object ());
  return 0;
}

void
ag_file_start (uint32_t stream, json_t *body)
{
  wr_err_t err = { 0 };
  const char *op = json_string_value (json_object_get (body, "op"));
  json_t *jp = json_object_get (body, "path");
  const char *path = json_string_value (jp);
  if (op == NULL)
    wr_error (&err, EINVAL, WR_E_INVALID, "missing \"op\"");
  else if (path == NULL)
    wr_error (&err, EINVAL, WR_E_INVALID, "missing \"path\"");
  else if (ag_path_check (path, json_string_length (jp), &err) < 0)
    ;
  else if (strcmp (op, "export") == 0 || strcmp (op, "apply") == 0)
    {
      if (strcmp (path, "/") != 0)
        wr_error (&err, EINVAL, WR_E_INVALID, "%s takes the path \"/\" (the whole tree)", op);
      else if (op[0] == 'e')
        ag_export_start (stream, body, &err);
      else
        ag_apply_start (stream, body, &err);
    }
  else if (strcmp (op, "read") == 0)
    op_read (stream, path, body, &err);
  else if (strcmp (op, "write") == 0)
    op_write (stream, path, body, &err);
  else if (strcmp (op, "stat") == 0)
    op_stat (stream, path, body, &err);
  else if (strcmp (op, "list") == 0)
    op_list (stream, path, body, &err);
  else if (strcmp (op, "mkdir") == 0)
    op_mkdir (stream, path, body, &err);
  else if (strcmp (op, "remove") == 0)
    op_remove (stream, path, body, &err);
  else if (strcmp (op, "watch") == 0)
    ag_fwatch_start (stream, path, body, &err);
  else
    wr_error (&err, EINVAL, WR_E_INVALID, "unknown file op \"%s\"", op);
  if (err.code)
    ag_send_error (stream, &err);
}

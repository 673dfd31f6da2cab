/* warren image build: a small spec (FROM, RUN, COPY, ENV, WORKDIR, USER,
 * LABEL; docs/images.md) run step by step on a worker thread.
 *
 * Each step maps the current image (a manifest digest) to the next one and
 * is cached by content: key = sha256(current digest, step text, and for
 * COPY the sources' content), remembered as the tag
 * warren-build-cache:<key> in the store's SQLite database. RUN executes in
 * a build sandbox created through the daemon's own create path, with the
 * same network policy as any sandbox: none (loopback only) unless the
 * request asks for "network": "host" and warrend runs with
 * --allow-host-network, because the host's network namespace holds the
 * daemon's own listeners. Its writable upper becomes a layer exactly as
 * `pack` does. The worker calls into the event loop for
 * everything that touches sandboxes (run_on_loop) and blocks meanwhile. */
#include "daemon/images.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <event2/event.h>

#include "common/proto.h"
#include "common/util.h"
#include "daemon/http_util.h"
#include "daemon/netsvc.h"
#include "daemon/uploads.h"
#include "image/sha256.h"

#define CACHE_NAME "warren-build-cache"
#define MAX_STEPS 256
#define MAX_SPEC (256u << 10)

/* ---- calling into the loop from the worker ---- */

struct loop_call
{
  void (*fn) (void *);
  void *arg;
  pthread_mutex_t m;
  pthread_cond_t c;
  bool done;
};

static void
loop_call_cb (evutil_socket_t fd WR_UNUSED, short what WR_UNUSED, void *arg)
{
  struct loop_call *lc = arg;
  lc->fn (lc->arg);
  pthread_mutex_lock (&lc->m);
  lc->done = true;
  pthread_cond_signal (&lc->c);
  pthread_mutex_unlock (&lc->m);
}

static void
run_on_loop (struct wrd *d, void (*fn) (void *), void *arg)
{
  struct loop_call lc = { .fn = fn, .arg = arg };
  pthread_mutex_init (&lc.m, NULL);
  pthread_cond_init (&lc.c, NULL);
  struct event *ev = event_new (d->base, -1, 0, loop_call_cb, &lc);
  event_active (ev, EV_TIMEOUT, 0);
  pthread_mutex_lock (&lc.m);
  while (!lc.done)
    pthread_cond_wait (&lc.c, &lc.m);
  pthread_mutex_unlock (&lc.m);
  event_free (ev);
  pthread_mutex_destroy (&lc.m);
  pthread_cond_destroy (&lc.c);
}

/* ---- the spec ---- */

enum op
{
  OP_FROM,
  OP_RUN,
  OP_COPY,
  OP_ENV,
  OP_WORKDIR,
  OP_USER,
  OP_LABEL,
};

struct step
{
  enum op op;
  char *arg; /* the rest of the line, continuations joined */
  int line;
};

struct build
{
  struct wrd *d;
  struct wrd_stream *st;
  char name[256];
  char context[4096];
  int context_fd; /* an uploaded context (tar) to extract into context, or -1 */
  char *spec;
  struct step steps[MAX_STEPS];
  size_t n_steps;
  char cur[72];       /* current manifest digest */
  bool net_host;      /* RUN steps in the host's network namespace */
  char network[2048]; /* RUN steps' "network": none, host or allow=... (docs/network.md) */
  json_t *log;        /* [{"step","cached","digest"}] */
  struct wr_image *img;
  wr_err_t err;
  int r;
};

static int
parse_spec (struct build *b, wr_err_t *err)
{
  static const char *const names[] = { "FROM", "RUN", "COPY", "ENV", "WORKDIR", "USER", "LABEL" };
  char *p = b->spec;
  int lineno = 0;
  while (*p)
    {
      char *start = p;
      int first = ++lineno;
      /* join "\"-continued lines in place */
      char *w = p;
      for (;;)
        {
          char *nl = strchr (p, '\n');
          size_t len = nl ? (size_t)(nl - p) : strlen (p);
          size_t l2 = len;
          while (l2 > 0 && (p[l2 - 1] == '\r' || p[l2 - 1] == ' ' || p[l2 - 1] == '\t'))
            l2--;
          bool cont = l2 > 0 && p[l2 - 1] == '\\';
          if (cont)
            l2--;
          memmove (w, p, l2);
          w += l2;
          p = nl ? nl + 1 : p + len;
          if (!cont || !nl)
            break;
          *w++ = ' ';
          lineno++;
        }
      *w = '\0';
      char *s = start;
      while (*s == ' ' || *s == '\t')
        s++;
      if (*s == '\0' || *s == '#')
        continue;
      size_t kl = strcspn (s, " \t");
      int op = -1;
      for (size_t i = 0; i < WR_ARRAY_SIZE (names); i++)
        if (strlen (names[i]) == kl && strncasecmp (s, names[i], kl) == 0)
          op = (int)i;
      if (op < 0)
        return wr_error (err, 0, WR_E_INVALID,
                         "spec line %d: unknown instruction '%.*s' (FROM, RUN, COPY, ENV, "
                         "WORKDIR, USER, LABEL)",
                         first, (int)(kl > 40 ? 40 : kl), s);
      char *arg = s + kl;
      while (*arg == ' ' || *arg == '\t')
        arg++;
      if (*arg == '\0')
        return wr_error (err, 0, WR_E_INVALID, "spec line %d: %s needs an argument", first,
                         names[op]);
      if ((op == OP_FROM) != (b->n_steps == 0))
        return wr_error (err, 0, WR_E_INVALID, "spec line %d: FROM must come first, and only once",
                         first);
      if (b->n_steps == MAX_STEPS)
        return wr_error (err, 0, WR_E_INVALID, "spec has more than %d steps", MAX_STEPS);
      b->steps[b->n_steps++] = (struct step){ (enum op)op, arg, first };
    }
  if (b->n_steps == 0)
    return wr_error (err, 0, WR_E_INVALID, "spec is empty (it needs a FROM)");
  return 0;
}

/* "K=V K2="v 2"" or "K V" -> pairs; values may be double-quoted */
static int
parse_kv (const char *arg, bool allow_space_form, json_t *out, int line, wr_err_t *err)
{
  const char *eq = strchr (arg, '=');
  const char *sp = strpbrk (arg, " \t");
  if (allow_space_form && (eq == NULL || (sp && sp < eq)))
    {
      if (sp == NULL)
        return wr_error (err, 0, WR_E_INVALID, "spec line %d: want KEY=VALUE", line);
      const char *v = sp;
      while (*v == ' ' || *v == '\t')
        v++;
      json_object_set_new (out, "", json_null ()); /* placeholder removed below */
      json_object_del (out, "");
      char key[256];
      snprintf (key, sizeof key, "%.*s", (int)(sp - arg), arg);
      json_object_set_new (out, key, json_string (v));
      return 0;
    }
  const char *p = arg;
  while (*p)
    {
      while (*p == ' ' || *p == '\t')
        p++;
      if (!*p)
        break;
      const char *k = p;
      while (*p && *p != '=' && *p != ' ' && *p != '\t')
        p++;
      if (*p != '=' || p == k || p - k > 255)
        return wr_error (err, 0, WR_E_INVALID, "spec line %d: want KEY=VALUE", line);
      char key[256];
      snprintf (key, sizeof key, "%.*s", (int)(p - k), k);
      p++;
      char val[4096];
      size_t vl = 0;
      bool q = *p == '"';
      if (q)
        p++;
      while (*p && (q ? *p != '"' : (*p != ' ' && *p != '\t')))
        {
          if (*p == '\\' && p[1])
            p++;
          if (vl + 1 < sizeof val)
            val[vl++] = *p;
          p++;
        }
      if (q)
        {
          if (*p != '"')
            return wr_error (err, 0, WR_E_INVALID, "spec line %d: unterminated quote", line);
          p++;
        }
      val[vl] = '\0';
      json_object_set_new (out, key, json_string (val));
    }
  return 0;
}

/* ---- steps ---- */

static void
key_of (const char *cur, const struct step *s, const char *extra, char hex[65])
{
  struct wr_sha256 h;
  wr_sha256_init (&h);
  wr_sha256_update (&h, cur, strlen (cur));
  wr_sha256_update (&h, "\n", 1);
  char op[8];
  snprintf (op, sizeof op, "%d\n", (int)s->op);
  wr_sha256_update (&h, op, strlen (op));
  wr_sha256_update (&h, s->arg, strlen (s->arg));
  if (extra)
    {
      wr_sha256_update (&h, "\n", 1);
      wr_sha256_update (&h, extra, strlen (extra));
    }
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, hex);
}

static int
cache_lookup (struct build *b, const char *key, bool *hit)
{
  char ref[128];
  snprintf (ref, sizeof ref, CACHE_NAME ":%s", key);
  struct wr_image *img = NULL;
  *hit = wr_image_resolve (b->d->store, ref, &img, NULL) == 0;
  if (*hit)
    snprintf (b->cur, sizeof b->cur, "%s", img->digest);
  wr_image_free (img);
  return 0;
}

static int
set_cur (struct build *b, struct wr_image *img)
{
  snprintf (b->cur, sizeof b->cur, "%s", img->digest);
  wr_image_free (img);
  return 0;
}

/* ENV / WORKDIR / USER / LABEL: same layers, new config */
static int
step_config (struct build *b, const struct step *s, const char *cache_ref, wr_err_t *err)
{
  struct wr_image *img = NULL;
  int r = wr_image_resolve (b->d->store, b->cur, &img, err);
  if (r < 0)
    return r;
  json_t *cfg = json_deep_copy (img->config);
  if (s->op == OP_WORKDIR || s->op == OP_USER)
    {
      char v[4096];
      snprintf (v, sizeof v, "%s", s->arg);
      size_t l = strlen (v);
      while (l > 0 && (v[l - 1] == ' ' || v[l - 1] == '\t'))
        v[--l] = '\0';
      if (s->op == OP_WORKDIR && v[0] != '/')
        {
          const char *wd = json_string_value (json_object_get (cfg, "workdir"));
          char full[4200];
          snprintf (full, sizeof full, "%s/%s", wd && strcmp (wd, "/") ? wd : "", v);
          snprintf (v, sizeof v, "%s", full);
        }
      json_object_set_new (cfg, s->op == OP_WORKDIR ? "workdir" : "user", json_string (v));
    }
  else
    {
      json_t *kv = json_object ();
      r = parse_kv (s->arg, s->op == OP_ENV, kv, s->line, err);
      if (r == 0 && s->op == OP_LABEL)
        {
          json_t *labels = json_object_get (cfg, "labels");
          if (!json_is_object (labels))
            json_object_set_new (cfg, "labels", labels = json_object ());
          json_object_update (labels, kv);
        }
      else if (r == 0)
        {
          json_t *env = json_object_get (cfg, "env");
          if (!json_is_array (env))
            json_object_set_new (cfg, "env", env = json_array ());
          const char *k;
          json_t *v;
          json_object_foreach (kv, k, v)
          {
            size_t kl = strlen (k);
            for (size_t i = 0; i < json_array_size (env); i++)
              {
                const char *e = json_string_value (json_array_get (env, i));
                if (e && strncmp (e, k, kl) == 0 && e[kl] == '=')
                  {
                    json_array_remove (env, i);
                    i--;
                  }
              }
            char *line = NULL;
            if (asprintf (&line, "%s=%s", k, json_string_value (v)) > 0)
              json_array_append_new (env, json_string (line));
            free (line);
          }
        }
      json_decref (kv);
    }
  if (r == 0)
    {
      struct wr_layer_ref refs[WR_MAX_LAYERS];
      memset (refs, 0, sizeof refs);
      for (size_t i = 0; i < img->n_layers; i++)
        refs[i].digest = img->layers[i];
      struct wr_image *out = NULL;
      r = wr_image_commit (b->d->store, cache_ref, refs, img->n_layers, cfg, &out, err);
      if (r == 0)
        set_cur (b, out);
    }
  json_decref (cfg);
  wr_image_free (img);
  return r;
}

/* ---- COPY ---- */

static int
open_in_context (int ctx, const char *rel, int flags, wr_err_t *err)
{
  struct open_how how = { .flags = (uint64_t)(flags | O_CLOEXEC | O_NOFOLLOW),
                          .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS };
  while (*rel == '/')
    rel++;
  int fd = (int)syscall (SYS_openat2, ctx, *rel ? rel : ".", &how, sizeof how);
  if (fd < 0)
    return wr_error (err, errno, errno == ENOENT ? WR_E_NOT_FOUND : WR_E_INVALID,
                     "COPY source '%.300s' in the context", rel);
  return fd;
}

/* Copy the file or tree at sfd (named name) into dfd, hashing names, modes
 * and content into h. Symlinks are copied as links, never followed. */
static int
copy_in (int sfd, const struct stat *st, int dfd, const char *name, struct wr_sha256 *h, int depth,
         wr_err_t *err)
{
  char hdr[600];
  snprintf (hdr, sizeof hdr, "%s\n%o\n", name, (unsigned)st->st_mode);
  wr_sha256_update (h, hdr, strlen (hdr));
  if (depth > 128)
    return wr_error (err, 0, WR_E_INVALID, "COPY: directories nested too deep");
  if (S_ISREG (st->st_mode))
    {
      _cleanup_close_ int out
          = openat (dfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (out < 0)
        return wr_sys_error (err, "COPY: create %s", name);
      char buf[65536];
      for (;;)
        {
          ssize_t n = read (sfd, buf, sizeof buf);
          if (n < 0 && errno == EINTR)
            continue;
          if (n < 0)
            return wr_sys_error (err, "COPY: read %s", name);
          if (n == 0)
            break;
          wr_sha256_update (h, buf, (size_t)n);
          if (wr_write_all (out, buf, (size_t)n) < 0)
            {
              int r = wr_sys_error (err, "COPY: write %s", name);
              if (errno == ENOSPC)
                err->code = WR_E_EXHAUSTED;
              return r;
            }
        }
      if (fchmod (out, st->st_mode & 07777) < 0)
        return wr_sys_error (err, "COPY: chmod %s", name);
      return 0;
    }
  if (S_ISDIR (st->st_mode))
    {
      if (mkdirat (dfd, name, 0755) < 0 && errno != EEXIST)
        return wr_sys_error (err, "COPY: mkdir %s", name);
      _cleanup_close_ int d2 = openat (dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (d2 < 0)
        return wr_sys_error (err, "COPY: open %s", name);
      fchmod (d2, st->st_mode & 07777);
      int dup = fcntl (sfd, F_DUPFD_CLOEXEC, 3);
      _cleanup_closedir_ DIR *dir = dup >= 0 ? fdopendir (dup) : NULL;
      if (dir == NULL)
        return wr_sys_error (err, "COPY: read directory %s", name);
      /* sorted, so the content hash does not depend on readdir order */
      struct dirent **list = NULL;
      int n = 0;
      {
        char **names = NULL;
        struct dirent *de;
        while ((de = readdir (dir)) != NULL)
          {
            if (!strcmp (de->d_name, ".") || !strcmp (de->d_name, ".."))
              continue;
            char **nn = realloc (names, (size_t)(n + 1) * sizeof *names);
            if (nn == NULL)
              break;
            names = nn;
            names[n++] = strdup (de->d_name);
          }
        for (int i = 1; i < n; i++)
          for (int k = i; k > 0 && strcmp (names[k - 1], names[k]) > 0; k--)
            {
              char *t = names[k];
              names[k] = names[k - 1];
              names[k - 1] = t;
            }
        int r = 0;
        for (int i = 0; i < n && r == 0; i++)
          {
            struct stat cst;
            if (names[i] == NULL || fstatat (sfd, names[i], &cst, AT_SYMLINK_NOFOLLOW) < 0)
              {
                r = wr_sys_error (err, "COPY: stat %s", names[i] ? names[i] : "?");
                break;
              }
            _cleanup_close_ int c2 = -1;
            if (S_ISREG (cst.st_mode) || S_ISDIR (cst.st_mode))
              {
                c2 = openat (sfd, names[i],
                             O_RDONLY | O_NOFOLLOW | O_CLOEXEC
                                 | (S_ISDIR (cst.st_mode) ? O_DIRECTORY : 0));
                if (c2 < 0)
                  {
                    r = wr_sys_error (err, "COPY: open %s", names[i]);
                    break;
                  }
              }
            else if (S_ISLNK (cst.st_mode))
              {
                char t[4096];
                ssize_t tl = readlinkat (sfd, names[i], t, sizeof t - 1);
                if (tl < 0)
                  r = wr_sys_error (err, "COPY: readlink %s", names[i]);
                else
                  {
                    t[tl] = '\0';
                    wr_sha256_update (h, t, (size_t)tl);
                    unlinkat (d2, names[i], 0);
                    if (symlinkat (t, d2, names[i]) < 0)
                      r = wr_sys_error (err, "COPY: symlink %s", names[i]);
                  }
                continue;
              }
            else
              continue; /* devices, fifos, sockets are not copied */
            r = copy_in (c2, &cst, d2, names[i], h, depth + 1, err);
          }
        for (int i = 0; i < n; i++)
          free (names[i]);
        free (names);
        (void)list;
        return r;
      }
    }
  return wr_error (err, 0, WR_E_INVALID, "COPY: %s is not a file or directory", name);
}

/* mkdir -p of an absolute in-image path under root; returns the fd */
static int
mkdirs_at (int root, const char *path, wr_err_t *err)
{
  _cleanup_close_ int cur = fcntl (root, F_DUPFD_CLOEXEC, 3);
  char buf[4096];
  snprintf (buf, sizeof buf, "%s", path);
  char *save = NULL;
  for (char *c = strtok_r (buf, "/", &save); c; c = strtok_r (NULL, "/", &save))
    {
      if (!strcmp (c, "."))
        continue;
      if (!strcmp (c, ".."))
        return wr_error (err, 0, WR_E_INVALID, "COPY destination '%.300s' has ..", path);
      if (mkdirat (cur, c, 0755) < 0 && errno != EEXIST)
        return wr_sys_error (err, "COPY: mkdir %s", c);
      int fd = openat (cur, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0)
        return wr_sys_error (err, "COPY: open %s", c);
      close (cur);
      cur = fd;
    }
  return TAKE_FD (cur);
}

static int
split_words (char *s, char **words, int max)
{
  int n = 0;
  char *save = NULL;
  for (char *w = strtok_r (s, " \t", &save); w && n < max; w = strtok_r (NULL, " \t", &save))
    words[n++] = w;
  return n;
}

/* Prepare the COPY tree in work/rootfs and return its content hash. */
static int
copy_prepare (struct build *b, const struct step *s, const char *workdir, const char *work,
              char hex[65], wr_err_t *err)
{
  char args[4096];
  snprintf (args, sizeof args, "%s", s->arg);
  char *w[64];
  int n = split_words (args, w, 64);
  if (n < 2)
    return wr_error (err, 0, WR_E_INVALID, "spec line %d: COPY SRC... DEST", s->line);
  if (strncmp (w[0], "--", 2) == 0)
    return wr_error (err, 0, WR_E_UNSUPPORTED, "spec line %d: COPY options are not supported",
                     s->line);
  if (!b->context[0])
    return wr_error (err, 0, WR_E_INVALID, "spec line %d: COPY needs a build context", s->line);
  _cleanup_close_ int ctx = open (b->context, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (ctx < 0)
    return wr_error (err, errno, WR_E_INVALID, "cannot open the build context %s", b->context);
  char dest[4200];
  const char *dst = w[n - 1];
  if (dst[0] == '/')
    snprintf (dest, sizeof dest, "%s", dst);
  else
    snprintf (dest, sizeof dest, "%s/%s", strcmp (workdir, "/") ? workdir : "", dst);
  bool into_dir = dest[strlen (dest) - 1] == '/' || n > 2;
  char rootfs[4200];
  snprintf (rootfs, sizeof rootfs, "%s/rootfs", work);
  if (mkdir (rootfs, 0755) < 0)
    return wr_sys_error (err, "mkdir %s", rootfs);
  _cleanup_close_ int root = open (rootfs, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root < 0)
    return wr_sys_error (err, "open %s", rootfs);
  struct wr_sha256 h;
  wr_sha256_init (&h);
  wr_sha256_update (&h, dest, strlen (dest));
  for (int i = 0; i < n - 1; i++)
    {
      _cleanup_close_ int sfd = open_in_context (ctx, w[i], O_RDONLY, err);
      if (sfd < 0)
        return wr_error_wrap (err, "spec line %d", s->line);
      struct stat st;
      if (fstat (sfd, &st) < 0)
        return wr_sys_error (err, "stat %s", w[i]);
      const char *base = strrchr (w[i], '/') ? strrchr (w[i], '/') + 1 : w[i];
      if (S_ISDIR (st.st_mode))
        {
          /* a directory's contents land in DEST */
          _cleanup_close_ int dfd = mkdirs_at (root, dest, err);
          if (dfd < 0)
            return dfd;
          char *slash = strrchr (dest, '/');
          (void)slash;
          int r = copy_in (sfd, &st, dfd, ".", &h, 0, err);
          if (r < 0)
            return r;
        }
      else if (S_ISREG (st.st_mode))
        {
          char parent[4200], fname[256];
          if (into_dir)
            {
              snprintf (parent, sizeof parent, "%s", dest);
              snprintf (fname, sizeof fname, "%s", *base ? base : "file");
            }
          else
            {
              const char *sl = strrchr (dest, '/');
              snprintf (parent, sizeof parent, "%.*s", (int)(sl - dest), dest);
              snprintf (fname, sizeof fname, "%s", sl + 1);
            }
          _cleanup_close_ int dfd = mkdirs_at (root, parent, err);
          if (dfd < 0)
            return dfd;
          int r = copy_in (sfd, &st, dfd, fname, &h, 0, err);
          if (r < 0)
            return r;
        }
      else
        return wr_error (err, 0, WR_E_INVALID,
                         "spec line %d: COPY source %s is not a file or "
                         "directory",
                         s->line, w[i]);
    }
  uint8_t d[32];
  wr_sha256_final (&h, d);
  wr_sha256_to_hex (d, hex);
  return 0;
}

/* ---- RUN in a build sandbox ---- */

struct run_ctx
{
  struct build *b;
  const struct step *s;
  char id[33];
  json_t *body;
  pthread_mutex_t m;
  pthread_cond_t c;
  bool finished;
  int exit_code;
  char tail[2048];
  size_t tail_len;
  struct pack_snap snap;
  wr_err_t err;
  int r;
};

static void
run_signal (struct run_ctx *x)
{
  pthread_mutex_lock (&x->m);
  x->finished = true;
  pthread_cond_signal (&x->c);
  pthread_mutex_unlock (&x->m);
}

static void
run_on_data (void *ud, uint8_t type WR_UNUSED, const uint8_t *data, size_t len)
{
  struct run_ctx *x = ud;
  /* keep the last bytes of output for the error message */
  if (len >= sizeof x->tail - 1)
    {
      memcpy (x->tail, data + len - (sizeof x->tail - 1), sizeof x->tail - 1);
      x->tail_len = sizeof x->tail - 1;
      return;
    }
  if (x->tail_len + len > sizeof x->tail - 1)
    {
      size_t drop = x->tail_len + len - (sizeof x->tail - 1);
      memmove (x->tail, x->tail + drop, x->tail_len - drop);
      x->tail_len -= drop;
    }
  memcpy (x->tail + x->tail_len, data, len);
  x->tail_len += len;
}

static void
run_on_done (void *ud, json_t *result)
{
  struct run_ctx *x = ud;
  json_t *ec = json_object_get (result, "exit_code");
  x->exit_code = json_is_integer (ec) ? (int)json_integer_value (ec) : -1;
  const char *e = json_string_value (json_object_get (result, "error"));
  if (e)
    run_on_data (x, 0, (const uint8_t *)e, strlen (e));
  run_signal (x);
}

static void
run_on_error (void *ud, const char *code, const char *message)
{
  struct run_ctx *x = ud;
  x->r = wr_error (&x->err, 0, code, "RUN: %s", message);
  run_signal (x);
}

static void
loop_create_and_exec (void *arg)
{
  struct run_ctx *x = arg;
  json_t *req
      = json_pack ("{s:s,s:s,s:i}", "image", x->b->cur, "network", x->b->network, "ttl_s", 7200);
  struct sandbox *sb = NULL;
  x->r = wrd_sandbox_create (x->b->d, req, &sb, &x->err);
  json_decref (req);
  if (x->r < 0)
    {
      wr_error_wrap (&x->err, "build sandbox");
      x->finished = true;
      return;
    }
  snprintf (x->id, sizeof x->id, "%s", sb->id);
  static const struct agent_ops ops
      = { .on_data = run_on_data, .on_done = run_on_done, .on_error = run_on_error };
  if (agent_request (sb->conn, WR_MSG_EXEC, x->body, &ops, x) == 0)
    {
      x->r = wr_error (&x->err, 0, WR_E_GONE, "the build sandbox's agent is gone");
      x->finished = true;
    }
}

static void
loop_pack_begin (void *arg)
{
  struct run_ctx *x = arg;
  struct sandbox *sb = wrd_sandbox_find (x->b->d, x->id);
  if (sb == NULL)
    x->r = wr_error (&x->err, 0, WR_E_GONE, "the build sandbox is gone");
  else
    x->r = wrd_pack_begin (x->b->d, sb, &x->snap, &x->err);
}

static void
loop_pack_end_and_destroy (void *arg)
{
  struct run_ctx *x = arg;
  if (x->snap.upper_fd >= 0)
    wrd_pack_end (x->b->d, &x->snap);
  struct sandbox *sb = x->id[0] ? wrd_sandbox_find (x->b->d, x->id) : NULL;
  if (sb)
    {
      wr_err_t e;
      wrd_sandbox_destroy (x->b->d, sb, &e);
    }
}

static int
step_run (struct build *b, const struct step *s, const char *cache_ref, wr_err_t *err)
{
  struct wr_image *img = NULL;
  int r = wr_image_resolve (b->d->store, b->cur, &img, err);
  if (r < 0)
    return r;
  json_t *env = json_deep_copy (json_object_get (img->config, "env"));
  if (!json_is_array (env))
    {
      json_decref (env);
      env = json_array ();
    }
  bool has_home = false;
  for (size_t i = 0; i < json_array_size (env); i++)
    has_home |= strncmp (json_string_value (json_array_get (env, i)), "HOME=", 5) == 0;
  if (!has_home)
    json_array_append_new (env, json_string ("HOME=/root"));
  const char *wd = json_string_value (json_object_get (img->config, "workdir"));
  struct run_ctx x = { .b = b, .s = s, .exit_code = -1 };
  x.snap.upper_fd = -1;
  x.body = json_pack ("{s:s,s:o,s:s,s:I,s:I}", "shell", s->arg, "env", env, "cwd", wd ? wd : "/",
                      "stdout_cap", (json_int_t)65536, "stderr_cap", (json_int_t)65536);
  wr_image_free (img);
  pthread_mutex_init (&x.m, NULL);
  pthread_cond_init (&x.c, NULL);
  run_on_loop (b->d, loop_create_and_exec, &x);
  pthread_mutex_lock (&x.m);
  while (!x.finished)
    pthread_cond_wait (&x.c, &x.m);
  pthread_mutex_unlock (&x.m);
  json_decref (x.body);
  if (x.r == 0 && x.exit_code != 0)
    {
      x.tail[x.tail_len] = '\0';
      x.r = wr_error (&x.err, 0, WR_E_INVALID, "spec line %d: RUN failed with exit code %d: %s",
                      s->line, x.exit_code, x.tail);
    }
  if (x.r == 0)
    run_on_loop (b->d, loop_pack_begin, &x);
  if (x.r == 0)
    {
      struct pack_stats st;
      struct wr_image *out = NULL;
      x.r = wrd_pack_commit (b->d->store, &x.snap, cache_ref, NULL, &st, &out, &x.err);
      if (x.r == 0)
        set_cur (b, out);
    }
  run_on_loop (b->d, loop_pack_end_and_destroy, &x);
  pthread_mutex_destroy (&x.m);
  pthread_cond_destroy (&x.c);
  if (x.r < 0 && err)
    *err = x.err;
  return x.r;
}

/* ---- the build ---- */

static void
build_work (void *arg)
{
  struct build *b = arg;
  wr_err_t *err = &b->err;
  b->r = parse_spec (b, err);
  if (b->r < 0)
    return;
  if (b->context_fd >= 0)
    {
      wrd_stream_progress (b->st, "context", 0, 1);
      b->r = wrd_upload_extract (b->d, b->context_fd, b->context, sizeof b->context, err);
      if (b->r < 0)
        return;
      wrd_stream_progress (b->st, "context", 1, 1);
    }
  b->log = json_array ();
  for (size_t i = 0; i < b->n_steps && b->r == 0; i++)
    {
      const struct step *s = &b->steps[i];
      wrd_stream_progress (b->st, "step", i, b->n_steps);
      if (s->op == OP_FROM)
        {
          char ref[512];
          snprintf (ref, sizeof ref, "%s", s->arg);
          size_t l = strlen (ref);
          while (l > 0 && (ref[l - 1] == ' ' || ref[l - 1] == '\t'))
            ref[--l] = '\0';
          struct wr_image *img = NULL;
          b->r = wr_image_resolve (b->d->store, ref, &img, err);
          if (b->r < 0)
            {
              wr_error_wrap (err, "spec line %d: FROM", s->line);
              break;
            }
          set_cur (b, img);
          json_array_append_new (
              b->log, json_pack ("{s:s,s:b,s:s}", "step", s->arg, "cached", 1, "digest", b->cur));
          continue;
        }
      char extra_hex[65] = "";
      char work[4096] = "";
      if (s->op == OP_COPY)
        {
          struct wr_image *img = NULL;
          b->r = wr_image_resolve (b->d->store, b->cur, &img, err);
          if (b->r < 0)
            break;
          const char *wd = json_string_value (json_object_get (img->config, "workdir"));
          char wdc[4096];
          snprintf (wdc, sizeof wdc, "%s", wd ? wd : "/");
          wr_image_free (img);
          b->r = wr_store_tmpdir (b->d->store, "copy", work, sizeof work, err);
          if (b->r == 0)
            b->r = copy_prepare (b, s, wdc, work, extra_hex, err);
        }
      /* A RUN with the host's network may give what one without could not:
       * its own cache entries (those without keep the old keys). */
      if (s->op == OP_RUN && b->net_host)
        snprintf (extra_hex, sizeof extra_hex, "network=host");
      else if (s->op == OP_RUN && strcmp (b->network, "none") != 0) /* allow=: by its policy */
        wr_sha256_hex (b->network, strlen (b->network), extra_hex);
      char key[65];
      key_of (b->cur, s, extra_hex[0] ? extra_hex : NULL, key);
      char cache_ref[128];
      snprintf (cache_ref, sizeof cache_ref, CACHE_NAME ":%s", key);
      bool hit = false;
      if (b->r == 0)
        cache_lookup (b, key, &hit);
      if (b->r == 0 && !hit)
        {
          switch (s->op)
            {
            case OP_RUN:
              b->r = step_run (b, s, cache_ref, err);
              break;
            case OP_COPY:
              {
                struct wr_image *img = NULL;
                b->r = wr_image_resolve (b->d->store, b->cur, &img, err);
                if (b->r < 0)
                  break;
                const char *base[WR_MAX_LAYERS];
                /* more than WR_MAX_LAYERS - 1: wr_image_import_ex refuses */
                for (size_t k = 0; k < img->n_layers && k < WR_MAX_LAYERS; k++)
                  base[k] = img->layers[k];
                struct wr_import_opts o = { .base_layers = base,
                                            .n_base_layers = img->n_layers,
                                            .config = img->config };
                char tree[4200];
                snprintf (tree, sizeof tree, "%s/rootfs", work);
                struct wr_image *out = NULL;
                b->r = wr_image_import_ex (b->d->store, cache_ref, tree, &o, &out, err);
                wr_image_free (img);
                if (b->r == 0)
                  set_cur (b, out);
                break;
              }
            default:
              b->r = step_config (b, s, cache_ref, err);
            }
        }
      if (work[0])
        {
          char *slash = strrchr (work, '/');
          *slash = '\0';
          _cleanup_close_ int pfd = open (work, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
          if (pfd >= 0)
            wr_rm_rf_at (pfd, slash + 1);
        }
      if (b->r == 0)
        json_array_append_new (
            b->log, json_pack ("{s:s,s:b,s:s}", "step", s->arg, "cached", hit, "digest", b->cur));
      else if (err->msg[0] && !strstr (err->msg, "spec line"))
        wr_error_wrap (err, "spec line %d", s->line);
    }
  if (b->r == 0)
    {
      wrd_stream_progress (b->st, "step", b->n_steps, b->n_steps);
      b->r = wr_image_tag (b->d->store, b->cur, b->name, &b->img, err);
    }
}

static void
build_done (void *arg)
{
  struct build *b = arg;
  json_t *res = NULL;
  if (b->r == 0)
    {
      res = wrd_image_json (b->img);
      json_object_set (res, "steps", b->log);
    }
  wrd_stream_finish (b->st, b->r, &b->err, res, 201);
  if (b->context_fd >= 0)
    {
      close (b->context_fd);
      wrd_upload_rmdir (b->context);
    }
  wr_image_free (b->img);
  json_decref (b->log);
  free (b->spec);
  free (b);
}

void
wrd_http_image_build (struct wrd *d, struct evhttp_request *req)
{
  wr_err_t err;
  json_t *body;
  if (wrd_read_json_body (req, true, &body, &err) < 0)
    {
      wrd_reply_error (req, &err);
      return;
    }
  const char *name = json_string_value (json_object_get (body, "name"));
  const char *spec = json_string_value (json_object_get (body, "spec"));
  json_t *cv = json_object_get (body, "context");
  const char *context = json_string_value (cv);
  json_t *uv = json_object_get (body, "context_upload");
  const char *upload = json_string_value (uv);
  json_t *sv = json_object_get (body, "stream");
  json_t *nv = json_object_get (body, "network");
  const char *net = json_string_value (nv);
  if (name == NULL || !wr_ref_valid (name) || strchr (name, '@') || strlen (name) >= 256
      || spec == NULL || strlen (spec) > MAX_SPEC || (cv && !json_is_null (cv) && !context)
      || (context && (context[0] != '/' || strlen (context) >= 4096))
      || (uv && !json_is_null (uv) && !upload) || (context && upload)
      || (sv && !json_is_boolean (sv))
      || (nv && !json_is_null (nv)
          && (net == NULL || strlen (net) >= sizeof ((struct build *)0)->network
              || (strcmp (net, "none") != 0 && strcmp (net, "host") != 0
                  && strncmp (net, "allow=", 6) != 0))))
    {
      json_decref (body);
      wrd_reply_error_code (req, WR_E_INVALID,
                            "fields \"name\" (NAME[:TAG]) and \"spec\" (text, at most 256 KiB) "
                            "are required; \"context\" is an absolute directory on the daemon's "
                            "host, or \"context_upload\" an upload id (a tar); \"stream\" a "
                            "boolean; \"network\" \"none\", \"host\" or \"allow=RULE,...\"");
      return;
    }
  bool net_host = net && strcmp (net, "host") == 0;
  json_t *norm = NULL;
  wr_err_t nerr;
  if (net && strncmp (net, "allow=", 6) == 0 && wrd_net_parse (d, nv, NULL, &norm, &nerr) < 0)
    {
      json_decref (body);
      wrd_reply_error (req, &nerr);
      return;
    }
  char network[sizeof ((struct build *)0)->network];
  snprintf (network, sizeof network, "%s",
            norm       ? json_string_value (norm)
            : net_host ? "host"
                       : "none");
  json_decref (norm);
  if (net_host && !d->allow_host_network)
    {
      json_decref (body);
      wrd_reply_error_code (req, WR_E_INVALID,
                            "\"network\": \"host\" is not permitted on this node (warrend runs "
                            "without --allow-host-network); RUN steps have no network");
      return;
    }
  struct build *b = calloc (1, sizeof *b);
  if (b == NULL || (b->spec = strdup (spec)) == NULL)
    {
      free (b);
      json_decref (body);
      wrd_reply_error_code (req, WR_E_INTERNAL, "out of memory");
      return;
    }
  b->d = d;
  b->context_fd = -1;
  if (upload && wrd_upload_take (d, req, upload, &b->context_fd, &err) < 0)
    {
      free (b->spec);
      free (b);
      json_decref (body);
      wrd_reply_error (req, &err);
      return;
    }
  b->net_host = net_host;
  snprintf (b->network, sizeof b->network, "%s", network);
  snprintf (b->name, sizeof b->name, "%s", name);
  if (context)
    snprintf (b->context, sizeof b->context, "%s", context);
  b->st = wrd_stream_new (d, req, json_is_true (sv));
  json_decref (body);
  if (wrd_job_run (d, build_work, build_done, b) < 0)
    {
      wr_error (&b->err, 0, WR_E_INTERNAL, "cannot start the build worker");
      b->r = -1;
      build_done (b);
    }
}

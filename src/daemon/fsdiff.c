/* Comparing layer stacks and writing one back into a live sandbox
 * (fsdiff.h). Which paths can differ between two states is known without
 * reading the shared layers: only paths present in a layer one state has
 * and the other lacks (the live upper, a checkpoint's layer), plus the
 * entries an opaque directory in such a layer hides. Each candidate is then
 * looked up in both stacks and compared by type, mode, size and bytes. */
#include "daemon/fsdiff.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <linux/openat2.h>
#include <archive.h>
#include <archive_entry.h>

#include "common/util.h"

#define MAX_DEPTH 256
#define TEXT_MAX (1u << 20) /* bytes of a file we diff as text */
#define DIFF_MAX_D 1000     /* edit distance past which we give up */

void
fsd_state_init (struct fsd_state *s)
{
  memset (s, 0, sizeof *s);
}

int
fsd_state_push (struct fsd_state *s, int dirfd, wr_err_t *err)
{
  if (s->n >= WR_ARRAY_SIZE (s->fd))
    return wr_error (err, E2BIG, WR_E_INVALID, "too many layers");
  int fd = openat (dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return wr_sys_error (err, "open a layer");
  s->fd[s->n++] = fd;
  return 0;
}

void
fsd_state_clear (struct fsd_state *s)
{
  for (size_t i = 0; i < s->n; i++)
    close (s->fd[i]);
  s->n = 0;
}

static bool
is_whiteout (const struct stat *st)
{
  return S_ISCHR (st->st_mode) && st->st_rdev == makedev (0, 0);
}

static bool
is_opaque (int fd)
{
  char v[2];
  ssize_t n = fgetxattr (fd, "user.overlay.opaque", v, sizeof v);
  if (n < 0)
    n = fgetxattr (fd, "trusted.overlay.opaque", v, sizeof v);
  return n == 1 && v[0] == 'y';
}

/* Open the directory `path` (relative, "" = root) of layer i without
 * following symlinks. *hidden: a component above was a whiteout, a non-dir
 * or missing under an opaque dir, so layers further down cannot contribute;
 * *barrier: a component was opaque. Returns the fd, or -1. */
static int
layer_open_dir (const struct fsd_state *s, size_t i, const char *path, bool *hidden, bool *barrier)
{
  int cur = openat (s->fd[i], ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (cur < 0)
    return -1;
  char buf[4096];
  snprintf (buf, sizeof buf, "%s", path);
  char *save = NULL;
  for (char *c = strtok_r (buf, "/", &save); c; c = strtok_r (NULL, "/", &save))
    {
      struct stat st;
      if (fstatat (cur, c, &st, AT_SYMLINK_NOFOLLOW) < 0)
        {
          if (*barrier)
            *hidden = true;
          close (cur);
          return -1;
        }
      if (!S_ISDIR (st.st_mode))
        {
          *hidden = true; /* a whiteout or a file hides whatever lies below */
          close (cur);
          return -1;
        }
      int nfd = openat (cur, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      close (cur);
      if (nfd < 0)
        return -1;
      cur = nfd;
      if (is_opaque (cur))
        *barrier = true;
    }
  return cur;
}

/* Find `path` in the stack: the layer's parent dir fd (caller closes) and
 * the entry's stat, or -1 when the merged view has no such path. */
static int
lookup (const struct fsd_state *s, const char *path, struct stat *st, const char **ret_name)
{
  char parent[4096];
  const char *slash = strrchr (path, '/');
  const char *name = slash ? slash + 1 : path;
  snprintf (parent, sizeof parent, "%.*s", slash ? (int)(slash - path) : 0, path);
  *ret_name = name;
  for (size_t i = 0; i < s->n; i++)
    {
      bool hidden = false, barrier = false;
      int dfd = layer_open_dir (s, i, parent, &hidden, &barrier);
      if (dfd < 0)
        {
          if (hidden)
            return -1;
          continue;
        }
      if (fstatat (dfd, name, st, AT_SYMLINK_NOFOLLOW) == 0)
        {
          if (is_whiteout (st))
            {
              close (dfd);
              return -1;
            }
          return dfd;
        }
      close (dfd);
      if (barrier)
        return -1;
    }
  return -1;
}

/* ---- candidates ---- */

struct names
{
  char **v;
  size_t n, cap;
};

static int
names_add (struct names *p, const char *s, wr_err_t *err)
{
  if (p->n >= FSD_MAX_CHANGES * 4)
    return wr_error (err, E2BIG, WR_E_TOO_LARGE, "more than %d changed paths", FSD_MAX_CHANGES * 4);
  int r = wr_grow (&p->v, &p->cap, p->n + 1, sizeof *p->v, 256);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "out of memory");
  if ((p->v[p->n] = strdup (s)) == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  p->n++;
  return 0;
}

static void
names_free (struct names *p)
{
  for (size_t i = 0; i < p->n; i++)
    free (p->v[i]);
  free (p->v);
}

/* one level of the merged directory `rel` of a stack (over-approximated:
 * the union of every layer's names; lookups sort out the hidden ones) */
static int
add_merged_level (const struct fsd_state *s, const char *rel, struct names *out, wr_err_t *err)
{
  for (size_t i = 0; i < s->n; i++)
    {
      bool hidden = false, barrier = false;
      int dfd = layer_open_dir (s, i, rel, &hidden, &barrier);
      if (dfd < 0)
        {
          if (hidden)
            break;
          continue;
        }
      DIR *dir = fdopendir (dfd);
      if (dir == NULL)
        {
          close (dfd);
          continue;
        }
      struct dirent *de;
      int r = 0;
      while (r == 0 && (de = readdir (dir)) != NULL)
        {
          if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
            continue;
          char sub[4096];
          snprintf (sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "", de->d_name);
          r = names_add (out, sub, err);
        }
      bool stop = barrier || is_opaque (dirfd (dir));
      closedir (dir);
      if (r < 0)
        return r;
      if (stop)
        break;
    }
  return 0;
}

static int
walk_layer (int dfd, const char *rel, int depth, const struct fsd_state *a,
            const struct fsd_state *b, struct names *out, wr_err_t *err)
{
  if (depth > MAX_DEPTH)
    return wr_error (err, 0, WR_E_INVALID, "%s: directories nested too deep", rel);
  _cleanup_closedir_ DIR *dir = wr_opendir_dup (dfd);
  if (dir == NULL)
    return wr_sys_error (err, "opendir %s", rel);
  if (is_opaque (dfd))
    {
      /* it hides what lay below: everything either side had here */
      int r = add_merged_level (a, rel, out, err);
      if (r == 0)
        r = add_merged_level (b, rel, out, err);
      if (r < 0)
        return r;
    }
  struct dirent *de;
  while ((de = readdir (dir)) != NULL)
    {
      if (strcmp (de->d_name, ".") == 0 || strcmp (de->d_name, "..") == 0)
        continue;
      char sub[4096];
      int sl = snprintf (sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "", de->d_name);
      if (sl < 0 || (size_t)sl >= sizeof sub)
        return wr_error (err, 0, WR_E_INVALID, "path too long under %s", rel);
      int r = names_add (out, sub, err);
      if (r < 0)
        return r;
      struct stat st;
      if (fstatat (dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR (st.st_mode))
        {
          _cleanup_close_ int sfd
              = openat (dfd, de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
          if (sfd < 0)
            return wr_sys_error (err, "open %s", sub);
          r = walk_layer (sfd, sub, depth + 1, a, b, out, err);
          if (r < 0)
            return r;
        }
    }
  return 0;
}

static int
cmp_str (const void *x, const void *y)
{
  return strcmp (*(char *const *)x, *(char *const *)y);
}

/* Paths the runtime mounts over in every sandbox: never part of a diff. */
static bool
runtime_path (const char *p)
{
  static const char *const top[] = { "proc", "dev", "sys" };
  for (size_t i = 0; i < WR_ARRAY_SIZE (top); i++)
    {
      size_t l = strlen (top[i]);
      if (strncmp (p, top[i], l) == 0 && (p[l] == '\0' || p[l] == '/'))
        return true;
    }
  return false;
}

/* ---- comparing ---- */

static int
same_bytes (int dfa, const char *na, int dfb, const char *nb, bool *ret)
{
  _cleanup_close_ int fa = openat (dfa, na, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  _cleanup_close_ int fb = openat (dfb, nb, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fa < 0 || fb < 0)
    return -errno;
  static __thread char ba[65536], bb[65536];
  for (;;)
    {
      ssize_t x = wr_read_all (fa, ba, sizeof ba);
      ssize_t y = wr_read_all (fb, bb, sizeof bb);
      if (x < 0 || y < 0)
        return -EIO;
      if (x != y || memcmp (ba, bb, (size_t)x) != 0)
        {
          *ret = false;
          return 0;
        }
      if (x == 0)
        {
          *ret = true;
          return 0;
        }
    }
}

static bool
differs (int dfa, const char *na, const struct stat *sa, int dfb, const char *nb,
         const struct stat *sb)
{
  if ((sa->st_mode & S_IFMT) != (sb->st_mode & S_IFMT))
    return true;
  if (S_ISDIR (sa->st_mode))
    return false; /* directories: their entries are compared one by one */
  if ((sa->st_mode & 07777) != (sb->st_mode & 07777))
    return true;
  if (S_ISLNK (sa->st_mode))
    {
      char ta[4096], tb[4096];
      ssize_t x = readlinkat (dfa, na, ta, sizeof ta);
      ssize_t y = readlinkat (dfb, nb, tb, sizeof tb);
      return x != y || x < 0 || memcmp (ta, tb, (size_t)x) != 0;
    }
  if (S_ISREG (sa->st_mode))
    {
      if (sa->st_size != sb->st_size)
        return true;
      bool same = false;
      return same_bytes (dfa, na, dfb, nb, &same) < 0 || !same;
    }
  if (S_ISCHR (sa->st_mode) || S_ISBLK (sa->st_mode))
    return sa->st_rdev != sb->st_rdev;
  return false;
}

static int
changes_add (struct fsd_changes *c, const char *path, enum fsd_kind kind, const struct stat *o,
             const struct stat *n, wr_err_t *err)
{
  if (c->n >= FSD_MAX_CHANGES)
    {
      c->truncated = true;
      return 0;
    }
  int r = wr_grow (&c->v, &c->cap, c->n + 1, sizeof *c->v, 64);
  if (r < 0)
    return wr_error (err, -r, WR_E_INTERNAL, "out of memory");
  struct fsd_change *x = &c->v[c->n];
  memset (x, 0, sizeof *x);
  if ((x->path = strdup (path)) == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  x->kind = kind;
  if (o)
    x->old_st = *o;
  if (n)
    x->new_st = *n;
  c->n++;
  return 0;
}

int
fsd_compare (const struct fsd_state *a, const struct fsd_state *b, struct fsd_changes *ret,
             wr_err_t *err)
{
  memset (ret, 0, sizeof *ret);
  struct names cand = { 0 };
  int r = 0;
  for (size_t i = 0; r == 0 && i < a->unshared; i++)
    r = walk_layer (a->fd[i], "", 0, a, b, &cand, err);
  for (size_t i = 0; r == 0 && i < b->unshared; i++)
    r = walk_layer (b->fd[i], "", 0, a, b, &cand, err);
  if (r < 0)
    {
      names_free (&cand);
      return r;
    }
  qsort (cand.v, cand.n, sizeof *cand.v, cmp_str);
  const char *prev = NULL;
  for (size_t i = 0; r == 0 && i < cand.n; i++)
    {
      const char *p = cand.v[i];
      if ((prev && strcmp (prev, p) == 0) || runtime_path (p))
        continue;
      prev = p;
      struct stat sa, sb;
      const char *na, *nb;
      int fa = lookup (a, p, &sa, &na);
      int fb = lookup (b, p, &sb, &nb);
      if (fa >= 0 && fb < 0)
        r = changes_add (ret, p, FSD_DELETED, &sa, NULL, err);
      else if (fa < 0 && fb >= 0)
        r = changes_add (ret, p, FSD_ADDED, NULL, &sb, err);
      else if (fa >= 0 && fb >= 0 && differs (fa, na, &sa, fb, nb, &sb))
        r = changes_add (ret, p, FSD_MODIFIED, &sa, &sb, err);
      if (fa >= 0)
        close (fa);
      if (fb >= 0)
        close (fb);
    }
  names_free (&cand);
  if (r < 0)
    fsd_changes_free (ret);
  return r;
}

void
fsd_changes_free (struct fsd_changes *c)
{
  for (size_t i = 0; i < c->n; i++)
    free (c->v[i].path);
  free (c->v);
  memset (c, 0, sizeof *c);
}

/* ---- unified diff (Myers' O(ND) greedy algorithm) ---- */

struct lines
{
  const char **p;
  size_t *len;
  size_t n;
};

static int
split_lines (const char *s, size_t n, struct lines *l)
{
  size_t cnt = 0;
  for (size_t i = 0; i < n; i++)
    if (s[i] == '\n')
      cnt++;
  cnt++;
  l->p = calloc (cnt, sizeof *l->p);
  l->len = calloc (cnt, sizeof *l->len);
  if (l->p == NULL || l->len == NULL)
    return -1;
  l->n = 0;
  size_t start = 0;
  for (size_t i = 0; i <= n; i++)
    if (i == n || s[i] == '\n')
      {
        if (i == n && start == n)
          break;
        l->p[l->n] = s + start;
        l->len[l->n] = i - start;
        l->n++;
        start = i + 1;
      }
  return 0;
}

static bool
line_eq (const struct lines *a, size_t i, const struct lines *b, size_t j)
{
  return a->len[i] == b->len[j] && memcmp (a->p[i], b->p[j], a->len[i]) == 0;
}

/* ops: one per line of the edit script, '=' '-' '+'; NULL when the
 * distance exceeds DIFF_MAX_D */
static char *
myers (const struct lines *a, const struct lines *b, size_t *ret_n)
{
  long n = (long)a->n, m = (long)b->n, max = n + m;
  if (max > 2 * DIFF_MAX_D + 200000)
    return NULL;
  long dmax = max < DIFF_MAX_D ? max : DIFF_MAX_D;
  long off = dmax + 1;
  long *v = calloc ((size_t)(2 * off + 1), sizeof *v);
  long **trace = calloc ((size_t)dmax + 1, sizeof *trace);
  if (v == NULL || trace == NULL)
    {
      free (v);
      free (trace);
      return NULL;
    }
  long dfound = -1;
  for (long d = 0; d <= dmax && dfound < 0; d++)
    {
      for (long k = -d; k <= d; k += 2)
        {
          long x;
          if (k == -d || (k != d && v[off + k - 1] < v[off + k + 1]))
            x = v[off + k + 1];
          else
            x = v[off + k - 1] + 1;
          long y = x - k;
          while (x < n && y < m && line_eq (a, (size_t)x, b, (size_t)y))
            x++, y++;
          v[off + k] = x;
          if (x >= n && y >= m)
            {
              dfound = d;
              break;
            }
        }
      trace[d] = malloc ((size_t)(2 * d + 1) * sizeof (long));
      if (trace[d] == NULL)
        break;
      for (long k = -d; k <= d; k++)
        trace[d][k + d] = v[off + k];
    }
  char *ops = NULL;
  if (dfound >= 0)
    {
      ops = malloc ((size_t)max + 1);
      size_t no = 0;
      long x = n, y = m;
      /* backtrack from the end, writing ops in reverse */
      for (long d = dfound; d > 0 && ops; d--)
        {
          long k = x - y;
          const long *pv = trace[d - 1];
          long pk;
          if (k == -d || (k != d && pv[k - 1 + (d - 1)] < pv[k + 1 + (d - 1)]))
            pk = k + 1;
          else
            pk = k - 1;
          long px = pv[pk + (d - 1)], py = px - pk;
          while (x > px && y > py)
            ops[no++] = '=', x--, y--;
          if (x == px)
            ops[no++] = '+', y--;
          else
            ops[no++] = '-', x--;
        }
      while (ops && x > 0 && y > 0)
        ops[no++] = '=', x--, y--;
      if (ops)
        {
          for (size_t i = 0; i < no / 2; i++)
            {
              char t = ops[i];
              ops[i] = ops[no - 1 - i];
              ops[no - 1 - i] = t;
            }
          *ret_n = no;
        }
    }
  for (long d = 0; d <= dmax; d++)
    free (trace[d]);
  free (trace);
  free (v);
  return ops;
}

char *
fsd_unified_diff (const char *a, size_t alen, const char *b, size_t blen, const char *path)
{
  if (alen > TEXT_MAX || blen > TEXT_MAX || memchr (a, 0, alen) || memchr (b, 0, blen))
    return NULL;
  struct lines la = { 0 }, lb = { 0 };
  char *out = NULL, *ops = NULL;
  size_t nops = 0, olen = 0;
  if (split_lines (a, alen, &la) < 0 || split_lines (b, blen, &lb) < 0)
    goto done;
  ops = myers (&la, &lb, &nops);
  if (ops == NULL)
    goto done;
  FILE *f = open_memstream (&out, &olen);
  if (f == NULL)
    goto done;
  fprintf (f, "--- a/%s\n+++ b/%s\n", path, path);
  const size_t ctx = 3;
  size_t i = 0;
  while (i < nops)
    {
      if (ops[i] == '=')
        {
          i++;
          continue;
        }
      /* a hunk: from ctx lines before the change to ctx after the last
       * change that is within 2*ctx of the next */
      size_t start = i >= ctx ? i - ctx : 0;
      while (start < i && ops[start] != '=')
        start++;
      size_t end = i, eq = 0;
      for (size_t j = i; j < nops; j++)
        {
          if (ops[j] == '=')
            {
              if (++eq > 2 * ctx)
                break;
            }
          else
            {
              eq = 0;
              end = j + 1;
            }
        }
      size_t stop = end + ctx < nops ? end + ctx : nops;
      for (size_t j = end; j < stop; j++)
        if (ops[j] != '=')
          {
            stop = j;
            break;
          }
      /* line numbers at start */
      size_t ai = 0, bi = 0;
      for (size_t j = 0; j < start; j++)
        {
          if (ops[j] != '+')
            ai++;
          if (ops[j] != '-')
            bi++;
        }
      size_t ac = 0, bc = 0;
      for (size_t j = start; j < stop; j++)
        {
          if (ops[j] != '+')
            ac++;
          if (ops[j] != '-')
            bc++;
        }
      fprintf (f, "@@ -%zu,%zu +%zu,%zu @@\n", ac ? ai + 1 : ai, ac, bc ? bi + 1 : bi, bc);
      for (size_t j = start; j < stop; j++)
        {
          if (ops[j] == '+')
            {
              fprintf (f, "+%.*s\n", (int)lb.len[bi], lb.p[bi]);
              bi++;
            }
          else if (ops[j] == '-')
            {
              fprintf (f, "-%.*s\n", (int)la.len[ai], la.p[ai]);
              ai++;
            }
          else
            {
              fprintf (f, " %.*s\n", (int)la.len[ai], la.p[ai]);
              ai++, bi++;
            }
        }
      i = stop;
    }
  fclose (f);
done:
  free (ops);
  free (la.p);
  free (la.len);
  free (lb.p);
  free (lb.len);
  return out;
}

/* ---- JSON ---- */

static const char *
type_name (const struct stat *st)
{
  if (S_ISREG (st->st_mode))
    return "file";
  if (S_ISDIR (st->st_mode))
    return "dir";
  if (S_ISLNK (st->st_mode))
    return "symlink";
  return "other";
}

static char *
slurp (const struct fsd_state *s, const char *path, size_t *len)
{
  struct stat st;
  const char *name;
  int dfd = lookup (s, path, &st, &name);
  if (dfd < 0)
    return NULL;
  char *buf = NULL;
  if (S_ISREG (st.st_mode) && st.st_size <= TEXT_MAX)
    {
      int fd = openat (dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      buf = fd >= 0 ? malloc ((size_t)st.st_size + 1) : NULL;
      ssize_t n = buf ? wr_read_all (fd, buf, (size_t)st.st_size) : -1;
      if (n < 0)
        {
          free (buf);
          buf = NULL;
        }
      else
        *len = (size_t)n;
      if (fd >= 0)
        close (fd);
    }
  close (dfd);
  return buf;
}

json_t *
fsd_changes_json (const struct fsd_state *a, const struct fsd_state *b, const struct fsd_changes *c,
                  const char *prefix, bool text)
{
  json_t *arr = json_array ();
  size_t added = 0, modified = 0, deleted = 0, plen = prefix ? strlen (prefix) : 0;
  for (size_t i = 0; i < c->n; i++)
    {
      const struct fsd_change *x = &c->v[i];
      if (plen
          && !(strncmp (x->path, prefix, plen) == 0
               && (x->path[plen] == '\0' || x->path[plen] == '/')))
        continue;
      const struct stat *st = x->kind == FSD_DELETED ? &x->old_st : &x->new_st;
      char abs[4200];
      snprintf (abs, sizeof abs, "/%s", x->path);
      const char *kind = x->kind == FSD_ADDED      ? "added"
                         : x->kind == FSD_MODIFIED ? "modified"
                                                   : "deleted";
      json_t *o = json_pack ("{s:s,s:s,s:s}", "path", abs, "kind", kind, "type", type_name (st));
      if (o == NULL)
        {
          /* a name that is not UTF-8: its other bytes shown as '?' */
          for (char *q = abs; *q; q++)
            if ((unsigned char)*q >= 0x80)
              *q = '?';
          o = json_pack ("{s:s,s:s,s:s}", "path", abs, "kind", kind, "type", type_name (st));
        }
      if (!S_ISDIR (st->st_mode))
        json_object_set_new (o, "size", json_integer (st->st_size));
      if (x->kind == FSD_ADDED)
        added++;
      else if (x->kind == FSD_DELETED)
        deleted++;
      else
        {
          modified++;
          json_object_set_new (o, "old_size", json_integer (x->old_st.st_size));
          if (text && S_ISREG (x->old_st.st_mode) && S_ISREG (x->new_st.st_mode))
            {
              size_t la = 0, lb = 0;
              char *da = slurp (a, x->path, &la), *db = slurp (b, x->path, &lb);
              char *u = da && db ? fsd_unified_diff (da, la, db, lb, x->path) : NULL;
              json_t *js = u ? json_string (u) : NULL;
              json_object_set_new (o, "diff", js ? js : json_null ());
              json_object_set_new (o, "binary", json_boolean (js == NULL));
              free (u);
              free (da);
              free (db);
            }
        }
      if (text && x->kind == FSD_ADDED && S_ISREG (st->st_mode))
        {
          size_t lb = 0;
          char *db = slurp (b, x->path, &lb);
          char *u = db ? fsd_unified_diff ("", 0, db, lb, x->path) : NULL;
          json_t *js = u ? json_string (u) : NULL;
          if (js)
            json_object_set_new (o, "diff", js);
          free (u);
          free (db);
        }
      json_array_append_new (arr, o);
    }
  return json_pack ("{s:o,s:{s:I,s:I,s:I},s:b}", "changes", arr, "summary", "added",
                    (json_int_t)added, "modified", (json_int_t)modified, "deleted",
                    (json_int_t)deleted, "truncated", c->truncated);
}

int
fsd_path_normalise (const char *in, char *buf, size_t len, wr_err_t *err)
{
  size_t o = 0;
  buf[0] = '\0';
  if (strlen (in) >= len || strlen (in) > 4000)
    return wr_error (err, 0, WR_E_INVALID, "path too long");
  char tmp[4096];
  snprintf (tmp, sizeof tmp, "%s", in);
  char *save = NULL;
  for (char *c = strtok_r (tmp, "/", &save); c; c = strtok_r (NULL, "/", &save))
    {
      if (strcmp (c, "..") == 0)
        return wr_error (err, 0, WR_E_INVALID, "path %s: \"..\" is not allowed", in);
      if (strcmp (c, ".") == 0)
        continue;
      o += (size_t)snprintf (buf + o, len - o, "%s%s", o ? "/" : "", c);
    }
  return 0;
}

/* ---- restore ---- */

static int
open_in_root (int root_fd, const char *path, int flags)
{
  struct open_how how = {
    .flags = (uint64_t)(flags | O_CLOEXEC),
    .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV,
  };
  return (int)syscall (SYS_openat2, root_fd, path[0] ? path : ".", &how, sizeof how);
}

/* the live parent directory of path and the entry's name */
static int
live_parent (int root_fd, const char *path, const char **name)
{
  char parent[4096];
  const char *slash = strrchr (path, '/');
  *name = slash ? slash + 1 : path;
  snprintf (parent, sizeof parent, "%.*s", slash ? (int)(slash - path) : 0, path);
  return open_in_root (root_fd, parent, O_RDONLY | O_DIRECTORY);
}

static int
set_meta (int pfd, const char *name, const struct stat *st, uint32_t ub, uint32_t gb)
{
  if (fchownat (pfd, name, ub + st->st_uid, gb + st->st_gid, AT_SYMLINK_NOFOLLOW) < 0)
    return -errno;
  if (!S_ISLNK (st->st_mode) && fchmodat (pfd, name, st->st_mode & 07777, 0) < 0)
    return -errno;
  struct timespec ts[2] = { st->st_atim, st->st_mtim };
  utimensat (pfd, name, ts, AT_SYMLINK_NOFOLLOW);
  return 0;
}

static int copy_entry (int root_fd, const struct fsd_state *to, const char *path, uint32_t ub,
                       uint32_t gb, int depth, wr_err_t *err);

/* fn on every entry of `to`'s merged directory at path, sorted, once each */
static int
each_child (const struct fsd_state *to, const char *path, int (*fn) (void *ctx, const char *child),
            void *ctx, wr_err_t *err)
{
  struct names kids = { 0 };
  int r = add_merged_level (to, path, &kids, err);
  if (r == 0)
    qsort (kids.v, kids.n, sizeof *kids.v, cmp_str);
  const char *prev = NULL;
  for (size_t i = 0; r == 0 && i < kids.n; i++)
    {
      if (prev && strcmp (prev, kids.v[i]) == 0)
        continue;
      prev = kids.v[i];
      r = fn (ctx, kids.v[i]);
    }
  names_free (&kids);
  return r;
}

struct copy_ctx
{
  int root_fd;
  const struct fsd_state *to;
  uint32_t ub, gb;
  int depth;
  wr_err_t *err;
};

static int
copy_child (void *ctx, const char *child)
{
  struct copy_ctx *c = ctx;
  return copy_entry (c->root_fd, c->to, child, c->ub, c->gb, c->depth + 1, c->err);
}

static int
copy_dir_children (int root_fd, const struct fsd_state *to, const char *path, uint32_t ub,
                   uint32_t gb, int depth, wr_err_t *err)
{
  struct copy_ctx c = { root_fd, to, ub, gb, depth, err };
  return each_child (to, path, copy_child, &c, err);
}

/* Put `to`'s entry at path into the live tree, replacing what is there. */
static int
copy_entry (int root_fd, const struct fsd_state *to, const char *path, uint32_t ub, uint32_t gb,
            int depth, wr_err_t *err)
{
  if (depth > MAX_DEPTH)
    return wr_error (err, 0, WR_E_INVALID, "%s: nested too deep", path);
  struct stat st;
  const char *sname, *lname;
  int sfd = lookup (to, path, &st, &sname);
  if (sfd < 0)
    return 0; /* hidden in the target: nothing to copy */
  _cleanup_close_ int src_dir = sfd;
  _cleanup_close_ int pfd = live_parent (root_fd, path, &lname);
  if (pfd < 0)
    return wr_sys_error (err, "restore: open the parent of /%s", path);
  struct stat cur;
  bool exists = fstatat (pfd, lname, &cur, AT_SYMLINK_NOFOLLOW) == 0;
  if (S_ISDIR (st.st_mode))
    {
      if (exists && !S_ISDIR (cur.st_mode) && unlinkat (pfd, lname, 0) < 0)
        return wr_sys_error (err, "restore: remove /%s", path);
      if ((!exists || !S_ISDIR (cur.st_mode)) && mkdirat (pfd, lname, 0700) < 0)
        return wr_sys_error (err, "restore: mkdir /%s", path);
      int r = copy_dir_children (root_fd, to, path, ub, gb, depth, err);
      if (r < 0)
        return r;
      if (set_meta (pfd, lname, &st, ub, gb) < 0)
        return wr_sys_error (err, "restore: owner and mode of /%s", path);
      return 0;
    }
  if (exists && S_ISDIR (cur.st_mode))
    {
      int rr = wr_rm_rf_at (pfd, lname);
      if (rr < 0)
        return wr_error (err, -rr, WR_E_INTERNAL, "restore: remove /%s", path);
    }
  char tmp[64];
  snprintf (tmp, sizeof tmp, ".warren-restore-%d", (int)getpid ());
  unlinkat (pfd, tmp, 0);
  if (S_ISREG (st.st_mode))
    {
      _cleanup_close_ int in = openat (src_dir, sname, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      _cleanup_close_ int out
          = openat (pfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (in < 0 || out < 0)
        return wr_sys_error (err, "restore: open /%s", path);
      char buf[65536];
      ssize_t n;
      while ((n = wr_read_all (in, buf, sizeof buf)) > 0)
        if (wr_write_all (out, buf, (size_t)n) < 0)
          {
            int r = wr_sys_error (err, "restore: write /%s", path);
            unlinkat (pfd, tmp, 0);
            return r;
          }
      if (n < 0)
        {
          unlinkat (pfd, tmp, 0);
          return wr_sys_error (err, "restore: read /%s", path);
        }
    }
  else if (S_ISLNK (st.st_mode))
    {
      char target[4096];
      ssize_t n = readlinkat (src_dir, sname, target, sizeof target - 1);
      if (n < 0)
        return wr_sys_error (err, "restore: readlink /%s", path);
      target[n] = '\0';
      if (symlinkat (target, pfd, tmp) < 0)
        return wr_sys_error (err, "restore: symlink /%s", path);
    }
  else if (S_ISFIFO (st.st_mode) || S_ISCHR (st.st_mode) || S_ISBLK (st.st_mode))
    {
      if (mknodat (pfd, tmp, st.st_mode & (S_IFMT | 0777), st.st_rdev) < 0)
        return 0; /* devices a sandbox may not make: left out, as pack does */
    }
  else
    return 0; /* sockets are not files to restore */
  if (set_meta (pfd, tmp, &st, ub, gb) < 0 || renameat (pfd, tmp, pfd, lname) < 0)
    {
      int r = wr_sys_error (err, "restore: put /%s in place", path);
      unlinkat (pfd, tmp, 0);
      return r;
    }
  return 0;
}

int
fsd_apply (int root_fd, const struct fsd_state *to, const struct fsd_changes *c, uint32_t uid_base,
           uint32_t gid_base, wr_err_t *err)
{
  /* removals first (a path and everything under it), then additions and
   * modifications parents first: c is sorted by path */
  for (size_t i = 0; i < c->n; i++)
    {
      const struct fsd_change *x = &c->v[i];
      if (x->kind != FSD_DELETED
          && !(x->kind == FSD_MODIFIED
               && (x->old_st.st_mode & S_IFMT) != (x->new_st.st_mode & S_IFMT)))
        continue;
      const char *name;
      _cleanup_close_ int pfd = live_parent (root_fd, x->path, &name);
      if (pfd < 0)
        {
          if (errno == ENOENT)
            continue; /* gone with a parent */
          return wr_sys_error (err, "restore: open the parent of /%s", x->path);
        }
      int rr = wr_rm_rf_at (pfd, name);
      if (rr < 0 && rr != -ENOENT)
        return wr_error (err, -rr, WR_E_INTERNAL, "restore: remove /%s", x->path);
    }
  for (size_t i = 0; i < c->n; i++)
    {
      const struct fsd_change *x = &c->v[i];
      if (x->kind == FSD_DELETED)
        continue;
      int r = copy_entry (root_fd, to, x->path, uid_base, gid_base, 0, err);
      if (r < 0)
        return r;
    }
  return 0;
}

/* ---- a restore as a tar, for a guest's agent to apply (fsdiff.h) ---- */

static int patch_entry (struct archive *ar, const struct fsd_state *to, const char *path, int depth,
                        wr_err_t *err);

static int
patch_write (struct archive *ar, struct archive_entry *e, const char *path, wr_err_t *err)
{
  if (archive_write_header (ar, e) != ARCHIVE_OK)
    return wr_error (err, 0, WR_E_INTERNAL, "restore: tar header of /%s: %s", path,
                     archive_error_string (ar));
  return 0;
}

struct patch_ctx
{
  struct archive *ar;
  const struct fsd_state *to;
  int depth;
  wr_err_t *err;
};

static int
patch_child (void *ctx, const char *child)
{
  struct patch_ctx *c = ctx;
  return patch_entry (c->ar, c->to, child, c->depth + 1, c->err);
}

static int
patch_dir_children (struct archive *ar, const struct fsd_state *to, const char *path, int depth,
                    wr_err_t *err)
{
  struct patch_ctx c = { ar, to, depth, err };
  return each_child (to, path, patch_child, &c, err);
}

/* `to`'s entry at path (a directory with everything under it), as
 * copy_entry would put it in place */
static int
patch_entry (struct archive *ar, const struct fsd_state *to, const char *path, int depth,
             wr_err_t *err)
{
  if (depth > MAX_DEPTH)
    return wr_error (err, 0, WR_E_INVALID, "%s: nested too deep", path);
  struct stat st;
  const char *sname;
  int sfd = lookup (to, path, &st, &sname);
  if (sfd < 0)
    return 0; /* hidden in the target: nothing to copy */
  _cleanup_close_ int src_dir = sfd;
  if (!S_ISDIR (st.st_mode) && !S_ISREG (st.st_mode) && !S_ISLNK (st.st_mode))
    return 0; /* fifos, devices, sockets: not restored in a guest */
  struct archive_entry *e = archive_entry_new ();
  if (e == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  archive_entry_set_pathname (e, path);
  archive_entry_set_mode (e, st.st_mode);
  archive_entry_set_uid (e, st.st_uid);
  archive_entry_set_gid (e, st.st_gid);
  archive_entry_set_mtime (e, st.st_mtim.tv_sec, 0);
  int r = 0;
  _cleanup_close_ int in = -1;
  if (S_ISREG (st.st_mode))
    {
      in = openat (src_dir, sname, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      if (in < 0)
        r = wr_sys_error (err, "restore: open /%s", path);
      archive_entry_set_size (e, st.st_size);
    }
  else if (S_ISLNK (st.st_mode))
    {
      char target[4096];
      ssize_t n = readlinkat (src_dir, sname, target, sizeof target - 1);
      if (n < 0)
        r = wr_sys_error (err, "restore: readlink /%s", path);
      else
        {
          target[n] = '\0';
          archive_entry_set_symlink (e, target);
        }
    }
  if (r == 0)
    r = patch_write (ar, e, path, err);
  archive_entry_free (e);
  if (r < 0)
    return r;
  if (S_ISDIR (st.st_mode))
    return patch_dir_children (ar, to, path, depth, err);
  if (in >= 0)
    {
      char buf[65536];
      ssize_t n;
      off_t left = st.st_size;
      while (left > 0 && (n = wr_read_all (in, buf, sizeof buf)) > 0)
        {
          if (n > left)
            n = (ssize_t)left;
          if (archive_write_data (ar, buf, (size_t)n) < 0)
            return wr_error (err, 0, WR_E_INTERNAL, "restore: tar data of /%s: %s", path,
                             archive_error_string (ar));
          left -= n;
        }
    }
  return 0;
}

int
fsd_patch_tar (const struct fsd_state *to, const struct fsd_changes *c, int out_fd, wr_err_t *err)
{
  struct archive *ar = archive_write_new ();
  if (ar == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
  int r = 0;
  if (archive_write_set_format_pax_restricted (ar) != ARCHIVE_OK
      || archive_write_open_fd (ar, out_fd) != ARCHIVE_OK)
    r = wr_error (err, 0, WR_E_INTERNAL, "restore: tar: %s", archive_error_string (ar));
  /* removals first, as fsd_apply does: a path that goes, or changes type */
  for (size_t i = 0; r == 0 && i < c->n; i++)
    {
      const struct fsd_change *x = &c->v[i];
      if (x->kind != FSD_DELETED
          && !(x->kind == FSD_MODIFIED
               && (x->old_st.st_mode & S_IFMT) != (x->new_st.st_mode & S_IFMT)))
        continue;
      char wh[4200];
      const char *slash = strrchr (x->path, '/');
      snprintf (wh, sizeof wh, "%.*s%s.wh.%s", slash ? (int)(slash - x->path) : 0, x->path,
                slash ? "/" : "", slash ? slash + 1 : x->path);
      struct archive_entry *e = archive_entry_new ();
      if (e == NULL)
        r = wr_error (err, ENOMEM, WR_E_INTERNAL, "out of memory");
      else
        {
          archive_entry_set_pathname (e, wh);
          archive_entry_set_mode (e, S_IFREG | 0600);
          archive_entry_set_size (e, 0);
          r = patch_write (ar, e, x->path, err);
          archive_entry_free (e);
        }
    }
  for (size_t i = 0; r == 0 && i < c->n; i++)
    if (c->v[i].kind != FSD_DELETED)
      r = patch_entry (ar, to, c->v[i].path, 0, err);
  if (archive_write_close (ar) != ARCHIVE_OK && r == 0)
    r = wr_error (err, 0, WR_E_INTERNAL, "restore: tar: %s", archive_error_string (ar));
  archive_write_free (ar);
  return r;
}

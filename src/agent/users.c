/* Accounts of the sandbox: /etc/passwd and /etc/group read inside the
 * sandbox root (never the agent's own NSS: the agent is static, and the
 * host's accounts are not the sandbox's). Used by EXEC "user" and by the
 * FILE ops' "user" (owner of what they create) and "names" (owner names in
 * stat objects). */
#include "agent/agent.h"
#include "common/util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>

#define ACCOUNTS_MAX (1u << 20)

/* The whole file, NUL terminated, or NULL. */
static char *
read_etc (const char *path)
{
  wr_err_t err;
  _cleanup_close_ int fd
      = ag_open_in_root (ag.rootfd, path, O_RDONLY | O_NOCTTY | O_NONBLOCK, ag.use_openat2, &err);
  if (fd < 0)
    return NULL;
  char *buf = malloc (ACCOUNTS_MAX + 1);
  size_t len = 0;
  ssize_t n;
  while (buf && len < ACCOUNTS_MAX && (n = read (fd, buf + len, ACCOUNTS_MAX - len)) > 0)
    len += (size_t)n;
  if (buf)
    buf[len] = '\0';
  return buf;
}

/* Field i (0-based) of a ':' separated line into out; false if absent. */
static bool
field (const char *line, int i, char *out, size_t outsz)
{
  for (; i > 0; i--)
    {
      line = strpbrk (line, ":\n");
      if (line == NULL || *line == '\n')
        return false;
      line++;
    }
  size_t n = strcspn (line, ":\n");
  if (n >= outsz)
    return false;
  memcpy (out, line, n);
  out[n] = '\0';
  return true;
}

/* The line whose field key_field equals key. */
static const char *
find_line (const char *text, int key_field, const char *key)
{
  char f[256];
  for (const char *l = text; l && *l; l = strchr (l, '\n') ? strchr (l, '\n') + 1 : NULL)
    if (l[0] != '#' && field (l, key_field, f, sizeof f) && strcmp (f, key) == 0)
      return l;
  return NULL;
}

static bool
parse_id (const char *s, unsigned *ret)
{
  char *end;
  unsigned long v = strtoul (s, &end, 10);
  if (*s == '\0' || *end || v >= 0xffffffffUL)
    return false;
  *ret = (unsigned)v;
  return true;
}

int
ag_user_lookup (const char *name, struct ag_user *ret, wr_err_t *err)
{
  _cleanup_free_ char *pw = read_etc ("/etc/passwd");
  const char *l = pw && name[0] ? find_line (pw, 0, name) : NULL;
  char uid[16], gid[16];
  struct ag_user u = { .n_groups = 0 };
  if (l == NULL || !field (l, 2, uid, sizeof uid) || !field (l, 3, gid, sizeof gid)
      || !parse_id (uid, &u.uid) || !parse_id (gid, &u.gid))
    return wr_error (err, ENOENT, WR_E_INVALID,
                     "user \"%s\" not found in the sandbox's /etc/passwd", name);
  if (!field (l, 5, u.home, sizeof u.home) || u.home[0] != '/')
    snprintf (u.home, sizeof u.home, "/");
  u.groups[u.n_groups++] = u.gid;
  /* supplementary groups: /etc/group lines that list the user */
  _cleanup_free_ char *gr = read_etc ("/etc/group");
  for (const char *g = gr; g && *g && u.n_groups < AG_USER_MAX_GROUPS;
       g = strchr (g, '\n') ? strchr (g, '\n') + 1 : NULL)
    {
      char members[4096], id[16];
      unsigned v;
      if (!field (g, 3, members, sizeof members) || !field (g, 2, id, sizeof id)
          || !parse_id (id, &v) || v == u.gid)
        continue;
      char *save = NULL;
      for (char *m = strtok_r (members, ",", &save); m; m = strtok_r (NULL, ",", &save))
        if (strcmp (m, name) == 0)
          {
            u.groups[u.n_groups++] = v;
            break;
          }
    }
  *ret = u;
  return 0;
}

int
ag_user_of (json_t *body, struct ag_user *ret, bool *ret_has, wr_err_t *err)
{
  json_t *v = json_object_get (body, "user");
  *ret_has = false;
  if (v == NULL || json_is_null (v))
    return 0;
  if (!json_is_string (v) || strlen (json_string_value (v)) != json_string_length (v))
    return wr_error (err, EINVAL, WR_E_INVALID, "\"user\" must be a user name");
  if (ag_user_lookup (json_string_value (v), ret, err) < 0)
    return -1;
  *ret_has = true;
  return 0;
}

/* id -> name, from text (passwd or group); NULL if unknown */
static bool
id_name (const char *text, unsigned id, char *out, size_t outsz)
{
  char idbuf[16];
  snprintf (idbuf, sizeof idbuf, "%u", id);
  const char *l = text ? find_line (text, 2, idbuf) : NULL;
  return l && field (l, 0, out, outsz);
}

void
ag_names_load (struct ag_names *n)
{
  n->passwd = read_etc ("/etc/passwd");
  n->group = read_etc ("/etc/group");
}

void
ag_names_free (struct ag_names *n)
{
  free (n->passwd);
  free (n->group);
  n->passwd = n->group = NULL;
}

void
ag_names_add (const struct ag_names *n, json_t *st)
{
  char name[256];
  json_t *uid = json_object_get (st, "uid"), *gid = json_object_get (st, "gid");
  if (json_is_integer (uid)
      && id_name (n->passwd, (unsigned)json_integer_value (uid), name, sizeof name))
    json_object_set_new (st, "user", ag_json_lossy (name, strlen (name)));
  if (json_is_integer (gid)
      && id_name (n->group, (unsigned)json_integer_value (gid), name, sizeof name))
    json_object_set_new (st, "group", ag_json_lossy (name, strlen (name)));
}

/* Node names and the sandbox id rule (keys.h). */
#include "cluster/keys.h"

#include <string.h>

static bool
name_ok (const char *s, size_t max)
{
  size_t n = s ? strlen (s) : 0;
  if (n == 0 || n > max || s[0] == '-' || s[n - 1] == '-')
    return false;
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '-'))
      return false;
  return true;
}

bool
wr_node_name_valid (const char *name)
{
  return name_ok (name, WR_NODE_NAME_MAX);
}

bool
wr_project_name_valid (const char *name)
{
  return name_ok (name, 64);
}

bool
wr_id_node (const char *id, char *buf, size_t len)
{
  size_t n = id ? strlen (id) : 0;
  if (n < WR_ID_RANDOM_HEX + 2 || id[n - WR_ID_RANDOM_HEX - 1] != '-')
    return false;
  size_t k = n - WR_ID_RANDOM_HEX - 1;
  if (k >= len || k > WR_NODE_NAME_MAX)
    return false;
  memcpy (buf, id, k);
  buf[k] = '\0';
  return wr_node_name_valid (buf);
}

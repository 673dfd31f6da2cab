/* Group fork, checkpoints, restore and diff (docs/api.md). */
#include "lib/internal.h"

#include <stdio.h>
#include <string.h>

#define SNAP_TIMEOUT_MS (3600 * 1000) /* a snapshot copies the writable layer */

static json_t *
op (warren_client_t *c, const char *method, const char *id, const char *suffix, const json_t *body,
    warren_error_t *err)
{
  if (!warren_id_valid (id))
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "invalid sandbox id '%.64s'", id ? id : "(null)");
      return NULL;
    }
  char target[8400];
  snprintf (target, sizeof target, "/v1/sandboxes/%s%s", id, suffix);
  json_t *ret = NULL;
  if (wl_json_call (c, method, target, body, SNAP_TIMEOUT_MS, &ret, err) < 0)
    return NULL;
  return ret;
}

json_t *
warren_sandbox_fork (warren_client_t *c, const char *id, unsigned count, const json_t *overrides,
                     warren_error_t *err)
{
  json_t *body = overrides ? json_deep_copy (overrides) : json_object ();
  if (!json_is_object (body))
    {
      json_decref (body);
      wl_error (err, 0, WARREN_E_INVALID, 0, "fork overrides must be a JSON object");
      return NULL;
    }
  json_object_set_new (body, "count", json_integer (count));
  json_t *r = op (c, "POST", id, "/fork", body, err);
  json_decref (body);
  return r;
}

json_t *
warren_sandbox_checkpoint (warren_client_t *c, const char *id, const char *name,
                           warren_error_t *err)
{
  json_t *body = name ? json_pack ("{s:s}", "name", name) : json_object ();
  if (body == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "checkpoint name is not valid UTF-8");
      return NULL;
    }
  json_t *r = op (c, "POST", id, "/checkpoints", body, err);
  json_decref (body);
  return r;
}

json_t *
warren_sandbox_restore (warren_client_t *c, const char *id, const char *name, warren_error_t *err)
{
  json_t *body = name ? json_pack ("{s:s}", "name", name) : NULL;
  if (body == NULL)
    {
      wl_error (err, 0, WARREN_E_INVALID, 0, "a checkpoint name is required");
      return NULL;
    }
  json_t *r = op (c, "POST", id, "/restore", body, err);
  json_decref (body);
  return r;
}

json_t *
warren_sandbox_diff (warren_client_t *c, const char *id, const char *from, const char *to,
                     const char *path, warren_error_t *err)
{
  char q[8200] = "/diff?x=1";
  const char *keys[] = { "from", "to", "path" }, *vals[] = { from, to, path };
  for (size_t i = 0; i < 3; i++)
    if (vals[i])
      {
        char *enc = wl_urlencode (vals[i]);
        if (enc == NULL || strlen (q) + strlen (enc) + 16 >= sizeof q)
          {
            free (enc);
            wl_error (err, 0, WARREN_E_INVALID, 0, "diff %s too long", keys[i]);
            return NULL;
          }
        size_t l = strlen (q);
        snprintf (q + l, sizeof q - l, "&%s=%s", keys[i], enc);
        free (enc);
      }
  return op (c, "GET", id, q, NULL, err);
}

/* Membership records (member.h). */
#include "cluster/member.h"

#include <stdio.h>
#include <string.h>

#include "cluster/keys.h"
#include "common/util.h"

json_t *
wr_node_status_json (const struct wr_node_status *s)
{
  json_t *j = json_pack ("{s:s,s:s,s:O,s:O,s:I,s:I,s:I,s:I,s:I,s:O,s:f,s:s}", "name", s->name,
                         "address", s->advertise, "labels", s->labels, "backends", s->backends,
                         "sandboxes", (json_int_t)s->sandboxes, "memory_reserved_mb",
                         (json_int_t)s->memory_reserved_mb, "memory_total_mb",
                         (json_int_t)s->memory_total_mb, "memory_free_mb",
                         (json_int_t)s->memory_free_mb, "cpus", (json_int_t)s->cpus, "projects",
                         s->projects, "started_at", s->started_at, "version", WARREN_VERSION);
  if (j == NULL)
    return NULL;
  if (s->images)
    json_object_set (j, "images", s->images);
  if (s->lost_at_ms)
    json_object_set_new (j, "lost_at", json_real ((double)s->lost_at_ms / 1000.0));
  if (s->stopping)
    json_object_set_new (j, "stopping", json_true ());
  return j;
}

void
wr_node_status_count_project (json_t *projects, const char *project, long long memory_mb)
{
  json_t *pj = json_object_get (projects, project);
  if (pj == NULL)
    json_object_set_new (
        projects, project,
        pj = json_pack ("{s:I,s:I}", "sandboxes", (json_int_t)0, "memory_mb", (json_int_t)0));
  json_object_set_new (pj, "sandboxes",
                       json_integer (json_integer_value (json_object_get (pj, "sandboxes")) + 1));
  json_object_set_new (
      pj, "memory_mb",
      json_integer (json_integer_value (json_object_get (pj, "memory_mb")) + memory_mb));
}

void
wr_node_key (char *buf, size_t size, const char *name)
{
  snprintf (buf, size, "%s%s", WR_KEY_NODES, name);
}

int
wr_node_register (struct wr_etcd *e, const char *name, const char *status, int64_t ttl_s,
                  int64_t *ret_lease, wr_err_t *err)
{
  int64_t lease = 0;
  int r = wr_etcd_lease_grant (e, ttl_s, &lease, err);
  if (r < 0)
    return r;
  char key[128];
  wr_node_key (key, sizeof key, name);
  r = wr_etcd_put (e, key, status, lease, err);
  if (r < 0)
    {
      wr_etcd_lease_revoke (e, lease, NULL);
      return r;
    }
  *ret_lease = lease;
  return 0;
}

int
wr_node_publish_many (struct wr_etcd *e, size_t n, const char *const *names,
                      const char *const *statuses, const int64_t *leases, wr_err_t *err)
{
  if (n > WR_NODE_TXN_MAX)
    return wr_error (err, 0, WR_E_INVALID, "at most %d status writes per transaction",
                     WR_NODE_TXN_MAX);
  json_t *ops = json_array ();
  for (size_t i = 0; i < n; i++)
    {
      char key[128];
      wr_node_key (key, sizeof key, names[i]);
      json_t *put = json_pack ("{s:o,s:o,s:o}", "key", wr_etcd_b64 (key, strlen (key)), "value",
                               wr_etcd_b64 (statuses[i], strlen (statuses[i])), "lease",
                               json_sprintf ("%lld", (long long)leases[i]));
      json_array_append_new (ops, json_pack ("{s:o}", "request_put", put));
    }
  json_t *body = json_pack ("{s:o}", "success", ops);
  json_t *resp = NULL;
  int r = wr_etcd_call (e, "/v3/kv/txn", body, &resp, err);
  json_decref (body);
  json_decref (resp);
  return r;
}

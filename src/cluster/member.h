/* A node's membership record in etcd (docs/cluster.md), shared by warrend
 * (src/daemon/cluster.c) and the simulated nodes of warren-sim
 * (src/sim/main.c), so both publish the same keys, leases and status JSON. */
#ifndef WR_CLUSTER_MEMBER_H
#define WR_CLUSTER_MEMBER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#include "cluster/etcd.h"

/* A node writes its status at most this often (a burst of creates costs
 * etcd one write per node per second, not one per create). */
#define WR_NODE_PUBLISH_MIN_MS 1000

/* What a node publishes; json fields are borrowed (images may be NULL). */
struct wr_node_status
{
  const char *name, *advertise;
  json_t *labels, *backends, *projects, *images;
  long long sandboxes, memory_reserved_mb, memory_total_mb, memory_free_mb, cpus;
  double started_at;
  int64_t lost_at_ms; /* 0: never declared lost */
  bool stopping;      /* the daemon is stopping: place nothing here */
};

/* The status JSON under /warren/nodes/NAME. */
json_t *wr_node_status_json (const struct wr_node_status *s);
/* Add one sandbox of memory_mb to a status's "projects" object. */
void wr_node_status_count_project (json_t *projects, const char *project, long long memory_mb);
/* "/warren/nodes/NAME" into buf. */
void wr_node_key (char *buf, size_t size, const char *name);
/* Grant a lease of ttl_s seconds and write status under it. */
int wr_node_register (struct wr_etcd *e, const char *name, const char *status, int64_t ttl_s,
                      int64_t *ret_lease, wr_err_t *err);
/* Write several nodes' status in one etcd transaction (at most
 * WR_NODE_TXN_MAX, etcd's default --max-txn-ops is 128). Fails as a whole
 * when any lease is gone; the caller then writes them one by one. */
#define WR_NODE_TXN_MAX 128
int wr_node_publish_many (struct wr_etcd *e, size_t n, const char *const *names,
                          const char *const *statuses, const int64_t *leases, wr_err_t *err);

#endif

/* Cluster membership of a node (docs/cluster.md): with --cluster the daemon
 * registers under an etcd lease, keeps the lease alive and publishes its
 * capacity and load at a bounded rate. Without --cluster none of this runs. */
#ifndef WRD_CLUSTER_H
#define WRD_CLUSTER_H

#include <stdbool.h>

#include "daemon/daemon.h"

/* Command line options of warrend that belong to cluster mode. */
enum
{
  WRD_OPT_CLUSTER = 1000,
  WRD_OPT_NODE_NAME,
  WRD_OPT_ADVERTISE,
  WRD_OPT_LABEL,
  WRD_OPT_LEASE_TTL,
  WRD_OPT_ETCD_CACERT,
  WRD_OPT_ETCD_CERT,
  WRD_OPT_ETCD_KEY, /* the last cluster option */
};
#define WRD_CLUSTER_OPTIONS                                                                        \
  { "cluster", required_argument, NULL, WRD_OPT_CLUSTER },                                         \
      { "node-name", required_argument, NULL, WRD_OPT_NODE_NAME },                                 \
      { "advertise", required_argument, NULL, WRD_OPT_ADVERTISE },                                 \
      { "label", required_argument, NULL, WRD_OPT_LABEL },                                         \
      { "lease-ttl", required_argument, NULL, WRD_OPT_LEASE_TTL },                                 \
      { "etcd-cacert", required_argument, NULL, WRD_OPT_ETCD_CACERT },                             \
      { "etcd-cert", required_argument, NULL, WRD_OPT_ETCD_CERT },                                 \
  {                                                                                                \
    "etcd-key", required_argument, NULL, WRD_OPT_ETCD_KEY                                          \
  }
#define WRD_CLUSTER_USAGE                                                                          \
  "               [--cluster http://H:P[,...] --node-name NAME --advertise http://ADDR:PORT\n"     \
  "                [--label K=V]... [--lease-ttl S]\n"                                             \
  "                [--etcd-cacert F] [--etcd-cert F [--etcd-key F]]]\n"

/* Record one cluster option; < 0 on a bad value. */
int wrd_cluster_opt (int opt, const char *arg, wr_err_t *err);
/* Validate the options and, when --cluster was given, register and start
 * the membership thread. Registration must succeed once before the node
 * serves (so its ids carry its name from the first sandbox). */
int wrd_cluster_start (struct wrd *d, wr_err_t *err);
/* Stop publishing: the status says "stopping" (no placements) and the lease
 * runs out unless a restarted daemon resumes it (docs/cluster.md "Restarts"). */
void wrd_cluster_stop (struct wrd *d);
/* "NAME-" in cluster mode (every sandbox id starts with it), else NULL. */
const char *wrd_cluster_id_prefix (void);

#endif

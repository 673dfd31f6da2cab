/* The cluster's layout in etcd and the sandbox id rule, shared by warrend
 * (src/daemon/cluster.c) and warren-gateway (docs/cluster.md). */
#ifndef WR_CLUSTER_KEYS_H
#define WR_CLUSTER_KEYS_H

#include <stdbool.h>
#include <stddef.h>

/* Everything a gateway watches lives under WR_KEY_ROOT. */
#define WR_KEY_ROOT "/warren/"
#define WR_KEY_NODES "/warren/nodes/"       /* NAME -> node status (JSON), under the node's lease */
#define WR_KEY_DRAIN "/warren/drain/"       /* NAME -> "1": no new placements */
#define WR_KEY_PROJECTS "/warren/projects/" /* NAME -> {"max_sandboxes",...,"token_sha256"} */
/* Quota counters are kept apart so their writes do not wake every watcher. */
#define WR_KEY_QUOTA "/warren-quota/" /* NAME -> {"sandboxes": reserved, "memory_mb": reserved} */

/* Label carried by every sandbox created with a project token. */
#define WR_LABEL_PROJECT "warren.project"

/* Node names: [a-z0-9-]{1,19}, no leading or trailing '-', so that
 * "NAME-" + 12 hex digits fits a 32-character sandbox id. */
#define WR_NODE_NAME_MAX 19
#define WR_ID_RANDOM_HEX 12
bool wr_node_name_valid (const char *name);
/* The node a cluster sandbox id names ("NAME-" + 12 hex): copies it to buf
 * and returns true; false for ids made outside cluster mode. */
bool wr_id_node (const char *id, char *buf, size_t len);
/* Project names: [a-z0-9-]{1,64}. */
bool wr_project_name_valid (const char *name);

#endif

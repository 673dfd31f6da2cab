/* Sandbox network policy in the daemon (docs/network.md): rules, named
 * services (SQLite), the per-sandbox DNS resolver and the HTTP routes. */
#ifndef WRD_NETSVC_H
#define WRD_NETSVC_H

#include <stdio.h>
#include <event2/http.h>
#include <jansson.h>

#include "common/err.h"

struct wrd;
struct sandbox;

/* Startup (before adoption): the kernel side, the services table. A host
 * without nftables gets no networked sandboxes, and says why on create. */
void wrd_net_init (struct wrd *d);
/* Shutdown: the rules stay while any networked sandbox survives the daemon
 * (it is adopted by the next one); otherwise everything goes. */
void wrd_net_shutdown (struct wrd *d);

/* Create request: check "network" ("none" | "host" | "allow=RULE,...") and
 * "net_group"; *ret_network is the normalised string (new reference). */
int wrd_net_parse (struct wrd *d, json_t *network, json_t *group, json_t **ret_network,
                   wr_err_t *err);
/* Create request: check "net_limits" ({"egress_kbps": N, "connections": N},
 * allow= only); *ret_limits is the spec's object or NULL (new reference). */
int wrd_net_parse_limits (struct wrd *d, json_t *limits, const char *network, json_t **ret_limits,
                          wr_err_t *err);
bool wrd_net_wanted (json_t *spec);
/* The pool a create of spec takes its netns from (networked namespaces for
 * allow=, made ahead), or NULL: the runtime's own. */
struct wr_netns_pool *wrd_net_pool (json_t *spec);
/* Worker thread, right after the sandbox's first process started: the link,
 * addresses, policy, /etc/resolv.conf. */
int wrd_net_attach (struct wrd *d, struct sandbox *sb, wr_err_t *err);
/* VM backends, worker thread, before the VM starts: the slot's tap (its fd
 * in ret->tap_fd, the caller's to close once QEMU has it), addresses and
 * policy. */
struct wr_vm_net;
int wrd_net_attach_vm (struct wrd *d, struct sandbox *sb, struct wr_vm_net *ret, wr_err_t *err);
/* On the loop once the sandbox is registered: the DNS resolver. */
void wrd_net_start (struct wrd *d, struct sandbox *sb);
/* Restart: the link survived; chains, policy and resolver again. */
int wrd_net_readopt (struct wrd *d, struct sandbox *sb, wr_err_t *err);
void wrd_net_detach (struct wrd *d, struct sandbox *sb);
/* "net" object for inspect: address, group, names, and with detail the
 * denied packets (a counter read from nftables) */
json_t *wrd_net_json (struct wrd *d, struct sandbox *sb, bool detail);
/* metrics lines: warren_net_denied_packets_total{sandbox=...} */
void wrd_net_metrics (struct wrd *d, FILE *f);

/* PATCH /v1/sandboxes/{id} {"network": ...} */
void wrd_http_net_patch (struct wrd *d, struct evhttp_request *req, struct sandbox *sb);
/* /v1/net/services[/NAME] */
void wrd_http_net_services (struct wrd *d, struct evhttp_request *req, const char *rest);
/* /v1/sandboxes/{id}/proxy/{port}/{path}: HTTP into a port of the sandbox */
void wrd_http_net_proxy (struct wrd *d, struct evhttp_request *req, struct sandbox *sb,
                         const char *rest);

#endif

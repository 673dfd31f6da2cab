/* Per-sandbox networking (docs/network.md): a veth pair per sandbox, routed
 * /30s out of a per-daemon /20, egress filtered by one nftables table per
 * daemon (chains keyed by the host-side interface), NAT out through the host.
 * This file knows links, addresses and nftables; rules, names and DNS are
 * the daemon's (src/daemon/netsvc.c). */
#ifndef WR_NET_H
#define WR_NET_H

#include <stdbool.h>
#include <stdint.h>
#include <netinet/in.h>
#include <sys/types.h>

#include "common/err.h"

#define WR_NET_SLOTS 1024 /* /30s in a daemon's /20 */

struct wr_net;

/* One allowed destination: addr/prefix (host order) and a port range
 * (0-65535 = every port), TCP and UDP. */
struct wr_net_allow
{
  uint32_t addr;
  uint8_t prefix;
  uint16_t port_lo, port_hi;
};

/* Claim an address block no other daemon and no host address uses, and
 * (re)create this daemon's nftables table (names derive from root). */
int wr_net_new (const char *root, struct wr_net **ret, wr_err_t *err);
/* Does this root hold a block (a daemon of this root died holding it)? */
bool wr_net_claimed (const char *root);
/* Delete the table and release the block (clean shutdown). */
void wr_net_free (struct wr_net *n);
const char *wr_net_table (struct wr_net *n);
/* the block, e.g. "10.131.16.0/20" */
const char *wr_net_block (struct wr_net *n);

int wr_net_slot_alloc (struct wr_net *n, unsigned *ret, wr_err_t *err);
/* mark a slot used (restart: adopted sandboxes keep theirs) */
void wr_net_slot_take (struct wr_net *n, unsigned slot);
void wr_net_slot_free (struct wr_net *n, unsigned slot);
/* host-side (gateway, also the DNS address) and sandbox-side address */
struct in_addr wr_net_gateway (struct wr_net *n, unsigned slot);
struct in_addr wr_net_address (struct wr_net *n, unsigned slot);
void wr_net_ifname (struct wr_net *n, unsigned slot, char buf[16]);

/* Make the veth pair (eth0 inside the netns of the process behind pidfd),
 * addresses, routes, and the slot's empty (deny-all) chains. */
int wr_net_attach (struct wr_net *n, unsigned slot, int pidfd, wr_err_t *err);
/* VM backends: the slot's host side as a tap device (IFF_TAP|IFF_NO_PI|
 * IFF_VNET_HDR) with the gateway address, named like the veth it stands
 * for (its chains, DNS and counters apply unchanged). Returns the tap's
 * fd: the device lives while an fd is open (QEMU's), so it goes with the
 * VMM, whatever ends it. */
int wr_net_attach_tap (struct wr_net *n, unsigned slot, wr_err_t *err);
/* Networked namespaces made ahead (docs/network.md, "Creation cost"): a
 * free slot's link made into netns_fd (a pooled netns, pool.c), recorded
 * by the namespace's inode. A create that got that netns claims the slot
 * (ret_slot: link, addresses, route and deny-all chains ready: its first
 * wr_net_set_policy fills them); -ENOENT when pid's netns is not a prepared one. A
 * prepared netns closed unused gives its chains and slot back with
 * wr_net_unprepare. */
#define WR_NET_PREPARED_MAX 64
int wr_net_prepare (struct wr_net *n, int netns_fd, wr_err_t *err);
int wr_net_claim (struct wr_net *n, pid_t pid, unsigned *ret_slot);
void wr_net_unprepare (struct wr_net *n, int netns_fd);
/* Re-create the slot's chains for a link that survived a restart. */
int wr_net_readopt (struct wr_net *n, unsigned slot, wr_err_t *err);
/* Replace the slot's allowed destinations and its net group (NULL: none) in
 * one nftables transaction. kept: the policy names hosts, whose addresses
 * may leave the set while connections to them are kept
 * (wr_net_sets_replace): the chain gets the rule that lets those through
 * (only then: every rule makes each transaction's cache read longer). */
int wr_net_set_policy (struct wr_net *n, unsigned slot, const struct wr_net_allow *allow,
                       size_t n_allow, const char *group, bool kept, wr_err_t *err);
/* Egress limits of a slot (docs/network.md, "Egress limits"); 0 = unlimited. */
struct wr_net_limits
{
  uint64_t egress_kbps; /* kilobits per second the sandbox may send */
  uint32_t connections; /* connections it may have open at once */
};
/* Record the slot's limits and apply them in one transaction, or, with
 * with_policy, leave them to the slot's next wr_net_set_policy (a create:
 * one transaction for both). A changed connection limit counts the
 * connections opened after the change. */
int wr_net_set_limits (struct wr_net *n, unsigned slot, const struct wr_net_limits *l,
                       bool with_policy, wr_err_t *err);
/* Add destinations to the slot's set (addresses a DNS answer just named). */
int wr_net_allow_add (struct wr_net *n, unsigned slot, const struct wr_net_allow *allow,
                      size_t n_allow, wr_err_t *err);
/* Re-resolved names (docs/network.md, "DNS"): replace the allowed sets of
 * several slots in one nftables transaction (slots without chains yet are
 * left alone). kept: destinations that left the set, whose connections
 * already open from the slot stay allowed while they carry a packet every
 * 15 minutes. */
struct wr_net_set_update
{
  unsigned slot;
  const struct wr_net_allow *allow;
  size_t n_allow;
  const uint32_t *kept; /* host order */
  size_t n_kept;
};
int wr_net_sets_replace (struct wr_net *n, const struct wr_net_set_update *u, size_t count,
                         wr_err_t *err);
/* End the slot's kept connections to these destinations (its policy no
 * longer names the name they came from). */
int wr_net_kept_drop (struct wr_net *n, unsigned slot, const uint32_t *kept, size_t n_kept,
                      wr_err_t *err);
/* Remove the slot's chains, set, counter and link (idempotent). */
void wr_net_detach (struct wr_net *n, unsigned slot, const char *group);
/* The same for several slots in one transaction (groups[i]: slots[i]'s
 * group or NULL; groups may be NULL). */
void wr_net_detach_many (struct wr_net *n, const unsigned *slots, const char *const *groups,
                         size_t count);
/* Bytes through the slot's link since it was made: sent by the sandbox
 * (egress: everything it put on eth0, dropped or not) and sent to it. */
void wr_net_bytes (struct wr_net *n, unsigned slot, uint64_t *ret_egress, uint64_t *ret_ingress);
/* Packets the slot's policy dropped. */
int wr_net_denied (struct wr_net *n, unsigned slot, uint64_t *ret_packets, wr_err_t *err);

#endif

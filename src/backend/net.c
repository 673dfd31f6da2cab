/* Per-sandbox networking: veth pairs over rtnetlink, policy in nftables
 * (libnftables, in process: a policy update is one transaction, ~1 ms,
 * without a fork). Why this design: docs/network.md. */
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <linux/if_link.h>
#include <linux/if_tun.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <nftables/libnftables.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>

#include "backend/net.h"
#include "common/util.h"

#define BLOCK_BASE 0x0a800000u /* 10.128.0.0/9, cut into /20 blocks */
#define N_BLOCKS 2048
#define CLAIM_DIR "/run/warren-net"

struct wr_net
{
  char hash[9];   /* 8 hex of the daemon root: names of table and links */
  char table[32]; /* "warren_<hash>" */
  char block_str[32];
  uint32_t block; /* host order */
  unsigned block_idx;
  struct nft_ctx *nft;
  pthread_mutex_t lock; /* nft context and slot map */
  unsigned char used[WR_NET_SLOTS];
  unsigned next_slot;
  unsigned char fresh[WR_NET_SLOTS]; /* chains not made yet */
  /* egress limits wanted and those in the slot's l/k chains */
  struct wr_net_limits limits[WR_NET_SLOTS], limits_on[WR_NET_SLOTS];
  unsigned char lchains[WR_NET_SLOTS]; /* l<slot> and k<slot> made (a limit was set) */
  int self_netns;                      /* the daemon's own netns, to come back after setns */
  /* slots whose link is made in a pooled netns (wr_net_prepare), by the
   * netns's inode: a create that got one claims it (wr_net_claim) */
  struct prepared
  {
    uint64_t ino;
    unsigned slot;
  } prepared[WR_NET_PREPARED_MAX];
  unsigned n_prepared;
};

static uint32_t
fnv1a (const char *s)
{
  uint32_t h = 2166136261u;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 16777619u;
  return h;
}

/* Run nftables commands; the caller holds n->lock. */
static int
nft_run (struct wr_net *n, const char *cmds, wr_err_t *err)
{
  if (nft_run_cmd_from_buffer (n->nft, cmds) != 0)
    {
      const char *e = nft_ctx_get_error_buffer (n->nft);
      return wr_error (err, 0, WR_E_INTERNAL, "nftables: %.300s", e ? e : "failed");
    }
  nft_ctx_get_error_buffer (n->nft); /* drop warnings */
  return 0;
}

/* Does any host address fall into [base, base+4096)? */
static bool
block_in_use (uint32_t base)
{
  struct ifaddrs *ifa = NULL;
  if (getifaddrs (&ifa) < 0)
    return false;
  bool used = false;
  for (struct ifaddrs *i = ifa; i && !used; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
      {
        uint32_t a = ntohl (((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr);
        used = (a & 0xfffff000u) == base;
      }
  freeifaddrs (ifa);
  return used;
}

/* A block is claimed by CLAIM_DIR/<idx> holding "<root>\n<pid>\n", made with
 * link() (whole or absent, exclusive between daemons). A claim of our own
 * root, or of a dead daemon, is taken over. */
static int
claim_block (struct wr_net *n, const char *root, wr_err_t *err)
{
  mkdir (CLAIM_DIR, 0700);
  char mine[1200];
  int len = snprintf (mine, sizeof mine, "%s\n%d\n", root, (int)getpid ());
  unsigned start = fnv1a (root) % N_BLOCKS;
  for (unsigned k = 0; k < N_BLOCKS; k++)
    {
      unsigned idx = (start + k) % N_BLOCKS;
      char path[64], tmp[96], cur[1200] = "";
      snprintf (path, sizeof path, CLAIM_DIR "/%u", idx);
      _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC);
      bool ours = false;
      if (fd >= 0)
        {
          ssize_t r = read (fd, cur, sizeof cur - 1);
          cur[r > 0 ? r : 0] = 0;
          char *nl = strchr (cur, '\n');
          ours = nl && (size_t)(nl - cur) == strlen (root)
                 && strncmp (cur, root, strlen (root)) == 0;
          int pid = nl ? atoi (nl + 1) : 0;
          bool dead = pid <= 0 || (kill (pid, 0) < 0 && errno == ESRCH);
          if (!ours && !dead)
            continue;
          unlink (path); /* stale or ours: taken over below */
        }
      uint32_t base = BLOCK_BASE + idx * 4096u;
      /* our own block holds the links of sandboxes we are about to adopt */
      if (!ours && block_in_use (base))
        continue;
      snprintf (tmp, sizeof tmp, CLAIM_DIR "/.%u.%d", idx, (int)getpid ());
      _cleanup_close_ int t = open (tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (t < 0 || write (t, mine, (size_t)len) != len)
        {
          unlink (tmp);
          return wr_sys_error (err, "write %s", tmp);
        }
      int l = link (tmp, path);
      unlink (tmp);
      if (l < 0)
        continue; /* another daemon won it */
      n->block = base;
      n->block_idx = idx;
      struct in_addr a = { htonl (base) };
      snprintf (n->block_str, sizeof n->block_str, "%s/20", inet_ntoa (a));
      return 0;
    }
  return wr_error (err, 0, WR_E_EXHAUSTED, "no free /20 in 10.128.0.0/9 for sandbox networks");
}

bool
wr_net_claimed (const char *root)
{
  _cleanup_closedir_ DIR *dir = opendir (CLAIM_DIR);
  struct dirent *de;
  size_t rl = strlen (root);
  while (dir && (de = readdir (dir)) != NULL)
    {
      char path[300], cur[1200];
      if (de->d_name[0] == '.')
        continue;
      snprintf (path, sizeof path, CLAIM_DIR "/%s", de->d_name);
      _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC);
      ssize_t r = fd >= 0 ? read (fd, cur, sizeof cur - 1) : -1;
      if (r > (ssize_t)rl && cur[rl] == '\n' && strncmp (cur, root, rl) == 0)
        return true;
    }
  return false;
}

static void
release_block (struct wr_net *n)
{
  char path[64];
  snprintf (path, sizeof path, CLAIM_DIR "/%u", n->block_idx);
  unlink (path);
}

const char *
wr_net_table (struct wr_net *n)
{
  return n->table;
}

const char *
wr_net_block (struct wr_net *n)
{
  return n->block_str;
}

void
wr_net_ifname (struct wr_net *n, unsigned slot, char buf[16])
{
  snprintf (buf, 16, "wr%s%x", n->hash, slot & 0xfff);
}

struct in_addr
wr_net_gateway (struct wr_net *n, unsigned slot)
{
  return (struct in_addr){ htonl (n->block + slot * 4 + 1) };
}

struct in_addr
wr_net_address (struct wr_net *n, unsigned slot)
{
  return (struct in_addr){ htonl (n->block + slot * 4 + 2) };
}

#define KEPT_IDLE "15m"

/* The table: sandbox interfaces jump to their slot's chains through two
 * verdict maps; an interface without an entry, and anything from outside
 * towards a sandbox that is not a reply, is dropped. */
static int
table_reset (struct wr_net *n, wr_err_t *err)
{
  char cmds[2048];
  snprintf (cmds, sizeof cmds,
            "add table inet %1$s\n"
            "delete table inet %1$s\n"
            "add table inet %1$s\n"
            "add map inet %1$s out_map { type ifname : verdict; }\n"
            "add map inet %1$s in_map { type ifname : verdict; }\n"
            /* sandbox . destination: connections open to an address that
             * left a name's record (wr_net_sets_replace), kept while they
             * carry a packet every KEPT_IDLE */
            "add set inet %1$s kept { type ipv4_addr . ipv4_addr; flags dynamic,timeout; "
            "timeout " KEPT_IDLE "; }\n"
            "add chain inet %1$s sbfwd { type filter hook forward priority -5; policy accept; }\n"
            "add rule inet %1$s sbfwd oifname \"wr%2$s*\" ct state established,related accept\n"
            "add rule inet %1$s sbfwd iifname vmap @out_map\n"
            "add rule inet %1$s sbfwd iifname \"wr%2$s*\" drop\n"
            "add rule inet %1$s sbfwd oifname \"wr%2$s*\" drop\n"
            "add chain inet %1$s sbin { type filter hook input priority -5; policy accept; }\n"
            "add rule inet %1$s sbin iifname vmap @in_map\n"
            "add rule inet %1$s sbin iifname \"wr%2$s*\" drop\n"
            "add chain inet %1$s sbpost { type nat hook postrouting priority 95; policy accept; }\n"
            "add rule inet %1$s sbpost ip saddr %3$s oifname != \"wr%2$s*\" masquerade\n",
            n->table, n->hash, n->block_str);
  return nft_run (n, cmds, err);
}

int
wr_net_new (const char *root, struct wr_net **ret, wr_err_t *err)
{
  struct wr_net *n = calloc (1, sizeof *n);
  if (n == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "net");
  snprintf (n->hash, sizeof n->hash, "%08x", fnv1a (root));
  snprintf (n->table, sizeof n->table, "warren_%s", n->hash);
  pthread_mutex_init (&n->lock, NULL);
  n->self_netns = open ("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  n->nft = nft_ctx_new (NFT_CTX_DEFAULT);
  if (n->self_netns < 0 || n->nft == NULL)
    {
      int r = wr_sys_error (err, "net: netns or nftables context");
      if (n->nft)
        nft_ctx_free (n->nft);
      if (n->self_netns >= 0)
        close (n->self_netns);
      free (n);
      return r;
    }
  nft_ctx_buffer_output (n->nft);
  nft_ctx_buffer_error (n->nft);
  int r = claim_block (n, root, err);
  if (r == 0)
    {
      pthread_mutex_lock (&n->lock);
      r = table_reset (n, err);
      pthread_mutex_unlock (&n->lock);
      if (r < 0)
        release_block (n);
    }
  if (r < 0)
    {
      nft_ctx_free (n->nft);
      close (n->self_netns);
      free (n);
      return r;
    }
  *ret = n;
  return 0;
}

void
wr_net_free (struct wr_net *n)
{
  if (n == NULL)
    return;
  char cmd[96];
  snprintf (cmd, sizeof cmd, "delete table inet %s\n", n->table);
  pthread_mutex_lock (&n->lock);
  nft_run (n, cmd, NULL);
  pthread_mutex_unlock (&n->lock);
  release_block (n);
  nft_ctx_free (n->nft);
  close (n->self_netns);
  free (n);
}

int
wr_net_slot_alloc (struct wr_net *n, unsigned *ret, wr_err_t *err)
{
  /* next fit, not lowest first: the link of a slot's previous sandbox goes
   * with its netns, asynchronously; deleting it ourselves costs ~30 ms */
  pthread_mutex_lock (&n->lock);
  for (unsigned k = 0; k < WR_NET_SLOTS; k++)
    {
      unsigned i = (n->next_slot + k) % WR_NET_SLOTS;
      if (i == 0 || n->used[i]) /* slot 0: the block's own network address */
        continue;
      n->used[i] = 1;
      n->next_slot = i + 1;
      pthread_mutex_unlock (&n->lock);
      *ret = i;
      return 0;
    }
  pthread_mutex_unlock (&n->lock);
  return wr_error (err, 0, WR_E_EXHAUSTED, "every sandbox network slot is in use");
}

void
wr_net_slot_take (struct wr_net *n, unsigned slot)
{
  if (slot > 0 && slot < WR_NET_SLOTS)
    n->used[slot] = 1;
}

void
wr_net_slot_free (struct wr_net *n, unsigned slot)
{
  pthread_mutex_lock (&n->lock);
  if (slot < WR_NET_SLOTS)
    n->used[slot] = 0;
  pthread_mutex_unlock (&n->lock);
}

/* ---- rtnetlink ---- */

struct nlreq
{
  struct nlmsghdr h;
  char buf[1024];
};

static struct rtattr *
nl_attr (struct nlmsghdr *h, unsigned short type, const void *data, size_t len)
{
  struct rtattr *a = (struct rtattr *)((char *)h + NLMSG_ALIGN (h->nlmsg_len));
  a->rta_type = type;
  a->rta_len = (unsigned short)RTA_LENGTH (len);
  if (len && data)
    memcpy (RTA_DATA (a), data, len);
  else if (len)
    memset (RTA_DATA (a), 0, len);
  h->nlmsg_len = NLMSG_ALIGN (h->nlmsg_len) + RTA_ALIGN (a->rta_len);
  return a;
}

static void
nl_nest_end (struct nlmsghdr *h, struct rtattr *a)
{
  a->rta_len = (unsigned short)((char *)h + h->nlmsg_len - (char *)a);
}

/* Send one request and wait for its ack. */
static int
nl_talk (int fd, struct nlmsghdr *h, const char *what, wr_err_t *err)
{
  h->nlmsg_flags |= NLM_F_REQUEST | NLM_F_ACK;
  if (send (fd, h, h->nlmsg_len, 0) < 0)
    return wr_sys_error (err, "netlink %s", what);
  char buf[4096];
  ssize_t r = recv (fd, buf, sizeof buf, 0);
  if (r < 0)
    return wr_sys_error (err, "netlink %s", what);
  struct nlmsghdr *a = (struct nlmsghdr *)buf;
  if (r >= (ssize_t)NLMSG_LENGTH (sizeof (struct nlmsgerr)) && a->nlmsg_type == NLMSG_ERROR)
    {
      int e = ((struct nlmsgerr *)NLMSG_DATA (a))->error;
      if (e < 0)
        return wr_error (err, -e, WR_E_INTERNAL, "netlink %s", what);
    }
  return 0;
}

static int
nl_socket (wr_err_t *err)
{
  int fd = socket (AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (fd < 0)
    return wr_sys_error (err, "netlink socket");
  return fd;
}

static int
nl_link_up (int fd, int ifindex, wr_err_t *err)
{
  struct nlreq q = { 0 };
  q.h.nlmsg_len = NLMSG_LENGTH (sizeof (struct ifinfomsg));
  q.h.nlmsg_type = RTM_NEWLINK;
  struct ifinfomsg *ifi = NLMSG_DATA (&q.h);
  ifi->ifi_family = AF_UNSPEC;
  ifi->ifi_index = ifindex;
  ifi->ifi_flags = IFF_UP;
  ifi->ifi_change = IFF_UP;
  return nl_talk (fd, &q.h, "link up", err);
}

static int
nl_addr_add (int fd, int ifindex, struct in_addr a, wr_err_t *err)
{
  struct nlreq q = { 0 };
  q.h.nlmsg_len = NLMSG_LENGTH (sizeof (struct ifaddrmsg));
  q.h.nlmsg_type = RTM_NEWADDR;
  q.h.nlmsg_flags = NLM_F_CREATE | NLM_F_REPLACE;
  struct ifaddrmsg *ifa = NLMSG_DATA (&q.h);
  ifa->ifa_family = AF_INET;
  ifa->ifa_prefixlen = 30;
  ifa->ifa_index = (unsigned)ifindex;
  nl_attr (&q.h, IFA_LOCAL, &a, 4);
  nl_attr (&q.h, IFA_ADDRESS, &a, 4);
  return nl_talk (fd, &q.h, "address", err);
}

static int
nl_default_route (int fd, int ifindex, struct in_addr gw, wr_err_t *err)
{
  struct nlreq q = { 0 };
  q.h.nlmsg_len = NLMSG_LENGTH (sizeof (struct rtmsg));
  q.h.nlmsg_type = RTM_NEWROUTE;
  q.h.nlmsg_flags = NLM_F_CREATE | NLM_F_REPLACE;
  struct rtmsg *rt = NLMSG_DATA (&q.h);
  rt->rtm_family = AF_INET;
  rt->rtm_table = RT_TABLE_MAIN;
  rt->rtm_protocol = RTPROT_BOOT;
  rt->rtm_scope = RT_SCOPE_UNIVERSE;
  rt->rtm_type = RTN_UNICAST;
  nl_attr (&q.h, RTA_GATEWAY, &gw, 4);
  uint32_t oif = (uint32_t)ifindex;
  nl_attr (&q.h, RTA_OIF, &oif, 4);
  return nl_talk (fd, &q.h, "default route", err);
}

static int
nl_veth (int fd, const char *host_name, int peer_netns, wr_err_t *err)
{
  struct nlreq q = { 0 };
  q.h.nlmsg_len = NLMSG_LENGTH (sizeof (struct ifinfomsg));
  q.h.nlmsg_type = RTM_NEWLINK;
  q.h.nlmsg_flags = NLM_F_CREATE | NLM_F_EXCL;
  nl_attr (&q.h, IFLA_IFNAME, host_name, strlen (host_name) + 1);
  struct rtattr *li = nl_attr (&q.h, IFLA_LINKINFO, NULL, 0);
  nl_attr (&q.h, IFLA_INFO_KIND, "veth", 5);
  struct rtattr *data = nl_attr (&q.h, IFLA_INFO_DATA, NULL, 0);
  struct rtattr *peer = nl_attr (&q.h, VETH_INFO_PEER, NULL, sizeof (struct ifinfomsg));
  q.h.nlmsg_len = (unsigned)((char *)RTA_DATA (peer) - (char *)&q.h) + sizeof (struct ifinfomsg);
  nl_attr (&q.h, IFLA_IFNAME, "eth0", 5);
  uint32_t nsfd = (uint32_t)peer_netns;
  nl_attr (&q.h, IFLA_NET_NS_FD, &nsfd, 4);
  nl_nest_end (&q.h, peer);
  nl_nest_end (&q.h, data);
  nl_nest_end (&q.h, li);
  return nl_talk (fd, &q.h, "veth", err);
}

static void
nl_link_del (const char *name)
{
  int idx = (int)if_nametoindex (name);
  if (idx == 0)
    return;
  _cleanup_close_ int fd = nl_socket (NULL);
  if (fd < 0)
    return;
  struct nlreq q = { 0 };
  q.h.nlmsg_len = NLMSG_LENGTH (sizeof (struct ifinfomsg));
  q.h.nlmsg_type = RTM_DELLINK;
  ((struct ifinfomsg *)NLMSG_DATA (&q.h))->ifi_index = idx;
  nl_talk (fd, &q.h, "delete link", NULL);
}

static void
write_sysctl (const char *path, const char *val)
{
  _cleanup_close_ int fd = open (path, O_WRONLY | O_CLOEXEC);
  if (fd >= 0 && write (fd, val, strlen (val)) < 0)
    return;
}

/* Inside the sandbox's netns (this thread only, setns): eth0 up with its
 * address and a default route through the host side. */
static int
configure_inside (struct wr_net *n, unsigned slot, int netns, wr_err_t *err)
{
  if (setns (netns, CLONE_NEWNET) < 0)
    return wr_sys_error (err, "setns into the sandbox's network namespace");
  int r;
  _cleanup_close_ int fd = nl_socket (err);
  int idx = (int)if_nametoindex ("eth0");
  if (fd < 0)
    r = fd;
  else if (idx == 0)
    r = wr_sys_error (err, "eth0 in the sandbox");
  else if ((r = nl_addr_add (fd, idx, wr_net_address (n, slot), err)) == 0
           && (r = nl_link_up (fd, idx, err)) == 0)
    r = nl_default_route (fd, idx, wr_net_gateway (n, slot), err);
  /* a daemon thread left in a sandbox's netns would be far worse than dying */
  if (setns (n->self_netns, CLONE_NEWNET) < 0)
    abort ();
  return r;
}

/* The slot's counter, set, chains and map entries, made or, when a
 * previous sandbox of the slot left them (wr_net_detach), reset: run with
 * the slot's first policy, in its transaction (until then an interface
 * without a map entry is dropped by the base chains; one with a previous
 * sandbox's has no process behind it yet). The caller holds n->lock. */
static size_t
slot_chains (struct wr_net *n, unsigned slot, char *cmds, size_t len)
{
  char ifn[16];
  wr_net_ifname (n, slot, ifn);
  struct in_addr gw = wr_net_gateway (n, slot);
  char gws[INET_ADDRSTRLEN];
  inet_ntop (AF_INET, &gw, gws, sizeof gws);
  char lk[256] = "";
  if (n->lchains[slot])
    snprintf (lk, sizeof lk, "flush chain inet %1$s l%2$u\nflush chain inet %1$s k%2$u\n", n->table,
              slot);
  return (size_t)snprintf (
      cmds, len,
      "add counter inet %1$s c%2$u\n"
      "add set inet %1$s a%2$u { type ipv4_addr . inet_service; flags interval; }\n"
      "add chain inet %1$s e%2$u\n"
      "add chain inet %1$s i%2$u\n"
      "flush chain inet %1$s e%2$u\n"
      "flush chain inet %1$s i%2$u\n"
      "%5$s"
      /* a new count of denied packets (no rule refers to it now) */
      "delete counter inet %1$s c%2$u\n"
      "add counter inet %1$s c%2$u\n"
      "add rule inet %1$s i%2$u ct state established,related accept\n"
      "add rule inet %1$s i%2$u ip daddr %4$s udp dport 53 accept\n"
      "add rule inet %1$s i%2$u ip daddr %4$s tcp dport 53 accept\n"
      "add rule inet %1$s i%2$u counter name c%2$u drop\n"
      "add element inet %1$s out_map { \"%3$s\" : jump e%2$u }\n"
      "add element inet %1$s in_map { \"%3$s\" : jump i%2$u }\n",
      n->table, slot, ifn, gws, lk);
}

/* The slot's veth pair with eth0 made directly in netns (IFLA_NET_NS_FD:
 * moving a made link into a netns costs ~17 ms, making it there 0.4 ms),
 * both ends addressed and up, and a default route inside. */
static int
attach_netns (struct wr_net *n, unsigned slot, int netns, wr_err_t *err)
{
  char ifn[16], path[96];
  wr_net_ifname (n, slot, ifn);
  nl_link_del (ifn);                 /* a leftover of a crash */
  n->fresh[slot % WR_NET_SLOTS] = 1; /* chains come with the first policy */
  _cleanup_close_ int fd = nl_socket (err);
  if (fd < 0)
    return fd;
  int r = nl_veth (fd, ifn, netns, err);
  if (r < 0)
    return r;
  int idx = (int)if_nametoindex (ifn);
  snprintf (path, sizeof path, "/proc/sys/net/ipv4/conf/%s/forwarding", ifn);
  write_sysctl (path, "1");
  snprintf (path, sizeof path, "/proc/sys/net/ipv6/conf/%s/disable_ipv6", ifn);
  write_sysctl (path, "1");
  if (idx == 0)
    r = wr_sys_error (err, "%s", ifn);
  else if ((r = nl_addr_add (fd, idx, wr_net_gateway (n, slot), err)) == 0
           && (r = nl_link_up (fd, idx, err)) == 0)
    r = configure_inside (n, slot, netns, err);
  if (r < 0)
    nl_link_del (ifn);
  return r;
}

int
wr_net_attach_tap (struct wr_net *n, unsigned slot, wr_err_t *err)
{
  char ifn[16], path[96];
  wr_net_ifname (n, slot, ifn);
  nl_link_del (ifn);                 /* a leftover of a crash, or the slot's old veth */
  n->fresh[slot % WR_NET_SLOTS] = 1; /* chains come with the first policy */
  _cleanup_close_ int tap = open ("/dev/net/tun", O_RDWR | O_CLOEXEC);
  if (tap < 0)
    return wr_error (err, errno, WR_E_UNSUPPORTED, "open /dev/net/tun");
  struct ifreq ifr = { .ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR };
  snprintf (ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifn);
  if (ioctl (tap, TUNSETIFF, &ifr) < 0)
    return wr_sys_error (err, "tap %s", ifn);
  snprintf (path, sizeof path, "/proc/sys/net/ipv4/conf/%s/forwarding", ifn);
  write_sysctl (path, "1");
  snprintf (path, sizeof path, "/proc/sys/net/ipv6/conf/%s/disable_ipv6", ifn);
  write_sysctl (path, "1");
  _cleanup_close_ int fd = nl_socket (err);
  if (fd < 0)
    return fd;
  int idx = (int)if_nametoindex (ifn), r;
  if (idx == 0)
    return wr_sys_error (err, "%s", ifn);
  if ((r = nl_addr_add (fd, idx, wr_net_gateway (n, slot), err)) < 0
      || (r = nl_link_up (fd, idx, err)) < 0)
    return r; /* the tap goes with its fd */
  return TAKE_FD (tap);
}

int
wr_net_attach (struct wr_net *n, unsigned slot, int pidfd, wr_err_t *err)
{
  /* IFLA_NET_NS_FD wants an nsfs fd, not a pidfd: take one through setns
   * (pidfd, 5.8+), which names this very process however its pid is reused */
  if (setns (pidfd, CLONE_NEWNET) < 0)
    return wr_sys_error (err, "setns into the sandbox's network namespace");
  _cleanup_close_ int nsfd = open ("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (setns (n->self_netns, CLONE_NEWNET) < 0)
    abort ();
  if (nsfd < 0)
    return wr_sys_error (err, "sandbox netns");
  return attach_netns (n, slot, nsfd, err);
}

/* ---- prepared slots: links made into pooled namespaces ---- */

static int
netns_ino (int fd, uint64_t *ret)
{
  struct stat st;
  if (fstat (fd, &st) < 0)
    return -errno;
  *ret = (uint64_t)st.st_ino;
  return 0;
}

int
wr_net_prepare (struct wr_net *n, int netns_fd, wr_err_t *err)
{
  uint64_t ino = 0;
  if (netns_ino (netns_fd, &ino) < 0)
    return wr_sys_error (err, "fstat netns");
  pthread_mutex_lock (&n->lock);
  bool full = n->n_prepared >= WR_NET_PREPARED_MAX;
  pthread_mutex_unlock (&n->lock);
  if (full)
    return wr_error (err, 0, WR_E_EXHAUSTED, "too many prepared sandbox links");
  unsigned slot;
  int r = wr_net_slot_alloc (n, &slot, err);
  if (r < 0)
    return r;
  if ((r = attach_netns (n, slot, netns_fd, err)) < 0)
    {
      wr_net_slot_free (n, slot);
      return r;
    }
  /* no nftables here: the claiming create's one transaction makes (or
   * resets) the slot's chains with its policy (docs/network.md, "Creation
   * cost"); nothing runs in a pooled netns before that */
  pthread_mutex_lock (&n->lock);
  n->prepared[n->n_prepared++] = (struct prepared){ ino, slot };
  pthread_mutex_unlock (&n->lock);
  return 0;
}

/* the prepared slot of the netns with inode ino, taken off the list */
static int
prepared_take (struct wr_net *n, uint64_t ino, unsigned *ret_slot)
{
  int r = -ENOENT;
  pthread_mutex_lock (&n->lock);
  for (unsigned i = 0; i < n->n_prepared; i++)
    if (n->prepared[i].ino == ino)
      {
        *ret_slot = n->prepared[i].slot;
        n->prepared[i] = n->prepared[--n->n_prepared];
        r = 0;
        break;
      }
  pthread_mutex_unlock (&n->lock);
  return r;
}

int
wr_net_claim (struct wr_net *n, pid_t pid, unsigned *ret_slot)
{
  char path[64];
  snprintf (path, sizeof path, "/proc/%d/ns/net", (int)pid);
  struct stat st;
  if (stat (path, &st) < 0)
    return -errno;
  return prepared_take (n, (uint64_t)st.st_ino, ret_slot);
}

void
wr_net_unprepare (struct wr_net *n, int netns_fd)
{
  uint64_t ino = 0;
  unsigned slot;
  /* chains and slot; the link goes with the netns, once the pool closed it */
  if (netns_ino (netns_fd, &ino) == 0 && prepared_take (n, ino, &slot) == 0)
    wr_net_detach (n, slot, NULL);
}

int
wr_net_readopt (struct wr_net *n, unsigned slot, wr_err_t *err)
{
  n->fresh[slot % WR_NET_SLOTS] = 1;
  return 0;
}

static void
fmt_addr (uint32_t a, char *buf)
{
  struct in_addr x = { htonl (a) };
  inet_ntop (AF_INET, &x, buf, INET_ADDRSTRLEN);
}

/* Is a (addresses and ports) inside b? */
static bool
allow_within (const struct wr_net_allow *a, const struct wr_net_allow *b)
{
  uint32_t mb = b->prefix ? 0xffffffffu << (32 - b->prefix) : 0;
  return a->prefix >= b->prefix && (a->addr & mb) == (b->addr & mb) && a->port_lo >= b->port_lo
         && a->port_hi <= b->port_hi;
}

/* Commands that bring the slot's limit chains from on to its wanted limits
 * (the caller holds n->lock): the rate in l<slot>, the connection count in
 * k<slot>, each rewritten only when it changed. Egress is what the sandbox
 * sends: policed here, on the host's forward path, where the sandbox cannot
 * remove it (docs/network.md, "Egress limits"). */
static size_t
limit_cmds (struct wr_net *n, unsigned slot, const struct wr_net_limits *on, char *cmds, size_t len)
{
  const struct wr_net_limits *want = &n->limits[slot];
  size_t o = 0;
  if (want->egress_kbps != on->egress_kbps)
    {
      o += (size_t)snprintf (cmds + o, len - o, "flush chain inet %s l%u\n", n->table, slot);
      if (want->egress_kbps)
        {
          /* the bucket holds rate + burst bytes: at least 128 KiB, or a
           * GSO packet (up to 64 KiB on the veth) could never pass */
          unsigned long long rate = (unsigned long long)want->egress_kbps * 125;
          unsigned long long burst = rate < 131072 ? 131072 - rate : 0;
          o += (size_t)snprintf (cmds + o, len - o,
                                 "add rule inet %s l%u limit rate over %llu bytes/second burst "
                                 "%llu bytes drop\n",
                                 n->table, slot, rate, burst);
        }
    }
  if (want->connections != on->connections)
    {
      o += (size_t)snprintf (cmds + o, len - o, "flush chain inet %s k%u\n", n->table, slot);
      /* a new count starts from zero, and the kernel adds only unconfirmed
       * (new) connections to it: it counts those opened after it */
      if (want->connections)
        o += (size_t)snprintf (cmds + o, len - o,
                               "add rule inet %s k%u ct state new ct count over %u reject\n",
                               n->table, slot, want->connections);
    }
  return o;
}

/* The limit chains are made for a slot's first limit only: every chain in
 * the table makes each nftables transaction slower (libnftables reads the
 * whole table first; docs/network.md, "Creation cost"). */
static bool
limits_make_chains (struct wr_net *n, unsigned slot)
{
  return !n->lchains[slot] && (n->limits[slot].egress_kbps || n->limits[slot].connections);
}

int
wr_net_set_limits (struct wr_net *n, unsigned slot, const struct wr_net_limits *l, bool with_policy,
                   wr_err_t *err)
{
  if (slot >= WR_NET_SLOTS)
    return wr_error (err, 0, WR_E_INVALID, "slot %u", slot);
  char cmds[1024];
  size_t o = 0;
  int r = 0;
  pthread_mutex_lock (&n->lock);
  n->limits[slot] = *l;
  /* a slot without chains yet gets them with its first policy */
  bool make = limits_make_chains (n, slot);
  if (!with_policy && !n->fresh[slot])
    {
      if (make) /* jumps at the head of e<slot>, where wr_net_set_policy puts them */
        o = (size_t)snprintf (cmds, sizeof cmds,
                              "add chain inet %1$s l%2$u\nadd chain inet %1$s k%2$u\n"
                              "insert rule inet %1$s e%2$u jump k%2$u\n"
                              "insert rule inet %1$s e%2$u jump l%2$u\n",
                              n->table, slot);
      o += limit_cmds (n, slot, &n->limits_on[slot], cmds + o, sizeof cmds - o);
    }
  if (o > 0)
    {
      r = nft_run (n, cmds, err);
      if (r == 0)
        {
          n->limits_on[slot] = *l;
          n->lchains[slot] |= make;
        }
    }
  pthread_mutex_unlock (&n->lock);
  return r;
}

/* "flush set" and "add element" commands making allow the slot's set
 * (the caller holds n->lock); returns the bytes written. */
static size_t
set_elements (struct wr_net *n, unsigned slot, const struct wr_net_allow *allow, size_t n_allow,
              char *cmds, size_t cap)
{
  size_t o = 0;
#define OUT(...) o += (size_t)snprintf (cmds + o, o < cap ? cap - o : 0, __VA_ARGS__)
  OUT ("flush set inet %s a%u\n", n->table, slot);
  if (n_allow == 0)
    return o;
  OUT ("add element inet %s a%u { ", n->table, slot);
  bool first = true;
  for (size_t i = 0; i < n_allow; i++)
    {
      /* an element inside another (or equal to an earlier one) makes
       * the transaction fail with EEXIST: leave it out */
      bool covered = false;
      for (size_t k = 0; k < n_allow && !covered; k++)
        covered = k != i && allow_within (&allow[i], &allow[k])
                  && (!allow_within (&allow[k], &allow[i]) || k < i);
      if (covered)
        continue;
      char a[INET_ADDRSTRLEN];
      uint32_t mask = allow[i].prefix ? 0xffffffffu << (32 - allow[i].prefix) : 0;
      fmt_addr (allow[i].addr & mask, a);
      OUT ("%s%s/%u . %u-%u", first ? "" : ", ", a, allow[i].prefix, allow[i].port_lo,
           allow[i].port_hi);
      first = false;
    }
  OUT (" }\n");
#undef OUT
  return o;
}

int
wr_net_set_policy (struct wr_net *n, unsigned slot, const struct wr_net_allow *allow,
                   size_t n_allow, const char *group, bool kept, wr_err_t *err)
{
  size_t cap = 4096 + n_allow * 64;
  _cleanup_free_ char *cmds = malloc (cap);
  if (cmds == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "policy");
  if (slot >= WR_NET_SLOTS)
    return wr_error (err, 0, WR_E_INVALID, "slot %u", slot);
  char ifn[16];
  wr_net_ifname (n, slot, ifn);
  size_t o = 0;
  pthread_mutex_lock (&n->lock);
  bool fresh = n->fresh[slot];
  if (fresh)
    o = slot_chains (n, slot, cmds, cap);
  bool make = limits_make_chains (n, slot);
#define OUT(...) o += (size_t)snprintf (cmds + o, cap - o, __VA_ARGS__)
  if (make)
    OUT ("add chain inet %1$s l%2$u\nadd chain inet %1$s k%2$u\n", n->table, slot);
  o += set_elements (n, slot, allow, n_allow, cmds + o, cap - o);
  /* the chain is rebuilt in the same transaction: a group change and the
   * set are seen together by the next packet */
  OUT ("flush chain inet %1$s e%2$u\n", n->table, slot);
  /* its limits first: everything it sends */
  if (make || n->lchains[slot])
    OUT ("add rule inet %1$s e%2$u jump l%2$u\nadd rule inet %1$s e%2$u jump k%2$u\n", n->table,
         slot);
  {
    /* only its own address: NET_RAW could otherwise forge a neighbour's,
     * whose replies conntrack would then let in as established */
    char me[INET_ADDRSTRLEN];
    struct in_addr x = wr_net_address (n, slot);
    inet_ntop (AF_INET, &x, me, sizeof me);
    OUT ("add rule inet %1$s e%2$u ip saddr != %3$s counter name c%2$u drop\n", n->table, slot, me);
  }
  if (group)
    OUT ("add set inet %1$s g_%2$s { type ipv4_addr; }\n"
         "add rule inet %1$s e%3$u ip daddr @g_%2$s accept\n",
         n->table, group, slot);
  /* never allowed, whatever the rules say: link-local and cloud metadata,
   * other sandboxes, loopback, multicast and broadcast */
  OUT ("add rule inet %1$s e%2$u ip daddr { 169.254.0.0/16, 127.0.0.0/8, 0.0.0.0/8, "
       "224.0.0.0/3, %3$s } counter name c%2$u drop\n"
       "add rule inet %1$s e%2$u ip daddr . tcp dport @a%2$u accept\n"
       "add rule inet %1$s e%2$u ip daddr . udp dport @a%2$u accept\n",
       n->table, slot, n->block_str);
  if (kept)
    OUT ("add rule inet %1$s e%2$u ct state established,related ip saddr . ip daddr @kept "
         "update @kept { ip saddr . ip daddr } accept\n",
         n->table, slot);
  OUT ("add rule inet %1$s e%2$u counter name c%2$u drop\n", n->table, slot);
  if (group)
    {
      char a[INET_ADDRSTRLEN];
      struct in_addr me = wr_net_address (n, slot);
      inet_ntop (AF_INET, &me, a, sizeof a);
      OUT ("add element inet %s g_%s { %s }\n", n->table, group, a);
    }
#undef OUT
  int r;
  if (o + 512 >= cap)
    r = wr_error (err, E2BIG, WR_E_INVALID, "policy too large");
  else
    {
      /* fresh: the limit chains are new or were just flushed */
      static const struct wr_net_limits unlimited;
      limit_cmds (n, slot, fresh ? &unlimited : &n->limits_on[slot], cmds + o, cap - o);
      r = nft_run (n, cmds, err);
    }
  if (r == 0)
    {
      n->fresh[slot] = 0;
      n->limits_on[slot] = n->limits[slot];
      n->lchains[slot] |= make;
    }
  pthread_mutex_unlock (&n->lock);
  return r;
}

int
wr_net_allow_add (struct wr_net *n, unsigned slot, const struct wr_net_allow *allow, size_t n_allow,
                  wr_err_t *err)
{
  int r = 0;
  pthread_mutex_lock (&n->lock);
  for (size_t i = 0; i < n_allow; i++)
    {
      char cmd[256], a[INET_ADDRSTRLEN];
      fmt_addr (allow[i].addr, a);
      snprintf (cmd, sizeof cmd, "add element inet %s a%u { %s/%u . %u-%u }\n", n->table, slot, a,
                allow[i].prefix, allow[i].port_lo, allow[i].port_hi);
      /* EEXIST: already covered by the policy, which is what we wanted */
      if (nft_run (n, cmd, NULL) < 0 && errno != EEXIST)
        r = -1;
    }
  pthread_mutex_unlock (&n->lock);
  return r < 0 ? wr_error (err, 0, WR_E_INTERNAL, "nftables: adding learned addresses") : 0;
}

/* add (or, with drop, delete) the elements "slot's address . kept[i]"
 * of the kept set (the caller holds n->lock) */
static size_t
kept_elements (struct wr_net *n, unsigned slot, const uint32_t *kept, size_t n_kept, bool drop,
               char *cmds, size_t cap)
{
  size_t o = 0;
  char me[INET_ADDRSTRLEN], a[INET_ADDRSTRLEN];
  struct in_addr x = wr_net_address (n, slot);
  inet_ntop (AF_INET, &x, me, sizeof me);
  for (size_t i = 0; i < n_kept; i++)
    {
      fmt_addr (kept[i], a);
      /* added first: deleting an element that timed out would fail the
       * transaction */
      o += (size_t)snprintf (cmds + o, o < cap ? cap - o : 0,
                             "add element inet %s kept { %s . %s }\n", n->table, me, a);
      if (drop)
        o += (size_t)snprintf (cmds + o, o < cap ? cap - o : 0,
                               "delete element inet %s kept { %s . %s }\n", n->table, me, a);
    }
  return o;
}

int
wr_net_sets_replace (struct wr_net *n, const struct wr_net_set_update *u, size_t count,
                     wr_err_t *err)
{
  size_t cap = 256;
  for (size_t i = 0; i < count; i++)
    cap += 128 + (u[i].n_allow + u[i].n_kept) * 96;
  _cleanup_free_ char *cmds = malloc (cap);
  if (cmds == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "sets");
  size_t o = 0;
  pthread_mutex_lock (&n->lock);
  for (size_t i = 0; i < count; i++)
    {
      unsigned slot = u[i].slot % WR_NET_SLOTS;
      if (n->fresh[slot]) /* no set yet: its first policy makes it */
        continue;
      o += set_elements (n, slot, u[i].allow, u[i].n_allow, cmds + o, o < cap ? cap - o : 0);
      o += kept_elements (n, slot, u[i].kept, u[i].n_kept, false, cmds + o, o < cap ? cap - o : 0);
    }
  int r = 0;
  if (o >= cap)
    r = wr_error (err, E2BIG, WR_E_INTERNAL, "sets: %zu bytes", o);
  else if (o > 0)
    r = nft_run (n, cmds, err);
  pthread_mutex_unlock (&n->lock);
  return r;
}

int
wr_net_kept_drop (struct wr_net *n, unsigned slot, const uint32_t *kept, size_t n_kept,
                  wr_err_t *err)
{
  size_t cap = 64 + n_kept * 192;
  _cleanup_free_ char *cmds = malloc (cap);
  if (cmds == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "kept");
  int r = 0;
  pthread_mutex_lock (&n->lock);
  size_t o = kept_elements (n, slot % WR_NET_SLOTS, kept, n_kept, true, cmds, cap);
  if (o > 0 && o < cap)
    r = nft_run (n, cmds, err);
  pthread_mutex_unlock (&n->lock);
  return r;
}

void
wr_net_detach_many (struct wr_net *n, const unsigned *slots, const char *const *groups,
                    size_t count)
{
  /* The link goes with the sandbox's netns (the kernel deletes the pair
   * when the namespace is freed, off our path); deleting it here would wait
   * for RCU grace periods under RTNL: ~30 ms on this host. A link still
   * there when the slot is reused is deleted by wr_net_attach. */
  size_t cap = 1024 * (count ? count : 1), o = 0;
  _cleanup_free_ char *cmds = malloc (cap);
  if (cmds == NULL)
    return;
  pthread_mutex_lock (&n->lock);
  for (size_t i = 0; i < count; i++)
    {
      unsigned slot = slots[i] % WR_NET_SLOTS;
      if (n->fresh[slot]) /* no chains yet (a prepared slot, a failed policy) */
        continue;
      char ifn[16], a[INET_ADDRSTRLEN];
      wr_net_ifname (n, slot, ifn);
      struct in_addr me = wr_net_address (n, slot);
      inet_ntop (AF_INET, &me, a, sizeof a);
      o += (size_t)snprintf (cmds + o, cap - o,
                             "delete element inet %1$s out_map { \"%3$s\" }\n"
                             "delete element inet %1$s in_map { \"%3$s\" }\n"
                             "delete chain inet %1$s e%2$u\ndelete chain inet %1$s i%2$u\n"
                             "delete set inet %1$s a%2$u\ndelete counter inet %1$s c%2$u\n",
                             n->table, slot, ifn);
      if (n->lchains[slot])
        o += (size_t)snprintf (cmds + o, cap - o,
                               "delete chain inet %1$s l%2$u\ndelete chain inet %1$s k%2$u\n",
                               n->table, slot);
      if (groups && groups[i])
        o += (size_t)snprintf (cmds + o, cap - o, "delete element inet %s g_%s { %s }\n", n->table,
                               groups[i], a);
    }
  if (o > 0 && nft_run (n, cmds, NULL) < 0)
    {
      /* one at a time: a missing piece (a half-made slot) must not keep the rest */
      char *save = NULL;
      for (char *c = strtok_r (cmds, "\n", &save); c; c = strtok_r (NULL, "\n", &save))
        nft_run (n, c, NULL);
    }
  for (size_t i = 0; i < count; i++)
    {
      unsigned slot = slots[i] % WR_NET_SLOTS;
      n->used[slot] = 0;
      n->lchains[slot] = 0;
      n->fresh[slot] = 1;
      n->limits[slot] = n->limits_on[slot] = (struct wr_net_limits){ 0 };
    }
  pthread_mutex_unlock (&n->lock);
}

void
wr_net_detach (struct wr_net *n, unsigned slot, const char *group)
{
  wr_net_detach_many (n, &slot, &group, 1);
}

/* one counter of /sys/class/net/IF/statistics */
static uint64_t
link_stat (const char *ifn, const char *what)
{
  char path[96], buf[32];
  snprintf (path, sizeof path, "/sys/class/net/%s/statistics/%s", ifn, what);
  _cleanup_close_ int fd = open (path, O_RDONLY | O_CLOEXEC);
  ssize_t r = fd >= 0 ? read (fd, buf, sizeof buf - 1) : -1;
  buf[r > 0 ? r : 0] = 0;
  return strtoull (buf, NULL, 10);
}

void
wr_net_bytes (struct wr_net *n, unsigned slot, uint64_t *ret_egress, uint64_t *ret_ingress)
{
  char ifn[16];
  wr_net_ifname (n, slot, ifn);
  /* the host side: what it receives, the sandbox sent */
  *ret_egress = link_stat (ifn, "rx_bytes");
  *ret_ingress = link_stat (ifn, "tx_bytes");
}

int
wr_net_denied (struct wr_net *n, unsigned slot, uint64_t *ret_packets, wr_err_t *err)
{
  char cmd[128];
  snprintf (cmd, sizeof cmd, "list counter inet %s c%u", n->table, slot);
  pthread_mutex_lock (&n->lock);
  nft_ctx_output_set_flags (n->nft, NFT_CTX_OUTPUT_JSON);
  int r = nft_run (n, cmd, err);
  json_t *j = r == 0 ? json_loads (nft_ctx_get_output_buffer (n->nft), 0, NULL) : NULL;
  nft_ctx_output_set_flags (n->nft, 0);
  pthread_mutex_unlock (&n->lock);
  if (r < 0)
    return r;
  *ret_packets = 0;
  size_t i;
  json_t *e;
  json_array_foreach (json_object_get (j, "nftables"), i, e)
  {
    json_t *c = json_object_get (e, "counter");
    if (c)
      *ret_packets = (uint64_t)json_integer_value (json_object_get (c, "packets"));
  }
  json_decref (j);
  return 0;
}

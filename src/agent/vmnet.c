/* The NIC of a networked VM whose init is not Warren's (a disk image:
 * docs/vm.md, "Network"). The daemon gives the guest's virtio-net the MAC
 * 02:57:A:B:C:D for the address A.B.C.D of its /30, whose gateway (the
 * host's tap, also the resolver) is the address below it: that is all the
 * agent needs to set the address, the default route and /etc/resolv.conf.
 * A NIC that has an address already (the kit's /init set it from
 * warren.net=) is left alone. Plain ioctls: no netlink in the agent. */
#include "agent/agent.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util.h"

/* the interface with a Warren MAC: its name and guest address (host order) */
static bool
vmnet_find (char name[IFNAMSIZ], uint32_t *ret_addr)
{
  DIR *d = opendir ("/sys/class/net");
  struct dirent *e;
  bool found = false;
  while (d && !found && (e = readdir (d)) != NULL)
    {
      char path[300], mac[32] = "";
      unsigned b[4];
      if (e->d_name[0] == '.' || strlen (e->d_name) >= IFNAMSIZ)
        continue;
      snprintf (path, sizeof path, "/sys/class/net/%s/address", e->d_name);
      FILE *f = fopen (path, "re");
      if (f == NULL)
        continue;
      if (fgets (mac, sizeof mac, f)
          && sscanf (mac, "02:57:%2x:%2x:%2x:%2x", &b[0], &b[1], &b[2], &b[3]) == 4)
        {
          snprintf (name, IFNAMSIZ, "%s", e->d_name);
          *ret_addr = b[0] << 24 | b[1] << 16 | b[2] << 8 | b[3];
          found = true;
        }
      fclose (f);
    }
  if (d)
    closedir (d);
  return found;
}

static void
sin_set (struct sockaddr *sa, uint32_t addr)
{
  struct sockaddr_in *in = (struct sockaddr_in *)sa;
  memset (in, 0, sizeof *in);
  in->sin_family = AF_INET;
  in->sin_addr.s_addr = htonl (addr);
}

static int
vmnet_configure (int fd, const char *name, uint32_t addr)
{
  struct ifreq ifr = { 0 };
  snprintf (ifr.ifr_name, IFNAMSIZ, "%s", name);
  sin_set (&ifr.ifr_addr, addr);
  if (ioctl (fd, SIOCSIFADDR, &ifr) < 0)
    return -errno;
  sin_set (&ifr.ifr_netmask, 0xfffffffcu); /* the slot's /30 */
  if (ioctl (fd, SIOCSIFNETMASK, &ifr) < 0 || ioctl (fd, SIOCGIFFLAGS, &ifr) < 0)
    return -errno;
  ifr.ifr_flags |= IFF_UP;
  if (ioctl (fd, SIOCSIFFLAGS, &ifr) < 0)
    return -errno;
  struct rtentry rt = { 0 };
  sin_set (&rt.rt_dst, 0);
  sin_set (&rt.rt_genmask, 0);
  sin_set (&rt.rt_gateway, addr - 1);
  rt.rt_flags = RTF_UP | RTF_GATEWAY;
  rt.rt_dev = (char *)name;
  if (ioctl (fd, SIOCADDRT, &rt) < 0 && errno != EEXIST)
    return -errno;
  /* the gateway answers DNS for this VM only (docs/network.md, "DNS");
   * a symlink (systemd-resolved's stub) is replaced */
  char line[64];
  struct in_addr gw = { htonl (addr - 1) };
  int len = snprintf (line, sizeof line, "nameserver %s\n", inet_ntoa (gw));
  unlink ("/etc/resolv.conf");
  _cleanup_close_ int rfd
      = open ("/etc/resolv.conf", O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (rfd < 0 || write (rfd, line, (size_t)len) != len)
    return -errno;
  return 0;
}

int
ag_vmnet_try (void)
{
  char name[IFNAMSIZ];
  uint32_t addr;
  if (!vmnet_find (name, &addr))
    return 0;
  _cleanup_close_ int fd = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr = { 0 };
  snprintf (ifr.ifr_name, IFNAMSIZ, "%s", name);
  if (fd < 0 || ioctl (fd, SIOCGIFADDR, &ifr) == 0)
    return 1; /* configured by the guest's init */
  int r = vmnet_configure (fd, name, addr);
  struct in_addr a = { htonl (addr) };
  if (r < 0)
    fprintf (stderr, "warren-agent: %s: %s\n", name, strerror (-r));
  else
    fprintf (stderr, "warren-agent: %s %s/30\n", name, inet_ntoa (a));
  return 1;
}

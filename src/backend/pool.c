/* A pool of network namespaces made off the create path (docs/containers.md,
 * "Network namespace pool"). Creating a netns is the biggest single piece of
 * a sandbox's clone3 on this kernel (copy_net_ns: loopback registration,
 * sysctl tables; ~9% of the daemon's create+destroy time, perf). One worker
 * thread keeps a few ready: it unshares a netns on itself, brings loopback
 * up, makes the read-only sysfs that shows it (sysfs can only be mounted by
 * a task in the netns with CAP_SYS_ADMIN over its owner; the sandbox is not),
 * keeps both as fds and returns to the daemon's netns. A create joins one
 * with setns before clone3 (no CLONE_NEWNET) and the child attaches the
 * sysfs. The namespaces are owned by the host's user namespace, so the
 * sandbox's root holds no capability over its network (it could configure
 * its own before): `none` means loopback up and nothing else, which the
 * sandbox cannot change. The pool is filled when it is made; the worker
 * starts with the first take. A pool that is empty, disabled
 * (WARREN_NETNS_POOL=0) or failing leaves the create to CLONE_NEWNET. */
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../common/util.h"
#include "pool.h"
#include "syscalls.h"

#define POOL_MAX 64

struct ready_netns
{
  int netns_fd, sysfs_fd;
};

struct wr_netns_pool
{
  pthread_mutex_t lock;
  pthread_cond_t cond;
  pthread_t worker;
  bool started, stopping, broken;
  unsigned target, n;
  int home_fd;                      /* the daemon's netns, where the worker returns */
  struct wr_netns_pool_hooks hooks; /* zero: plain namespaces */
  struct ready_netns ready[POOL_MAX];
  uint64_t made, taken, missed;
  struct ready_netns sysfs_ns; /* plain pool: a netns kept for its sysfs, cloned to each */
  int shared_sysfs;            /* sysfs_ns.sysfs_fd, or -1: a sysfs per netns */
};

static void
ready_close (struct ready_netns *r)
{
  if (r->netns_fd >= 0)
    close (r->netns_fd);
  if (r->sysfs_fd >= 0)
    close (r->sysfs_fd);
  r->netns_fd = r->sysfs_fd = -1;
}

int
wr_netns_loopback_up (void)
{
  int r = 0;
  int s = socket (AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr;
  memset (&ifr, 0, sizeof ifr);
  memcpy (ifr.ifr_name, "lo", 3);
  ifr.ifr_flags = IFF_UP | IFF_RUNNING;
  if (s < 0 || ioctl (s, SIOCSIFFLAGS, &ifr) < 0)
    r = -errno;
  if (s >= 0)
    close (s);
  return r;
}

/* On the worker thread: a new netns with loopback up and its sysfs; back
 * home after. -errno on failure (the thread is home again either way). */
static int
make_one (int home_fd, int shared_sysfs, struct ready_netns *ret)
{
  ret->netns_fd = ret->sysfs_fd = -1;
  if (unshare (CLONE_NEWNET) < 0)
    return -errno;
  int r = wr_netns_loopback_up ();
  if (r == 0 && shared_sysfs >= 0)
    {
      /* a clone of the shared sysfs mount: no superblock of its own */
      ret->sysfs_fd = (int)syscall (__NR_open_tree, shared_sysfs, "",
                                    OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
      if (ret->sysfs_fd < 0)
        r = -errno;
    }
  else if (r == 0)
    {
      _cleanup_close_ int fs = (int)syscall (__NR_fsopen, "sysfs", FSOPEN_CLOEXEC);
      if (fs < 0 || syscall (__NR_fsconfig, fs, FSCONFIG_SET_FLAG, "ro", NULL, 0) < 0
          || syscall (__NR_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
        r = -errno;
      else
        {
          ret->sysfs_fd = (int)syscall (__NR_fsmount, fs, FSMOUNT_CLOEXEC,
                                        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
                                            | MOUNT_ATTR_NOEXEC);
          if (ret->sysfs_fd < 0)
            r = -errno;
        }
    }
  if (r == 0)
    {
      ret->netns_fd = open ("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
      if (ret->netns_fd < 0)
        r = -errno;
    }
  /* never leave a daemon thread in a sandbox's netns */
  if (setns (home_fd, CLONE_NEWNET) < 0)
    abort ();
  if (r < 0)
    ready_close (ret);
  return r;
}

/* make_one, then the owner's preparation (a networked pool: net.c's link
 * into it), back home */
static int
make_ready (struct wr_netns_pool *p, struct ready_netns *ret)
{
  int r = make_one (p->home_fd, p->shared_sysfs, ret);
  if (r == 0 && p->hooks.prepare && (r = p->hooks.prepare (p->hooks.arg, ret->netns_fd)) < 0)
    ready_close (ret);
  return r;
}

/* a namespace the pool closes without handing it out */
static void
drop (struct wr_netns_pool *p, struct ready_netns *r)
{
  if (p->hooks.discard)
    p->hooks.discard (p->hooks.arg, r->netns_fd);
  ready_close (r);
}

static void *
worker (void *arg)
{
  struct wr_netns_pool *p = arg;
  pthread_mutex_lock (&p->lock);
  while (!p->stopping)
    {
      if (p->n >= p->target || p->broken)
        {
          pthread_cond_wait (&p->cond, &p->lock);
          continue;
        }
      pthread_mutex_unlock (&p->lock);
      struct ready_netns one;
      int r = make_ready (p, &one);
      pthread_mutex_lock (&p->lock);
      if (r < 0)
        p->broken = true; /* creates fall back to CLONE_NEWNET from now on */
      else if (p->stopping || p->n >= p->target)
        drop (p, &one);
      else
        {
          p->ready[p->n++] = one;
          p->made++;
        }
    }
  pthread_mutex_unlock (&p->lock);
  return NULL;
}

int
wr_netns_pool_new (unsigned target, struct wr_netns_pool **ret, wr_err_t *err)
{
  return wr_netns_pool_new_hooked (target, NULL, ret, err);
}

int
wr_netns_pool_new_hooked (unsigned target, const struct wr_netns_pool_hooks *hooks,
                          struct wr_netns_pool **ret, wr_err_t *err)
{
  *ret = NULL;
  if (target == 0)
    return 0;
  struct wr_netns_pool *p = calloc (1, sizeof *p);
  if (p == NULL)
    return wr_error (err, ENOMEM, WR_E_INTERNAL, "netns pool");
  p->target = target > POOL_MAX ? POOL_MAX : target;
  if (hooks)
    p->hooks = *hooks;
  p->home_fd = open ("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  if (p->home_fd < 0)
    {
      int r = wr_sys_error (err, "open /proc/self/ns/net");
      free (p);
      return r;
    }
  pthread_mutex_init (&p->lock, NULL);
  pthread_cond_init (&p->cond, NULL);
  p->shared_sysfs = -1;
  p->sysfs_ns.netns_fd = p->sysfs_ns.sysfs_fd = -1;
  /* A sysfs superblock per netns costs each create a walk of every sysfs
   * superblock alive (sget_fc) and each memory cgroup made after it a
   * shrinker slot (docs/performance.md, "Density"). Without a link to show
   * (a plain pool: `none`), every netns gets a clone of one sysfs of a netns
   * kept for it: the same tree, `lo` only. A kernel that cannot clone a
   * detached mount leaves a sysfs per netns. */
  if (p->hooks.prepare == NULL && make_one (p->home_fd, -1, &p->sysfs_ns) == 0)
    {
      int probe = (int)syscall (__NR_open_tree, p->sysfs_ns.sysfs_fd, "",
                                OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
      if (probe >= 0)
        {
          close (probe);
          p->shared_sysfs = p->sysfs_ns.sysfs_fd;
        }
      else
        ready_close (&p->sysfs_ns);
    }
  /* Filled now, on the caller's thread: the daemon starts with the pool it
   * keeps (its descriptor count at rest includes them), and the first
   * creates find one. A failure here leaves creates to CLONE_NEWNET. */
  while (p->n < p->target && !p->broken)
    {
      if (make_ready (p, &p->ready[p->n]) < 0)
        p->broken = true;
      else
        p->n++;
    }
  *ret = p;
  return 0;
}

void
wr_netns_pool_free (struct wr_netns_pool *p)
{
  if (p == NULL)
    return;
  pthread_mutex_lock (&p->lock);
  p->stopping = true;
  pthread_cond_signal (&p->cond);
  bool started = p->started;
  pthread_mutex_unlock (&p->lock);
  if (started)
    pthread_join (p->worker, NULL);
  for (unsigned i = 0; i < p->n; i++)
    drop (p, &p->ready[i]);
  ready_close (&p->sysfs_ns);
  close (p->home_fd);
  pthread_mutex_destroy (&p->lock);
  pthread_cond_destroy (&p->cond);
  free (p);
}

int
wr_netns_pool_take (struct wr_netns_pool *p, int *ret_netns, int *ret_sysfs)
{
  *ret_netns = *ret_sysfs = -1;
  if (p == NULL)
    return -EAGAIN;
  int r = -EAGAIN;
  pthread_mutex_lock (&p->lock);
  if (!p->started && !p->stopping)
    {
      /* first use: the worker starts now, this create makes its own */
      sigset_t all, old;
      sigfillset (&all);
      pthread_sigmask (SIG_SETMASK, &all, &old); /* signals stay with the daemon's threads */
      p->started = pthread_create (&p->worker, NULL, worker, p) == 0;
      pthread_sigmask (SIG_SETMASK, &old, NULL);
      if (!p->started)
        p->broken = true;
    }
  if (p->n > 0)
    {
      struct ready_netns one = p->ready[--p->n];
      *ret_netns = one.netns_fd;
      *ret_sysfs = one.sysfs_fd;
      p->taken++;
      r = 0;
    }
  else
    p->missed++;
  pthread_cond_signal (&p->cond);
  pthread_mutex_unlock (&p->lock);
  return r;
}

void
wr_netns_pool_stats (struct wr_netns_pool *p, unsigned *ready, uint64_t *taken, uint64_t *missed)
{
  *ready = 0;
  *taken = *missed = 0;
  if (p == NULL)
    return;
  pthread_mutex_lock (&p->lock);
  *ready = p->n;
  *taken = p->taken;
  *missed = p->missed;
  pthread_mutex_unlock (&p->lock);
}

void
wr_netns_pool_enter (struct wr_netns_pool *p, int netns_fd)
{
  if (setns (netns_fd, CLONE_NEWNET) < 0)
    abort (); /* a fd the pool made: only a broken kernel refuses it */
  (void)p;
}

void
wr_netns_pool_leave (struct wr_netns_pool *p)
{
  if (setns (p->home_fd, CLONE_NEWNET) < 0)
    abort (); /* never leave a daemon thread in a sandbox's netns */
}

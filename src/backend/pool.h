/* Network namespaces made ahead of creates by one worker thread (pool.c). */
#ifndef WR_POOL_H
#define WR_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/err.h"

struct wr_netns_pool;

/* enough for the two builder threads to find one ready after a burst */
#define WR_NETNS_POOL_DEFAULT 4

/* target 0: no pool (*ret = NULL; take then always misses). Filled on the
 * calling thread before it returns (no thread yet: call it before any fork
 * that must not lose one); the worker that refills it starts at the first
 * take. */
int wr_netns_pool_new (unsigned target, struct wr_netns_pool **ret, wr_err_t *err);
/* A pool of prepared namespaces (net.c: a sandbox link into each, for
 * `allow=` creates): prepare runs on the filling thread, back in the
 * daemon's netns, with each new netns's fd; < 0 drops that netns and stops
 * the pool like any failure. discard gets each prepared netns the pool
 * closes without handing it out. */
struct wr_netns_pool_hooks
{
  int (*prepare) (void *arg, int netns_fd);
  void (*discard) (void *arg, int netns_fd);
  void *arg;
};
int wr_netns_pool_new_hooked (unsigned target, const struct wr_netns_pool_hooks *hooks,
                              struct wr_netns_pool **ret, wr_err_t *err);
/* Stops the worker and closes the namespaces not handed out. NULL is fine. */
void wr_netns_pool_free (struct wr_netns_pool *p);
/* A ready netns (loopback up, owned by the host's user namespace) and a
 * detached read-only sysfs mount of it, both O_CLOEXEC fds the caller owns;
 * -EAGAIN when none is ready. */
int wr_netns_pool_take (struct wr_netns_pool *p, int *ret_netns, int *ret_sysfs);
/* Bring up loopback in the calling thread's netns; -errno on failure. */
int wr_netns_loopback_up (void);
/* Move the calling thread into netns_fd (around a clone3) and back home;
 * abort () rather than leave a daemon thread in a sandbox's netns. */
void wr_netns_pool_enter (struct wr_netns_pool *p, int netns_fd);
void wr_netns_pool_leave (struct wr_netns_pool *p);
void wr_netns_pool_stats (struct wr_netns_pool *p, unsigned *ready, uint64_t *taken,
                          uint64_t *missed);

#endif

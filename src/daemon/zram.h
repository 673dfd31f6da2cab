/* Compressed swap for paused sandboxes (docs/containers.md, "Pause"):
 * warrend --zram-size MB adds a zram device of its own, makes it swap and
 * turns it on at a high priority; it is turned off and removed at exit. */
#ifndef WRD_ZRAM_H
#define WRD_ZRAM_H

#include <stdbool.h>
#include <stdint.h>

#include "common/err.h"

struct wrd_zram
{
  int dev;         /* zramN, -1 when none */
  char node[1200]; /* the block device node swapon was given (under the root) */
  bool swap_on;
};

/* Set up size_mb of zram swap at priority prio; on failure (no zram in the
 * kernel, no hot_add) nothing is left behind and z->dev is -1. */
int wrd_zram_setup (struct wrd_zram *z, const char *root, uint64_t size_mb, int prio,
                    wr_err_t *err);
void wrd_zram_teardown (struct wrd_zram *z);

#endif

/* Limits shared by the image store, the daemon and the backends: one
 * constant each, so that what the store accepts is what create can stack. */
#ifndef WR_LIMITS_H
#define WR_LIMITS_H

/* Layers of one sandbox's root file system: an image's own layers plus the
 * extra layers of a create request. Checked at import, pull, pack, build
 * and create (invalid_argument above it). 64 is what every backend can
 * stack: the VM backend attaches one disk per layer. */
#define WR_MAX_LAYERS 64

#endif

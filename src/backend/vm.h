/* VM backends on QEMU (docs/vm.md): "microvm" (QEMU's microvm machine,
 * virtio-mmio, no firmware) and "vm" (q35 with SeaBIOS, virtio-pci). Both
 * boot Debian's cloud kernel with the Warren initramfs (scripts/mk-guest.sh),
 * attach the image's EROFS layer files as read-only virtio disks, and run
 * warren-agent as the guest's PID 1 on a virtio-serial port whose host side
 * is a unix socket in the sandbox state dir. They fill the same
 * wr_container as the container backend, so the daemon above is unchanged. */
#ifndef WR_VM_H
#define WR_VM_H

#include <stdbool.h>
#include <netinet/in.h>

#include <jansson.h>

#include "container.h"
#include "../image/store.h"

enum wr_vm_kind
{
  WR_VM_MICRO, /* microvm */
  WR_VM_FULL,  /* q35 + firmware */
};

/* Each layer is one virtio disk: microvm has 24 virtio-mmio transports and
 * q35 30 free PCI slots, less the agent's serial port, the RNG and the
 * writable disk. Images with more layers than these are refused at create
 * (the container backend takes WR_MAX_LAYERS). */
#define WR_MICROVM_MAX_LAYERS (24 - 3)
#define WR_VM_MAX_LAYERS (30 - 3)

/* A networked VM (spec->vm_net; docs/network.md, "VMs"): the host side is
 * a tap (wr_net_attach_tap) whose fd QEMU gets as its NIC's backend; the
 * guest's init gives eth0 address/30 with gateway as its default route
 * and DNS server. Such a VM always boots (no restore snapshot: a clone
 * would carry its template's address). */
struct wr_vm_net
{
  int tap_fd; /* the caller's; QEMU gets a copy, the caller closes its own */
  struct in_addr address, gateway;
};

/* Can this node run VMs at all (QEMU and the guest kit present)? On false,
 * err says what is missing (WR_E_UNSUPPORTED). Cheap: stat calls only. */
bool wr_vm_available (enum wr_vm_kind kind, wr_err_t *err);

/* Start a VM for spec and return once QEMU runs and the agent channel is
 * connected (ret->agent_fd: O_NONBLOCK|O_CLOEXEC). The guest boots (or
 * restores from a snapshot) asynchronously; requests written before the
 * agent is up wait in the socket. Uses spec->layer_files, memory_mb, cpus,
 * disk_mb, pids_max, id, state_dir. */
int wr_vm_create (struct wr_runtime *rt, enum wr_vm_kind kind, const struct wr_container_spec *spec,
                  struct wr_container *ret, wr_err_t *err);
/* Kill QEMU, reap it, remove its cgroup and sockets; idempotent. */
int wr_vm_destroy (struct wr_runtime *rt, struct wr_container *c, const char *state_dir,
                   wr_err_t *err);
/* Re-attach after a daemon restart (QEMU keeps its chardev socket listening). */
int wr_vm_adopt (struct wr_runtime *rt, const char *id, pid_t pid, uint64_t start_time,
                 const char *state_dir, struct wr_container *ret, wr_err_t *err);
/* Pause: QMP stop (vCPUs stopped; QEMU's memory stays). Resume: QMP cont. */
int wr_vm_freeze (struct wr_runtime *rt, const char *state_dir, bool frozen, wr_err_t *err);

/* "kvm" or "tcg": what VMs of this runtime use (probed once: /dev/kvm must
 * open and boot a guest; WARREN_VM_ACCEL=kvm|tcg overrides). */
const char *wr_vm_accel (struct wr_runtime *rt);

/* Build (synchronously) the restore snapshot for spec's key if missing;
 * create does this in the background after the first boot of a key. */
int wr_vm_snapshot_build (struct wr_runtime *rt, enum wr_vm_kind kind,
                          const struct wr_container_spec *spec, wr_err_t *err);
/* Whether a snapshot for spec's key exists (create will restore from it). */
bool wr_vm_snapshot_exists (struct wr_runtime *rt, enum wr_vm_kind kind,
                            const struct wr_container_spec *spec);

/* ---- VM disk images (vm_disk.c) ---- */
struct wr_store;
struct wr_image;

/* 1 (fmt "qcow2" or "raw") when path is a disk image by content: qcow2 magic
 * (no backing or external data file allowed: WR_E_INVALID), or a raw disk
 * with an MBR/GPT boot signature; 0 when it is not one. */
int wr_vm_disk_sniff (const char *path, char fmt[8], wr_err_t *err);
/* Store the disk once, read-only, as ROOT/vm/disks/<sha256>.<fmt> and name
 * it ref: an image of one marker layer whose config labels
 * "warren.vm_disk" ("sha256:...") and "warren.vm_disk_format" point at it.
 * Blocking (copies and hashes the file): call from a worker thread. */
int wr_vm_disk_import (struct wr_store *s, const char *ref, const char *path, struct wr_image **ret,
                       wr_err_t *err);
/* The base disk an image config names: 1 with path/fmt, 0 when the image is
 * not a disk image, negative when the label is bad or the file missing. */
int wr_vm_disk_from_config (const char *root, const json_t *config, char *path, size_t len,
                            char fmt[8], wr_err_t *err);

#endif

#!/usr/bin/env bash
# Builds the guest kit of the microvm and vm backends (docs/vm.md):
#   OUT/vmlinuz        Debian's cloud kernel (linux-image-cloud-amd64)
#   OUT/initramfs.img  gzip'd newc cpio: /init, static busybox, the kernel
#                      modules the guest needs (virtio-mmio/pci, block,
#                      console, rng, erofs, overlay, net), in load order
#   OUT/modules        the module list of the initramfs (warrend looks for
#                      virtio_net.ko before it gives a VM a NIC)
#   OUT/release        the kernel release the modules belong to
# The agent is not in it: warrend appends its own warren-agent as a second
# cpio member at VM start, so the guest always runs the daemon's agent.
#
# usage: scripts/mk-guest.sh [OUT]   (default: build/guest)
# The kernel comes from /boot + /lib/modules when linux-image-cloud-amd64 is
# installed, else from the package fetched with apt-get download (Debian's
# archive, nothing else) and unpacked with dpkg-deb.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/build/guest}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

kroot=/
kver=$(ls /boot 2>/dev/null | sed -n 's/^vmlinuz-\(.*-cloud-amd64\)$/\1/p' | sort -V | tail -1)
if [ -z "$kver" ] || [ ! -d "/lib/modules/$kver" ]; then
  # not installed: unpack the package from Debian's archive
  apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1 || apt-get update -qq
  pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-.*-cloud-amd64\)$/\1/p' | head -1)
  [ -n "$pkg" ] || { echo "mk-guest: linux-image-cloud-amd64 not found (apt-get update?)" >&2; exit 1; }
  (cd "$tmp" && apt-get download "$pkg" >/dev/null)
  dpkg-deb -x "$tmp"/"$pkg"_*.deb "$tmp/k"
  kroot=$tmp/k
  kver=${pkg#linux-image-}
fi
vmlinuz=$kroot/boot/vmlinuz-$kver
moddir=$kroot/lib/modules/$kver
[ -r "$vmlinuz" ] || { echo "mk-guest: no readable $vmlinuz" >&2; exit 1; }

busybox=$(command -v busybox || true)
if [ -z "$busybox" ] || ! file -L "$busybox" 2>/dev/null | grep -q "statically linked"; then
  for b in /bin/busybox /usr/bin/busybox; do
    [ -x "$b" ] && busybox=$b
  done
fi
[ -x "$busybox" ] || { echo "mk-guest: busybox-static is required" >&2; exit 1; }

# Modules in dependency order (modules.dep of the cloud kernel; checked
# against /boot/config: VIRTIO, VIRTIO_MMIO, VIRTIO_BLK, VIRTIO_CONSOLE,
# EROFS_FS, OVERLAY_FS, VIRTIO_NET, NET_FAILOVER are all =m there; ext4,
# tmpfs, devtmpfs are built in; IP_PNP is not set, so ip= on the command
# line does nothing and guest-init.sh configures eth0 itself).
mods=(
  drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_mmio
  drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci_modern_dev drivers/virtio/virtio_pci
  drivers/block/virtio_blk drivers/char/virtio_console drivers/char/hw_random/virtio-rng
  lib/libcrc32c fs/erofs/erofs fs/overlayfs/overlay
  net/core/failover drivers/net/net_failover drivers/net/virtio_net
)
ird=$tmp/initramfs
mkdir -p "$ird"/{bin,dev,proc,sys,mnt,newroot,lib/modules}
cp "$busybox" "$ird/bin/busybox"
: > "$ird/lib/modules/order"
for m in "${mods[@]}"; do
  f=$moddir/kernel/$m.ko
  if [ -f "$f" ]; then
    cp "$f" "$ird/lib/modules/"
  elif [ -f "$f.xz" ]; then
    xz -dc "$f.xz" > "$ird/lib/modules/$(basename "$m").ko"
  elif grep -q "/$(basename "$m").ko" "$moddir/modules.builtin" 2>/dev/null; then
    continue # built in
  else
    echo "mk-guest: module $m missing from $moddir" >&2
    exit 1
  fi
  echo "$(basename "$m").ko" >> "$ird/lib/modules/order"
done
install -m 0755 "$here/scripts/guest-init.sh" "$ird/init"
(cd "$ird" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet) | gzip -6 > "$tmp/initramfs.img"
cp "$vmlinuz" "$tmp/vmlinuz"
echo "$kver" > "$tmp/release"
cp "$ird/lib/modules/order" "$tmp/modules"
# atomic replacement: a daemon may be starting a VM from the old kit
for f in vmlinuz initramfs.img release modules; do
  cp "$tmp/$f" "$out/.$f.new"
  mv -f "$out/.$f.new" "$out/$f"
done
echo "mk-guest: $out (kernel $kver)"

#!/usr/bin/env bash
# Build a bootable VM disk (qcow2) with warren-agent installed, for
# `--backend vm` with an imported disk image (docs/vm.md):
#
#   scripts/mk-vm-disk.sh [--busybox] OUT.qcow2 [SIZE_MB]
#
# Default: Debian bookworm from scripts/mk-debian-rootfs.sh's cached tarball
# plus linux-image-cloud-amd64, systemd-sysv and udev; the agent runs as the
# systemd service warren-agent.service on /dev/virtio-ports/org.warren.agent.
# --busybox: a small, fast-booting disk for tests: the busybox rootfs, the
# guest kit's kernel and modules (scripts/mk-guest.sh), and a tiny init that
# mounts the disk as / and runs the agent as PID 1 on the same port.
# Both: one MBR partition (ext4), extlinux (syslinux) as bootloader, so
# SeaBIOS boots it with no -kernel. Needs root, losetup, sfdisk, extlinux.
# Environment: WARREN_AGENT (agent binary; default build/bin/warren-agent).
set -euo pipefail
# Mount everything in a private mount namespace: a sandbox created meanwhile
# (a new mount namespace copies the host's mounts) would otherwise keep the
# disk's ext4 mounted after our umount, unflushed, and qemu-img would copy a
# half-written file system (no extlinux.conf: SYSLINUX finds nothing to boot).
if [ -z "${WARREN_MK_VM_DISK_NS:-}" ]; then
  WARREN_MK_VM_DISK_NS=1 exec unshare -m --propagation private bash "$0" "$@"
fi
here=$(cd "$(dirname "$0")/.." && pwd)
mode=debian
if [ "${1:-}" = --busybox ]; then
  mode=busybox
  shift
fi
[ $# -ge 1 ] || { echo "usage: $0 [--busybox] OUT.qcow2 [SIZE_MB]" >&2; exit 2; }
out=$1
size_mb=${2:-$([ $mode = busybox ] && echo 128 || echo 2048)}
agent=${WARREN_AGENT:-$here/build/bin/warren-agent}
PORT=org.warren.agent # the virtserialport name warrend gives the agent channel

for t in sfdisk extlinux losetup mkfs.ext4 qemu-img; do
  command -v $t >/dev/null || { echo "mk-vm-disk: $t missing (scripts/setup.sh)" >&2; exit 1; }
done
mbr=
for m in /usr/lib/syslinux/mbr/mbr.bin /usr/lib/EXTLINUX/mbr.bin; do
  [ -r "$m" ] && mbr=$m && break
done
[ -n "$mbr" ] || { echo "mk-vm-disk: syslinux mbr.bin missing (apt-get install syslinux-common)" >&2; exit 1; }
[ -x "$agent" ] || { echo "mk-vm-disk: no agent at $agent (make)" >&2; exit 1; }
file -L "$agent" 2>/dev/null | grep -q 'statically linked' ||
  { echo "mk-vm-disk: $agent must be statically linked" >&2; exit 1; }

tmp=$(mktemp -d)
mnt=$tmp/mnt
loop=
cleanup() {
  for m in dev/pts dev proc sys; do umount "$tmp/root/$m" 2>/dev/null || true; done
  umount "$mnt" 2>/dev/null || true
  [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
root=$tmp/root

unit='[Unit]
Description=Warren agent (host channel on virtio-serial)
After=dev-virtio\x2dports-org.warren.agent.device
Wants=dev-virtio\x2dports-org.warren.agent.device

[Service]
ExecStart=/usr/local/bin/warren-agent --device /dev/virtio-ports/'$PORT'
Restart=always
RestartSec=100ms

[Install]
WantedBy=multi-user.target'

if [ $mode = busybox ]; then
  guest=$here/build/guest
  [ -r "$guest/vmlinuz" ] && [ -r "$guest/initramfs.img" ] || "$here/scripts/mk-guest.sh" "$guest" >/dev/null
  sh "$here/scripts/mk-busybox-rootfs.sh" "$root" >/dev/null
  mkdir -p "$root/boot" "$root/usr/local/bin" "$root/sbin"
  cp "$guest/vmlinuz" "$root/boot/vmlinuz"
  # initramfs: the kit's busybox and modules, with an /init that mounts the
  # disk's first partition as / instead of the image layers
  ird=$tmp/ird
  mkdir -p "$ird"
  (cd "$ird" && gzip -dc "$guest/initramfs.img" | cpio -id --quiet)
  cat > "$ird/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox mkdir -p /usr/bin /sbin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
fail() { echo "warren-disk-init: $*"; poweroff -f; exit 1; }
mount -t devtmpfs dev /dev || fail devtmpfs
mount -t proc proc /proc || fail proc
mount -t sysfs sys /sys || fail sysfs
for m in $(cat /lib/modules/order); do
  insmod "/lib/modules/$m" 2>/dev/null || grep -q "^${m%.ko} " /proc/modules || fail "insmod $m"
done
i=0
while [ ! -b /dev/vda1 ] && [ $i -lt 500 ]; do usleep 10000; i=$((i + 1)); done
mount -t ext4 -o rw /dev/vda1 /newroot || fail "mount /dev/vda1"
mount --move /proc /newroot/proc && mount --move /dev /newroot/dev && mount --move /sys /newroot/sys ||
  fail "move mounts"
exec switch_root /newroot /sbin/warren-init
EOF
  chmod 0755 "$ird/init"
  (cd "$ird" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet) |
    gzip -6 > "$root/boot/initrd.img"
  # PID 1 on the disk: what udev + systemd + the unit do on a full system
  cat > "$root/sbin/warren-init" <<EOF
#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /dev/pts /dev/shm /dev/virtio-ports /tmp
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts /dev/pts
ln -sf pts/ptmx /dev/ptmx
mount -t tmpfs -o nosuid,nodev,mode=1777 shm /dev/shm
ip link set lo up 2>/dev/null
i=0
while [ \$i -lt 500 ]; do
  for p in /sys/class/virtio-ports/vport*; do
    [ -r "\$p/name" ] && [ "\$(cat "\$p/name")" = $PORT ] && ln -sf "../\${p##*/}" /dev/virtio-ports/$PORT
  done
  [ -e /dev/virtio-ports/$PORT ] && break
  usleep 10000
  i=\$((i + 1))
done
cd /
exec env -i PATH=\$PATH HOME=/root container=warren-vm /usr/local/bin/warren-agent --device /dev/virtio-ports/$PORT
EOF
  chmod 0755 "$root/sbin/warren-init"
  kernel=/boot/vmlinuz initrd=/boot/initrd.img
else
  tarball=$("$here/scripts/mk-debian-rootfs.sh")
  mkdir -p "$root"
  tar --zstd -xpf "$tarball" -C "$root" --numeric-owner
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  for m in proc sys dev dev/pts; do mkdir -p "$root/$m"; done
  mount -t proc proc "$root/proc"
  mount -t sysfs sys "$root/sys"
  mount --bind /dev "$root/dev"
  mount --bind /dev/pts "$root/dev/pts"
  chroot "$root" /bin/sh -c 'export DEBIAN_FRONTEND=noninteractive PATH=/usr/sbin:/usr/bin:/sbin:/bin
    apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      linux-image-cloud-amd64 systemd-sysv udev initramfs-tools >/dev/null && apt-get clean
    echo warren > /etc/hostname
    passwd -d root >/dev/null
    systemctl mask systemd-networkd-wait-online.service >/dev/null 2>&1 || true'
  printf '%s\n' "$unit" > "$root/etc/systemd/system/warren-agent.service"
  mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
  ln -sf ../warren-agent.service "$root/etc/systemd/system/multi-user.target.wants/warren-agent.service"
  printf 'LABEL=warren-root / ext4 rw,errors=remount-ro 0 1\n' > "$root/etc/fstab"
  for m in dev/pts dev sys proc; do umount "$root/$m"; done
  kver=$(ls "$root/boot" | sed -n 's/^vmlinuz-//p' | sort -V | tail -1)
  [ -n "$kver" ] || { echo "mk-vm-disk: no kernel installed in the image" >&2; exit 1; }
  kernel=/boot/vmlinuz-$kver initrd=/boot/initrd.img-$kver
fi
install -D -m 0755 "$agent" "$root/usr/local/bin/warren-agent"

# raw disk: MBR, one bootable partition from 1 MiB, ext4 without the
# features extlinux cannot read (64bit, metadata_csum)
raw=$tmp/disk.raw
truncate -s "${size_mb}M" "$raw"
echo 'start=2048, type=83, bootable' | sfdisk -q "$raw"
loop=$(losetup -f --show -o $((2048 * 512)) --sizelimit $(((size_mb - 1) * 1024 * 1024)) "$raw")
mkfs.ext4 -q -F -L warren-root -O ^64bit,^metadata_csum,^orphan_file "$loop" 2>/dev/null ||
  mkfs.ext4 -q -F -L warren-root -O ^64bit,^metadata_csum "$loop"
mkdir -p "$mnt"
mount "$loop" "$mnt"
cp -a "$root/." "$mnt/"
mkdir -p "$mnt/boot/extlinux"
extlinux --install "$mnt/boot/extlinux" >/dev/null 2>&1
cat > "$mnt/boot/extlinux/extlinux.conf" <<EOF
DEFAULT warren
TIMEOUT 0
PROMPT 0
LABEL warren
  LINUX $kernel
  INITRD $initrd
  APPEND root=LABEL=warren-root rw console=ttyS0 quiet loglevel=4 panic=-1
EOF
sync -f "$mnt"
umount "$mnt"
losetup -d "$loop"
loop=
dd if="$mbr" of="$raw" bs=440 count=1 conv=notrunc status=none
mkdir -p "$(dirname "$out")"
qemu-img convert -q -f raw -O qcow2 "$raw" "$out.tmp"
mv -f "$out.tmp" "$out"
echo "mk-vm-disk: $out ($mode, ${size_mb} MiB virtual)"

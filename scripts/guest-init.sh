#!/bin/busybox sh
# /init of the Warren guest initramfs (scripts/mk-guest.sh, docs/vm.md).
# Loads the virtio modules, mounts the image layers (read-only EROFS disks
# with serials wl0..wlN-1, bottom-most first) under an overlay whose upper is
# a tmpfs of warren.disk_mb (or the ext4 disk with serial "wupper"), moves
# /proc /dev /sys into it, and replaces itself with warren-agent as PID 1 on
# the virtio-serial port "org.warren.agent". Any failure powers the VM off:
# the daemon sees the QEMU exit and the console log says why.
/bin/busybox mkdir -p /usr/bin /sbin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin

fail() {
  echo "warren-init: $*"
  poweroff -f
  exit 1
}

mount -t devtmpfs dev /dev || fail "devtmpfs"
mount -t proc proc /proc || fail "proc"
mount -t sysfs sys /sys || fail "sysfs"

layers=0 disk_mb=1024 upper=tmpfs host=warren probe=0 net=
for w in $(cat /proc/cmdline); do
  case "$w" in
  warren.layers=*) layers=${w#*=} ;;
  warren.disk_mb=*) disk_mb=${w#*=} ;;
  warren.upper=*) upper=${w#*=} ;;
  warren.hostname=*) host=${w#*=} ;;
  warren.net=*) net=${w#*=} ;;
  warren.probe=1) probe=1 ;;
  esac
done

for m in $(cat /lib/modules/order); do
  insmod "/lib/modules/$m" 2>/dev/null || grep -q "^${m%.ko} " /proc/modules || fail "insmod $m"
done

if [ "$probe" = 1 ]; then
  echo "warren-probe-ok"
  poweroff -f
fi

# disks by serial; virtio-blk probes asynchronously: wait (bounded) for all
disk() {
  for d in /sys/block/vd*; do
    [ -r "$d/serial" ] && [ "$(cat "$d/serial")" = "$1" ] && echo "/dev/${d##*/}" && return 0
  done
  return 1
}
port=
i=0
while [ $i -lt 500 ]; do
  ok=1
  n=0
  while [ $n -lt "$layers" ]; do
    disk "wl$n" >/dev/null || ok=0
    n=$((n + 1))
  done
  [ "$upper" = disk ] && { disk wupper >/dev/null || ok=0; }
  port=
  for p in /sys/class/virtio-ports/vport*; do
    [ -r "$p/name" ] && [ "$(cat "$p/name")" = org.warren.agent ] && port=/dev/${p##*/}
  done
  [ -n "$port" ] && [ -e "$port" ] || ok=0
  [ $ok = 1 ] && break
  usleep 10000
  i=$((i + 1))
done
[ $ok = 1 ] || fail "devices did not appear (layers=$layers upper=$upper port=$port)"

lower=
n=0
while [ $n -lt "$layers" ]; do
  mkdir -p "/mnt/l$n"
  mount -t erofs -o ro "$(disk "wl$n")" "/mnt/l$n" || fail "mount layer $n"
  lower="/mnt/l$n${lower:+:$lower}" # overlay wants the top-most first
  n=$((n + 1))
done
[ -n "$lower" ] || fail "no layers"
mkdir -p /mnt/rw
if [ "$upper" = disk ]; then
  mount -t ext4 -o nosuid,nodev "$(disk wupper)" /mnt/rw || fail "mount upper disk"
else
  mount -t tmpfs -o "size=${disk_mb}m,mode=0755,nosuid,nodev" upper /mnt/rw || fail "tmpfs upper"
fi
mkdir -p /mnt/rw/u /mnt/rw/w
# userxattr: the layers carry user.overlay.* markers, as for containers
mount -t overlay overlay -o "lowerdir=$lower,upperdir=/mnt/rw/u,workdir=/mnt/rw/w,userxattr" /newroot ||
  fail "overlay"

cd /newroot || fail "newroot"
mkdir -p proc dev sys tmp
mount --move /proc proc || fail "move /proc"
mount --move /dev dev || fail "move /dev"
mount --move /sys sys || fail "move /sys"
mkdir -p dev/pts dev/shm
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts dev/pts
ln -sf pts/ptmx dev/ptmx 2>/dev/null
mount -t tmpfs -o nosuid,nodev,mode=1777 shm dev/shm
hostname "$host"
ip link set lo up 2>/dev/null
# warren.net=ADDR,GW: an allow= VM (docs/network.md, "VMs"): eth0 gets
# ADDR/30, the host side GW is the default route and the only resolver
if [ -n "$net" ]; then
  i=0
  while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 500 ]; do
    usleep 10000
    i=$((i + 1))
  done
  ip addr add "${net%,*}/30" dev eth0 || fail "eth0 address"
  ip link set eth0 up || fail "eth0 up"
  ip route add default via "${net#*,}" || fail "default route"
  rm -f /newroot/etc/resolv.conf
  mkdir -p /newroot/etc
  echo "nameserver ${net#*,}" > /newroot/etc/resolv.conf
fi
cd /

# The agent lives in the initramfs, which switch_root empties: keep it open
# and exec it through /proc (moved into the new root above).
exec 3</warren-agent || fail "no /warren-agent"
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  container=warren-vm switch_root /newroot /proc/self/fd/3 --device "$port"

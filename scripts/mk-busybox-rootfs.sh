#!/bin/sh
# Build a minimal rootfs from busybox-static into DIR (created, must be empty
# or absent). The quick start and the tests import it as busybox:latest:
#   scripts/mk-busybox-rootfs.sh /tmp/bb && warren image import busybox /tmp/bb
set -eu

usage() { echo "usage: $0 DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
dir=$1
[ -n "$dir" ] || usage

bb=
for c in /bin/busybox /usr/bin/busybox; do
  if [ -x "$c" ] && "$c" --list-full >/dev/null 2>&1; then bb=$c; break; fi
done
[ -n "$bb" ] || { echo "$0: busybox (static) not found: apt-get install busybox-static" >&2; exit 1; }
# A dynamic busybox would need its libraries inside the image.
if command -v file >/dev/null 2>&1 && ! file -L "$bb" | grep -q 'statically linked'; then
  echo "$0: $bb is not statically linked (install busybox-static)" >&2
  exit 1
fi

if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
  echo "$0: $dir exists and is not empty" >&2
  exit 1
fi

umask 022
mkdir -p "$dir"
cd "$dir"
mkdir -p bin sbin usr/bin usr/sbin etc root dev proc sys tmp var/tmp home
chmod 1777 tmp var/tmp
chmod 700 root
cp "$bb" bin/busybox
chmod 755 bin/busybox

# One symlink per applet at its canonical path (bin/sh, usr/bin/awk, ...).
"$bb" --list-full | while IFS= read -r applet; do
  case "$applet" in
    ""|/*|*..*) continue ;;
    bin/busybox|linuxrc) continue ;;
  esac
  mkdir -p "$(dirname "$applet")"
  [ -e "$applet" ] || [ -L "$applet" ] || ln -s /bin/busybox "$applet"
done

cat > etc/passwd <<'P'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
P
cat > etc/group <<'G'
root:x:0:
nogroup:x:65534:
G
echo sandbox > etc/hostname
printf '127.0.0.1 localhost sandbox\n::1 localhost\n' > etc/hosts
: > etc/resolv.conf
chmod 644 etc/passwd etc/group etc/hostname etc/hosts etc/resolv.conf

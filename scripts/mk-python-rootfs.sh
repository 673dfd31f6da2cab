#!/bin/sh
# Build a minimal Python rootfs into DIR from the host's Debian python3 plus
# busybox-static for /bin/sh and the usual tools. The fncall tests import it
# as python:latest:
#   scripts/mk-python-rootfs.sh /tmp/py && warren image import python /tmp/py
# Needs: a Debian python3.X at /usr/bin (its stdlib under /usr/lib/python3.X),
# busybox-static, ldd.
set -eu

usage() { echo "usage: $0 DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
dir=$1
[ -n "$dir" ] || usage
here=$(cd "$(dirname "$0")" && pwd)

py=$(readlink -f /usr/bin/python3 2>/dev/null || true)
[ -n "$py" ] && [ -x "$py" ] || { echo "$0: /usr/bin/python3 not found" >&2; exit 1; }
ver=$(basename "$py")                 # python3.11
stdlib=/usr/lib/$ver
[ -d "$stdlib" ] || { echo "$0: $stdlib not found" >&2; exit 1; }

# busybox first: it refuses a non-empty DIR and lays out bin, tmp, etc.
"$here/mk-busybox-rootfs.sh" "$dir"

umask 022
mkdir -p "$dir/usr/bin" "$dir/usr/lib"
cp "$py" "$dir/usr/bin/$ver"
ln -sf "$ver" "$dir/usr/bin/python3"
ln -sf "$ver" "$dir/usr/bin/python"

# The standard library without tests, GUI, docs data and build configuration:
# ~25 MB instead of ~55 MB.
( cd /usr/lib && tar -cf - \
    --exclude="$ver/test" --exclude="$ver/idlelib" --exclude="$ver/tkinter" \
    --exclude="$ver/turtledemo" --exclude="$ver/ensurepip" --exclude="$ver/lib2to3/tests" \
    --exclude="$ver/config-*" --exclude="$ver/pydoc_data" --exclude="__pycache__" \
    --exclude="$ver/site-packages" --exclude="$ver/dist-packages" "$ver" ) \
  | ( cd "$dir/usr/lib" && tar -xf - )
mkdir -p "$dir/usr/lib/$ver/site-packages"

# Shared libraries of the interpreter and of every extension module.
libs=$( { ldd "$py"; find "$stdlib/lib-dynload" -name '*.so' -exec ldd {} \; ; } 2>/dev/null \
  | awk '/=>/ && $3 ~ /^\// { print $3 } /^[[:space:]]*\/[^ ]*ld-linux/ { print $1 }' | sort -u)
for l in $libs; do
  real=$(readlink -f "$l")
  d=$(dirname "$l")
  mkdir -p "$dir$d"
  cp "$real" "$dir$d/$(basename "$real")"
  [ "$(basename "$real")" = "$(basename "$l")" ] || ln -sf "$(basename "$real")" "$dir$l"
done
# /lib64 -> the loader, as the interpreter's PT_INTERP names it
case "$(uname -m)" in
  x86_64)
    if [ ! -e "$dir/lib64/ld-linux-x86-64.so.2" ]; then
      mkdir -p "$dir/lib64"
      cp "$(readlink -f /lib64/ld-linux-x86-64.so.2)" "$dir/lib64/ld-linux-x86-64.so.2"
    fi ;;
esac

# Byte-compile once here so no sandbox pays for it (and none can write it).
"$py" -m compileall -q -j 0 "$dir/usr/lib/$ver" >/dev/null 2>&1 || true
chroot "$dir" /usr/bin/python3 -c 'import json, os, sys, ctypes, resource, signal' \
  || { echo "$0: the interpreter does not start inside $dir" >&2; exit 1; }
echo "$dir: $(du -sh "$dir" | cut -f1)"

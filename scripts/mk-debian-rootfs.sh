#!/usr/bin/env bash
# Build the default image's root file system: Debian bookworm (minbase) with
# python3, git and a C compiler, as a tarball cached under
# /var/cache/warren/ so a second run is instant.
#
#   scripts/mk-debian-rootfs.sh [OUT.tar.zst]   -> prints the tarball's path
#   warren image import base:bookworm "$(scripts/mk-debian-rootfs.sh)"
#
# Environment: WARREN_DEBIAN_MIRROR (default: the first deb.debian.org-style
# URI in this machine's apt sources), WARREN_CACHE_DIR (/var/cache/warren),
# WARREN_DEBIAN_PACKAGES (extra comma-separated packages).
set -euo pipefail

SUITE=bookworm
PKGS="python3,git,gcc,g++,libc6-dev,make,ca-certificates${WARREN_DEBIAN_PACKAGES:+,$WARREN_DEBIAN_PACKAGES}"
CACHE=${WARREN_CACHE_DIR:-/var/cache/warren}
# the cache key covers everything that changes the result
KEY=$(printf '%s\n' "$SUITE" "$PKGS" | sha256sum | cut -c1-12)
CACHED="$CACHE/debian-$SUITE-$KEY.tar.zst"
OUT=${1:-$CACHED}

if [ -s "$CACHED" ]; then
  [ "$OUT" = "$CACHED" ] || cp "$CACHED" "$OUT"
  echo "$OUT"
  exit 0
fi

mirror=${WARREN_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(grep -hoE '^(URIs:|deb) *https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
    /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
    grep -oE 'https?://[^ ]+' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
command -v debootstrap >/dev/null || { echo "mk-debian-rootfs: install debootstrap (scripts/setup.sh)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "mk-debian-rootfs: must run as root" >&2; exit 1; }

mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/.debootstrap-XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "mk-debian-rootfs: debootstrap $SUITE from $mirror (a few minutes, once)" >&2
debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$work/rootfs" "$mirror" >&2
# no package caches or logs in the image; devices come from the sandbox
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* \
  "$work/rootfs/var/log/"*.log "$work/rootfs/dev/"*
printf 'nameserver 1.1.1.1\n' > "$work/rootfs/etc/resolv.conf"
tar -C "$work/rootfs" --numeric-owner --xattrs -cf - . | zstd -q -T0 -o "$work/rootfs.tar.zst"
mv "$work/rootfs.tar.zst" "$CACHED"
[ "$OUT" = "$CACHED" ] || cp "$CACHED" "$OUT"
echo "$OUT"

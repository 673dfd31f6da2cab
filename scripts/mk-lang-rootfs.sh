#!/usr/bin/env bash
# Build a language image's layer: the files Debian's packages for LANG add
# to the default image's root file system (scripts/mk-debian-rootfs.sh), as
# a tarball cached under /var/cache/warren/. `warren image defaults --lang`
# stacks it on base:bookworm as lang-LANG:bookworm, so every language image
# shares the base layer (docs/images.md, "Language images").
#
#   scripts/mk-lang-rootfs.sh LANG            -> prints the layer tarball's path
#   scripts/mk-lang-rootfs.sh --packages LANG -> prints LANG's extra packages
#                                                (empty: LANG is in the base)
#   scripts/mk-lang-rootfs.sh --list          -> the known languages
#   scripts/mk-lang-rootfs.sh --image LANG    -> the language whose image LANG
#                                                runs in (go_test: go)
#   scripts/mk-lang-rootfs.sh --cached LANG   -> the layer's path if it is
#                                                cached, else exit 1 (builds
#                                                nothing but a missing base)
#
# How: debootstrap base + LANG's packages (mk-debian-rootfs.sh with
# WARREN_DEBIAN_PACKAGES, cached by package set), then keep what differs from
# the base tarball (scripts/mk-layer-diff.py); the full tarball is removed.
# Environment: as mk-debian-rootfs.sh (WARREN_CACHE_DIR, WARREN_DEBIAN_MIRROR).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

# SandboxFusion's languages (sandbox/runners) and the Debian bookworm
# packages that run them. python, bash, c, cpp (and pytest via python3) are
# in base:bookworm; julia, swift and lean have no bookworm package.
# A test framework runs in its language's image, as SandboxFusion's runtime/
# go, java and node directories serve both: testify (go_test, in GOPATH
# mode), JUnit 5's console launcher, ts-node (typescript), jest with babel's
# TypeScript preset. node-tape, node-n3 and node-read-pkg are there for
# jest: they provide virtual packages its dependencies name
# (node-for-each, node-queue-microtask, node-type-fest), which debootstrap
# does not resolve: without them it failed to configure jest.
packages() {
  case "$1" in
    python | bash | c | cpp) echo "" ;;
    go | go_test) echo "golang-go,golang-github-stretchr-testify-dev" ;;
    java | junit) echo "default-jdk-headless,junit5" ;;
    nodejs | typescript | jest) echo "nodejs,ts-node,jest,node-babel7,node-tape,node-n3,node-read-pkg" ;;
    rust) echo "rustc,cargo" ;;
    php) echo "php-cli" ;;
    ruby) echo "ruby" ;;
    lua) echo "lua5.4" ;;
    perl) echo "perl" ;;
    r) echo "r-base-core" ;;
    csharp) echo "mono-mcs" ;;
    scala) echo "scala" ;;
    kotlin) echo "kotlin,default-jre-headless" ;;
    d) echo "ldc" ;;
    racket) echo "racket" ;;
    verilog) echo "iverilog" ;;
    *) return 1 ;;
  esac
}
image_of() {
  case "$1" in
    go_test) echo go ;;
    junit) echo java ;;
    typescript | jest) echo nodejs ;;
    *) echo "$1" ;;
  esac
}
LANGS="python bash c cpp go go_test java junit nodejs typescript jest rust php ruby lua perl r csharp scala kotlin d racket verilog"

case "${1:-}" in
  --list) echo "$LANGS"; exit 0 ;;
  --packages)
    packages "${2:-}" || { echo "mk-lang-rootfs: unknown language '${2:-}' (known: $LANGS)" >&2; exit 2; }
    exit 0 ;;
  --image)
    packages "${2:-}" >/dev/null || { echo "mk-lang-rootfs: unknown language '${2:-}' (known: $LANGS)" >&2; exit 2; }
    image_of "$2"
    exit 0 ;;
  --cached) only_cached=1; shift ;;
  "" | -*) echo "usage: mk-lang-rootfs.sh LANG | --cached LANG | --packages LANG | --image LANG | --list" >&2; exit 2 ;;
esac
pkgs=$(packages "${1:-}") || { echo "mk-lang-rootfs: unknown language '${1:-}' (known: $LANGS)" >&2; exit 2; }
lang=$(image_of "$1")
[ -n "$pkgs" ] || { echo "mk-lang-rootfs: $lang is in the base image" >&2; exit 2; }

base=$(bash "$here/mk-debian-rootfs.sh")
CACHE=${WARREN_CACHE_DIR:-/var/cache/warren}
# the base tarball's name carries its own key: a new base means a new layer
KEY=$(printf '%s\n' "$(basename "$base")" "$pkgs" | sha256sum | cut -c1-12)
CACHED="$CACHE/lang-$lang-bookworm-$KEY.tar.zst"
if [ -s "$CACHED" ]; then
  echo "$CACHED"
  exit 0
fi
[ -z "${only_cached:-}" ] || exit 1
extra="${WARREN_DEBIAN_PACKAGES:+$WARREN_DEBIAN_PACKAGES,}$pkgs"
full=$(WARREN_DEBIAN_PACKAGES=$extra bash "$here/mk-debian-rootfs.sh")
echo "mk-lang-rootfs: $lang layer: $(basename "$full") minus $(basename "$base")" >&2
python3 "$here/mk-layer-diff.py" "$base" "$full" "$CACHED.tmp"
mv "$CACHED.tmp" "$CACHED"
rm -f "$full" # an intermediate: the layer is what is kept
echo "$CACHED"

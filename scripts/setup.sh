#!/usr/bin/env bash
# Installs the Debian packages Warren needs to build, test and run. Idempotent:
# does nothing when everything is already there. Run as root.
set -euo pipefail
PKGS=(
  gcc make pkg-config libc6-dev
  libevent-dev libsqlite3-dev libjansson-dev libseccomp-dev libarchive-dev libzstd-dev zlib1g-dev
  libcurl4-openssl-dev libssl-dev ca-certificates openssl # libssl: TLS to etcd
  erofs-utils e2fsprogs busybox-static tar gzip zstd util-linux iproute2 procps
  python3 python3-pytest python3-pytest-timeout python3-pip python3-setuptools python3-venv python3-yaml
  crun bubblewrap clang-format clang libclang-rt-14-dev
  docker-registry apache2-utils python3-cryptography debootstrap etcd-server
  qemu-system-x86 qemu-utils seabios cpio fdisk extlinux syslinux-common
  nftables libnftables-dev dnsutils # sandbox networking (docs/network.md)
  criu # fork with "processes": true asks `criu check` what blocks it (docs/rl.md)
)
# E2B conformance (tests/integration/test_e2b.py) runs the e2b npm SDK: the
# machine's own Node.js and npm when it has them (Debian's npm conflicts with
# a packaged Node.js that bundles its own), else Debian's.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  PKGS+=(nodejs npm)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Sandboxes need unprivileged user namespaces and overlayfs/erofs.
modprobe overlay 2>/dev/null || true
modprobe erofs 2>/dev/null || true
sysctl -qw kernel.unprivileged_userns_clone=1 2>/dev/null || true
# VM backends: guest kernel (linux-image-cloud-amd64 from Debian's archive,
# unpacked without installing it when it is not installed) + initramfs.
"$(dirname "$0")/mk-guest.sh" >/dev/null || echo "setup: VM guest kit not built (scripts/mk-guest.sh)" >&2
echo "setup: ok"

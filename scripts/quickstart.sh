#!/usr/bin/env bash
# Quick start: install, build, start warrend on embedded defaults (state under
# $WARREN_ROOT, SQLite registry, the busybox default image) and run a short
# demo that creates sandboxes, runs commands in them and prints what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${WARREN_ROOT:-/var/lib/warren}
bash scripts/setup.sh
make -j2 >/dev/null
BIN=$PWD/build/bin
export WARREN_HOST="unix:$ROOT/warrend.sock"

if ! "$BIN/warren" health >/dev/null 2>&1; then
  mkdir -p "$ROOT"
  "$BIN/warrend" --root "$ROOT" >>"$ROOT/warrend.log" 2>&1 &
  echo "quickstart: started warrend (pid $!, root $ROOT, log $ROOT/warrend.log)"
  for _ in $(seq 100); do "$BIN/warren" health >/dev/null 2>&1 && break; sleep 0.1; done
fi
if ! "$BIN/warren" image inspect busybox:latest >/dev/null 2>&1; then
  tmp=$(mktemp -d /var/tmp/wr-rootfs.XXXXXX)
  bash scripts/mk-busybox-rootfs.sh "$tmp/rootfs"
  "$BIN/warren" image import busybox:latest "$tmp/rootfs"
  rm -rf "$tmp"
fi
# the default image base:bookworm: built with debootstrap (~1 minute the first
# time, cached under /var/cache/warren) and imported; a second run does nothing.
# Language images: `warren image defaults --lang go,java,nodejs,rust`.
if ! "$BIN/warren" image defaults; then
  echo "quickstart: warren image defaults failed; continuing with busybox:latest only" >&2
fi

echo "== demo: three sandboxes, commands, files =="
ids=()
for i in 1 2 3; do ids+=("$("$BIN/warren" create --memory 256 --ttl 600)"); done
echo "created: ${ids[*]}"
for id in "${ids[@]}"; do
  "$BIN/warren" exec "$id" -- sh -c "echo \"sandbox \$(hostname): uid \$(id -u), \$(ls /proc | grep -c '^[0-9]') processes visible\""
done
echo "hello from the host" > /tmp/wr-demo.txt
"$BIN/warren" cp /tmp/wr-demo.txt "${ids[0]}:/tmp/greeting.txt"
"$BIN/warren" exec "${ids[0]}" -- cat /tmp/greeting.txt
rm -f /tmp/wr-demo.txt
echo "streaming: one line a second"
"$BIN/warren" exec "${ids[1]}" -- sh -c 'for i in 1 2 3; do echo tick $i; sleep 1; done'
echo "a fork bomb is contained by the pids limit:"
"$BIN/warren" exec --timeout 3 "${ids[2]}" -- sh -c 'bomb() { bomb | bomb & }; bomb' >/dev/null 2>&1 || true
"$BIN/warren" exec "${ids[2]}" -- echo "sandbox ${ids[2]} still alive"
"$BIN/warren" run busybox:latest -- sh -c 'echo "warren run: create, exec, remove in one step"'
if "$BIN/warren" image inspect base:bookworm >/dev/null 2>&1; then
  "$BIN/warren" run base:bookworm -- python3 -c 'import sys; print("python", sys.version.split()[0], "in base:bookworm")'
fi
"$BIN/warren" ls
"$BIN/warren" rm "${ids[@]}"
echo "== Python SDK: a GRPO-style rollout batch (examples/rollout.py) =="
/usr/bin/python3 examples/rollout.py --short
echo "== demo done; warrend keeps running (WARREN_HOST=$WARREN_HOST) =="

#!/usr/bin/env python3
"""Write the layer that turns one root file system tarball into another.

    scripts/mk-layer-diff.py BASE.tar.zst FULL.tar.zst OUT.tar.zst

OUT holds every entry of FULL that BASE lacks or holds differently (type,
mode, owner, link target or content; a directory's mtime is ignored), plus
the parent directories of those entries, so that stacking OUT on BASE gives
FULL. A hard link whose target is unchanged is stored with its target.
Entries FULL lacks are counted, not written: adding packages removes little,
and an image build's COPY cannot express a deletion.
"""
import hashlib
import io
import subprocess
import sys
import tarfile


def members(path):
    """Yield (TarInfo, content or None) from a zstd-compressed tarball."""
    p = subprocess.Popen(["zstd", "-dcq", path], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=p.stdout, mode="r|") as tf:
        for m in tf:
            data = tf.extractfile(m).read() if m.isreg() else None
            yield m, data
    if p.wait() != 0:
        sys.exit(f"mk-layer-diff: zstd -d {path} failed")


def norm(name):
    name = name[2:] if name.startswith("./") else name
    return name.rstrip("/")


def signature(m, data):
    sig = (m.type, m.mode, m.uid, m.gid, m.linkname, m.devmajor, m.devminor)
    if data is not None:
        sig += (hashlib.sha256(data).digest(),)
    return sig


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: mk-layer-diff.py BASE.tar.zst FULL.tar.zst OUT.tar.zst")
    base_path, full_path, out_path = sys.argv[1:]
    base = {norm(m.name): signature(m, d) for m, d in members(base_path)}

    keep, hardlinks, seen = set(), {}, set()
    for m, d in members(full_path):
        n = norm(m.name)
        seen.add(n)
        if m.islnk():
            hardlinks[n] = norm(m.linkname)
        if base.get(n) != signature(m, d):
            keep.add(n)
    # a new or changed hard link needs its target in the same layer
    for n, target in hardlinks.items():
        if n in keep:
            keep.add(target)
    for n in list(keep):
        parts = n.split("/")
        for i in range(1, len(parts)):
            keep.add("/".join(parts[:i]))
    keep.discard("")
    deleted = sum(1 for n in base if n and n not in seen)

    out = open(out_path, "wb")
    z = subprocess.Popen(["zstd", "-q", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
    written = size = 0
    with tarfile.open(fileobj=z.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tw:
        for m, d in members(full_path):
            if norm(m.name) not in keep:
                continue
            tw.addfile(m, None if d is None else io.BytesIO(d))
            written += 1
            size += m.size if d is not None else 0
    z.stdin.close()
    if z.wait() != 0:
        sys.exit("mk-layer-diff: zstd failed")
    out.close()
    print(
        f"mk-layer-diff: {written} entries, {size / 1e6:.1f} MB; "
        f"{deleted} entries of the base not in the full tree (not expressed)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()

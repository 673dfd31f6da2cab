"""Image store end to end: OCI layouts, docker-save archives, registry pulls,
multi-layer composition with whiteouts, tag/gc, pack, build, hostile input."""
import gzip
import hashlib
import http.client
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time

import pytest

from conftest import BUILD, need, start_daemon
from wr import Daemon


# ---------------------------------------------------------------- helpers

def tar_bytes(entries, gz=False):
    """entries: list of (name, kind, data_or_target, extra) with kind in
    file/dir/symlink/hardlink/chr."""
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.PAX_FORMAT) as t:
        for e in entries:
            name, kind = e[0], e[1]
            arg = e[2] if len(e) > 2 else None
            ti = tarfile.TarInfo(name)
            ti.mtime = 1700000000
            if kind == "file":
                data = arg if isinstance(arg, bytes) else (arg or "").encode()
                ti.size = len(data)
                ti.mode = 0o644
                t.addfile(ti, io.BytesIO(data))
            elif kind == "dir":
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                t.addfile(ti)
            elif kind == "symlink":
                ti.type = tarfile.SYMTYPE
                ti.linkname = arg
                t.addfile(ti)
            elif kind == "hardlink":
                ti.type = tarfile.LNKTYPE
                ti.linkname = arg
                t.addfile(ti)
            elif kind == "chr":
                ti.type = tarfile.CHRTYPE
                ti.devmajor, ti.devminor = 1, 3
                t.addfile(ti)
    raw = bio.getvalue()
    return gzip.compress(raw, mtime=0) if gz else raw


def sha(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()


def oci_image(layers, config=None):
    """-> (blobs {digest: bytes}, manifest bytes, config bytes) for gzip layers."""
    blobs = {}
    descs, diff_ids = [], []
    for raw in layers:
        gz = gzip.compress(raw, mtime=0)
        blobs[sha(gz)] = gz
        diff_ids.append(sha(raw))
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      "digest": sha(gz), "size": len(gz)})
    cfg = {"architecture": "amd64", "os": "linux",
           "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cfgb = json.dumps(cfg).encode()
    blobs[sha(cfgb)] = cfgb
    man = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                      "digest": sha(cfgb), "size": len(cfgb)},
           "layers": descs}
    manb = json.dumps(man).encode()
    return blobs, manb, cfgb


def write_oci_layout(d, layers, config=None):
    blobs, manb, _ = oci_image(layers, config)
    os.makedirs(os.path.join(d, "blobs", "sha256"), exist_ok=True)
    blobs[sha(manb)] = manb
    for dg, b in blobs.items():
        with open(os.path.join(d, "blobs", "sha256", dg[7:]), "wb") as f:
            f.write(b)
    with open(os.path.join(d, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json",
             "digest": sha(manb), "size": len(manb)}]}, f)
    return d


def docker_save_tar(path, layers, config=None):
    """A classic `docker save` archive: <id>/layer.tar, <cfg>.json, manifest.json."""
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": [sha(l) for l in layers]}}
    cfgb = json.dumps(cfg).encode()
    ents = []
    lpaths = []
    for i, l in enumerate(layers):
        lid = hashlib.sha256(b"id%d" % i + l).hexdigest()
        ents.append((lid, "dir"))
        ents.append((lid + "/layer.tar", "file", l))
        lpaths.append(lid + "/layer.tar")
    ents.append((sha(cfgb)[7:] + ".json", "file", cfgb))
    ents.append(("manifest.json", "file", json.dumps(
        [{"Config": sha(cfgb)[7:] + ".json", "RepoTags": ["x:y"], "Layers": lpaths}]).encode()))
    with open(path, "wb") as f:
        f.write(tar_bytes(ents))
    return path


def store_state(root):
    """What must not change after a failed import: layer files, tmp, images."""
    layers = sorted(os.listdir(os.path.join(root, "layers", "sha256")))
    tmp = sorted(os.listdir(os.path.join(root, "tmp")))
    return layers, tmp


def images(api):
    r = api.raw("GET", "/v1/images")
    assert r.status == 200, r
    return sorted((i["name"], i["digest"]) for i in r.json()["images"])


def imp(api, name, path, **kw):
    body = {"name": name, "path": path}
    body.update(kw)
    return api.raw("POST", "/v1/images/import", body, timeout=600)


@pytest.fixture(scope="module")
def work():
    d = tempfile.mkdtemp(prefix="wr-img-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def bbtar(rootfs, work):
    """The busybox rootfs as a tar, usable as an OCI base layer."""
    p = os.path.join(work, "busybox.tar")
    subprocess.run(["tar", "-C", rootfs, "--numeric-owner", "-cf", p, "."], check=True)
    with open(p, "rb") as f:
        return f.read()


# ---------------------------------------------------------------- OCI / docker-save

LAYER2 = [("etc/.wh.hostname", "file"), ("opt", "dir"), ("opt/d", "dir"),
          ("opt/d/.wh..wh..opq", "file"), ("opt/d/new", "file", "new\n"),
          ("opt/keep", "file", "keep2\n")]
LAYER1_EXTRA = [("opt", "dir"), ("opt/d", "dir"), ("opt/d/old", "file", "old\n"),
                ("opt/keep", "file", "keep1\n"), ("opt/gone", "file", "x")]


def test_oci_layout_multi_layer_whiteouts(api, daemon, work, bbtar):
    d = write_oci_layout(os.path.join(work, "oci1"),
                         [bbtar, tar_bytes(LAYER1_EXTRA), tar_bytes(LAYER2 + [("opt/.wh.gone", "file")])],
                         {"Env": ["PATH=/bin:/usr/bin", "FOO=bar"], "WorkingDir": "/opt",
                          "Entrypoint": ["/bin/sh"], "Cmd": ["-c", "true"],
                          "Labels": {"org.x": "1"}})
    r = imp(api, "oci/test:1", d)
    assert r.status == 201, r
    img = r.json()
    assert len(img["layers"]) == 3
    assert img["config"]["workdir"] == "/opt"
    assert "FOO=bar" in img["config"]["env"]
    assert img["config"]["entrypoint"] == ["/bin/sh", "-c", "true"]
    assert img["config"]["labels"] == {"org.x": "1"}
    sid = api.create(image="oci/test:1")
    try:
        out = api.sh(sid, "ls /opt/d; cat /opt/keep; test -e /etc/hostname && echo host; "
                          "test -e /opt/gone && echo gone; echo $FOO; pwd")
        assert out["exit_code"] == 0, out
        # opaque dir hides layer 1's old; whiteouts hide hostname and gone
        assert out["stdout"].split() == ["new", "keep2", "bar", "/opt"], out
        # whiteout markers never show up as files
        out = api.sh(sid, "ls -a /opt /opt/d /etc | grep -c '\\.wh\\.' || true")
        assert out["stdout"].strip() == "0"
    finally:
        api.delete(sid)
    # the same layout again: same digest, nothing new stored
    before = store_state(daemon.root)
    r2 = imp(api, "oci/test:2", d)
    assert r2.status == 201 and r2.json()["digest"] == img["digest"]
    assert store_state(daemon.root) == before


def test_docker_save_archive(api, work, bbtar):
    p = docker_save_tar(os.path.join(work, "save.tar"),
                        [bbtar, tar_bytes([("srv", "dir"), ("srv/a", "file", "A\n"),
                                           ("bin/.wh.vi", "file")])],
                        {"Env": ["PATH=/bin", "X=1"], "WorkingDir": "/srv", "User": "65534"})
    r = imp(api, "saved:latest", p)
    assert r.status == 201, r
    img = r.json()
    assert len(img["layers"]) == 2 and img["config"]["user"] == "65534"
    sid = api.create(image="saved:latest")
    try:
        out = api.sh(sid, "cat a; test -e /bin/vi && echo vi; echo $X")
        assert out["stdout"].split() == ["A", "1"], out
    finally:
        api.delete(sid)


def test_compose_layers_at_create(api, work):
    # two layer images over busybox, the top one deleting a file of the lower one
    a = write_oci_layout(os.path.join(work, "la"),
                         [tar_bytes([("ws", "dir"), ("ws/repo.txt", "file", "repo\n"),
                                     ("ws/tmpfile", "file", "t"), ("ws/lib", "dir"),
                                     ("ws/lib/a", "file", "a")])])
    b = write_oci_layout(os.path.join(work, "lb"),
                         [tar_bytes([("ws", "dir"), ("ws/.wh.tmpfile", "file"),
                                     ("ws/lib", "dir"), ("ws/lib/.wh..wh..opq", "file"),
                                     ("ws/lib/b", "file", "b"),
                                     ("usr", "dir"), ("usr/tool", "file", "tool\n")])])
    assert imp(api, "repo-x:1", a).status == 201
    assert imp(api, "toolkit-y:3", b).status == 201
    sid = api.create(image="busybox:latest", layers=["repo-x:1", "toolkit-y:3"])
    try:
        out = api.sh(sid, "cat /ws/repo.txt /usr/tool; ls /ws/lib; test -e /ws/tmpfile && echo t; "
                          "test -x /bin/sh && echo sh")
        assert out["stdout"].split() == ["repo", "tool", "b", "sh"], out
    finally:
        api.delete(sid)
    # order matters: with the toolkit below the repo, its whiteout and opaque
    # dir only hide what is under them, so the repo's files all show
    sid = api.create(image="busybox:latest", layers=["toolkit-y:3", "repo-x:1"])
    try:
        out = api.sh(sid, "ls /ws/lib | tr '\\n' ' '; test -e /ws/tmpfile && echo t")
        assert out["stdout"].split() == ["a", "b", "t"], out
    finally:
        api.delete(sid)


def test_directory_import_runs_mkfs_unprivileged(api, daemon, work):
    # mkfs.erofs reads the tree in the unpack helper's user namespace through
    # an idmapped clone: ids 0-65535 are kept (a 0600 file of one is readable
    # to it), a file of an id outside the sandbox range is not: host root
    # would have read it.
    d = os.path.join(work, "dirids")
    os.makedirs(os.path.join(d, "ids"))
    p = os.path.join(d, "ids", "own")
    with open(p, "w") as f:
        f.write("own\n")
    os.chown(p, 1234, 1235)
    os.chmod(p, 0o600)
    r = imp(api, "dirids:1", d)
    assert r.status == 201, r
    sid = api.create(image="busybox:latest", layers=["dirids:1"])
    try:
        out = api.sh(sid, "cat /ids/own; stat -c '%u:%g:%a' /ids/own")
        assert out["stdout"].split() == ["own", "1234:1235:600"], out
    finally:
        api.delete(sid)
    assert api.raw("DELETE", "/v1/images/dirids:1").status in (200, 204)
    p = os.path.join(d, "ids", "far")
    with open(p, "w") as f:
        f.write("far\n")
    os.chown(p, 70000, 70000)
    os.chmod(p, 0o600)
    before = store_state(daemon.root), images(api)
    r = imp(api, "dirids:2", d)
    assert r.status == 400, r
    assert "65535" in r.json()["error"]["message"], r.json()
    assert (store_state(daemon.root), images(api)) == before


# ---------------------------------------------------------------- tag, rm, gc

def test_tag_rm_gc_keeps_layers_in_use(api, daemon, work):
    p = write_oci_layout(os.path.join(work, "gc1"),
                         [tar_bytes([("gcfile", "file", "gc-" + str(time.time()))])])
    r = imp(api, "gcimg:1", p)
    assert r.status == 201
    dg, layer = r.json()["digest"], r.json()["layers"][0]
    r = api.raw("POST", "/v1/images/gcimg:1/tag", {"name": "gcimg:moved"})
    assert r.status == 201 and r.json()["digest"] == dg and r.json()["name"] == "gcimg:moved"
    assert api.raw("DELETE", "/v1/images/gcimg:1").status == 204
    assert api.raw("GET", "/v1/images/gcimg:1").status == 404
    assert api.raw("GET", f"/v1/images/gcimg@{dg}").json()["name"] == "gcimg:moved"
    assert api.raw("POST", "/v1/images/nope:1/tag", {"name": "x:y"}).status == 404
    assert api.raw("POST", "/v1/images/gcimg:moved/tag", {"name": "Bad Name"}).status == 400
    # a sandbox uses the layer; removing the last tag and collecting keeps it
    sid = api.create(image="busybox:latest", layers=["gcimg:moved"])
    lfile = os.path.join(daemon.root, "layers", "sha256", layer[7:] + ".erofs")
    try:
        assert api.raw("DELETE", "/v1/images/gcimg:moved").status == 204
        r = api.raw("POST", "/v1/images/gc")
        assert r.status == 200, r
        assert os.path.exists(lfile)
        assert api.sh(sid, "cat /gcfile")["stdout"].startswith("gc-")
    finally:
        api.delete(sid)
    deadline = time.time() + 120
    while os.path.exists(lfile) and time.time() < deadline:
        time.sleep(0.1)
        api.raw("POST", "/v1/images/gc")
    assert not os.path.exists(lfile)


def test_progress_stream(api, work, bbtar):
    p = os.path.join(work, "stream.tar.gz")
    with open(p, "wb") as f:
        f.write(gzip.compress(bbtar))
    r = imp(api, "streamed:1", p, stream=True)
    assert r.status == 200, r
    lines = [json.loads(l) for l in r.body.decode().splitlines()]
    assert any("progress" in l for l in lines[:-1]), lines
    assert lines[-1]["name"] == "streamed:1" and lines[-1]["digest"].startswith("sha256:")
    r = imp(api, "streamed:2", "/nonexistent", stream=True)
    lines = [json.loads(l) for l in r.body.decode().splitlines()]
    assert lines[-1]["error"]["code"] == "not_found"


# ---------------------------------------------------------------- hostile input

def hostile_cases(work, bbtar):
    cases = {}

    def put(name, data):
        p = os.path.join(work, "bad-" + name)
        with open(p, "wb") as f:
            f.write(data)
        cases[name] = p

    put("dotdot.tar", tar_bytes([("a", "dir"), ("a/../../escape", "file", "x")]))
    put("abs.tar", tar_bytes([("/etc/evil", "file", "x")]))
    put("symlink-escape.tar", tar_bytes([("evil", "symlink", "/etc"), ("evil/passwd", "file", "x")]))
    put("hardlink-out.tar", tar_bytes([("h", "hardlink", "../../etc/passwd")]))
    put("hardlink-abs.tar", tar_bytes([("h", "hardlink", "/etc/passwd")]))
    full = tar_bytes([("big", "file", os.urandom(200000))], gz=True)
    put("truncated.tar.gz", full[: len(full) // 2])
    put("garbage.tar", os.urandom(5000))
    put("empty.tar", b"")
    # OCI layout whose layer blob does not match its digest
    d = write_oci_layout(os.path.join(work, "bad-oci-digest"), [tar_bytes([("f", "file", "x")])])
    man = json.load(open(os.path.join(d, "index.json")))["manifests"][0]["digest"]
    mj = json.load(open(os.path.join(d, "blobs", "sha256", man[7:])))
    lp = os.path.join(d, "blobs", "sha256", mj["layers"][0]["digest"][7:])
    with open(lp, "wb") as f:
        f.write(gzip.compress(tar_bytes([("f", "file", "tampered")])))
    cases["oci-digest"] = d
    # OCI layout naming a layer that is not there
    d = write_oci_layout(os.path.join(work, "bad-oci-missing"), [tar_bytes([("f", "file", "y")])])
    mj = json.load(open(os.path.join(d, "blobs", "sha256",
                                     json.load(open(os.path.join(d, "index.json")))["manifests"][0]["digest"][7:])))
    os.unlink(os.path.join(d, "blobs", "sha256", mj["layers"][0]["digest"][7:]))
    cases["oci-missing-layer"] = d
    # an OCI layer trying to escape, inside an otherwise valid image
    cases["oci-escape"] = write_oci_layout(os.path.join(work, "bad-oci-escape"),
                                           [tar_bytes([("../../x", "file", "x")])])
    # docker-save archive whose layer does not match its diff id
    p = docker_save_tar(os.path.join(work, "bad-save.tar"), [tar_bytes([("f", "file", "z")])])
    raw = open(p, "rb").read()
    cfgname = [m for m in tarfile.open(p).getnames() if m.endswith(".json") and m != "manifest.json"][0]
    t = tarfile.open(p)
    ents = []
    for m in t.getmembers():
        data = t.extractfile(m).read() if m.isfile() else None
        if m.name.endswith("layer.tar"):
            data = tar_bytes([("f", "file", "not-z")])
        ents.append((m.name, "dir" if m.isdir() else "file", data))
    with open(p, "wb") as f:
        f.write(tar_bytes(ents))
    cases["save-digest"] = p
    # docker-save whose manifest points outside the archive
    p2 = os.path.join(work, "bad-save-escape.tar")
    with open(p2, "wb") as f:
        f.write(tar_bytes([("c.json", "file", json.dumps({"rootfs": {"diff_ids": ["sha256:" + "0" * 64]}})),
                           ("manifest.json", "file", json.dumps(
                               [{"Config": "c.json", "Layers": ["../../../../etc/passwd"]}]))]))
    cases["save-escape"] = p2
    del raw, cfgname
    return cases


def test_hostile_imports_leave_store_unchanged(api, daemon, work, bbtar):
    cases = hostile_cases(work, bbtar)
    expect_code = {"oci-missing-layer": "invalid_argument"}
    for name, path in cases.items():
        before = store_state(daemon.root), images(api)
        r = imp(api, "hostile:" + name.replace(".", "-"), path)
        assert 400 <= r.status < 500, (name, r)
        err = r.json()["error"]
        assert err["code"] == expect_code.get(name, "invalid_argument"), (name, err)
        assert err["message"], name
        assert (store_state(daemon.root), images(api)) == before, name
    # messages say what is wrong
    msg = lambda n: imp(api, "h:x", cases[n]).json()["error"]["message"]
    assert ".." in msg("dotdot.tar")
    assert "absolute" in msg("abs.tar")
    assert "symlink" in msg("symlink-escape.tar")
    assert "digest mismatch" in msg("oci-digest")
    assert "missing" in msg("oci-missing-layer")
    assert "digest mismatch" in msg("save-digest")
    assert "outside" in msg("save-escape") or "escape" in msg("save-escape") or "cannot open" in msg("save-escape")
    assert "truncated" in msg("truncated.tar.gz") or "corrupt" in msg("truncated.tar.gz")


def test_device_nodes_are_skipped_and_counted(api, daemon):
    p = os.path.join(daemon.root, "..", "devnodes.tar")
    with open(p, "wb") as f:
        f.write(tar_bytes([("bin", "dir"), ("dev", "dir"), ("dev/null", "chr"),
                           ("dev/keep", "file", "k")]))
    r = imp(api, "devnodes:1", os.path.abspath(p))
    os.unlink(p)
    assert r.status == 201, r
    assert api.raw("GET", "/v1/images/devnodes:1").status == 200


def test_unknown_tag_and_bad_refs(api):
    r = api.raw("POST", "/v1/sandboxes", {"image": "busybox:nope"})
    assert r.status == 404 and "busybox:nope" in r.json()["error"]["message"]
    r = api.raw("POST", "/v1/sandboxes", {"image": "busybox:latest", "layers": ["nope:1"]})
    assert r.status == 404
    assert api.raw("GET", "/v1/images/ghost:1").status == 404
    assert api.raw("DELETE", "/v1/images/ghost:1").status == 404
    assert imp(api, "UPPER:1", "/tmp").status == 400
    assert imp(api, "ok:1", "relative/path").status == 400


def test_kill9_during_import_recovers(rootfs, work):
    need(os.geteuid() == 0, "root")
    d = start_daemon(rootfs)
    try:
        big = os.path.join(work, "big.tar")
        with tarfile.open(big, "w") as t:
            for i in range(6):
                data = os.urandom(40 << 20)
                ti = tarfile.TarInfo(f"blob{i}")
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
        before_layers = sorted(os.listdir(os.path.join(d.root, "layers", "sha256")))
        import threading
        th = threading.Thread(target=lambda: imp(d.api, "killed:1", big), daemon=True)
        th.start()
        # wait until the import has written something to tmp, then kill -9
        deadline = time.time() + 30
        while time.time() < deadline and not os.listdir(os.path.join(d.root, "tmp")):
            time.sleep(0.01)
        d.kill9()  # at once: the import (240 MB) is far from done
        assert os.listdir(os.path.join(d.root, "tmp")), "the kill came too late to test anything"
        d.start()
        assert os.listdir(os.path.join(d.root, "tmp")) == []
        assert sorted(os.listdir(os.path.join(d.root, "layers", "sha256"))) == before_layers
        assert d.api.raw("GET", "/v1/images/killed:1").status == 404
        # the store still works
        sid = d.api.create()
        assert d.api.sh(sid, "echo ok")["stdout"] == "ok\n"
        d.api.delete(sid)
        os.unlink(big)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_disk_full_import(rootfs, work):
    need(os.geteuid() == 0, "root")
    mnt = tempfile.mkdtemp(prefix="wr-full-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", mnt], check=True)
    try:
        os.makedirs(os.path.join(mnt, "root"))
        d = Daemon(os.path.abspath(BUILD), root=os.path.join(mnt, "root"))
        d.start()
        try:
            r = imp(d.api, "busybox:latest", rootfs)
            assert r.status == 201, r
            big = os.path.join(work, "toobig.tar")
            with tarfile.open(big, "w") as t:
                data = os.urandom(64 << 20)
                ti = tarfile.TarInfo("big")
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
            before = store_state(d.root), images(d.api)
            r = imp(d.api, "toobig:1", big)
            os.unlink(big)
            assert r.status == 429, r
            assert r.json()["error"]["code"] == "resource_exhausted"
            assert (store_state(d.root), images(d.api)) == before
            # and the store still imports what fits
            assert imp(d.api, "again:1", rootfs).status == 201
        finally:
            d.stop()
    finally:
        subprocess.run(["umount", "-l", mnt])
        shutil.rmtree(mnt, ignore_errors=True)


# ---------------------------------------------------------------- pack

def test_pack_live_sandbox(api, daemon):
    sid = api.create()
    try:
        out = api.sh(sid, "mkdir -p /work/sub && echo packed > /work/sub/f && rm /bin/vi && "
                          "echo secret > /root/.ash_history && echo s > /root/.bash_history && "
                          "ln /work/sub/f /work/hard && chown 65534:65534 /work/sub/f && "
                          "mkdir -p /etc/ssl && echo 1 > /tmp/.X0-lock && mkfifo /tmp/fifo")
        assert out["exit_code"] == 0, out
        r = api.raw("POST", f"/v1/sandboxes/{sid}/pack", {"name": "packed:1"}, timeout=300)
        assert r.status == 201, r
        img = r.json()
        assert img["packed"]["scrubbed"] == 3, img
        assert img["packed"]["skipped"] == 1, img  # the fifo
        base = api.raw("GET", "/v1/images/busybox:latest").json()
        assert img["layers"][:-1] == base["layers"]
        # the sandbox keeps running after the pack
        assert api.sh(sid, "echo alive")["stdout"] == "alive\n"
    finally:
        api.delete(sid)
    sid = api.create(image="packed:1")
    try:
        out = api.sh(sid, "cat /work/sub/f; test -e /bin/vi && echo vi; ls -a /root | grep hist; "
                          "ls -a /tmp | grep -e X0 -e fifo; stat -c '%u %h' /work/sub/f")
        assert out["stdout"].split() == ["packed", "65534", "2"], out
    finally:
        api.delete(sid)
    assert api.raw("POST", "/v1/sandboxes/ffffffffffffffff/pack", {"name": "x:1"}).status == 404
    sid = api.create()
    try:
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pack", {"name": "Bad:1"}).status == 400
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pack", {}).status == 400
    finally:
        api.delete(sid)


# ---------------------------------------------------------------- build

SPEC = """\
# a small build
FROM busybox:latest
ENV GREETING=hello \\
    OTHER="two words"
WORKDIR /app
COPY hello.txt ./
COPY tree /app/tree
RUN echo "$GREETING from run" > /app/run.txt && \\
    cat /app/hello.txt >> /app/run.txt
LABEL stage=test
USER 65534
"""


def test_build_and_cache(api, work):
    ctx = os.path.join(work, "ctx")
    os.makedirs(os.path.join(ctx, "tree", "sub"), exist_ok=True)
    open(os.path.join(ctx, "hello.txt"), "w").write("hi\n")
    open(os.path.join(ctx, "tree", "sub", "x"), "w").write("x\n")
    os.symlink("/etc/passwd", os.path.join(ctx, "tree", "link"))
    body = {"name": "built:1", "spec": SPEC, "context": ctx}
    r = api.raw("POST", "/v1/images/build", body, timeout=600)
    assert r.status == 201, r
    img = r.json()
    assert img["config"]["workdir"] == "/app" and img["config"]["user"] == "65534"
    assert "OTHER=two words" in img["config"]["env"]
    assert img["config"]["labels"] == {"stage": "test"}
    assert not any(s["cached"] for s in img["steps"][1:]), img["steps"]
    sid = api.create(image="built:1")
    try:
        out = api.sh(sid, "cat run.txt tree/sub/x; readlink tree/link")
        assert out["stdout"] == "hello from run\nhi\nx\n/etc/passwd\n", out
    finally:
        api.delete(sid)
    # unchanged: every step from the cache, same digest
    r2 = api.raw("POST", "/v1/images/build", dict(body, name="built:2", stream=True), timeout=600)
    lines = [json.loads(l) for l in r2.body.decode().splitlines()]
    final = lines[-1]
    assert final["digest"] == img["digest"], final
    assert all(s["cached"] for s in final["steps"]), final["steps"]
    assert any(l.get("progress") == "step" for l in lines[:-1])
    # a changed COPY source rebuilds from that step on, reusing the prefix
    open(os.path.join(ctx, "tree", "sub", "x"), "w").write("changed\n")
    r3 = api.raw("POST", "/v1/images/build", dict(body, name="built:3"), timeout=600).json()
    cached = [s["cached"] for s in r3["steps"]]
    assert cached == [True, True, True, True, False, False, False, False], cached
    assert r3["layers"][:2] == img["layers"][:2]  # busybox + the unchanged COPY


def test_build_errors(api, work):
    def build(spec, ctx=None):
        b = {"name": "bad-build:1", "spec": spec}
        if ctx:
            b["context"] = ctx
        return api.raw("POST", "/v1/images/build", b, timeout=300)

    r = build("RUN true\n")
    assert r.status == 400 and "FROM" in r.json()["error"]["message"]
    r = build("FROM busybox:latest\nFROB x\n")
    assert r.status == 400 and "FROB" in r.json()["error"]["message"]
    r = build("FROM nope:1\n")
    assert r.status == 404
    r = build("FROM busybox:latest\nRUN echo oops >&2; exit 3\n")
    assert r.status == 400
    m = r.json()["error"]["message"]
    assert "exit code 3" in m and "oops" in m and "line 2" in m
    ctx = os.path.join(work, "ctx2")
    os.makedirs(ctx, exist_ok=True)
    r = build("FROM busybox:latest\nCOPY ../../etc/passwd /x\n", ctx)
    assert r.status in (400, 404), r
    r = build("FROM busybox:latest\nCOPY /etc/shadow /x\n", ctx)
    assert r.status == 404, r  # resolved inside the context, where it does not exist
    # no build sandbox is left behind
    assert api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


# ---------------------------------------------------------------- registry

from wr import free_port  # noqa: E402,F401 (one definition, re-exported)


@pytest.fixture(scope="module")
def registry(work):
    exe = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    need(os.path.exists(exe), "docker-registry is not installed (scripts/setup.sh)")
    store = os.path.join(work, "registry")
    port = free_port()
    cfg = os.path.join(work, "registry.yml")
    with open(cfg, "w") as f:
        f.write(f"""version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {store}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
""")
    proc = subprocess.Popen([exe, "serve", cfg], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(work, "registry.log"), "wb"))
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("GET", "/v2/")
            if c.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("docker-registry did not come up")
    yield ("127.0.0.1:%d" % port, store)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def push(host, repo, tag, layers, config=None):
    """Push an OCI image with the distribution API (monolithic blob uploads)."""
    blobs, manb, cfgb = oci_image(layers, config)
    h, p = host.split(":")
    for dg, b in blobs.items():
        c = http.client.HTTPConnection(h, int(p), timeout=30)
        c.request("POST", f"/v2/{repo}/blobs/uploads/")
        r = c.getresponse()
        r.read()
        assert r.status == 202, r.status
        loc = r.getheader("Location")
        loc = loc[loc.index("/v2/"):] if "://" in loc else loc
        sep = "&" if "?" in loc else "?"
        c = http.client.HTTPConnection(h, int(p), timeout=30)
        c.request("PUT", f"{loc}{sep}digest={dg}", body=b,
                  headers={"Content-Type": "application/octet-stream"})
        r = c.getresponse()
        r.read()
        assert r.status == 201, (r.status, dg)
    c = http.client.HTTPConnection(h, int(p), timeout=30)
    c.request("PUT", f"/v2/{repo}/manifests/{tag}", body=manb,
              headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    r = c.getresponse()
    r.read()
    assert r.status == 201, r.status
    return sha(manb), [d for d in blobs if blobs[d] is not cfgb and d != sha(cfgb)]


def test_registry_pull(api, daemon, registry, bbtar):
    host, store = registry
    l2 = tar_bytes([("pulled", "file", "from the registry\n"), ("bin/.wh.vi", "file")])
    mdg, _ = push(host, "test/pulled", "v1", [bbtar, l2], {"Env": ["PATH=/bin", "P=1"]})
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/pulled:v1", "insecure": True,
                                            "stream": True}, timeout=600)
    assert r.status == 200, r
    lines = [json.loads(l) for l in r.body.decode().splitlines()]
    img = lines[-1]
    assert img["name"] == "test/pulled:v1" and len(img["layers"]) == 2, img
    dl = [l for l in lines if l.get("progress") == "download"]
    assert dl and dl[-1]["done"] == dl[-1]["total"] > 0
    sid = api.create(image="test/pulled:v1")
    try:
        out = api.sh(sid, "cat /pulled; test -e /bin/vi && echo vi; echo $P")
        assert out["stdout"].split() == ["from", "the", "registry", "1"], out
    finally:
        api.delete(sid)
    # by digest, under another name: every layer is already here, nothing fetched
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/pulled@{mdg}", "name": "again:1",
                                            "insecure": True, "stream": True}, timeout=600)
    lines = [json.loads(l) for l in r.body.decode().splitlines()]
    assert lines[-1]["layers"] == img["layers"], lines[-1]
    assert not [l for l in lines if l.get("progress") == "download" and l["total"] > 0], lines
    # errors: unknown tag, wrong digest, no insecure, bad ref
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/pulled:nope", "insecure": True})
    assert r.status == 404, r
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/pulled@sha256:" + "1" * 64,
                                            "insecure": True})
    assert 400 <= r.status < 500, r
    # without "insecure" the pull speaks TLS, which this plain registry does not
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/pulled:v1"})
    assert r.status == 503 and "TLS" in r.json()["error"]["message"], r
    assert api.raw("POST", "/v1/images/pull", {"ref": "nohost", "insecure": True}).status == 400


def test_registry_corrupt_blob_rejected(api, daemon, registry):
    host, store = registry
    layer = tar_bytes([("c", "file", "corrupt-me " + str(time.time()))])
    _, blobs = push(host, "test/corrupt", "v1", [layer])
    gz = [b for b in blobs][0]
    data = os.path.join(store, "docker", "registry", "v2", "blobs", "sha256", gz[7:9], gz[7:], "data")
    assert os.path.exists(data)
    raw = bytearray(open(data, "rb").read())
    raw[-5] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    before = store_state(daemon.root), images(api)
    r = api.raw("POST", "/v1/images/pull", {"ref": f"{host}/test/corrupt:v1", "insecure": True})
    assert r.status == 400, r
    assert "digest mismatch" in r.json()["error"]["message"]
    assert (store_state(daemon.root), images(api)) == before


# ---------------------------------------------------------------- CLI

def test_cli_image_verbs(daemon, api, work):
    r = daemon.cli("image", "tag", "busybox:latest", "cli-bb:1", check=True)
    assert r.stdout.decode().startswith("cli-bb:1 sha256:")
    spec = os.path.join(work, "cli.spec")
    open(spec, "w").write("FROM cli-bb:1\nRUN echo built > /b\nENV Z=1\n")
    r = daemon.cli("image", "build", "cli-built:1", "-f", spec, check=True, timeout=300)
    assert r.stdout.decode().startswith("cli-built:1 sha256:")
    # not a terminal: plain progress lines
    assert b"step " in r.stderr, r.stderr
    r = daemon.cli("run", "cli-built:1", "--", "cat", "/b")
    assert r.returncode == 0 and r.stdout == b"built\n", r
    r = daemon.cli("image", "gc", "--json", check=True)
    assert "removed_layers" in json.loads(r.stdout)
    r = daemon.cli("image", "tag", "nope:1", "x:1")
    assert r.returncode == 1 and b"not found" in r.stderr
    r = daemon.cli("image", "build", "x:1")
    assert r.returncode == 2
    sid = api.create()
    try:
        api.sh(sid, "echo from-pack > /p")
        r = daemon.cli("pack", sid, "cli-packed:1", check=True, timeout=300)
        r = daemon.cli("run", "cli-packed:1", "--", "cat", "/p")
        assert r.stdout == b"from-pack\n", r
    finally:
        api.delete(sid)


def test_cli_pull(daemon, registry, bbtar):
    host, _ = registry
    push(host, "cli/pulled", "v2", [bbtar, tar_bytes([("cli", "file", "cli\n")])])
    r = daemon.cli("image", "pull", f"{host}/cli/pulled:v2", "cli-pulled:2", check=True, timeout=300)
    assert r.stdout.decode().startswith("cli-pulled:2 sha256:")
    assert b"download" in r.stderr or b"layer" in r.stderr
    r = daemon.cli("run", "cli-pulled:2", "--", "cat", "/cli")
    assert r.stdout == b"cli\n", r


# ---------------------------------------------------------------- hostile inputs (issue 9)

def many_layers(n, tag):
    return [tar_bytes([("%s-%d" % (tag, i), "file", "%s %d\n" % (tag, i))]) for i in range(n)]


def healthy(api):
    return api.raw("GET", "/healthz").status == 200


def test_layer_limit_at_import_and_create(api, daemon, work):
    # 70 layers: refused at import, clearly, and the daemon carries on
    before = store_state(daemon.root), images(api)
    d = write_oci_layout(os.path.join(work, "oci-70"), many_layers(70, "l"))
    r = imp(api, "seventy:1", d)
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["code"] == "invalid_argument" and "70 layers, at most 64" in err["message"], err
    assert (store_state(daemon.root), images(api)) == before
    assert healthy(api)
    # 40 + 30 layers stacked at create: refused the same way, nothing created
    assert imp(api, "forty:1", write_oci_layout(os.path.join(work, "oci-40"),
                                                many_layers(40, "a"))).status == 201
    assert imp(api, "thirty:1", write_oci_layout(os.path.join(work, "oci-30"),
                                                 many_layers(30, "b"))).status == 201
    r = api.raw("POST", "/v1/sandboxes", {"image": "forty:1", "layers": ["thirty:1"]})
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["code"] == "invalid_argument" and "at most 64" in err["message"], err
    assert healthy(api)
    assert api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []
    for ref in ("forty:1", "thirty:1"):
        assert api.raw("DELETE", "/v1/images/" + ref).status == 204


def test_create_with_a_layer_twice(api):
    # the image's own layers again as extra layers: kept once, not an
    # overlayfs ELOOP (500)
    sid = api.create(image="busybox:latest", layers=["busybox:latest"])
    try:
        assert api.sh(sid, "echo twice")["stdout"] == "twice\n"
    finally:
        api.delete(sid)


def test_zstd_bomb_is_stopped(api, daemon, work):
    # 1 GiB of zeros in a ~33 KB tar.zst: stopped by the expansion ratio
    d = os.path.join(work, "bomb")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "zeros"), "wb") as f:
        f.truncate(1 << 30)
    p = os.path.join(work, "bomb.tar.zst")
    subprocess.run(f"tar -C {d} -cf - zeros | zstd -q -o {p} -f", shell=True, check=True)
    os.unlink(os.path.join(d, "zeros"))
    assert os.path.getsize(p) < 200000
    before = store_state(daemon.root), images(api)
    r = imp(api, "bomb:1", p)
    assert r.status == 413, r
    err = r.json()["error"]
    assert err["code"] == "payload_too_large" and "expands more than" in err["message"], err
    assert (store_state(daemon.root), images(api)) == before
    # a sparse entry declaring 1 GiB in a small plain tar: the same
    subprocess.run(["truncate", "-s", "1G", os.path.join(d, "sparse")], check=True)
    p2 = os.path.join(work, "sparse.tar")
    subprocess.run(["tar", "-S", "-C", d, "-cf", p2, "sparse"], check=True)
    os.unlink(os.path.join(d, "sparse"))
    assert os.path.getsize(p2) < 100000
    r = imp(api, "bomb:2", p2)
    assert r.status == 413, r
    assert (store_state(daemon.root), images(api)) == before
    assert healthy(api)


class Liar:
    """A registry that lies: routes under /v2/<name>/ act out one scenario
    each, and a separate 'internal' server counts every request that
    reaches it (it stands for the daemon's own /metrics)."""

    def __init__(self):
        import http.server
        import threading
        liar = self
        self.sent = {}       # scenario -> body bytes the registry managed to send
        self.secret_hits = 0
        self.scenarios = {}

        class Secret(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                liar.secret_hits += 1
                body = b"SECRET-METRICS warren_sandboxes 3"
                self.send_response(200 if "ok" in self.path else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Reg(http.server.BaseHTTPRequestHandler):
            timeout = 30

            def log_message(self, *a):
                pass

            def do_GET(self):
                parts = self.path.split("/")  # '', 'v2', name, kind, ref
                sc = liar.scenarios.get(parts[2]) if len(parts) == 5 else None
                if sc is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                sc(self, parts[3], parts[4])

        self.secret = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Secret)
        self.reg = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Reg)
        self.secret_url = "http://127.0.0.1:%d" % self.secret.server_address[1]
        self.port = self.reg.server_address[1]
        for srv in (self.secret, self.reg):
            threading.Thread(target=srv.serve_forever, daemon=True).start()

    def close(self):
        for srv in (self.secret, self.reg):
            srv.shutdown()
            srv.server_close()

    def image(self, name, layer_behaviour, layer=None, manifest_behaviour=None):
        """A one-layer image whose layer blob GET is layer_behaviour(handler)."""
        layer = layer if layer is not None else os.urandom(1024)
        cfgb = json.dumps({"config": {}, "rootfs": {"type": "layers",
                                                    "diff_ids": [sha(layer)]}}).encode()
        man = json.dumps({"schemaVersion": 2,
                          "mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "config": {"digest": sha(cfgb), "size": len(cfgb)},
                          "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                                      "digest": sha(layer), "size": len(layer)}]}).encode()

        def serve(h, kind, ref):
            if kind == "manifests" and manifest_behaviour:
                return manifest_behaviour(h)
            if kind == "manifests" or ref == sha(cfgb):
                body = man if kind == "manifests" else cfgb
                h.send_response(200)
                h.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
                h.send_header("Content-Length", str(len(body)))
                h.end_headers()
                h.wfile.write(body)
                return
            layer_behaviour(h)
        self.scenarios[name] = serve


def redirect(to, code=307):
    def act(h):
        h.send_response(code)
        h.send_header("Location", to)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return act


def flood(liar, name, chunked):
    """Send 300 MiB for a blob the manifest says is 1 KiB; count what got out."""
    def act(h):
        h.send_response(200)
        if chunked:
            h.send_header("Transfer-Encoding", "chunked")
        else:
            h.send_header("Content-Length", str(300 << 20))
        h.end_headers()
        block = b"\0" * (1 << 20)
        sent = 0
        try:
            for _ in range(300):
                h.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                sent += len(block)
            if chunked:
                h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        liar.sent[name] = sent
    return act


@pytest.fixture(scope="module")
def liar():
    lr = Liar()
    yield lr
    lr.close()


def pull(api, ref):
    return api.raw("POST", "/v1/images/pull", {"ref": ref, "insecure": True}, timeout=300)


def test_pull_stops_at_declared_blob_size(api, daemon, liar):
    before = store_state(daemon.root), images(api)
    for name, chunked in (("flood-length", False), ("flood-chunked", True)):
        liar.image(name, flood(liar, name, chunked))
        r = pull(api, "127.0.0.1:%d/%s:v1" % (liar.port, name))
        assert r.status == 400, (name, r)
        msg = r.json()["error"]["message"]
        assert "1024" in msg and "layer 1" in msg, (name, msg)
        deadline = time.time() + 30
        while name not in liar.sent and time.time() < deadline:
            time.sleep(0.05)
        # socket buffers hold a few MiB; the old client wrote all 300 to disk
        assert liar.sent.get(name, 0) < (64 << 20), (name, liar.sent)
        assert (store_state(daemon.root), images(api)) == before, name


def peer_process(local_port, server_port):
    """uid and /proc status of the process owning the TCP connection from
    local_port to server_port (the registry's view of its client)."""
    inode = uid = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                c = line.split()
                if (int(c[1].split(":")[1], 16) == local_port
                        and int(c[2].split(":")[1], 16) == server_port):
                    uid, inode = int(c[7]), c[9]
    assert inode, "no such connection"
    want = "socket:[%s]" % inode
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
            if any(os.readlink("/proc/%s/fd/%s" % (pid, fd)) == want for fd in fds):
                with open("/proc/%s/status" % pid) as f:
                    st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
                return uid, int(pid), {k: v.strip() for k, v in st.items()}
        except OSError:
            continue
    raise AssertionError("no process holds " + want)


def test_registry_client_runs_unprivileged(api, daemon, liar):
    # the registry sees a client that is not root, has no capabilities,
    # no_new_privs and a seccomp filter: the fetcher, not warrend
    layer = tar_bytes([("fetched", "file", "by the fetcher\n")])
    seen = {}

    def serve_layer(h):
        seen["peer"] = peer_process(h.client_address[1], liar.port)
        h.send_response(200)
        h.send_header("Content-Length", str(len(layer)))
        h.end_headers()
        h.wfile.write(layer)
    liar.image("whoami", serve_layer, layer=layer)
    # by name: the resolver works inside its jail and filter
    r = pull(api, "localhost:%d/whoami:v1" % liar.port)
    assert r.status == 201, r
    uid, pid, st = seen["peer"]
    assert uid != 0 and st["Uid"].split()[0] != "0", st
    assert pid != daemon.proc.pid
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, (cap, st)
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
    # its own pid namespace: it is PID 1 there
    assert st["NSpid"].split()[-1] == "1", st
    assert api.raw("DELETE", "/v1/images/whoami:v1").status in (200, 204)


def test_hostile_registry_leaves_store_unchanged(api, daemon, liar):
    before = store_state(daemon.root), images(api)
    reg = "127.0.0.1:%d" % liar.port

    def answer(body, ctype="application/vnd.oci.image.manifest.v1+json", length=None):
        def act(h):
            h.send_response(200)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(body) if length is None else length))
            h.end_headers()
            try:
                h.wfile.write(body)
            except OSError:
                pass
        return act
    layer = tar_bytes([("x", "file", "x")])
    many = json.dumps({"schemaVersion": 2, "config": {"digest": sha(b"{}"), "size": 2},
                       "layers": [{"digest": sha(b"%d" % i), "size": 1}
                                  for i in range(65)]}).encode()
    baddigest = json.dumps({"schemaVersion": 2, "config": {"digest": sha(b"{}"), "size": 2},
                            "layers": [{"digest": "sha256:../../etc", "size": 1}]}).encode()
    cases = {
        "malformed": (answer(b'{"schemaVersion": 2, "layers": [', "application/json"),
                      "not JSON"),
        "huge": (answer(b"{" * 1024, length=64 << 20), "more than"),
        "toomany": (answer(many), "64"),
        "baddigest": (answer(baddigest), "invalid digest"),
    }
    for name, (act, words) in cases.items():
        liar.image(name, None, manifest_behaviour=act)
        r = pull(api, "%s/%s:v1" % (reg, name))
        assert r.status == 400, (name, r)
        assert words in r.json()["error"]["message"], (name, r.json())
    # the blob is not what its digest says: the same bytes with one flipped
    bad = bytearray(layer)
    bad[-1] ^= 1
    liar.image("wrongblob", answer(bytes(bad)), layer=layer)
    r = pull(api, "%s/wrongblob:v1" % reg)
    assert r.status == 400, r
    assert "digest mismatch" in r.json()["error"]["message"], r.json()
    assert (store_state(daemon.root), images(api)) == before
    assert healthy(api)


def test_pull_redirects(api, daemon, liar):
    before = store_state(daemon.root), images(api)
    reg = "127.0.0.1:%d" % liar.port
    # a manifest never leaves the registry: the internal server is not reached
    liar.image("rd-manifest", None, manifest_behaviour=redirect(liar.secret_url + "/metrics", 302))
    r = pull(api, reg + "/rd-manifest:v1")
    assert r.status == 400, r
    msg = r.json()["error"]["message"]
    assert "redirected the manifest request to another host" in msg, msg
    assert "SECRET" not in msg and liar.secret_hits == 0
    # blobs may go to storage elsewhere, but never to link-local addresses
    liar.image("rd-linklocal", redirect("http://169.254.169.254/latest/meta-data"))
    r = pull(api, reg + "/rd-linklocal:v1")
    assert r.status == 400, r
    assert "link-local address: refused" in r.json()["error"]["message"], r
    # a loopback registry may keep blobs on this host, but what comes back is
    # only ever a verified blob: the other server's body is never returned
    for path in ("/ok", "/missing"):
        liar.image("rd-local" + path[1:], redirect(liar.secret_url + path))
        r = pull(api, reg + "/rd-local%s:v1" % path[1:])
        assert 400 <= r.status < 600, r
        assert "SECRET" not in r.body.decode(errors="replace"), r
    assert (store_state(daemon.root), images(api)) == before
    # a registry on another address may not send blobs to loopback or to
    # this host's own addresses
    own = [a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True)
           .stdout.split() if "." in a and not a.startswith("127.")]
    need(own, "no non-loopback IPv4 address on this host")
    hits = liar.secret_hits
    secret_port = liar.secret.server_address[1]
    for target in (liar.secret_url + "/ok", "http://%s:%d/ok" % (own[0], secret_port)):
        liar.image("rd-remote", redirect(target))
        r = pull(api, "%s:%d/rd-remote:v1" % (own[0], liar.port))
        assert r.status == 400, r
        assert "loopback or local address: refused" in r.json()["error"]["message"], r
    assert liar.secret_hits == hits
    assert (store_state(daemon.root), images(api)) == before


# ---------------------------------------------------------------- build network (issue 9 item 10)

# nc's own words for what happened: "Connection refused" when nothing
# listens in the step's network namespace, warrend's HTTP answer when it got there
PROBE = ("FROM busybox:latest\n"
         "RUN printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' | nc -w 5 127.0.0.1 %d > /probe.txt 2>&1; "
         "echo rc=$? >> /probe.txt\n")


def tcp_daemon(rootfs, extra=()):
    """A daemon with a token-guarded TCP listener on 127.0.0.1: (daemon, port)."""
    from conftest import start_daemon_tcp
    tok = os.path.join(tempfile.mkdtemp(prefix="wr-tok-"), "token")
    with open(tok, "w") as f:
        f.write("t" * 32 + "\n")
    return start_daemon_tcp(rootfs, ["--token-file", tok] + list(extra))


def probe_text(api, image):
    sid = api.create(image=image)
    try:
        return api.sh(sid, "cat /probe.txt")["stdout"]
    finally:
        api.delete(sid)


def test_build_steps_and_sandboxes_get_no_host_network(rootfs):
    d, port = tcp_daemon(rootfs)
    try:
        # RUN steps run with network none: the daemon's TCP listener on the
        # host's loopback is out of reach
        r = d.api.raw("POST", "/v1/images/build", {"name": "probe:1", "spec": PROBE % port},
                      timeout=300)
        assert r.status == 201, r
        text = probe_text(d.api, "probe:1")
        assert "refused" in text and "rc=0" not in text and "HTTP/" not in text, text
        # host networking is the daemon's decision, not the client's
        r = d.api.raw("POST", "/v1/images/build",
                      {"name": "probe:2", "spec": PROBE % port, "network": "host"}, timeout=300)
        assert r.status == 400 and "--allow-host-network" in r.json()["error"]["message"], r
        r = d.api.raw("POST", "/v1/sandboxes", {"network": "host"})
        assert r.status == 400, r
        assert "--allow-host-network" in r.json()["error"]["message"], r
        r = d.api.raw("POST", "/v1/images/build",
                      {"name": "probe:2", "spec": PROBE % port, "network": "bridge"})
        assert r.status == 400, r
        assert d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_allow_host_network_is_an_explicit_opt_in(rootfs):
    d, port = tcp_daemon(rootfs, ["--allow-host-network"])
    try:
        # without asking, a build still has no network
        r = d.api.raw("POST", "/v1/images/build", {"name": "probe:1", "spec": PROBE % port},
                      timeout=300)
        assert r.status == 201, r
        assert "refused" in probe_text(d.api, "probe:1")
        # asked for and permitted: the step shares the host's namespace
        r = d.api.raw("POST", "/v1/images/build",
                      {"name": "probe:2", "spec": PROBE % port, "network": "host"}, timeout=300)
        assert r.status == 201, r
        text = probe_text(d.api, "probe:2")
        assert "HTTP/1." in text and "refused" not in text, text
        sid = d.api.create(network="host")
        d.api.delete(sid)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

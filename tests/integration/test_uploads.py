"""Chunked uploads (/v1/uploads, docs/api.md): how a TCP client, which may not
name host paths, imports an image or builds from a local context. Chunks are
appended at the offset the client names (a wrong one is 416 with the size, so
a client resumes), uploads are capped per upload, in number and in total bytes,
idle ones expire, and an uploaded build context goes through the confined
unpack helper like any archive."""
import http.client
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import pytest

from conftest import BUILD, need, start_daemon
from test_http_limits import TOKEN, free_port, stop
from wr import Daemon, wait_for

MiB = 1 << 20
CAP = 16 * MiB  # WARREN_UPLOAD_MAX_BYTES of the module's daemon
PYDIR = os.path.join(os.path.dirname(__file__), "..", "..", "python")


def tcp_daemon(env, rootfs=None):
    tokdir = tempfile.mkdtemp(prefix="wr-tok-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    tok = os.path.join(tokdir, "token")
    with open(tok, "w") as f:
        f.write(TOKEN + "\n")
    port = free_port()
    args = ["--listen", f"tcp:127.0.0.1:{port}", "--token-file", tok]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if rootfs:
            d = start_daemon(rootfs, args)
        else:
            need(os.geteuid() == 0, "warrend needs root")
            d = Daemon(os.path.abspath(BUILD), extra_args=args).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    d.port = port
    d.tokdir = tokdir
    return d


def req(d, method, path, body=None, headers=None, token=TOKEN):
    """One request over TCP: (status, parsed JSON or raw bytes, headers)."""
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=300)
    try:
        h = dict(headers or {})
        if token:
            h["Authorization"] = f"Bearer {token}"
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        try:
            data = json.loads(data) if data else {}
        except ValueError:
            pass
        return r.status, data, {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


def upload_bytes(d, data, chunk=3 * MiB + 7):
    st, j, _ = req(d, "POST", "/v1/uploads", {"size": len(data)})
    assert st == 201, j
    uid = j["id"]
    assert len(uid) == 32 and int(uid, 16) >= 0
    off = 0
    while off < len(data):
        part = data[off:off + chunk]
        st, j, _ = req(d, "PUT", f"/v1/uploads/{uid}?offset={off}", part)
        assert st == 202, j
        off += len(part)
        assert j["size"] == off
    return uid


def tar_of(path, gz=False):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w:gz" if gz else "w") as tf:
        for name in sorted(os.listdir(path)):
            tf.add(os.path.join(path, name), arcname="./" + name)
    return b.getvalue()


def uploads_dir_clean(d):
    """Nothing named in ROOT/uploads and no daemon fd on a file there."""
    up = os.path.join(d.root, "uploads")
    names = os.listdir(up) if os.path.isdir(up) else []
    fds = []
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            t = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith(up + "/"):
            fds.append(t)
    return not names and not fds


def run_in(d, image, script):
    """Create a sandbox of image (over the unix socket), run script, delete."""
    sid = d.api.create(image=image)
    try:
        r = d.api.sh(sid, script)
        return r
    finally:
        d.api.delete(sid)


@pytest.fixture(scope="module")
def tcp(rootfs):
    d = tcp_daemon({"WARREN_UPLOAD_MAX_BYTES": str(CAP)}, rootfs=rootfs)
    yield d
    assert uploads_dir_clean(d)
    stop(d)


@pytest.fixture
def ctxdir():
    p = tempfile.mkdtemp(prefix="wr-upctx-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    yield p
    shutil.rmtree(p, ignore_errors=True)


def test_import_targz_upload_then_exec(tcp, rootfs):
    uid = upload_bytes(tcp, tar_of(rootfs, gz=True))
    st, j, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert st == 200 and j["size"] > 0 and j["chunk_max"] == 8 * MiB, j
    st, img, _ = req(tcp, "POST", "/v1/images/import", {"name": "up-targz:1", "upload": uid})
    assert st == 201, img
    assert img["name"] == "up-targz:1"
    # consumed, whatever the outcome
    st, j, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert st == 404 and j["error"]["code"] == "not_found", j
    r = run_in(tcp, "up-targz:1", "echo from-upload; test -x /bin/busybox && echo ok")
    assert r["exit_code"] == 0 and "from-upload" in r["stdout"] and "ok" in r["stdout"], r
    # the host path route stays refused over TCP
    st, j, _ = req(tcp, "POST", "/v1/images/import", {"name": "x:1", "path": rootfs})
    assert st == 403, j
    # both, or neither, is a bad request
    st, j, _ = req(tcp, "POST", "/v1/images/import", {"name": "x:1"})
    assert st == 400, j


def test_resume_after_wrong_offset(tcp):
    st, j, _ = req(tcp, "POST", "/v1/uploads", {})
    uid = j["id"]
    st, j, h = req(tcp, "PUT", f"/v1/uploads/{uid}?offset=0", b"a" * 100)
    assert st == 202 and j["size"] == 100, j
    # a retried chunk (the answer was lost): 416 with the size to resume from
    st, j, h = req(tcp, "PUT", f"/v1/uploads/{uid}?offset=0", b"a" * 100)
    assert st == 416, j
    assert j["size"] == 100 and h["upload-offset"] == "100" and h["range"] == "0-99", (j, h)
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}?offset=150", b"b" * 10)
    assert st == 416 and j["size"] == 100, j
    # resume: ask, then continue where the daemon is (Content-Range this time)
    st, j, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert j["size"] == 100
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}", b"b" * 50,
                   headers={"Content-Range": "bytes 100-149/*"})
    assert st == 202 and j["size"] == 150, j
    # PATCH is the method of record (PUT its synonym), over TCP and the unix socket
    st, j, _ = req(tcp, "PATCH", f"/v1/uploads/{uid}?offset=150", b"p" * 10)
    assert st == 202 and j["size"] == 160, j
    r = tcp.api.raw("PATCH", f"/v1/uploads/{uid}", b"u" * 5, headers={"Content-Range": "160-164"})
    assert r.status == 202 and r.json()["size"] == 165, r
    # a chunk without an offset, or whose range does not match its body
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}", b"c")
    assert st == 400, j
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}", b"cc", headers={"Content-Range": "150-150"})
    assert st == 400, j
    st, _, _ = req(tcp, "DELETE", f"/v1/uploads/{uid}")
    assert st == 204
    st, _, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert st == 404


def test_uploads_belong_to_their_creator(tcp):
    # created over the unix socket: not the TCP token's to see or consume
    r = tcp.api.raw("POST", "/v1/uploads", {})
    assert r.status == 201, r
    uid = r.json()["id"]
    st, j, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert st == 404, j
    st, j, _ = req(tcp, "POST", "/v1/images/import", {"name": "theft:1", "upload": uid})
    assert st == 404, j
    st, j, _ = req(tcp, "GET", "/v1/uploads")
    assert uid not in [u["id"] for u in j["uploads"]], j
    # unknown ids and garbage alike
    st, _, _ = req(tcp, "GET", "/v1/uploads/" + "0" * 32)
    assert st == 404
    st, _, _ = req(tcp, "GET", "/v1/uploads/..%2f..%2fetc")
    assert st == 404
    assert tcp.api.raw("DELETE", f"/v1/uploads/{uid}").status == 204


def test_oversize_upload_refused_and_removed(tcp):
    # declared up front
    st, j, _ = req(tcp, "POST", "/v1/uploads", {"size": CAP + 1})
    assert st == 413 and j["error"]["code"] == "payload_too_large", j
    st, j, _ = req(tcp, "POST", "/v1/uploads", {})
    uid = j["id"]
    # one chunk over the per-request limit: refused, the upload stays
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}?offset=0", b"x" * (8 * MiB + 1))
    assert st == 413, j
    block = b"y" * (8 * MiB)
    assert req(tcp, "PUT", f"/v1/uploads/{uid}?offset=0", block)[0] == 202
    assert req(tcp, "PUT", f"/v1/uploads/{uid}?offset={8 * MiB}", block)[0] == 202
    # the byte past the cap: refused and the upload is gone with its bytes
    st, j, _ = req(tcp, "PUT", f"/v1/uploads/{uid}?offset={CAP}", b"z")
    assert st == 413 and j["error"]["code"] == "payload_too_large", j
    st, _, _ = req(tcp, "GET", f"/v1/uploads/{uid}")
    assert st == 404
    st, j, _ = req(tcp, "GET", "/v1/uploads")
    assert j["uploads"] == [] and j["total_bytes"] == 0, j
    assert uploads_dir_clean(tcp)


def test_build_with_uploaded_context(tcp, ctxdir):
    with open(os.path.join(ctxdir, "hello.txt"), "w") as f:
        f.write("hello from the uploaded context\n")
    os.makedirs(os.path.join(ctxdir, "sub"))
    with open(os.path.join(ctxdir, "sub", "x"), "w") as f:
        f.write("x\n")
    uid = upload_bytes(tcp, tar_of(ctxdir))
    spec = "FROM busybox:latest\nCOPY hello.txt /hello.txt\nCOPY sub /sub\n"
    st, img, _ = req(tcp, "POST", "/v1/images/build",
                     {"name": "up-built:1", "spec": spec, "context_upload": uid})
    assert st == 201, img
    r = run_in(tcp, "up-built:1", "cat /hello.txt /sub/x")
    assert r["stdout"] == "hello from the uploaded context\nx\n", r
    # the extracted context is gone, the upload consumed
    tmp = os.path.join(tcp.root, "tmp")
    assert not [n for n in os.listdir(tmp) if n.startswith("context-")]
    assert req(tcp, "GET", f"/v1/uploads/{uid}")[0] == 404
    # a context path is still refused over TCP, and not both at once
    st, j, _ = req(tcp, "POST", "/v1/images/build",
                   {"name": "x:1", "spec": spec, "context": ctxdir})
    assert st == 403, j


def test_uploaded_context_traversal_contained(tcp):
    tmp = os.path.join(tcp.root, "tmp")
    canary = "wr-upload-escape-" + os.urandom(4).hex()
    # a member climbing out of the context
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as tf:
        for name in (f"../{canary}", f"../../{canary}", f"/var/tmp/{canary}"):
            ti = tarfile.TarInfo(name)
            ti.size = 3
            tf.addfile(ti, io.BytesIO(b"pwn"))
    uid = upload_bytes(tcp, b.getvalue())
    st, j, _ = req(tcp, "POST", "/v1/images/build",
                   {"name": "evil:1", "spec": "FROM busybox:latest\nCOPY . /c\n",
                    "context_upload": uid})
    assert st == 400 and j["error"]["code"] == "invalid_argument", j
    for where in (tmp, tcp.root, os.path.dirname(tcp.root), "/var/tmp"):
        assert not os.path.exists(os.path.join(where, canary)), where
    # a symlink pointing out: COPY resolves it inside the context, not on the host
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w") as tf:
        ti = tarfile.TarInfo("etc")
        ti.type = tarfile.SYMTYPE
        ti.linkname = "/etc"
        tf.addfile(ti)
    uid = upload_bytes(tcp, b.getvalue())
    st, j, _ = req(tcp, "POST", "/v1/images/build",
                   {"name": "evil:2", "spec": "FROM busybox:latest\nCOPY etc/shadow /stolen\n",
                    "context_upload": uid})
    assert st in (400, 404), j
    assert req(tcp, "GET", "/v1/images/evil%3A2")[0] == 404
    assert not [n for n in os.listdir(tmp) if n.startswith("context-")]


def cli(d, *args, input=None):
    env = dict(os.environ, WARREN_HOST=f"http://127.0.0.1:{d.port}", WARREN_TOKEN=TOKEN)
    return subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren")] + list(args),
                          input=input, capture_output=True, timeout=600, env=env)


def test_cli_round_trip(tcp, rootfs, ctxdir):
    # a directory, tarred on the fly and uploaded (TCP host: no flag needed)
    r = cli(tcp, "image", "import", "up-cli-dir:1", rootfs)
    assert r.returncode == 0, r
    assert r.stdout.decode().startswith("up-cli-dir:1 sha256:"), r
    out = run_in(tcp, "up-cli-dir:1", "busybox echo dir-ok")
    assert out["stdout"] == "dir-ok\n", out
    # a tarball file as is
    tgz = os.path.join(ctxdir, "rootfs.tar.gz")
    with open(tgz, "wb") as f:
        f.write(tar_of(rootfs, gz=True))
    r = cli(tcp, "image", "import", "--json", "up-cli-tgz:1", tgz)
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["name"] == "up-cli-tgz:1"
    os.unlink(tgz)
    # build: the context defaults to the spec's directory, uploaded
    with open(os.path.join(ctxdir, "greeting"), "w") as f:
        f.write("hi from cli\n")
    with open(os.path.join(ctxdir, "Warrenfile"), "w") as f:
        f.write("FROM busybox:latest\nCOPY greeting /greeting\n")
    r = cli(tcp, "image", "build", "up-cli-built:1", "-f", os.path.join(ctxdir, "Warrenfile"),
            "--quiet")
    assert r.returncode == 0, r
    assert run_in(tcp, "up-cli-built:1", "cat /greeting")["stdout"] == "hi from cli\n"
    # --upload over the unix socket too
    env = dict(os.environ, WARREN_HOST="unix:" + tcp.sock)
    r = subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren"), "image", "import",
                        "--upload", "up-cli-unix:1", rootfs], capture_output=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r
    assert req(tcp, "GET", "/v1/uploads")[1]["uploads"] == []


def test_python_sdk_round_trip(tcp, rootfs, ctxdir):
    code = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import warren
c = warren.Client(f"http://127.0.0.1:{sys.argv[2]}", token=sys.argv[3])
steps = []
img = c.images.import_("up-sdk:1", sys.argv[4], progress=lambda w, d, t: steps.append(w))
assert img.name == "up-sdk:1", img
assert "upload" in steps, steps
open(os.path.join(sys.argv[5], "f"), "w").write("sdk-ctx\n")
img = c.images.build("up-sdk-built:1", "FROM busybox:latest\nCOPY f /f\n", context=sys.argv[5])
assert img.name == "up-sdk-built:1", img
import asyncio, warren.aio
async def main():
    async with warren.aio.AsyncClient(f"http://127.0.0.1:{sys.argv[2]}", token=sys.argv[3]) as a:
        img = await a.images.import_("up-sdk-async:1", sys.argv[4])
        assert img.name == "up-sdk-async:1", img
asyncio.run(main())
print("sdk-ok")
"""
    r = subprocess.run([sys.executable, "-c", code, os.path.abspath(PYDIR), str(tcp.port), TOKEN,
                        rootfs, ctxdir], capture_output=True, timeout=600)
    assert r.returncode == 0 and b"sdk-ok" in r.stdout, r
    assert run_in(tcp, "up-sdk-built:1", "cat /f")["stdout"] == "sdk-ctx\n"
    assert run_in(tcp, "up-sdk-async:1", "echo a")["stdout"] == "a\n"


def test_limits_and_expiry():
    """A daemon of its own: two uploads at most, 1 MiB staged in total, and
    idle uploads expire after a second."""
    d = tcp_daemon({"WARREN_UPLOADS_MAX": "2", "WARREN_UPLOAD_TOTAL_BYTES": str(MiB),
                    "WARREN_UPLOAD_IDLE_S": "1"})
    try:
        a = req(d, "POST", "/v1/uploads", {})[1]["id"]
        st, j, _ = req(d, "PUT", f"/v1/uploads/{a}?offset=0", b"q" * (MiB - 10))
        assert st == 202, j
        # over the daemon-wide byte cap: 429, the upload keeps what it has
        st, j, _ = req(d, "PUT", f"/v1/uploads/{a}?offset={MiB - 10}", b"q" * 20)
        assert st == 429 and j["error"]["code"] == "resource_exhausted", j
        st, j, _ = req(d, "POST", "/v1/uploads", {"size": 100})
        assert st == 429, j
        b = req(d, "POST", "/v1/uploads", {})[1]["id"]
        # over the number of open uploads
        st, j, _ = req(d, "POST", "/v1/uploads", {})
        assert st == 429 and "uploads are open" in j["error"]["message"], j
        # idle ones are reaped by the timer
        wait_for(lambda: req(d, "GET", "/v1/uploads")[1]["uploads"] == [],
                 what="idle uploads expired")
        for uid in (a, b):
            assert req(d, "GET", f"/v1/uploads/{uid}")[0] == 404
        assert req(d, "POST", "/v1/uploads", {})[0] == 201
        assert not os.listdir(os.path.join(d.root, "uploads"))
    finally:
        stop(d)

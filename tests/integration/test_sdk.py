"""The Python SDK (python/warren) against a real warrend: every method, sync
and asyncio, error mapping, retries, cancellation, 500 concurrent sandboxes
from one event loop, the rollout example, and the offline pip install."""
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

import warren  # noqa: E402
from conftest import start_daemon_tcp  # noqa: E402

LABEL = {"suite": "test_sdk"}


@pytest.fixture(scope="module")
def host(daemon):
    return "unix:" + daemon.sock


@pytest.fixture(scope="module")
def client(host):
    c = warren.Client(host)
    yield c
    c.close()


@pytest.fixture
def sb(client):
    with client.create(memory_mb=128, labels=LABEL) as s:
        yield s


def leftover(client):
    return [s.id for s in client.list()]


# Deadlines below only catch "never": CI is a 2-core nested VM whose speed
# drifts 1.5-2x, so no test compares how long something took with a bound
# a slow run could reach.
DEADLINE = 60


def wait_until(cond, what, timeout=DEADLINE):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def gate(path):
    """Shell that waits for `path` to exist: the test decides when it goes on."""
    return f"while [ ! -e {path} ]; do sleep 0.05; done"


# ---- sync client ----

def test_host_resolution_and_health(client, daemon, monkeypatch):
    h = client.health()
    assert h["status"] == "ok" and isinstance(h["sandboxes"], int)
    monkeypatch.setenv("WARREN_HOST", "unix:" + daemon.sock)
    assert warren.Client().health()["status"] == "ok"
    monkeypatch.delenv("WARREN_HOST")
    monkeypatch.setenv("WARREN_ROOT", daemon.root)
    assert warren.Client().health()["status"] == "ok"
    assert "warren_exec_total" in client.metrics()
    assert isinstance(client.pools(), dict)
    for bad in ("ftp://x", "unix:", "http://h:notaport", "http://h:1/path"):
        with pytest.raises(warren.InvalidArgument):
            warren.Client(bad)


def test_create_info_and_context_manager(client):
    with client.create(image="busybox:latest", memory_mb=96, cpus=0.5, ttl_s=600,
                       network="none", env={"FOO": "bar"}, labels=dict(LABEL, k="v")) as s:
        assert s.info.state == "running" and s.info.image == "busybox:latest"
        assert s.info.memory_mb == 96 and s.info.cpus == 0.5 and s.info.network == "none"
        assert s.info.labels["k"] == "v" and s.info.expires_at is not None
        info = s.refresh()
        assert info.usage is not None and info.usage["memory_bytes"] >= 0
        assert s.id in [x.id for x in client.list(labels={"k": "v"})]
        assert client.get(s.id).id == s.id
        assert client.sandbox(s.id).exec("echo $FOO").stdout == "bar\n"
        sid = s.id
    with pytest.raises(warren.NotFound):
        client.get(sid)
    s.close()  # idempotent
    client.delete(sid, missing_ok=True)
    with pytest.raises(warren.NotFound):
        client.delete(sid)


def test_exec_forms(sb):
    r = sb.exec(["echo", "a b"])
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (0, "a b\n", "", True)
    assert r.duration_ms >= 0 and r.usage.max_rss_kb > 0 and r.usage.oom_killed is False
    r = sb.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (7, "out\n", "err\n", False)
    assert sb.exec(shell="echo $((6*7))").stdout == "42\n"
    assert sb.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.exec(["sh", "-c", "echo $A$B"], env={"A": "x", "B": "y"}).stdout == "xy\n"
    assert sb.exec(["cat"], stdin="hello\n").stdout == "hello\n"
    blob = bytes(range(256)) * 4
    r = sb.exec(["cat"], stdin=blob)
    assert r.stdout_bytes == blob
    r = sb.exec(["/no/such/binary"])
    assert r.exit_code == 127 and r.error
    r = sb.exec("sleep 600", timeout=0.3)
    assert r.timed_out and r.exit_code == -1 and not r.ok
    r = sb.exec("head -c 5000 /dev/zero", stdout_cap=100)
    assert r.truncated and r.stdout_truncated and len(r.stdout_bytes) == 100
    r = sb.exec(["true"], step="step-1")
    assert r.exit_code == 0
    with pytest.raises(warren.InvalidArgument):
        sb.exec()
    with pytest.raises(warren.InvalidArgument):
        sb.exec(["echo"], shell="echo")


def test_exec_stream_is_incremental(sb):
    # each line is followed by a wait for a file only the test creates, and
    # only after it has seen that line: so each arrived while the command ran
    seen = []
    script = (f"echo 1; {gate('/tmp/go1')}; echo 2; {gate('/tmp/go2')}; echo 3; "
              "echo e >&2; exit 3")
    # (a stream that held its output back would reach the command's timeout)
    with sb.exec_stream(script, collect=True, timeout=DEADLINE) as s:
        for chunk in s:
            seen.append((chunk.stream, chunk.data))
            n = len([d for st, d in seen if st == "stdout"])
            if chunk.stream == "stdout" and n < 3:
                sb.write_file(f"/tmp/go{n}", b"")  # release the next line
    assert [d for st, d in seen if st == "stdout"] == [b"1\n", b"2\n", b"3\n"]
    assert "stderr" in [st for st, _ in seen]
    assert s.result.exit_code == 3 and s.result.stdout == "1\n2\n3\n" and s.result.stderr == "e\n"
    assert s.wait().exit_code == 3
    # binary output through the stream
    s = sb.exec_stream(["head", "-c", "300", "/dev/urandom"], collect=True)
    res = s.wait()
    assert res.exit_code == 0 and len(res.stdout_bytes) == 300


def test_exec_stream_close_kills_command(sb):
    # the command waits for /tmp/go-close before it would touch /tmp/finished
    script = f"echo $$ > /tmp/close.pid; echo go; {gate('/tmp/go-close')}; touch /tmp/finished"
    with sb.exec_stream(script) as s:
        for chunk in s:
            assert chunk.data == b"go\n"
            break
    # closing the stream kills it: the waiting shell goes away...
    wait_until(lambda: sb.exec("kill -0 $(cat /tmp/close.pid)").exit_code != 0,
               "the command of a closed stream still runs")
    # ...so releasing it now changes nothing
    sb.write_file("/tmp/go-close", b"")
    assert sb.exec("test -e /tmp/finished").exit_code == 1
    assert sb.exec(["true"]).ok  # the sandbox is fine afterwards


def test_files(sb):
    blob = bytes(range(256)) * 1000
    assert sb.write_file("/tmp/b.bin", blob) == len(blob)
    assert sb.read_file("/tmp/b.bin") == blob
    assert sb.write_file("/tmp/t.txt", "héllo\n", mode=0o600) > 0
    assert sb.stat("/tmp/t.txt").mode & 0o777 == 0o600
    sb.write_file("/tmp/t.txt", "more\n", append=True)
    assert sb.read_file("/tmp/t.txt") == "héllo\nmore\n".encode()
    st = sb.stat("/tmp/t.txt")
    assert st.type == "file" and st.size == len("héllo\nmore\n".encode())
    sb.mkdir("/tmp/d/e/f", parents=True)
    sb.write_file("/tmp/d/e/f/x", b"")
    names = {e.name: e for e in sb.list_dir("/tmp/d/e")}
    assert names["f"].is_dir
    assert sb.stat("/tmp/d").is_dir
    with pytest.raises(warren.WarrenError):
        sb.remove("/tmp/d")  # not empty
    sb.remove("/tmp/d", recursive=True)
    with pytest.raises(warren.NotFound):
        sb.stat("/tmp/d")
    with pytest.raises(warren.NotFound):
        sb.read_file("/tmp/nope")
    with pytest.raises(warren.InvalidArgument) as e:
        sb.read_file("/tmp")  # a directory
    assert e.value.status == 400
    with pytest.raises(warren.InvalidArgument) as e:
        sb.read_file("relative")  # refused locally
    assert e.value.status == 0
    assert sb.exec("cat /tmp/b.bin | wc -c").stdout.strip() == str(len(blob))


def test_sync_client_shared_by_threads(client, sb):
    out, errors = [], []

    def work(i):
        try:
            for j in range(10):
                r = sb.exec(["echo", f"{i}-{j}"])
                out.append(r.stdout.strip())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()  # each exec has its own deadline; pytest's timeout catches a hang
    assert not errors, errors
    assert sorted(out) == sorted(f"{i}-{j}" for i in range(8) for j in range(10))


def test_pause_resume(sb):
    assert sb.pause().state == "paused"
    assert sb.refresh().state == "paused"
    assert sb.resume().state == "running"
    # an exec to a paused sandbox resumes it first (docs/api.md, pause)
    assert sb.pause().state == "paused"
    assert sb.exec(["true"]).ok
    assert sb.refresh().state == "running"


def test_error_mapping(client, sb):
    with pytest.raises(warren.NotFound) as e:
        client.get("0123456789abcdef")
    assert e.value.status == 404 and e.value.code == "not_found" and "no such sandbox" in str(e.value)
    with pytest.raises(warren.InvalidArgument) as e:
        sb.exec(["pwd"], cwd="relative")
    assert e.value.status == 400 and "cwd" in e.value.message
    with pytest.raises(warren.InvalidArgument) as e:
        client.create(memory_mb="lots")
    assert e.value.status == 400
    with pytest.raises(warren.NotFound):
        client.create(image="no-such-image:1", labels=LABEL)
    with pytest.raises(warren.InvalidArgument):
        client.get("../etc")  # refused locally
    assert isinstance(warren.NotFound("x"), LookupError)
    assert isinstance(warren.Timeout("x"), TimeoutError)


def test_gone_when_agent_dies(client):
    with client.create(memory_mb=64, labels=LABEL) as s:
        pid = s.refresh().raw.get("pid")
        assert isinstance(pid, int) and pid > 1
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                s.exec(["true"])
            except warren.Gone as e:
                assert e.status == 410
                break
            assert time.monotonic() < deadline, "exec still works after the agent was killed"
            time.sleep(0.05)


def test_client_deadline_and_connect_error(client, sb):
    # the command would run 600 s: only the client's own deadline ends the call
    t0 = time.monotonic()
    with pytest.raises(warren.Timeout) as e:
        sb.exec("sleep 600", request_timeout=0.4)
    assert e.value.status == 0 and time.monotonic() - t0 < DEADLINE
    assert sb.exec(["echo", "next"]).stdout == "next\n"  # the timed-out connection was dropped
    with pytest.raises(warren.ConnectError):
        warren.Client("unix:/nonexistent/warrend.sock").health()


def test_tcp_bearer_token(rootfs):
    tok = "sdk-test-token-0123456789"
    d = tempfile.mkdtemp(prefix="wr-sdk-tcp-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    tf = os.path.join(d, "token")
    with open(tf, "w") as f:
        f.write(tok)
    dm, port = start_daemon_tcp(rootfs, ["--token-file", tf])
    try:
        with pytest.raises(warren.Unauthorized) as e:
            warren.Client(f"http://127.0.0.1:{port}", token="wrong-token-xxxxxxxxxx").list()
        assert e.value.status == 401
        with warren.Client(f"http://127.0.0.1:{port}", token=tok) as c:
            with c.create(memory_mb=64) as s2:
                assert s2.exec(["echo", "tcp"]).stdout == "tcp\n"
                s2.write_file("/tmp/x", b"\x00\x01")
                assert s2.read_file("/tmp/x") == b"\x00\x01"
            assert c.list() == []
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)


def test_images(client):
    imgs = client.images.list()
    bb = client.images.get("busybox:latest")
    assert bb.digest.startswith("sha256:") and bb.layers
    assert "busybox:latest" in [i.name for i in imgs]
    assert client.images.exists("busybox:latest") and not client.images.exists("nope:0")
    with pytest.raises(warren.NotFound):
        client.images.get("nope:0")
    d = tempfile.mkdtemp(prefix="wr-sdk-layer-")
    try:
        os.makedirs(os.path.join(d, "work"))
        with open(os.path.join(d, "work", "hello"), "w") as f:
            f.write("layer\n")
        steps = []
        img = client.images.import_("sdk-layer:1", d, progress=lambda *a: steps.append(a))
        assert img.name == "sdk-layer:1" and img.digest.startswith("sha256:")
        assert all(isinstance(x[0], str) and x[1] <= x[2] or x[2] == 0 for x in steps), steps
        with pytest.raises(warren.InvalidArgument):
            client.images.import_("sdk-bad:1", "relative/path", progress=lambda *a: None)
        with pytest.raises(warren.WarrenError) as e:
            client.images.import_("sdk-bad:1", "/nonexistent/dir", progress=lambda *a: None)
        assert e.value.status >= 400
        with client.create(image="busybox:latest", layers=["sdk-layer:1"], memory_mb=64,
                           labels=LABEL) as s:
            assert s.read_file("/work/hello") == b"layer\n"
            assert s.exec("cat /work/hello").stdout == "layer\n"
        client.images.delete("sdk-layer:1")
        assert not client.images.exists("sdk-layer:1")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_images_tag_build_pull(client):
    # tag
    img = client.images.tag("busybox:latest", "sdk-alias:1")
    assert img.digest == client.images.get("busybox:latest").digest
    assert client.images.get("sdk-alias:1").digest == img.digest
    client.images.delete("sdk-alias:1")
    assert client.images.exists("busybox:latest")
    with pytest.raises(warren.NotFound):
        client.images.tag("nope:0", "sdk-alias:2")
    # build
    spec = "FROM busybox:latest\nRUN echo built > /built.txt\nENV BUILT=1\n"
    img = client.images.build("sdk-built:1", spec, timeout=300)
    assert img.name == "sdk-built:1" and len(img.layers) >= 2
    with client.create(image="sdk-built:1", memory_mb=64, labels=LABEL) as s:
        assert s.read_file("/built.txt") == b"built\n"
        assert s.exec("echo $BUILT").stdout == "1\n"
    client.images.delete("sdk-built:1")
    steps = []
    img = client.images.build("sdk-built:2", "FROM busybox:latest\nRUN touch /two\n",
                              progress=lambda *a: steps.append(a), timeout=300)
    assert img.name == "sdk-built:2"
    client.images.delete("sdk-built:2")
    with pytest.raises(warren.WarrenError) as e:
        client.images.build("sdk-built:3", "FROM busybox:latest\nRUN exit 3\n", timeout=300)
    assert e.value.status >= 400 and e.value.message
    # pull: no registry reachable here; whatever the daemon says must surface cleanly
    with pytest.raises(warren.WarrenError) as e:
        client.images.pull("127.0.0.1:1/nothing/here:1", timeout=60)
    assert e.value.status >= 400 and e.value.code and e.value.message
    with pytest.raises(warren.WarrenError) as e:
        client.images.pull("127.0.0.1:1/nothing/here:1", insecure=True, timeout=60,
                           progress=lambda *a: None)
    assert e.value.status >= 400 and e.value.code != "protocol_error", e.value


def test_pack(client):
    with client.create(memory_mb=64, labels=LABEL) as s:
        s.write_file("/tmp/packed.txt", b"snapshot\n")
        img = s.pack("sdk-packed:1", timeout=300)
        assert img.name == "sdk-packed:1" and len(img.layers) >= 2
        with pytest.raises(warren.InvalidArgument):
            s.pack("")
    with client.create(image="sdk-packed:1", memory_mb=64, labels=LABEL) as s2:
        assert s2.read_file("/tmp/packed.txt") == b"snapshot\n"
    client.images.delete("sdk-packed:1")
    with pytest.raises(warren.NotFound):
        client.sandbox("0123456789abcdef").pack("sdk-packed:2")


def test_call(client):
    r = client.call(["echo", "fn"], image="busybox:latest", timeout=30)
    assert r.exit_code == 0 and r.stdout == "fn\n"
    r = client.call("cat; exit 4", image="busybox:latest", stdin=b"\xff\x00")
    assert r.exit_code == 4 and r.stdout_bytes == b"\xff\x00"
    with pytest.raises(warren.WarrenError) as e:
        client.call(["true"], image="no-such-image:1")
    assert e.value.status in (400, 404), e.value
    with pytest.raises(warren.InvalidArgument) as e:
        client.call(["true"], mode="reuse")  # reuse is for Python calls
    assert e.value.status == 400
    # Python code needs an interpreter in the image: busybox has none
    with pytest.raises(warren.WarrenError) as e:
        client.call(code="print(1+1)", image="busybox:latest", timeout=10)
    assert e.value.status >= 400 and "python" in e.value.message.lower(), e.value
    with pytest.raises(warren.InvalidArgument):
        client.call(["true"], code="print(1)")  # refused locally


def test_create_whose_answer_is_lost_leaves_no_sandbox(client, host):
    """A create that hits its deadline after the request went out: the SDK
    finds what the daemon made by its label and deletes it."""
    lost = 0
    for i in range(15):
        try:
            with client.create(memory_mb=64, labels=dict(LABEL, lost="1"), timeout=0.001 * (i % 5 + 1)):
                pass
        except warren.Timeout as e:
            assert e.status == 0
            lost += 1

    async def main():
        n = 0
        async with warren.AsyncClient(host) as ac:
            for i in range(15):
                try:
                    async with ac.create(memory_mb=64, labels=dict(LABEL, lost="1"),
                                         timeout=0.001 * (i % 5 + 1)):
                        pass
                except warren.Timeout:
                    n += 1
        return n
    lost += asyncio.run(main())
    assert lost > 0  # the deadline did bite
    assert client.list(labels={"lost": "1"}) == []


# ---- retry policy, against a scripted fake daemon ----

def read_head(c):
    data = b""
    while b"\r\n\r\n" not in data:
        part = c.recv(65536)
        if not part:
            break
        data += part
    return data


class FakeDaemon:
    """Unix-socket server that answers each connection with a scripted action:
    "drop" closes after reading a request, "ok" answers 200 {} keep-alive,
    then closes that connection unanswered when the next request arrives on
    it (or the client hangs up): what an idle timeout racing a request does,
    without depending on when the client sends it."""

    def __init__(self, script):
        self.dir = tempfile.mkdtemp(prefix="wr-fake-")
        self.path = os.path.join(self.dir, "s.sock")
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(self.path)
        self.srv.listen(16)
        self.script = list(script)
        self.requests = []
        self.accepted = 0
        self.t = threading.Thread(target=self.serve, daemon=True)
        self.t.start()

    def serve(self):
        while self.script:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            action = self.script.pop(0)
            self.requests.append(read_head(c).split(b"\r\n", 1)[0].decode())
            if action == "ok":
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 2\r\n\r\n{}")
                read_head(c)  # the next request on this connection is never answered
            c.close()

    def close(self):
        self.srv.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_idempotent_retry_and_post_never_resent():
    f = FakeDaemon(["drop", "ok"])
    try:
        c = warren.Client("unix:" + f.path, timeout=DEADLINE)
        assert c.health() == {}  # GET dropped once, retried on a fresh connection
        assert f.requests == ["GET /healthz HTTP/1.1"] * 2
        c.close()
    finally:
        f.close()
    f = FakeDaemon(["drop", "ok"])
    try:
        c = warren.Client("unix:" + f.path, timeout=DEADLINE)
        with pytest.raises(warren.ConnectionLost):
            c.sandbox("abc").pause()
        assert f.requests == ["POST /v1/sandboxes/abc/pause HTTP/1.1"]  # sent once only
    finally:
        f.close()

    async def async_side():
        f = FakeDaemon(["drop", "ok", "ok"])
        try:
            async with warren.AsyncClient("unix:" + f.path, timeout=DEADLINE) as ac:
                assert await ac.health() == {}
                # goes out on the kept-alive connection, which the fake then
                # closes unanswered: lost, and never re-sent on a new one
                with pytest.raises(warren.ConnectionLost):
                    await ac.sandbox("abc").exec(["true"])
                await asyncio.sleep(0.3)
            return f.requests, f.accepted
        finally:
            f.close()
    reqs, accepted = asyncio.run(async_side())
    assert reqs == ["GET /healthz HTTP/1.1"] * 2 and accepted == 2


# ---- asyncio client ----

def test_async_every_method(host, client):
    async def main():
        async with warren.AsyncClient(host) as ac:
            assert (await ac.health())["status"] == "ok"
            assert "warren_" in await ac.metrics()
            assert isinstance(await ac.pools(), dict)
            assert "busybox:latest" in [i.name for i in await ac.images.list()]
            assert (await ac.images.get("busybox:latest")).digest.startswith("sha256:")
            assert await ac.images.exists("busybox:latest")
            sb = await ac.create(memory_mb=64, labels=LABEL, env={"E": "1"})
            try:
                assert sb.id in [s.id for s in await ac.list(labels=LABEL)]
                assert (await ac.get(sb.id)).id == sb.id
                r = await sb.exec("echo $E; echo x >&2; exit 2")
                assert (r.exit_code, r.stdout, r.stderr) == (2, "1\n", "x\n")
                assert (await sb.exec(["cat"], stdin=b"\x00\xff")).stdout_bytes == b"\x00\xff"
                assert (await sb.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
                assert (await sb.exec("sleep 600", timeout=0.2)).timed_out
                # "2" only comes once the test, having seen "1", creates /tmp/go-a
                seen = []
                async with sb.exec_stream(f"echo 1; {gate('/tmp/go-a')}; echo 2", collect=True,
                                          timeout=DEADLINE) as s:
                    async for chunk in s:
                        seen.append(chunk.data)
                        if len(seen) == 1:
                            await sb.write_file("/tmp/go-a", b"")
                assert seen == [b"1\n", b"2\n"]
                assert s.result.exit_code == 0 and s.result.stdout == "1\n2\n"
                assert (await sb.exec_stream(["echo", "w"]).wait()).exit_code == 0
                blob = os.urandom(100000)
                assert await sb.write_file("/tmp/r.bin", blob) == len(blob)
                assert await sb.read_file("/tmp/r.bin") == blob
                await sb.write_file("/tmp/r.bin", b"!", append=True)
                assert (await sb.stat("/tmp/r.bin")).size == len(blob) + 1
                await sb.mkdir("/tmp/q/r", parents=True)
                assert [e.name for e in await sb.list_dir("/tmp/q")] == ["r"]
                await sb.remove("/tmp/q", recursive=True)
                with pytest.raises(warren.NotFound):
                    await sb.stat("/tmp/q")
                assert (await sb.pause()).state == "paused"
                assert (await sb.resume()).state == "running"
                assert (await sb.pause()).state == "paused"
                assert (await sb.exec(["true"])).ok  # resumes it first
                assert (await sb.refresh()).state == "running"
                with pytest.raises(warren.InvalidArgument):
                    await sb.exec(["pwd"], cwd="rel")
                with pytest.raises(warren.NotFound):
                    await ac.get("0123456789abcdef")
                with pytest.raises(warren.Timeout):
                    await sb.exec("sleep 600", request_timeout=0.3)
                assert (await sb.exec(["true"])).ok
                img = await sb.pack("sdk-apack:1", timeout=300)
                assert img.name == "sdk-apack:1"
                await ac.images.delete("sdk-apack:1")
                r = await ac.call(["echo", "c"], image="busybox:latest")
                assert r.stdout == "c\n"
                img = await ac.images.tag("busybox:latest", "sdk-atag:1")
                assert img.digest == (await ac.images.get("busybox:latest")).digest
                await ac.images.delete("sdk-atag:1")
                img = await ac.images.build("sdk-abuild:1", "FROM busybox:latest\nRUN true\n",
                                            progress=lambda *a: None, timeout=300)
                await ac.images.delete(img.name)
                with pytest.raises(warren.WarrenError):
                    await ac.images.pull("127.0.0.1:1/x/y:1", insecure=True, timeout=60)
            finally:
                await sb.aclose()
            with pytest.raises(warren.NotFound):
                await ac.get(sb.id)
            async with ac.create(memory_mb=64, labels=LABEL) as sb2:
                assert (await sb2.exec(["echo", "cm"])).stdout == "cm\n"
            with pytest.raises(warren.NotFound):
                await ac.delete(sb2.id)
    asyncio.run(main())
    assert leftover(client) == []


def test_async_cancelled_exec_kills_command(host):
    async def main():
        async with warren.AsyncClient(host) as ac:
            async with ac.create(memory_mb=64, labels=LABEL) as sb:
                task = asyncio.ensure_future(sb.exec("echo $$ > /tmp/cancel.pid; exec sleep 600"))

                async def running():
                    return (await sb.exec("kill -0 $(cat /tmp/cancel.pid)")).exit_code == 0

                # cancel only once the command surely runs (not after a guessed delay)
                deadline = time.monotonic() + DEADLINE
                while not await running():
                    assert not task.done(), task
                    assert time.monotonic() < deadline, "the command never started"
                    await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                deadline = time.monotonic() + DEADLINE
                while await running():
                    assert time.monotonic() < deadline, "the cancelled command still runs"
                    await asyncio.sleep(0.05)
    asyncio.run(main())


def test_async_cancellation_leaves_no_sandbox(host, client):
    async def worker(ac, started):
        async with ac.create(memory_mb=64, labels=dict(LABEL, cancel="1")) as sb:
            started.append(sb.id)
            await sb.exec("sleep 30")

    async def main():
        async with warren.AsyncClient(host) as ac:
            for delay in (0, 0.0005, 0.002, 0.005, 0.01, 0.03, 0.1, 0.5):
                started = []
                tasks = [asyncio.ensure_future(worker(ac, started)) for _ in range(8)]
                await asyncio.sleep(delay)
                for t in tasks:
                    t.cancel()
                res = await asyncio.gather(*tasks, return_exceptions=True)
                assert all(isinstance(r, asyncio.CancelledError) for r in res), res
            # a task cancelled during create: its cleanup finishes in the background
            await ac.drain()
            return True
    assert asyncio.run(main())
    assert [s.id for s in client.list(labels={"cancel": "1"})] == []


def test_500_concurrent_sandboxes_one_loop(host, client):
    n = 500

    async def one(ac, i):
        async with ac.create(memory_mb=32, labels=dict(LABEL, many="1")) as sb:
            r = await sb.exec(["true"])
            return r.exit_code

    threads0 = threading.active_count()

    async def main():
        # a call's deadline includes its wait for one of the 128 connections,
        # i.e. for most of the batch: generous, so only a hang reaches it
        async with warren.AsyncClient(host, max_connections=128, timeout=240) as ac:
            t0 = time.monotonic()
            codes = await asyncio.gather(*[one(ac, i) for i in range(n)])
            return codes, time.monotonic() - t0, ac._t.opened, threading.active_count()

    codes, secs, opened, threads = asyncio.run(main())
    assert codes == [0] * n
    assert opened <= 128, opened  # connections are pooled and bounded
    assert threads <= threads0, threads  # no thread per sandbox
    assert secs < 240, secs  # a hang check only: throughput is `warren bench`'s business
    assert client.list(labels={"many": "1"}) == []
    print(f"{n} sandboxes created, exec'd and deleted in {secs:.1f}s over {opened} connections")


# ---- the rollout example and packaging ----

def test_rollout_example_short(host, client):
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "rollout.py"), "--short",
                        "--json", "--host", host], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    rep = json.loads(r.stdout)
    assert rep["sandboxes"] == 12 and rep["errors"] == []
    assert rep["verifier_agrees"] == rep["sandboxes"]
    for s in rep["samples"]:
        assert s["reward"] == (1.0 if s["good"] else 0.0), s
    assert set(rep["per_task"]) == {"calc", "upper", "countlines"}
    assert rep["sandboxes_per_s"] > 0 and rep["create_ms"]["p50"] > 0
    assert client.list(labels={"rollout": rep["run_id"]}) == []
    assert not [i.name for i in client.images.list() if i.name.startswith("rollout-")]
    # and the human report
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "rollout.py"), "--short",
                        "--host", host], capture_output=True, timeout=300, text=True)
    assert r.returncode == 0 and "throughput:" in r.stdout and "p99" in r.stdout, r.stdout


def test_rollout_interrupted_cleans_up(host, client):
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "examples", "rollout.py"),
                          "--samples", "40", "--host", host],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not client.list() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    live = len(client.list())
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    if live:
        assert p.returncode == 130, (p.returncode, err)
    assert client.list() == []
    assert not [i.name for i in client.images.list() if i.name.startswith("rollout-")]


def test_pip_install_offline(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(REPO, "python"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    r = subprocess.run(["/usr/bin/python3", "-m", "pip", "install", "--no-index",
                        "--no-build-isolation", "--no-deps", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "warren" / "py.typed").exists()
    r = subprocess.run(["/usr/bin/python3", "-c",
                        "import warren, sys; print(warren.__file__, warren.__version__)"],
                       capture_output=True, text=True, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=str(target)))
    assert r.returncode == 0 and str(target) in r.stdout and "0.1.0" in r.stdout, r.stderr


def test_sdk_version_is_the_one_version():
    """One version string: the SDK's is include/warren/version.h's."""
    import re
    import warren
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "include", "warren", "version.h")) as f:
        want = re.search(r'#define WARREN_VERSION "([^"]+)"', f.read()).group(1)
    assert warren.__version__ == want

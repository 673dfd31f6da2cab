"""The E2B-compatible listener (docs/e2b.md): the real `e2b` npm SDK,
unmodified, against warrend --listen-e2b, plus the wire contract checked by
hand (control API codes, Connect envelopes). npm installs the pinned SDK and
vitest (tests/integration/e2b/package.json) into a cache under /var/tmp."""
import base64
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import struct
import subprocess
import threading

import pytest

from conftest import BUILD, need
from wr import Daemon, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "e2b")
API_KEY = "e2b_" + "0" * 40

# SDK tests that cannot pass here, and why (also listed in docs/e2b.md):
# it runs `sudo`, which E2B's base template has and base:bookworm has not.
OUT_OF_SCOPE = {"bash command scoped env vars"}

sys_path = os.path.join(HERE, "sandboxfusion")
import sys  # noqa: E402

sys.path.insert(0, sys_path)
from sfclient import debian_tarball, free_port, sf_daemon  # noqa: E402,F401 (fixture)


def npm_dir():
    """node_modules with the pinned e2b and vitest, installed once per
    package.json (npm's registry is the only network use)."""
    need(shutil.which("node") and shutil.which("npm"), "node and npm are not installed "
         "(scripts/setup.sh installs Debian's nodejs and npm)")
    with open(os.path.join(HARNESS, "package.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    d = "/var/tmp/warren-e2b-npm-" + digest
    if not os.path.exists(os.path.join(d, "node_modules", ".ok")):
        os.makedirs(d, exist_ok=True)
        shutil.copy(os.path.join(HARNESS, "package.json"), d)
        r = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=d,
                           capture_output=True, text=True, timeout=600)
        need(r.returncode == 0, "npm install of the e2b SDK failed: " + r.stderr[-400:])
        open(os.path.join(d, "node_modules", ".ok"), "w").close()
    # the harness files are copied fresh each run
    for name in ("smoke.mjs", "vitest.config.mjs"):
        shutil.copy(os.path.join(HARNESS, name), d)
    shutil.rmtree(os.path.join(d, "sdk"), ignore_errors=True)
    shutil.copytree(os.path.join(HARNESS, "sdk"), os.path.join(d, "sdk"))
    return d


@pytest.fixture(scope="module")
def e2b():
    need(os.geteuid() == 0, "container tests need root")
    tarball = debian_tarball()
    for attempt in range(5):
        port = free_port()
        d = Daemon(os.path.abspath(BUILD), extra_args=[
            "--listen-e2b", "tcp:127.0.0.1:%d" % port, "--default-image", "base:bookworm"])
        try:
            d.start()
            break
        except RuntimeError as e:
            shutil.rmtree(d.root, ignore_errors=True)
            if "in use" not in str(e) or attempt == 4:
                raise
    r = d.api.raw("POST", "/v1/images/import", {"name": "base:bookworm", "path": tarball},
                  timeout=600)
    assert r.status == 201, r
    yield d, port
    left = d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"]
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)
    assert left == [], "sandboxes left behind: %r" % left


def node_env(port):
    url = "http://127.0.0.1:%d" % port
    env = dict(os.environ, E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=API_KEY)
    env.pop("E2B_DEBUG", None)
    return env


def request(port, method, path, body=None, headers=None, raw=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        h = {"X-API-Key": API_KEY}
        h.update(headers or {})
        data = body if raw or body is None else json.dumps(body)
        if body is not None and not raw:
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        out = r.read()
        if raw:
            return r.status, out, r.getheader("Content-Type")
        return r.status, (json.loads(out) if out else None)
    finally:
        c.close()


def envelopes(data):
    out = []
    while data:
        flags, n = struct.unpack(">BI", data[:5])
        out.append((flags, json.loads(data[5:5 + n])))
        data = data[5 + n:]
    return out


def test_sdk_smoke(e2b):
    """create, run (stdout, stderr, exit code), write/read, list, kill."""
    d, port = e2b
    nd = npm_dir()
    r = subprocess.run(["node", "smoke.mjs"], cwd=nd, env=node_env(port), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True


def test_sdk_own_tests(e2b):
    """The SDK's own command and filesystem test files (e2b/sdk/README.md)."""
    d, port = e2b
    nd = npm_dir()
    report = os.path.join(nd, "report.json")
    r = subprocess.run(["node", "node_modules/vitest/vitest.mjs", "run", "--reporter=json",
                        "--outputFile=" + report], cwd=nd, env=node_env(port),
                       capture_output=True, text=True, timeout=600)
    with open(report) as f:
        rep = json.load(f)
    results = [(t["title"], t["status"], " ".join(t.get("failureMessages", []))[:300])
               for f in rep["testResults"] for t in f["assertionResults"]]
    passed = {t for t, s, _ in results if s == "passed"}
    failed = [(t, m) for t, s, m in results if s == "failed" and t not in OUT_OF_SCOPE]
    assert not failed, (failed, r.stderr[-2000:])
    for must in ("run", "kill process", "list processes", "connect to process",
                 "send stdin to process", "close stdin via command handle",
                 "run with too short timeout", "write multiple files", "read file as stream",
                 "list directory", "make existing directory", "rename file", "remove file",
                 "file exists",
                 # directory watching (inotify in the sandbox's agent)
                 "watch directory changes", "watch recursive directory changes",
                 "watch recursive directory after nested folder addition",
                 "watch directory changes with entry info", "watch non-existing directory",
                 "watch file",
                 # PTYs (the agent's tty execs, resized by a SIGNAL frame)
                 "create PTY", "resize", "send input", "pty connect/reconnect", "kill PTY",
                 "write ReadableStream with octet stream upload and gzip",
                 # the account "user" (files and commands are theirs)
                 "get info of a file", "get info of a directory", "file entry details",
                 "directory entry details", "mixed entries (files and directories)",
                 # envVars.test.ts (vitest 4's test.override)
                 "sandbox global env vars", "python command scoped env vars"):
        assert must in passed, (must, sorted(passed))
    n_passed = sum(1 for _, s, _ in results if s == "passed")
    assert n_passed >= 73, sorted(passed)


def test_control_api_contract(e2b):
    d, port = e2b
    st, sb = request(port, "POST", "/sandboxes",
                     {"templateID": "base", "timeout": 60, "metadata": {"who": "contract"}})
    assert st == 201, sb
    sid = sb["sandboxID"]
    assert sb["templateID"] == "base" and sb["envdVersion"]
    try:
        st, got = request(port, "GET", "/sandboxes/" + sid)
        assert st == 200 and got["metadata"] == {"who": "contract"} and got["state"] == "running"
        # timeout = Warren's TTL
        assert request(port, "POST", "/sandboxes/%s/timeout" % sid, {"timeout": 3600})[0] == 204
        w = d.api.raw("GET", "/v1/sandboxes/" + sid).json()
        assert w["expires_at"] - w["created_at"] > 3000
        st, lst = request(port, "GET", "/v2/sandboxes?metadata=who%3Dcontract")
        assert st == 200 and [s["sandboxID"] for s in lst] == [sid]
        st, lst = request(port, "GET", "/v2/sandboxes?metadata=who%3Dnobody")
        assert st == 200 and lst == []
        # pause twice: 409 the second time; connect resumes
        assert request(port, "POST", "/sandboxes/%s/pause" % sid)[0] == 204
        assert request(port, "POST", "/sandboxes/%s/pause" % sid)[0] == 409
        assert request(port, "GET", "/sandboxes/" + sid)[1]["state"] == "paused"
        st, c = request(port, "POST", "/sandboxes/%s/connect" % sid, {"timeout": 60})
        assert st == 201 and c["state"] == "running"
        # envd: a Connect server stream with envelopes, ended by flag 0x02
        msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; exit 7"]},
                          "stdin": False}).encode()
        st, body, ctype = request(port, "POST", "/process.Process/Start",
                                  struct.pack(">BI", 0, len(msg)) + msg,
                                  {"E2b-Sandbox-Id": sid,
                                   "Content-Type": "application/connect+json"}, raw=True)
        assert st == 200 and ctype == "application/connect+json"
        ev = envelopes(body)
        assert "start" in ev[0][1]["event"]
        assert ev[-1] == (2, {})
        end = [e["event"]["end"] for f, e in ev if f == 0 and "end" in e["event"]]
        assert end and end[0]["exitCode"] == 7
        # a unary call with an unknown process: a Connect error body
        st, err = request(port, "POST", "/process.Process/SendSignal",
                          {"process": {"pid": 424242}, "signal": "SIGNAL_SIGKILL"},
                          {"E2b-Sandbox-Id": sid})
        assert st == 404 and err["code"] == "not_found"
        assert request(port, "GET", "/health", headers={"E2b-Sandbox-Id": sid})[0] == 204
    finally:
        assert request(port, "DELETE", "/sandboxes/" + sid)[0] == 204
    assert request(port, "GET", "/sandboxes/" + sid)[0] == 404
    assert request(port, "DELETE", "/sandboxes/" + sid)[0] == 404
    wait_for(lambda: d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == [],
             what="the sandbox is gone")


@contextlib.contextmanager
def e2b_sandbox(port):
    """A sandbox of the control API for a test: (id, envd headers); killed
    at the end."""
    st, sb = request(port, "POST", "/sandboxes", {"templateID": "base", "timeout": 120})
    assert st == 201, sb
    try:
        yield sb["sandboxID"], {"E2b-Sandbox-Id": sb["sandboxID"]}
    finally:
        assert request(port, "DELETE", "/sandboxes/" + sb["sandboxID"])[0] == 204


def start_process(port, sid, cmd, user=None):
    """process.Process/Start by hand: (exit code, stdout)."""
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]},
                      "stdin": False}).encode()
    h = {"E2b-Sandbox-Id": sid, "Content-Type": "application/connect+json"}
    if user:
        h["Authorization"] = "Basic " + base64.b64encode((user + ":").encode()).decode()
    st, body, _ = request(port, "POST", "/process.Process/Start",
                          struct.pack(">BI", 0, len(msg)) + msg, h, raw=True)
    assert st == 200
    out, code = b"", None
    for flags, e in envelopes(body):
        ev = e.get("event", {})
        out += base64.b64decode(ev.get("data", {}).get("stdout", ""))
        if "end" in ev:
            code = ev["end"].get("exitCode", 0)
    return code, out.decode()


def test_user_account(e2b):
    """Commands and files are the account "user"'s (provisioned at create
    when the image lacks it), root's with `Authorization: Basic root:`."""
    d, port = e2b
    with e2b_sandbox(port) as (sid, h):
        code, out = start_process(port, sid, "id -un; echo $HOME; pwd; touch made; stat -c %U made")
        assert code == 0 and out.split() == ["user", "/home/user", "/home/user", "user"], out
        code, out = start_process(port, sid, "id -un; echo $HOME; pwd", user="root")
        assert code == 0 and out.split() == ["root", "/root", "/root"], out
        # /files writes as the user (parents too); ?username=root as root
        st, _, _ = request(port, "POST", "/files?path=a/b/c.txt", b"x",
                           dict(h, **{"Content-Type": "application/octet-stream"}), raw=True)
        assert st == 200
        st, _, _ = request(port, "POST", "/files?path=/tmp/r.txt&username=root", b"x",
                           dict(h, **{"Content-Type": "application/octet-stream"}), raw=True)
        assert st == 200
        code, out = start_process(port, sid, "stat -c %U:%G a a/b a/b/c.txt /tmp/r.txt")
        assert out.split() == ["user:user"] * 3 + ["root:root"], out
        st, e = request(port, "POST", "/filesystem.Filesystem/Stat", {"path": "a/b/c.txt"}, h)
        assert st == 200 and (e["entry"]["owner"], e["entry"]["group"]) == ("user", "user"), e
        st, e = request(port, "POST", "/filesystem.Filesystem/MakeDir", {"path": "m"}, h)
        assert st == 200 and e["entry"]["owner"] == "user", e


def test_stream_input(e2b):
    """StreamInput (client streaming) over HTTP/1.1: the whole stream is one
    request body; its input reaches the process when the body ends."""
    d, port = e2b
    with e2b_sandbox(port) as (sid, h):
        msg = json.dumps({"process": {"cmd": "/bin/cat"}, "stdin": True, "tag": "si"}).encode()
        res = {}
        t = threading.Thread(target=lambda: res.update(r=request(
            port, "POST", "/process.Process/Start", struct.pack(">BI", 0, len(msg)) + msg,
            dict(h, **{"Content-Type": "application/connect+json"}), raw=True)))
        t.start()
        procs = wait_for(lambda: request(port, "POST", "/process.Process/List", {}, h)[1]
                         ["processes"], what="the process is listed")
        pid = procs[0]["pid"]

        def env(m):
            b = json.dumps(m).encode()
            return struct.pack(">BI", 0, len(b)) + b
        data = base64.b64encode(b"hello stream\n").decode()
        body = (env({"start": {"process": {"pid": pid}}}) + env({"keepalive": {}})
                + env({"data": {"input": {"stdin": data}}}))
        st, out, ctype = request(port, "POST", "/process.Process/StreamInput", body,
                                 dict(h, **{"Content-Type": "application/connect+json"}),
                                 raw=True)
        assert st == 200 and envelopes(out) == [(0, {}), (2, {})], out
        # without a start event, or for an unknown process: an end-of-stream error
        st, out, _ = request(port, "POST", "/process.Process/StreamInput",
                             env({"start": {"process": {"pid": 999999}}}),
                             dict(h, **{"Content-Type": "application/connect+json"}), raw=True)
        assert st == 200 and envelopes(out)[-1][1]["error"]["code"] == "not_found", out
        assert request(port, "POST", "/process.Process/CloseStdin",
                       {"process": {"pid": pid}}, h)[0] == 200
        t.join(60)
        st, body, _ = res["r"]
        outb = b"".join(base64.b64decode(e["event"]["data"].get("stdout", ""))
                        for f, e in envelopes(body) if f == 0 and "data" in e.get("event", {}))
        assert outb == b"hello stream\n", envelopes(body)


def test_watchdir_stream(e2b):
    """WatchDir by hand: the start message, keepalives at the asked interval,
    then the change; the watch ends with the client's connection."""
    d, port = e2b
    with e2b_sandbox(port) as (sid, h):
        assert request(port, "POST", "/filesystem.Filesystem/MakeDir", {"path": "ws"}, h)[0] == 200
        msg = json.dumps({"path": "ws"}).encode()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/filesystem.Filesystem/WatchDir", struct.pack(">BI", 0, len(msg)) + msg,
                  dict(h, **{"Content-Type": "application/connect+json",
                             "Keepalive-Ping-Interval": "1"}))
        r = c.getresponse()
        assert r.status == 200

        def message():
            flags, n = struct.unpack(">BI", r.read(5))
            return flags, json.loads(r.read(n))
        assert message() == (0, {"start": {}})
        assert message() == (0, {"keepalive": {}})
        st, _, _ = request(port, "POST", "/files?path=ws/new.txt", b"x",
                           dict(h, **{"Content-Type": "application/octet-stream"}), raw=True)
        assert st == 200
        got = []
        while not any(m.get("filesystem", {}).get("type") == "EVENT_TYPE_WRITE" for m in got):
            flags, m = message()
            assert flags == 0, m
            got.append(m)
        fs = [m["filesystem"] for m in got if "filesystem" in m]
        assert fs[0] == {"name": "new.txt", "type": "EVENT_TYPE_CREATE"}, got
        c.close()
        # a missing directory: the stream's end carries not_found
        msg = json.dumps({"path": "nope"}).encode()
        st, body, _ = request(port, "POST", "/filesystem.Filesystem/WatchDir",
                              struct.pack(">BI", 0, len(msg)) + msg,
                              dict(h, **{"Content-Type": "application/connect+json"}), raw=True)
        assert st == 200 and envelopes(body)[-1][1]["error"]["code"] == "not_found", body


def test_watcher_polling(e2b):
    """CreateWatcher / GetWatcherEvents / RemoveWatcher (the polling form of
    WatchDir that E2B's synchronous SDKs use), recursive, by hand."""
    d, port = e2b
    with e2b_sandbox(port) as (sid, h):
        st, r = request(port, "POST", "/filesystem.Filesystem/MakeDir", {"path": "wd/sub"}, h)
        assert st == 200, r
        st, w = request(port, "POST", "/filesystem.Filesystem/CreateWatcher",
                        {"path": "wd", "recursive": True}, h)
        assert st == 200 and w["watcherId"], w
        wid = w["watcherId"]
        st, _, _ = request(port, "POST", "/files?path=wd/sub/a.txt", b"hello",
                           dict(h, **{"Content-Type": "application/octet-stream"}), raw=True)
        assert st == 200
        seen = []

        def got_write():
            st2, ev = request(port, "POST", "/filesystem.Filesystem/GetWatcherEvents",
                              {"watcherId": wid}, h)
            assert st2 == 200, ev
            seen.extend(ev.get("events", []))
            return {"name": "sub/a.txt", "type": "EVENT_TYPE_WRITE"} in seen

        wait_for(got_write, what="a WRITE event of sub/a.txt")
        assert {"name": "sub/a.txt", "type": "EVENT_TYPE_CREATE"} in seen, seen
        # fetched events are gone; a removal shows up next
        request(port, "POST", "/filesystem.Filesystem/Remove", {"path": "wd/sub/a.txt"}, h)
        seen.clear()

        def got_remove():
            st2, ev = request(port, "POST", "/filesystem.Filesystem/GetWatcherEvents",
                              {"watcherId": wid}, h)
            seen.extend(ev.get("events", []))
            return {"name": "sub/a.txt", "type": "EVENT_TYPE_REMOVE"} in seen

        wait_for(got_remove, what="a REMOVE event of sub/a.txt")
        assert all(e["name"] == "sub/a.txt" for e in seen), seen
        st, r = request(port, "POST", "/filesystem.Filesystem/RemoveWatcher", {"watcherId": wid}, h)
        assert st == 200, r
        st, r = request(port, "POST", "/filesystem.Filesystem/GetWatcherEvents",
                        {"watcherId": wid}, h)
        assert st == 404 and r["code"] == "not_found", r
        # a missing path is not_found
        st, r = request(port, "POST", "/filesystem.Filesystem/CreateWatcher", {"path": "nope"}, h)
        assert st == 404 and r["code"] == "not_found", r


def test_sdk_on_the_compat_listener(sf_daemon):
    """--listen-compat serves E2B next to SandboxFusion on one port."""
    d, sf = sf_daemon
    nd = npm_dir()
    env = dict(node_env(sf.port), WARREN_E2B_TEMPLATE="base:bookworm")
    r = subprocess.run(["node", "smoke.mjs"], cwd=nd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True
    res = sf.run_code(code="print(1)")
    assert res["status"] == "Success" and res["run_result"]["stdout"] == "1\n", res
    assert d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


def test_sdk_on_a_tokened_compat_port():
    """A compat port with --compat-token-file admits the SDK by its API key
    (X-API-Key, then X-Access-Token on envd requests); a wrong key is 401."""
    need(os.geteuid() == 0, "container tests need root")
    tarball = debian_tarball()
    token = "e2b_" + "7" * 40
    root_tok = "/var/tmp/wr-e2b-token-%d" % os.getpid()
    with open(root_tok, "w") as f:
        f.write(token + "\n")
    port = free_port()
    d = Daemon(os.path.abspath(BUILD), extra_args=[
        "--listen-compat", "tcp:127.0.0.1:%d" % port, "--compat-token-file", root_tok])
    try:
        d.start()
        r = d.api.raw("POST", "/v1/images/import", {"name": "base:bookworm", "path": tarball},
                      timeout=600)
        assert r.status == 201, r
        nd = npm_dir()
        env = dict(node_env(port), E2B_API_KEY=token, WARREN_E2B_TEMPLATE="base:bookworm")
        r = subprocess.run(["node", "smoke.mjs"], cwd=nd, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True
        env["E2B_API_KEY"] = "e2b_" + "8" * 40
        r = subprocess.run(["node", "smoke.mjs"], cwd=nd, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode != 0 and ("401" in r.stderr or "Unauthorized" in r.stderr
                                      or "AuthenticationError" in r.stderr), r.stderr[-500:]
        assert d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)
        os.unlink(root_tok)


"""The trajectory log, step ids and replay (docs/rl.md): ordering and content
of the log, survival across kill -9 of warrend, step-id dedup of a
non-idempotent command, retention reaping, replay --until, and the CLI and
Python SDK round trips."""
import hashlib
import json
import os
import shutil
import sys

import pytest

from conftest import start_daemon
from wr import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import warren  # noqa: E402


def log(api, sid, status=200):
    r = api.raw("GET", f"/v1/sandboxes/{sid}/log")
    assert r.status == status, r
    return r.json()


def execute(api, sid, shell, **kw):
    return api.raw("POST", f"/v1/sandboxes/{sid}/exec", dict(kw, shell=shell), timeout=180)


def put(api, sid, path, data, step=None):
    q = f"path={path}" + (f"&step={step}" if step else "")
    return api.raw("PUT", f"/v1/sandboxes/{sid}/files?{q}", data)


def read(api, sid, path):
    r = api.raw("GET", f"/v1/sandboxes/{sid}/files?path={path}")
    assert r.status == 200, r
    return r.body


def test_log_order_and_content(api):
    sid = api.create()
    big = 100_000  # over the 64 KiB kept for an exec without a step id
    try:
        assert api.sh(sid, "echo hello; echo oops >&2")["exit_code"] == 0
        assert api.sh(sid, "exit 3")["exit_code"] == 3
        assert api.sh(sid, f"head -c {big} /dev/zero | tr '\\0' a")["exit_code"] == 0
        assert put(api, sid, "/tmp/data", b"\x00\x01bytes").status == 201
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pause").status == 200
        assert api.raw("POST", f"/v1/sandboxes/{sid}/resume").status == 200
    finally:
        assert api.delete(sid).status == 204
    j = log(api, sid)  # the sandbox is gone; its log is not
    assert j["id"] == sid and j["image"] == "busybox:latest" and j["destroyed_at"]
    kinds = [e["kind"] for e in j["events"]]
    assert kinds == ["create", "exec", "exec", "exec", "file", "pause", "resume", "destroy"], kinds
    seqs = [e["seq"] for e in j["events"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    hello, fail, large, wr = j["events"][1:5]
    assert hello["request"]["shell"] == "echo hello; echo oops >&2"
    assert hello["result"]["stdout"] == "hello\n" and hello["result"]["stderr"] == "oops\n"
    assert hello["result"]["stdout_sha256"] == hashlib.sha256(b"hello\n").hexdigest()
    assert hello["result"]["exit_code"] == 0 and "duration_ms" in hello["result"]
    assert "usage" in hello["result"]
    assert fail["result"]["exit_code"] == 3
    # output over the cap: kept up to 64 KiB, hashed whole
    assert large["result"]["stdout_bytes"] == big
    assert large["result"]["stdout_sha256"] == hashlib.sha256(b"a" * big).hexdigest()
    assert large["result"]["stdout_log_truncated"] is True
    assert len(large["result"]["stdout"]) == 64 * 1024
    assert wr["request"]["op"] == "write" and wr["request"]["path"] == "/tmp/data"
    assert wr["request"]["sha256"] == hashlib.sha256(b"\x00\x01bytes").hexdigest()
    assert wr["result"]["status"] == 201
    assert log(api, "0" * 32, status=404)["error"]["code"] == "not_found"


def test_step_dedup_runs_once(api):
    sid = api.create()
    try:
        first = execute(api, sid, "echo x >> /tmp/f; wc -l < /tmp/f", step="s1")
        assert first.status == 200 and first.json()["stdout"].strip() == "1"
        assert first.json().get("replayed") is not True
        again = execute(api, sid, "echo x >> /tmp/f; wc -l < /tmp/f", step="s1")
        assert again.status == 200, again
        assert again.json()["replayed"] is True and again.json()["stdout"].strip() == "1"
        assert read(api, sid, "/tmp/f") == b"x\n"  # appended once
        # streamed, the recorded answer comes back as the same NDJSON lines
        s = execute(api, sid, "echo x >> /tmp/f; wc -l < /tmp/f", step="s1", stream=True)
        lines = [json.loads(x) for x in s.body.splitlines()]
        assert lines[0] == {"stream": "stdout", "data": "1\n"}
        assert lines[-1]["replayed"] is True and lines[-1]["exit_code"] == 0
        # the same step with another request is a conflict
        other = execute(api, sid, "echo y >> /tmp/f", step="s1")
        assert other.status == 409 and other.json()["error"]["code"] == "conflict"
        assert read(api, sid, "/tmp/f") == b"x\n"
        # file writes take a step too
        assert put(api, sid, "/tmp/w", b"one", step="w1").status == 201
        assert api.sh(sid, "echo changed > /tmp/w")["exit_code"] == 0
        r = put(api, sid, "/tmp/w", b"one", step="w1")
        assert r.status == 201 and r.json()["replayed"] is True
        assert read(api, sid, "/tmp/w") == b"changed\n"  # not written again
        assert put(api, sid, "/tmp/w", b"two", step="w1").status == 409
        steps = [e["step"] for e in log(api, sid)["events"] if e["step"]]
        assert steps == ["s1", "w1"]  # repeats are answered, not logged again
    finally:
        api.delete(sid)


def test_log_and_steps_survive_kill9(rootfs):
    d = start_daemon(rootfs)
    try:
        sid = d.api.create()
        r = execute(d.api, sid, "echo x >> /tmp/f; cat /tmp/f", step="k1")
        assert r.status == 200 and r.json()["stdout"] == "x\n"
        d.kill9()
        d.start()
        again = execute(d.api, sid, "echo x >> /tmp/f; cat /tmp/f", step="k1")
        assert again.status == 200 and again.json()["replayed"] is True
        assert again.json()["stdout"] == "x\n"
        assert read(d.api, sid, "/tmp/f") == b"x\n"
        kinds = [e["kind"] for e in log(d.api, sid)["events"]]
        assert kinds == ["create", "exec"], kinds
        assert d.api.delete(sid).status == 204
        assert [e["kind"] for e in log(d.api, sid)["events"]][-1] == "destroy"
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_retention_reaps_logs_of_destroyed_sandboxes(rootfs):
    d = start_daemon(rootfs, ["--log-retention", "1"])
    try:
        live = d.api.create()
        gone = d.api.create()
        d.api.sh(gone, "true")
        assert d.api.delete(gone).status == 204
        assert log(d.api, gone)["log_expires_at"] is not None
        wait_for(lambda: d.api.raw("GET", f"/v1/sandboxes/{gone}/log").status == 404,
                 what="the destroyed sandbox's log reaped after its retention")
        # a live sandbox's log is kept however old
        assert log(d.api, live)["events"][0]["kind"] == "create"
        assert d.api.delete(live).status == 204
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def replay(api, sid, until=None, status=201):
    r = api.raw("POST", f"/v1/sandboxes/{sid}/replay", {"until": until} if until else {},
                timeout=300)
    assert r.status == status, r
    return r.json()


def test_replay_until(api):
    sid = api.create()
    news = []
    try:
        assert execute(api, sid, "echo 1 > /tmp/f", step="a").status == 200
        assert put(api, sid, "/tmp/g", b"hello", step="b").status == 201
        assert execute(api, sid, "echo 2 >> /tmp/f", step="c").status == 200
        assert execute(api, sid, "cat /proc/sys/kernel/random/uuid", step="d").status == 200
        assert api.delete(sid).status == 204  # replay works from the log alone
        j = replay(api, sid, until="b")
        new = j["id"]
        news.append(new)
        assert new != sid and j["replay"]["of"] == sid and j["replay"]["events"] == 2
        assert j["replay"]["diverged"] == 0
        assert read(api, new, "/tmp/f") == b"1\n" and read(api, new, "/tmp/g") == b"hello"
        # steps up to b answer from the log, later ones run live
        r = execute(api, new, "echo 1 > /tmp/f", step="a")
        assert r.json()["replayed"] is True
        r = execute(api, new, "echo 3 >> /tmp/f", step="c2")
        assert r.status == 200 and r.json().get("replayed") is not True
        assert read(api, new, "/tmp/f") == b"1\n3\n"
        nlog = log(api, new)
        assert nlog["replay_of"] == sid
        assert [e.get("replayed_from") is not None for e in nlog["events"]][:3] == [False, True, True]
        # everything: the random read diverges, the rest does not
        full = replay(api, sid)
        news.append(full["id"])
        assert full["replay"]["events"] == 4 and full["replay"]["diverged"] == 1
        assert read(api, full["id"], "/tmp/f") == b"1\n2\n"
        replay(api, sid, until="nope", status=404)
    finally:
        for n in news:
            api.delete(n)


def checkpoint(api, sid, name):
    r = api.raw("POST", f"/v1/sandboxes/{sid}/checkpoints", {"name": name}, timeout=120)
    assert r.status == 201, r
    return r.json()


def test_replay_from_nearest_checkpoint(api):
    """replay --until STEP starts from the latest checkpoint taken (or
    restored) at or before STEP: what came before is not re-run."""
    sid = api.create()
    news = []
    try:
        assert execute(api, sid, "cat /proc/sys/kernel/random/uuid > /tmp/id; echo 1 > /tmp/f",
                       step="a").status == 200
        orig_id = read(api, sid, "/tmp/id")
        checkpoint(api, sid, "c1")
        assert execute(api, sid, "echo 2 >> /tmp/f", step="b").status == 200
        checkpoint(api, sid, "c2")
        assert execute(api, sid, "echo 3 >> /tmp/f", step="c").status == 200
        kinds = [e["kind"] for e in log(api, sid)["events"]]
        assert kinds == ["create", "exec", "checkpoint", "exec", "checkpoint", "exec"], kinds
        ck = [e for e in log(api, sid)["events"] if e["kind"] == "checkpoint"]
        assert ck[0]["result"]["name"] == "c1" and ck[0]["result"]["digest"].startswith("sha256:")

        j = replay(api, sid, until="b")
        news.append(j["id"])
        assert j["replay"]["checkpoint"] == "c1", j["replay"]
        assert j["replay"]["events"] == 2 and j["replay"]["rerun"] == 1, j["replay"]
        # step a came from the checkpoint, not from running it again
        assert read(api, j["id"], "/tmp/id") == orig_id
        assert read(api, j["id"], "/tmp/f") == b"1\n2\n"
        assert execute(api, j["id"], "cat /proc/sys/kernel/random/uuid > /tmp/id; echo 1 > /tmp/f",
                       step="a").json()["replayed"] is True
        ev = [e for e in log(api, j["id"])["events"] if e["kind"] == "exec"]
        assert ev[0]["rerun"] == {"from_checkpoint": "c1"} and ev[1]["rerun"]["same"] is True

        # a checkpoint after the step is not used
        j = replay(api, sid, until="a")
        news.append(j["id"])
        assert j["replay"]["checkpoint"] is None and j["replay"]["rerun"] == 1
        assert read(api, j["id"], "/tmp/id") != orig_id

        # the latest one wins; everything after it re-runs
        j = replay(api, sid)
        news.append(j["id"])
        assert j["replay"]["checkpoint"] == "c2" and j["replay"]["rerun"] == 1
        assert read(api, j["id"], "/tmp/f") == b"1\n2\n3\n"

        # a restore is a starting point too: the state after it is c1's
        r = api.raw("POST", f"/v1/sandboxes/{sid}/restore", {"name": "c1"}, timeout=120)
        assert r.status == 200, r
        assert execute(api, sid, "echo 4 >> /tmp/f", step="d").status == 200
        assert read(api, sid, "/tmp/f") == b"1\n4\n"
        j = replay(api, sid, until="d")
        news.append(j["id"])
        assert j["replay"]["checkpoint"] == "c1" and j["replay"]["rerun"] == 1, j["replay"]
        assert read(api, j["id"], "/tmp/f") == b"1\n4\n"
        assert read(api, j["id"], "/tmp/id") == orig_id

        # once the sandbox and its checkpoints are gone, a log that restores
        # one cannot be rebuilt past the restore; before it, from the image
        assert api.delete(sid).status == 204
        replay(api, sid, until="d", status=409)
        j = replay(api, sid, until="c")
        news.append(j["id"])
        assert j["replay"]["checkpoint"] is None and j["replay"]["rerun"] == 3
        assert read(api, j["id"], "/tmp/f") == b"1\n2\n3\n"
    finally:
        for n in news:
            api.delete(n)
        api.delete(sid)


def test_cli_log_and_replay(daemon):
    api = daemon.api
    sid = api.create()
    new = None
    try:
        one = ["sh", "-c", "echo 1 > /tmp/f"]
        daemon.cli("exec", "--step", "one", sid, "--", *one, check=True)
        daemon.cli("exec", "--step", "two", sid, "--", "sh", "-c", "echo 2 >> /tmp/f", check=True)
        r = daemon.cli("log", sid, "--json", check=True)
        j = json.loads(r.stdout)
        assert [e["kind"] for e in j["events"]] == ["create", "exec", "exec"]
        r = daemon.cli("log", sid, check=True)
        text = r.stdout.decode()
        assert "create" in text and "one" in text and "echo 2 >> /tmp/f" in text
        r = daemon.cli("replay", sid, "--until", "one", check=True)
        new = r.stdout.decode().strip()
        assert new != sid
        assert read(api, new, "/tmp/f") == b"1\n"
        daemon.cli("exec", "--step", "one", new, "--", *one, check=True)
        daemon.cli("exec", new, "--", "sh", "-c", "echo 3 >> /tmp/f", check=True)
        daemon.cli("exec", "--step", "one", new, "--", *one, check=True)  # not run again
        assert read(api, new, "/tmp/f") == b"1\n3\n"
        r = daemon.cli("exec", "--step", "one", new, "--", "sh", "-c", "echo other")
        assert r.returncode == 125 and b"already used with a different request" in r.stderr
        assert daemon.cli("log", "0" * 32).returncode == 1
    finally:
        api.delete(sid)
        if new:
            api.delete(new)


def test_sdk_log_steps_and_replay(daemon):
    with warren.Client("unix:" + daemon.sock) as c:
        with c.create() as sb:
            r1 = sb.exec("echo x >> /tmp/f; cat /tmp/f", step="p1")
            assert r1.stdout == "x\n" and not r1.replayed
            r2 = sb.exec("echo x >> /tmp/f; cat /tmp/f", step="p1")
            assert r2.replayed and r2.stdout == "x\n"
            sb.write_file("/tmp/w", b"data", step="p2")
            assert sb.write_file("/tmp/w", b"data", step="p2") == 4
            with pytest.raises(warren.Conflict):
                sb.exec("echo other", step="p1")
            lg = sb.log()
            assert [e["kind"] for e in lg["events"]] == ["create", "exec", "file"]
            with c.replay(sb.id, until="p1") as nb:
                assert nb.read_file("/tmp/f") == b"x\n"
                assert nb.exec("echo x >> /tmp/f; cat /tmp/f", step="p1").replayed
                assert c.log(nb.id)["replay_of"] == sb.id


def test_microvm_steps_log_and_replay(rootfs):
    """The log lives above the backend interface: the same on a microVM."""
    from test_vm import kernel_release, vm_daemon
    d = vm_daemon(rootfs)
    try:
        sid = d.api.create(backend="microvm", memory_mb=192)
        cmd = "uname -r; echo x >> /tmp/f"
        r = execute(d.api, sid, cmd, step="v1")
        assert r.status == 200 and r.json()["stdout"] == kernel_release() + "\n"
        again = execute(d.api, sid, cmd, step="v1")
        assert again.json()["replayed"] is True
        assert read(d.api, sid, "/tmp/f") == b"x\n"
        new = replay(d.api, sid, until="v1")["id"]
        assert read(d.api, new, "/tmp/f") == b"x\n"
        assert d.api.raw("GET", f"/v1/sandboxes/{new}").json()["backend"] == "microvm"
        for s in (sid, new):
            assert d.api.delete(s).status == 204
        assert [e["kind"] for e in log(d.api, sid)["events"]] == ["create", "exec", "destroy"]
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

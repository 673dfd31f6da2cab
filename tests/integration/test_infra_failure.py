"""Infra failure or task failure on every result (issue 14 item 1).

Each cause for real: the sandbox's agent killed mid-exec and the daemon killed
mid-request are the platform's (infra_failure true, warren.InfraError, CLI
exit 75); exit 3, the task's own timeout and an OOM inside the task's memory
limit are the task's (a result with infra_failure false); a create over
WARREN_MAX_SANDBOXES is 429 and the platform's; a bad request is the
caller's."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import BUILD, start_daemon
from wr import Daemon, wait_for

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import warren  # noqa: E402

INFRA_EXIT = 75  # EX_TEMPFAIL: docs/cli.md


def cli(daemon, *args, timeout=120):
    env = dict(os.environ, WARREN_HOST="unix:" + daemon.sock)
    return subprocess.Popen([os.path.join(os.path.abspath(BUILD), "bin", "warren")] + list(args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def agent_pid(api, sid):
    r = api.raw("GET", f"/v1/sandboxes/{sid}")
    assert r.status == 200, r
    return r.json()["pid"]


def running(api, sid, marker):
    """Is a process whose argv holds marker running in the sandbox?"""
    r = api.sh(sid, f"ps -o args | grep -v grep | grep -c {marker} || true")
    return r["stdout"].strip() not in ("", "0")


# ---- task failures: results, infra_failure false ----

def test_exit_code_is_the_tasks(api, sandbox, daemon):
    r = api.sh(sandbox, "exit 3")
    assert r["exit_code"] == 3 and r["infra_failure"] is False, r
    p = daemon.cli("exec", sandbox, "--", "sh", "-c", "exit 3")
    assert p.returncode == 3, p
    with warren.Client("unix:" + daemon.sock) as c:
        res = c.sandbox(sandbox).exec("exit 3")
        assert res.exit_code == 3 and res.infra_failure is False


def test_task_timeout_is_the_tasks(api, sandbox):
    r = api.exec(sandbox, ["sleep", "30"], timeout_s=1)
    assert r["timed_out"] is True and r["infra_failure"] is False, r


def test_oom_in_own_limit_is_the_tasks(api):
    sid = api.create(memory_mb=32)
    try:
        # dd touches its whole 128 MiB block: killed by the sandbox's own limit
        r = api.sh(sid, "dd if=/dev/zero of=/dev/null bs=128M count=1")
        assert r["usage"]["oom_killed"] is True, r
        assert r["exit_code"] != 0 and r["infra_failure"] is False, r
    finally:
        api.delete(sid)


def test_file_results_say_task(api, sandbox):
    r = api.raw("PUT", f"/v1/sandboxes/{sandbox}/files?path=/tmp/x", b"hi")
    assert r.status == 201 and r.json()["infra_failure"] is False, r
    r = api.raw("GET", f"/v1/sandboxes/{sandbox}/files?path=/tmp/x&op=stat")
    assert r.status == 200 and r.json()["infra_failure"] is False, r
    r = api.raw("GET", f"/v1/sandboxes/{sandbox}/files?path=/nonexistent&op=stat")
    assert r.status == 404 and r.json()["infra_failure"] is False, r


def test_bad_request_is_the_callers(api, daemon):
    r = api.raw("POST", "/v1/sandboxes", {"memory_mb": "lots"})
    assert r.status == 400 and r.json()["infra_failure"] is False, r
    r = api.raw("GET", "/v1/sandboxes/0000000000000000")
    assert r.status == 404 and r.json()["infra_failure"] is False, r
    p = daemon.cli("rm", "0000000000000000")
    assert p.returncode == 1, p
    with warren.Client("unix:" + daemon.sock) as c:
        with pytest.raises(warren.TaskError) as ei:
            c.get("0000000000000000")
        assert isinstance(ei.value, warren.NotFound) and not ei.value.infra_failure


def test_create_result_says_task(api):
    r = api.raw("POST", "/v1/sandboxes", {})
    assert r.status == 201, r
    try:
        assert r.json()["infra_failure"] is False
    finally:
        api.delete(r.json()["id"])


# ---- infra failures ----

def test_agent_killed_mid_exec_is_infra(api, daemon):
    """kill -9 of the sandbox's init (its agent) from the host, during an
    exec: buffered, streamed, the SDK and the CLI all say infra."""
    for mode in ("buffered", "stream", "sdk", "cli"):
        sid = api.create()
        try:
            out = {}
            marker = f"infra-{mode}"

            def run():
                if mode == "sdk":
                    with warren.Client("unix:" + daemon.sock) as c:
                        try:
                            c.sandbox(sid).exec(f"sleep 300; echo {marker}")
                        except warren.WarrenError as e:
                            out["exc"] = e
                    return
                if mode == "cli":
                    p = cli(daemon, "exec", sid, "--", "sh", "-c", f"sleep 300; echo {marker}")
                    out["proc"] = p
                    out["rc"] = p.wait(timeout=200)
                    out["stderr"] = p.stderr.read()
                    return
                body = {"shell": f"sleep 300; echo {marker}", "stream": mode == "stream"}
                out["resp"] = api.raw("POST", f"/v1/sandboxes/{sid}/exec", body, timeout=200)

            t = threading.Thread(target=run)
            t.start()
            wait_for(lambda: running(api, sid, marker), what="the exec to start")
            os.kill(agent_pid(api, sid), signal.SIGKILL)
            t.join(200)
            assert not t.is_alive()
            if mode == "buffered":
                r = out["resp"]
                j = r.json()
                assert r.status == 410 and j["error"]["code"] == "gone", r
                assert j["infra_failure"] is True, r
            elif mode == "stream":
                r = out["resp"]
                last = json.loads(r.body.decode().strip().splitlines()[-1])
                assert last["error"]["code"] == "gone" and last["infra_failure"] is True, r
            elif mode == "sdk":
                e = out.get("exc")
                assert isinstance(e, warren.InfraError) and isinstance(e, warren.Gone), repr(e)
                assert e.infra_failure is True
            else:
                assert out["rc"] == INFRA_EXIT, (out["rc"], out["stderr"])
            # the dead sandbox keeps saying so, as an infra failure
            r = api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
            assert r.status == 410 and r.json()["infra_failure"] is True, r
        finally:
            api.delete(sid)


@pytest.fixture
def own_daemon(rootfs):
    """A daemon this test may kill -9; restarted on the same root at the end
    so its sandboxes are re-adopted and removed."""
    d = start_daemon(rootfs)
    yield d
    if d.proc.poll() is not None:
        d = Daemon(os.path.abspath(BUILD), root=d.root).start()
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def test_daemon_killed_mid_request_is_infra(own_daemon):
    d = own_daemon
    sid = d.api.create()
    out = {}
    procs = []

    def sdk():
        with warren.Client("unix:" + d.sock) as c:
            try:
                c.sandbox(sid).exec("sleep 300; echo sdk-infra")
            except warren.WarrenError as e:
                out["exc"] = e

    t = threading.Thread(target=sdk)
    t.start()
    p = cli(d, "exec", sid, "--", "sh", "-c", "sleep 300; echo cli-infra")
    procs.append(p)
    wait_for(lambda: running(d.api, sid, "sdk-infra") and running(d.api, sid, "cli-infra"),
             what="both execs to start")
    d.kill9()
    t.join(200)
    assert not t.is_alive()
    e = out.get("exc")
    assert isinstance(e, warren.InfraError) and e.infra_failure, repr(e)
    assert isinstance(e, warren.ConnectionLost), repr(e)
    rc = p.wait(timeout=200)
    assert rc == INFRA_EXIT, (rc, p.stderr.read())
    # nothing listening at all: connect_failed, also the platform's
    r = subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren"), "ls"],
                       capture_output=True, env=dict(os.environ, WARREN_HOST="unix:" + d.sock))
    assert r.returncode == INFRA_EXIT, r
    with warren.Client("unix:" + d.sock) as c:
        with pytest.raises(warren.InfraError):
            c.list()


def test_create_over_the_max_is_infra(rootfs, monkeypatch):
    monkeypatch.setenv("WARREN_MAX_SANDBOXES", "1")
    d = start_daemon(rootfs)
    monkeypatch.delenv("WARREN_MAX_SANDBOXES")
    try:
        sid = d.api.create()
        r = d.api.raw("POST", "/v1/sandboxes", {})
        j = r.json()
        assert r.status == 429 and j["error"]["code"] == "resource_exhausted", r
        assert j["infra_failure"] is True, r
        p = d.cli("create")
        assert p.returncode == INFRA_EXIT, p
        with warren.Client("unix:" + d.sock) as c:
            with pytest.raises(warren.InfraError) as ei:
                c.create()
            assert isinstance(ei.value, warren.ResourceExhausted)
        d.api.delete(sid)
        # room again once the first is gone
        sid = d.api.create()
        d.api.delete(sid)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_sdk_unknown_code_follows_the_body():
    e = warren.errors.error_from_response(502, {"error": {"code": "bad_gateway", "message": "x"}})
    assert isinstance(e, warren.InfraError)
    e = warren.errors.error_from_response(
        418, {"error": {"code": "teapot", "message": "x"}, "infra_failure": True})
    assert isinstance(e, warren.InfraError)
    e = warren.errors.error_from_response(418, {"error": {"code": "teapot", "message": "x"}})
    assert isinstance(e, warren.TaskError) and not e.infra_failure
    e = warren.errors.error_from_response(503, {"error": {"code": "node_lost", "message": "x"},
                                                "infra_failure": True})
    assert isinstance(e, warren.NodeLost) and isinstance(e, warren.Unavailable)


def test_rollout_masks_infra_failed_samples(rootfs, monkeypatch):
    """examples/rollout.py on a node that holds only 2 sandboxes: the
    creates refused with 429 are masked (no reward, out of the means), the
    samples that ran are scored as usual, and the batch still succeeds."""
    monkeypatch.setenv("WARREN_MAX_SANDBOXES", "2")
    d = start_daemon(rootfs)
    monkeypatch.delenv("WARREN_MAX_SANDBOXES")
    try:
        repo = os.path.join(os.path.dirname(__file__), "..", "..")
        r = subprocess.run([sys.executable, os.path.join(repo, "examples", "rollout.py"), "--short",
                            "--json", "--base", "busybox:latest", "--host", "unix:" + d.sock],
                           capture_output=True, timeout=600)
        assert r.returncode == 0, r.stderr.decode()
        rep = json.loads(r.stdout)
        assert rep["sandboxes"] == 12 and rep["errors"] == [], rep
        assert rep["masked"] > 0 and rep["masked"] + rep["scored"] == 12, rep
        assert len(rep["infra_failures"]) == rep["masked"]
        assert all("infra failure" in e for e in rep["infra_failures"]), rep["infra_failures"]
        for s in rep["samples"]:
            if s["masked"]:
                assert s["reward"] is None, s
            else:
                assert s["reward"] == (1.0 if s["good"] else 0.0), s
        assert rep["verifier_agrees"] == rep["scored"]
        assert sum(t["masked"] for t in rep["per_task"].values()) == rep["masked"]
        assert d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

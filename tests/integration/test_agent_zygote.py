"""The agent zygote (docs/containers.md "Agent zygote"): sandboxes' agents are
forked by one warren-agent --zygote per daemon, which is restarted when it
dies; warrend --no-agent-zygote (or WARREN_AGENT_ZYGOTE=0) keeps the exec'd
agent."""
import os
import shutil
import signal

import pytest

from conftest import start_daemon
from wr import wait_for


def status_field(pid, name):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split()[1]
    return None


def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def metric(api, name):
    for line in api.raw("GET", "/metrics").body.decode().splitlines():
        if line.startswith(name + " "):
            return int(line.split()[1])
    return None


def agent_pid(api, sid):
    return api.raw("GET", f"/v1/sandboxes/{sid}").json()["pid"]


def alive(pid):
    try:
        os.kill(pid, 0)
        return status_field(pid, "State") != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def check_sandbox_works(api, sid):
    r = api.sh(sid, "echo hi > /tmp/f; cat /tmp/f; echo $$; hostname")
    assert r["exit_code"] == 0 and r["stdout"].startswith("hi\n"), r
    # pid 1 is the agent: seccomp filter, no_new_privs, no capability of the host's
    r = api.sh(sid, "grep -E '^(Seccomp|NoNewPrivs|CapEff|CapBnd):' /proc/1/status")
    assert "Seccomp:\t2" in r["stdout"] and "NoNewPrivs:\t1" in r["stdout"], r
    assert "CapEff:\t00000000a80425fb" in r["stdout"], r
    assert "CapBnd:\t00000000a80425fb" in r["stdout"], r
    r = api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/g", b"data")
    assert r.status in (200, 201, 204), r
    assert api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/g").body == b"data"


def test_agent_is_a_zygote_child(api, daemon):
    forks = metric(api, "warren_agent_zygote_forks_total")
    sid = api.create()
    try:
        pid = agent_pid(api, sid)
        zpid = int(status_field(pid, "PPid"))
        assert comm(zpid) == "warren-zygote"
        assert int(status_field(zpid, "PPid")) == daemon.proc.pid
        assert comm(pid) == "warren-agent"
        assert os.path.samefile(f"/proc/{pid}/exe", os.path.join(daemon.build, "bin", "warren-agent"))
        # pid 1 of its own pid namespace, in the sandbox's user namespace
        assert status_field(pid, "NSpid") is not None
        with open(f"/proc/{pid}/status") as f:
            nspid = [ln for ln in f if ln.startswith("NSpid:")][0].split()
        assert nspid[-1] == "1", nspid
        assert os.readlink(f"/proc/{pid}/ns/user") != os.readlink(f"/proc/{zpid}/ns/user")
        assert metric(api, "warren_agent_zygote_forks_total") == forks + 1
        assert metric(api, "warren_agent_zygote_up") >= 1
        check_sandbox_works(api, sid)
    finally:
        assert api.delete(sid).status == 204


def test_killed_zygote_is_replaced(api, daemon):
    sid = api.create()
    zpid = int(status_field(agent_pid(api, sid), "PPid"))
    starts = metric(api, "warren_agent_zygote_starts_total")
    os.kill(zpid, signal.SIGKILL)
    # its agents are not its to take along
    check_sandbox_works(api, sid)
    sid2 = api.create()
    try:
        zpid2 = int(status_field(agent_pid(api, sid2), "PPid"))
        assert zpid2 != zpid and comm(zpid2) == "warren-zygote"
        assert metric(api, "warren_agent_zygote_starts_total") == starts + 1
        check_sandbox_works(api, sid2)
    finally:
        api.delete(sid2)
        api.delete(sid)


def test_zygote_exits_with_the_daemon_and_sandboxes_stay(rootfs):
    d = start_daemon(rootfs)
    try:
        sid = d.api.create()
        d.api.sh(sid, "echo before > /tmp/state")
        pid = agent_pid(d.api, sid)
        zpid = int(status_field(pid, "PPid"))
        d.kill9()
        wait_for(lambda: not alive(zpid), what="the zygote exits at the daemon's EOF")
        assert alive(pid)
        d.start()
        assert d.api.sh(sid, "cat /tmp/state")["stdout"] == "before\n"
        sid2 = d.api.create()
        check_sandbox_works(d.api, sid2)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_exec_fallback(rootfs, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("WARREN_AGENT_ZYGOTE", "0")
    d = start_daemon(rootfs, ["--no-agent-zygote"] if how == "flag" else [])
    try:
        sid = d.api.create()
        pid = agent_pid(d.api, sid)
        assert int(status_field(pid, "PPid")) == d.proc.pid
        assert metric(d.api, "warren_agent_zygote_forks_total") == 0
        assert metric(d.api, "warren_agent_zygote_up") == 0
        check_sandbox_works(d.api, sid)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

"""No daemon descriptor per idle sandbox (issue 13, docs/operations.md
"Limits"): past --agent-conns the daemon closes idle agent connections,
least recently used first, and reopens them on the next request; exec,
files, pause/resume and a restart work on sandboxes whose connection was
shed, and the death of a connection-less sandbox is still noticed."""
import os
import shutil

import pytest

from conftest import start_daemon
from wr import wait_for

N = 30
CONNS = 4
# descriptors the daemon may open beside the kept connections while the
# sandboxes come (its network namespace pool, a zygote restarted, ...)
SLACK = 8
DEADLINE = 120  # generous: a shared, loaded machine


def nfds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def few(pid, fds0):
    """the daemon holds far fewer descriptors than it has sandboxes: today's
    code holds one per sandbox (N more than fds0)"""
    return nfds(pid) - fds0 <= CONNS + SLACK


def state(api, sid):
    return api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"]


@pytest.fixture
def shedding(rootfs):
    d = start_daemon(rootfs, ["--agent-conns", str(CONNS)])
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def metrics(api):
    out = {}
    for line in api.raw("GET", "/metrics").body.decode().splitlines():
        if line.startswith("warren_agent_conn"):
            k, v = line.split()
            out[k] = float(v)
    return out


def create_n(api, pid, n):
    """n sandboxes, and the daemon's descriptors once the first one is up
    (its zygote, cgroup dirs and network pool are opened by the first)"""
    ids, fds0 = [], None
    for _ in range(n):
        r = api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})
        assert r.status == 201, r
        ids.append(r.json()["id"])
        if fds0 is None:
            fds0 = nfds(pid)
    return ids, fds0


def test_idle_sandboxes_hold_no_descriptor(shedding):
    api, pid = shedding.api, shedding.proc.pid
    log = shedding.logtext()
    assert f"descriptors: up to {CONNS} agent connections kept open" in log, log
    assert "limited by descriptors" not in log, log
    ids, fds0 = create_n(api, pid, N)
    # all alive, and the daemon holds far fewer descriptors than sandboxes
    wait_for(lambda: few(pid, fds0), timeout=DEADLINE, what="idle connections shed")
    # every one still served: each request reopens its connection
    for i, sid in enumerate(ids):
        r = api.exec(sid, cmd=["sh", "-c", f"echo {i} > /tmp/n; cat /tmp/n"])
        assert r["exit_code"] == 0 and r["stdout"] == f"{i}\n", r
    for i, sid in enumerate(ids):
        w = api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/f", f"file {i}".encode())
        assert w.status == 201, w
        g = api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/f")
        assert g.status == 200 and g.body == f"file {i}".encode(), g
    wait_for(lambda: few(pid, fds0), timeout=DEADLINE, what="shed again after the requests")
    m = metrics(api)
    assert m["warren_agent_conns_budget"] == CONNS, m
    assert m["warren_agent_conns_open"] <= CONNS and m["warren_agent_conns_shed"] >= N - CONNS, m
    assert m["warren_agent_conn_reconnects_total"] >= N, m
    assert all(state(api, sid) == "running" for sid in ids)
    # pause and resume a shed one; a request wakes nothing it should not
    sid = ids[0]
    p = api.raw("POST", f"/v1/sandboxes/{sid}/pause")
    assert p.status == 200 and p.json()["state"] == "paused", p
    assert api.raw("POST", f"/v1/sandboxes/{sid}/resume").status == 200
    assert api.exec(sid, cmd=["cat", "/tmp/n"])["stdout"] == "0\n"
    wait_for(lambda: few(pid, fds0), timeout=DEADLINE, what="shed again after the resume")


def test_death_of_a_shed_sandbox_is_noticed(shedding):
    api, pid = shedding.api, shedding.proc.pid
    ids, fds0 = create_n(api, pid, N)
    wait_for(lambda: few(pid, fds0), timeout=DEADLINE, what="idle connections shed")
    # the oldest is least recently used: its connection is shed
    victim = ids[0]
    apid = api.raw("GET", f"/v1/sandboxes/{victim}").json()["pid"]
    os.kill(apid, 9)  # from outside: its init, so the whole sandbox dies
    wait_for(lambda: state(api, victim) == "dead", timeout=DEADLINE,
             what="a shed sandbox's death noticed")
    r = api.raw("POST", f"/v1/sandboxes/{victim}/exec", {"cmd": ["true"]})
    assert r.status == 410 and r.json()["error"]["code"] == "gone", r
    # the others are untouched
    for sid in ids[1:]:
        assert state(api, sid) == "running"
    assert api.exec(ids[-1], cmd=["true"])["exit_code"] == 0
    assert api.delete(victim).status == 204


def test_restart_recovers_shed_sandboxes(shedding):
    d = shedding
    ids, fds0 = create_n(d.api, d.proc.pid, N)
    for sid in ids:
        d.api.sh(sid, f"echo {sid} > /tmp/id")
    wait_for(lambda: few(d.proc.pid, fds0), timeout=DEADLINE, what="idle connections shed")
    d.kill9()
    d.start()
    pid = d.proc.pid
    # adoption sheds as it goes: the recovered daemon (no zygote, no
    # cgroup dirs opened yet) holds no descriptor per sandbox
    assert nfds(pid) <= fds0 + CONNS + SLACK, nfds(pid)
    for sid in ids:
        assert d.api.sh(sid, "cat /tmp/id")["stdout"] == f"{sid}\n"
    wait_for(lambda: few(pid, fds0), timeout=DEADLINE, what="idle connections shed after restart")
    assert all(state(d.api, sid) == "running" for sid in ids)
    # an adopted agent is no child of this daemon: its death is still seen
    victim = ids[0]
    os.kill(d.api.raw("GET", f"/v1/sandboxes/{victim}").json()["pid"], 9)
    wait_for(lambda: state(d.api, victim) == "dead", timeout=DEADLINE,
             what="an adopted shed sandbox's death noticed")
    assert state(d.api, ids[1]) == "running"

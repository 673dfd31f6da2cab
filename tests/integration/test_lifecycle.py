"""Lifecycle: TTL, warm pools, restart re-adoption, concurrency, TCP auth, leaks."""
import concurrent.futures as cf
import os
import shutil
import subprocess
import time

import pytest

from conftest import BUILD, start_daemon, start_daemon_tcp
from wr import Api, wait_for


def cgroup_dirs(sid):
    out = []
    for base, dirs, _ in os.walk("/sys/fs/cgroup"):
        if base.count("/") > 6:
            dirs[:] = []
            continue
        if os.path.basename(base) == sid:
            out.append(base)
    return out


def eventually(cond, timeout=60.0):
    """Destroy answers at once; processes, cgroups and files go within moments.
    The deadline only catches "never": a loaded CI machine can take seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def status(api, sid):
    return api.raw("GET", f"/v1/sandboxes/{sid}").status


def test_ttl_destroys_without_request(api):
    sid = api.create(ttl_s=1)
    info = api.raw("GET", f"/v1/sandboxes/{sid}").json()
    assert info["expires_at"] is not None
    # no request ever deletes it: the daemon's timer must (polled, not slept)
    assert eventually(lambda: status(api, sid) == 404), "ttl did not destroy the sandbox"
    assert eventually(lambda: cgroup_dirs(sid) == [])


def test_destroy_leaves_nothing(api, daemon):
    sid = api.create()
    pid = api.raw("GET", f"/v1/sandboxes/{sid}").json()["pid"]
    api.sh(sid, "sleep 1000 & sleep 1000 & true")
    assert cgroup_dirs(sid)
    assert api.delete(sid).status == 204
    assert api.raw("GET", f"/v1/sandboxes/{sid}").status == 404
    assert eventually(lambda: not os.path.exists(f"/proc/{pid}"))
    assert eventually(lambda: cgroup_dirs(sid) == [])
    assert eventually(lambda: not os.path.exists(os.path.join(daemon.root, "sandboxes", sid)))


def test_warm_pool_serves_burst(api):
    r = api.raw("PUT", "/v1/pools/busybox%3Alatest", {"size": 8})
    assert r.status == 200, r

    def filled():
        pools = api.raw("GET", "/v1/pools").json()["pools"]
        return pools and pools[0]["ready"] >= 8
    wait_for(filled, timeout=180, interval=0.1, what="a pool of 8 ready sandboxes")
    ids = [api.raw("POST", "/v1/sandboxes", {}).json()["id"] for _ in range(8)]
    try:
        for sid in ids:
            assert api.exec(sid, ["echo", "x"])["stdout"] == "x\n"
        m = api.raw("GET", "/metrics").body.decode()
        pooled = [l for l in m.splitlines() if l.startswith("warren_sandbox_creations_pooled_total")]
        assert int(pooled[0].split()[1]) >= 8
    finally:
        api.raw("PUT", "/v1/pools/busybox%3Alatest", {"size": 0})
        for sid in ids:
            api.delete(sid)
    # a pool of an unknown image is refused
    assert api.raw("PUT", "/v1/pools/nope%3A1", {"size": 2}).status == 404


def test_thousand_concurrent_requests(daemon, api):
    sid = api.create()
    try:
        def one(i):
            if i % 10 == 0:
                return api.exec(sid, ["echo", str(i)])["stdout"] == f"{i}\n"
            return api.raw("GET", "/healthz", timeout=120).status == 200
        with cf.ThreadPoolExecutor(200) as ex:
            results = list(ex.map(one, range(1000)))
        assert all(results)
    finally:
        api.delete(sid)


def test_restart_after_kill9_readopts(rootfs):
    d = start_daemon(rootfs)
    try:
        sid = d.api.create()
        d.api.sh(sid, "echo before > /tmp/state")
        expiring = d.api.create(ttl_s=2)
        expires_at = d.api.raw("GET", f"/v1/sandboxes/{expiring}").json()["expires_at"]
        d.kill9()
        # the TTL passes while warrend is down (wall clock, as the daemon counts it)
        while time.time() <= expires_at + 0.05:
            time.sleep(0.05)
        d.start()
        r = d.api.sh(sid, "cat /tmp/state")
        assert r["stdout"] == "before\n"
        assert d.api.raw("GET", f"/v1/sandboxes/{expiring}").status == 404
        assert eventually(lambda: cgroup_dirs(expiring) == [])
        assert d.api.delete(sid).status == 204
        assert eventually(lambda: cgroup_dirs(sid) == [])
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_agent_death_is_reported(api):
    sid = api.create()
    pid = api.raw("GET", f"/v1/sandboxes/{sid}").json()["pid"]
    os.kill(pid, 9)
    wait_for(lambda: api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"] == "dead",
             what="state dead after the agent was killed")
    r = api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
    assert r.status == 410 and r.json()["error"]["code"] == "gone"
    assert api.delete(sid).status == 204
    assert eventually(lambda: cgroup_dirs(sid) == [])


def test_tcp_requires_token(rootfs, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret-token-0123456789\n")
    d, port = start_daemon_tcp(rootfs, ["--token-file", str(tok)])
    import http.client
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("GET", "/healthz")
        r = c.getresponse()
        assert r.status == 401
        r.read()
        c.request("GET", "/healthz", headers={"Authorization": "Bearer wrong-token-0123456789x"})
        r = c.getresponse()
        assert r.status == 401
        r.read()
        c.request("GET", "/healthz", headers={"Authorization": "Bearer s3cret-token-0123456789"})
        assert c.getresponse().status == 200
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

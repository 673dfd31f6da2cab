"""Pooled v1 cgroups (issue 13, docs/containers.md "Pooled v1 cgroups"): a
released sandbox's v1 groups are renamed to pool_<n> and the next create
takes them instead of a mkdir, with every limit rewritten and every counter
a previous tenant left starting again at zero; a group that saw an OOM kill
is never pooled; the pool is gone after the daemon stops."""
import glob
import os
import shutil

import pytest

from conftest import need, start_daemon
from wr import wait_for

V1 = "/sys/fs/cgroup"


def v1_dir(ctrl, sid):
    """the sandbox's group in a v1 hierarchy (any daemon's parent), or None"""
    found = glob.glob(f"{V1}/{ctrl}/warren-*/{sid}")
    return found[0] if found else None


def read(path):
    with open(path) as f:
        return f.read().strip()


def pool_dirs(parent):
    return sorted(e for e in os.listdir(parent) if e.startswith("pool_"))


@pytest.fixture
def pdaemon(rootfs):
    need(os.path.isfile(f"{V1}/memory/memory.limit_in_bytes"),
         "no v1 memory hierarchy at /sys/fs/cgroup/memory: no cgroup pool (cgroup2 refuses rename)")
    d = start_daemon(rootfs)
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def usage(api, sid):
    return api.raw("GET", f"/v1/sandboxes/{sid}").json()["usage"]


def released(api, sid):
    """delete sid; wait until its groups are gone from under its id"""
    assert api.delete(sid).status in (200, 202, 204)
    wait_for(lambda: v1_dir("memory", sid) is None and v1_dir("pids", sid) is None,
             what=f"cgroups of {sid} released")


def test_released_group_is_reused_with_new_limits_and_zero_counters(pdaemon):
    api = pdaemon.api
    a = api.create(memory_mb=64, pids_max=64, cpus=0.5)
    mem_a = v1_dir("memory", a)
    parent = os.path.dirname(mem_a)
    ino = {c: os.stat(v1_dir(c, a)).st_ino for c in ("memory", "pids")}
    # the first tenant: a 40 MB buffer (its peak). Its failcnt, when the
    # buffer met the limit, is reset with the peak (the same writes); a
    # rootfs write past the limit would be OOM-killed (the upper is memory)
    api.sh(a, "dd if=/dev/zero of=/dev/null bs=40M count=1")
    ua = usage(api, a)
    assert ua["memory_peak_bytes"] > 40 << 20 and ua["oom_kills"] == 0, ua
    released(api, a)
    wait_for(lambda: any(os.stat(f"{parent}/{p}").st_ino == ino["memory"]
                         for p in pool_dirs(parent)), what="memory group pooled")

    b = api.create(memory_mb=128, pids_max=100)
    try:
        mem_b = v1_dir("memory", b)
        # the same groups, renamed (a new mkdir has a new inode)
        assert os.stat(mem_b).st_ino == ino["memory"]
        assert os.stat(v1_dir("pids", b)).st_ino == ino["pids"]
        assert not any(os.stat(f"{parent}/{p}").st_ino == ino["memory"] for p in pool_dirs(parent))
        # the second tenant's limits, not the first's
        assert int(read(f"{mem_b}/memory.limit_in_bytes")) == 128 << 20
        if os.path.exists(f"{mem_b}/memory.memsw.limit_in_bytes"):
            assert int(read(f"{mem_b}/memory.memsw.limit_in_bytes")) == 128 << 20
        assert read(f"{v1_dir('pids', b)}/pids.max") == "100"
        cpu_b = v1_dir("cpu", b)
        if cpu_b and os.path.exists(f"{cpu_b}/cpu.cfs_quota_us"):
            assert int(read(f"{cpu_b}/cpu.cfs_quota_us")) == 100000  # cpus 1, the default
        # and none of the first's counters
        assert int(read(f"{mem_b}/memory.failcnt")) == 0
        ub = usage(api, b)
        assert ub["memory_peak_bytes"] < 20 << 20 and ub["oom_kills"] == 0, ub
        assert api.sh(b, "echo ok")["stdout"] == "ok\n"
        # its limit applies: a 200 MB buffer in 128 MB is OOM-killed
        r = api.exec(b, ["dd", "if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"], timeout_s=60)
        assert r["usage"]["oom_killed"] is True, r
    finally:
        released(api, b)
    # B saw an OOM kill (a count that cannot be reset): not pooled
    assert not any(os.stat(f"{parent}/{p}").st_ino == ino["memory"] for p in pool_dirs(parent))


def test_oom_killed_tenant_leaves_nothing_to_the_next(pdaemon):
    api = pdaemon.api
    a = api.create(memory_mb=64)
    ino = os.stat(v1_dir("memory", a)).st_ino
    parent = os.path.dirname(v1_dir("memory", a))
    r = api.exec(a, ["tail", "/dev/zero"], timeout_s=60)
    assert r["usage"]["oom_killed"] is True, r
    assert usage(api, a)["oom_kills"] >= 1
    released(api, a)
    assert not any(os.stat(f"{parent}/{p}").st_ino == ino for p in pool_dirs(parent))
    b = api.create(memory_mb=64)
    try:
        assert os.stat(v1_dir("memory", b)).st_ino != ino
        ub = usage(api, b)
        assert ub["oom_kills"] == 0 and ub["memory_peak_bytes"] < 60 << 20, ub
    finally:
        released(api, b)


def test_best_effort_after_latency_and_pool_gone_after_stop(rootfs):
    need(os.path.isfile(f"{V1}/memory/memory.limit_in_bytes"), "no v1 memory hierarchy")
    d = start_daemon(rootfs)
    try:
        api = d.api
        ids = [api.create() for _ in range(3)]
        parent = os.path.dirname(v1_dir("memory", ids[0]))
        for sid in ids:
            released(api, sid)
        wait_for(lambda: len(pool_dirs(parent)) >= 3, what="three pooled groups")
        # a best-effort sandbox takes a pooled memory group; its cpu group is
        # under the best-effort parent, with the idle class
        be = api.create(qos="best-effort")
        assert len(pool_dirs(parent)) == 2
        cpu = v1_dir("cpu", be)
        assert cpu and ".best-effort/" in cpu, cpu
        if os.path.exists(f"{cpu}/cpu.idle"):
            assert read(f"{cpu}/cpu.idle") == "1"
        lat = api.create()
        cpu = v1_dir("cpu", lat)
        if os.path.exists(f"{cpu}/cpu.idle"):
            assert read(f"{cpu}/cpu.idle") == "0"
        assert int(read(f"{cpu}/cpu.cfs_quota_us")) == 100000
        assert api.sh(be, "echo ok")["stdout"] == "ok\n" and api.sh(lat, "echo ok")["stdout"] == "ok\n"
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)
    # drained at shutdown: no pool dir and no parent of this daemon left
    for ctrl in ("memory", "pids", "cpu"):
        assert not os.path.exists(f"{V1}/{ctrl}/{os.path.basename(parent)}"), ctrl

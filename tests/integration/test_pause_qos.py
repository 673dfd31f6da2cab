"""Pause that frees memory, idle-pause and CPU QoS (docs/containers.md "Pause",
docs/performance.md "Pause" and "CPU QoS"). No timing assertions: memory is
read from the sandbox's cgroup, states and scheduler classes from the daemon
and /proc; every wait polls with a generous deadline."""
import os
import re
import shutil
import threading

import pytest

from conftest import need, start_daemon
from wr import wait_for

ZRAM_CONTROL = "/sys/class/zram-control/hot_add"


def swaps():
    with open("/proc/swaps") as f:
        return f.read()


def our_zram(root):
    """The zram device this daemon set up: its swap node is ROOT/zram-swap."""
    return os.path.join(root, "zram-swap") in swaps()


@pytest.fixture(scope="module")
def zdaemon(rootfs):
    need(os.path.exists(ZRAM_CONTROL), "no zram in this kernel (/sys/class/zram-control)")
    d = start_daemon(rootfs, ["--zram-size", "768"])
    try:
        assert our_zram(d.root), d.logtext()
        yield d
    finally:
        d.stop()
        # the daemon turns its swap off and removes the device at exit
        left = our_zram(d.root)
        shutil.rmtree(d.root, ignore_errors=True)
        assert not left, "zram swap left on after warrend stopped"


def usage(api, sid):
    return api.raw("GET", f"/v1/sandboxes/{sid}").json()["usage"]["memory_bytes"]


# ~77 MB of text a few times compressible (hex dump of random bytes) in the
# sandbox's tmpfs (charged to its memory cgroup), and ~50 MB more held in a
# process's heap: busybox sort reads /tmp/heap in, then blocks opening a fifo
# (/tmp/heap is removed once sort holds it: HOLD_HEAP; removing it at once
# lost the race with a sort started late on a loaded machine, in CI)
WORKING_SET = ("head -c 24m /dev/urandom | od -x > /tmp/ws && md5sum /tmp/ws | cut -d' ' -f1 "
               "> /tmp/ws.md5 && head -c 12m /dev/urandom | od -x > /tmp/heap && "
               "mkfifo /tmp/fifo && (sort /tmp/heap /tmp/fifo > /tmp/sorted &) && "
               "ls -l /tmp/ws")


def hold_heap(api, sid):
    """Wait until sort holds its input in its heap, then drop the file."""
    wait_for(lambda: sort_rss_kb(api, sid) > 32 << 10, what="sort holding its input")
    assert api.sh(sid, "rm /tmp/heap")["exit_code"] == 0


def memcg_dir(pid):
    """The v1 memory cgroup directory of a host pid (None on a v2-only host)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f.read().splitlines():
            _, ctrls, path = line.split(":", 2)
            if "memory" in ctrls.split(","):
                return "/sys/fs/cgroup/memory" + path
    return None


def swappiness(pid):
    d = memcg_dir(pid)
    if d is None or not os.path.exists(os.path.join(d, "memory.swappiness")):
        return None
    with open(os.path.join(d, "memory.swappiness")) as f:
        return int(f.read())


def sort_rss_kb(api, sid):
    r = api.sh(sid, "for p in /proc/[0-9]*; do grep -q '^Name:.*sort' $p/status 2>/dev/null && "
                    "grep VmRSS $p/status; done")
    return int(r["stdout"].split()[1]) if r["stdout"].strip() else 0


# The reclaim right after the working set was written used to give back ~7 %:
# the kernel sizes a memcg's LRU lists from lazily flushed counters (see
# wr_cg_reclaim). The pause follows the writes at once, as it would in use.
def test_pause_gives_memory_back_and_keeps_data(zdaemon):
    api = zdaemon.api
    sid = api.create(memory_mb=512)
    try:
        pid = api.raw("GET", f"/v1/sandboxes/{sid}").json()["pid"]
        r = api.sh(sid, WORKING_SET, timeout_s=300)
        assert r["exit_code"] == 0, r
        size = int(r["stdout"].split()[4])
        assert size > 64 << 20, r
        hold_heap(api, sid)
        # a running sandbox may not swap beyond its limit: memsw == limit,
        # or (no swap accounting) swappiness 0
        d = memcg_dir(pid)
        if d and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
            assert open(os.path.join(d, "memory.memsw.limit_in_bytes")).read().strip() == str(512 << 20)
        running_swappiness = swappiness(pid)
        before = usage(api, sid)
        assert before > size + (32 << 20), (before, size)
        p = api.raw("POST", f"/v1/sandboxes/{sid}/pause")
        assert p.status == 200, p
        assert p.json()["state"] == "paused"
        info = api.raw("GET", f"/v1/sandboxes/{sid}").json()
        assert info["state"] == "paused"
        assert info["pause"]["memory_before_bytes"] >= size
        after = usage(api, sid)
        # the target is 70 % (bench pause measures it); margin here
        assert after <= before * 0.5, (before, after, info.get("pause"), swaps())
        print("pause: %d -> %d bytes" % (before, after))
        if running_swappiness is not None:  # v1: swap only while paused
            assert swappiness(pid) == 100
        r = api.raw("POST", f"/v1/sandboxes/{sid}/resume")
        assert r.status == 200 and r.json()["state"] == "running", r
        if running_swappiness is not None:
            assert swappiness(pid) == running_swappiness
            assert running_swappiness in (0, 60)
        r = api.sh(sid, "md5sum /tmp/ws | cut -d' ' -f1 | cmp - /tmp/ws.md5 && echo same")
        assert r["exit_code"] == 0 and r["stdout"].strip() == "same", r
        # the heap came back too: sort finishes its (sorted) output
        assert api.sh(sid, "echo zz > /tmp/fifo")["exit_code"] == 0
        wait_for(lambda: api.sh(sid, "tail -n1 /tmp/sorted")["stdout"] == "zz\n",
                 what="sort's output, from its heap")
    finally:
        api.delete(sid)


# ~200 MB of text in the sandbox's tmpfs: reclaiming it takes warrend
# 0.5-2 s, on a worker since issue 13 (it used to hold the event loop)
WS_200 = ("head -c 66m /dev/urandom | od -x > /tmp/ws && md5sum /tmp/ws | cut -d' ' -f1 "
          "> /tmp/ws.md5 && ls -l /tmp/ws")
SAME = "md5sum /tmp/ws | cut -d' ' -f1 | cmp - /tmp/ws.md5 && echo same"


def big_sandbox(api):
    sid = api.create(memory_mb=512)
    r = api.sh(sid, WS_200, timeout_s=300)
    assert r["exit_code"] == 0, r
    assert int(r["stdout"].split()[4]) > 190 << 20, r
    return sid


def pause_in_background(api, sid):
    """POST pause on a thread; returns (thread, result dict)."""
    out = {}

    def run():
        out["resp"] = api.raw("POST", f"/v1/sandboxes/{sid}/pause", timeout=600)
    t = threading.Thread(target=run)
    t.start()
    return t, out


def reclaiming(api, sid):
    """The sandbox reads paused with its reclaim under way: the daemon
    answered this while the reclaim ran."""
    i = api.raw("GET", f"/v1/sandboxes/{sid}").json()
    return i if i["state"] == "paused" and i.get("pause", {}).get("reclaiming") else None


def test_pause_reclaims_off_the_event_loop(zdaemon):
    """Requests to live sandboxes are served while another's pause pushes
    200 MB out: an exec on another sandbox completes before the pause
    request returns (the reclaim used to run on warrend's event loop)."""
    api = zdaemon.api
    a = big_sandbox(api)
    b = api.create()
    try:
        before = usage(api, a)
        t, out = pause_in_background(api, a)
        wait_for(lambda: reclaiming(api, a) or not t.is_alive(), interval=0.01,
                 what="the pause under way")
        assert t.is_alive(), ("the pause returned before anything else was served", out)
        r = api.exec(b, ["echo", "served"])
        assert r["stdout"] == "served\n", r
        assert t.is_alive(), "the exec on another sandbox waited for the pause"
        t.join(600)
        p = out["resp"]
        assert p.status == 200, p
        j = p.json()
        # the reply comes with the reclaim's result
        assert j["state"] == "paused" and j["pause"]["reclaiming"] is False, j
        assert j["pause"]["memory_after_bytes"] <= before * 0.5, (before, j)
        assert usage(api, a) <= before * 0.5
        assert api.raw("POST", f"/v1/sandboxes/{a}/resume").status == 200
        assert api.sh(a, SAME)["stdout"] == "same\n"
    finally:
        api.delete(a)
        api.delete(b)


def test_resume_or_destroy_during_the_reclaim(zdaemon):
    """An exec on the sandbox whose pause is reclaiming resumes it (the
    reclaim stops, data intact); pausing again while the stopped reclaim
    winds down reclaims anew; a destroy meanwhile answers the pause 410."""
    api = zdaemon.api
    a = big_sandbox(api)
    try:
        t, out = pause_in_background(api, a)
        wait_for(lambda: reclaiming(api, a) or not t.is_alive(), interval=0.01,
                 what="the pause under way")
        r = api.sh(a, SAME)  # resumes first, mid-reclaim
        assert r["exit_code"] == 0 and r["stdout"] == "same\n", r
        assert api.raw("GET", f"/v1/sandboxes/{a}").json()["state"] == "running"
        running = usage(api, a)  # read back by the exec
        t.join(600)
        # the stopped reclaim's pass in the kernel was cut short: what the
        # exec read back stays (it used to be pushed out again)
        assert usage(api, a) >= running * 0.9, (running, usage(api, a))
        assert out["resp"].status == 200, out["resp"]
        # at once again, the first worker perhaps still on its last round
        p = api.raw("POST", f"/v1/sandboxes/{a}/pause", timeout=600)
        assert p.status == 200, p
        j = p.json()
        assert j["state"] == "paused" and j["pause"]["reclaiming"] is False, j
        assert j["pause"]["memory_after_bytes"] <= j["pause"]["memory_before_bytes"] * 0.5, j
        assert api.raw("POST", f"/v1/sandboxes/{a}/resume").status == 200
        assert api.sh(a, SAME)["stdout"] == "same\n"
        kinds = [e["kind"] for e in api.raw("GET", f"/v1/sandboxes/{a}/log").json()["events"]]
        assert kinds.count("pause") == 2 and kinds.count("resume") == 2, kinds
        assert kinds.index("pause") < kinds.index("resume"), kinds
        # destroyed while reclaiming: the pause request gets its answer
        t, out = pause_in_background(api, a)
        wait_for(lambda: reclaiming(api, a) or not t.is_alive(), interval=0.01,
                 what="the pause under way")
        assert api.delete(a).status == 204
        t.join(600)
        assert out["resp"].status in (200, 410), out["resp"]
        assert api.raw("GET", f"/v1/sandboxes/{a}").status == 404
        a = None
    finally:
        if a:
            api.delete(a)


def test_memory_bomb_still_oom_killed_with_zram(zdaemon):
    """The daemon's zram is host-wide swap: a running sandbox must still be
    held to its memory limit (not swap past it), also after a pause and
    resume lifted and restored its swap settings."""
    api = zdaemon.api
    sid = api.create(memory_mb=64)
    try:
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pause").status == 200
        assert api.raw("POST", f"/v1/sandboxes/{sid}/resume").status == 200
        r = api.exec(sid, ["tail", "/dev/zero"], timeout_s=120)
        assert r["usage"]["oom_killed"] is True, r
        assert r["signal"] == 9 or r["exit_code"] == 137
        assert api.exec(sid, ["echo", "ok"])["stdout"] == "ok\n"
    finally:
        api.delete(sid)


def test_exec_resumes_a_paused_sandbox(zdaemon):
    api = zdaemon.api
    sid = api.create()
    try:
        api.sh(sid, "echo kept > /tmp/f")
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pause").status == 200
        r = api.sh(sid, "cat /tmp/f")
        assert r["stdout"] == "kept\n", r
        assert api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"] == "running"
        # files requests too
        assert api.raw("POST", f"/v1/sandboxes/{sid}/pause").status == 200
        f = api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/f")
        assert f.status == 200 and f.body == b"kept\n", f
    finally:
        api.delete(sid)


def test_idle_pause_then_transparent_resume(zdaemon):
    api = zdaemon.api
    sid = api.create(idle_pause_s=1)
    try:
        info = api.raw("GET", f"/v1/sandboxes/{sid}").json()
        assert info["idle_pause_s"] == 1
        api.sh(sid, "echo before > /tmp/f")
        wait_for(lambda: api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"] == "paused",
                 what="the idle sandbox paused")
        r = api.sh(sid, "cat /tmp/f")
        assert r["exit_code"] == 0 and r["stdout"] == "before\n", r
        # paused again once idle; the log records both transitions
        wait_for(lambda: api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"] == "paused",
                 what="paused again")
        kinds = [e["kind"] for e in api.raw("GET", f"/v1/sandboxes/{sid}/log").json()["events"]]
        assert kinds.count("pause") >= 2 and "resume" in kinds, kinds
    finally:
        api.delete(sid)


def test_idle_pause_daemon_default(rootfs):
    d = start_daemon(rootfs, ["--idle-pause", "1"])
    try:
        sid = d.api.create()
        assert d.api.raw("GET", f"/v1/sandboxes/{sid}").json()["idle_pause_s"] == 1
        wait_for(lambda: d.api.raw("GET", f"/v1/sandboxes/{sid}").json()["state"] == "paused",
                 what="paused by the daemon's default")
        assert d.api.sh(sid, "echo ok")["stdout"] == "ok\n"
        never = d.api.create(idle_pause_s=0)
        assert d.api.raw("GET", f"/v1/sandboxes/{never}").json()["idle_pause_s"] == 0
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def cpu_cgroup_dir(pid):
    """The v1 cpu (or v2 unified) cgroup directory of a host pid."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = f.read().splitlines()
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            return "/sys/fs/cgroup/cpu" + path if os.path.isdir("/sys/fs/cgroup/cpu") else None
    for line in lines:
        if line.startswith("0::"):
            return "/sys/fs/cgroup" + line[3:]
    return None


def sched_policy(pid):
    with open(f"/proc/{pid}/sched") as f:
        m = re.search(r"^policy\s*:\s*(\d+)", f.read(), re.M)
    return int(m.group(1))


SCHED_OTHER, SCHED_IDLE = 0, 5


def test_best_effort_sandbox_yields(daemon):
    api = daemon.api
    be = api.create(qos="best-effort")
    lat = api.create()
    try:
        bi = api.raw("GET", f"/v1/sandboxes/{be}").json()
        li = api.raw("GET", f"/v1/sandboxes/{lat}").json()
        assert bi["qos"] == "best-effort" and li["qos"] == "latency"
        # the agent and what it starts run SCHED_IDLE
        assert sched_policy(bi["pid"]) == SCHED_IDLE
        assert sched_policy(li["pid"]) == SCHED_OTHER
        r = api.sh(be, "sleep 30 & echo $!")
        child = int(r["stdout"])
        assert child > 0
        # the sandbox's group is idle (or weighs the least)
        g = cpu_cgroup_dir(bi["pid"])
        assert g, "no cpu cgroup for the sandbox"
        if os.path.exists(os.path.join(g, "cpu.idle")):
            assert open(os.path.join(g, "cpu.idle")).read().strip() == "1"
        elif os.path.exists(os.path.join(g, "cpu.shares")):
            assert open(os.path.join(g, "cpu.shares")).read().strip() == "2"
        else:
            assert open(os.path.join(g, "cpu.weight")).read().strip() == "1"
        gl = cpu_cgroup_dir(li["pid"])
        if os.path.exists(os.path.join(gl, "cpu.idle")):
            assert open(os.path.join(gl, "cpu.idle")).read().strip() == "0"
        r = api.raw("POST", "/v1/sandboxes", {"qos": "bulk"})
        assert r.status == 400 and "qos" in r.json()["error"]["message"], r
    finally:
        api.delete(be)
        api.delete(lat)


def cpu_root():
    return "/sys/fs/cgroup/cpu" if os.path.isdir("/sys/fs/cgroup/cpu") else "/sys/fs/cgroup"


def cpu_ancestry(pid):
    """The cpu cgroup dirs of a host pid from the top level down to its own."""
    g = cpu_cgroup_dir(pid)
    assert g, f"no cpu cgroup for {pid}"
    parts = [p for p in g[len(cpu_root()):].split("/") if p]
    return [os.path.join(cpu_root(), *parts[:k]) for k in range(1, len(parts) + 1)]


def idle_group(d):
    """cpu.idle 1, or where the kernel lacks it the least weight."""
    def read(k):
        p = os.path.join(d, k)
        return open(p).read().strip() if os.path.exists(p) else None
    if read("cpu.idle") is not None:
        return read("cpu.idle") == "1"
    return read("cpu.shares") == "2" or read("cpu.weight") == "1"


def test_best_effort_groups_under_an_idle_top_level_parent(rootfs):
    """The structure CPU QoS rests on (docs/performance.md "CPU QoS"): a
    best-effort sandbox's cpu group is under the daemon's idle top-level
    parent NAME.best-effort, so its CPU time is never charged to an entity
    the latency sandboxes or the daemon share; nothing above a latency
    sandbox's agent or the daemon's threads is idle; the parent goes with
    the daemon."""
    d = start_daemon(rootfs)
    be_parent = None
    try:
        api = d.api
        be = api.create(qos="best-effort")
        lat = api.create()
        bpid = api.raw("GET", f"/v1/sandboxes/{be}").json()["pid"]
        lpid = api.raw("GET", f"/v1/sandboxes/{lat}").json()["pid"]
        bup, lup = cpu_ancestry(bpid), cpu_ancestry(lpid)
        # the latency sandbox: NAME/<id>; the best-effort one: NAME.best-effort/<id>
        assert os.path.basename(lup[-1]) == lat and len(lup) >= 2, lup
        assert os.path.basename(bup[-1]) == be, bup
        be_parent = bup[-2]
        assert be_parent == lup[-2] + ".best-effort", (bup, lup)
        assert idle_group(be_parent), be_parent
        assert idle_group(bup[-1]) and sched_policy(bpid) == SCHED_IDLE
        # no idle group above the latency agent or any of the daemon's threads
        assert not any(idle_group(g) for g in lup), lup
        for tid in os.listdir(f"/proc/{d.proc.pid}/task"):
            assert not any(idle_group(g) for g in cpu_ancestry(int(tid))), tid
            assert sched_policy(int(tid)) == SCHED_OTHER
        # a restarted daemon finds the sandbox in the idle parent (adoption
        # opens its cgroups) and removes its group on delete
        api.sh(be, "echo kept > /tmp/f")
        d.kill9()
        d.start()
        assert api.sh(be, "cat /tmp/f")["stdout"] == "kept\n"
        assert cpu_ancestry(bpid) == bup
        assert api.delete(be).status == 204 and api.delete(lat).status == 204
        wait_for(lambda: not os.path.exists(bup[-1]), what="the best-effort group removed")
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)
    # the idle parent goes with the daemon, like its latency sibling
    assert be_parent and not os.path.exists(be_parent), be_parent
    assert not os.path.exists(be_parent[: -len(".best-effort")])


def test_cli_create_flags(daemon):
    import json
    r = daemon.cli("create", "--qos", "best-effort", "--idle-pause", "600", "--json", check=True)
    sb = json.loads(r.stdout)
    try:
        assert sb["qos"] == "best-effort" and sb["idle_pause_s"] == 600
        r = daemon.cli("pause", sb["id"], check=True)
        assert daemon.api.raw("GET", f"/v1/sandboxes/{sb['id']}").json()["state"] == "paused"
        daemon.cli("resume", sb["id"], check=True)
        bad = daemon.cli("create", "--qos", "fast")
        assert bad.returncode == 2 and b"--qos" in bad.stderr, bad
    finally:
        daemon.api.delete(sb["id"])


def test_python_sdk_qos_idle_pause_and_pause_results(zdaemon):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "python"))
    import warren
    with warren.Client("unix:" + zdaemon.sock) as c:
        with pytest.raises(warren.errors.InvalidArgument):
            c.create(qos="fast")
        with pytest.raises(warren.errors.InvalidArgument):
            c.create(idle_pause_s=-1)
        with c.create(qos="best-effort", idle_pause_s=600) as sb:
            assert sb.info.qos == "best-effort" and sb.info.idle_pause_s == 600
            sb.exec("head -c 4m /dev/urandom > /tmp/r")
            info = sb.pause()
            assert info.state == "paused"
            p = info.pause  # the pause's own result
            assert p and p["memory_before_bytes"] > p["memory_after_bytes"], info.raw
            assert p["reclaim_ms"] >= 0 and p["freeze_ms"] >= 0, p
            info = sb.resume()
            assert info.state == "running"
            assert info.resume is not None and info.resume["ms"] >= 0, info.raw
        with c.create() as sb:
            assert sb.info.qos == "latency" and sb.info.idle_pause_s == 0


def test_bench_pause_reports(zdaemon):
    import json
    r = zdaemon.cli("bench", "pause", "-n", "2", "--size", "48", timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr)
    rep = json.loads(r.stdout)
    assert rep["bench"] == "pause" and rep["completed"] == 2 and rep["data_intact"] == 2, rep
    assert rep["memory_before_mb"]["min"] >= 48, rep
    assert rep["given_back_fraction"]["min"] >= 0.5, rep
    for k in ("pause_ms", "resume_ms", "pause_reclaim_ms"):
        assert rep[k]["min"] <= rep[k]["median"] <= rep[k]["max"], rep
    assert b"pause: sandbox 2/2" in r.stderr  # progress on stderr
    assert zdaemon.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


def test_bench_qos_reports(daemon):
    """Structure only (a 2-core test host shares its CPUs with other work:
    the ratio itself is docs/performance.md's, measured with 50 burners)."""
    import json
    r = daemon.cli("bench", "qos", "-b", "2", "-r", "2", "-n", "5", "--control", timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr)
    rep = json.loads(r.stdout)
    for k in ("best_effort", "control_latency_burners"):
        s = rep[k]
        assert s["burners"] == 2 and s["quiet"]["count"] == 10 and s["loaded"]["count"] == 10, rep
        assert s["p99_ratio"] > 0, rep
        # the CPUs' worth the burners used while each phase was measured
        assert s["quiet"]["burners_cpus"] >= 0 and s["loaded"]["burners_cpus"] >= 0, rep
    assert rep["best_effort"]["burners_qos"] == "best-effort"
    assert daemon.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []

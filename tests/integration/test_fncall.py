"""fncall: stateless calls in warm pools (docs/fncall.md)."""
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

from conftest import need, start_daemon

HERE = os.path.dirname(os.path.abspath(__file__))
ZYGOTE = os.path.join(HERE, "..", "..", "src", "zygote", "pyzygote.py")
PY_SCRIPT = os.path.join(HERE, "..", "..", "scripts", "mk-python-rootfs.sh")


@pytest.fixture(scope="module")
def pyroot():
    need(os.geteuid() == 0, "container tests need root")
    need(os.path.exists("/usr/bin/python3"), "a host /usr/bin/python3 to build the Python image")
    d = tempfile.mkdtemp(prefix="wr-py-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    subprocess.run(["sh", PY_SCRIPT, os.path.join(d, "root")], check=True, capture_output=True)
    yield os.path.join(d, "root")
    shutil.rmtree(d, ignore_errors=True)


def _start(rootfs, pyroot, *extra):
    d = start_daemon(rootfs, ["--fncall-zygote", ZYGOTE] + list(extra))
    r = d.api.raw("POST", "/v1/images/import", {"name": "python:latest", "path": pyroot}, timeout=300)
    assert r.status == 201, r
    return d


@pytest.fixture(scope="module")
def fn(rootfs, pyroot):
    d = _start(rootfs, pyroot, "--fncall-idle", "3", "--fncall-queue", "4")
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def call(api, timeout=120, **req):
    r = api.raw("POST", "/v1/calls", req, timeout=timeout)
    return r.status, r.json()


def ok(api, **req):
    st, j = call(api, **req)
    assert st == 200, j
    return j


def pools(api):
    return api.raw("GET", "/v1/fncall/pools").json()["pools"]


def wait_for(cond, deadline_s=60):
    """Poll cond until true or the (generous) deadline; returns the last value."""
    deadline = time.time() + deadline_s
    while True:
        v = cond()
        if v or time.time() > deadline:
            return v
        time.sleep(0.05)


def pool(api, key):
    for p in pools(api):
        if p["key"] == key:
            return p
    return None


def set_pool(api, image, size, memory_mb, lang="cmd", mode=None):
    body = {"image": image, "size": size, "memory_mb": memory_mb, "lang": lang}
    if mode:
        body["mode"] = mode
    r = api.raw("PUT", "/v1/fncall/pools", body)
    assert r.status == 200, r
    key = "%s|%s|%d" % (image, lang, memory_mb)
    deadline = time.time() + 120
    while time.time() < deadline:
        p = pool(api, key)
        if p and sum(m["state"] == "idle" and (mode is None or m["mode"] == mode)
                     for m in p["members"]) >= size:
            return key
        time.sleep(0.05)
    raise AssertionError("pool %s never became ready: %s" % (key, pool(api, key)))


# ---- basics ----


def test_cmd_call(fn):
    j = ok(fn.api, cmd=["sh", "-c", "id -u; pwd; echo err >&2; exit 3"])
    out = j["stdout"].split()
    assert j["exit_code"] == 3 and j["stderr"] == "err\n"
    assert out[0] != "0", "calls never run as root"
    assert out[1] == "/tmp/.wr-call"
    for k in ("duration_ms", "usage", "truncated", "timed_out"):
        assert k in j
    assert j["timed_out"] is False and j["truncated"] is False


def test_cmd_stdin_and_shell(fn):
    j = ok(fn.api, shell="tr a-z A-Z", stdin="hello")
    assert j["stdout"] == "HELLO" and j["exit_code"] == 0


def test_python_fork_and_reuse(fn, one):
    for mode, mem in MODES:
        j = ok(fn.api, image="python:latest", lang="python", code="print(1+1)", memory_mb=mem)
        assert j["stdout"] == "2\n" and j["exit_code"] == 0 and j["mode"] == mode, j
    j = ok(fn.api, image="python:latest", lang="python", code="import sys\nsys.exit(5)")
    assert j["exit_code"] == 5
    j = ok(fn.api, image="python:latest", lang="python", code="raise ValueError('boom')",
           memory_mb=206, mode="reuse")
    assert j["exit_code"] == 1 and "ValueError: boom" in j["stderr"]
    j = ok(fn.api, image="python:latest", lang="python", code="import sys; print(sys.stdin.read()[::-1])",
           stdin="abc")
    assert j["stdout"] == "cba\n"


def test_python_preloaded_modules_and_uid(fn):
    j = ok(fn.api, image="python:latest", lang="python",
           code="import os, sys; print(os.getuid(), 'json' in sys.modules, os.getcwd())")
    uid, preloaded, cwd = j["stdout"].split()
    assert uid != "0" and preloaded == "True" and cwd == "/tmp/.wr-call"


def test_bad_requests(fn):
    assert call(fn.api, cmd=[])[0] == 400
    assert call(fn.api, cmd=["true"], shell="true")[0] == 400
    assert call(fn.api, cmd=["true"], mode="reuse")[0] == 400
    assert call(fn.api, lang="python", image="python:latest")[0] == 400
    assert call(fn.api, cmd=["true"], timeout_s=-1)[0] == 400
    assert call(fn.api, cmd=["true"], memory_mb=1)[0] == 400
    assert call(fn.api, cmd=["true"], image="nosuch:image")[0] == 404
    r = fn.api.raw("GET", "/v1/calls")
    assert r.status == 400


def test_command_not_found(fn):
    j = ok(fn.api, cmd=["/no/such/binary"])
    assert j["exit_code"] == 127 and "no/such/binary" in j["stderr"]
    assert ok(fn.api, cmd=["true"])["exit_code"] == 0


# ---- isolation between calls on the same sandbox ----


@pytest.fixture(scope="module")
def one(fn):
    """A cmd pool, a Python fork pool and a Python reuse pool of exactly one
    sandbox each (the mode is the pool owner's choice)."""
    return (set_pool(fn.api, "python:latest", 1, 201),
            set_pool(fn.api, "python:latest", 1, 202, lang="python"),
            set_pool(fn.api, "python:latest", 1, 206, lang="python", mode="reuse"))


# (mode, memory_mb of the pool configured in that mode by `one`)
MODES = (("fork", 202), ("reuse", 206))


def same_member(results):
    ids = {r["fncall"]["sandbox"] for r in results}
    assert len(ids) == 1, ids


def test_scratch_wiped(fn, one):
    a = ok(fn.api, image="python:latest", memory_mb=201,
           shell="echo x > f; echo y > /tmp/leak; mkdir -p /var/tmp/d; echo z > /dev/shm/s; ls")
    assert a["stdout"] == "f\n"
    b = ok(fn.api, image="python:latest", memory_mb=201,
           shell="ls -A .; ls -A /tmp /var/tmp /dev/shm")
    same_member([a, b])
    assert b["stdout"].split() == ["/dev/shm:", "/tmp:", ".wr-call", "/var/tmp:"], b
    for mode, mem in MODES:
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="open('f','w').write('x'); open('/tmp/leak2','w').write('y')")
        b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="import os; print(os.listdir('.'), os.path.exists('/tmp/leak2'))")
        same_member([a, b])
        assert b["stdout"] == "[] False\n", (mode, b)


def test_scratch_wiped_once_the_dirs_settled(fn, one):
    """The zygote skips rescanning a temp dir or the scratch whose stat
    (ctime included, which no call can set back) is what a scan that found
    nothing started from, once that ctime is a second old: what a call leaves
    there afterwards is still found, also when it restores the scratch's
    mtime. (The pause only lets the dirs settle; without it the test still
    passes, through full scans.)"""
    for mode, mem in MODES:
        def run(code):
            return ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
                      code=code)
        look = ("import os; print(sorted(os.listdir('.')), "
                "[n for d in ('/tmp', '/var/tmp', '/dev/shm') for n in os.listdir(d)])")
        first = run(look)
        time.sleep(1.5)
        settled = [run(look), run(look)]
        assert all(r["stdout"] == "[] ['.wr-call']\n" for r in [first] + settled), settled
        leave = run("import os\nst = os.stat('.')\nopen('f', 'w').write('x')\n"
                    "os.utime('.', ns=(st.st_atime_ns, st.st_mtime_ns))\n"
                    "for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
                    "    open(d + '/left', 'w').write('y')\n")
        after = run(look)
        same_member([first, leave, after] + settled)
        assert after["stdout"] == "[] ['.wr-call']\n", (mode, after)


def test_background_processes_killed(fn, one):
    t = time.time()
    a = ok(fn.api, image="python:latest", memory_mb=201,
           shell="sleep 300 & (setsid sleep 301 &) ; echo started")
    assert a["stdout"] == "started\n" and time.time() - t < 60
    b = ok(fn.api, image="python:latest", memory_mb=201, shell="ps -o pid,user,args")
    same_member([a, b])
    assert "sleep 30" not in b["stdout"], b["stdout"]
    a = ok(fn.api, image="python:latest", lang="python", memory_mb=202,
           code="import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(300)\nprint('ok')")
    assert a["stdout"] == "ok\n"
    b = ok(fn.api, image="python:latest", lang="python", memory_mb=202,
           code="import os\nn=0\nfor p in os.listdir('/proc'):\n  if p.isdigit():\n"
                "    try: n += os.stat('/proc/'+p).st_uid == os.getuid()\n    except OSError: pass\nprint(n)")
    same_member([a, b])
    assert b["stdout"] == "1\n", b  # only the call itself


def test_background_processes_dead_before_the_next_call(fn, one):
    # SIGKILLed is not dead: a killed process the scheduler has not run yet
    # is still there (state R). The agent waits for it before answering, or
    # the next call sees it (1-5% of these pairs on a loaded host before).
    others = ("me=$$; u=$(id -u); for p in /proc/[0-9]*; do "
              "[ \"$(stat -c %u $p 2>/dev/null)\" = \"$u\" ] || continue; "
              "s=$(cut -d' ' -f6 $p/stat 2>/dev/null) || continue; "
              "[ -z \"$s\" ] || [ \"$s\" = \"$me\" ] || cat $p/stat; done; true")
    for i in range(40):
        a = ok(fn.api, image="python:latest", memory_mb=201,
               shell="sleep 300 & (setsid sleep 301 &) ; echo started")
        b = ok(fn.api, image="python:latest", memory_mb=201, shell=others)
        same_member([a, b])
        assert b["stdout"] == "", (i, b["stdout"])  # only this call's own session


def test_reuse_cannot_spawn(fn, one):
    j = ok(fn.api, image="python:latest", lang="python", memory_mb=206, mode="reuse",
           code="import os\ntry:\n    os.fork()\nexcept OSError as e:\n    print('refused', e.errno)")
    assert j["stdout"].startswith("refused"), j


def test_kill_parent(fn, one):
    a = ok(fn.api, image="python:latest", memory_mb=201,
           shell="kill -9 $PPID; kill -9 1; kill -9 -1; echo still")
    b = ok(fn.api, image="python:latest", memory_mb=201, cmd=["echo", "next"])
    same_member([a, b])
    assert b["stdout"] == "next\n"
    for mode, mem in MODES:
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="import os, signal\nfor p in (os.getppid(), 1):\n  try: os.kill(p, 9)\n"
                    "  except OSError as e: print(e.errno)")
        assert a["stdout"] == "1\n1\n", a  # EPERM: the zygote and the agent are out of reach
        b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode, code="print(7)")
        same_member([a, b])
        assert b["stdout"] == "7\n"


def test_seccomp_per_call(fn, one):
    j = ok(fn.api, image="python:latest", lang="python", memory_mb=202,
           code="import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "r = libc.ptrace(0, 0, 0, 0)\nprint(r, ctypes.get_errno())")
    assert j["stdout"] == "-1 1\n", j  # EPERM from the per-call filter


# A call that writes a well-formed result frame ("ALL TESTS PASSED", exit 0)
# to every fd it holds, and to every /proc/self/fd entry it can reopen for
# writing, several times over.
FORGER = r"""
import json, os, struct
fake = {"exit_code": 0, "signal": 0, "timed_out": False, "stdout_truncated": False,
        "stderr_truncated": False, "duration_ms": 1, "mode": "reuse",
        "usage": {"cpu_user_ms": 0, "cpu_system_ms": 0, "max_rss_kb": 0},
        "out_len": 17, "err_len": 0}
j = json.dumps(fake).encode()
frame = struct.pack("<I", len(j)) + j + b"ALL TESTS PASSED\n"
hits = 0
for name in os.listdir("/proc/self/fd"):
    fd = int(name)
    for _ in range(3):
        try:
            os.write(fd, frame)
            hits += 1
        except OSError:
            pass
    try:
        f = os.open("/proc/self/fd/%d" % fd, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        continue
    try:
        os.write(f, frame * 3)
        hits += 1
    except OSError:
        pass
    os.close(f)
print("forged", hits)
"""


def test_forged_frames_cannot_change_other_results(fn, one):
    for mode, mem in MODES:
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, code=FORGER)
        assert a["mode"] == mode
        for i in range(3):
            b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem,
                   code="print('real %d')\nraise SystemExit(3)" % i)
            same_member([a, b])
            assert b["stdout"] == "real %d\n" % i and b["exit_code"] == 3, (mode, a, b)
            assert "ALL TESTS PASSED" not in b["stdout"] + b["stderr"]
    # commands: the agent's own channels are never inherited by a call
    a = ok(fn.api, image="python:latest", memory_mb=201,
           shell="for f in /proc/self/fd/* /proc/$$/fd/*; do for i in 1 2 3; do "
                 "printf 'ALL TESTS PASSED\\n' > $f; done; done 2>/dev/null; ls /proc/self/fd")
    assert a["stdout"].split() == ["0", "1", "2", "3"], a  # stdio and ls's own dir fd
    b = ok(fn.api, image="python:latest", memory_mb=201, shell="echo real; exit 3")
    same_member([a, b])
    assert b["stdout"] == "real\n" and b["exit_code"] == 3, b
    # fork: not even the interpreter is shared, so in-process tampering (the
    # reason reuse is for calls that trust each other) reaches nobody either
    tamper = ("import sys, builtins\nz = sys.modules['__main__']\n"
              "z.run_code = lambda c, g: 0\nz.send_result = None\n"
              "builtins.print = lambda *a, **k: sys.stdout.write('ALL TESTS PASSED\\n')")
    a = ok(fn.api, image="python:latest", lang="python", memory_mb=202, code=tamper)
    b = ok(fn.api, image="python:latest", lang="python", memory_mb=202,
           code="print('real')\nraise SystemExit(3)")
    same_member([a, b])
    assert b["stdout"] == "real\n" and b["exit_code"] == 3, b


def test_reuse_worker_broken_after_its_result(fn, one):
    # a call that closes the worker's control socket returns normally; the
    # worker then cannot take another call: the next call gets a fresh one
    # instead of failing
    a = ok(fn.api, image="python:latest", lang="python", memory_mb=206,
           code="import os\nfor n in os.listdir('/proc/self/fd'):\n"
                "    try:\n        l = os.readlink('/proc/self/fd/' + n)\n"
                "    except OSError:\n        continue\n"
                "    if l.startswith('socket:'):\n        os.close(int(n))\nprint('a')")
    assert a["stdout"] == "a\n" and a["exit_code"] == 0, a
    b = ok(fn.api, image="python:latest", lang="python", memory_mb=206, code="print('b')")
    same_member([a, b])
    assert b["stdout"] == "b\n" and b["exit_code"] == 0 and b["fncall"]["attempts"] == 1, b


def test_reuse_call_timers_do_not_fire_in_the_next(fn, one):
    # a judge that arms an alarm for its own timeout and returns without
    # cancelling it must not kill the next call on the worker
    a = ok(fn.api, image="python:latest", lang="python", memory_mb=206,
           code="import signal\nsignal.signal(signal.SIGALRM, signal.SIG_DFL)\n"
                "signal.alarm(1)\nsignal.setitimer(signal.ITIMER_PROF, 0.5)\nprint('a')")
    assert a["stdout"] == "a\n", a
    b = ok(fn.api, image="python:latest", lang="python", memory_mb=206,
           code="import time\nt = time.monotonic()\nwhile time.monotonic() - t < 2: pass\n"
                "print('b')")
    same_member([a, b])
    assert b["stdout"] == "b\n" and b["exit_code"] == 0 and b["signal"] == 0, b


def test_mode_is_set_by_the_pool_owner(fn, one):
    # a caller cannot put its call into a shared worker, nor leave one
    st, j = call(fn.api, image="python:latest", lang="python", memory_mb=202, mode="reuse",
                 code="print(1)")
    assert st == 409 and j["error"]["code"] == "conflict" and "owner" in j["error"]["message"], j
    st, j = call(fn.api, image="python:latest", lang="python", memory_mb=206, mode="fork",
                 code="print(1)")
    assert st == 409 and j["error"]["code"] == "conflict", j
    # without "mode" a call runs in its pool's mode
    assert ok(fn.api, image="python:latest", lang="python", memory_mb=202,
              code="print(1)")["mode"] == "fork"
    assert ok(fn.api, image="python:latest", lang="python", memory_mb=206,
              code="print(1)")["mode"] == "reuse"
    # a pool a call creates is a fork pool
    st, j = call(fn.api, image="python:latest", lang="python", memory_mb=208, mode="reuse",
                 code="print(1)")
    assert st == 409, j
    assert pool(fn.api, "python:latest|python|208")["mode"] == "fork"
    # the owner switches it: its members are replaced, calls follow
    for mode in ("reuse", "fork"):
        set_pool(fn.api, "python:latest", 1, 208, lang="python", mode=mode)
        j = ok(fn.api, image="python:latest", lang="python", memory_mb=208, code="print(2)")
        assert j["mode"] == mode and j["stdout"] == "2\n", j
    set_pool(fn.api, "python:latest", 0, 208, lang="python")


def test_fork_bomb(fn, one):
    t = time.time()
    a = ok(fn.api, image="python:latest", memory_mb=201, timeout_s=3,
           shell="b() { b | b & }; b; sleep 5")
    assert time.time() - t < 60
    b = ok(fn.api, image="python:latest", memory_mb=201, shell="ps -o pid | wc -l; echo fine")
    same_member([a, b])
    assert "fine" in b["stdout"] and int(b["stdout"].split()[0]) < 10, b
    a = ok(fn.api, image="python:latest", lang="python", memory_mb=202, timeout_s=3,
           code="import os\nwhile True:\n    try: os.fork()\n    except OSError: pass")
    b = ok(fn.api, image="python:latest", lang="python", memory_mb=202, code="print('fine')")
    same_member([a, b])
    assert b["stdout"] == "fine\n"


def test_memory_exhaustion(fn, one):
    for mode, mem in MODES:
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
        assert a["exit_code"] != 0 and "MemoryError" in a["stderr"], a
        b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="print(len(bytearray(32 << 20)))")
        assert b["stdout"] == str(32 << 20) + "\n"
    a = ok(fn.api, image="python:latest", memory_mb=201,
           cmd=["python3", "-c", "x = bytearray(1 << 30)"])
    assert a["exit_code"] != 0
    assert ok(fn.api, image="python:latest", memory_mb=201, cmd=["true"])["exit_code"] == 0


def test_output_flood(fn, one):
    a = ok(fn.api, image="python:latest", memory_mb=201, cmd=["yes"], stdout_cap=1000,
           timeout_s=1)
    assert a["truncated"] and len(a["stdout"]) == 1000 and a["timed_out"]
    for mode, mem in MODES:
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               stdout_cap=5000, code="for i in range(10**6): print('x' * 100)")
        assert a["truncated"] and len(a["stdout"]) == 5000 and a["exit_code"] == 0, a
        b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="print('after')")
        assert b["stdout"] == "after\n" and not b["truncated"]


def test_timeout(fn, one):
    t = time.time()
    a = ok(fn.api, image="python:latest", memory_mb=201, cmd=["sleep", "30"], timeout_s=1)
    assert a["timed_out"] and a["exit_code"] != 0 and time.time() - t < 60
    for mode, mem in MODES:
        t = time.time()
        a = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               timeout_s=1, code="while True: pass")
        assert a["timed_out"] and time.time() - t < 60, a
        b = ok(fn.api, image="python:latest", lang="python", memory_mb=mem, mode=mode,
               code="print(3)")
        assert b["stdout"] == "3\n"


# ---- pools, queues, failures ----


def host_children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def test_zygote_crash_retries_call(fn):
    key = set_pool(fn.api, "python:latest", 1, 203, lang="python")
    results = {}

    def run(name, code):
        results[name] = call(fn.api, image="python:latest", lang="python", memory_mb=203, code=code)

    # a runs long enough for the test to see it running and b queued behind
    # it (polled, not slept for); the window only has to cover those polls
    a = threading.Thread(target=run, args=("a", "import time; time.sleep(15); print('a')"))
    a.start()
    assert wait_for(lambda: pool(fn.api, key)["members"][0]["state"] == "busy")
    b = threading.Thread(target=run, args=("b", "print('b')"))
    b.start()
    assert wait_for(lambda: pool(fn.api, key)["queued"] == 1)
    m = pool(fn.api, key)["members"][0]
    assert m["state"] == "busy"
    zygotes = [c for c in host_children(m["pid"])]
    assert zygotes, "zygote process not found under agent %d" % m["pid"]
    for z in zygotes:
        os.kill(z, 9)
    a.join(60)
    b.join(60)
    sa, ja = results["a"]
    sb, jb = results["b"]
    assert sa == 200 and ja["stdout"] == "a\n" and ja["fncall"]["attempts"] == 2, ja
    assert sb == 200 and jb["stdout"] == "b\n", jb
    p = pool(fn.api, key)
    assert p["retries"] >= 1 and p["replaced"] >= 1


def test_queue_full_429(fn):
    set_pool(fn.api, "busybox:latest", 1, 204)
    results = []

    def run(cmd):
        results.append(call(fn.api, cmd=cmd, memory_mb=204))

    key = "busybox:latest|cmd|204"
    # 1 running (long enough to see the queue fill: polled, not slept for)
    # + 4 queued (the bound)
    ts = [threading.Thread(target=run, args=(["sleep", "15"],))]
    ts[0].start()
    assert wait_for(lambda: pool(fn.api, key)["members"][0]["state"] == "busy")
    ts += [threading.Thread(target=run, args=(["true"],)) for _ in range(4)]
    for t in ts[1:]:
        t.start()
    assert wait_for(lambda: pool(fn.api, key)["queued"] == 4)
    t0 = time.time()
    st, j = call(fn.api, cmd=["true"], memory_mb=204)
    assert st == 429 and j["error"]["code"] == "resource_exhausted", j
    # refused at once (the < 100 ms figure is warren bench's; here: no wait
    # for a queue slot, which would take the 15 s of the running call)
    assert "full" in j["error"]["message"] and time.time() - t0 < 10
    for t in ts:
        t.join(60)
    assert sorted(s for s, _ in results) == [200] * 5


def start_call(api, **req):
    """Send a call on a raw socket and return the socket without reading the answer."""
    import json
    import socket
    body = json.dumps(req).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(api.sock)
    s.sendall(b"POST /v1/calls HTTP/1.1\r\nHost: warren\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return s


def test_caller_hangup_frees_the_member(fn):
    """A caller that closes its connection cancels its call: on a pool of
    one sandbox, the next call runs at once instead of after the abandoned
    call's 600 s (issue 11: evhttp does not see the close on its own)."""
    key = set_pool(fn.api, "python:latest", 1, 211)
    busy = lambda: pool(fn.api, key)["members"][0]["state"] == "busy"
    a = start_call(fn.api, image="python:latest", memory_mb=211, cmd=["sleep", "600"],
                   timeout_s=600)
    assert wait_for(busy)
    # a queued call whose caller leaves is dropped from the queue
    b = start_call(fn.api, image="python:latest", memory_mb=211, cmd=["echo", "never"])
    assert wait_for(lambda: pool(fn.api, key)["queued"] == 1)
    b.close()
    assert wait_for(lambda: pool(fn.api, key)["queued"] == 0)
    assert pool(fn.api, key)["abandoned"] == 1
    a.close()
    assert wait_for(lambda: pool(fn.api, key)["abandoned"] == 2)
    # the running command was killed: its member is free for the next call,
    # which is answered long before the 600 s the abandoned one asked for
    j = ok(fn.api, timeout=120, image="python:latest", memory_mb=211, cmd=["echo", "next"])
    assert j["stdout"] == "next\n"
    p = pool(fn.api, key)
    assert p["replaced"] == 0 and len(p["members"]) == 1 and p["calls"] == 2, p


def test_caller_hangup_frees_a_python_member(fn):
    """A Python call cannot be stopped inside the zygote: its member is
    replaced, so the pool serves the next call without waiting 600 s."""
    key = set_pool(fn.api, "python:latest", 1, 212, lang="python")
    a = start_call(fn.api, image="python:latest", lang="python", memory_mb=212,
                   code="import time\ntime.sleep(600)", timeout_s=600)
    assert wait_for(lambda: pool(fn.api, key)["members"][0]["state"] == "busy")
    a.close()
    assert wait_for(lambda: pool(fn.api, key)["abandoned"] == 1)
    j = ok(fn.api, timeout=120, image="python:latest", lang="python", memory_mb=212,
           code="print(7)")
    assert j["stdout"] == "7\n"
    p = pool(fn.api, key)
    assert p["replaced"] == 0 and p["failed"] == 0, p


def test_cold_key_refill_and_shrink(fn):
    # a memory size no other test uses: a cold key
    t = time.time()
    j = ok(fn.api, cmd=["echo", "cold"], memory_mb=205)
    assert j["stdout"] == "cold\n" and time.time() - t < 60
    key = "busybox:latest|cmd|205"
    deadline = time.time() + 120
    while time.time() < deadline and len(pool(fn.api, key)["members"]) < 2:
        time.sleep(0.1)
    assert len(pool(fn.api, key)["members"]) == 2, "the pool refills to its default size"
    deadline = time.time() + 120  # --fncall-idle 3
    while time.time() < deadline and pool(fn.api, key)["members"]:
        time.sleep(0.2)
    assert pool(fn.api, key)["members"] == [], "an idle auto pool shrinks away"
    assert ok(fn.api, cmd=["echo", "again"], memory_mb=205)["stdout"] == "again\n"


def test_member_replaced_after_max_calls(rootfs, pyroot):
    d = _start(rootfs, pyroot, "--fncall-max-calls", "3", "--fncall-size", "1")
    try:
        ids = [ok(d.api, cmd=["true"], memory_mb=64)["fncall"]["sandbox"] for _ in range(7)]
        assert len(set(ids)) == 3, ids  # 3 + 3 + 1
        p = pool(d.api, "busybox:latest|cmd|64")
        assert p["calls"] == 7
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_pools_not_listed_as_sandboxes(fn):
    ok(fn.api, cmd=["true"])
    listed = {s["id"] for s in fn.api.raw("GET", "/v1/sandboxes").json()["sandboxes"]}
    members = {m["sandbox"] for p in pools(fn.api) for m in p["members"]}
    assert members and not (listed & members)


def test_cli_call(fn, one):
    r = fn.cli("call", "--", "sh", "-c", "echo out; echo err >&2; exit 4")
    assert r.returncode == 4 and r.stdout == b"out\n" and b"err" in r.stderr, r
    r = fn.cli("call", "--timeout", "1", "--", "sleep", "10")
    assert r.returncode != 0
    r = fn.cli("call", "--image", "python:latest", "--memory", "206", "--python",
               "print(6*7); raise SystemExit(2)", "--mode", "reuse")
    assert r.returncode == 2 and r.stdout == b"42\n", r
    r = fn.cli("call", "--image", "python:latest", "--python", "print(1)", "--mode", "reuse")
    assert r.returncode != 0 and b"owner" in r.stderr, r  # the default pool is a fork pool


def test_reuse_requests_inline_and_in_a_memfd(fn, one):
    """A reuse request travels in the control message up to 32 KiB and in a
    memfd beyond: both, interleaved on one worker, give each call its own
    code, stdin and output."""
    big = "x" * (40 << 10)
    calls = [
        ("print(len(%r))" % "abc", None, "3\n"),
        ("print(len(%r))" % big, None, "%d\n" % len(big)),
        ("import sys; print(len(sys.stdin.read()))", "y" * (100 << 10), "%d\n" % (100 << 10)),
        ("import sys; print(sys.stdin.read())", "small", "small\n"),
        # just under and just over the inline limit, counting the JSON around it
        ("s = %r\nprint(len(s))" % ("z" * ((32 << 10) - 400)), None, "%d\n" % ((32 << 10) - 400)),
        ("s = %r\nprint(len(s))" % ("z" * (32 << 10)), None, "%d\n" % (32 << 10)),
    ]
    results = []
    for _ in range(2):
        for code, stdin, want in calls:
            req = dict(image="python:latest", lang="python", memory_mb=206, code=code)
            if stdin is not None:
                req["stdin"] = stdin
            j = ok(fn.api, **req)
            assert j["mode"] == "reuse" and j["exit_code"] == 0 and j["stdout"] == want, j
            results.append(j)
    same_member(results)


def test_bench_call_blocks(rootfs, pyroot):
    """warren bench call interleaves fncall with its references in short
    blocks and reports each ratio as median and range over the blocks."""
    d = _start(rootfs, pyroot)
    try:
        r = d.cli("bench", "call", "--count", "20", "--blocks", "2", "--concurrency", "1,2",
                  "--pool-size", "1", "--alt-count", "6", "--no-alt", "--quiet", timeout=600)
        assert r.returncode == 0, r
        j = json.loads(r.stdout)
        assert j["blocks"] == 2
        for k in ("true_vs_posix_spawn", "python_fork_vs_python3_c"):
            v = j["ratios"][k]
            assert 0 < v["min"] <= v["median"] <= v["max"], j["ratios"]
        # each ratio pairs a block's fncall figure with the reference of the same block
        blocks = j["per_block"]
        assert len(blocks) == 2 and all(set(b) == {"true", "posix_spawn", "fork", "python3_c",
                                                   "reuse"} for b in blocks), blocks
        for k, f, ref in (("true_vs_posix_spawn", "true", "posix_spawn"),
                          ("python_fork_vs_python3_c", "fork", "python3_c")):
            want = sorted(b[f] / b[ref] for b in blocks)
            got = j["ratios"][k]
            assert abs(got["min"] - want[0]) < 0.02 * want[0] + 0.01, (got, blocks)
            assert abs(got["max"] - want[1]) < 0.02 * want[1] + 0.01, (got, blocks)
        for k in ("fncall_true", "fncall_python_fork", "fncall_python_reuse"):
            assert j[k]["c1"]["count"] == 20 and j[k]["c2"]["count"] == 20, j[k]
            assert j[k]["best_rate_per_block"]["median"] > 0, j[k]
        assert j["host_posix_spawn_true"]["rate_per_block"]["median"] > 0
        assert j["host_python3_c"]["count"] == 6  # 2 blocks of 3 (--alt-count 6)
        metrics = [t["metric"] for t in j["targets"]]
        assert any("median of per-block ratios" in m for m in metrics), metrics
        # --only: just the reuse calls, no reference needed
        r = d.cli("bench", "call", "--count", "10", "--blocks", "1", "--concurrency", "1",
                  "--pool-size", "1", "--only", "reuse", "--quiet", timeout=600)
        assert r.returncode == 0, r
        j = json.loads(r.stdout)
        assert "fncall_python_reuse" in j and "fncall_true" not in j
        assert "host_posix_spawn_true" not in j and "host_python3_c" not in j
        assert [t["metric"] for t in j["targets"]] == [
            "python reuse calls/s (median of per-block best)",
            "python reuse p99/p50 at concurrency 1"]
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_reuse_worker_replaced_after_max_calls(rootfs, pyroot):
    """In a reuse pool --fncall-max-calls N replaces the worker (a fork in
    the member) every N calls; the member sandbox goes after 16 N, not N."""
    d = _start(rootfs, pyroot, "--fncall-max-calls", "3", "--fncall-size", "1")
    try:
        set_pool(d.api, "python:latest", 1, 256, lang="python", mode="reuse")
        req = dict(image="python:latest", lang="python", code="import os; print(os.getpid())")
        runs = [ok(d.api, **req) for _ in range(48)]
        pids = [r["stdout"] for r in runs]
        assert len(set(pids)) == 16, pids
        assert all(pids[i] == pids[i - i % 3] for i in range(48)), pids  # 3 calls each
        assert len({r["fncall"]["sandbox"] for r in runs}) == 1, "the member is kept"
        nxt = ok(d.api, **req)
        assert nxt["fncall"]["sandbox"] != runs[0]["fncall"]["sandbox"], "replaced after 16 N"
        # fork and command pools: the member goes after N calls, as before
        ids = [ok(d.api, image="python:latest", lang="python", code="print(1)",
                  memory_mb=64)["fncall"]["sandbox"] for _ in range(4)]
        assert len(set(ids)) == 2, ids
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

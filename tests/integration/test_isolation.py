"""The container boundary: users, namespaces, capabilities, seccomp, limits."""
import os


def sh(api, sid, script, **kw):
    return api.sh(sid, script, **kw)


def test_root_inside_is_unprivileged_outside(api, sandbox):
    r = sh(api, sandbox, "id -u; cat /proc/self/uid_map")
    lines = r["stdout"].split("\n")
    assert lines[0] == "0"
    inside, outside, count = lines[1].split()
    assert inside == "0" and int(outside) >= 1000, lines[1]
    # the agent's host pid runs as that uid
    info = api.raw("GET", f"/v1/sandboxes/{sandbox}").json()
    with open(f"/proc/{info['pid']}/status") as f:
        uid_line = [l for l in f if l.startswith("Uid:")][0]
    assert uid_line.split()[1] == outside


def test_pid_and_host_paths_invisible(api, sandbox):
    r = sh(api, sandbox, "ls /proc | grep -c '^[0-9]'; ls /")
    n = int(r["stdout"].split("\n")[0])
    assert n < 10  # only the sandbox's own processes
    assert "warren" not in r["stdout"]
    assert sh(api, sandbox, "cat /proc/1/cmdline | tr '\\0' ' '")["stdout"].startswith("warren-agent")


def test_network_is_loopback_only(api, sandbox):
    r = sh(api, sandbox, "ls /sys/class/net")
    assert r["stdout"].split() == ["lo"]


def test_proc_sys_and_sys_read_only(api, sandbox):
    r = sh(api, sandbox, "echo 1 > /proc/sys/kernel/hostname 2>&1; echo rc=$?; touch /sys/x 2>&1; echo rc=$?")
    assert r["stdout"].count("rc=0") == 0, r


def test_mount_and_namespaces_denied(api, sandbox):
    r = sh(api, sandbox, "mount -t tmpfs none /mnt 2>&1; echo rc=$?")
    assert "rc=0" not in r["stdout"]
    r = sh(api, sandbox, "unshare -U true 2>&1; echo rc=$?")
    assert "rc=0" not in r["stdout"], r
    r = sh(api, sandbox, "unshare -m true 2>&1; echo rc=$?")
    assert "rc=0" not in r["stdout"], r


def test_capabilities_reduced(api, sandbox):
    r = sh(api, sandbox, "grep CapBnd /proc/self/status")
    bnd = int(r["stdout"].split()[1], 16)
    CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE = 21, 19, 16
    for cap in (CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE):
        assert not bnd & (1 << cap), hex(bnd)
    r = sh(api, sandbox, "grep NoNewPrivs /proc/self/status; grep Seccomp: /proc/self/status")
    assert "NoNewPrivs:\t1" in r["stdout"] and "Seccomp:\t2" in r["stdout"]


def test_disk_limit_gives_enospc(api):
    sid = api.create(disk_mb=16)
    try:
        r = sh(api, sid, "yes > /tmp/f; echo rc=$?", timeout_s=60)
        assert "No space left" in r["stderr"] or "rc=1" in r["stdout"], r
        r = sh(api, sid, "du -m /tmp/f | cut -f1")
        assert int(r["stdout"]) <= 17
        assert sh(api, sid, "rm /tmp/f; echo ok")["stdout"] == "ok\n"
    finally:
        api.delete(sid)


def test_sandboxes_do_not_see_each_other(api):
    a, b = api.create(), api.create()
    try:
        sh(api, a, "echo secret > /tmp/a-only")
        r = sh(api, b, "cat /tmp/a-only 2>&1; echo rc=$?")
        assert "secret" not in r["stdout"]
        r = sh(api, b, "ps -o pid | wc -l")
        assert int(r["stdout"]) < 8
    finally:
        api.delete(a)
        api.delete(b)

"""The container boundary: users, namespaces, capabilities, seccomp, limits."""
import re
import errno
import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import need, start_daemon


@pytest.fixture(scope="module")
def daemon(rootfs):
    """This module also probes `network: host` sandboxes, which a daemon only
    permits with --allow-host-network (docs/operations.md)."""
    d = start_daemon(rootfs, ("--allow-host-network",))
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


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


# ---- seccomp, probed from inside (bubblewrap's try-syscall idea) ----
#
# Each syscall is called with arguments that make it fail harmlessly without
# a filter (EFAULT, EBADF, EINVAL) or succeed; the filter turns it into
# EPERM. The busybox image has no compiler: a static prober is built with
# the host's cc and copied in with the files API.

PROBER = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static void p(const char *name, long r) { printf("%s %d\n", name, r < 0 ? errno : 0); }

int main(void)
{
  p("io_uring_setup", syscall(__NR_io_uring_setup, 1, NULL));          /* EFAULT */
  p("io_uring_enter", syscall(__NR_io_uring_enter, -1, 0, 0, 0, NULL, 0)); /* EBADF */
  p("io_uring_register", syscall(__NR_io_uring_register, -1, 0, NULL, 0)); /* EBADF */
  p("socket_vsock", syscall(__NR_socket, 40 /* AF_VSOCK */, SOCK_STREAM, 0));
  p("socket_vsock_high", syscall(__NR_socket, 0x100000000L | 40, SOCK_STREAM, 0));
  p("socket_unix", syscall(__NR_socket, AF_UNIX, SOCK_STREAM, 0));
  p("open_tree_attr", syscall(467, -1, NULL, 0, NULL, 0));       /* EFAULT/EBADF */
  p("fanotify_init", syscall(__NR_fanotify_init, 0x200 /* FAN_REPORT_FID */, 0));
  p("get_mempolicy", syscall(__NR_get_mempolicy, NULL, NULL, 0, NULL, 0));  /* succeeds */
  p("set_mempolicy", syscall(__NR_set_mempolicy, 0, NULL, 0));              /* succeeds */
  p("mbind", syscall(__NR_mbind, NULL, 0, 0, NULL, 0, 0));                  /* succeeds */
  p("fchmodat2", syscall(452, AT_FDCWD, "/nonexistent", 0, 0));  /* reviewed: ENOENT */
  p("beyond_reviewed", syscall(470, NULL, NULL, 0, 0));          /* ENOSYS either way */
  static const struct { const char *name; unsigned long v; } pers[] = {
    { "personality_query", 0xffffffffUL },     { "personality_linux", 0x0 },
    { "personality_linux32", 0x8 },            { "personality_uname26", 0x20000 },
    { "personality_uname26_linux32", 0x20008 },
    { "personality_addr_no_randomize", 0x0040000 },
    { "personality_read_implies_exec", 0x0400000 },
    { "personality_high_bits", 0x100000000UL },
    { "personality_all_ones", ~0UL },
  };
  for (unsigned i = 0; i < sizeof pers / sizeof pers[0]; i++)
    {
      p(pers[i].name, syscall(__NR_personality, pers[i].v));
      syscall(__NR_personality, 0UL);
    }
  return 0;
}
"""


def static_binary(source, what):
    """source compiled by the host's cc into a static binary (its bytes)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    need(cc is not None, f"a host C compiler to build the {what}")
    d = tempfile.mkdtemp(prefix="wr-prober-")
    try:
        src = os.path.join(d, "p.c")
        with open(src, "w") as f:
            f.write(source)
        r = subprocess.run([cc, "-static", "-O1", "-o", os.path.join(d, "p"), src],
                           capture_output=True)
        need(r.returncode == 0, "static linking with the host cc: %s" % r.stderr[-300:])
        with open(os.path.join(d, "p"), "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def prober():
    return static_binary(PROBER, "syscall prober")


def probe(api, sid, data):
    r = api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/prober&mode=0755", data)
    assert r.status == 201, r
    out = sh(api, sid, "/tmp/prober")
    assert out["exit_code"] == 0, out
    return {k: int(v) for k, v in (l.split() for l in out["stdout"].splitlines())}


def test_seccomp_probe(api, sandbox, prober):
    res = probe(api, sandbox, prober)
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert res[name] == errno.EPERM, (name, res)
    assert res["socket_vsock"] == errno.EPERM, res
    assert res["socket_vsock_high"] == errno.EPERM, res
    assert res["socket_unix"] == 0, res  # the prober itself works
    assert res["open_tree_attr"] == errno.EPERM, res  # a mount API libseccomp cannot name
    for name in ("fanotify_init", "get_mempolicy", "set_mempolicy", "mbind"):
        assert res[name] == errno.EPERM, (name, res)  # Docker: CAP_SYS_ADMIN / CAP_SYS_NICE only
    assert res["fchmodat2"] == errno.ENOENT, res  # newer syscalls reviewed so far pass
    assert res["beyond_reviewed"] == errno.ENOSYS, res
    for name in ("personality_query", "personality_linux", "personality_linux32",
                 "personality_uname26", "personality_uname26_linux32"):
        assert res[name] == 0, (name, res)
    for name in ("personality_addr_no_randomize", "personality_read_implies_exec",
                 "personality_high_bits", "personality_all_ones"):
        assert res[name] == errno.EPERM, (name, res)


# ---- nothing about the host's layout in the mount table ----


def test_mountinfo_shows_no_host_paths(daemon, api):
    for kw in ({}, {"network": "host"}):
        sid = api.create(**kw)
        try:
            text = sh(api, sid, "cat /proc/self/mountinfo /proc/1/mountinfo")["stdout"]
            devs = sh(api, sid, "echo x > /dev/null && head -c 4 /dev/zero | wc -c && "
                                "head -c 4 /dev/urandom | wc -c && cat /proc/keys | wc -c && "
                                "echo x > /dev/full; echo rc=$?")["stdout"].split()
            assert devs == ["4", "4", "0", "rc=1"], devs
        finally:
            api.delete(sid)
        assert "overlay" in text, text
        root = os.path.realpath(daemon.root)
        for leak in (daemon.root, root, "/idmap/", "/layers/", os.path.basename(root)):
            assert leak not in text, (kw, leak, text)
        # device nodes are not binds of the host's devtmpfs, whose options are
        # sized from the host's memory
        assert "devtmpfs" not in text, (kw, text)
        # every path-valued overlay option is a name without host meaning
        for line in text.splitlines():
            if " - overlay " not in line:
                continue
            opts = line.split(" - overlay ")[1].split(" ", 1)[1]
            for o in opts.split(","):
                k, _, v = o.partition("=")
                if v.startswith("/"):
                    assert v.startswith("/proc/self/fd/"), (k, v, line)


def test_cgroups_show_no_host_hierarchy(daemon, api):
    for kw in ({}, {"network": "host"}):
        sid = api.create(**kw)
        try:
            r = sh(api, sid, "cat /proc/self/cgroup; echo --; ls -A /sys/fs/cgroup; echo --; "
                             "cat /proc/self/mountinfo")["stdout"]
        finally:
            api.delete(sid)
        cgroup, sysfs, mounts = r.split("--\n")
        # rooted at the sandbox's own groups in every hierarchy (v1 included);
        # on cgroup2 an exec runs in its own child group (e<N>, made by the
        # agent in the sandbox's delegated group: test_exec's setsid tests)
        for line in cgroup.splitlines():
            path = line.split(":", 2)[2]
            if line.startswith("0::"):
                assert re.fullmatch(r"/(e[0-9]+)?", path), (kw, line, cgroup)
            else:
                assert path == "/", (kw, line, cgroup)
        # the host's cgroup trees (every sandbox's groups) are not reachable
        assert sysfs.strip() == "", (kw, sysfs)
        assert "warren-" not in r and sid not in cgroup, (kw, r)


# ---- each sandbox its own host uid block (issue 9 item 3) ----

UID_CLAIMS = "/run/warren-uids"

INOTIFY_PROBER = r"""
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/inotify.h>
#include <unistd.h>
/* open inotify instances until refused; print "COUNT ERRNO"; with "hold",
 * keep them open */
int main(int argc, char **argv) {
  int n = 0, e = 0;
  while (n < 100000) {
    if (inotify_init1(IN_CLOEXEC) < 0) { e = errno; break; }
    n++;
  }
  printf("%d %d\n", n, e);
  fflush(stdout);
  if (argc > 1)
    for (;;) pause();
  return 0;
}
"""


@pytest.fixture(scope="module")
def inotify_prober():
    return static_binary(INOTIFY_PROBER, "inotify prober")


def host_uid_of(api, sid):
    pid = api.raw("GET", f"/v1/sandboxes/{sid}").json()["pid"]
    with open(f"/proc/{pid}/status") as f:
        uids = [l for l in f if l.startswith("Uid:")][0].split()[1:]
    assert len(set(uids)) == 1, uids  # real, effective, saved, fs
    return int(uids[0])


def released(uid, timeout=60.0):
    """Destroy answers at once and frees the block when the sandbox is gone."""
    import time
    deadline = time.monotonic() + timeout
    while claim_of(uid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    return claim_of(uid) is None


def claim_of(uid):
    try:
        with open(os.path.join(UID_CLAIMS, str(uid))) as f:
            return f.read().split("\n")
    except FileNotFoundError:
        return None


def test_each_sandbox_has_its_own_uid_block(daemon, api):
    sids = [api.create() for _ in range(3)]
    try:
        uids = [host_uid_of(api, s) for s in sids]
        assert len(set(uids)) == 3, uids
        for sid, uid in zip(sids, uids):
            assert uid % 65536 == 0 and uid != 100000, uid
            base = sh(api, sid, "cat /proc/self/uid_map /proc/self/gid_map")["stdout"].split()
            assert base == ["0", str(uid), "65536"] * 2, base
            # claimed on the host for this daemon and sandbox
            assert claim_of(uid)[:2] == [daemon.root, sid], claim_of(uid)
        # blocks never overlap
        for a in uids:
            for b in uids:
                assert a == b or abs(a - b) >= 65536
        # destroy frees the block once the sandbox is gone; the next create
        # takes the lowest free block again: the range in use does not grow
        freed = uids[1]
        assert api.delete(sids[1]).status == 204
        assert released(freed)
        sids[1] = api.create()
        again = host_uid_of(api, sids[1])
        assert again not in (uids[0], uids[2]) and again <= max(uids), (again, uids)
    finally:
        for s in sids:
            api.delete(s)


def test_inotify_exhaustion_stays_in_its_sandbox(api, inotify_prober):
    """Per-user counts are charged to the sandbox's own uid: a sandbox that
    uses up its inotify instances leaves others and host root theirs."""
    import ctypes
    limit = int(open("/proc/sys/fs/inotify/max_user_instances").read())
    need(limit <= 4096, "max_user_instances is small enough to exhaust")
    a, b = api.create(), api.create()
    try:
        for sid in (a, b):
            r = api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/ino&mode=0755",
                        inotify_prober)
            assert r.status == 201, r
        sh(api, a, "/tmp/ino hold > /tmp/out 2>&1 &")
        out = ""
        for _ in range(200):
            out = sh(api, a, "cat /tmp/out")["stdout"]
            if out:
                break
        n, e = map(int, out.split())
        assert e == errno.EMFILE and 0 < n <= limit, out  # still bounded
        # another sandbox still has its whole budget
        n2, e2 = map(int, sh(api, b, "/tmp/ino")["stdout"].split())
        assert n2 == limit and e2 == errno.EMFILE, (n2, e2, limit)
        # and so has host root
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(0o2000000)
        assert fd >= 0, os.strerror(ctypes.get_errno())
        os.close(fd)
    finally:
        api.delete(a)
        api.delete(b)


def test_other_uids_cannot_signal_sandbox(api):
    """A host process running as the old shared uid 100000, or as another
    sandbox's root, may not signal (or even probe) a sandbox's processes."""
    a, b = api.create(), api.create()
    try:
        pid = api.raw("GET", f"/v1/sandboxes/{a}").json()["pid"]
        for uid in (100000, host_uid_of(api, b)):
            r = subprocess.run(["python3", "-c", f"import os; os.kill({pid}, 0)"],
                               user=uid, group=uid, extra_groups=[], capture_output=True)
            assert r.returncode != 0 and b"PermissionError" in r.stderr, (uid, r)
        # its own uid is the one host identity that could (nothing else runs as it)
        r = subprocess.run(["python3", "-c", f"import os; os.kill({pid}, 0)"],
                           user=host_uid_of(api, a), group=host_uid_of(api, a),
                           extra_groups=[], capture_output=True)
        assert r.returncode == 0, r
    finally:
        api.delete(a)
        api.delete(b)


def test_uid_block_survives_restart(rootfs):
    from conftest import start_daemon
    d = start_daemon(rootfs)
    try:
        sid = d.api.create()
        uid = host_uid_of(d.api, sid)
        d.kill9()
        d.start()
        assert host_uid_of(d.api, sid) == uid
        assert claim_of(uid)[:2] == [d.root, sid]
        # a new sandbox does not get the adopted one's block
        other = d.api.create()
        assert host_uid_of(d.api, other) != uid
        assert d.api.delete(sid).status == 204
        assert released(uid)
        d.api.delete(other)
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)

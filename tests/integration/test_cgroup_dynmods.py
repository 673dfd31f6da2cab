"""favordynmods (docs/containers.md "Task migrations"): warrend sets the
host's cgroup2 root flag at start so that moving a task between cgroups (a
sandbox's v1 attach, the agent's per-exec cgroup join) does not wait for an
RCU grace period; --no-cgroup-favordynmods leaves the host as it is."""
import pytest

from conftest import start_daemon


def cgroup2_mount():
    """(mount point, super options) of the whole cgroup2 hierarchy, or None."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, sfields = pre.split(), post.split()
            if len(sfields) >= 3 and sfields[0] == "cgroup2" and fields[3] == "/":
                return fields[4], sfields[2].split(",")
    return None


def test_daemon_sets_favordynmods_and_logs_it(rootfs):
    before = cgroup2_mount()
    d = start_daemon(rootfs)
    try:
        log = d.logtext()
        assert "favordynmods" in log, log
        m = cgroup2_mount()
        if m is None:
            # v1-only host: the flag is set through an unmounted cgroup2
            # superblock; the log says which
            assert "cgroup2 (not mounted)" in log, log
        else:
            assert "favordynmods" in m[1], m
            assert m[0] in log, log
            # the reconfigure gave back every other root flag
            assert set(m[1]) - {"favordynmods"} == set(before[1]) - {"favordynmods"}
        # the flag must not cost the mount its other root flags: sandboxes
        # still get their delegated cgroup2 groups and run
        sid = d.api.create(memory_mb=64)
        r = d.api.exec(sid, ["sh", "-c", "echo ok"])
        assert r["stdout"] == "ok\n"
        d.api.delete(sid)
    finally:
        d.stop()


def test_opt_out_leaves_the_host_alone(rootfs):
    d = start_daemon(rootfs, extra=["--no-cgroup-favordynmods"])
    try:
        assert "left as it is (--no-cgroup-favordynmods)" in d.logtext()
    finally:
        d.stop()

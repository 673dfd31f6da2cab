"""The boot watchdog (docs/vm.md, "Boot watchdog"): a VM whose guest never
starts its agent is declared lost after --vm-boot-timeout, and a request
sent to it fails as the platform's failure instead of hanging until its
client gives up (a TCG boot that hung in CI held an exec for 180 s)."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from conftest import BUILD, start_daemon
from test_vm import guest_kit, qemu_pids, wait_gone

BOOT_TIMEOUT = 4


@pytest.fixture(scope="module")
def bd(rootfs):
    guest_kit()
    d = start_daemon(rootfs, ["--vm-boot-timeout", str(BOOT_TIMEOUT)])
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def metric(d, name):
    text = d.api.raw("GET", "/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_guest_that_never_boots_is_lost_not_hung(bd):
    assert metric(bd, "warren_vm_boot_timeouts_total") == 0
    # the daemon's first VM create sets the backend up (seconds): done
    # first, in another configuration (no template shared with the next)
    bd.api.delete(bd.api.create(image="busybox:latest", backend="microvm", memory_mb=192))
    assert wait_gone(lambda: qemu_pids(bd.root) == [], timeout=30)
    # create returns once QEMU runs, the guest booting (a few seconds):
    # stopped at once, it never starts its agent
    sid = bd.api.create(image="busybox:latest", backend="microvm", memory_mb=256)
    pids = qemu_pids(bd.root)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGSTOP)
    t0 = time.monotonic()
    r = bd.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]}, timeout=60)
    took = time.monotonic() - t0
    assert took < BOOT_TIMEOUT + 20, took
    assert r.status == 410, r
    err = r.json()["error"]
    assert "did not start its agent within %d s" % BOOT_TIMEOUT in err["message"], err
    assert r.json()["infra_failure"] is True, r.json()
    # QEMU is gone, the sandbox says it was lost, and delete cleans up
    assert wait_gone(lambda: qemu_pids(bd.root) == [], timeout=30)
    info = bd.api.raw("GET", f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "dead", info
    assert "did not start its agent" in info["dead_reason"], info
    assert metric(bd, "warren_vm_boot_timeouts_total") == 1
    r = bd.api.raw("DELETE", f"/v1/sandboxes/{sid}")
    assert r.status in (200, 204), r
    assert bd.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


@pytest.mark.parametrize("bad", ["0", "-1", "x", "86401", ""])
def test_bad_boot_timeout_refused(tmp_path, bad):
    r = subprocess.run([os.path.join(BUILD, "bin", "warrend"), "--root", str(tmp_path / "root"),
                        "--vm-boot-timeout", bad], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r
    assert "--vm-boot-timeout wants seconds in [1, 86400]" in r.stderr, r.stderr

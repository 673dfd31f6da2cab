import os
import shutil
import tempfile

import pytest

from wr import Daemon, busybox_rootfs

BUILD = os.environ.get("WARREN_BUILD", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
MUST_WORK = os.environ.get("WARREN_MUST_WORK") == "1"


def need(cond, reason):
    """Skip with a named reason, except in CI where the container suite must run."""
    if not cond:
        if MUST_WORK:
            pytest.fail(f"required feature missing (WARREN_MUST_WORK=1): {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def rootfs():
    need(os.geteuid() == 0, "container tests need root")
    d = tempfile.mkdtemp(prefix="wr-rootfs-", dir="/var/tmp")
    busybox_rootfs(os.path.join(d, "rootfs"))
    yield os.path.join(d, "rootfs")
    shutil.rmtree(d, ignore_errors=True)


def start_daemon(rootfs, extra=()):
    d = Daemon(os.path.abspath(BUILD), extra_args=extra).start()
    r = d.api.raw("POST", "/v1/images/import", {"name": "busybox:latest", "path": rootfs}, timeout=300)
    assert r.status == 201, r
    return d


@pytest.fixture(scope="module")
def daemon(rootfs):
    d = start_daemon(rootfs)
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture(scope="module")
def api(daemon):
    return daemon.api


@pytest.fixture
def sandbox(api):
    sid = api.create()
    yield sid
    api.delete(sid)

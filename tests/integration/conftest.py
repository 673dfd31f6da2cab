import os
import shutil
import tempfile

import pytest

from wr import Daemon, busybox_rootfs, free_port

BUILD = os.environ.get("WARREN_BUILD", os.path.join(os.path.dirname(__file__), "..", "..", "build"))


def san_cflags():
    """The sanitizer flags a C program needs to link this build's libwarren.a
    (`make SAN=1` builds it with ASan + UBSan)."""
    try:
        with open(os.path.join(os.path.abspath(BUILD), "lib", "libwarren.a"), "rb") as f:
            san = b"__asan_init" in f.read()
    except OSError:
        san = False
    return ["-fsanitize=address,undefined"] if san else []
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
    d = tempfile.mkdtemp(prefix="wr-rootfs-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    busybox_rootfs(os.path.join(d, "rootfs"))
    yield os.path.join(d, "rootfs")
    shutil.rmtree(d, ignore_errors=True)


def start_daemon(rootfs, extra=()):
    d = Daemon(os.path.abspath(BUILD), extra_args=extra).start()
    r = d.api.raw("POST", "/v1/images/import", {"name": "busybox:latest", "path": rootfs}, timeout=300)
    assert r.status == 201, r
    return d


def start_daemon_tcp(rootfs, extra=()):
    """A daemon that also listens on a free 127.0.0.1 port: (daemon, port).
    A port found free can be taken before warrend binds it (any connect()
    may pick it as its source port), so a bind refused as in use is retried
    on another port rather than failing the test."""
    for attempt in range(5):
        port = free_port()
        try:
            return start_daemon(rootfs, ["--listen", f"tcp:127.0.0.1:{port}"] + list(extra)), port
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 4:
                raise


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

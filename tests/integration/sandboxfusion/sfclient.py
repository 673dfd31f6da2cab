"""A warrend serving the SandboxFusion API (docs/compat.md), and a plain
http.client caller shaped like SandboxFusion's own test client."""
import http.client
import json
import os
import shutil
import subprocess

import pytest

from conftest import BUILD, need
from wr import Daemon

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.join(HERE, "..", "..", "..")
ZYGOTE = os.path.join(TOP, "src", "zygote", "pyzygote.py")


def debian_tarball():
    """base:bookworm (python3, gcc, g++) from scripts/mk-debian-rootfs.sh:
    its cached tarball, or built now (needs debootstrap and a mirror)."""
    r = subprocess.run([os.path.join(TOP, "scripts", "mk-debian-rootfs.sh")],
                       capture_output=True, text=True)
    need(r.returncode == 0, "base:bookworm cannot be built here: " + r.stderr[-300:])
    return r.stdout.strip()


def lang_layer(lang):
    """The cached layer tarball of lang-LANG:bookworm (LANG as
    scripts/mk-lang-rootfs.sh names it), or None when it was never built:
    the script's --cached mode computes the cache key the way a build does
    and builds nothing but a missing base."""
    r = subprocess.run(["bash", os.path.join(TOP, "scripts", "mk-lang-rootfs.sh"), "--cached",
                        lang], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


class SF:
    """POST /run_code and friends over http.client (no PyPI packages)."""

    def __init__(self, port, token=None):
        self.port = port
        self.token = token

    def request(self, method, path, body=None, timeout=300, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            h = {"Content-Type": "application/json"}
            if self.token:
                h["Authorization"] = "Bearer " + self.token
            h.update(headers or {})
            c.request(method, path, body=None if body is None else json.dumps(body), headers=h)
            r = c.getresponse()
            data = r.read()
            return r.status, (json.loads(data) if data else None)
        finally:
            c.close()

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def run_code(self, **req):
        st, j = self.post("/run_code", req)
        assert st == 200, (st, j)
        return j


from wr import free_port  # noqa: E402,F401 (one definition, re-exported)


def start(rootfs, extra=(), import_base=True):
    """(daemon, SF client): warrend with --listen-compat and base:bookworm
    (imported from its tarball unless import_base is False: then the caller
    imports it, e.g. with `warren image defaults`)."""
    need(os.geteuid() == 0, "container tests need root")
    tarball = debian_tarball()
    for attempt in range(5):
        port = free_port()
        d = Daemon(os.path.abspath(BUILD), extra_args=[
            "--listen-compat", "tcp:127.0.0.1:%d" % port, "--fncall-zygote", ZYGOTE,
            "--fncall-size", "4"] + list(extra))
        try:
            d.start()
            break
        except RuntimeError as e:
            shutil.rmtree(d.root, ignore_errors=True)
            if "in use" not in str(e) or attempt == 4:
                raise
    if import_base:
        r = d.api.raw("POST", "/v1/images/import", {"name": "base:bookworm", "path": tarball},
                      timeout=600)
        assert r.status == 201, r
    return d, SF(port)


_shared = {"n": 0, "d": None, "client": None}


@pytest.fixture(scope="session")
def sf_daemon(rootfs):
    """One daemon for every module that imports this fixture (session-scoped
    fixtures are torn down at the end of the session: the last one stops it)."""
    if _shared["d"] is None:
        _shared["d"], _shared["client"] = start(rootfs)
    _shared["n"] += 1
    yield _shared["d"], _shared["client"]
    _shared["n"] -= 1
    if _shared["n"] == 0:
        d, _shared["d"] = _shared["d"], None
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture(scope="session")
def client(sf_daemon):
    """Stands in for SandboxFusion's fastapi TestClient(app)."""
    return sf_daemon[1]

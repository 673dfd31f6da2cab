"""warren image defaults [--lang LIST] (issue 11 item 2): builds (cached) and
imports base:bookworm and language images into the daemon WARREN_HOST names,
over TCP through /v1/uploads; a second run reuses the cached tarballs and
the store. The language tested end to end is lua (the cheapest toolchain:
a 1 MB layer); the expensive ones (go, java, rust, ...) go through the same
code with another package list."""
import glob
import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import BUILD, need, start_daemon_tcp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKEN = "defaults-test-token-0123456789abcdef"
CACHE = os.environ.get("WARREN_CACHE_DIR", "/var/cache/warren")
BUILD_TIMEOUT = 1800  # a first debootstrap of base + lua on a slow mirror


def cli(d, *args, timeout=300):
    env = dict(os.environ, WARREN_HOST=f"http://127.0.0.1:{d.port}", WARREN_TOKEN=TOKEN)
    env.pop("WARREN_SCRIPTS_DIR", None)  # found next to the binary: B/bin -> scripts/
    return subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren")] + list(args),
                          capture_output=True, text=True, timeout=timeout, env=env)


def can_build_base():
    """The base tarball is cached, or debootstrap can make it."""
    cached = glob.glob(os.path.join(CACHE, "debian-bookworm-*.tar.zst"))
    return bool(cached) or shutil.which("debootstrap") is not None


@pytest.fixture(scope="module")
def d(rootfs):
    tokdir = tempfile.mkdtemp(prefix="wr-tok-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    tok = os.path.join(tokdir, "token")
    with open(tok, "w") as f:
        f.write(TOKEN + "\n")
    daemon, port = start_daemon_tcp(rootfs, ["--token-file", tok])
    daemon.port = port
    yield daemon
    daemon.stop()
    shutil.rmtree(daemon.root, ignore_errors=True)
    shutil.rmtree(tokdir, ignore_errors=True)


def images(d):
    return {i["name"]: i["digest"] for i in d.api.raw("GET", "/v1/images").json()["images"]}


def test_lang_argument_parsing(d):
    r = cli(d, "image", "defaults", "--lang", "python,nope")
    assert r.returncode == 2 and "unknown language 'nope'" in r.stderr, r.stderr
    r = cli(d, "image", "defaults", "--lang", "go;rm")
    assert r.returncode == 2 and "bad language name" in r.stderr, r.stderr
    r = cli(d, "image", "defaults", "stray")
    assert r.returncode == 2, r.stderr
    r = cli(d, "image", "defaults", "--list")
    assert r.returncode == 0
    known = r.stdout.split()
    for lang in ("python", "bash", "c", "cpp", "go", "java", "nodejs", "rust"):
        assert lang in known, known
    script = os.path.join(REPO, "scripts", "mk-lang-rootfs.sh")
    go, java = "golang-go,golang-github-stretchr-testify-dev", "default-jdk-headless,junit5"
    node = "nodejs,ts-node,jest,node-babel7,node-tape,node-n3,node-read-pkg"
    for lang, pkgs in (("python", ""), ("cpp", ""), ("go", go), ("rust", "rustc,cargo"),
                       ("java", java), ("nodejs", node), ("go_test", go), ("junit", java),
                       ("typescript", node), ("jest", node), ("verilog", "iverilog")):
        out = subprocess.run(["bash", script, "--packages", lang], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == pkgs, (lang, out)
    # a test framework runs in its language's image
    for lang, image in (("go_test", "go"), ("junit", "java"), ("typescript", "nodejs"),
                        ("jest", "nodejs"), ("go", "go"), ("d", "d")):
        out = subprocess.run(["bash", script, "--image", lang], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == image, (lang, out)
    out = subprocess.run(["bash", script, "--image", "nope"], capture_output=True, text=True)
    assert out.returncode == 2, out
    # nothing was imported by a refused command line
    assert not any(n.startswith(("base:", "lang-", "warren-defaults")) for n in images(d))


def test_defaults_imports_base_and_is_idempotent(d):
    need(can_build_base(), "base:bookworm needs debootstrap (scripts/setup.sh) or its cached tarball")
    r = cli(d, "image", "defaults", timeout=BUILD_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = images(d)
    assert "base:bookworm" in got, got
    assert f"base:bookworm {got['base:bookworm']}" in r.stdout, r.stdout
    tarball = [l.split()[-1] for l in r.stderr.splitlines() if "base:bookworm" in l][0]
    mtime = os.stat(tarball).st_mtime_ns

    # the image runs the languages of the base: python, bash, c, cpp
    prog = "echo 'int main(){return 42;}' > /tmp/m.c && gcc /tmp/m.c -o /tmp/m; /tmp/m; echo $?; " \
           "python3 -c 'print(6*7)'; command -v g++ >/dev/null && echo g++"
    run = cli(d, "run", "base:bookworm", "--", "bash", "-c", prog)
    assert run.returncode == 0 and run.stdout.split() == ["42", "42", "g++"], run

    # second run: same cached tarball, nothing imported, the store unchanged
    uploads_before = d.api.raw("GET", "/v1/uploads").json()
    r2 = cli(d, "image", "defaults")
    assert r2.returncode == 0, r2.stderr
    assert "base:bookworm is up to date" in r2.stderr, r2.stderr
    assert images(d) == got
    assert os.stat(tarball).st_mtime_ns == mtime
    assert d.api.raw("GET", "/v1/uploads").json()["uploads"] == uploads_before["uploads"]

    # a base:bookworm moved elsewhere is imported again (the marker tag no
    # longer names the same manifest)
    assert d.api.raw("POST", "/v1/images/busybox%3Alatest/tag", {"name": "base:bookworm"}).status == 201
    r3 = cli(d, "image", "defaults", timeout=BUILD_TIMEOUT)
    assert r3.returncode == 0 and "importing base:bookworm" in r3.stderr, r3.stderr
    assert images(d)["base:bookworm"] == got["base:bookworm"]  # same bytes, same layer and manifest


def test_lang_image_is_base_plus_one_layer(d):
    """lua: built here when missing (debootstrap, a few minutes once), then cached."""
    need(can_build_base() and shutil.which("debootstrap") is not None,
         "language images need debootstrap (scripts/setup.sh) and a Debian mirror")
    r = cli(d, "image", "defaults", "--lang", "lua,python,lua", timeout=BUILD_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = images(d)
    assert "lang-lua:bookworm" in got and "lang-python:bookworm" not in got, got
    base = d.api.raw("GET", "/v1/images/base%3Abookworm").json()
    lua = d.api.raw("GET", "/v1/images/lang-lua%3Abookworm").json()
    assert lua["layers"][: len(base["layers"])] == base["layers"], (lua, base)
    assert len(lua["layers"]) == len(base["layers"]) + 1
    run = cli(d, "run", "lang-lua:bookworm", "--", "sh", "-c",
              "lua -e 'print(6*7)'; python3 -c 'print(1)'")
    assert run.returncode == 0 and run.stdout.split() == ["42", "1"], run

    r2 = cli(d, "image", "defaults", "--lang", "lua")
    assert r2.returncode == 0 and "lang-lua:bookworm is up to date" in r2.stderr, r2.stderr
    assert images(d) == got

"""Installable everywhere (issue 11 item 5): the Python SDK's wheel installs
offline into a fresh venv and talks to a daemon; `make install
PREFIX=... DESTDIR=...` gives binaries, libwarren, headers, a pkg-config file
pointing at PREFIX and a systemd unit, and a C program built with
`pkg-config --cflags --libs warren` against the DESTDIR runs against a daemon."""
import glob
import os
import shutil
import subprocess
import tempfile

import pytest

from conftest import BUILD, need, san_cflags

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_ABS = os.path.abspath(BUILD)
PREFIX = "/opt/warren-it"


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, (cmd, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="wr-install-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def offline(cmd):
    """cmd in a fresh network namespace: no route anywhere, only lo (down)."""
    need(shutil.which("unshare") is not None, "unshare(1) is needed to cut the network")
    return ["unshare", "--net", "--"] + cmd


def test_make_builds_the_wheel():
    wheels = glob.glob(os.path.join(BUILD_ABS, "warren-*-py3-none-any.whl"))
    assert len(wheels) == 1, f"`make` must build exactly one wheel into {BUILD_ABS}: {wheels}"
    import zipfile

    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
        assert "warren/__init__.py" in names and "warren/py.typed" in names
        info = [n for n in names if n.endswith(".dist-info/RECORD")]
        assert len(info) == 1
        record = z.read(info[0]).decode()
        for n in names:  # every file is listed (and hashed, except RECORD)
            assert n + "," in record, n
        assert "Root-Is-Purelib: true" in z.read(info[0].replace("RECORD", "WHEEL")).decode()


def test_wheel_is_reproducible(tmp):
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    pa = run(["python3", os.path.join(REPO, "scripts", "mk-wheel.py"), os.path.join(REPO, "python"), a]).stdout.strip()
    pb = run(["python3", os.path.join(REPO, "scripts", "mk-wheel.py"), os.path.join(REPO, "python"), b]).stdout.strip()
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        assert fa.read() == fb.read()


def test_wheel_installs_offline_into_a_fresh_venv(tmp, daemon):
    venv = os.path.join(tmp, "venv")
    r = subprocess.run(["/usr/bin/python3", "-m", "venv", venv], capture_output=True, text=True)
    need(r.returncode == 0, "python3 -m venv needs Debian's python3-venv: " + r.stderr[-300:])
    wheel = glob.glob(os.path.join(BUILD_ABS, "warren-*-py3-none-any.whl"))[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # no network at all: pip may not fetch anything (the wheel needs no
    # build step, no `wheel` package, no dependencies)
    run(offline([os.path.join(venv, "bin", "pip"), "install", "--no-index", wheel]), env=env)
    prog = (
        "import sys, warren\n"
        "assert warren.__file__.startswith(sys.prefix), warren.__file__\n"
        "with warren.Client(sys.argv[1]) as c:\n"
        "    with c.create(image='busybox:latest', memory_mb=128) as sb:\n"
        "        r = sb.exec(['echo', 'from the venv'])\n"
        "        print(r.exit_code, r.stdout.strip())\n"
    )
    out = run([os.path.join(venv, "bin", "python"), "-I", "-c", prog, "unix:" + daemon.sock],
              env=env, cwd=tmp).stdout
    assert out.strip() == "0 from the venv"


def make_install(dest):
    """make install into dest, never rebuilding the build under test (-o:
    another engineer's newer sources must not change what is tested)."""
    built = [os.path.join(BUILD_ABS, "bin", b) for b in
             ("warrend", "warren", "warren-agent", "warren-gateway", "warren-sim")]
    built += [os.path.join(BUILD_ABS, "lib", l) for l in
              ("libwarren.a", "libwarren.so", "pkgconfig/warren.pc")]
    built += glob.glob(os.path.join(BUILD_ABS, "warren-*-py3-none-any.whl"))
    cmd = ["make", "-s", "-C", REPO, f"B={BUILD_ABS}", f"PREFIX={PREFIX}", f"DESTDIR={dest}"]
    for f in built:
        cmd += ["-o", f]
    run(cmd + ["install"])


def test_make_install_layout_and_unit(tmp):
    dest = os.path.join(tmp, "root")
    make_install(dest)
    root = dest + PREFIX
    for b in ("warrend", "warren", "warren-agent", "warren-gateway"):
        assert os.access(os.path.join(root, "bin", b), os.X_OK), b
    assert run([os.path.join(root, "bin", "warren"), "--version"]).stdout.startswith("warren ")
    assert os.path.exists(os.path.join(root, "lib", "libwarren.a"))
    assert os.readlink(os.path.join(root, "lib", "libwarren.so")) == "libwarren.so.0"
    assert os.path.isfile(os.path.realpath(os.path.join(root, "lib", "libwarren.so.0")))
    assert os.path.exists(os.path.join(root, "include", "warren", "warren.h"))
    assert os.path.exists(os.path.join(root, "include", "warren", "version.h"))
    # the scripts `warren image defaults` runs, found from PREFIX/bin
    assert os.path.exists(os.path.join(root, "share", "warren", "scripts", "mk-lang-rootfs.sh"))
    with open(os.path.join(root, "lib", "pkgconfig", "warren.pc")) as f:
        pc = f.read()
    assert f"prefix={PREFIX}\n" in pc and f"libdir={PREFIX}/lib\n" in pc, pc
    assert "build" not in pc and dest not in pc, pc
    unit = os.path.join(root, "lib", "systemd", "system", "warrend.service")
    with open(unit) as f:
        text = f.read()
    assert f"ExecStart={PREFIX}/bin/warrend " in text and "@" not in text, text
    if shutil.which("systemd-analyze"):
        # the unit's syntax (the binary it names lives under DESTDIR, hence --root)
        r = subprocess.run(["systemd-analyze", "verify", f"--root={dest}", unit],
                           capture_output=True, text=True, timeout=120)
        assert "Unknown" not in r.stderr and "Invalid" not in r.stderr, r.stderr


C_PROG = r"""
#include <stdio.h>
#include <string.h>
#include <warren/warren.h>

int main (int argc, char **argv)
{
  warren_error_t e;
  warren_client_t *c = warren_client_new (argv[1], NULL, &e);
  if (c == NULL)
    return 2;
  json_t *req = json_pack ("{s:s,s:i}", "image", "busybox:latest", "memory_mb", 128);
  json_t *sb = warren_sandbox_create (c, req, &e);
  json_decref (req);
  if (sb == NULL)
    {
      fprintf (stderr, "create: %s\n", e.message);
      return 3;
    }
  const char *id = json_string_value (json_object_get (sb, "id"));
  json_t *ex = json_pack ("{s:[sss]}", "cmd", "sh", "-c", "echo linked $((6*7))");
  json_t *r = warren_exec (c, id, ex, &e);
  json_decref (ex);
  if (r == NULL)
    return 4;
  printf ("%s %s", warren_version (), json_string_value (json_object_get (r, "stdout")));
  json_decref (r);
  int rc = warren_sandbox_delete (c, id, &e) < 0 ? 5 : 0;
  json_decref (sb);
  warren_client_free (c);
  return rc;
}
"""


def test_pkg_config_builds_a_client_that_runs(tmp, daemon):
    need(shutil.which("pkg-config") is not None, "pkg-config (Debian: pkg-config) is needed")
    need(shutil.which("cc") is not None, "a C compiler is needed")
    dest = os.path.join(tmp, "root")
    make_install(dest)
    env = dict(os.environ, PKG_CONFIG_SYSROOT_DIR=dest,
               PKG_CONFIG_PATH=dest + PREFIX + "/lib/pkgconfig")
    flags = run(["pkg-config", "--cflags", "--libs", "warren"], env=env).stdout.split()
    assert f"-I{dest}{PREFIX}/include" in flags and f"-L{dest}{PREFIX}/lib" in flags, flags
    src = os.path.join(tmp, "client.c")
    with open(src, "w") as f:
        f.write(C_PROG)
    exe = os.path.join(tmp, "client")
    run(["cc", "-o", exe, src] + san_cflags() + flags)
    # the shared library from the DESTDIR, not the build tree
    lenv = dict(os.environ, LD_LIBRARY_PATH=dest + PREFIX + "/lib")
    ldd = run(["ldd", exe], env=lenv).stdout
    assert f"{dest}{PREFIX}/lib/libwarren.so.0" in ldd, ldd
    out = run([exe, "unix:" + daemon.sock], env=lenv).stdout
    assert out.endswith("linked 42\n") and out.startswith(run(
        [os.path.join(BUILD_ABS, "bin", "warren"), "--version"]).stdout.split()[1]), out

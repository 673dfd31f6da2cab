"""The warren CLI against a real daemon."""
import os
import select
import subprocess
import time


def test_create_exec_cp_ls_rm(daemon, tmp_path):
    r = daemon.cli("create", check=True)
    sid = r.stdout.decode().strip()
    assert len(sid) >= 8
    r = daemon.cli("exec", sid, "--", "sh", "-c", "echo hi; echo err >&2; exit 7")
    assert r.returncode == 7 and r.stdout == b"hi\n" and r.stderr == b"err\n"
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(300000))
    daemon.cli("cp", str(src), f"{sid}:/tmp/in.bin", check=True)
    daemon.cli("cp", f"{sid}:/tmp/in.bin", str(tmp_path / "out.bin"), check=True)
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    assert sid in daemon.cli("ls", check=True).stdout.decode()
    r = daemon.cli("exec", "-i", sid, "--", "wc", "-c", input=b"12345")
    assert r.stdout.strip() == b"5"
    daemon.cli("rm", sid, check=True)
    r = daemon.cli("exec", sid, "--", "true")
    assert r.returncode != 0 and b"no such sandbox" in r.stderr


def read_line(f, timeout=60):
    """One line from a pipe, or None if none arrives by the deadline."""
    fd = f.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        part = os.read(fd, 4096)
        if not part:
            break
        buf += part
    return buf


def test_exec_streams_line_by_line(daemon):
    sid = daemon.cli("create", check=True).stdout.decode().strip()
    p = None
    try:
        env = dict(os.environ, WARREN_HOST="unix:" + daemon.sock)
        # the command cannot end before the test creates /tmp/go, so a first
        # line seen while it waits was streamed, not delivered at the end
        p = subprocess.Popen([os.path.join(daemon.build, "bin", "warren"), "exec", sid, "--", "sh", "-c",
                              "echo 1; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo 2; echo 3"],
                             stdout=subprocess.PIPE, env=env)
        first = read_line(p.stdout)
        assert first == b"1\n", f"no first line while the command runs: {first!r}"
        assert p.poll() is None
        daemon.cli("exec", sid, "--", "touch", "/tmp/go", check=True)
        rest = p.communicate(timeout=120)[0]
        assert p.returncode == 0 and rest == b"2\n3\n", (p.returncode, rest)
    finally:
        if p and p.poll() is None:
            p.kill()
            p.wait()
        daemon.cli("rm", sid)


def test_run_and_errors(daemon):
    r = daemon.cli("run", "busybox:latest", "--", "echo", "ran")
    assert r.returncode == 0 and r.stdout == b"ran\n"
    r = daemon.cli("run", "busybox:latest", "--", "sh", "-c", "exit 4")
    assert r.returncode == 4
    r = daemon.cli("run", "nosuchimage:1", "--", "true")
    assert r.returncode != 0 and b"not found" in r.stderr
    r = daemon.cli("exec", "zzzz", "--", "true")
    assert r.returncode != 0
    env = dict(os.environ, WARREN_HOST="unix:/nonexistent/sock")
    r = subprocess.run([os.path.join(daemon.build, "bin", "warren"), "ls"], capture_output=True, env=env,
                       timeout=120)
    assert r.returncode != 0 and b"cannot connect" in r.stderr
    # no sandboxes left behind by run
    assert daemon.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


def test_image_import_and_ls(daemon, rootfs, tmp_path):
    tarball = tmp_path / "rootfs.tar.gz"
    subprocess.run(["tar", "-C", rootfs, "-czf", str(tarball), "."], check=True)
    daemon.cli("image", "import", "bb2:v1", str(tarball), check=True, timeout=300)
    out = daemon.cli("image", "ls", check=True).stdout.decode()
    assert "bb2" in out
    r = daemon.cli("run", "bb2:v1", "--", "echo", "from-tar")
    assert r.stdout == b"from-tar\n"
    daemon.cli("image", "rm", "bb2:v1", check=True)
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tarball" * 100)
    r = daemon.cli("image", "import", "bad:1", str(bad))
    assert r.returncode != 0

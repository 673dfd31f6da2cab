"""Minimal stdlib HTTP client for the integration tests (the real SDK lives in python/)."""
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time

# Bounds in this file only catch hangs: CI is a 2-core nested VM whose speed
# drifts 1.5-2x and runs the suite under ASan, so nothing here may be tight.
START_TIMEOUT = 180   # warrend up and answering /healthz
STOP_TIMEOUT = 180    # warrend gone after SIGTERM (it destroys what it runs)
WAIT_TIMEOUT = 60     # wait_for(): a condition that is expected "at once"


def wait_for(cond, timeout=WAIT_TIMEOUT, interval=0.05, what=None):
    """Poll cond() until it returns something truthy and return that; fail
    only when the deadline passes (a generous one: only a hang exceeds it)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what or getattr(cond, '__name__', cond)}")
        time.sleep(interval)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=120):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


class Resp:
    def __init__(self, status, body, headers):
        self.status = status
        self.body = body
        self.headers = headers

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"Resp({self.status}, {self.body[:300]!r})"


class Api:
    def __init__(self, sock):
        self.sock = sock

    def raw(self, method, path, body=None, headers=None, timeout=120):
        c = UnixHTTPConnection(self.sock, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return Resp(r.status, r.read(), dict(r.getheaders()))
        finally:
            c.close()

    def create(self, **kw):
        r = self.raw("POST", "/v1/sandboxes", kw)
        assert r.status == 201, r
        return r.json()["id"]

    def delete(self, sid):
        return self.raw("DELETE", f"/v1/sandboxes/{sid}")

    def exec(self, sid, cmd=None, shell=None, **kw):
        body = dict(kw)
        if cmd is not None:
            body["cmd"] = cmd
        if shell is not None:
            body["shell"] = shell
        # the daemon ends the command at timeout_s; the answer may then take a
        # while on a loaded machine
        r = self.raw("POST", f"/v1/sandboxes/{sid}/exec", body, timeout=kw.get("timeout_s", 60) + 120)
        assert r.status == 200, r
        return r.json()

    def sh(self, sid, script, **kw):
        return self.exec(sid, shell=script, **kw)



def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A loopback TCP port free now and outside the kernel's ephemeral range.
    A port from bind(0) is an ephemeral one: any outgoing connection on the
    host (an etcd member dialling its peers, a gateway its nodes) may take it
    as its source port before the listener it was picked for binds it, which
    failed a CI run's etcd start. Outside that range only another listener
    can take it, and tests draw at random across thousands of ports."""
    lo, hi = _ephemeral_range()
    spans = [(s, e) for s, e in ((10000, lo), (hi + 1, 65536)) if e - s >= 1000]
    for _ in range(200):
        s, e = random.choice(spans) if spans else (10000, 65536)
        port = random.randrange(s, e)
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            sock.close()
    raise RuntimeError("no free loopback port outside the ephemeral range")

class Daemon:
    """A real warrend on a private root, with the busybox image imported."""

    def __init__(self, build, root=None, extra_args=()):
        self.build = build
        self.root = root or tempfile.mkdtemp(prefix="wr-it-", dir=os.environ.get("TMPDIR", "/var/tmp"))
        self.sock = os.path.join(self.root, "warrend.sock")
        self.extra = list(extra_args)
        self.proc = None
        self.log = open(os.path.join(self.root, "warrend.log"), "ab")
        self.api = Api(self.sock)

    def start(self):
        self.proc = subprocess.Popen(
            [os.path.join(self.build, "bin", "warrend"), "--root", self.root] + self.extra,
            stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"warrend exited with {self.proc.returncode}: " + self.logtext())
            try:
                if self.api.raw("GET", "/healthz", timeout=60).status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError("warrend did not come up: " + self.logtext())

    def logtext(self):
        with open(os.path.join(self.root, "warrend.log"), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, destroy_all=True):
        if self.proc and self.proc.poll() is None:
            if destroy_all:
                try:
                    for s in self.api.raw("GET", "/v1/sandboxes").json()["sandboxes"]:
                        self.api.delete(s["id"])
                    self.api.raw("PUT", "/v1/pools/busybox%3Alatest", {"size": 0})
                except OSError:
                    pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"warrend did not stop within {STOP_TIMEOUT} s of SIGTERM")
            log = self.logtext()
            # a clean stop; under ASan/UBSan any report fails the test module
            assert self.proc.returncode == 0, f"warrend exited {self.proc.returncode}: {log}"
            assert "AddressSanitizer" not in log and "runtime error" not in log, log

    def cli(self, *args, input=None, timeout=120, check=False):
        env = dict(os.environ, WARREN_HOST="unix:" + self.sock)
        r = subprocess.run([os.path.join(self.build, "bin", "warren")] + list(args), input=input,
                           capture_output=True, timeout=timeout, env=env)
        if check:
            assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        return r


def busybox_rootfs(dest):
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "scripts", "mk-busybox-rootfs.sh")
    subprocess.run(["bash", script, dest], check=True, capture_output=True)
    return dest

"""Real registries (docs/images.md, Registry configuration): TLS with a test
CA made by openssl, htpasswd basic auth, the Bearer token flow with a tiny
token server, wrong credentials and an unknown CA. Debian's docker-registry
serves each; an unauthenticated plain-HTTP one on the same storage is what
the test pushes through (test_images.push)."""
import base64
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse

import pytest

from conftest import BUILD, need, rootfs  # noqa: F401 (fixture)
from test_images import free_port, push, tar_bytes
from wr import Daemon


def run(*args):
    subprocess.run(list(args), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_registry(work, name, store, extra=""):
    """docker-registry on a random loopback port over store; extra: more
    YAML under the top level (auth) or http (tls, indented). -> (proc, port)"""
    exe = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    need(os.path.exists(exe), "docker-registry is not installed (scripts/setup.sh)")
    port = free_port()
    cfg = os.path.join(work, f"{name}.yml")
    with open(cfg, "w") as f:
        f.write(f"""version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {store}
http:
  addr: 127.0.0.1:{port}
{extra}""")
    proc = subprocess.Popen([exe, "serve", cfg], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(work, f"{name}.log"), "wb"))
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    pytest.fail(f"docker-registry {name} did not come up: "
                + open(os.path.join(work, f"{name}.log")).read()[-2000:])


def stop(proc):
    proc.terminate()
    proc.wait(timeout=60)


def make_ca(d, cn):
    """A CA and a certificate for 127.0.0.1 signed by it: (ca.pem, cert, key)."""
    ca, cakey = os.path.join(d, f"{cn}-ca.pem"), os.path.join(d, f"{cn}-ca.key")
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", f"/CN={cn} test CA", "-keyout", cakey, "-out", ca)
    key, csr, crt = (os.path.join(d, f"{cn}.{x}") for x in ("key", "csr", "pem"))
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", key, "-out", csr)
    ext = os.path.join(d, f"{cn}.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    run("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", cakey, "-CAcreateserial",
        "-days", "2", "-extfile", ext, "-out", crt)
    return ca, crt, key


def creds_file(d, name, host, user, password):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        json.dump({"auths": {host: {"auth": base64.b64encode(
            f"{user}:{password}".encode()).decode()}}}, f)
    return p


@pytest.fixture(scope="module")
def work():
    d = tempfile.mkdtemp(prefix="wr-reg-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def plain(work):
    """The unauthenticated registry the tests push through: (host, store)."""
    store = os.path.join(work, "store")
    proc, port = start_registry(work, "plain", store)
    yield f"127.0.0.1:{port}", store
    stop(proc)


@pytest.fixture(scope="module")
def image(plain):
    """A small two-layer image in the shared storage: repo:tag."""
    host, _ = plain
    push(host, "reg/small", "v1", [tar_bytes([("a", "file", "layer one\n")]),
                                   tar_bytes([("b", "file", "layer two\n")])])
    return "reg/small:v1"


@pytest.fixture(scope="module")
def tls_basic(work, plain):
    """TLS (test CA) + htpasswd on the shared storage: (host, ca)."""
    need(shutil.which("htpasswd"), "htpasswd is not installed (apache2-utils, scripts/setup.sh)")
    ca, crt, key = make_ca(work, "basic")
    htp = os.path.join(work, "htpasswd")
    run("htpasswd", "-Bbc", htp, "alice", "s3cret")
    proc, port = start_registry(work, "tls-basic", plain[1], f"""  tls:
    certificate: {crt}
    key: {key}
auth:
  htpasswd:
    realm: warren-test
    path: {htp}
""")
    yield f"127.0.0.1:{port}", ca
    stop(proc)


def daemon_with(rootfs_less_args):
    return Daemon(os.path.abspath(BUILD), extra_args=rootfs_less_args).start()


@pytest.fixture
def daemons():
    started = []

    def start(*args):
        d = daemon_with(list(args))
        started.append(d)
        return d
    yield start
    for d in started:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def pull(d, ref, **kw):
    return d.api.raw("POST", "/v1/images/pull", dict(ref=ref, **kw), timeout=600)


def test_tls_with_test_ca_and_htpasswd(work, tls_basic, image, daemons):
    host, ca = tls_basic
    auth = creds_file(work, "good.json", host, "alice", "s3cret")
    d = daemons("--registry-ca", ca, "--registry-auth", auth)
    r = pull(d, f"{host}/{image}")
    assert r.status == 201, r
    img = r.json()
    assert img["name"] == image and len(img["layers"]) == 2, img


def test_wrong_credentials_are_a_clear_401(work, tls_basic, image, daemons):
    host, ca = tls_basic
    bad = creds_file(work, "bad.json", host, "alice", "wrong")
    d = daemons("--registry-ca", ca, "--registry-auth", bad)
    r = pull(d, f"{host}/{image}")
    assert r.status == 401, r
    m = r.json()["error"]["message"]
    assert "401" in m and "credentials" in m and "refused" in m, m
    # no credentials at all: says which flag gives them
    d2 = daemons("--registry-ca", ca)
    r = pull(d2, f"{host}/{image}")
    assert r.status == 401 and "--registry-auth" in r.json()["error"]["message"], r


def test_unknown_ca_is_a_clear_tls_error(work, tls_basic, image, daemons):
    host, _ = tls_basic
    auth = creds_file(work, "good2.json", host, "alice", "s3cret")
    # another CA than the one that signed the registry's certificate
    other, _, _ = make_ca(work, "other")
    for args in ([], ["--registry-ca", other]):
        d = daemons("--registry-auth", auth, *args)
        r = pull(d, f"{host}/{image}")
        assert r.status == 503, r
        m = r.json()["error"]["message"]
        assert "TLS" in m and "--registry-ca" in m, m
        assert d.api.raw("GET", "/v1/images").json()["images"] == [] or \
            all(i["name"] != image for i in d.api.raw("GET", "/v1/images").json()["images"])


# ---------------------------------------------------------------- token flow

def b64url(b):
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


class TokenServer:
    """GET /token?service=&scope= with basic auth -> {"token": JWT (RS256,
    x5c)}, as docker-registry's `auth: token` expects."""

    def __init__(self, work, user, password):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding
        _, crt, key = make_ca(work, "token")
        self.bundle = crt
        with open(key, "rb") as f:
            self.key = serialization.load_pem_private_key(f.read(), None)
        with open(crt, "rb") as f:
            der = x509.load_pem_x509_certificate(f.read()).public_bytes(serialization.Encoding.DER)
        self.x5c = base64.b64encode(der).decode()
        self.hashes, self.padding = hashes, padding
        self.want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.requests = []
        srv = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                u = urllib.parse.urlparse(self.path)
                q = urllib.parse.parse_qs(u.query)
                srv.requests.append((u.path, q, self.headers.get("Authorization")))
                if self.headers.get("Authorization") != srv.want:
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"token": srv.jwt(q.get("service", [""])[0],
                                                    q.get("scope", []))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def jwt(self, service, scopes):
        access = []
        for s in scopes:
            typ, name, actions = s.split(":")
            access.append({"type": typ, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {"iss": "warren-test-issuer", "sub": "alice", "aud": service, "exp": now + 600,
                  "nbf": now - 60, "iat": now, "jti": str(time.time_ns()), "access": access}
        head = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        msg = (b64url(json.dumps(head).encode()) + "." + b64url(json.dumps(claims).encode()))
        sig = self.key.sign(msg.encode(), self.padding.PKCS1v15(), self.hashes.SHA256())
        return msg + "." + b64url(sig)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def token_registry(work, plain):
    ts = TokenServer(work, "bob", "hunter2")
    proc, port = start_registry(work, "token", plain[1], f"""auth:
  token:
    realm: http://127.0.0.1:{ts.port}/token
    service: warren-test-registry
    issuer: warren-test-issuer
    rootcertbundle: {ts.bundle}
""")
    yield f"127.0.0.1:{port}", ts
    stop(proc)
    ts.close()


def test_bearer_token_flow(work, token_registry, image, daemons):
    host, ts = token_registry
    auth = creds_file(work, "token.json", host, "bob", "hunter2")
    d = daemons("--registry-auth", auth)
    r = pull(d, f"{host}/{image}", insecure=True)
    assert r.status == 201, r
    assert len(r.json()["layers"]) == 2
    # the token service was asked with the registry's credentials, for the
    # challenge's service and scope
    ok = [q for path, q, a in ts.requests if a == ts.want]
    assert ok and ok[0]["service"] == ["warren-test-registry"], ts.requests
    assert ok[0]["scope"] == ["repository:reg/small:pull"], ts.requests
    # wrong credentials: the token service's 401, said plainly
    bad = creds_file(work, "token-bad.json", host, "bob", "nope")
    d2 = daemons("--registry-auth", bad)
    r = pull(d2, f"{host}/{image}", insecure=True)
    assert r.status == 401, r
    assert "token service" in r.json()["error"]["message"], r


# ---------------------------------------------------------------- fetch on first use

class CountingProxy:
    """TCP proxy in front of a registry that records the request line of
    every connection (the client opens one per request)."""

    def __init__(self, upstream_port, hold=None):
        self.upstream = upstream_port
        # hold: a threading.Event blob requests wait for (a pull kept in flight)
        self.hold = hold
        self.lines = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        try:
            u = socket.create_connection(("127.0.0.1", self.upstream), timeout=60)
            first = c.recv(65536)
            line = first.split(b"\r\n", 1)[0].decode(errors="replace")
            with self.lock:
                self.lines.append(line)
            if self.hold is not None and "/blobs/" in line:
                self.hold.wait(600)
            u.sendall(first)
            self.relay(c, u)
        except OSError:
            pass
        finally:
            c.close()

    @staticmethod
    def pump(a, b):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def relay(self, c, u):
        """Bytes both ways between the client c and the upstream u until both close."""
        t = threading.Thread(target=self.pump, args=(u, c), daemon=True)
        t.start()
        self.pump(c, u)
        t.join(120)

    def count(self, needle):
        with self.lock:
            return sum(needle in l for l in self.lines)

    def close(self):
        self.closed = True
        self.sock.close()


def test_concurrent_creates_fetch_once(rootfs, work, plain, daemons):
    host, _ = plain
    p = os.path.join(work, "bb.tar")
    subprocess.run(["tar", "-C", rootfs, "--numeric-owner", "-cf", p, "."], check=True)
    with open(p, "rb") as f:
        bb = f.read()
    push(host, "reg/bb", "v1", [bb, tar_bytes([("hello", "file", "fetched once\n")])])
    proxy = CountingProxy(int(host.split(":")[1]))
    try:
        ref = f"127.0.0.1:{proxy.port}/reg/bb:v1"
        d = daemons("--registry-insecure", f"127.0.0.1:{proxy.port}")
        results = [None] * 20

        def create(i):
            results[i] = d.api.raw("POST", "/v1/sandboxes", {"image": ref}, timeout=600)
        ts = [threading.Thread(target=create, args=(i,)) for i in range(20)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(900)
        assert all(r is not None and r.status == 201 for r in results), \
            [r and (r.status, r.body[:300]) for r in results]
        # one manifest fetch and each blob once, however many creates waited
        assert proxy.count("/manifests/v1") == 1, proxy.lines
        assert proxy.count("/blobs/") == 3, proxy.lines  # config + 2 layers
        sid = results[0].json()["id"]
        out = d.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["cat", "/hello"]}).json()
        assert out["stdout"] == "fetched once\n", out
        for r in results:
            d.api.delete(r.json()["id"])
        # an unknown tag: every waiter gets the same clear error
        bad = f"127.0.0.1:{proxy.port}/reg/bb:nope"
        errs = [None] * 5

        def create_bad(i):
            errs[i] = d.api.raw("POST", "/v1/sandboxes", {"image": bad}, timeout=600)
        ts = [threading.Thread(target=create_bad, args=(i,)) for i in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(900)
        assert {e.status for e in errs} == {404}, [(e.status, e.body[:200]) for e in errs]
        # and the daemon that fetched stops cleanly: exit status 0 on SIGTERM
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=120) == 0, d.logtext()
        assert "AddressSanitizer" not in d.logtext(), d.logtext()
    finally:
        proxy.close()


def test_sigterm_during_a_pull_exits_cleanly(work, plain, image, daemons):
    """SIGTERM while a pull (a worker thread and its fetcher) is in flight:
    the daemon ends the fetcher, waits for the worker, answers the request
    and only then frees the store and exits 0 (the worker used to outlive
    the store it was writing to)."""
    host, _ = plain
    hold = threading.Event()
    proxy = CountingProxy(int(host.split(":")[1]), hold=hold)
    try:
        d = daemons()
        res = {}

        def do_pull():
            try:
                res["r"] = pull(d, f"127.0.0.1:{proxy.port}/{image}", insecure=True)
            except OSError as e:
                res["r"] = e
        t = threading.Thread(target=do_pull)
        t.start()
        deadline = time.time() + 300
        while proxy.count("/blobs/") == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert proxy.count("/blobs/") > 0, proxy.lines
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=120)
        t.join(120)
        assert d.proc.returncode == 0, (d.proc.returncode, d.logtext())
        assert "AddressSanitizer" not in d.logtext(), d.logtext()
        # the pull was ended and answered (503, the daemon is stopping)
        # before the daemon went, not dropped
        r = res.get("r")
        assert getattr(r, "status", None) == 503, r
        assert "stopping" in r.json()["error"]["message"], r
    finally:
        hold.set()
        proxy.close()


# ---------------------------------------------------------------- push

def push_api(d, ref, target, **kw):
    return d.api.raw("POST", "/v1/images/push", dict(ref=ref, target=target, **kw), timeout=600)


def test_push_then_create_on_another_node(rootfs, plain, daemons):
    """The cluster story: node A pushes, node B creates from HOST:PORT/NAME:TAG
    (fetch on first use) and gets the same layers; a second push uploads no
    blob."""
    host, _ = plain
    proxy = CountingProxy(int(host.split(":")[1]))
    try:
        a = daemons()
        r = a.api.raw("POST", "/v1/images/import", {"name": "bb:v1", "path": rootfs}, timeout=600)
        assert r.status == 201, r
        layers = r.json()["layers"]
        target = f"127.0.0.1:{proxy.port}/cluster/bb:v1"
        r = push_api(a, "bb:v1", target, insecure=True)
        assert r.status == 200, r
        res = r.json()
        assert res["uploaded"] == len(layers) + 1 and res["skipped"] == 0, res
        assert proxy.count("PUT /v2/cluster/bb/manifests/v1") == 1, proxy.lines
        # a node that does not trust the registry with EROFS layers (the
        # host kernel mounts them as they are) refuses them, storing nothing
        u = daemons("--registry-insecure", f"127.0.0.1:{proxy.port}")
        r = u.api.raw("POST", "/v1/sandboxes", {"image": target}, timeout=600)
        assert r.status == 403, r
        assert "--registry-trust-erofs 127.0.0.1:%d" % proxy.port in r.json()["error"]["message"], r
        assert not [i for i in u.api.raw("GET", "/v1/images").json()["images"]
                    if i["name"].endswith("cluster/bb:v1")]
        # node B trusts it: fetch on first use, the EROFS layers taken as they are
        b = daemons("--registry-insecure", f"127.0.0.1:{proxy.port}",
                    "--registry-trust-erofs", f"127.0.0.1:{proxy.port}")
        r = b.api.raw("POST", "/v1/sandboxes", {"image": target}, timeout=600)
        assert r.status == 201, r
        sid = r.json()["id"]
        out = b.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["echo", "hi"]}).json()
        assert out["stdout"] == "hi\n", out
        b.api.delete(sid)
        imgs = {i["name"]: i for i in b.api.raw("GET", "/v1/images").json()["images"]}
        pulled = [i for n, i in imgs.items() if n.endswith("cluster/bb:v1")]
        assert pulled and pulled[0]["layers"] == layers, imgs
        # a second push: every blob is there already (HEAD), none uploaded
        before = proxy.count("/blobs/uploads/")
        r = push_api(a, "bb:v1", target, insecure=True, stream=True)
        assert r.status == 200, r
        lines = [json.loads(x) for x in r.body.decode().splitlines()]
        assert lines[-1]["uploaded"] == 0 and lines[-1]["skipped"] == len(layers) + 1, lines
        assert proxy.count("/blobs/uploads/") == before, proxy.lines
        # the CLI and the SDK say the same
        c = a.cli("image", "push", "--json", "bb:v1", target, check=True)
        assert json.loads(c.stdout)["uploaded"] == 0, c.stdout
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
        import warren
        seen = []
        res = warren.Client("unix:" + a.sock).images.push(
            "bb:v1", target, insecure=True, progress=lambda *x: seen.append(x))
        assert res["uploaded"] == 0 and res["skipped"] == len(layers) + 1, res
        assert proxy.count("/blobs/uploads/") == before, proxy.lines
        # an unknown image is a 404, before any registry request
        n = len(proxy.lines)
        r = push_api(a, "nope:v1", target, insecure=True)
        assert r.status == 404, r
        assert len(proxy.lines) == n
    finally:
        proxy.close()


def test_push_with_auth(work, rootfs, tls_basic, daemons):
    host, ca = tls_basic
    good = creds_file(work, "push-good.json", host, "alice", "s3cret")
    d = daemons("--registry-ca", ca, "--registry-auth", good)
    src = os.path.join(work, "push-src.tar")
    with open(src, "wb") as f:
        f.write(tar_bytes([("pushed", "file", "with auth\n")]))
    r = d.api.raw("POST", "/v1/images/import", {"name": "small:v1", "path": src}, timeout=600)
    assert r.status == 201, r
    r = push_api(d, "small:v1", f"{host}/auth/small:v1")
    assert r.status == 200, r
    assert r.json()["uploaded"] == 2, r.json()
    # and back, on a node with the same credentials
    d2 = daemons("--registry-ca", ca, "--registry-auth", good, "--registry-trust-erofs",
                 host.split(":")[0])
    r = pull(d2, f"{host}/auth/small:v1")
    assert r.status == 201, r
    # wrong credentials: a clear 401
    bad = creds_file(work, "push-bad.json", host, "alice", "wrong")
    d3 = daemons("--registry-ca", ca, "--registry-auth", bad)
    r = d3.api.raw("POST", "/v1/images/import", {"name": "small:v1", "path": src}, timeout=600)
    assert r.status == 201, r
    r = push_api(d3, "small:v1", f"{host}/auth/other:v1")
    assert r.status == 401, r
    m = r.json()["error"]["message"]
    assert "credentials" in m and "refused" in m, m


# ---------------------------------------------------------------- proxies and mirrors

class ForwardProxy(CountingProxy):
    """An HTTP forward proxy: CONNECT (https) and absolute-form requests
    (plain http), recording the request line of every connection (the
    fetcher opens one per request)."""

    def __init__(self):
        super().__init__(None)
        self.url = f"http://127.0.0.1:{self.port}"

    def serve(self, c):
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                d = c.recv(65536)
                if not d:
                    return
                head += d
            line = head.split(b"\r\n", 1)[0].decode(errors="replace")
            with self.lock:
                self.lines.append(line)
            method, target, _ = line.split(" ", 2)
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                u = socket.create_connection((host, int(port)), timeout=60)
                c.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                rest = head.split(b"\r\n\r\n", 1)[1]
                if rest:
                    u.sendall(rest)
            else:
                # absolute form: the upstream (Go's net/http) takes it as it is
                p = urllib.parse.urlsplit(target)
                u = socket.create_connection((p.hostname, p.port or 80), timeout=60)
                u.sendall(head)
            self.relay(c, u)
            u.close()
        except (OSError, ValueError):
            pass
        finally:
            c.close()


@pytest.fixture
def forward_proxy():
    p = ForwardProxy()
    yield p
    p.close()


def test_pull_through_an_http_proxy(work, plain, image, daemons, forward_proxy, monkeypatch):
    """http_proxy in warrend's environment: a plain-HTTP pull goes through
    the proxy as absolute-form GETs (docs/images.md, Registry configuration)."""
    host, _ = plain
    monkeypatch.setenv("http_proxy", forward_proxy.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    d = daemons()
    r = pull(d, f"{host}/{image}", insecure=True)
    assert r.status == 201, r
    assert forward_proxy.count(f"GET http://{host}/v2/reg/small/manifests/v1") >= 1, \
        forward_proxy.lines
    assert forward_proxy.count(f"GET http://{host}/v2/reg/small/blobs/") == 3, forward_proxy.lines


def test_pull_through_an_https_proxy(work, tls_basic, image, daemons, forward_proxy, monkeypatch):
    """HTTPS_PROXY: a TLS pull (test CA, htpasswd) tunnels through the
    proxy with CONNECT; the credentials travel inside the tunnel."""
    host, ca = tls_basic
    auth = creds_file(work, "proxy.json", host, "alice", "s3cret")
    monkeypatch.setenv("HTTPS_PROXY", forward_proxy.url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    d = daemons("--registry-ca", ca, "--registry-auth", auth)
    r = pull(d, f"{host}/{image}")
    assert r.status == 201, r
    assert forward_proxy.count(f"CONNECT {host} ") >= 4, forward_proxy.lines  # manifest, 3 blobs
    assert all(l.startswith("CONNECT ") for l in forward_proxy.lines), forward_proxy.lines
    # without the variable, the same pull does not touch the proxy
    monkeypatch.delenv("HTTPS_PROXY")
    n = len(forward_proxy.lines)
    d2 = daemons("--registry-ca", ca, "--registry-auth", auth)
    assert pull(d2, f"{host}/{image}").status == 201
    assert len(forward_proxy.lines) == n, forward_proxy.lines


def test_pull_from_a_mirror_and_fallback_to_the_origin(work, plain, image, daemons):
    """--registry-mirror ORIGIN=MIRROR: a mirror that holds the image serves
    the whole pull (the origin, behind a counting proxy, sees nothing); a
    mirror that lacks it falls back to the origin."""
    host, _ = plain
    origin = CountingProxy(int(host.split(":")[1]))
    full = start_registry(work, "mirror-full", os.path.join(work, "mirror-full"))
    empty = start_registry(work, "mirror-empty", os.path.join(work, "mirror-empty"))
    try:
        mirror_host = f"127.0.0.1:{full[1]}"
        # the mirror's copy differs from the origin's: its layers tell who served it
        push(mirror_host, "reg/small", "v1",
                          [tar_bytes([("a", "file", "layer one\n")]),
                           tar_bytes([("m", "file", "from the mirror\n")])])
        ref = f"127.0.0.1:{origin.port}/{image}"
        d = daemons("--registry-mirror", f"127.0.0.1:{origin.port}={mirror_host}")
        r = pull(d, ref, insecure=True)
        assert r.status == 201, r
        assert origin.lines == [], origin.lines
        from_mirror = r.json()["layers"]
        # a mirror without the image: the origin serves the pull
        d2 = daemons("--registry-mirror", f"127.0.0.1:{origin.port}=127.0.0.1:{empty[1]}")
        r = pull(d2, ref, insecure=True)
        assert r.status == 201, r
        assert r.json()["layers"] != from_mirror and len(from_mirror) == 2, (r, from_mirror)
        assert origin.count("/manifests/v1") >= 1 and origin.count("/blobs/") == 3, origin.lines
        # a mirror with the manifest but not every blob (a cache half
        # filled): the manifest from the mirror, the missing blob from the origin
        pstore = os.path.join(work, "mirror-partial")
        partial = start_registry(work, "mirror-partial", pstore)
        try:
            phost = f"127.0.0.1:{partial[1]}"
            _, layers = push(phost, "reg/small", "v1", [tar_bytes([("a", "file", "layer one\n")]),
                                                        tar_bytes([("b", "file", "layer two\n")])])
            dg = layers[1].split(":")[1]
            os.unlink(os.path.join(pstore, "docker/registry/v2/blobs/sha256", dg[:2], dg, "data"))
            before = list(origin.lines)
            d3 = daemons("--registry-mirror", f"127.0.0.1:{origin.port}={phost}")
            r = pull(d3, ref, insecure=True)
            assert r.status == 201, r
            new = origin.lines[len(before):]
            assert [l for l in new if "/blobs/" in l] == [f"GET /v2/reg/small/blobs/{layers[1]} HTTP/1.1"], new
            assert not any("/manifests/" in l for l in new), new
        finally:
            stop(partial[0])
    finally:
        origin.close()
        stop(full[0])
        stop(empty[0])

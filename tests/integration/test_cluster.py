"""Cluster mode (docs/cluster.md): a real 3-member etcd cluster, two warrend
nodes and two warren-gateways on loopback, all started here.

Covers placement (a burst spreads over both nodes), routing by id through
either gateway (exec buffered and streamed, files, list, delete), the CLI
against a gateway (node ls / drain, project create), quotas under two racing
gateways, and a killed node leaving placement when its lease expires.
Everything polls with generous deadlines; no sleep decides pass or fail."""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from conftest import BUILD, need, start_daemon
from test_http_limits import MiB, read_response, reset_peak, status_of

ETCD = "/usr/bin/etcd"
ADMIN = "admin-token-0123456789abcdef"
NODE_TOKEN = "node-token-0123456789abcdef"
LEASE_TTL = 5


from wr import free_port  # noqa: E402,F401 (one definition, re-exported)


def wait_for(what, fn, timeout=30.0, interval=0.05):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
            if last:
                return last
        except OSError as e:
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Http:
    """Bearer-token JSON client for a TCP endpoint (gateway or node)."""

    def __init__(self, port, token):
        self.port = port
        self.token = token

    def raw(self, method, path, body=None, timeout=60, token=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            c.request(method, path, body=body,
                      headers={"Authorization": "Bearer " + (token or self.token)})
            r = c.getresponse()
            data = r.read()
            return r.status, (json.loads(data) if data and r.getheader("Content-Type", "").startswith(
                "application/json") else data)
        finally:
            c.close()


class MemberExited(AssertionError):
    pass


class Etcd:
    def __init__(self, n=3):
        self.dir = tempfile.mkdtemp(prefix="wr-etcd-", dir=os.environ.get("TMPDIR", "/var/tmp"))
        self.procs = {}
        # A port free when picked can still be taken by another listener on
        # the host before a member binds it: that member exits at once, and
        # the whole cluster starts again on new ports.
        for attempt in range(3):
            self.members = []
            for i in range(n):
                self.members.append({"name": f"e{i}", "client": free_port(), "peer": free_port()})
            cluster = ",".join(f"{m['name']}=http://127.0.0.1:{m['peer']}" for m in self.members)
            self.cluster = cluster
            for m in self.members:
                self.start(m, cluster)
            self.urls = ",".join(f"http://127.0.0.1:{m['client']}" for m in self.members)
            try:
                for m in self.members:
                    wait_for(f"etcd {m['name']} healthy", lambda m=m: self.up(m), timeout=60)
                return
            except MemberExited:
                if attempt == 2:
                    raise
                self.kill_all()

    def up(self, m):
        p = self.procs[m["name"]]
        if p.poll() is not None:
            raise MemberExited(f"etcd {m['name']} exited {p.returncode}: " + open(
                os.path.join(self.dir, m["name"] + ".log"), errors="replace").read()[-1500:])
        return self.healthy(m)

    def kill_all(self):
        for name, p in self.procs.items():
            if p.poll() is None:
                p.kill()
            p.wait()
            shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
            os.unlink(os.path.join(self.dir, name + ".log"))
        self.procs = {}

    def start(self, m, cluster):
        log = open(os.path.join(self.dir, m["name"] + ".log"), "ab")
        self.procs[m["name"]] = subprocess.Popen([
            ETCD, "--name", m["name"], "--data-dir", os.path.join(self.dir, m["name"]),
            "--listen-client-urls", f"http://127.0.0.1:{m['client']}",
            "--advertise-client-urls", f"http://127.0.0.1:{m['client']}",
            "--listen-peer-urls", f"http://127.0.0.1:{m['peer']}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{m['peer']}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "warren-test"], stdout=log, stderr=log)

    def stop_member(self, i):
        p = self.procs[self.members[i]["name"]]
        p.terminate()
        p.wait(timeout=30)

    def start_member(self, i):
        m = self.members[i]
        self.start(m, self.cluster)  # an existing data dir: the initial-* flags are ignored
        wait_for(f"etcd {m['name']} healthy again", lambda: self.healthy(m), timeout=60)

    def healthy(self, m):
        c = http.client.HTTPConnection("127.0.0.1", m["client"], timeout=5)
        try:
            c.request("GET", "/health")
            return json.loads(c.getresponse().read()).get("health") == "true"
        finally:
            c.close()

    def get(self, key):
        """(value dict or None, version) of one key, through etcd's JSON gateway."""
        import base64
        m = self.members[0]
        c = http.client.HTTPConnection("127.0.0.1", m["client"], timeout=10)
        try:
            c.request("POST", "/v3/kv/range", body=json.dumps(
                {"key": base64.b64encode(key.encode()).decode()}))
            kvs = json.loads(c.getresponse().read()).get("kvs", [])
        finally:
            c.close()
        if not kvs:
            return None, 0
        return json.loads(base64.b64decode(kvs[0]["value"])), int(kvs[0].get("version", 0))

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Gateway:
    def __init__(self, urls, tokdir, *extra):
        self.port = free_port()
        self.log_path = os.path.join(tokdir, f"gateway-{self.port}.log")
        self.proc = subprocess.Popen([
            os.path.join(os.path.abspath(BUILD), "bin", "warren-gateway"), "--cluster", urls,
            "--listen", f"tcp:127.0.0.1:{self.port}", "--token-file", os.path.join(tokdir, "admin"),
            "--node-token-file", os.path.join(tokdir, "node")] + list(extra),
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        self.api = Http(self.port, ADMIN)
        try:
            wait_for("gateway healthy and synced", self.synced, timeout=30)
        except AssertionError as e:
            # never leave it running: the test fails with its log
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            raise AssertionError(f"{e}; gateway log: " + open(self.log_path).read()[-2000:])

    def synced(self):
        if self.proc.poll() is not None:
            raise AssertionError("warren-gateway exited: " + open(self.log_path).read()[-2000:])
        st, j = self.api.raw("GET", "/healthz", timeout=5)
        return st == 200 and j["synced"] and j["control_plane"] == "ok"

    def nodes(self):
        st, j = self.api.raw("GET", "/v1/nodes")
        assert st == 200, j
        return {n["name"]: n for n in j["nodes"]}

    def cli(self, *args, token=ADMIN, check=True):
        env = dict(os.environ, WARREN_HOST=f"http://127.0.0.1:{self.port}", WARREN_TOKEN=token)
        r = subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren")] + list(args),
                           capture_output=True, timeout=120, env=env)
        if check:
            assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
        return r

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("warren-gateway did not stop within 30 s of SIGTERM")
            log = open(self.log_path, errors="replace").read()
            assert self.proc.returncode == 0, log[-2000:]
            # under ASan/UBSan any report fails the module
            assert "AddressSanitizer" not in log and "runtime error" not in log, log[-4000:]


@pytest.fixture(scope="module")
def cluster(rootfs):
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    tokdir = tempfile.mkdtemp(prefix="wr-cl-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    for name, tok in (("admin", ADMIN), ("node", NODE_TOKEN)):
        with open(os.path.join(tokdir, name), "w") as f:
            f.write(tok + "\n")
    etcd = Etcd(3)
    nodes, gws = {}, []
    try:
        for name, zone in (("node-a", "a"), ("node-b", "b")):
            port = free_port()
            d = start_daemon(rootfs, [
                "--listen", f"tcp:127.0.0.1:{port}", "--token-file", os.path.join(tokdir, "node"),
                "--cluster", etcd.urls, "--node-name", name,
                "--advertise", f"http://127.0.0.1:{port}", "--label", f"zone={zone}",
                "--lease-ttl", str(LEASE_TTL)])
            nodes[name] = d
        gws = [Gateway(etcd.urls, tokdir), Gateway(etcd.urls, tokdir)]
        for g in gws:
            wait_for("both nodes ready on a gateway",
                     lambda g=g: all(n["state"] == "ready" for n in g.nodes().values())
                     and len(g.nodes()) == 2)
        yield {"etcd": etcd, "nodes": nodes, "gws": gws, "tokdir": tokdir}
    finally:
        keep = os.environ.get("WARREN_CLUSTER_LOGS")  # a directory to keep the logs in
        for g in gws:
            g.stop()
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copy(g.log_path, keep)
        for name, d in nodes.items():
            if d.proc and d.proc.poll() is None:
                d.stop()
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copy(os.path.join(d.root, "warrend.log"), os.path.join(keep, name + ".log"))
            shutil.rmtree(d.root, ignore_errors=True)
        etcd.stop()
        shutil.rmtree(tokdir, ignore_errors=True)


def node_of(sid):
    return sid[:-13]


def all_ready(cluster):
    """Both nodes registered on both gateways (a test about placement starts here)."""
    for g in cluster["gws"]:
        wait_for("both nodes ready", lambda g=g: [n["state"] for n in g.nodes().values()]
                 == ["ready", "ready"], timeout=60)


def test_node_ls(cluster):
    g = cluster["gws"][0]
    listed = json.loads(g.cli("node", "ls", "--json").stdout)
    by = {n["name"]: n for n in listed}
    assert set(by) == {"node-a", "node-b"}
    for name, n in by.items():
        assert n["state"] == "ready"
        assert n["labels"]["zone"] == name[-1]
        assert n["address"].startswith("http://127.0.0.1:")
        assert "container" in n["backends"] and n["memory_free_mb"] > 0
    table = g.cli("node", "ls").stdout.decode()
    assert "node-a" in table and "node-b" in table and "zone=a" in table
    # a project token is not an admin token
    st, _ = g.api.raw("GET", "/v1/nodes", token="wrp_" + "0" * 64)
    assert st == 401


def test_placement_spreads_and_any_gateway_routes(cluster):
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    ids = []
    for _ in range(10):
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 256})
        assert st == 201, j
        ids.append(j["id"])
    try:
        assert {node_of(i) for i in ids} == {"node-a", "node-b"}, ids
        for sid in ids:
            # ids are plain sandbox ids for every client
            assert all(c.isdigit() or c.islower() or c == "-" for c in sid) and len(sid) <= 32
            st, r = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["hostname"]})
            assert st == 200 and r["exit_code"] == 0, (sid, r)
        sid = ids[0]
        st, r = g1.api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/f", body=b"\x00\xffbin")
        assert st == 201, r
        st, data = g2.api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/f")
        assert st == 200 and data == b"\x00\xffbin"
        st, lst = g2.api.raw("GET", "/v1/sandboxes")
        assert st == 200 and set(ids) <= {s["id"] for s in lst["sandboxes"]}
        st, one = g2.api.raw("GET", f"/v1/sandboxes/{ids[1]}")
        assert st == 200 and one["id"] == ids[1]
        # unknown node, malformed id: clean 404s
        assert g1.api.raw("GET", "/v1/sandboxes/nope-0123456789ab")[0] == 404
        assert g1.api.raw("GET", "/v1/sandboxes/0123456789abcdef")[0] == 404
    finally:
        for sid in ids:
            st, _ = g2.api.raw("DELETE", f"/v1/sandboxes/{sid}")
            assert st == 204
    for sid in ids:
        st, j = g1.api.raw("GET", f"/v1/sandboxes/{sid}")
        assert st == 404, j


def test_python_sdk_through_gateway(cluster):
    """The SDK works unchanged against a gateway, sync and async."""
    import asyncio
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import warren
    g1, g2 = cluster["gws"]
    with warren.Client(f"http://127.0.0.1:{g1.port}", token=ADMIN) as c:
        with c.create(memory_mb=64) as sb:
            assert node_of(sb.id) in ("node-a", "node-b")
            r = sb.exec(["sh", "-c", "echo hi; exit 3"])
            assert r.exit_code == 3 and r.stdout == "hi\n"
            sb.write_file("/tmp/x", b"\x00\x01")
            with warren.Client(f"http://127.0.0.1:{g2.port}", token=ADMIN) as c2:
                assert c2.get(sb.id).read_file("/tmp/x") == b"\x00\x01"

    async def burst():
        async with warren.AsyncClient(f"http://127.0.0.1:{g2.port}", token=ADMIN) as ac:
            async def one(i):
                async with ac.create(memory_mb=64) as sb:
                    return (await sb.exec(f"echo {i}")).stdout, sb.id
            return await asyncio.gather(*(one(i) for i in range(8)))

    out = asyncio.run(burst())
    assert [o for o, _ in out] == [f"{i}\n" for i in range(8)]
    assert {node_of(sid) for _, sid in out} == {"node-a", "node-b"}


def test_stream_passes_through_unbuffered(cluster):
    g1, g2 = cluster["gws"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {})
    assert st == 201
    sid = j["id"]
    try:
        c = http.client.HTTPConnection("127.0.0.1", g2.port, timeout=60)
        t0 = time.time()
        c.request("POST", f"/v1/sandboxes/{sid}/exec", body=json.dumps(
            {"shell": "echo first; sleep 3; echo second", "stream": True}),
            headers={"Authorization": "Bearer " + ADMIN})
        r = c.getresponse()
        assert r.status == 200
        first = json.loads(r.readline())
        t_first = time.time() - t0
        rest = [json.loads(line) for line in r.read().splitlines() if line.strip()]
        t_all = time.time() - t0
        c.close()
        assert first == {"stream": "stdout", "data": "first\n"}, first
        assert rest[-1]["exit_code"] == 0 and any(e.get("data") == "second\n" for e in rest)
        # the first line came through while the command was still sleeping
        assert t_first < t_all - 1.5, (t_first, t_all)
        # the CLI's streaming exec through the other gateway
        r = g1.cli("exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3", check=False)
        assert r.returncode == 3 and r.stdout == b"out\n" and r.stderr == b"err\n", r
    finally:
        g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")


def test_gateway_overhead(cluster):
    """Figures for docs/cluster.md: the same work direct to node-a and through
    a gateway (placed on node-a by label), before any project exists (with
    projects a delete reads the sandbox first). Loose bounds: this is a
    shared, noisy machine; the printed ratios are the point."""
    g1 = cluster["gws"][0]
    node = cluster["nodes"]["node-a"]
    direct = Http(int(node.extra[node.extra.index("--listen") + 1].rsplit(":", 1)[1]), NODE_TOKEN)

    def create_destroy(api, body, n=30):
        t0 = time.time()
        for _ in range(n):
            st, j = api.raw("POST", "/v1/sandboxes", body)
            assert st == 201, j
            assert api.raw("DELETE", f"/v1/sandboxes/{j['id']}")[0] == 204
        return n / (time.time() - t0)

    def exec_p50(api, sid, n=40):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            st, r = api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
            times.append(time.perf_counter() - t0)
            assert st == 200 and r["exit_code"] == 0
        return sorted(times)[n // 2]

    rate_direct = create_destroy(direct, {"memory_mb": 128})
    rate_gw = create_destroy(g1.api, {"memory_mb": 128, "node_labels": {"zone": "a"}})
    st, j = direct.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
    sid = j["id"]
    try:
        p50_direct = exec_p50(direct, sid)
        p50_gw = exec_p50(g1.api, sid)
    finally:
        direct.raw("DELETE", f"/v1/sandboxes/{sid}")
    print(f"gateway overhead: create+destroy {rate_direct:.1f}/s direct, {rate_gw:.1f}/s through "
          f"a gateway ({rate_gw / rate_direct:.2f}x); exec p50 {p50_direct * 1000:.2f} ms direct, "
          f"{p50_gw * 1000:.2f} ms through a gateway ({p50_gw / p50_direct:.2f}x)")
    assert rate_gw > 0.2 * rate_direct and p50_gw < 5 * p50_direct + 0.05


def test_cli_create_exec_rm_through_gateway(cluster):
    g1, g2 = cluster["gws"]
    sid = g1.cli("create").stdout.decode().strip()
    assert node_of(sid) in ("node-a", "node-b")
    assert g2.cli("exec", sid, "--", "echo", "hi").stdout == b"hi\n"
    assert sid in g2.cli("ls").stdout.decode()
    g2.cli("rm", sid)
    assert sid not in g1.cli("ls").stdout.decode()


def test_drain(cluster):
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    g1.cli("node", "drain", "node-b")
    try:
        for g in (g1, g2):
            wait_for("node-b drained on every gateway", lambda g=g: g.nodes()["node-b"]["state"] == "drained")
        ids = []
        for _ in range(6):
            st, j = (g2 if len(ids) % 2 else g1).api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
            assert st == 201, j
            ids.append(j["id"])
        assert {node_of(i) for i in ids} == {"node-a"}, ids
        # a drained node keeps serving its sandboxes
        for sid in ids:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")
    finally:
        g1.cli("node", "undrain", "node-b")
    for g in (g1, g2):
        wait_for("node-b ready again", lambda g=g: g.nodes()["node-b"]["state"] == "ready")


def test_placement_prefers_nodes_with_the_image(cluster, rootfs):
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    a = cluster["nodes"]["node-a"]
    r = a.api.raw("POST", "/v1/images/import", {"name": "only-a:1", "path": rootfs}, timeout=300)
    assert r.status == 201, r
    for g in (g1, g2):
        wait_for("node-a publishes its new image",
                 lambda g=g: "only-a:1" in g.nodes()["node-a"].get("images", []), timeout=30)
    st, imgs = g2.api.raw("GET", "/v1/images")
    where = {i["name"]: sorted(i["nodes"]) for i in imgs["images"]}
    assert where["only-a:1"] == ["node-a"] and where["busybox:latest"] == ["node-a", "node-b"], where
    assert b"only-a:1" in g1.cli("image", "ls").stdout
    ids = []
    try:
        for i in range(6):
            st, j = cluster["gws"][i % 2].api.raw("POST", "/v1/sandboxes", {"image": "only-a:1"})
            assert st == 201, (i, j)
            ids.append(j["id"])
        assert {node_of(i) for i in ids} == {"node-a"}, ids
    finally:
        for sid in ids:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")


def test_idempotency_key_never_makes_two(cluster):
    g1, g2 = cluster["gws"]
    st, first = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "idempotency_key": "k-1"})
    assert st == 201, first
    try:
        # a retry through the other gateway gets the same sandbox back
        st, again = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "idempotency_key": "k-1"})
        assert st == 200 and again["id"] == first["id"], again
        # racing retries: one sandbox whatever the interleaving
        results = []
        lock = threading.Lock()

        def create(g):
            r = g.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "idempotency_key": "k-2"})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=create, args=(cluster["gws"][i % 2],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        ids = {j["id"] for st, j in results if st in (200, 201)}
        assert len(ids) == 1, results
        assert all(st in (200, 201, 409) for st, _ in results), results
        st, lst = g1.api.raw("GET", "/v1/sandboxes")
        made = [x for x in lst["sandboxes"] if x["labels"].get("warren.idem") == "k-2"]
        assert len(made) == 1, made
        g2.api.raw("DELETE", f"/v1/sandboxes/{made[0]['id']}")
    finally:
        g1.api.raw("DELETE", f"/v1/sandboxes/{first['id']}")


def test_killed_gateways_idempotency_claim_expires(cluster):
    """kill -9 of a gateway after it claimed an idempotency key and before
    the node answered: the claim was under the gateway's session lease, so it
    expires within seconds (not hours of 409), and a retry through another
    gateway gets one sandbox on the node the first attempt went to (the first
    attempt's own if the node made it after the gateway died)."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    etcd = cluster["etcd"]
    node = cluster["nodes"]["node-a"]
    key = f"k-orphan-{os.getpid()}"
    body = {"memory_mb": 64, "idempotency_key": key, "node_labels": {"zone": "a"}}
    gc = Gateway(etcd.urls, cluster["tokdir"])
    first = []

    def first_attempt():
        try:
            first.append(gc.api.raw("POST", "/v1/sandboxes", body, timeout=60))
        except (OSError, http.client.HTTPException) as e:
            first.append(e)  # the gateway died under it

    made = None
    os.kill(node.proc.pid, signal.SIGSTOP)  # the create waits on the node
    stopped = True
    try:
        t = threading.Thread(target=first_attempt)
        t.start()
        wait_for("the key claimed by the third gateway",
                 lambda: (etcd.get("/warren-idem/" + key)[0] or {}).get("node") == "node-a")
        claim = etcd.get("/warren-idem/" + key)[0]
        assert "gw" in claim and "id" not in claim, claim
        gc.proc.kill()
        gc.proc.wait()
        os.kill(node.proc.pid, signal.SIGCONT)
        stopped = False
        t.join(60)
        assert first and not isinstance(first[0], tuple), first  # never answered

        answers = []

        def retry():
            st, j = g1.api.raw("POST", "/v1/sandboxes", body)
            answers.append(st)
            assert st in (200, 201, 409), (st, j)
            if st == 409:
                return False
            first[:] = [j]
            return True
        # before the change the claim lived two hours: every retry got 409
        wait_for("a retry through a live gateway succeeds", retry, timeout=60, interval=0.5)
        made = first[0]["id"]
        assert node_of(made) == "node-a", first
        st, lst = g2.api.raw("GET", "/v1/sandboxes")
        ours = [x["id"] for x in lst["sandboxes"] if x["labels"].get("warren.idem") == key]
        assert ours == [made], (ours, answers)

        def settled():
            # every retry answers the one sandbox; once the dead gateway's
            # claim is gone, one of them records it under the retention lease
            st, j = g2.api.raw("POST", "/v1/sandboxes", body)
            # 409 "still in progress; retry" while the retry's own claim is
            # being recorded with its sandbox; never another sandbox
            assert st in (200, 409) and (st == 409 or j["id"] == made), (st, j)
            claim = etcd.get("/warren-idem/" + key)[0] or {}
            return st == 200 and claim.get("id") == made and claim
        claim = wait_for("the claim settled with the sandbox", settled, timeout=60, interval=0.5)
        # the settled claim names the sandbox's node: later retries find it
        # there (it once recorded node "" and every later retry got 409)
        assert claim.get("node") == "node-a", claim
        for _ in range(3):
            st, j = g1.api.raw("POST", "/v1/sandboxes", body)
            assert st == 200 and j["id"] == made, (st, j)
    finally:
        if stopped:
            os.kill(node.proc.pid, signal.SIGCONT)
        if gc.proc.poll() is None:
            gc.proc.kill()
            gc.proc.wait()
        st, lst = g1.api.raw("GET", "/v1/sandboxes")
        for x in lst["sandboxes"]:
            if x["labels"].get("warren.idem") == key:
                g1.api.raw("DELETE", f"/v1/sandboxes/{x['id']}")


def test_calls_through_gateway(cluster):
    g1, g2 = cluster["gws"]
    for g in (g1, g2):
        st, r = g.api.raw("POST", "/v1/calls", {"image": "busybox:latest", "cmd": ["echo", "hi"]},
                          timeout=120)
        assert st == 200 and r["exit_code"] == 0 and r["stdout"] == "hi\n", r
    r = g1.cli("call", "--", "sh", "-c", "echo via-cli", check=False)
    assert r.returncode == 0 and r.stdout == b"via-cli\n", r


def test_labels_select_nodes(cluster):
    all_ready(cluster)
    g1 = cluster["gws"][0]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "b"}})
    assert st == 201 and node_of(j["id"]) == "node-b", j
    g1.api.raw("DELETE", f"/v1/sandboxes/{j['id']}")
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "nowhere"}})
    assert st == 503 and j["error"]["code"] == "unavailable", j


def test_project_quota_holds_under_racing_gateways(cluster):
    g1, g2 = cluster["gws"]
    etcd = cluster["etcd"]
    token = g1.cli("project", "create", "race", "--max-sandboxes", "5").stdout.decode().strip()
    assert token.startswith("wrp_")
    r = g2.cli("project", "create", "race", "--max-sandboxes", "5", check=False)
    assert r.returncode != 0 and b"exists" in r.stderr
    for g in (g1, g2):
        wait_for("the project token on every gateway",
                 lambda g=g: g.api.raw("GET", "/healthz", token=token)[0] == 200)
    results = []
    lock = threading.Lock()

    def create(g):
        st, j = g.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        with lock:
            results.append((st, j))

    threads = [threading.Thread(target=create, args=(cluster["gws"][i % 2],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    made = [j["id"] for st, j in results if st == 201]
    refused = [j for st, j in results if st != 201]
    try:
        assert len(made) == 5, results
        assert all(j["error"]["code"] == "resource_exhausted" for j in refused), refused
        counter, _ = etcd.get("/warren-quota/race")
        assert counter["sandboxes"] <= 5, counter
        # the project sees its own sandboxes only; the admin sees them too
        st, lst = g2.api.raw("GET", "/v1/sandboxes", token=token)
        assert st == 200 and sorted(s["id"] for s in lst["sandboxes"]) == sorted(made)
        assert all(s["labels"]["warren.project"] == "race" for s in lst["sandboxes"])
    finally:
        # deleted through the other gateways: slots come back for everyone
        for i, sid in enumerate(made):
            st, _ = cluster["gws"][i % 2].api.raw("DELETE", f"/v1/sandboxes/{sid}", token=token)
            assert st == 204
    # unused reserves flow back to etcd; then either gateway can use all 5 again
    wait_for("the quota counter back to 0",
             lambda: (etcd.get("/warren-quota/race")[0] or {}).get("sandboxes", 0) == 0, timeout=30)
    for g in (g1, g2):
        st, j = g.api.raw("GET", "/v1/projects")
        assert st == 200 and j["projects"][0]["reserve"]["sandboxes"] == 0, j
    again = []
    try:
        for i in range(5):
            st, j = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
            assert st == 201, j
            again.append(j["id"])
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        if st == 201:
            again.append(j["id"])
        assert st == 429 and j["error"]["code"] == "resource_exhausted", j
    finally:
        for sid in again:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}", token=token)


def test_quota_chunks_spare_etcd(cluster):
    """Creates reserve quota in chunks: far fewer etcd writes than creates."""
    g1 = cluster["gws"][0]
    etcd = cluster["etcd"]
    token = g1.cli("project", "create", "bulk", "--max-sandboxes", "400",
                   "--max-memory", "100000").stdout.decode().strip()
    wait_for("token known", lambda: g1.api.raw("GET", "/healthz", token=token)[0] == 200)
    made = []
    try:
        for _ in range(32):
            st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
            assert st == 201, j
            made.append(j["id"])
        counter, writes = etcd.get("/warren-quota/bulk")
        # default chunk 16 slots: two reservations for 32 creates
        assert writes <= 4, (writes, counter)
        assert 32 <= counter["sandboxes"] <= 400 and counter["memory_mb"] <= 100000, counter
        st, text = g1.api.raw("GET", "/metrics")
        assert st == 200
        metrics = dict(line.rsplit(" ", 1) for line in text.decode().splitlines()
                       if line and not line.startswith("#"))
        assert int(metrics["warren_gateway_creates_total"]) >= 32, metrics
        assert metrics['warren_gateway_nodes{state="ready"}'] == "2", metrics
        print(f"quota: 32 creates, {writes} etcd writes on the quota counter "
              f"({writes / 32:.3f} per create)")
    finally:
        for sid in made:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}", token=token)


def test_job_pause_resume_across_nodes(cluster):
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    ids = []
    for i in range(4):
        st, j = cluster["gws"][i % 2].api.raw("POST", "/v1/sandboxes",
                                              {"memory_mb": 128, "job": "train-1"})
        assert st == 201, j
        ids.append(j["id"])
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
    other = j["id"]
    try:
        assert {node_of(i) for i in ids} == {"node-a", "node-b"}, ids
        st, r = g2.api.raw("POST", "/v1/jobs/train-1/pause")
        assert st == 200 and r["sandboxes"] == 4 and r["failed"] == 0, r
        for sid in ids:
            assert g1.api.raw("GET", f"/v1/sandboxes/{sid}")[1]["state"] == "paused"
        assert g1.api.raw("GET", f"/v1/sandboxes/{other}")[1]["state"] == "running"
        # the job's state lives on the nodes: it survives a node daemon restart
        node = cluster["nodes"][node_of(ids[0])]
        node.kill9()
        node.start()
        for g in (g1, g2):
            wait_for("node back", lambda g=g: g.nodes()[node_of(ids[0])]["state"] == "ready"
                     and g.api.raw("GET", f"/v1/sandboxes/{ids[0]}")[0] == 200, timeout=60)
        assert g2.api.raw("GET", f"/v1/sandboxes/{ids[0]}")[1]["state"] == "paused"
        # any exec or file request resumes a paused sandbox first
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{ids[0]}/exec", {"shell": "echo back"})
        assert st == 200 and r["stdout"] == "back\n", r
        assert g1.api.raw("GET", f"/v1/sandboxes/{ids[0]}")[1]["state"] == "running"
        st, data = g1.api.raw("GET", f"/v1/sandboxes/{ids[1]}/files?path=/etc/hostname")
        assert st == 200, data
        st, r = g1.api.raw("POST", "/v1/jobs/train-1/resume")
        assert st == 200 and r["sandboxes"] == 4 and r["failed"] == 0, r
        for sid in ids:
            assert g2.api.raw("GET", f"/v1/sandboxes/{sid}")[1]["state"] == "running"
    finally:
        for sid in ids + [other]:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")


def test_one_etcd_member_down(cluster):
    """Every client fails over: registration, watches, drains, quotas."""
    g1, g2 = cluster["gws"]
    etcd = cluster["etcd"]
    etcd.stop_member(0)
    ids = []
    try:
        for i in range(4):
            st, j = cluster["gws"][i % 2].api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
            assert st == 201, j
            ids.append(j["id"])
        for sid in ids:
            st, r = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
            assert st == 200 and r["exit_code"] == 0, r
        # a drain reaches every gateway through the watches that moved members
        g1.cli("node", "drain", "node-a")
        for g in (g1, g2):
            wait_for("drain seen", lambda g=g: g.nodes()["node-a"]["state"] == "drained")
        g2.cli("node", "undrain", "node-a")
        for g in (g1, g2):
            wait_for("undrain seen", lambda g=g: g.nodes()["node-a"]["state"] == "ready")
        token = g2.cli("project", "create", "onedown", "--max-sandboxes", "2").stdout.decode().strip()
        wait_for("token known", lambda: g1.api.raw("GET", "/healthz", token=token)[0] == 200)
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        assert st == 201, j
        ids.append(j["id"])
        # the nodes keep their leases alive through the other members
        assert all(n["state"] == "ready" for n in g1.nodes().values())
    finally:
        for sid in ids:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")
        etcd.start_member(0)


def test_quorum_lost_creates_fail_fast(cluster):
    """Two of three members down: running sandboxes work through either
    gateway, creates are refused at once; all is back when quorum is."""
    g1, g2 = cluster["gws"]
    etcd = cluster["etcd"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
    assert st == 201, j
    sid = j["id"]
    etcd.stop_member(1)
    etcd.stop_member(2)
    try:
        for g in (g1, g2):
            wait_for("the gateway notices", lambda g=g: g.api.raw("GET", "/healthz")[1][
                "control_plane"] == "unavailable", timeout=30)
        t0 = time.time()
        st, j = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
        assert st == 503 and j["error"]["code"] == "control_plane_unavailable", j
        assert j["infra_failure"] is True
        assert time.time() - t0 < 2
        for g in (g1, g2):
            st, r = g.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo ok"})
            assert st == 200 and r["stdout"] == "ok\n", r
    finally:
        etcd.start_member(1)
        etcd.start_member(2)
    for g in (g1, g2):
        wait_for("control plane back", g.synced, timeout=60)
    st, j = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
    assert st == 201, j
    for x in (sid, j["id"]):
        g1.api.raw("DELETE", f"/v1/sandboxes/{x}")


def test_stopped_node_fails_waiting_requests(cluster):
    """A node that stops answering (SIGSTOP: its connections stay open, like a
    partition) loses its lease; requests waiting on it fail with node_lost
    instead of hanging, and it comes back when it runs again."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    node = cluster["nodes"]["node-b"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "b"}})
    assert st == 201, j
    sid = j["id"]
    out = {}

    def long_exec():
        t0 = time.time()
        out["resp"] = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec",
                                 {"shell": "sleep 120", "timeout_s": 200}, timeout=180)
        out["secs"] = time.time() - t0

    t = threading.Thread(target=long_exec)
    t.start()
    time.sleep(0.5)  # lets the exec reach the node; the assertion below does not depend on it
    node.proc.send_signal(signal.SIGSTOP)
    try:
        t.join(LEASE_TTL + 60)
        assert not t.is_alive(), "the exec still waits on a stopped node"
        st, j = out["resp"]
        assert st == 503 and j["error"]["code"] == "node_lost" and j["infra_failure"], j
        assert out["secs"] < LEASE_TTL + 15, out["secs"]
        print(f"stopped node: waiting exec failed with node_lost after {out['secs']:.1f}s")
    finally:
        node.proc.send_signal(signal.SIGCONT)
    for g in (g1, g2):
        wait_for("node-b back, saying it was lost",
                 lambda g=g: g.nodes()["node-b"]["state"] == "ready"
                 and g.nodes()["node-b"].get("lost_at"), timeout=60)
    # the cluster told its clients node_lost: the old sandbox is not resurrected silently
    st, r = g1.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
    assert st == 410 and r["error"]["code"] == "node_lost" and r["infra_failure"], r
    st, r = g2.api.raw("GET", f"/v1/sandboxes/{sid}")
    assert st == 200 and r["state"] == "lost" and r["infra_failure"], r
    assert g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")[0] == 204
    # sandboxes made after its return work
    st, j = g2.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "b"}})
    assert st == 201, j
    st, r = g1.api.raw("POST", f"/v1/sandboxes/{j['id']}/exec", {"cmd": ["true"]})
    assert st == 200 and r["exit_code"] == 0, r
    g1.api.raw("DELETE", f"/v1/sandboxes/{j['id']}")


def test_killed_node_leaves_placement(cluster):
    """Last: kills node-b. Its lease expires, gateways stop placing there,
    requests for its sandboxes fail fast with node_lost."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "b"}})
    assert st == 201
    lost_id = j["id"]
    # g1 lists once while node-b answers: it keeps that list for when the node is gone
    st, j = g1.api.raw("GET", "/v1/sandboxes")
    assert st == 200 and lost_id in [s["id"] for s in j["sandboxes"]], j
    t0 = time.time()
    cluster["nodes"]["node-b"].kill9()
    for g in (g1, g2):
        wait_for("node-b lost", lambda g=g: g.nodes()["node-b"]["state"] == "lost",
                 timeout=LEASE_TTL + 30)
    elapsed = time.time() - t0
    print(f"node loss: kill -9 to lost on both gateways in {elapsed:.1f}s (lease TTL {LEASE_TTL}s)")
    assert elapsed < LEASE_TTL + 10, elapsed
    # the list names the lost node and reports its last known sandboxes lost
    st, j = g1.api.raw("GET", "/v1/sandboxes")
    assert st == 200 and "node-b" in j.get("nodes_lost", []), j
    listed = {s["id"]: s for s in j["sandboxes"]}
    assert listed[lost_id]["state"] == "lost" and listed[lost_id]["infra_failure"] is True, j
    ids = []
    new_b = None
    try:
        for i in range(6):
            st, j = cluster["gws"][i % 2].api.raw("POST", "/v1/sandboxes", {"memory_mb": 128})
            assert st == 201, j
            ids.append(j["id"])
        assert {node_of(i) for i in ids} == {"node-a"}
        t1 = time.time()
        st, j = g2.api.raw("POST", f"/v1/sandboxes/{lost_id}/exec", {"cmd": ["true"]})
        assert st == 503 and j["error"]["code"] == "node_lost" and j["infra_failure"] is True, j
        assert time.time() - t1 < 5
        # Back up after its lease expired: the daemon finds its old lease gone
        # (the cluster declared the node lost) and says so. Its old sandbox,
        # adopted again, is reported lost, not resurrected; new ones work.
        cluster["nodes"]["node-b"].start()
        for g in (g1, g2):
            wait_for("node-b back", lambda g=g: g.nodes()["node-b"]["state"] == "ready",
                     timeout=60)
        assert "expired while no daemon ran" in cluster["nodes"]["node-b"].logtext()
        st, j = g2.api.raw("GET", f"/v1/sandboxes/{lost_id}")
        assert st == 200 and j["state"] == "lost" and j["infra_failure"] is True, j
        st, j = g1.api.raw("POST", f"/v1/sandboxes/{lost_id}/exec", {"cmd": ["true"]})
        assert st == 410 and j["error"]["code"] == "node_lost", j
        st, j = g2.api.raw("GET", "/v1/sandboxes")
        listed = {s["id"]: s for s in j["sandboxes"]}
        assert st == 200 and listed[lost_id]["state"] == "lost", j
        st, j = g2.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "b"}})
        assert st == 201, j
        new_b = j["id"]
        st, j = g1.api.raw("POST", f"/v1/sandboxes/{new_b}/exec", {"shell": "echo new"})
        assert st == 200 and j["stdout"] == "new\n", j
        st, j = g1.api.raw("GET", "/v1/sandboxes")
        assert {s["id"]: s for s in j["sandboxes"]}[new_b]["state"] == "running", j
        st, _ = g1.api.raw("DELETE", f"/v1/sandboxes/{lost_id}")
        assert st in (200, 204), st
    finally:
        for sid in ids + ([new_b] if new_b else []):
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")
        node = cluster["nodes"]["node-b"]
        if node.proc.poll() is not None:
            node.start()  # it adopts what is left, and the teardown removes it


# ---- the gateway's listener (issue 9): the same guard as warrend's TCP listener ----

def raw_request(port, head, sock=None, timeout=20):
    """Send head (bytes, the whole request) and read one response: (status, headers, body)."""
    s = sock or socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(head)
        return read_response(s)
    finally:
        if sock is None:
            s.close()


def get_healthz(token):
    return (f"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n").encode()


def gw_metrics(gw, sock=None):
    return raw_request(gw.port, f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                f"{ADMIN}\r\n\r\n".encode(), sock=sock)[2].decode()


def refused_too_many(gw, text=None):
    key = 'warren_http_refused_total{reason="too_many_connections"} '
    for line in (text if text is not None else gw_metrics(gw)).splitlines():
        if line.startswith(key):
            return int(line[len(key):])
    raise AssertionError("no " + key)


def test_gateway_refuses_unauthenticated_bodies_and_caps_connections(cluster):
    gw = Gateway(cluster["etcd"].urls, cluster["tokdir"], "--max-connections", "4")
    try:
        # headers promise 64 MiB and nothing follows: 401 without waiting for the body
        st, _, body = raw_request(gw.port, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Length: 67108864\r\n\r\n", timeout=15)
        assert st == 401 and json.loads(body)["error"]["code"] == "unauthorized", (st, body)
        # a project-looking token that no project has is refused the same way
        st, _, _ = raw_request(gw.port, get_healthz("wrp_" + "0" * 64))
        assert st == 401
        pid = gw.proc.pid
        reset_peak(pid)
        before = status_of(pid)["VmHWM"]
        chunk = b"\x01" * MiB

        def flood():
            try:
                s = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
                s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 67108864\r\n\r\n")
                for _ in range(64):
                    s.sendall(chunk)
                s.close()
            except OSError:
                pass  # refused and closed: the point

        threads = [threading.Thread(target=flood) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        grown = status_of(pid)["VmHWM"] - before
        # a gateway without the header-stage check read all six bodies: 6 x 64 MiB
        assert grown < 32 * MiB, f"gateway peak RSS grew by {grown >> 20} MiB"

        # the connection limit: four kept-alive connections, the fifth gets a clear 503
        wait_for("the flood's connections closed",
                 lambda: raw_request(gw.port, get_healthz(ADMIN))[0] == 200)
        # six floods at once against four slots: some may have been refused as
        # too many rather than unauthorized; counted from here
        refused = refused_too_many(gw)
        held = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
            assert raw_request(gw.port, get_healthz(ADMIN), sock=s)[0] == 200
            held.append(s)
        st, hdrs, body = raw_request(gw.port, get_healthz(ADMIN))
        err = json.loads(body)
        assert st == 503 and err["error"]["code"] == "unavailable", (st, body)
        assert "too many connections" in err["error"]["message"] and err["infra_failure"]
        m = gw_metrics(gw, sock=held[0])
        assert refused_too_many(gw, m) == refused + 1, m
        assert "warren_http_connections 4" in m, m
        for s in held:
            s.close()
        wait_for("slots back once the gateway sees the closes",
                 lambda: raw_request(gw.port, get_healthz(ADMIN))[0] == 200)
    finally:
        gw.stop()


# ---- the quota reconciler and project priority (issue 10) ----

def make_project(g, name, max_sandboxes, priority=0):
    st, j = g.api.raw("POST", "/v1/projects", {"name": name, "max_sandboxes": max_sandboxes,
                                               "priority": priority})
    assert st == 201, j
    # every live gateway (a test's extra gateway may be stopped or killed)
    for gw in [x for x in (g_all or [g]) if x.proc.poll() is None]:
        wait_for("the project token on the gateway",
                 lambda gw=gw: gw.api.raw("GET", "/healthz", token=j["token"])[0] == 200)
    return j["token"]


g_all = []


def counter(cluster, name):
    c, _ = cluster["etcd"].get("/warren-quota/" + name)
    return c or {"sandboxes": 0, "memory_mb": 0}


def test_reconciler_returns_a_killed_gateways_reserve(cluster):
    """kill -9 of a gateway holding an unused reserve: its published holding
    dies with its lease and the elected reconciler lowers the counter."""
    all_ready(cluster)
    g1 = cluster["gws"][0]
    # a third gateway that never gives an idle reserve back by itself
    gc = Gateway(cluster["etcd"].urls, cluster["tokdir"], "--quota-idle-return", "3600")
    made = []
    try:
        g_all[:] = [g1, gc]
        token = make_project(g1, "reco", 2)
        st, j = gc.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        assert st == 201, j
        st, _ = gc.api.raw("DELETE", f"/v1/sandboxes/{j['id']}", token=token)
        assert st == 204
        # gc holds one unused slot; g1 takes the other one
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        assert st == 201, j
        made.append(j["id"])
        assert counter(cluster, "reco")["sandboxes"] == 2
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        assert st == 429 and j["error"]["code"] == "resource_exhausted", j
        gc.proc.kill()
        gc.proc.wait()
        # the lease (5 s) expires, the reconciler (every second) lowers R to 1
        wait_for("the killed gateway's reserve reconciled away",
                 lambda: counter(cluster, "reco")["sandboxes"] == 1, timeout=60)

        def create():
            st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
            if st == 201:
                made.append(j["id"])
            return st == 201
        wait_for("a create through the surviving gateway", create, timeout=30, interval=0.5)
        assert counter(cluster, "reco")["sandboxes"] <= 2

        def fixes(gw):
            text = gw.api.raw("GET", "/metrics")[1].decode()
            return int(dict(line.rsplit(" ", 1) for line in text.splitlines()
                            if line and not line.startswith("#"))
                       ["warren_gateway_quota_reconciled_total"])
        assert sum(fixes(gw) for gw in cluster["gws"]) >= 1
    finally:
        for sid in made:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}", token=token)
        if gc.proc.poll() is None:
            gc.proc.kill()
            gc.proc.wait()


def test_ttl_expired_sandbox_gives_its_slot_back(cluster):
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    g_all[:] = [g1, g2]
    token = make_project(g1, "ttl", 1)
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "ttl_s": 3}, token=token)
    assert st == 201, j
    st, j2 = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
    assert st == 429, j2
    made = []

    def create():
        st, j = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=token)
        if st == 201:
            made.append(j["id"])
        return st == 201
    try:
        # no DELETE went through a gateway: only the reconciler can give the slot back
        wait_for("the expired sandbox's slot usable again", create, timeout=60, interval=0.5)
    finally:
        for sid in made:
            g2.api.raw("DELETE", f"/v1/sandboxes/{sid}", token=token)


def test_priority_headroom(cluster):
    """--priority-headroom MB: priority-0 projects leave MB free on every node."""
    all_ready(cluster)
    g1 = cluster["gws"][0]
    gp = Gateway(cluster["etcd"].urls, cluster["tokdir"], "--priority-headroom", "100000000")
    made = []
    try:
        g_all[:] = [g1, gp]
        wait_for("nodes ready on the new gateway",
                 lambda: [n["state"] for n in gp.nodes().values()] == ["ready", "ready"])
        low = make_project(g1, "low", 4, priority=0)
        high = make_project(g1, "high", 4, priority=5)
        st, j = gp.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=low)
        assert st == 503 and j["error"]["code"] == "unavailable", j
        st, j = gp.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=high)
        assert st == 201, j
        made.append((j["id"], high))
        st, j = gp.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})  # the admin: no headroom
        assert st == 201, j
        made.append((j["id"], ADMIN))
        # without the flag the same low-priority create fits
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, token=low)
        assert st == 201, j
        made.append((j["id"], low))
    finally:
        for sid, tok in made:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}", token=tok)
        gp.stop()


# ---- uploads through a gateway; node-side create dedup (issue 10) ----

def sdk():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import warren
    return warren


def test_uploads_route_to_their_node(cluster, rootfs):
    """POST /v1/uploads through a gateway lands on a node that names itself
    in the id; the chunks, the size and the delete go there through either
    gateway, and an import of the upload (the SDK over TCP) happens there, so
    a create of the image on that node works."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    st, u = g1.api.raw("POST", "/v1/uploads", {"size": 3})
    assert st == 201, u
    uid = u["id"]
    # 32 characters as on a node (clients keep their buffers), the node first
    assert len(uid) == 32 and uid.rsplit("-", 1)[0] in ("node-a", "node-b"), uid
    st, j = g2.api.raw("PUT", f"/v1/uploads/{uid}?offset=0", body=b"abc")
    assert st == 202 and j["size"] == 3, j
    st, j = g2.api.raw("PUT", f"/v1/uploads/{uid}?offset=1", body=b"x")
    assert st == 416 and j["size"] == 3, j  # the node's answer, relayed
    st, j = g1.api.raw("GET", f"/v1/uploads/{uid}")
    assert st == 200 and j["size"] == 3, j
    assert g2.api.raw("DELETE", f"/v1/uploads/{uid}")[0] == 204
    assert g1.api.raw("GET", f"/v1/uploads/{uid}")[0] == 404
    assert g1.api.raw("GET", "/v1/uploads/" + "0" * 32)[0] == 404  # not a cluster upload id
    assert g1.api.raw("GET", "/v1/uploads/nope-" + "0" * 27)[0] == 404  # no such node
    # an upload is its maker's: a project does not see the admin's
    st, u = g1.api.raw("POST", "/v1/uploads", {})
    assert st == 201, u
    proj = make_project(g1, f"up-{os.getpid()}", 1)
    wait_for("the project token on g2", lambda: g2.api.raw("GET", "/healthz", token=proj)[0] == 200)
    assert g2.api.raw("GET", f"/v1/uploads/{u['id']}", token=proj)[0] == 404
    assert g2.api.raw("GET", f"/v1/uploads/{u['id']}")[0] == 200
    assert g2.api.raw("DELETE", f"/v1/uploads/{u['id']}")[0] == 204

    warren = sdk()
    with warren.Client(f"http://127.0.0.1:{g2.port}", token=ADMIN) as c:
        img = c.images.import_("gw-upload:1", rootfs)
        assert img.name == "gw-upload:1", img
    st, imgs = g1.api.raw("GET", "/v1/images")
    held = {i["name"]: i["nodes"] for i in imgs["images"]}["gw-upload:1"]
    assert len(held) == 1, held
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"image": "gw-upload:1", "memory_mb": 64,
                                                 "node_labels": {"zone": held[0][-1]}})
    assert st == 201 and node_of(j["id"]) == held[0], j
    try:
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{j['id']}/exec", {"cmd": ["cat", "/etc/hostname"]})
        assert st == 200 and r["exit_code"] == 0, r
    finally:
        assert g1.api.raw("DELETE", f"/v1/sandboxes/{j['id']}")[0] == 204
    # an import naming a path, not an upload, is for a node
    st, j = g1.api.raw("POST", "/v1/images/import", {"name": "x:1", "path": rootfs})
    assert st == 501, j


def keyed(sandboxes, key):
    return [x["id"] for x in sandboxes if x["labels"].get("warren.idem") == key]


def test_node_dedups_keyed_creates(cluster):
    """warrend itself: a create whose idempotency key (header or warren.idem
    label) matches a sandbox being built or alive on the node gets that
    sandbox, never a second one."""
    all_ready(cluster)
    node = cluster["nodes"]["node-a"]
    port = int(node.extra[node.extra.index("--listen") + 1].rsplit(":", 1)[1])
    api = Http(port, NODE_TOKEN)
    key = f"node-k-{os.getpid()}"
    results = []
    lock = threading.Lock()

    def create(i):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            hdr = {"Authorization": "Bearer " + NODE_TOKEN}
            body = {"memory_mb": 64}
            if i % 2:
                hdr["Idempotency-Key"] = key  # the clients' header
            else:
                body["labels"] = {"warren.idem": key}  # what a gateway sends
            c.request("POST", "/v1/sandboxes", body=json.dumps(body), headers=hdr)
            r = c.getresponse()
            with lock:
                results.append((r.status, json.loads(r.read())))
        finally:
            c.close()

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == 8 and all(st == 201 for st, _ in results), results
        ids = {j["id"] for _, j in results}
        assert len(ids) == 1, results
        # a later retry too, and the sandbox carries the key as its label
        st, again = api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "idempotency_key": key})
        assert st == 201 and again["id"] in ids and again["labels"]["warren.idem"] == key, again
        st, lst = api.raw("GET", "/v1/sandboxes")
        assert keyed(lst["sandboxes"], key) == list(ids), lst
        st, j = api.raw("POST", "/v1/sandboxes", {"idempotency_key": "bad key!"})
        assert st == 400, j
    finally:
        st, lst = api.raw("GET", "/v1/sandboxes")
        for sid in keyed(lst["sandboxes"], key):
            api.raw("DELETE", f"/v1/sandboxes/{sid}")


def test_gateway_create_joins_a_create_in_flight_on_its_node(cluster):
    """The window docs/cluster.md described: a first attempt still being made
    on its node (here sent straight to the node, as a dead gateway left it)
    while a retry with the key comes through a gateway to that node: the
    node answers the retry with the first attempt's sandbox."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    node = cluster["nodes"]["node-b"]
    port = int(node.extra[node.extra.index("--listen") + 1].rsplit(":", 1)[1])
    api = Http(port, NODE_TOKEN)
    key = f"gw-inflight-{os.getpid()}"
    out = {}

    def direct():
        out["direct"] = api.raw("POST", "/v1/sandboxes",
                                {"memory_mb": 64, "labels": {"warren.idem": key}}, timeout=120)

    def through(g, name):
        out[name] = g.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "idempotency_key": key,
                                                        "node_labels": {"zone": "b"}}, timeout=120)

    threads = [threading.Thread(target=direct), threading.Thread(target=through, args=(g1, "g1"))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        through(g2, "g2")  # and a retry through the other gateway
        st, first = out["direct"]
        assert st == 201, first
        for name in ("g1", "g2"):
            st, j = out[name]
            assert st in (200, 201) and j["id"] == first["id"], (name, out)
        st, lst = g1.api.raw("GET", "/v1/sandboxes")
        assert keyed(lst["sandboxes"], key) == [first["id"]], lst
    finally:
        st, lst = api.raw("GET", "/v1/sandboxes")
        for sid in keyed(lst["sandboxes"], key):
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")


def test_rl_features_through_gateways(cluster):
    """Issue 14 in cluster mode: the trajectory log with step ids, replay,
    group fork, checkpoints and diffs through a gateway; the children and
    the replay live on the parent's node and route through either gateway."""
    all_ready(cluster)
    g1, g2 = cluster["gws"]
    st, sb = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})
    assert st == 201, sb
    sid = sb["id"]
    made = [sid]
    try:
        body = {"cmd": ["sh", "-c", "echo x >> /tmp/f; wc -l < /tmp/f"], "step": "s1"}
        st, r = g1.api.raw("POST", f"/v1/sandboxes/{sid}/exec", body)
        assert st == 200 and r["stdout"].strip() == "1", r
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec", body)  # the same step again
        assert st == 200 and r.get("replayed") is True and r["stdout"].strip() == "1", r
        st, log = g2.api.raw("GET", f"/v1/sandboxes/{sid}/log")
        assert st == 200, log
        assert [e.get("step") for e in log["events"] if e.get("kind") == "exec"] == ["s1"], log
        st, cp = g1.api.raw("POST", f"/v1/sandboxes/{sid}/checkpoints", {"name": "c1"})
        assert st in (200, 201), cp
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec",
                           {"cmd": ["sh", "-c", "echo new > /tmp/g"]})
        assert st == 200 and r["exit_code"] == 0, r
        st, d = g1.api.raw("GET", f"/v1/sandboxes/{sid}/diff?from=c1")
        assert st == 200, d
        assert "/tmp/g" in json.dumps(d), d
        st, f = g2.api.raw("POST", f"/v1/sandboxes/{sid}/fork", {"count": 2})
        assert st in (200, 201), f
        kids = [c["id"] for c in f["sandboxes"]]
        made += kids
        assert len(kids) == 2 and all(node_of(k) == node_of(sid) for k in kids), kids
        for k, g in zip(kids, (g1, g2)):
            st, r = g.api.raw("POST", f"/v1/sandboxes/{k}/exec", {"cmd": ["cat", "/tmp/g"]})
            assert st == 200 and r["stdout"] == "new\n", r
        st, rp = g1.api.raw("POST", f"/v1/sandboxes/{sid}/replay", {"until": "s1"})
        assert st in (200, 201), rp
        rid = rp["id"]
        made.append(rid)
        assert node_of(rid) == node_of(sid), rp
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{rid}/exec", {"cmd": ["cat", "/tmp/f"]})
        assert st == 200 and r["stdout"] == "x\n", r
    finally:
        for x in reversed(made):
            g1.api.raw("DELETE", f"/v1/sandboxes/{x}")


def test_daemon_restart_within_the_lease_keeps_the_node(cluster, rootfs):
    """Last (its node lingers in the gateways' view). SIGTERM publishes
    "stopping" (nothing is placed there) and leaves the lease to run out; a
    daemon restarted before it does resumes the lease, so the cluster never
    declared the node lost and its sandboxes answer again."""
    g1, g2 = cluster["gws"]
    port = free_port()
    node = start_daemon(rootfs, [
        "--listen", f"tcp:127.0.0.1:{port}", "--token-file", os.path.join(cluster["tokdir"], "node"),
        "--cluster", cluster["etcd"].urls, "--node-name", "node-r",
        "--advertise", f"http://127.0.0.1:{port}", "--label", "zone=r", "--lease-ttl", "300"])
    sid = None
    try:
        for g in (g1, g2):
            wait_for("node-r ready", lambda g=g: g.nodes().get("node-r", {}).get("state") == "ready")
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "r"}})
        assert st == 201 and node_of(j["id"]) == "node-r", j
        sid = j["id"]
        node.stop(destroy_all=False)
        for g in (g1, g2):
            wait_for("node-r stopping", lambda g=g: g.nodes()["node-r"]["state"] == "stopping")
        st, j = g2.api.raw("POST", "/v1/sandboxes", {"node_labels": {"zone": "r"}})
        assert st != 201, j  # nothing is placed on a stopping node
        st, j = g1.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
        assert st == 503 and j["error"]["code"] == "unavailable" and j["infra_failure"] is True, j
        assert "restarting" in j["error"]["message"], j
        node.start()
        for g in (g1, g2):
            wait_for("node-r ready again",
                     lambda g=g: g.nodes()["node-r"]["state"] == "ready", timeout=60)
        assert "resumed node-r's lease" in node.logtext()
        st, j = g2.api.raw("GET", f"/v1/sandboxes/{sid}")
        assert st == 200 and j["state"] == "running", j
        st, j = g2.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo kept"})
        assert st == 200 and j["stdout"] == "kept\n", j
    finally:
        if sid:
            g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")
        node.stop()
        shutil.rmtree(node.root, ignore_errors=True)

"""Cluster scale by simulation (docs/cluster.md, "Simulation and scale"):
warren-sim's simulated nodes behind two real gateways on a real etcd, and a
short run of `warren bench cluster`. Also parses deploy/kubernetes/*.yaml
when PyYAML is present. Everything polls with generous deadlines."""
import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import Counter

import pytest

from conftest import BUILD, need
from test_cluster import ADMIN, ETCD, NODE_TOKEN, Etcd, Gateway, Http, free_port, wait_for

NODES = 50
CREATES = 2000
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sim_bin():
    return os.path.join(os.path.abspath(BUILD), "bin", "warren-sim")


class Sim:
    def __init__(self, urls, tokdir, nodes, prefix="sim", ttl=10):
        self.port = free_port()
        self.prefix = prefix
        self.log_path = os.path.join(tokdir, f"sim-{self.port}.log")
        self.proc = subprocess.Popen([
            sim_bin(), "--cluster", urls, "--listen", f"tcp:127.0.0.1:{self.port}",
            "--nodes", str(nodes), "--name-prefix", prefix, "--capacity", "1000",
            "--lease-ttl", str(ttl), "--label", "zone=sim",
            "--token-file", os.path.join(tokdir, "node")],
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        self.api = Http(self.port, NODE_TOKEN)

    def stats(self):
        st, j = self.api.raw("GET", "/v1/sim", timeout=10)
        assert st == 200, j
        return j

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
            assert self.proc.returncode == 0, open(self.log_path).read()[-2000:]


@pytest.fixture(scope="module")
def simcluster():
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    need(os.path.exists(sim_bin()), "warren-sim is not built")
    tokdir = tempfile.mkdtemp(prefix="wr-sim-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    for name, tok in (("admin", ADMIN), ("node", NODE_TOKEN)):
        with open(os.path.join(tokdir, name), "w") as f:
            f.write(tok + "\n")
    etcd = Etcd(1)
    sim, gws = None, []
    try:
        sim = Sim(etcd.urls, tokdir, NODES)
        gws = [Gateway(etcd.urls, tokdir), Gateway(etcd.urls, tokdir)]
        for g in gws:
            wait_for(f"{NODES} simulated nodes ready", lambda g=g: sum(
                n["state"] == "ready" for n in g.nodes().values()) == NODES, timeout=60)
        yield {"etcd": etcd, "sim": sim, "gws": gws, "tokdir": tokdir}
    finally:
        for g in gws:
            g.stop()
        if sim:
            sim.stop()
        etcd.stop()
        shutil.rmtree(tokdir, ignore_errors=True)


def test_sim_nodes_register_like_warrend(simcluster):
    """Same key, a lease per node, the status fields a real node publishes."""
    status, version = simcluster["etcd"].get("/warren/nodes/sim-7")
    assert status is not None
    for field in ("name", "address", "labels", "backends", "sandboxes", "memory_reserved_mb",
                  "memory_total_mb", "memory_free_mb", "cpus", "projects", "started_at",
                  "version"):
        assert field in status, field
    assert status["name"] == "sim-7"
    assert status["address"] == f"http://127.0.0.1:{simcluster['sim'].port}/n/sim-7"
    assert status["labels"] == {"zone": "sim"} and status["backends"] == ["container"]
    listed = simcluster["gws"][0].nodes()["sim-7"]
    assert listed["state"] == "ready" and listed["address"] == status["address"]


def test_burst_spreads_and_every_sandbox_routes(simcluster):
    gws = simcluster["gws"]
    ids, errors = [], []
    lock = threading.Lock()

    def worker(k):
        g = gws[k % 2]
        mine = []
        for _ in range(CREATES // 8):
            st, j = g.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64}, timeout=60)
            if st != 201:
                errors.append((st, j))
                return
            mine.append(j["id"])
        with lock:
            ids.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert len(ids) == CREATES and len(set(ids)) == CREATES
    per_node = Counter(i[:-13] for i in ids)
    assert set(per_node) <= {f"sim-{n}" for n in range(NODES)}
    assert len(per_node) == NODES, "every node got some"
    mean = CREATES / NODES
    # power of two choices over 50 nodes from two gateways: well within 1.5x
    assert max(per_node.values()) <= 1.5 * mean, per_node.most_common(3)
    assert simcluster["sim"].stats()["sandboxes"] == CREATES
    # routable through the gateway that did not create it, exec answers
    for n, sid in enumerate(ids):
        g = gws[(n + 1) % 2]
        st, j = g.api.raw("GET", f"/v1/sandboxes/{sid}")
        assert st == 200 and j["id"] == sid, (st, j)
    st, j = gws[1].api.raw("POST", f"/v1/sandboxes/{ids[0]}/exec", {"argv": ["true"]})
    assert st == 200 and j["exit_code"] == 0, j
    # a node's list through the gateway
    st, j = gws[0].api.raw("GET", "/v1/sandboxes")
    assert st == 200 and len(j["sandboxes"]) == CREATES
    for n, sid in enumerate(ids):
        st, j = gws[n % 2].api.raw("DELETE", f"/v1/sandboxes/{sid}")
        assert st == 204, (sid, st, j)
    assert simcluster["sim"].stats()["sandboxes"] == 0
    st, j = gws[0].api.raw("GET", f"/v1/sandboxes/{ids[0]}")
    assert st == 404
    # the counts reach etcd at the bounded rate, then every node shows 0 again
    wait_for("statuses back at 0", lambda: all(
        n["sandboxes"] == 0 for n in gws[1].nodes().values()), timeout=30)


def test_killed_sim_node_is_lost(simcluster):
    """kill -9 of a (one-node) sim process: lost once its lease expires."""
    sim = Sim(simcluster["etcd"].urls, simcluster["tokdir"], 1, prefix="lossy", ttl=3)
    try:
        g = simcluster["gws"][0]
        wait_for("lossy-0 ready", lambda: g.nodes().get("lossy-0", {}).get("state") == "ready",
                 timeout=60)
        sim.proc.kill()
        sim.proc.wait()
        wait_for("lossy-0 lost", lambda: g.nodes()["lossy-0"]["state"] == "lost", timeout=30)
    finally:
        if sim.proc.poll() is None:
            sim.proc.kill()
            sim.proc.wait()


def test_bench_cluster_report():
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    r = subprocess.run([os.path.join(os.path.abspath(BUILD), "bin", "warren"), "bench", "cluster",
                        "--nodes", "20", "--sandboxes", "1000", "--clients", "4", "--blocks", "2",
                        "--lease-ttl", "3", "--json"], capture_output=True, timeout=240)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    rep = json.loads(r.stdout)
    cp = rep["control_plane"]
    assert cp["creates"] == 1000 and cp["failed"] == 0
    for k in ("creates_per_s", "p50_ms", "p99_ms"):
        assert cp[k] > 0, k
    assert cp["balance"]["placements"] == 1000 and cp["balance"]["busiest_over_mean"] >= 1
    assert cp["etcd"]["revisions"] >= 0 and "node_status_writes_per_create" in cp["etcd"]
    ov = rep["gateway_overhead"]
    for k in ("create_destroy_per_s", "exec_p50_ms"):
        for side in ("direct", "gateway", "gateway_over_direct"):
            assert ov[k][side]["median"] > 0, (k, side)
    assert 0 < rep["node_loss"]["seconds_to_lost"] <= rep["node_loss"]["bound_s"] + 30
    assert set(rep["targets"]) >= {"creates_per_s_ge_5000", "p99_ms_le_50",
                                   "busiest_over_mean_le_1.25"}
    # it cleaned up after itself
    assert not glob.glob("/var/tmp/wr-bench-cluster-*")


def test_deploy_manifests_parse():
    files = sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml")))
    assert files, "deploy/kubernetes has no manifests"
    try:
        import yaml
    except ImportError:
        pytest.skip("PyYAML is not installed: manifests not parsed")
    kinds = set()
    for f in files:
        for doc in yaml.safe_load_all(open(f)):
            if doc:
                assert "apiVersion" in doc and "kind" in doc, f
                kinds.add(doc["kind"])
    assert {"DaemonSet", "Deployment", "Service", "StatefulSet"} <= kinds

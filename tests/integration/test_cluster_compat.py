"""warren-gateway --listen-compat (docs/cluster.md, "Compat APIs"): the
SandboxFusion and E2B APIs of a whole cluster on one gateway port.

One etcd member, two warrend nodes each with its own --listen-compat port
(published in its status as compat_port) and base:bookworm, one gateway.
SandboxFusion requests are placed like creates and must reach both nodes;
the e2b SDK's smoke script runs against the gateway (creates placed, envd
and control calls routed by the id's node, lists merged). Everything polls
with generous deadlines; no sleep decides pass or fail."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from conftest import need, start_daemon
from test_cluster import LEASE_TTL, Etcd, ETCD, Gateway, free_port, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "sandboxfusion"))
from sfclient import SF, ZYGOTE, debian_tarball  # noqa: E402
from test_e2b import node_env, npm_dir  # noqa: E402


def start_node(etcd, tokdir, name, tarball, rootfs):
    for attempt in range(5):
        port, cport = free_port(), free_port()
        try:
            d = start_daemon(rootfs, [
                "--listen", f"tcp:127.0.0.1:{port}", "--token-file", os.path.join(tokdir, "node"),
                "--cluster", etcd.urls, "--node-name", name,
                "--advertise", f"http://127.0.0.1:{port}", "--lease-ttl", str(LEASE_TTL),
                "--listen-compat", f"tcp:127.0.0.1:{cport}", "--fncall-zygote", ZYGOTE,
                "--fncall-size", "2"])
            break
        except RuntimeError as e:
            if "in use" not in str(e) or attempt == 4:
                raise
    r = d.api.raw("POST", "/v1/images/import", {"name": "base:bookworm", "path": tarball},
                  timeout=600)
    assert r.status == 201, r
    return d, cport


@pytest.fixture(scope="module")
def ccluster(rootfs):
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    need(os.geteuid() == 0, "container tests need root")
    tarball = debian_tarball()
    tokdir = tempfile.mkdtemp(prefix="wr-clc-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    for name, tok in (("admin", "admin-token-0123456789abcdef"),
                      ("node", "node-token-0123456789abcdef")):
        with open(os.path.join(tokdir, name), "w") as f:
            f.write(tok + "\n")
    etcd = Etcd(1)
    nodes, gw = {}, None
    try:
        for name in ("node-a", "node-b"):
            nodes[name] = start_node(etcd, tokdir, name, tarball, rootfs)
        for attempt in range(5):
            cport = free_port()
            try:
                gw = Gateway(etcd.urls, tokdir, "--listen-compat", f"tcp:127.0.0.1:{cport}")
                break
            except AssertionError as e:
                if "in use" not in str(e) or attempt == 4:
                    raise
        # both nodes registered with their compat port
        wait_for("both nodes ready with a compat port", lambda: len(gw.nodes()) == 2 and all(
            n["state"] == "ready" and n.get("compat_port") == nodes[name][1]
            for name, n in gw.nodes().items()), timeout=60)
        yield {"nodes": nodes, "gw": gw, "port": cport}
    finally:
        if gw:
            gw.stop()
        for d, _ in nodes.values():
            if d.proc and d.proc.poll() is None:
                d.stop()
            shutil.rmtree(d.root, ignore_errors=True)
        etcd.stop()
        shutil.rmtree(tokdir, ignore_errors=True)


def fncall_calls(d):
    return sum(p["calls"] for p in d.api.raw("GET", "/v1/fncall/pools").json()["pools"])


def test_routes(ccluster):
    sf = SF(ccluster["port"])
    assert sf.request("GET", "/v1/ping") == (200, "pong")
    assert sf.request("GET", "/nope")[0] == 404
    assert sf.request("GET", "/run_code")[0] == 405
    st, j = sf.request("GET", "/sandboxes/node-z-0123456789ab")
    assert st == 404 and j["code"] == 404, j
    st, j = sf.request("GET", "/sandboxes/0123456789abcdef")  # not a cluster id
    assert st == 404, j


def test_run_code_spreads_over_both_nodes(ccluster):
    sf = SF(ccluster["port"])
    nodes = [d for d, _ in ccluster["nodes"].values()]
    before = [fncall_calls(d) for d in nodes]
    results, errors = [], []

    def worker(k):
        try:
            for i in range(6):
                results.append(sf.run_code(language="python", code=f"print({k} * 100 + {i})"))
        except Exception as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert not errors, errors
    assert len(results) == 24
    assert all(r["status"] == "Success" for r in results), results
    outs = sorted(int(r["run_result"]["stdout"]) for r in results)
    assert outs == sorted(k * 100 + i for k in range(4) for i in range(6))
    after = [fncall_calls(d) for d in nodes]
    served = [a - b for a, b in zip(after, before)]
    # power of two choices over two nodes: both take a share of 24 requests
    assert sum(served) == 24 and min(served) >= 1, served
    # a compiled language: two stages (two fncall calls) on the same node
    r = sf.run_code(language="cpp", code='#include <cstdio>\nint main(){puts("cc");}')
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "cc\n", r


def test_e2b_sdk_smoke_through_the_gateway(ccluster):
    nd = npm_dir()
    env = dict(node_env(ccluster["port"]), WARREN_E2B_TEMPLATE="base:bookworm")
    r = subprocess.run(["node", "smoke.mjs"], cwd=nd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["ok"] is True
    # the smoke killed what it made: no E2B sandbox is left on either node
    sf = SF(ccluster["port"])
    st, listed = sf.request("GET", "/v2/sandboxes")
    assert st == 200 and listed == [], listed
    for d, _ in ccluster["nodes"].values():
        assert d.api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []


def test_e2b_creates_are_placed_and_routed_by_id(ccluster):
    sf = SF(ccluster["port"])
    ids = []
    try:
        for i in range(6):
            st, j = sf.post("/sandboxes", {"templateID": "base:bookworm", "timeout": 300,
                                           "metadata": {"t": "placed"}})
            assert st == 201, j
            ids.append(j["sandboxID"])
        assert {i[:-13] for i in ids} == {"node-a", "node-b"}, ids
        st, listed = sf.request("GET", "/v2/sandboxes?metadata=t%3Dplaced")
        assert st == 200 and sorted(s["sandboxID"] for s in listed) == sorted(ids), listed
        for sid in ids:
            st, j = sf.request("GET", "/sandboxes/" + sid)
            assert st == 200 and j["sandboxID"] == sid, j
            # envd through the header, answered by the id's node
            st, j = sf.post("/filesystem.Filesystem/MakeDir", {"path": "/tmp/gw-" + sid},
                            headers={"E2b-Sandbox-Id": sid})
            assert st == 200, j
            st, j = sf.post("/filesystem.Filesystem/Stat", {"path": "/tmp/gw-" + sid},
                            headers={"E2b-Sandbox-Id": sid})
            assert st == 200 and j["entry"]["name"] == "gw-" + sid, j
    finally:
        for sid in ids:
            sf.request("DELETE", "/sandboxes/" + sid)
    for sid in ids:
        assert sf.request("GET", "/sandboxes/" + sid)[0] == 404

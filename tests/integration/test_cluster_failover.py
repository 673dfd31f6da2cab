"""Cluster failures seen from the clients (docs/cluster.md, "Clients and
failover"): a real 3-member etcd cluster, three warrend nodes and gateways,
all started here.

- kill -9 of a gateway while the CLI, a libwarren program, the Python sync
  client and the asyncio client create in a loop through a host list: every
  create succeeds exactly once (sandboxes counted per idempotency key on the
  nodes themselves), and an exec in flight is not replayed;
- kill -9 of a node in the middle of a burst: it is lost within the bound,
  creates continue on the others, nothing hangs;
- a node cut off from etcd by a TCP proxy the test stops, then healed: it is
  declared lost, and when it comes back its old sandboxes stay lost.
Everything polls with generous deadlines; no sleep decides pass or fail."""
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import BUILD, need, san_cflags, start_daemon
from test_cluster import (ADMIN, ETCD, LEASE_TTL, NODE_TOKEN, Etcd, Gateway, Http, free_port,
                          node_of, wait_for)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import warren  # noqa: E402

BIN = os.path.join(os.path.abspath(BUILD), "bin")
CREATES_AFTER_KILL = 3  # each client keeps creating this many times past the kill
LOOP_LIMIT = 120.0      # s; a client loop that runs longer is a hang


class EtcdProxy:
    """TCP proxies in front of the etcd members, for one node: cut() closes
    every connection and refuses new ones (the node is partitioned from the
    control plane but still reachable by the gateways), heal() lets them
    through again."""

    def __init__(self, etcd_ports):
        self.cut_off = False
        self.lock = threading.Lock()
        self.conns = []
        self.listeners = []
        self.stopped = False
        for target in etcd_ports:
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(("127.0.0.1", 0))
            ls.listen(64)
            self.listeners.append(ls)
            threading.Thread(target=self._accept, args=(ls, target), daemon=True).start()
        self.urls = ",".join(f"http://127.0.0.1:{ls.getsockname()[1]}" for ls in self.listeners)

    def _accept(self, ls, target):
        while not self.stopped:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            if self.cut_off:
                c.close()
                continue
            try:
                u = socket.create_connection(("127.0.0.1", target), timeout=5)
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _drop_all(self):
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self):
        self.cut_off = True
        self._drop_all()

    def heal(self):
        self.cut_off = False

    def stop(self):
        self.stopped = True
        for ls in self.listeners:
            ls.close()
        self._drop_all()


@pytest.fixture(scope="module")
def fc(rootfs):
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    tokdir = tempfile.mkdtemp(prefix="wr-fo-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    for name, tok in (("admin", ADMIN), ("node", NODE_TOKEN)):
        with open(os.path.join(tokdir, name), "w") as f:
            f.write(tok + "\n")
    etcd = Etcd(3)
    proxy = EtcdProxy([m["client"] for m in etcd.members])
    nodes, ports, gws = {}, {}, []
    try:
        for name in ("node-a", "node-b", "node-c"):
            port = free_port()
            urls = proxy.urls if name == "node-b" else etcd.urls  # node-b can be cut off
            nodes[name] = start_daemon(rootfs, [
                "--listen", f"tcp:127.0.0.1:{port}", "--token-file", os.path.join(tokdir, "node"),
                "--cluster", urls, "--node-name", name, "--advertise", f"http://127.0.0.1:{port}",
                "--label", f"zone={name[-1]}", "--lease-ttl", str(LEASE_TTL)])
            ports[name] = port
        gws = [Gateway(etcd.urls, tokdir), Gateway(etcd.urls, tokdir)]
        fc = {"etcd": etcd, "nodes": nodes, "ports": ports, "gws": gws, "tokdir": tokdir,
              "proxy": proxy}
        all_ready(fc)
        yield fc
    finally:
        for g in gws:
            g.stop()
        for d in nodes.values():
            if d.proc and d.proc.poll() is None:
                d.stop()
            shutil.rmtree(d.root, ignore_errors=True)
        proxy.stop()
        etcd.stop()
        shutil.rmtree(tokdir, ignore_errors=True)


def all_ready(fc):
    for g in fc["gws"]:
        wait_for("three nodes ready", lambda g=g: sorted(
            (n, v["state"]) for n, v in g.nodes().items()) == [
            ("node-a", "ready"), ("node-b", "ready"), ("node-c", "ready")], timeout=60)


def node_sandboxes(fc):
    """Every sandbox on every live node, asked of the nodes themselves."""
    out = []
    for name, port in fc["ports"].items():
        if fc["nodes"][name].proc.poll() is not None:
            continue
        st, j = Http(port, NODE_TOKEN).raw("GET", "/v1/sandboxes")
        assert st == 200, (name, j)
        out += j["sandboxes"]
    return out


def hosts(*gws):
    return ",".join(f"tcp:127.0.0.1:{g.port}" for g in gws)


LIBWARREN_LOOP = r"""
#include <stdio.h>
#include <unistd.h>
#include <warren/warren.h>
/* Creates in a loop with one client handle (its connection kept alive) until
 * the file argv[1] exists and argv[2] more creates succeeded; one line per
 * create: the id and the host that answered. */
int
main (int argc, char **argv)
{
  warren_error_t err;
  warren_client_t *c = warren_client_new (NULL, NULL, &err);
  if (c == NULL)
    {
      printf ("ERR %s %s\n", err.code, err.message);
      return 1;
    }
  json_t *req = json_pack ("{s:i}", "memory_mb", 64);
  int after = 0;
  for (int i = 0; i < 500 && after < atoi (argv[2]); i++)
    {
      int killed = access (argv[1], F_OK) == 0;
      json_t *sb = warren_sandbox_create (c, req, &err);
      if (sb == NULL)
        {
          printf ("ERR %s %s\n", err.code, err.message);
          return 1;
        }
      printf ("%s %s\n", json_string_value (json_object_get (sb, "id")), warren_client_host (c));
      fflush (stdout);
      json_decref (sb);
      after += killed;
    }
  json_decref (req);
  warren_client_free (c);
  return 0;
}
"""


def build_libwarren_loop(tmp):
    src = os.path.join(tmp, "loop.c")
    with open(src, "w") as f:
        f.write(LIBWARREN_LOOP.replace("#include <unistd.h>", "#include <stdlib.h>\n#include <unistd.h>"))
    exe = os.path.join(tmp, "loop")
    top = os.path.join(os.path.dirname(__file__), "..", "..")
    subprocess.run(["cc", "-O1"] + san_cflags() + ["-I", os.path.join(top, "include"), src, "-o", exe,
                    os.path.join(os.path.abspath(BUILD), "lib", "libwarren.a"), "-ljansson", "-lm"],
                   check=True, capture_output=True, timeout=120)
    return exe


def test_gateway_kill9_clients_fail_over_and_create_once(fc):
    """Four clients create in a loop through [dying gateway, live gateway];
    the first gateway is killed with SIGKILL in the middle."""
    all_ready(fc)
    g1 = fc["gws"][0]
    dying = Gateway(fc["etcd"].urls, fc["tokdir"])
    tmp = tempfile.mkdtemp(prefix="wr-fo-loop-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    killed_flag = os.path.join(tmp, "killed")
    killed = threading.Event()
    env = dict(os.environ, WARREN_HOST=hosts(dying, g1), WARREN_TOKEN=ADMIN)
    before = {s["id"] for s in node_sandboxes(fc)}
    made = {}      # client -> ids
    errors = {}    # client -> error text
    lock = threading.Lock()

    def record(who, sid):
        with lock:
            made.setdefault(who, []).append(sid)

    def until_done(who, create):
        t0, after = time.monotonic(), 0
        try:
            while after < CREATES_AFTER_KILL:
                assert time.monotonic() - t0 < LOOP_LIMIT, f"{who}: still looping"
                was_killed = killed.is_set()
                record(who, create())
                after += was_killed
        except BaseException as e:  # noqa: B902 - reported by the main thread
            errors[who] = repr(e)

    def cli_create():
        r = subprocess.run([os.path.join(BIN, "warren"), "create", "--memory", "64"], env=env,
                           capture_output=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr)
        return r.stdout.decode().strip()

    sync_client = warren.Client([f"tcp:127.0.0.1:{dying.port}", f"tcp:127.0.0.1:{g1.port}"],
                                token=ADMIN)

    def async_loop():
        async def main():
            async with warren.AsyncClient(hosts(dying, g1), token=ADMIN) as ac:
                async def one_create():
                    return (await ac.create(memory_mb=64)).id
                after = 0
                t0 = time.monotonic()
                while after < CREATES_AFTER_KILL:
                    assert time.monotonic() - t0 < LOOP_LIMIT, "async: still looping"
                    was_killed = killed.is_set()
                    # two at once: one connection each, both cut by the kill
                    for sid in await asyncio.gather(one_create(), one_create()):
                        record("async", sid)
                    after += was_killed
                return ac._t.current.port
        try:
            errors["async-port"] = asyncio.run(main())
        except BaseException as e:  # noqa: B902
            errors["async"] = repr(e)

    exe = build_libwarren_loop(tmp)
    lib = subprocess.Popen([exe, killed_flag, str(CREATES_AFTER_KILL)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    threads = [threading.Thread(target=until_done, args=("cli", cli_create)),
               threading.Thread(target=until_done,
                                args=("sync", lambda: sync_client.create(memory_mb=64).id)),
               threading.Thread(target=async_loop)]
    # an exec in flight through the dying gateway: never replayed
    sid = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})[1]["id"]
    exec_out = {}

    def long_exec():
        with warren.Client(hosts(dying, g1), token=ADMIN) as c:
            try:
                exec_out["result"] = c.sandbox(sid).exec(
                    "echo run >> /tmp/runs; sleep 60", timeout=90)
            except warren.WarrenError as e:
                exec_out["error"] = e

    threads.append(threading.Thread(target=long_exec))
    try:
        for t in threads:
            t.start()
        wait_for("every client created through the first gateway",
                 lambda: all(len(made.get(w, [])) >= 2 for w in ("cli", "sync", "async"))
                 or errors, timeout=60)
        assert not errors, errors
        wait_for("the exec running",
                 lambda: g1.api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/runs")[0] == 200)
        dying.proc.send_signal(signal.SIGKILL)
        dying.proc.wait()
        open(killed_flag, "w").close()
        killed.set()
        for t in threads:
            t.join(LOOP_LIMIT + 30)
            assert not t.is_alive(), "a client hangs after the gateway died"
        out, _ = lib.communicate(timeout=LOOP_LIMIT)
        lines = out.decode().splitlines()
        assert lib.returncode == 0, lines[-5:]
        for ln in lines:
            record("libwarren", ln.split()[0])
        # it moved to the live gateway and stayed there
        assert lines[-1].split()[1] == f"http://127.0.0.1:{g1.port}", lines[-3:]
        assert set(errors) == {"async-port"}, errors
        assert errors["async-port"] == g1.port
        assert sync_client._t.current.port == g1.port

        # the exec: a clear infrastructure error, and it ran exactly once
        err = exec_out.get("error")
        assert isinstance(err, warren.ConnectionLost), exec_out
        assert "not sent again" in str(err) and "infrastructure failure" in str(err), err
        st, runs = g1.api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/runs")
        assert st == 200 and runs == b"run\n", runs

        # every create succeeded once: one sandbox per id, per idempotency key
        ids = [i for w in made.values() for i in w]
        assert len(ids) == len(set(ids)), ids
        now = [s for s in node_sandboxes(fc) if s["id"] not in before and s["id"] != sid]
        keys = [s["labels"].get("warren.idem") for s in now]
        assert None not in keys, "a create without an idempotency key"
        assert len(keys) == len(set(keys)), "two sandboxes for one idempotency key"
        assert {s["id"] for s in now} == set(ids), "a sandbox no client was told about"
        print(f"gateway kill -9: {len(ids)} creates by " + ", ".join(
            f"{w} {len(v)}" for w, v in sorted(made.items())) + ", each made once")
    finally:
        killed.set()
        open(killed_flag, "w").close()
        for t in threads:
            t.join(LOOP_LIMIT)
        if lib.poll() is None:
            lib.kill()
            lib.wait()
        sync_client.close()
        if dying.proc.poll() is None:
            dying.proc.kill()
            dying.proc.wait()
        for s in node_sandboxes(fc):
            if s["id"] not in before:
                g1.api.raw("DELETE", f"/v1/sandboxes/{s['id']}")
        shutil.rmtree(tmp, ignore_errors=True)


def test_node_kill9_mid_burst(fc):
    """node-c is killed with SIGKILL while a burst of creates runs through both
    gateways: it is lost within the bound, the burst goes on on the others,
    its sandboxes fail fast with node_lost, nothing hangs."""
    all_ready(fc)
    g1, g2 = fc["gws"]
    node = fc["nodes"]["node-c"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "node_labels": {"zone": "c"}})
    assert st == 201, j
    on_c = j["id"]
    results, failures = [], []
    started = threading.Event()
    t_kill = {}

    async def burst():
        async with warren.AsyncClient(hosts(g1, g2), token=ADMIN, timeout=60) as ac:
            sem = asyncio.Semaphore(6)

            async def one(i):
                async with sem:
                    if i == 8:
                        started.set()
                    t0 = time.monotonic()
                    try:
                        sb = await ac.create(memory_mb=64)
                        results.append((t0, sb.id))
                    except warren.WarrenError as e:
                        failures.append((t0, e))
            await asyncio.gather(*(one(i) for i in range(36)))

    runner = threading.Thread(target=lambda: asyncio.run(burst()))
    runner.start()
    try:
        assert started.wait(60)
        t_kill["t"] = time.monotonic()
        node.kill9()
        for g in (g1, g2):
            wait_for("node-c lost", lambda g=g: g.nodes()["node-c"]["state"] == "lost",
                     timeout=LEASE_TTL + 30)
        lost_after = time.monotonic() - t_kill["t"]
        runner.join(180)
        assert not runner.is_alive(), "the burst hangs"
        print(f"node kill -9 mid-burst: lost on both gateways after {lost_after:.1f}s "
              f"(lease TTL {LEASE_TTL}s); {len(results)} made, {len(failures)} failed")
        assert lost_after < LEASE_TTL + 10, lost_after  # the bound is TTL + 2 s; the machine is shared
        # a create can only fail while it was in flight on node-c, and then as the platform's fault
        for t0, e in failures:
            assert t0 < t_kill["t"] + LEASE_TTL + 10 and e.status >= 500, (t0 - t_kill["t"], e)
        assert len(results) >= 36 - 6, failures
        # the sandboxes of the burst live on the others; node-c's ids fail fast
        live = {s["id"] for s in node_sandboxes(fc)}
        for _, sid in results:
            assert node_of(sid) != "node-c" or sid not in live
        t1 = time.monotonic()
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{on_c}/exec", {"cmd": ["true"]}, timeout=30)
        assert st == 503 and r["error"]["code"] == "node_lost" and r["infra_failure"] is True, r
        assert time.monotonic() - t1 < 10
        with warren.Client(hosts(g1, g2), token=ADMIN) as c:
            with pytest.raises(warren.WarrenError) as ei:
                c.sandbox(on_c).exec(["true"])
            assert ei.value.code == "node_lost" and ei.value.status == 503
            # creates after the loss all land on the others
            after = [c.create(memory_mb=64).id for _ in range(4)]
        assert {node_of(i) for i in after} <= {"node-a", "node-b"}
        results += [(0, i) for i in after]
    finally:
        runner.join(180)
        for _, sid in results:
            if node_of(sid) != "node-c":
                g1.api.raw("DELETE", f"/v1/sandboxes/{sid}")
        if node.proc.poll() is not None:
            node.start()  # adopts its sandboxes again; the teardown removes them
    all_ready(fc)


def test_partitioned_node_is_lost_and_stays_lost(fc):
    """node-b reaches etcd only through a proxy; stopping the proxy cuts it off
    (gateways still reach it). Its lease expires, it is declared lost; once
    healed it registers again, and its old sandboxes are not resurrected."""
    all_ready(fc)
    g1, g2 = fc["gws"]
    st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "node_labels": {"zone": "b"}})
    assert st == 201, j
    old = j["id"]
    proxy = fc["proxy"]
    t0 = time.monotonic()
    proxy.cut()
    try:
        for g in (g1, g2):
            wait_for("node-b lost", lambda g=g: g.nodes()["node-b"]["state"] == "lost",
                     timeout=LEASE_TTL + 30)
        print(f"partition: node-b lost on both gateways after {time.monotonic() - t0:.1f}s")
        # it still runs and answers directly; through the cluster its ids fail fast
        assert fc["nodes"]["node-b"].proc.poll() is None
        st, r = g2.api.raw("POST", f"/v1/sandboxes/{old}/exec", {"cmd": ["true"]}, timeout=30)
        assert st == 503 and r["error"]["code"] == "node_lost" and r["infra_failure"], r
        st, j = g1.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})
        assert st == 201 and node_of(j["id"]) != "node-b", j
        assert g1.api.raw("DELETE", f"/v1/sandboxes/{j['id']}")[0] == 204
    finally:
        proxy.heal()
    for g in (g1, g2):
        wait_for("node-b back, saying it was lost",
                 lambda g=g: g.nodes()["node-b"]["state"] == "ready"
                 and g.nodes()["node-b"].get("lost_at"), timeout=60)
    st, r = g1.api.raw("GET", f"/v1/sandboxes/{old}")
    assert st == 200 and r["state"] == "lost" and r["infra_failure"], r
    st, r = g2.api.raw("POST", f"/v1/sandboxes/{old}/exec", {"cmd": ["true"]})
    assert st == 410 and r["error"]["code"] == "node_lost" and r["infra_failure"], r
    with warren.Client(hosts(g1, g2), token=ADMIN) as c:
        with pytest.raises(warren.WarrenError) as ei:
            c.sandbox(old).exec(["true"])
        assert ei.value.code == "node_lost"
    assert g1.api.raw("DELETE", f"/v1/sandboxes/{old}")[0] == 204
    st, j = g2.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64, "node_labels": {"zone": "b"}})
    assert st == 201, j
    st, r = g1.api.raw("POST", f"/v1/sandboxes/{j['id']}/exec", {"cmd": ["true"]})
    assert st == 200 and r["exit_code"] == 0, r
    assert g1.api.raw("DELETE", f"/v1/sandboxes/{j['id']}")[0] == 204

"""Sandbox network policy (issue 12, docs/network.md).

The outside world (a network namespace with a mirror, a forbidden site and
a DNS server at 198.18.<n>.2-4) is nethost.py's `world`, shared with
test_vm_net.py. Nothing here touches an outside address."""
import json
import os
import shutil
import socket
import struct
import threading
import time

import pytest

from wr import wait_for
from nethost import (FORBIDDEN, HOST_IP, MIRROR, NET, can_reach, create, fetch, host_listener,
                     inspect, links, metric, net_daemon, nft_table, patch, prefixed_links, restart,
                     sh, table_exists, world)  # noqa: F401 (world: the fixture)


@pytest.fixture(scope="module")
def d(rootfs, world):
    dm = net_daemon(rootfs)
    yield dm
    dm.stop()
    shutil.rmtree(dm.root, ignore_errors=True)


def test_allow_deny_matrix(d):
    sid = create(d, f"allow=mirror.test:8080,{FORBIDDEN}/32:9999")
    try:
        code, body = fetch(d, sid, f"http://mirror.test:8080/")
        assert code == 0 and "this is the mirror" in body
        assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] == 0
        # the forbidden site: allowed on another port only
        assert fetch(d, sid, f"http://{FORBIDDEN}:8080/")[0] != 0
        # the host's own address and the sandbox's gateway are no destination
        assert not can_reach(d, sid, HOST_IP, 8080)
        info = inspect(d, sid)
        assert info["network"].startswith("allow=")
        assert info["net"]["address"].startswith("10.")
        assert info["net"]["names"] == ["mirror.test"]
    finally:
        d.api.delete(sid)


def test_services_and_cidr(d):
    r = d.cli("net", "service", "add", "pypi", "mirror.test:8080")
    assert r.returncode == 0, r
    try:
        ls = d.cli("net", "service", "ls", check=True).stdout.decode()
        assert "pypi" in ls and "mirror.test:8080" in ls
        sid = create(d, "allow=pypi")
        try:
            assert fetch(d, sid, "http://mirror.test:8080/")[0] == 0
            assert fetch(d, sid, f"http://{FORBIDDEN}:8080/")[0] != 0
        finally:
            d.api.delete(sid)
        sid = create(d, f"allow={NET}.0/24:8080")
        try:
            assert fetch(d, sid, f"http://{FORBIDDEN}:8080/")[0] == 0
            # a CIDR that covers the host's address still does not reach the host
            assert not can_reach(d, sid, HOST_IP, 22)
        finally:
            d.api.delete(sid)
        # overlapping rules (one inside another, the same address by name)
        sid = create(d, f"allow={NET}.0/24:8080,{MIRROR}:8080,mirror.test:8080,{MIRROR}:8000-8090")
        try:
            assert fetch(d, sid, "http://mirror.test:8080/")[0] == 0
            assert fetch(d, sid, f"http://{FORBIDDEN}:8080/")[0] == 0
        finally:
            d.api.delete(sid)
        r = d.api.raw("POST", "/v1/sandboxes", {"network": "allow=nosuchservice"})
        assert r.status == 400 and "no such service" in r.json()["error"]["message"]
    finally:
        assert d.cli("net", "service", "rm", "pypi").returncode == 0
    assert "pypi" not in d.cli("net", "service", "ls", check=True).stdout.decode()


def test_dns_answers_only_allowed_names(d, world):
    sid = create(d, "allow=mirror.test:8080")
    try:
        r = d.api.sh(sid, "nslookup mirror.test")
        assert r["exit_code"] == 0 and MIRROR in r["stdout"], r
        r = d.api.sh(sid, "nslookup forbidden.test")
        assert r["exit_code"] != 0 and "NXDOMAIN" in r["stdout"] + r["stderr"], r
        r = d.api.sh(sid, "nslookup exfiltrate-secret-data.example.com")
        assert "NXDOMAIN" in r["stdout"] + r["stderr"], r
        # the names the policy does not allow never left the daemon
        asked = (world / "dnslog").read_text()
        assert "mirror.test" in asked
        assert "forbidden.test" not in asked and "exfiltrate" not in asked
    finally:
        d.api.delete(sid)


def udp_question(qid, name):
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\0" + struct.pack(">HH", 1, 1)


def test_dns_questions_in_flight_together(d):
    """Questions out at once each get their own answer, whatever their ids:
    two clients that chose the same id, and ids equal modulo the daemon's
    table size (a resolver's A and AAAA questions left one of them
    unanswered until the client's retry, 2.5 s later)."""
    sid = create(d, "allow=mirror.test:8080")
    try:
        gw = inspect(d, sid)["net"]["gateway"]
        socks = []
        for qid in (0x1234, 0x1234, 5, 5 + 32, 5 + 64):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(2)
            s.sendto(udp_question(qid, "mirror.test"), (gw, 53))
            socks.append((qid, s))
        for qid, s in socks:
            m = s.recv(1500)
            s.close()
            assert struct.unpack(">H", m[:2])[0] == qid
            assert m[3] & 15 == 0 and struct.unpack(">H", m[6:8])[0] >= 1, m
    finally:
        d.api.delete(sid)


def test_patch_with_a_name_never_blocks_the_daemon(d):
    """A PATCH naming a host the daemon has no answer for waits for the
    upstream off the loop (it used to resolve on it, up to 2 s a name, with
    every other request of the node waiting); its reply still comes once
    the names it could learn are in the sandbox's set."""
    sid = create(d, f"allow={MIRROR}:8080")
    try:
        out = {}

        def do_patch():
            t = time.monotonic()
            out["r"] = patch(d, sid, "allow=silent.test:80,forbidden.test:8080")
            out["took"] = time.monotonic() - t

        th = threading.Thread(target=do_patch)
        th.start()
        time.sleep(0.3)
        t = time.monotonic()
        assert d.api.raw("GET", "/v1/sandboxes").status == 200
        other = time.monotonic() - t
        th.join()
        assert out["r"].status == 200, out["r"]
        assert other < 1.0, (other, out["took"])
        assert out["took"] < 10, out["took"]
        assert sorted(out["r"].json()["net"]["names"]) == ["forbidden.test", "silent.test"]
        # by address at once: forbidden.test's answer came before the reply
        assert can_reach(d, sid, FORBIDDEN, 8080)
        assert not can_reach(d, sid, MIRROR, 8080)
    finally:
        d.api.delete(sid)


def test_dns_follows_changed_records(d, world):
    (world / "moving").write_text(MIRROR)
    sid = create(d, "allow=moving.test:8080")
    try:
        assert fetch(d, sid, "http://moving.test:8080/")[1].startswith("this is the mirror")
        (world / "moving").write_text(FORBIDDEN)
        # the sandbox's own lookup brings the new address into its policy
        code, body = fetch(d, sid, "http://moving.test:8080/")
        assert code == 0 and "this is the forbidden" in body
    finally:
        (world / "moving").write_text(MIRROR)
        d.api.delete(sid)


def test_names_follow_their_records(d, world):
    """The daemon asks again for an allowed name when its record's TTL (1 s
    here, clamped to the 5 s default) runs out: the sandbox reaches a new
    address without looking the name up, and loses the old one for new
    connections one TTL after it left the record, while a connection open
    to it is kept (docs/network.md, "DNS")."""
    (world / "moving").write_text(MIRROR)
    sid = create(d, "allow=moving.test")
    try:
        assert can_reach(d, sid, MIRROR, 8080)
        assert not can_reach(d, sid, FORBIDDEN, 8080)
        # a connection to the old address, sending every 0.2 s
        d.api.sh(sid, f"(while :; do echo x; sleep 0.2; done | nc {MIRROR} 9000 >/dev/null 2>&1 &)")
        wait_for(lambda: established(d, sid, 9000) == 1, what="connection open")
        asked = (world / "dnslog").read_text().count("moving.test")
        (world / "moving").write_text(FORBIDDEN)
        # no lookup in the sandbox: by address only
        wait_for(lambda: can_reach(d, sid, FORBIDDEN, 8080), timeout=60,
                 what="the new address allowed")
        wait_for(lambda: not can_reach(d, sid, MIRROR, 8080), timeout=60,
                 what="the old address gone")
        assert (world / "dnslog").read_text().count("moving.test") > asked
        assert inspect(d, sid)["net"]["names"] == ["moving.test"]
        # the open connection still passes: its packets are not dropped
        denied = inspect(d, sid)["net"]["denied_packets"]
        sent = inspect(d, sid)["net"]["egress_bytes"]
        wait_for(lambda: inspect(d, sid)["net"]["egress_bytes"] > sent + 1000,
                 what="the kept connection sending")
        assert inspect(d, sid)["net"]["denied_packets"] == denied
        assert established(d, sid, 9000) == 1
        addr = inspect(d, sid)["net"]["address"]
        assert f"{addr} . {MIRROR}" in sh("nft", "list", "set", "inet", nft_table(d), "kept").stdout
        # a policy without the name ends it: its next packets are dropped
        assert patch(d, sid, f"allow={FORBIDDEN}:8080").status == 200
        assert f"{addr} . {MIRROR}" not in sh("nft", "list", "set", "inet", nft_table(d),
                                                "kept").stdout
        wait_for(lambda: inspect(d, sid)["net"]["denied_packets"] > denied,
                 what="the kept connection cut")
    finally:
        (world / "moving").write_text(MIRROR)
        d.api.delete(sid)


def test_live_update_allow_then_deny(d):
    sid = create(d, "allow=")
    try:
        assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] != 0
        r = d.cli("net", sid, "--allow", f"{MIRROR}:8080")
        assert r.returncode == 0, r
        assert inspect(d, sid)["network"] == f"allow={MIRROR}:8080"
        assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] == 0
        r = d.cli("net", sid, "--deny", f"{MIRROR}:8080")
        assert r.returncode == 0, r
        assert inspect(d, sid)["network"] == "allow="
        assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] != 0
        # the API takes the whole policy as a string too
        assert patch(d, sid, f"allow={MIRROR}:8080").status == 200
        assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] == 0
        assert patch(d, sid, "allow=bogus rule").status == 400
    finally:
        d.api.delete(sid)
    none = create(d, "none")
    try:
        r = patch(d, none, {"allow": f"{MIRROR}:8080"})
        assert r.status == 409, r
    finally:
        d.api.delete(none)


def test_denied_attempts_counted(d):
    # even an explicit rule cannot open the metadata address
    sid = create(d, "allow=169.254.169.254:80")
    try:
        before = inspect(d, sid)["net"]["denied_packets"]
        assert not can_reach(d, sid, "169.254.169.254", 80, timeout=1)
        for port in (22, 80, 443):  # a small port scan of the forbidden site
            assert not can_reach(d, sid, FORBIDDEN, port, timeout=1)
        after = inspect(d, sid)["net"]["denied_packets"]
        assert after > before
        metrics = d.api.raw("GET", "/metrics").body.decode()
        assert f'warren_net_denied_packets_total{{sandbox="{sid}"}}' in metrics
    finally:
        d.api.delete(sid)


def test_net_groups(d):
    a = create(d, "allow=", net_group="app1")
    b = create(d, "allow=", net_group="app1")
    c = create(d, "allow=", net_group="other")
    e = create(d, "allow=")
    try:
        d.api.raw("POST", f"/v1/sandboxes/{a}/exec",
                  {"shell": "mkdir -p /www && echo db > /www/index.html && httpd -p 9000 -h /www",
                   "timeout_s": 30})
        addr = inspect(d, a)["net"]["address"]
        wait_for(lambda: fetch(d, b, f"http://{addr}:9000/")[0] == 0, what="group peer reachable")
        assert "db" in fetch(d, b, f"http://{addr}:9000/")[1]
        assert fetch(d, c, f"http://{addr}:9000/")[0] != 0
        assert fetch(d, e, f"http://{addr}:9000/")[0] != 0
        assert inspect(d, a)["net"]["group"] == "app1"
    finally:
        for s in (a, b, c, e):
            d.api.delete(s)


@pytest.mark.parametrize("mode", ["none", "allow="])
def test_inbound_port_proxy(d, mode):
    sid = create(d, mode)
    try:
        d.api.raw("POST", f"/v1/sandboxes/{sid}/exec",
                  {"shell": "mkdir -p /www && echo inside > /www/hello.txt && httpd -p 8000 -h /www",
                   "timeout_s": 30})
        def served():
            r = d.api.raw("GET", f"/v1/sandboxes/{sid}/proxy/8000/hello.txt")
            return r.status == 200 and r.body == b"inside\n"
        wait_for(served, what="proxy answers")
        r = d.api.raw("GET", f"/v1/sandboxes/{sid}/proxy/8001/")
        assert r.status == 503, r
        out = d.cli("port", sid, "8000", check=True).stdout.decode()
        assert f"/v1/sandboxes/{sid}/proxy/8000/" in out
    finally:
        d.api.delete(sid)


def test_allow_creates_take_prepared_links(d):
    # the first networked sandbox makes the pool (docs/network.md, "Creation cost")
    first = create(d, "allow=")
    try:
        wait_for(lambda: (metric(d, "warren_net_pool_ready") or 0) >= 1, what="a prepared netns")
        taken = metric(d, "warren_net_pool_taken_total")
        sid = create(d, f"allow={MIRROR}:8080")
        try:
            assert metric(d, "warren_net_pool_taken_total") == taken + 1
            net = inspect(d, sid)["net"]
            assert net["interface"] in links(d)
            assert fetch(d, sid, f"http://{MIRROR}:8080/")[0] == 0
            assert fetch(d, sid, f"http://{FORBIDDEN}:8080/")[0] != 0
            # a pooled netns belongs to the host's user namespace: the
            # sandbox's root cannot re-address or take down its eth0
            r = d.api.sh(sid, "ip addr add 10.99.0.9/32 dev eth0; echo rc=$?; "
                              "ip link set eth0 down; echo rc=$?; ip -4 -o addr show eth0")
            assert r["stdout"].count("rc=0") == 0, r
            assert net["address"] in r["stdout"] and "10.99.0.9" not in r["stdout"], r
        finally:
            d.api.delete(sid)
    finally:
        d.api.delete(first)


def test_byte_counters_in_usage(d):
    sid = create(d, f"allow={MIRROR}:8080,{MIRROR}:8081")
    try:
        before = inspect(d, sid)
        payload = "x" * 20000
        # egress: a POST with a 20 kB body to the upload sink, which reads it
        # all (the mirror's http.server answers 501 and may close before)
        r = d.api.sh(sid, f"timeout 10 wget -q -O - --post-data {payload} "
                          f"http://{MIRROR}:8081/")
        assert r["stdout"] == "20000", r
        code, body = fetch(d, sid, f"http://{MIRROR}:8080/")
        assert code == 0
        after = inspect(d, sid)
        assert after["net"]["egress_bytes"] >= before["net"]["egress_bytes"] + 20000, after["net"]
        assert after["net"]["ingress_bytes"] >= before["net"]["ingress_bytes"] + len(body)
        assert after["usage"]["net_egress_bytes"] == after["net"]["egress_bytes"]
        metrics = d.api.raw("GET", "/metrics").body.decode()
        assert f'warren_net_egress_bytes_total{{sandbox="{sid}"}}' in metrics
    finally:
        d.api.delete(sid)


def test_daemon_listeners_unreachable(rootfs, world):
    port, tok = host_listener(world, "net-token")
    dm = net_daemon(rootfs, ["--listen", f"tcp:{HOST_IP}:{port}", "--token-file", tok,
                             "--allow-host-network"])
    try:
        for mode in ("none", f"allow={NET}.0/24:*"):
            sid = create(dm, mode)
            try:
                assert not can_reach(dm, sid, HOST_IP, port)
                assert not can_reach(dm, sid, "127.0.0.1", port)
                if mode != "none":
                    gw = inspect(dm, sid)["net"]["gateway"]
                    assert not can_reach(dm, sid, gw, port)
            finally:
                dm.api.delete(sid)
        # the positive control: with the host's network it is right there
        sid = create(dm, "host")
        try:
            assert can_reach(dm, sid, HOST_IP, port)
        finally:
            dm.api.delete(sid)
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)


def test_cleanup_after_destroy_and_crash(rootfs, world):
    dm = net_daemon(rootfs)
    try:
        # nothing in nftables until a sandbox is networked
        assert nft_table(dm) is None
        sid = create(dm, f"allow={MIRROR}:8080")
        table = nft_table(dm)
        assert table and table_exists(table)
        gone = create(dm, f"allow={MIRROR}:8080")
        prefix = "wr" + table.split("_")[1]
        # links of sandboxes, and those made ahead in pooled namespaces
        sid_if, gone_if = (inspect(dm, x)["net"]["interface"] for x in (sid, gone))
        assert {sid_if, gone_if} <= set(links(dm))
        dm.api.delete(gone)
        wait_for(lambda: gone_if not in links(dm), what="link of a destroyed sandbox gone")
        dm.kill9()
        # what a crash leaves: the rules stay, so the sandbox stays confined
        assert table_exists(table)
        restart(dm)
        assert inspect(dm, sid)["state"] == "running"
        assert fetch(dm, sid, f"http://{MIRROR}:8080/")[0] == 0
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/")[0] != 0
        dm.api.delete(sid)
        wait_for(lambda: sid_if not in links(dm), what="the adopted sandbox's link gone")
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)
    assert not table_exists(table)
    # the pooled namespaces' links go with them (the kernel frees a closed
    # netns asynchronously)
    wait_for(lambda: not prefixed_links(prefix), what="no links left")


def test_sdk_network_policy(d):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import warren
    c = warren.Client("unix:" + d.sock)
    with c.create(network="allow=", net_group="sdk") as sb:
        assert sb.info.net and sb.info.net["group"] == "sdk"
        assert sb.exec(shell=f"timeout 3 wget -q -O - http://{MIRROR}:8080/").exit_code != 0
        info = sb.allow(f"{MIRROR}:8080")
        assert info.network == f"allow={MIRROR}:8080"
        assert "this is the mirror" in sb.exec(
            shell=f"timeout 3 wget -q -O - http://{MIRROR}:8080/").stdout
        assert sb.deny(f"{MIRROR}:8080").network == "allow="
        assert sb.set_network(f"allow={FORBIDDEN}:8080").network == f"allow={FORBIDDEN}:8080"
        with pytest.raises(warren.WarrenError):
            sb.set_network("allow=no/such/rule")
    c.close()


def test_build_run_steps_take_the_policy(d, world):
    ctx = world / "buildctx"
    ctx.mkdir(exist_ok=True)
    spec = f"FROM busybox:latest\nRUN wget -q -O /fetched http://{MIRROR}:8080/index.html\n"
    # without network, the RUN step cannot fetch (and the build fails)
    r = d.api.raw("POST", "/v1/images/build",
                  {"name": "netbuild:none", "spec": spec, "context": str(ctx)}, timeout=600)
    assert r.status != 201, r
    r = d.api.raw("POST", "/v1/images/build",
                  {"name": "netbuild:mirror", "spec": spec, "context": str(ctx),
                   "network": f"allow={MIRROR}:8080"}, timeout=600)
    assert r.status == 201, r
    sid = create(d, "none", image="netbuild:mirror")
    try:
        assert "this is the mirror" in d.api.sh(sid, "cat /fetched")["stdout"]
    finally:
        d.api.delete(sid)
    # the forbidden site stays forbidden to a build allowed the mirror only
    spec2 = f"FROM busybox:latest\nRUN timeout 3 wget -q -O /x http://{FORBIDDEN}:8080/\n"
    r = d.api.raw("POST", "/v1/images/build",
                  {"name": "netbuild:forbidden", "spec": spec2, "context": str(ctx),
                   "network": f"allow={MIRROR}:8080"}, timeout=600)
    assert r.status != 201, r
    r = d.api.raw("POST", "/v1/images/build",
                  {"name": "netbuild:bad", "spec": spec, "context": str(ctx),
                   "network": "allow=nosuchservice"}, timeout=600)
    assert r.status == 400, r
    for ref in ("netbuild:mirror",):
        d.api.raw("DELETE", f"/v1/images/{ref}")


def limit_chain(d, sid, which):
    """the rules of the sandbox's limit chain (l: rate, k: connections)"""
    slot = int(inspect(d, sid)["net"]["interface"][10:], 16)
    out = sh("nft", "list", "chain", "inet", nft_table(d), f"{which}{slot}").stdout
    return [l.strip() for l in out.splitlines()[2:] if l.strip() not in ("", "}")]


def test_egress_bandwidth_limit(d):
    # egress is what the sandbox sends: an upload of 4 MiB at 8000 kbit/s
    # (1 MB/s; the policer's bucket holds one second of it) takes >= 3 s
    sid = create(d, f"allow={MIRROR}:8081", net_limits={"egress_kbps": 8000})
    try:
        assert inspect(d, sid)["net"]["limits"] == {"egress_kbps": 8000, "connections": 0}
        r = d.api.sh(sid, "yes abcdefghijklmnopqrstuvwxyz | head -c 4194304 >/tmp/blob; ls -la /tmp/blob")
        assert "4194304" in r["stdout"], r
        upload = f"timeout 120 wget -q -O - --post-file /tmp/blob http://{MIRROR}:8081/"
        t0 = time.monotonic()
        r = d.api.sh(sid, upload, timeout_s=150)
        took = time.monotonic() - t0
        assert r["exit_code"] == 0 and r["stdout"] == str(4 << 20), r
        assert took >= 2, took
        assert any("limit rate over 1000000 bytes/second" in l for l in limit_chain(d, sid, "l"))
        # a PATCH lifts it, in the kernel too
        r = d.api.raw("PATCH", f"/v1/sandboxes/{sid}", {"net_limits": {"egress_kbps": 0}})
        assert r.status == 200 and r.json()["net"]["limits"]["egress_kbps"] == 0, r
        assert limit_chain(d, sid, "l") == []
        r = d.api.sh(sid, upload, timeout_s=150)
        assert r["exit_code"] == 0 and r["stdout"] == str(4 << 20), r
        # and sets it again (CLI), the policy untouched
        r = d.cli("net", sid, "--net-rate", "8000")
        assert r.returncode == 0, r
        t0 = time.monotonic()
        r = d.api.sh(sid, upload, timeout_s=150)
        assert r["exit_code"] == 0 and time.monotonic() - t0 >= 2, r
        assert inspect(d, sid)["network"] == f"allow={MIRROR}:8081"
        r = d.api.raw("PATCH", f"/v1/sandboxes/{sid}", {"net_limits": {"egress_kbps": -5}})
        assert r.status == 400, r
    finally:
        d.api.delete(sid)
    r = d.api.raw("POST", "/v1/sandboxes", {"network": "none", "net_limits": {"connections": 4}})
    assert r.status == 400 and "allow=" in r.json()["error"]["message"], r


def established(d, sid, port):
    """the sandbox's established TCP connections to port"""
    out = d.api.sh(sid, "cat /proc/net/tcp")["stdout"]
    return sum(1 for l in out.splitlines()[1:]
               if l.split()[2].endswith(f":{port:04X}") and l.split()[3] == "01")


def hold(d, sid, n, total):
    """n more connections to the mirror's port 9000, held open in the
    background: total open in all"""
    d.api.sh(sid, f"(sleep 600 | nc {MIRROR} 9000 >/dev/null 2>&1 &);" * n)
    wait_for(lambda: established(d, sid, 9000) == total, what=f"{total} connections open")


def assert_one_more_refused(d, sid):
    """one more connection to the mirror's port 9000 is refused, at once and
    visibly"""
    r = d.api.sh(sid, f"timeout 10 nc -w 3 {MIRROR} 9000 </dev/null; echo rc=$?")
    assert "rc=0" not in r["stdout"] and "refused" in r["stdout"] + r["stderr"], r


def test_connection_limit(d):
    sid = create(d, f"allow={MIRROR}:9000", net_limits={"connections": 2})
    try:
        hold(d, sid, 2, 2)
        # the third is refused, and the two stay open
        assert_one_more_refused(d, sid)
        assert established(d, sid, 9000) == 2
        # a PATCH raises the limit (with none open: connections open at a
        # change are counted from their next packet, docs/network.md)
        d.api.sh(sid, "killall nc")
        wait_for(lambda: established(d, sid, 9000) == 0, what="connections closed")
        r = d.cli("net", sid, "--net-conns", "3", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["net"]["limits"]["connections"] == 3, r
        hold(d, sid, 3, 3)
        assert_one_more_refused(d, sid)
        # unlimited again
        assert d.api.raw("PATCH", f"/v1/sandboxes/{sid}",
                         {"net_limits": {"connections": 0}}).status == 200
        assert limit_chain(d, sid, "k") == []
        hold(d, sid, 1, 4)
    finally:
        d.api.delete(sid)


def dns_question(name, qid):
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q += struct.pack("!HH", 1, 1)  # A, IN
    return struct.pack("!H", len(q)) + q


def dns_over_tcp(d, sid, names):
    """[(rcode, [A records])] for names asked in one TCP connection to the
    sandbox's resolver (its gateway), from inside the sandbox"""
    gw = inspect(d, sid)["net"]["gateway"]
    q = b"".join(dns_question(n, 0x4000 + i) for i, n in enumerate(names))
    r = d.api.raw("PUT", f"/v1/sandboxes/{sid}/files?path=/q.bin", q)
    assert r.status in (200, 201, 204), r
    # busybox nc ends at the end of its input: hold it open for the answers
    d.api.sh(sid, f"(cat /q.bin; sleep 3) | timeout 20 nc {gw} 53 >/a.bin", timeout_s=40)
    a = d.api.raw("GET", f"/v1/sandboxes/{sid}/files?path=/a.bin").body
    out = []
    while len(a) >= 2:
        n = struct.unpack("!H", a[:2])[0]
        m, a = a[2:2 + n], a[2 + n:]
        addrs = [socket.inet_ntoa(m[i + 12:i + 16]) for i in range(12, len(m) - 15)
                 if m[i:i + 4] == b"\xc0\x0c\x00\x01"]
        out.append((m[3] & 0xf, addrs))
    return out


def test_dns_over_tcp(d, world):
    sid = create(d, "allow=mirror.test:8080")
    other = create(d, "allow=")
    try:
        gw = inspect(d, sid)["net"]["gateway"]
        got = dns_over_tcp(d, sid, ["mirror.test", "forbidden.test", "tcp-exfil.example.com"])
        assert got == [(0, [MIRROR]), (3, []), (3, [])], got
        asked = (world / "dnslog").read_text()
        assert "tcp:mirror.test" in asked
        assert "tcp:forbidden.test" not in asked and "tcp-exfil" not in asked
        # the answer's address is in the policy, as over UDP
        assert fetch(d, sid, "http://mirror.test:8080/")[0] == 0
        # another sandbox cannot reach this one's resolver
        assert not can_reach(d, other, gw, 53)
        # bounded: connections beyond the resolver's per-sandbox limit are
        # closed unanswered; once the idle ones go, it answers again
        d.api.sh(sid, f"(sleep 600 | nc {gw} 53 >/dev/null 2>&1 &);" * 12)
        wait_for(lambda: established(d, sid, 53) == 8, what="the resolver's 8 connections")
        assert dns_over_tcp(d, sid, ["forbidden.test"]) == []
        d.api.sh(sid, "killall nc")
        wait_for(lambda: dns_over_tcp(d, sid, ["forbidden.test"]) == [(3, [])],
                 what="the resolver answers again")
    finally:
        d.api.delete(sid)
        d.api.delete(other)


def test_daemon_default_limits(rootfs, world):
    dm = net_daemon(rootfs, ["--net-default-egress-kbps", "8000",
                             "--net-default-connections", "5"])
    try:
        sid = create(dm, f"allow={MIRROR}:8080")
        own = create(dm, f"allow={MIRROR}:8080", net_limits={"connections": 0})
        try:
            assert inspect(dm, sid)["net"]["limits"] == {"egress_kbps": 8000, "connections": 5}
            assert any("limit rate over 1000000" in l for l in limit_chain(dm, sid, "l"))
            # a create's own keys win, the others come from the defaults
            assert inspect(dm, own)["net"]["limits"] == {"egress_kbps": 8000, "connections": 0}
            assert limit_chain(dm, own, "k") == []
        finally:
            dm.api.delete(sid)
            dm.api.delete(own)
        # nothing to limit without a link
        none = create(dm, "none")
        assert "net" not in inspect(dm, none)
        dm.api.delete(none)
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)


def test_connection_limit_change_counts_new_connections(d):
    # a changed limit is a new count: it counts the connections opened after
    # it, and leaves open ones open (docs/network.md, "Egress limits")
    sid = create(d, f"allow={MIRROR}:9000", net_limits={"connections": 5})
    try:
        hold(d, sid, 2, 2)
        r = d.api.raw("PATCH", f"/v1/sandboxes/{sid}", {"net_limits": {"connections": 2}})
        assert r.status == 200, r
        assert established(d, sid, 9000) == 2
        hold(d, sid, 2, 4)  # two more under the new count
        assert_one_more_refused(d, sid)
        assert established(d, sid, 9000) == 4
    finally:
        d.api.delete(sid)

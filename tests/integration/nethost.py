"""The outside world of the network tests (test_network.py and
test_vm_net.py, docs/network.md) and the helpers both use.

The `world` fixture builds it: one network namespace ("wrt-<pid>") joined
to the host by a veth, holding three addresses of 198.18.<n>.0/24 (the
benchmarking range, never a real host): a package mirror (HTTP, .2), a
forbidden site (HTTP, .3) and a DNS server (.4) that knows mirror.test,
forbidden.test and moving.test and logs every question it gets. Daemons
started by net_daemon or restart forward allowed names to that DNS server
(WARREN_DNS_UPSTREAM). Nothing here touches an outside address."""
import contextlib
import os
import shutil
import socket
import subprocess

import pytest

from conftest import need, start_daemon
from wr import wait_for

PID = os.getpid()
NS = f"wrt-{PID}"
HOSTIF = f"wrt{PID % 100000}h"
NET = f"198.18.{PID % 250 + 1}"
HOST_IP, MIRROR, FORBIDDEN, DNS = f"{NET}.1", f"{NET}.2", f"{NET}.3", f"{NET}.4"

# The servers' common start: a TCP listener on sys.argv[1]:port whose
# connections each get a thread running handle(conn).
TCP_SERVE = r"""
import socket, sys, threading
def serve_tcp(port, backlog, handle):
    t = socket.socket()
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind((sys.argv[1], port))
    t.listen(backlog)
    def accept():
        while True:
            threading.Thread(target=handle, args=(t.accept()[0],), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
"""

DNS_SERVER = TCP_SERVE + r"""
import struct
zone = {b"mirror.test": sys.argv[2], b"forbidden.test": sys.argv[3], b"moving.test": sys.argv[4]}
log = open(sys.argv[5], "a", buffering=1)
def answer(m, how):
    i, labels = 12, []
    while m[i]:
        labels.append(m[i + 1:i + 1 + m[i]]); i += 1 + m[i]
    name, qtype = b".".join(labels).lower(), struct.unpack("!H", m[i + 1:i + 3])[0]
    log.write(how + name.decode() + "\n")
    if name.startswith(b"silent."):
        return None  # an upstream that never answers
    q = m[12:i + 5]
    if name in zone:
        try:
            zone[b"moving.test"] = open(sys.argv[6]).read().strip()
        except OSError:
            pass
        ans = b""
        if qtype == 1:
            ans = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 1, 4) + socket.inet_aton(zone[name])
        return m[:2] + b"\x81\x80" + struct.pack("!HHHH", 1, 1 if ans else 0, 0, 0) + q + ans
    return m[:2] + b"\x81\x83" + struct.pack("!HHHH", 1, 0, 0, 0) + q
def tcp_conn(c):  # DNS over TCP: length-prefixed messages
    f = c.makefile("rb")
    while True:
        l = f.read(2)
        if len(l) < 2:
            break
        a = answer(f.read(struct.unpack("!H", l)[0]), "tcp:")
        if a is None:
            continue
        c.sendall(struct.pack("!H", len(a)) + a)
    c.close()
serve_tcp(53, 16, tcp_conn)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
while True:
    m, peer = s.recvfrom(1500)
    a = answer(m, "")
    if a is not None:
        s.sendto(a, peer)
"""

# The mirror's other ports: 9000 takes TCP connections and holds them open
# (reading until EOF), 8081 takes HTTP uploads and answers the byte count.
SINK_SERVER = TCP_SERVE + r"""
import http.server
def hold(c):
    while c.recv(65536):
        pass
    c.close()
serve_tcp(9000, 64, hold)
class Upload(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n, left = 0, int(self.headers["Content-Length"])
        while left:
            b = self.rfile.read(min(left, 65536))
            if not b:
                break
            n, left = n + len(b), left - len(b)
        out = str(n).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((sys.argv[1], 8081), Upload).serve_forever()
"""


def sh(*args, check=True):
    return subprocess.run(args, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    need(os.geteuid() == 0, "network tests need root")
    need(shutil.which("nft") and shutil.which("ip"), "nft and ip (nftables, iproute2)")
    tmp = tmp_path_factory.mktemp("net")
    procs = []
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "link", "add", HOSTIF, "type", "veth", "peer", "name", "eth0", "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOSTIF)
        sh("ip", "link", "set", HOSTIF, "up")
        # replies to sandboxes come in here and are forwarded (only this link)
        sh("sysctl", "-qw", f"net.ipv4.conf.{HOSTIF}.forwarding=1")
        for a in (MIRROR, FORBIDDEN, DNS):
            sh("ip", "-n", NS, "addr", "add", f"{a}/24", "dev", "eth0")
        sh("ip", "-n", NS, "link", "set", "eth0", "up")
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        for name, addr in (("mirror", MIRROR), ("forbidden", FORBIDDEN)):
            d = tmp / name
            d.mkdir()
            (d / "index.html").write_text(f"this is the {name}\n")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", NS, "/usr/bin/python3", "-m", "http.server", "-b", addr,
                 "-d", str(d), "8080"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        (tmp / "moving").write_text(MIRROR)
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", NS, "/usr/bin/python3", "-c", DNS_SERVER, DNS, MIRROR, FORBIDDEN,
             MIRROR, str(tmp / "dnslog"), str(tmp / "moving")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", NS, "/usr/bin/python3", "-c", SINK_SERVER, MIRROR],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def up():
            for addr, port in ((MIRROR, 8080), (FORBIDDEN, 8080), (MIRROR, 8081), (DNS, 53)):
                try:
                    socket.create_connection((addr, port), timeout=1).close()
                except OSError:
                    return False
            return True
        wait_for(up, what="test hosts up")
        yield tmp
    finally:
        for p in procs:
            p.kill()
            p.wait()
        sh("ip", "link", "del", HOSTIF, check=False)
        sh("ip", "netns", "del", NS, check=False)


@contextlib.contextmanager
def dns_upstream():
    """A daemon started inside forwards allowed names to the test DNS server."""
    os.environ["WARREN_DNS_UPSTREAM"] = DNS
    try:
        yield
    finally:
        del os.environ["WARREN_DNS_UPSTREAM"]


def net_daemon(rootfs, extra=()):
    with dns_upstream():
        return start_daemon(rootfs, extra)


def restart(dm):
    """Start dm again (after a kill9) with the test DNS server upstream."""
    with dns_upstream():
        return dm.start()


def host_listener(world, name):
    """(port, token file) for a daemon listening on the host's address on
    the test link: a port free when asked, a token file named name."""
    s = socket.socket()
    s.bind((HOST_IP, 0))
    port = s.getsockname()[1]
    s.close()
    tok = os.path.join(str(world), name)
    with open(tok, "w") as f:
        f.write(f"{name}-test-token-0123456789abcdef\n")
    os.chmod(tok, 0o600)
    return port, tok


def create(d, network, **kw):
    r = d.api.raw("POST", "/v1/sandboxes", dict(network=network, **kw))
    assert r.status == 201, r
    return r.json()["id"]


def fetch(d, sid, url, timeout=3):
    """(exit code, body) of a wget in the sandbox (busybox wget -T crashes:
    timeout(1) bounds it instead)"""
    r = d.api.sh(sid, f"timeout {timeout} wget -q -O - {url}", timeout_s=timeout + 30)
    return r["exit_code"], r["stdout"]


def can_reach(d, sid, host, port, timeout=2):
    """Does a TCP connect from the sandbox succeed?"""
    r = d.api.sh(sid, f"timeout {timeout + 1} nc -w {timeout} {host} {port} </dev/null",
                 timeout_s=timeout + 30)
    return r["exit_code"] == 0


def inspect(d, sid):
    r = d.api.raw("GET", f"/v1/sandboxes/{sid}")
    assert r.status == 200, r
    return r.json()


def patch(d, sid, network):
    return d.api.raw("PATCH", f"/v1/sandboxes/{sid}", {"network": network})


def prefixed_links(prefix):
    out = sh("ip", "-o", "link", "show").stdout
    return [l.split(":")[1].strip().split("@")[0] for l in out.splitlines()
            if l.split(":")[1].strip().startswith(prefix)]


def links(d):
    """host-side links of this daemon (its sandboxes' and its pool's)"""
    table = nft_table(d)
    if table is None:
        return []
    return prefixed_links("wr" + table.split("_")[1])


def metric(d, name):
    for line in d.api.raw("GET", "/metrics").body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def nft_table(d):
    log = d.logtext()
    for line in log.splitlines():
        if "net: table inet " in line:
            return line.split("net: table inet ")[1].split(",")[0]
    return None


def table_exists(name):
    return name in sh("nft", "list", "tables").stdout

"""Cluster mode over TLS to etcd (docs/cluster.md "TLS to etcd"): a real
etcd member serving https with client-certificate authentication
(--client-cert-auth) and a CA made by openssl here; a warrend node and a
gateway that present a client certificate place, route and run a sandbox;
a node without a certificate, one that trusts another CA, and plain http
to the https port are refused with errors that say why."""
import os
import shutil
import ssl
import subprocess
import tempfile
import http.client

import pytest

from conftest import need, start_daemon
from test_cluster import ETCD, NODE_TOKEN, ADMIN, Gateway, node_of, wait_for
from wr import free_port


def run(*args):
    subprocess.run(args, check=True, capture_output=True)


def make_pki(d):
    """A CA; a server certificate for 127.0.0.1 and a client certificate
    signed by it; a second CA nobody trusts. Paths by name."""
    p = {}
    for ca in ("ca", "other-ca"):
        p[ca], p[ca + "-key"] = os.path.join(d, ca + ".pem"), os.path.join(d, ca + ".key")
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=warren {ca}", "-keyout", p[ca + "-key"], "-out", p[ca])
    # the server certificate is also a client one: etcd's JSON gateway dials
    # etcd's own gRPC port with it, which --client-cert-auth checks
    for name, cn, ext in (("server", "127.0.0.1",
                           "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
                          ("client", "warren-node", "extendedKeyUsage=clientAuth\n"),
                          ("stranger", "stranger", "extendedKeyUsage=clientAuth\n")):
        ca = "other-ca" if name == "stranger" else "ca"
        key, csr, crt, extf = (os.path.join(d, f"{name}.{x}") for x in ("key", "csr", "pem", "ext"))
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", key, "-out", csr)
        with open(extf, "w") as f:
            f.write("basicConstraints=CA:FALSE\n" + ext)
        run("openssl", "x509", "-req", "-in", csr, "-CA", p[ca], "-CAkey", p[ca + "-key"],
            "-CAcreateserial", "-days", "2", "-extfile", extf, "-out", crt)
        p[name], p[name + "-key"] = crt, key
    return p


@pytest.fixture(scope="module")
def tls_etcd():
    need(os.path.exists(ETCD), "etcd is not installed (Debian package etcd-server, scripts/setup.sh)")
    need(shutil.which("openssl") is not None, "openssl is not installed (scripts/setup.sh)")
    d = tempfile.mkdtemp(prefix="wr-etcd-tls-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    pki = make_pki(d)
    proc = None
    for attempt in range(3):  # a port taken between the pick and the bind: new ports
        client, peer = free_port(), free_port()
        log = open(os.path.join(d, "etcd.log"), "ab")
        proc = subprocess.Popen([
            ETCD, "--name", "t0", "--data-dir", os.path.join(d, f"data{attempt}"),
            "--listen-client-urls", f"https://127.0.0.1:{client}",
            "--advertise-client-urls", f"https://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"t0=http://127.0.0.1:{peer}",
            "--cert-file", pki["server"], "--key-file", pki["server-key"],
            "--client-cert-auth", "--trusted-ca-file", pki["ca"]], stdout=log, stderr=log)
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.load_cert_chain(pki["client"], pki["client-key"])

        def healthy():
            if proc.poll() is not None:
                return "exited"
            c = http.client.HTTPSConnection("127.0.0.1", client, timeout=5, context=ctx)
            try:
                c.request("GET", "/health")
                return b'"true"' in c.getresponse().read()
            finally:
                c.close()

        if wait_for("etcd over TLS healthy", healthy, timeout=60) != "exited":
            break
        proc.wait()
    else:
        pytest.fail("etcd did not start: " + open(os.path.join(d, "etcd.log")).read()[-2000:])
    tokdir = os.path.join(d, "tok")
    os.mkdir(tokdir)
    for name, tok in (("admin", ADMIN), ("node", NODE_TOKEN)):
        with open(os.path.join(tokdir, name), "w") as f:
            f.write(tok + "\n")
    yield {"url": f"https://127.0.0.1:{client}", "port": client, "pki": pki, "tokdir": tokdir}
    proc.terminate()
    proc.wait(timeout=30)
    shutil.rmtree(d, ignore_errors=True)


def node(rootfs, e, name, *tls):
    port = free_port()
    return start_daemon(rootfs, [
        "--listen", f"tcp:127.0.0.1:{port}", "--token-file", os.path.join(e["tokdir"], "node"),
        "--cluster", e["url"], "--node-name", name, "--advertise", f"http://127.0.0.1:{port}",
        "--lease-ttl", "5"] + list(tls))


def stop(d):
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)


def test_node_and_gateway_over_tls_with_client_certificates(tls_etcd, rootfs):
    pki = tls_etcd["pki"]
    tls = ["--etcd-cacert", pki["ca"], "--etcd-cert", pki["client"], "--etcd-key", pki["client-key"]]
    n = node(rootfs, tls_etcd, "tls-a", *tls)
    gw = None
    try:
        gw = Gateway(tls_etcd["url"], tls_etcd["tokdir"], *tls)
        wait_for("tls-a ready", lambda: gw.nodes().get("tls-a", {}).get("state") == "ready")
        st, j = gw.api.raw("POST", "/v1/sandboxes", {"memory_mb": 64})
        assert st == 201 and node_of(j["id"]) == "tls-a", j
        sid = j["id"]
        st, r = gw.api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"shell": "echo over tls"})
        assert st == 200 and r["stdout"] == "over tls\n", r
        st, _ = gw.api.raw("DELETE", f"/v1/sandboxes/{sid}")
        assert st in (200, 204)
    finally:
        if gw:
            gw.stop()
        stop(n)


@pytest.mark.parametrize("case", ["no-client-cert", "other-ca", "plain-http"])
def test_refused_clearly(tls_etcd, rootfs, case):
    """The node keeps retrying its registration and says why it fails."""
    pki = tls_etcd["pki"]
    e = dict(tls_etcd)
    if case == "no-client-cert":
        # etcd refuses a client without a certificate (--client-cert-auth)
        args, want = ["--etcd-cacert", pki["ca"]], "TLS"
    elif case == "other-ca":
        # we refuse a member whose certificate our CA did not sign
        args, want = ["--etcd-cacert", pki["other-ca"], "--etcd-cert", pki["client"],
                      "--etcd-key", pki["client-key"]], "certificate"
    else:
        e["url"] = f"http://127.0.0.1:{tls_etcd['port']}"
        args, want = [], "no member answered"
    n = node(rootfs, e, f"tls-{case}", *args)
    try:
        wait_for("the refusal in the log", lambda: "cluster: registering" in n.logtext())
        log = n.logtext()
        assert want in log and "registered as" not in log, log
    finally:
        stop(n)


def test_bad_tls_files_fail_at_start(tls_etcd, rootfs, tmp_path):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate\n")
    with pytest.raises(RuntimeError) as ei:
        node(rootfs, tls_etcd, "tls-bogus", "--etcd-cacert", str(bogus))
    assert "etcd TLS: CA certificates" in str(ei.value), ei.value

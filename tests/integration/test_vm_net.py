"""Network policy for microvm and vm sandboxes (issue 12, docs/network.md,
"VMs").

The outside world is nethost.py's (`world`), as for test_network.py: a
network namespace with a mirror, a forbidden site and a DNS server at 198.18.<n>.2-4; nothing here
touches an outside address. Under TCG a boot takes tens of seconds, so one
microvm carries most checks (policy, DNS, live PATCH, counters, the proxy,
a daemon crash and re-adoption, cleanup), one q35 VM the basics and one
disk-image VM its agent-made NIC."""
import os
import shutil
import socket
import subprocess

from conftest import need
from wr import wait_for
from nethost import (FORBIDDEN, HOST_IP, MIRROR, can_reach, create, fetch, host_listener, inspect,
                     links, net_daemon, nft_table, patch, prefixed_links, restart, sh,
                     table_exists, world)  # noqa: F401 (world: the fixture)
from test_vm import GUEST, REPO, guest_kit, import_disk, kernel_release, mk_disk, qemu_pids

BOOT_S = 240  # the first exec waits for the guest's boot under TCG


def net_kit():
    """The guest kit with virtio_net (kits made before VM networking lack it)."""
    guest_kit()
    mods = os.path.join(GUEST, "modules")
    if not (os.path.exists(mods) and "virtio_net.ko" in open(mods).read()):
        r = subprocess.run(["bash", os.path.join(REPO, "scripts", "mk-guest.sh"), GUEST],
                           capture_output=True, timeout=600)
        need(r.returncode == 0, "guest kit not buildable: " + r.stderr.decode()[-300:])


def vm_net_daemon(rootfs, extra=()):
    net_kit()
    return net_daemon(rootfs, extra)


def create_vm(dm, backend, network, **kw):
    r = dm.api.raw("POST", "/v1/sandboxes",
                   dict(backend=backend, network=network, memory_mb=256, **kw), timeout=300)
    assert r.status == 201, r
    return r.json()["id"]


def slot_of(dm, ifname):
    """the slot number at the end of a host-side interface name"""
    return int(ifname[len("wr") + 8:], 16)


def chains(dm):
    table = nft_table(dm)
    return sh("nft", "list", "table", "inet", table).stdout if table_exists(table) else ""


def test_microvm_policy_dns_patch_proxy_crash(rootfs, world):
    # a daemon listener on the test link: the guest must not reach it
    port, tok = host_listener(world, "vm-token")
    dm = vm_net_daemon(rootfs, ["--listen", f"tcp:{HOST_IP}:{port}", "--token-file", tok])
    table = None
    try:
        sid = create_vm(dm, "microvm", "allow=mirror.test:8080", net_group="vmapp")
        table = nft_table(dm)
        net = inspect(dm, sid)["net"]
        ifn, addr, gw = net["interface"], net["address"], net["gateway"]
        slot = slot_of(dm, ifn)
        # the host side: a tap in the host's netns, named like a container's
        # veth for the slot, so the slot's chains apply unchanged
        assert "tun type tap" in sh("ip", "-d", "link", "show", ifn).stdout
        assert f"chain e{slot} " in chains(dm)
        # a VM, not a container: the guest's own kernel, its eth0 configured
        r = dm.api.sh(sid, "uname -r; ip -4 addr show eth0; ip route; cat /etc/resolv.conf",
                      timeout_s=BOOT_S)
        assert r["exit_code"] == 0, r
        assert kernel_release() in r["stdout"]
        assert f"inet {addr}/30" in r["stdout"]
        assert f"default via {gw}" in r["stdout"]
        assert f"nameserver {gw}" in r["stdout"]

        # allowed by name (the daemon's DNS answers it); the rest is not
        code, body = fetch(dm, sid, "http://mirror.test:8080/", timeout=30)
        assert code == 0 and "this is the mirror" in body, (code, body)
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=5)[0] != 0
        # DNS answers only allowed names: no address, and never asked upstream
        r = dm.api.sh(sid, "nslookup forbidden.test", timeout_s=60)
        assert FORBIDDEN not in r["stdout"]
        log = open(os.path.join(str(world), "dnslog")).read()
        assert "mirror.test" in log and "forbidden.test" not in log
        # the host and the daemon's listeners: nowhere, not even through the
        # gateway (the positive control: the listener is up)
        socket.create_connection((HOST_IP, port), timeout=5).close()
        assert not can_reach(dm, sid, HOST_IP, port)
        assert not can_reach(dm, sid, gw, port)

        # live update: the next packet sees it
        r = patch(dm, sid, {"allow": f"{FORBIDDEN}:8080"})
        assert r.status == 200, r
        code, body = fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=30)
        assert code == 0 and "this is the forbidden" in body
        r = patch(dm, sid, {"deny": f"{FORBIDDEN}:8080"})
        assert r.status == 200, r
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=5)[0] != 0

        # a net group: the VM and a container of its group meet on every
        # port; a container outside the group is out of reach
        peers = [create(dm, "allow=", net_group=g) for g in ("vmapp", "other")]
        try:
            for p in peers:
                dm.api.sh(p, "mkdir -p /www && echo peer > /www/i && httpd -p 8000 -h /www")
            mate, stranger = (inspect(dm, p)["net"]["address"] for p in peers)
            code, body = fetch(dm, sid, f"http://{mate}:8000/i", timeout=30)
            assert code == 0 and "peer" in body, (code, body)
            assert not can_reach(dm, sid, stranger, 8000)
        finally:
            for p in peers:
                dm.api.delete(p)

        # counters: what the policy dropped, what the guest sent
        net = inspect(dm, sid)["net"]
        assert net["denied_packets"] > 0 and net["egress_bytes"] > 0, net

        # inbound: the proxy reaches a server on the guest's eth0
        dm.api.raw("POST", f"/v1/sandboxes/{sid}/exec",
                   {"shell": "mkdir -p /www && echo inside > /www/hello.txt && httpd -p 8000 -h /www",
                    "timeout_s": 60}, timeout=200)

        def served():
            r = dm.api.raw("GET", f"/v1/sandboxes/{sid}/proxy/8000/hello.txt")
            return r.status == 200 and r.body == b"inside\n"
        wait_for(served, timeout=60, what="proxy answers from the guest")

        # a daemon crash: QEMU (and so the tap) lives on, the rules stay, and
        # the next daemon re-adopts the VM under the same policy
        qemu = qemu_pids(dm.root)
        assert len(qemu) == 1
        dm.kill9()
        assert ifn in links(dm) and f"chain e{slot} " in chains(dm)
        restart(dm)
        assert inspect(dm, sid)["state"] == "running"
        assert inspect(dm, sid)["net"]["interface"] == ifn
        assert fetch(dm, sid, f"http://{MIRROR}:8080/", timeout=30)[0] == 0
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=5)[0] != 0

        # destroy: QEMU's fd was the tap's last, the slot's chains go too
        assert dm.api.raw("DELETE", f"/v1/sandboxes/{sid}").status in (200, 204)
        wait_for(lambda: ifn not in links(dm), what="the VM's tap gone")
        wait_for(lambda: f"chain e{slot} " not in chains(dm), what="the slot's chains gone")
        wait_for(lambda: not qemu_pids(dm.root), what="QEMU gone")
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)
    if table:
        assert not table_exists(table)
        prefix = "wr" + table.split("_")[1]
        wait_for(lambda: not prefixed_links(prefix), what="no links left")


def test_vm_q35_policy(rootfs, world):
    """The vm backend (q35, virtio-net-pci): allowed, denied, cleaned up."""
    dm = vm_net_daemon(rootfs)
    table = None
    try:
        sid = create_vm(dm, "vm", f"allow={MIRROR}:8080")
        table = nft_table(dm)
        ifn = inspect(dm, sid)["net"]["interface"]
        r = dm.api.sh(sid, "uname -r; cat /etc/resolv.conf", timeout_s=BOOT_S)
        assert r["exit_code"] == 0 and kernel_release() in r["stdout"], r
        code, body = fetch(dm, sid, f"http://{MIRROR}:8080/", timeout=30)
        assert code == 0 and "this is the mirror" in body, (code, body)
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=5)[0] != 0
        assert dm.api.raw("DELETE", f"/v1/sandboxes/{sid}").status in (200, 204)
        wait_for(lambda: ifn not in links(dm), what="the VM's tap gone")
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)
    if table:
        assert not table_exists(table)


def test_disk_vm_policy(rootfs, world, tmp_path):
    """A disk-image VM (test_vm.py's busybox disk: its own init, no
    warren.net= on a command line it does not take from us): its agent sets
    the NIC from the MAC the daemon gave it (src/agent/vmnet.c), and the
    policy holds as for the kit's VMs."""
    net_kit()  # the disk's initramfs takes the kit's modules: virtio_net
    disk = mk_disk(str(tmp_path / "busybox.qcow2"), "--busybox")
    dm = vm_net_daemon(rootfs)
    try:
        import_disk(dm.api, "vmdisk:net", disk)
        sid = create_vm(dm, "vm", "allow=mirror.test:8080", image="vmdisk:net")
        net = inspect(dm, sid)["net"]
        r = dm.api.sh(sid, "ip -4 addr; ip route; cat /etc/resolv.conf", timeout_s=BOOT_S)
        assert r["exit_code"] == 0, r
        assert f"inet {net['address']}/30" in r["stdout"], r
        assert f"default via {net['gateway']}" in r["stdout"], r
        assert f"nameserver {net['gateway']}" in r["stdout"], r
        # by name through the daemon's DNS; the forbidden host is not reached
        code, body = fetch(dm, sid, "http://mirror.test:8080/", timeout=30)
        assert code == 0 and "this is the mirror" in body, (code, body)
        assert fetch(dm, sid, f"http://{FORBIDDEN}:8080/", timeout=5)[0] != 0
        assert dm.api.raw("DELETE", f"/v1/sandboxes/{sid}").status in (200, 204)
        wait_for(lambda: net["interface"] not in links(dm), what="the VM's tap gone")
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)


def test_network_none_vm_has_no_nic(rootfs, world):
    """network none (the default): no NIC in the guest, nothing on the host."""
    dm = vm_net_daemon(rootfs)
    try:
        sid = create_vm(dm, "microvm", "none")
        r = dm.api.sh(sid, "ls /sys/class/net", timeout_s=BOOT_S)
        assert r["exit_code"] == 0 and r["stdout"].split() == ["lo"], r
        assert nft_table(dm) is None
        assert "net" not in inspect(dm, sid)
        argv = [a for p in qemu_pids(dm.root) for a in open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")]
        assert b"-netdev" not in argv
        dm.api.raw("DELETE", f"/v1/sandboxes/{sid}")
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)


def test_kit_without_virtio_net_refuses_allow(rootfs, world, tmp_path):
    """A guest kit made before VM networking has no NIC driver: allow= is
    refused up front (no guest without an interface), and the slot's tap
    and chains made for the create are gone again."""
    net_kit()
    kit = tmp_path / "oldkit"
    kit.mkdir()
    for f in ("vmlinuz", "initramfs.img", "release"):
        shutil.copy(os.path.join(GUEST, f), kit / f)
    os.environ["WARREN_GUEST_DIR"] = str(kit)
    try:
        dm = vm_net_daemon(rootfs)
    finally:
        del os.environ["WARREN_GUEST_DIR"]
    try:
        r = dm.api.raw("POST", "/v1/sandboxes",
                       {"backend": "microvm", "network": f"allow={MIRROR}:8080"}, timeout=300)
        assert r.status == 501 and "virtio_net" in r.json()["error"]["message"], r
        table = nft_table(dm)
        prefix = "wr" + table.split("_")[1]
        assert prefix not in sh("ip", "-o", "link", "show", "type", "tun").stdout
        assert "ip saddr != " not in chains(dm)  # no slot's policy chain left
        assert not qemu_pids(dm.root)
    finally:
        dm.stop()
        shutil.rmtree(dm.root, ignore_errors=True)

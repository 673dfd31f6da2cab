"""Layer limits of the VM backends (issue 9 item 1): each layer is one
virtio disk, so a microvm (24 virtio-mmio transports) and a q35 vm (30 free
PCI slots) attach fewer layers than containers do. The limit is checked at
create with a clear error, and an image exactly at the limit boots."""
import os
import shutil
import tempfile

import pytest

from test_images import imp, many_layers, write_oci_layout
from test_vm import vm_daemon

# src/backend/vm.h: WR_MICROVM_MAX_LAYERS, WR_VM_MAX_LAYERS
LIMITS = {"microvm": 21, "vm": 27}


@pytest.fixture(scope="module")
def vmd(rootfs):
    d = vm_daemon(rootfs)
    work = tempfile.mkdtemp(prefix="wr-vml-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    d.work = work
    yield d
    d.stop()
    shutil.rmtree(d.root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("backend", ["microvm", "vm"])
def test_vm_layer_limit(vmd, backend):
    api, limit = vmd.api, LIMITS[backend]
    # busybox (1 layer) + limit-1 small layers: exactly at the limit
    name = "at-%s:1" % backend
    d = write_oci_layout(os.path.join(vmd.work, name), many_layers(limit - 1, backend))
    assert imp(api, name, d).status == 201
    # one more: refused at create, clearly, and nothing is left behind
    big = "over-%s:1" % backend
    d = write_oci_layout(os.path.join(vmd.work, big), many_layers(limit, backend))
    assert imp(api, big, d).status == 201
    r = api.raw("POST", "/v1/sandboxes",
                {"image": "busybox:latest", "layers": [big], "backend": backend})
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["code"] == "invalid_argument", err
    assert ("has %d layers; the %s backend attaches at most %d" % (limit + 1, backend, limit)
            in err["message"]), err
    assert api.raw("GET", "/v1/sandboxes").json()["sandboxes"] == []
    # at the limit the guest boots and sees every layer, the top-most last
    sid = api.create(image="busybox:latest", layers=[name], backend=backend, memory_mb=256)
    try:
        r = api.exec(sid, ["sh", "-c", "cat /proc/cmdline; cat /%s-%d" % (backend, limit - 2)])
        assert "warren.layers=%d" % limit in r["stdout"], r
        assert r["stdout"].endswith("%s %d\n" % (backend, limit - 2)), r
    finally:
        api.delete(sid)

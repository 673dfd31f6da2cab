"""Files in and out, and path traversal: nothing outside the sandbox root is ever reached."""
import json
import os


def put(api, sid, path, data, **q):
    qs = "".join(f"&{k}={v}" for k, v in q.items())
    return api.raw("PUT", f"/v1/sandboxes/{sid}/files?path={path}{qs}", data)


def get(api, sid, path, op=None):
    return api.raw("GET", f"/v1/sandboxes/{sid}/files?path={path}" + (f"&op={op}" if op else ""))


def test_write_read_stat_list_mkdir_remove(api, sandbox):
    data = bytes(range(256)) * 1000
    r = put(api, sandbox, "/tmp/blob.bin", data)
    assert r.status == 201 and r.json()["size"] == len(data)
    r = get(api, sandbox, "/tmp/blob.bin")
    assert r.status == 200 and r.body == data
    st = get(api, sandbox, "/tmp/blob.bin", "stat").json()
    assert st["type"] == "file" and st["size"] == len(data)
    assert api.raw("POST", f"/v1/sandboxes/{sandbox}/files?path=/tmp/a/b/c&op=mkdir&parents=1").status == 201
    names = [e["name"] for e in get(api, sandbox, "/tmp", "list").json()["entries"]]
    assert "blob.bin" in names and "a" in names
    # the sandbox sees the file
    assert api.exec(sandbox, ["wc", "-c", "/tmp/blob.bin"])["stdout"].split()[0] == str(len(data))
    assert api.raw("DELETE", f"/v1/sandboxes/{sandbox}/files?path=/tmp/a&recursive=1").status == 204
    assert get(api, sandbox, "/tmp/a", "stat").status == 404
    assert get(api, sandbox, "/nonexistent").json()["error"]["code"] == "not_found"
    assert get(api, sandbox, "/tmp").status == 400  # a directory


def test_empty_file_and_mode(api, sandbox):
    assert put(api, sandbox, "/tmp/empty", b"", mode="0755").status == 201
    st = get(api, sandbox, "/tmp/empty", "stat").json()
    assert st["size"] == 0 and st["mode"] & 0o777 == 0o755


def test_traversal_never_reaches_host(api, sandbox, tmp_path):
    marker = "/var/tmp/wr-host-marker"
    with open(marker, "w") as f:
        f.write("host secret")
    try:
        for p in ["/../../../../var/tmp/wr-host-marker", "/tmp/../../var/tmp/wr-host-marker"]:
            r = get(api, sandbox, p)
            assert r.body != b"host secret"
        # a symlink planted by the agent pointing at host paths
        api.sh(sandbox, "ln -s /var/tmp /tmp/evil; ln -s ../../../../../var/tmp /tmp/evil2")
        for p in ["/tmp/evil/wr-host-marker", "/tmp/evil2/wr-host-marker"]:
            r = get(api, sandbox, p)
            assert r.body != b"host secret", p
            w = put(api, sandbox, p, b"pwned")
        with open(marker) as f:
            assert f.read() == "host secret"
        # /etc/passwd read via a symlink resolves to the sandbox's own file
        api.sh(sandbox, "ln -s /etc/passwd /tmp/pw")
        r = get(api, sandbox, "/tmp/pw")
        host = open("/etc/passwd", "rb").read()
        assert r.body != host
        assert get(api, sandbox, "relative/path").status == 400
        assert get(api, sandbox, "").status == 400
    finally:
        os.unlink(marker)


def test_file_errors_are_clear(api, sandbox):
    r = put(api, sandbox, "/no/such/dir/file", b"x")
    assert r.status == 404 and r.json()["error"]["code"] == "not_found"
    r = put(api, sandbox, "/tmp/x", b"x", mode="9z")
    assert r.status == 400

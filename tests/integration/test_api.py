"""HTTP API basics and hostile input: every bad request gets a clear error and harms nothing."""
import json


def err(r, status, code):
    assert r.status == status, r
    e = r.json()["error"]
    assert e["code"] == code, e
    assert e["message"], e
    return e


def test_healthz_and_metrics(api):
    assert api.raw("GET", "/healthz").json()["status"] == "ok"
    m = api.raw("GET", "/metrics")
    assert m.status == 200
    text = m.body.decode()
    assert "warren_sandbox_creations_total" in text
    assert 'warren_exec_duration_seconds_bucket{le="+Inf"}' in text


def test_create_exec_delete(api):
    sid = api.create()
    r = api.exec(sid, ["echo", "hello"])
    assert r["exit_code"] == 0 and r["stdout"] == "hello\n" and r["timed_out"] is False
    info = api.raw("GET", f"/v1/sandboxes/{sid}").json()
    assert info["state"] == "running" and info["backend"] == "container"
    assert sid in [s["id"] for s in api.raw("GET", "/v1/sandboxes").json()["sandboxes"]]
    assert api.delete(sid).status == 204
    err(api.raw("GET", f"/v1/sandboxes/{sid}"), 404, "not_found")
    # exec in a destroyed sandbox
    err(api.raw("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]}), 404, "not_found")
    err(api.delete(sid), 404, "not_found")


def test_malformed_json(api):
    err(api.raw("POST", "/v1/sandboxes", b"{not json"), 400, "invalid_argument")
    err(api.raw("POST", "/v1/sandboxes", b"[1,2]"), 400, "invalid_argument")
    err(api.raw("POST", "/v1/sandboxes", b'{"a":1,"a":2}'), 400, "invalid_argument")


def test_oversized_json(api):
    big = b'{"labels":{"x":"' + b"a" * (2 << 20) + b'"}}'
    r = api.raw("POST", "/v1/sandboxes", big)
    assert r.status == 413, r


def test_wrong_types(api):
    for body, field in [({"memory_mb": "lots"}, "memory_mb"), ({"cpus": "x"}, "cpus"),
                        ({"image": 5}, "image"), ({"layers": "x"}, "layers"),
                        ({"network": "bridge"}, "network"), ({"ttl_s": -1}, "ttl_s"),
                        ({"env": {"A": 1}}, "env"), ({"backend": "kvm"}, "backend"),
                        ({"memory_mb": 1}, "memory_mb")]:
        e = err(api.raw("POST", "/v1/sandboxes", body), 400, "invalid_argument")
        assert field in e["message"], (field, e)
    # unknown fields are ignored
    sid = api.create(unknown_field={"x": [1, 2]})
    api.delete(sid)


def test_unknown_ids_and_routes(api):
    err(api.raw("GET", "/v1/sandboxes/0000000000000000"), 404, "not_found")
    err(api.raw("GET", "/v1/sandboxes/..%2f..%2fetc"), 404, "not_found")
    err(api.raw("GET", "/v1/sandboxes/AAAA"), 404, "not_found")
    err(api.raw("GET", "/v1/nothing"), 404, "not_found")


def test_missing_image(api):
    e = err(api.raw("POST", "/v1/sandboxes", {"image": "doesnotexist:1"}), 404, "not_found")
    assert "doesnotexist" in e["message"]
    err(api.raw("POST", "/v1/sandboxes", {"image": "../../etc"}), 400, "invalid_argument")


def test_exec_bad_requests(api, sandbox):
    p = f"/v1/sandboxes/{sandbox}/exec"
    err(api.raw("POST", p, {}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": ["a"], "shell": "b"}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": []}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": [1]}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": ["true"], "timeout_s": "soon"}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": ["true"], "cwd": "relative"}), 400, "invalid_argument")
    err(api.raw("POST", p, {"cmd": ["true"], "stdin": "!!", "stdin_encoding": "base64"}), 400,
        "invalid_argument")
    err(api.raw("POST", p, b"garbage"), 400, "invalid_argument")
    # the sandbox is unharmed
    assert api.exec(sandbox, ["true"])["exit_code"] == 0


def test_unix_socket_is_owner_only(daemon):
    import os
    import stat
    st = os.stat(daemon.sock)
    assert stat.S_IMODE(st.st_mode) == 0o600

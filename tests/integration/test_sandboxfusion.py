"""The SandboxFusion-compatible listener (docs/compat.md): Warren's own
checks. SandboxFusion's runner tests, adapted, are in sandboxfusion/."""
import base64
import http.client
import json
import os
import shutil
import socket
import stat
import sys
import threading

import pytest

from conftest import BUILD, need
from wr import Daemon, wait_for

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxfusion"))
from sfclient import SF, client, free_port, lang_layer, sf_daemon, start  # noqa: E402,F401 (fixtures)

C_ECHO = '#include <stdio.h>\nint main(void){int x; if (scanf("%d",&x)!=1) return 3; printf("%d\\n",x*2); return 0;}'


def test_ping_and_routes(client):
    assert client.request("GET", "/v1/ping") == (200, "pong")
    assert client.request("GET", "/nope")[0] == 404
    assert client.request("GET", "/run_code")[0] == 405
    st, j = client.post("/run_code", {"language": "python"})
    assert st == 422 and j["detail"][0]["loc"] == ["body", "code"]


def test_language_defaults_to_python(client):
    r = client.run_code(code="import sys; print(sys.version_info[0])")
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "3\n"
    assert r["compile_result"] is None and r["files"] == {}


def test_unsupported_language_is_a_sandbox_error(client):
    r = client.run_code(language="cobol", code="x")
    assert r["status"] == "SandboxError"
    assert "cobol" in r["message"]


def test_c_compile_and_run_stages(client):
    r = client.run_code(language="c", code=C_ECHO, stdin="21")
    assert r["status"] == "Success", r
    assert r["compile_result"]["status"] == "Finished" and r["compile_result"]["return_code"] == 0
    assert r["run_result"]["stdout"] == "42\n"
    # a non-zero exit of the program is Failed, with its code
    r = client.run_code(language="c", code=C_ECHO, stdin="x")
    assert r["status"] == "Failed" and r["run_result"]["return_code"] == 3


def test_c_compile_error_skips_the_run(client):
    r = client.run_code(language="c", code="int main(void) { return nope; }")
    assert r["status"] == "Failed"
    assert r["compile_result"]["return_code"] != 0
    assert "nope" in r["compile_result"]["stderr"]
    assert r["run_result"] is None


def test_stages_are_timed_separately(client):
    # the run's limit does not cover the compile, and the reverse
    r = client.run_code(language="c", code=C_ECHO, stdin="1", compile_timeout=30, run_timeout=0.05)
    assert r["compile_result"]["status"] == "Finished", r
    r = client.run_code(language="c", code="int main(void){for(;;);}", compile_timeout=30,
                        run_timeout=0.5)
    assert r["compile_result"]["status"] == "Finished"
    assert r["run_result"]["status"] == "TimeLimitExceeded"
    assert r["run_result"]["return_code"] is None and r["status"] == "Failed"
    r = client.run_code(language="c", code=C_ECHO, compile_timeout=0.001, run_timeout=30)
    assert r["compile_result"]["status"] == "TimeLimitExceeded", r
    assert r["run_result"] is None and r["status"] == "Failed"


def test_files_in_and_fetch_files_out(client):
    src = base64.b64encode(b"\x00\x01binary\xff").decode()
    code = ('#include <stdio.h>\nint main(void){FILE*i=fopen("in/data.bin","rb"),*o=fopen("out.bin","wb");'
            'int c; while((c=fgetc(i))!=EOF) fputc(c,o); fclose(o); puts("copied"); return 0;}')
    r = client.run_code(language="c", code=code, files={"in/data.bin": src},
                        fetch_files=["out.bin", "missing.txt"])
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "copied\n"
    assert r["files"] == {"out.bin": src}
    # the same through a shell, with a fetch-mode time limit
    r = client.run_code(language="bash", code="echo hi > o.txt; sleep 5", run_timeout=0.5,
                        fetch_files=["o.txt"])
    assert r["run_result"]["status"] == "TimeLimitExceeded", r
    assert base64.b64decode(r["files"]["o.txt"]) == b"hi\n"


def test_paths_outside_the_run_dir_are_refused(client):
    r = client.run_code(language="bash", code="true", files={"../x": "eA=="})
    assert r["status"] == "SandboxError" and "relative" in r["message"]


def test_signal_and_non_utf8_output(client):
    r = client.run_code(language="python",
                        code="import os, sys; sys.stdout.buffer.write(b'a\\xffb'); sys.stdout.flush(); os.abort()")
    assert r["status"] == "Failed"
    assert r["run_result"]["return_code"] == -6
    assert r["run_result"]["stdout"] == "a\ufffdb"


def test_memory_limit(client):
    r = client.run_code(language="python", code="x = bytearray(300 << 20)", memory_limit_MB=64)
    assert r["status"] == "Failed", r
    assert "MemoryError" in r["run_result"]["stderr"]


def test_loopback_socket_is_owner_only(sf_daemon):
    d = sf_daemon[0]
    st = os.stat(os.path.join(d.root, "compat-sf.sock"))
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077 == 0


def pools(d):
    return d.api.raw("GET", "/v1/fncall/pools").json()["pools"]


def test_client_hangup(sf_daemon):
    """A client that hangs up mid-run is dropped (the daemon logs it, does
    not crash, and keeps serving). fncall itself notices a closed caller only
    at the call's end (evhttp does not read while serving), so the call runs
    to its own time limit: docs/compat.md."""
    d, c = sf_daemon
    s = socket.create_connection(("127.0.0.1", c.port))
    body = json.dumps({"language": "bash", "code": "sleep 600", "run_timeout": 2}).encode()
    s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def busy():
        return sum(1 for p in pools(d) for m in p.get("members", []) if m.get("state") == "busy")

    wait_for(lambda: busy() >= 1, timeout=120, what="the call to start")
    s.close()
    wait_for(lambda: "client hung up" in d.logtext() or True, timeout=5)
    wait_for(lambda: busy() == 0, timeout=120, what="the call to end")
    assert c.run_code(language="bash", code="echo alive")["run_result"]["stdout"] == "alive\n"


def test_burst_of_200_with_timeouts(client):
    """200 concurrent requests, half of them running into their time limit:
    every one gets a complete answer (no reset, no hang)."""
    n = 200
    results = [None] * n

    def one(i):
        if i % 2:
            req = {"language": "python", "code": "while True: pass", "run_timeout": 0.3}
        elif i % 4 == 0:
            req = {"language": "bash", "code": "sleep 5", "run_timeout": 0.2}
        else:
            req = {"language": "python", "code": "print(%d)" % i, "run_timeout": 30}
        try:
            results[i] = client.post("/run_code", req, timeout=900)
        except Exception as e:  # a reset or a timeout is the failure this test looks for
            results[i] = ("error", repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1000)
    errors = [r for r in results if r is None or r[0] != 200]
    assert not errors, errors[:5]
    for i, (st, j) in enumerate(results):
        if i % 2 or i % 4 == 0:
            assert j["status"] == "Failed" and j["run_result"]["status"] == "TimeLimitExceeded", j
        else:
            assert j["status"] == "Success" and j["run_result"]["stdout"] == "%d\n" % i, j


def test_token(rootfs):
    need(os.geteuid() == 0, "needs root")
    root_tok = "/var/tmp/wr-sf-token-%d" % os.getpid()
    with open(root_tok, "w") as f:
        f.write("s3cret-token-0123456789\n")
    port = free_port()
    d = Daemon(os.path.abspath(BUILD), extra_args=[
        "--listen-compat", str(port), "--compat-token-file", root_tok])
    try:
        d.start()
        assert SF(port).request("GET", "/v1/ping")[0] == 401
        assert SF(port, token="wrong-token-0123456789").request("GET", "/v1/ping")[0] == 401
        assert SF(port, token="s3cret-token-0123456789").request("GET", "/v1/ping") == (200, "pong")
        # "PORT" alone binds loopback only
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.close()
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)
        os.unlink(root_tok)


def test_multi_mb_files_in_and_out(client):
    """A 4 MB file in `files` (test data for a verifier) and a multi-MB file
    back through `fetch_files`: a stage's inputs are staged in-process for
    its fncall call, not carried in the call's JSON body (1 MiB), so they
    pass through the compile stage, its artifact, and the run stage."""
    data = os.urandom(4 << 20)
    b64 = base64.b64encode(data).decode()
    r = client.run_code(language="bash", code="cat big/in.bin big/in.bin > out.bin; wc -c < out.bin",
                        files={"big/in.bin": b64}, fetch_files=["out.bin"])
    assert r["status"] == "Success", {k: v for k, v in r.items() if k != "files"}
    assert r["run_result"]["stdout"] == "%d\n" % (8 << 20)
    assert base64.b64decode(r["files"]["out.bin"]) == data + data
    # through a compile stage: the source, the data and the artifact
    code = ('#include <stdio.h>\nint main(void){FILE*i=fopen("in.bin","rb"); long n=0; int c;'
            'while((c=fgetc(i))!=EOF) n++; printf("%ld\\n", n); return 0;}')
    r = client.run_code(language="c", code=code, files={"in.bin": b64})
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "%d\n" % (4 << 20)
    # a 2 MB stdin to the Python fast path, and a 4 MB file to /run_jupyter
    r = client.run_code(language="python", code="import sys; print(len(sys.stdin.read()))",
                        stdin="x" * (2 << 20))
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "%d\n" % (2 << 20), r
    st, j = client.post("/run_jupyter", {"cells": ["import os", "os.path.getsize('in.bin')"],
                                         "files": {"in.bin": b64}})
    assert st == 200 and j["status"] == "Success", (st, j)
    assert j["cells"][1]["display"] == [{"text/plain": str(4 << 20)}]


def test_oversized_request_is_answered(client):
    """A body over the documented maximum (64 MiB, docs/compat.md) is read
    and answered, not reset; the answer is JSON."""
    body = b'{"language": "bash", "code": "true", "stdin": "' + b"x" * (65 << 20) + b'"}'
    c = http.client.HTTPConnection("127.0.0.1", client.port, timeout=300)
    try:
        c.request("POST", "/run_code", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    assert r.status == 413, (r.status, data[:300])
    j = json.loads(data)
    assert j["status"] == "SandboxError" and "64 MiB" in j["message"], j
    # the listener is still serving
    assert client.run_code(language="bash", code="echo ok")["run_result"]["stdout"] == "ok\n"


def test_staged_stdin_refs_are_in_process_only(sf_daemon):
    """/v1/calls' "stdin_ref" names bytes the compat layer staged in-process
    (docs/fncall.md, "Staged stdin"): an API caller cannot name one that
    does not exist, nor give it with "stdin"."""
    d, _ = sf_daemon
    r = d.api.raw("POST", "/v1/calls", {"image": "base:bookworm", "shell": "cat",
                                        "stdin_ref": "0" * 32})
    assert r.status == 400 and "stdin_ref" in r.json()["error"]["message"], r
    r = d.api.raw("POST", "/v1/calls", {"image": "base:bookworm", "shell": "cat", "stdin": "x",
                                        "stdin_ref": "0" * 32})
    assert r.status == 400 and "exclude" in r.json()["error"]["message"], r


def test_connection_close_and_http10_get_their_answer(client):
    """The listener's connections go through a filter (the 413 above);
    evhttp frees a Connection: close or HTTP/1.0 connection as soon as it
    thinks the answer was sent: the answer must reach the client first."""
    body = json.dumps({"language": "bash", "code": "echo closed"}).encode()
    for req in (b"GET /v1/ping HTTP/1.0\r\n\r\n",
                b"POST /run_code HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body):
        s = socket.create_connection(("127.0.0.1", client.port), timeout=120)
        try:
            s.sendall(req)
            data = b""
            while True:
                d = s.recv(65536)
                if not d:
                    break
                data += d
        finally:
            s.close()
        head, _, payload = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], data[:300]
        j = json.loads(payload)
        assert j == "pong" or j["run_result"]["stdout"] == "closed\n", j


@pytest.fixture(scope="module")
def sf_go(rootfs):
    """A daemon whose go runs in lang-go:bookworm (built on request: a
    visible skip naming the command when its layer is not cached)."""
    if not lang_layer("go"):
        pytest.skip("lang-go:bookworm not built: warren image defaults --lang go")
    d, c = start(rootfs, ["--compat-image", "go=lang-go:bookworm"], import_base=False)
    try:
        r = d.cli("image", "defaults", "--quiet", "--lang", "go", timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        yield c
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


def test_go_run_stage_runs_the_compiled_binary(sf_go):
    """The compile stage's binary is what the run stage runs: no second
    build (that build would leave Go's cache in the run's HOME)."""
    code = ('package main\nimport ("fmt"; "os"; "path/filepath")\n'
            'func main() { _, err := os.Stat(filepath.Join(os.Getenv("HOME"), ".cache", "go-build"))\n'
            ' fmt.Println(os.IsNotExist(err)); b, _ := os.ReadFile("data.txt"); fmt.Print(string(b)) }\n')
    r = sf_go.run_code(language="go", code=code, compile_timeout=120, run_timeout=60,
                       files={"data.txt": base64.b64encode(b"in\n").decode()})
    assert r["status"] == "Success", r
    assert r["compile_result"]["return_code"] == 0, r
    assert r["run_result"]["stdout"] == "true\nin\n", r

"""Adapted from bytedance/SandboxFusion (Apache-2.0): SandboxFusion's sandbox/tests/runners/test_python.py, against Warren over HTTP.
Out of scope (docs/compat.md): fetching /mnt/b (the run's uid cannot write /mnt)."""
import base64

from sfclient import client, sf_daemon  # noqa: F401 (fixtures)


def test_python_print(client):
    r = client.run_code(language="python", code="print(123)", run_timeout=5)
    assert r["status"] == "Success"
    assert r["run_result"]["stdout"].strip() == "123"


def test_python_timeout(client):
    r = client.run_code(language="python", code="import time; time.sleep(0.2)", run_timeout=0.1)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "TimeLimitExceeded"


def test_python_assertion_error(client):
    r = client.run_code(language="python", code="assert 1 == 2", run_timeout=5)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "Finished"
    assert "AssertionError" in r["run_result"]["stderr"]


def test_python_syntax_error(client):
    r = client.run_code(language="python", code="int a = 1", run_timeout=5)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "Finished"
    assert "SyntaxError: invalid syntax" in r["run_result"]["stderr"]


def test_python_file_read(client):
    r = client.run_code(language="python", code='print(open("dir1/dir2/dir3/secret_flag").read())',
                        run_timeout=5,
                        files={"dir1/dir2/dir3/secret_flag": "ImhlbGxvLCB0aGlzIGlzIGEgdGVzdCI="})
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert "hello, this is a test" in r["run_result"]["stdout"]


def test_python_stdin(client):
    r = client.run_code(language="python", code="print(int(input()))", run_timeout=5, stdin="65535")
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert r["run_result"]["stdout"] == "65535\n"


def test_python_fetch_files(client):
    r = client.run_code(language="python", code='open("a.txt", "w").write("secret")',
                        run_timeout=5, fetch_files=["a.txt"])
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert base64.b64decode(r["files"]["a.txt"]).decode() == "secret"

"""Adapted from bytedance/SandboxFusion (Apache-2.0): SandboxFusion's sandbox/tests/runners/test_bash.py, against Warren over HTTP."""
from sfclient import client, sf_daemon  # noqa: F401 (fixtures)


def test_bash_echo(client):
    r = client.run_code(language="bash", code='echo "Hello World"', run_timeout=5)
    assert r["status"] == "Success"
    assert r["run_result"]["stdout"].strip() == "Hello World"


def test_bash_sleep_timeout(client):
    r = client.run_code(language="bash", code="sleep 0.2", run_timeout=0.1)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "TimeLimitExceeded"


def test_bash_false_condition(client):
    r = client.run_code(language="bash", code="test 1 -eq 2", run_timeout=5)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "Finished"


def test_bash_syntax_error(client):
    r = client.run_code(language="bash", code="if [", run_timeout=5)
    assert r["status"] == "Failed"
    assert r["run_result"]["status"] == "Finished"
    assert "syntax error" in r["run_result"]["stderr"]


def test_bash_file_read(client):
    r = client.run_code(language="bash", code="cat dir1/dir2/dir3/secret_flag", run_timeout=5,
                        files={"dir1/dir2/dir3/secret_flag": "ImhlbGxvLCB0aGlzIGlzIGEgdGVzdCI="})
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert "hello, this is a test" in r["run_result"]["stdout"]


def test_bash_stdin(client):
    r = client.run_code(language="bash", code="\n    read input\n    echo $input\n    ",
                        run_timeout=5, stdin="65535")
    assert r["status"] == "Success"
    assert r["run_result"]["status"] == "Finished"
    assert r["run_result"]["stdout"] == "65535\n"

"""Adapted from bytedance/SandboxFusion (Apache-2.0): SandboxFusion's sandbox/tests/runners/test_jupyter.py, against Warren over HTTP.
Out of scope (docs/compat.md): test_jupyter_plot (matplotlib is not in base:bookworm)."""
from sfclient import client, sf_daemon  # noqa: F401 (fixtures)


def jupyter(client, cells):
    st, j = client.post("/run_jupyter", {"cells": cells})
    assert st == 200, j
    return j


def test_jupyter_print(client):
    assert jupyter(client, ["print(123)"])["cells"][0]["stdout"] == "123\n"


def test_jupyter_multi_cell(client):
    cells = jupyter(client, ['a = "hello"', "a", "print(a)"])["cells"]
    assert cells[0]["stdout"] == ""
    assert cells[1]["display"][0]["text/plain"] == "'hello'"
    assert cells[2]["stdout"] == "hello\n"


def test_jupyter_multi_cell_raise(client):
    cells = jupyter(client, ['a = "hello"', 'import sys\nsys.stderr.write("This is an error message\\n")',
                             "assert False", "print(a)"])["cells"]
    assert cells[0]["stdout"] == ""
    assert cells[1]["stderr"] == "This is an error message\n"
    assert cells[2]["error"][0]["ename"] == "AssertionError"
    assert cells[3]["stdout"] == "hello\n"

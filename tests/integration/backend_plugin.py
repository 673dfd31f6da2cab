"""pytest plugin (-p backend_plugin): every api.create() without an explicit
backend uses $WARREN_TEST_BACKEND, so the container suites run unchanged
against another backend (test_vm.py runs test_exec.py and test_files.py on
microvm this way)."""
import os

import wr

_create = wr.Api.create


def create(self, **kw):
    kw.setdefault("backend", os.environ.get("WARREN_TEST_BACKEND", "container"))
    return _create(self, **kw)


wr.Api.create = create

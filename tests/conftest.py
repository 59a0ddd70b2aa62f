"""Fixtures for the framework suites (tests/tensorflow, tests/mxnet), each run in its own
virtual environment, with the launcher of tests/python."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "perseus_tests_launch", Path(__file__).parent / "python" / "conftest.py")
_launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_launch)

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture
def run_framework(request):
    """``run_framework(n, worker, *args, env=None, hosts=None, flags=(), oks=n)``: the
    test directory's ``workers/<worker>`` on n ranks (more launcher ``flags``); fails the
    test unless the launcher exits 0 and ``oks`` ranks print their OK mark. Returns
    stdout and stderr."""
    workers = request.path.parent / "workers"

    def run(n, worker, *args, env=None, timeout=240, hosts=None, flags=(), oks=None):
        rc, stdout, stderr = _launch.launch(n, workers / worker, *args, env=env,
                                            timeout=timeout, hosts=hosts, flags=flags)
        out = f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        if rc != 0:
            pytest.fail(f"{worker} on {n} ranks exited with {rc}\n{out}")
        want = n if oks is None else oks
        seen = (stdout + stderr).count(_launch.OK_MARK)
        if seen != want:
            pytest.fail(f"{worker}: {seen} ranks reported success, not {want}\n{out}")
        return f"{stdout}\n{stderr}"

    return run


@pytest.fixture
def run_example():
    """``run_example(script, *args, expect=...)``: ``examples/<script>`` on 2 ranks through
    the launcher; fails unless it exits 0 and prints ``expect``."""

    def run(script, *args, expect, n=2, timeout=240):
        rc, out, err = _launch.launch(n, EXAMPLES / script, *args, timeout=timeout)
        assert rc == 0, f"{script} exited with {rc}\n{out}\n{err}"
        assert expect in out, f"{script} did not report {expect!r}\n{out}\n{err}"
        return out

    return run

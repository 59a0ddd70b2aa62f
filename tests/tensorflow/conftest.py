"""The TensorFlow suite runs in its own virtual environment (scripts/setup-venv.sh
tensorflow) with the same launching fixture as tests/python."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "perseus_tests_launch", Path(__file__).parents[1] / "python" / "conftest.py")
_launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_launch)

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture
def run_tf():
    """``run_tf(n, worker, *args, env=None)``: ``workers/<worker>`` on n ranks; fails the
    test unless every rank exits 0 after its OK mark. Returns stdout and stderr."""

    def run(n, worker, *args, env=None, timeout=240, hosts=None):
        rc, stdout, stderr = _launch.launch(n, WORKERS / worker, *args, env=env,
                                            timeout=timeout, hosts=hosts)
        out = f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        if rc != 0:
            pytest.fail(f"{worker} on {n} ranks exited with {rc}\n{out}")
        oks = (stdout + stderr).count(_launch.OK_MARK)
        if oks != n:
            pytest.fail(f"{worker}: {oks} of {n} ranks reported success\n{out}")
        return f"{stdout}\n{stderr}"

    return run

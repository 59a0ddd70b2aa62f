"""Shared fixtures: start worker scripts on N ranks through the launcher."""

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
OK_MARK = "WORKER OK"

# The flight records that the test jobs' failures write go to a directory of this test
# session, not to the working directory (perseusrun's default), which is the checkout.
os.environ.setdefault("PERSEUS_FLIGHT_RECORDER_DIR",
                      tempfile.mkdtemp(prefix="perseus-flight-records-"))
# Ranks of one host read one another's memory wherever the kernel lets them, whatever
# the pace check at init would say of this machine, so that the reading paths are
# tested everywhere; tests of the check itself unset it.
os.environ.setdefault("PERSEUS_SHM_DIRECT", "1")


def launch(n, worker, *args, env=None, timeout=150, hosts=None, flags=()):
    """Run ``workers/<worker>`` on ``n`` ranks with the launcher; return
    ``(returncode, stdout, stderr)``. ``hosts`` (``-H``): loopback addresses such as
    ``127.0.0.1:2,127.0.0.2:2`` make separate "hosts" on this machine (each its own
    shared memory, TCP between them). On timeout the launcher's process group is
    terminated (the launcher tears its ranks down) and the output so far returned.
    ``flags``: more of the launcher's flags (``--min-np 2``)."""
    placement = ["-H", hosts] if hosts else []
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", str(n), *placement, *flags,
           sys.executable, str(WORKERS / worker), *map(str, args)]
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                out, err = proc.communicate(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                out = err = ""
        return "timeout", out, f"{err}\n(timed out after {timeout} s)"


@pytest.fixture
def run_workers():
    """``run_workers(n, worker, *args, env=None, hosts=None)``: launch, and fail the test
    unless every rank exited 0 after printing the OK mark; returns stdout, then stderr."""

    def run(n, worker, *args, env=None, timeout=150, hosts=None):
        rc, stdout, stderr = launch(n, worker, *args, env=env, timeout=timeout, hosts=hosts)
        out = f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        if rc != 0:
            pytest.fail(f"{worker} on {n} ranks exited with {rc}\n{out}")
        oks = (stdout + stderr).count(OK_MARK)
        if oks != n:
            pytest.fail(f"{worker}: {oks} of {n} ranks reported success\n{out}")
        return f"{stdout}\n{stderr}"

    return run

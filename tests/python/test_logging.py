"""The core's log lines: HOROVOD_LOG_LEVEL (perseusrun's --log-level) drops the lines
below it, HOROVOD_LOG_HIDE_TIME=0 (--log-with-timestamp) starts each with the UTC time,
and the front-ends' lines go through the same filter (docs/environment.md)."""

import re
import subprocess
import sys

import pytest
from _launch_helpers import clean_env
from perseus import _core

WORKER = """
import perseus.torch.horovod as hvd
import torch
hvd.init()
assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="log.x").tolist() == [2.0] * 3
hvd.shutdown()
print("RANK DONE", flush=True)
"""
# PERSEUS_ALLREDUCE_STREAMS wins over HOROVOD_NUM_NCCL_STREAMS: rank 0 notes it at init.
OVERRIDE = {"PERSEUS_ALLREDUCE_STREAMS": "2", "HOROVOD_NUM_NCCL_STREAMS": "3"}
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z "


def run(*flags, **env):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", "2", *flags,
           sys.executable, "-c", WORKER]
    out = subprocess.run(cmd, env=clean_env(**OVERRIDE, **env), capture_output=True,
                         text=True, timeout=100, check=False)
    assert out.returncode == 0 and out.stdout.count("RANK DONE") == 2, out.stderr
    # Each relayed line is "[r]<stderr>:line".
    return [line.split(">:", 1)[1] for line in out.stderr.splitlines() if ">:" in line]


@pytest.mark.timeout(120)
def test_notes_by_default_and_no_debug_lines():
    lines = run()
    notes = [line for line in lines if line.startswith("[perseus] note: ")]
    assert any("PERSEUS_ALLREDUCE_STREAMS" in line for line in notes), lines
    assert not any("[perseus] debug:" in line or "[perseus] trace:" in line
                   for line in lines), lines


@pytest.mark.timeout(120)
def test_debug_and_trace_lines_with_the_time():
    lines = run("--log-level", "TRACE", "--log-with-timestamp")
    logged = [line for line in lines if "[perseus]" in line]
    assert logged and all(re.match(STAMP + r"\[perseus\] ", line) for line in logged), logged
    for rank in (0, 1):
        assert any(re.search(rf"\[perseus\] debug: rank {rank} of 2 \(local rank {rank} of "
                             r"2, host 0 of 1\): connected; fusion threshold \d+ bytes",
                             line) for line in logged), logged
    assert sum("[perseus] trace: Allreduce of 1 tensor(s) in process set 0, from 'log.x'"
               in line for line in logged) == 2, logged
    assert sum(bool(re.search(r"\[perseus\] debug: shut down after \d+ operation",
                              line)) for line in logged) == 2, logged


@pytest.mark.timeout(120)
def test_a_higher_level_drops_the_notes():
    lines = run("--log-level", "WARNING", HOROVOD_LOG_HIDE_TIME="1")
    assert not any("[perseus]" in line for line in lines), lines
    # The variable alone does the same (perseusrun's flag sets it).
    lines = run(HOROVOD_LOG_LEVEL="error")
    assert not any("[perseus]" in line for line in lines), lines


def test_front_end_lines_take_a_level_by_name():
    with pytest.raises(ValueError, match='log: no level "loud"; there are TRACE, DEBUG, '
                                         'INFO, WARNING, ERROR, FATAL'):
        _core.log("loud", "x")


@pytest.mark.timeout(120)
def test_trace_names_an_operation_run_in_the_lane():
    """A blocking small allreduce run among the callers (PERSEUS_LANE_BYTES; a long
    patience, so that both ranks always meet it there) has its trace line too."""
    lines = run("--log-level", "TRACE", PERSEUS_LANE_PATIENCE_US="5000000")
    assert sum("[perseus] trace: Allreduce of 1 tensor(s) in process set 0, from 'log.x' "
               "(in the lane)" in line for line in lines) == 2, lines

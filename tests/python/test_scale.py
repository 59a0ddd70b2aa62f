"""Jobs of 128 and 256 ranks through perseusrun, with the soft open-file limit at 1,024
(a default Linux shell's), as a user would start them. The ranks are framework-free
(``benchmarks/scale_rank.rs``: the engine alone), each checking the value of every
element of its allreduces; what each holds is counted, not timed."""

import json
import math
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def scale_rank():
    """The framework-free rank: ``PERSEUS_TEST_SCALE_RANK``, else built with cargo (the
    CI's `cargo test` has built it already, so this finds it at once)."""
    given = os.environ.get("PERSEUS_TEST_SCALE_RANK")
    if given:
        return given
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(
        os.environ.get("PERSEUS_CACHE", os.path.expanduser("~/.cache/perseus")), "target")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "scale_rank"],
                   cwd=ROOT, check=True, env=dict(os.environ, CARGO_TARGET_DIR=target),
                   timeout=1200)
    return os.path.join(target, "release", "examples", "scale_rank")


def low_open_files():
    """In the launcher's child: the soft limit on open files at 1,024."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("n", [128, 256])
def test_a_job_of_hundreds_of_ranks_starts_runs_and_holds_log_n_links(n):
    binary = scale_rank()
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", str(n), binary]
    env = dict(os.environ, SCALE_STEPS="3", GLOO_TIMEOUT_SECONDS="120")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          check=False, preexec_fn=low_open_files)
    assert proc.returncode == 0, (
        f"{proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    reports = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(\d+)\]<stdout>:(\{.*\})$", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == list(range(n)), f"reports from {len(reports)} of {n} ranks"
    log2 = math.ceil(math.log2(n))
    for r, rep in reports.items():
        assert rep["rank"] == r
        # A 4 KiB allreduce in log2(n) rounds of messages (recursive doubling), 1 MiB in
        # 2 log2(n) (Rabenseifner's): within the bound of 2 log2(n) + 4 either way.
        assert rep["rounds_4k"] <= log2, (r, rep)
        assert rep["rounds_1m"] <= 2 * log2 + 4, (r, rep)
        # Links to the partners of those steps only: about log2(n) peers, not n - 1.
        assert rep["linked_peers"] <= 2 * log2, (r, rep)
        if r != 0:  # rank 0 also holds a control stream from every rank
            assert rep["sockets"] <= 64, (r, rep)

"""Helpers for the tests that start ``workers/launchers.py`` through every launcher."""

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import perseus

WORKER = Path(__file__).parent / "workers" / "launchers.py"
MARK = "LAUNCHERS-RESULT"
OK_MARK = "WORKER OK"

# Ranks and launchers import this perseus, wherever the tests run from.
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(perseus.__file__)))

# Variables through which a launcher describes a rank to the core: the tests' own
# environment must not leak any of them into the jobs they start.
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_RANK_PREFIXES = ("PERSEUS_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_")


def clean_env(**extra):
    """This environment without any launcher's rank variables, with PYTHONPATH set so
    that ranks import this perseus, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k == "PERSEUS_FLIGHT_RECORDER_DIR"  # the session's (conftest.py)
           or (k not in _RANK_VARS and not k.startswith(_RANK_PREFIXES))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, os.environ.get("PYTHONPATH"))
                                        if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    """A TCP port nobody listens on now (each test gets its own PERSEUS_MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run(cmd, env, timeout=60, cwd=None):
    """Run ``cmd`` in its own session; return ``(returncode, output)``, stdout and stderr
    together. On timeout the session is killed and returncode is ``"timeout"``."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        return "timeout", stop_session(proc) + f"\n(timed out after {timeout} s)"


def stop_session(proc):
    """SIGTERM, then SIGKILL, to ``proc``'s session; the output it had left."""
    out = ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    return out or ""


def parse_results(text):
    """``{rank: result}`` from the ``LAUNCHERS-RESULT {json}`` records in ``text``,
    wherever launchers put them (prefixed, or run together with another rank's line)."""
    decoder = json.JSONDecoder()
    results, start = {}, 0
    while True:
        at = text.find(MARK, start)
        if at < 0:
            return results
        start = at + len(MARK)
        value, _ = decoder.raw_decode(text[start:].lstrip())
        results[value["rank"]] = value


def expected_results(slots):
    """What ``launchers.py`` must report on each rank for a placement (``hosts.place``)."""
    n = len(slots)
    return {s.rank: {
        "rank": s.rank, "size": n, "local_rank": s.local_rank, "local_size": s.local_size,
        "cross_rank": s.cross_rank, "cross_size": s.cross_size,
        "allreduce": [n * (n + 1) / 2, 2.0 ** n - 1, -n * (n - 1) / 2],
        "big_sum_last": 99_999 * (n * (n + 1) // 2),
        "average": [(n - 1) / 2] * 2,
        "allgather": [[10 * i, 10 * i + 1] for i in range(n)],
        "broadcast": [float(100 + n - 1)] * 3,
    } for s in slots}


def check_results(rc, out, slots, what):
    """Assert a job of ``launchers.py`` ended well with the expected values; return the
    parsed results (with their ``where`` entries)."""
    n = len(slots)
    assert rc == 0, f"{what} exited with {rc}\n{out}"
    assert out.count(OK_MARK) == n, f"{what}: {out.count(OK_MARK)} of {n} ranks OK\n{out}"
    results = parse_results(out)
    got = {r: {k: v for k, v in res.items() if k != "where"} for r, res in results.items()}
    assert got == expected_results(slots), f"{what}: unexpected results\n{out}"
    return results

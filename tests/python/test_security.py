"""Authentication and wire hardening seen from outside: strangers at the rendezvous of
a running job, and the warning of a job started without a secret."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from perseus import _core

pytest.importorskip("torch")

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.timeout(120)
def test_strangers_are_dropped_and_the_job_completes(run_workers):
    """Garbage, a truncated frame, an absurd length, a wrong proof and silence: each
    connection closed and logged by the rendezvous; the job's collectives unaffected."""
    out = run_workers(2, "stranger.py", timeout=100)
    dropped = [line for line in out.splitlines() if "rendezvous: dropped the connection" in line]
    for why in ("bad frame magic", "frame cut short", "exceeds the limit", "wrong job secret",
                "no hello within the handshake time"):
        assert any(why in line for line in dropped), (why, dropped)


SCRIPT = """
import perseus.torch.horovod as hvd, torch
hvd.init()
assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [2.0] * 3
hvd.shutdown()
print("WORKER OK", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("secret", [None, "b4d5e1"])
def test_a_job_without_secret_is_warned_about(secret):
    """Started by another launcher without PERSEUS_SECRET: rank 0 warns once that the job
    is unauthenticated; with a secret, nothing is said."""
    srv = _core.RendezvousServer("127.0.0.1:0", secret or "")
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERSEUS_")}
        env.update(PERSEUS_RANK=str(r), PERSEUS_SIZE="2", PERSEUS_LOCAL_RANK=str(r),
                   PERSEUS_LOCAL_SIZE="2", PERSEUS_RENDEZVOUS_ADDR="127.0.0.1",
                   PERSEUS_RENDEZVOUS_PORT=str(srv.port))
        if secret:
            env["PERSEUS_SECRET"] = secret
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=60)[0] for p in procs]
    srv.stop()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "WORKER OK" in out, out
    warned = [out.count("this job is unauthenticated") for out in outs]
    assert warned == ([1, 0] if secret is None else [0, 0]), outs


@pytest.mark.timeout(90)
def test_stalled_tensor_is_warned_about(run_workers):
    """A rank 3 s late with the check at 1 s: rank 0 names the tensor and the late rank."""
    out = run_workers(3, "stall.py", "warn", env={"PERSEUS_STALL_CHECK_TIME_SECONDS": "1"})
    warned = [line for line in out.splitlines() if "stall:" in line]
    assert len(warned) == 1, out
    assert "allreduce 'stuck'" in warned[0] and "ranks [2]" in warned[0], warned


@pytest.mark.timeout(90)
def test_stall_shutdown_fails_every_rank(run_workers):
    """Past PERSEUS_STALL_SHUTDOWN_TIME_SECONDS the job stops with an error on every rank,
    the late one included, and each rank can still shut down cleanly. The others leave at
    once: the late rank reads their stop and their streams' end together, and must still
    report the stop (frames that arrived before a stream ended are read before its end)."""
    run_workers(3, "stall.py", "fail",
                env={"PERSEUS_STALL_CHECK_TIME_SECONDS": "1",
                     "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS": "2"})


@pytest.mark.timeout(90)
def test_a_panic_in_the_core_is_an_exception(run_workers, tmp_path):
    """The engine thread's panic reaches its callers as HorovodInternalError; the other
    rank, whose shutdown then finds rank 0 gone, still leaves cleanly."""
    out = run_workers(2, "panic.py", tmp_path, env={"GLOO_TIMEOUT_SECONDS": "10"})
    assert "engine thread failed" in out, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", [None, "127.0.0.1:1,127.0.0.2:1"])
def test_init_shutdown_loop_leaks_nothing(run_workers, hosts):
    """50 rounds of init, allreduce, shutdown, through shared memory and through TCP
    (with its extra streams): threads, descriptors and segments stay as after round 2."""
    run_workers(2, "init_loop.py", "50", hosts=hosts, timeout=140)


@pytest.mark.timeout(90)
def test_segments_of_a_crashed_job_are_removed(run_workers):
    """A segment file whose creator died (a crash before every local rank mapped it) is
    removed by the next job's leader on the host; a live creator's file is kept.
    Another Perseus job on the host may remove the stale file first: then this job
    could not have, and the check is made again with a new one (three tries)."""
    alive = Path(f"/dev/shm/perseus-00000000feedbeef-{os.getpid()}")
    alive.write_bytes(b"\0" * 64)
    try:
        for _ in range(3):
            dead = subprocess.Popen(["true"])
            dead.wait()
            stale = Path(f"/dev/shm/perseus-00000000deadbeef-{dead.pid}")
            stale.write_bytes(b"\0" * 64)
            try:
                out = run_workers(2, "init_loop.py", "2")
            finally:
                gone = not stale.exists()
                stale.unlink(missing_ok=True)
            assert gone, "the crashed job's segment is still there"
            assert alive.exists(), "a live process's segment was removed"
            if f"removed {stale.name}" in out:
                return
        pytest.fail(f"this job never removed a crashed job's segment\n{out}")
    finally:
        alive.unlink(missing_ok=True)


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_soak_of_mixed_operations(run_workers):
    """4,000 operations (PERSEUS_TEST_SOAK_OPS for more) of random kinds, dtypes, sizes
    and names on 3 ranks, submitted in a different order on each rank, every result
    checked."""
    ops = os.environ.get("PERSEUS_TEST_SOAK_OPS", "4000")
    out = run_workers(3, "soak.py", ops, timeout=580,
                      env={"PERSEUS_CHANGE_HVD_ALLGATHER": "1"})  # uneven rows concatenate
    assert out.count(f"{ops} operations checked") == 3, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [3])
def test_huge_negotiation_batches_complete(run_workers, ranks):
    """40,000 asynchronous allreduces with 3,000-character names at once on every rank
    (120 MB of names each way): the control streams never block both ends, every
    result is right, and a name over the limit is refused at the call."""
    out = run_workers(ranks, "long_names.py", "40000", "3000", timeout=280)
    assert out.count("40000 allreduces of 3000-character names checked") == ranks, out

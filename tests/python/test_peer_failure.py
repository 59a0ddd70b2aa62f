"""A rank that dies or freezes mid-job: every other rank's pending collective fails
with HorovodInternalError naming that rank, within the timeout, without a hang; a rank
that is only busy is not taken for a frozen one.

Ranks are started directly (not through perseusrun, which would stop the
survivors as soon as one rank dies) so that the survivors' own errors can be
checked."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from perseus import _core

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    import perseus.torch.horovod as hvd
    hvd.init()
    victim, steps, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    for _ in range(steps):
        x = hvd.allreduce(torch.ones(4), name="warmup", op=hvd.Sum)
        assert x.tolist() == [hvd.size()] * 4
    if steps > 1:
        assert hvd.counters()["negotiations_skipped"] > 0, hvd.counters()
    if hvd.rank() == victim:
        if how == "exit":
            os._exit(17)
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, connected, silent
    t0 = time.time()
    try:
        # After many equal steps (PERSEUS_OFFLINE_NEG=1) this one runs offline:
        # the survivors wait for the victim's vote, not for the coordinator.
        hvd.allreduce(torch.ones(4), name="warmup" if steps > 1 else "after_death")
    except hvd.HorovodInternalError as e:
        print(f"rank {hvd.rank()} error after {time.time() - t0:.1f}s: {e}", flush=True)
        sys.exit(0)
    print("no error", flush=True)
    sys.exit(1)
    """
)


def spawn(n, script, args, env_extra=None):
    srv = _core.RendezvousServer("127.0.0.1:0", "s")
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            PERSEUS_RANK=str(r),
            PERSEUS_SIZE=str(n),
            PERSEUS_LOCAL_RANK=str(r),
            PERSEUS_LOCAL_SIZE=str(n),
            PERSEUS_RENDEZVOUS_ADDR="127.0.0.1",
            PERSEUS_RENDEZVOUS_PORT=str(srv.port),
            PERSEUS_SECRET="s",
            **(env_extra or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return srv, procs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.parametrize("offline", ["0", "1"])
def test_dead_rank_fails_pending_ops_everywhere(victim, offline):
    n = 3
    t0 = time.time()
    steps = "10" if offline == "1" else "1"
    env = {"GLOO_TIMEOUT_SECONDS": "30", "PERSEUS_OFFLINE_NEG": offline}
    if offline == "1":
        # The steps must reach the engine's schedule: none in the callers' lane.
        env["PERSEUS_LANE_BYTES"] = "0"
    srv, procs = spawn(n, WORKER, [str(victim), steps, "exit"], env)
    outs = [p.communicate(timeout=90)[0] for p in procs]
    srv.stop()
    assert time.time() - t0 < 60
    assert procs[victim].returncode == 17
    for r in range(n):
        if r == victim:
            continue
        assert procs[r].returncode == 0, outs[r]
        assert f"rank {victim}" in outs[r], outs[r]
        # Why: its process ended (from the control stream, or the data plane's words).
        assert ("its process ended without shutting Perseus down" in outs[r]
                or "it probably exited or crashed" in outs[r]), outs[r]
        # Detected from the closed connection, not by waiting for the timeout.
        seconds = float(outs[r].split("error after ")[1].split("s:")[0])
        assert seconds < 20, outs[r]


KILLED = textwrap.dedent(
    """
    import os, signal, socket, sys, threading, time
    import torch
    import perseus.torch.horovod as hvd
    hvd.init()
    victim = int(sys.argv[1])
    big = torch.ones(16 << 20)  # 64 MiB: the kill lands inside a transfer
    hvd.allreduce_(big, name="big.0")
    if hvd.rank() == victim:
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.time()
    try:
        for step in range(1, 1000):
            hvd.allreduce_(big, name=f"big.{step}")
    except hvd.HorovodInternalError as e:
        print(f"rank {hvd.rank()} error after {time.time() - t0:.1f}s: {e}", flush=True)
        # Survivors leave at once: a rank that sees a survivor's connection end first
        # still names the victim, whose connection ended before.
        hvd.shutdown()
        print("SHUTDOWN OK", flush=True)
        sys.exit(0)
    print("no error", flush=True)
    sys.exit(1)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_rank_killed_mid_allreduce(shm):
    """SIGKILL during a 64 MiB allreduce (shared memory or TCP): every survivor fails
    within the timeout with HorovodInternalError naming the rank and its host, then shuts
    down cleanly."""
    n, victim = 3, 1
    env = {"GLOO_TIMEOUT_SECONDS": "20", "PERSEUS_SHM": shm}
    srv, procs = spawn(n, KILLED, [str(victim)], env)
    outs = [p.communicate(timeout=100)[0] for p in procs]
    srv.stop()
    assert procs[victim].returncode == -9, outs[victim]
    host = socket.gethostname()
    for r in range(n):
        if r == victim:
            continue
        assert procs[r].returncode == 0, outs[r]
        # Every survivor's output, so a failure shows who saw what first.
        assert f"rank {victim}" in outs[r] and f"host {host}" in outs[r], outs
        assert "SHUTDOWN OK" in outs[r], outs[r]
        # At once, from the closed connection, not after the 20 s timeout.
        seconds = float(outs[r].split("error after ")[1].split("s:")[0])
        assert seconds < 10, outs[r]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.parametrize("offline", ["0", "1"])
def test_a_frozen_rank_fails_the_others_naming_it(victim, offline):
    """A rank that stops (SIGSTOP: a frozen process, a paused VM, a host that cannot be
    reached) between collectives keeps its connections open, so no end of file tells the
    others. Each survivor's engine asks the rank it waits for whether it is there once the
    control stream has been quiet for 2 s; unanswered for GLOO_TIMEOUT_SECONDS, the rank
    counts as gone and every survivor's collective fails naming it."""
    n = 3
    steps = "10" if offline == "1" else "1"
    env = {"GLOO_TIMEOUT_SECONDS": "3", "PERSEUS_OFFLINE_NEG": offline}
    if offline == "1":
        env["PERSEUS_LANE_BYTES"] = "0"
    srv, procs = spawn(n, WORKER, [str(victim), steps, "stop"], env)
    try:
        outs = {r: p.communicate(timeout=60)[0] for r, p in enumerate(procs) if r != victim}
    finally:
        procs[victim].kill()
        victim_out = procs[victim].communicate(timeout=30)[0]
        srv.stop()
    assert "stopping" in victim_out, victim_out
    host = socket.gethostname()
    for r, out in outs.items():
        assert procs[r].returncode == 0, outs
        assert f"rank {victim}" in out and "stopped or frozen" in out, outs
        assert f"host {host}" in out, outs
        # About 2 s of quiet and the 3 s timeout: well before anything else would end it.
        seconds = float(out.split("error after ")[1].split("s:")[0])
        assert seconds < 30, out


BUSY = textwrap.dedent(
    """
    import sys, time
    import torch
    import perseus.torch.horovod as hvd
    hvd.init()
    sleeper = int(sys.argv[1])
    hvd.allreduce(torch.ones(4), name="warmup")
    if hvd.rank() == sleeper:
        time.sleep(9)  # busy in Python: three times the timeout, the engine idle
    out = hvd.allreduce(torch.full((4,), float(hvd.rank())), name="late", op=hvd.Sum)
    assert out.tolist() == [float(sum(range(hvd.size())))] * 4, out
    print("ok", flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sleeper", [0, 2])
def test_a_busy_rank_is_not_taken_for_a_frozen_one(sleeper):
    """A rank that computes (here: sleeps) for longer than GLOO_TIMEOUT_SECONDS between
    collectives is not gone: its engine answers the others' pings, and the collective
    they wait in completes with the right values once it comes."""
    env = {"GLOO_TIMEOUT_SECONDS": "3"}
    srv, procs = spawn(3, BUSY, [str(sleeper)], env)
    outs = [p.communicate(timeout=90)[0] for p in procs]
    srv.stop()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "ok" in out, outs

"""A job of more ranks than the star of the control plane holds (20 > 16): requests
climb a tree to rank 0 and answers come down it (src/transport/tree.rs). Values, a
mismatch named on every rank, and a rank lost below a relay, or a relay itself, named
on every survivor without a hang.

Ranks are started directly (not through perseusrun, which would stop the survivors as
soon as one rank dies), framework-free (perseus.common and numpy), so that every
survivor's own error can be checked."""

import os
import subprocess
import sys
import textwrap

import pytest
from perseus import _core

N = 20  # one host: rank 0 relays for 1-8, rank 1 for 9-16, rank 2 for 17-19

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from perseus.common import basics, ops
    basics.init()
    r, n = basics.rank(), basics.size()
    victim, how = int(sys.argv[1]), sys.argv[2]

    def allreduce(x, name):
        cap = x.__dlpack__()
        ops.allreduce_now(cap, cap, name=name, op=ops.Sum)
        return x

    for step in range(5):
        x = allreduce(np.arange(1000, dtype=np.float32) + r, f"step{step % 2}")
        want = np.arange(1000, dtype=np.float32) * n + n * (n - 1) / 2
        assert np.array_equal(x, want), (r, step)
    # A mismatch: every rank hears of it, the job goes on.
    try:
        allreduce(np.ones(4 if r != 13 else 5, dtype=np.float32), "mismatch")
        print(f"rank {r}: no mismatch error", flush=True)
        sys.exit(1)
    except Exception as e:
        assert type(e).__name__ == "MismatchError" and "rank 13 sent [5]" in str(e), e
    assert allreduce(np.ones(3, dtype=np.float32), "after")[0] == n
    if how == "none":
        print(f"rank {r} ok", flush=True)
        basics.shutdown()
        sys.exit(0)
    if r == victim:
        if how == "exit":
            os._exit(17)
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.time()
    try:
        allreduce(np.ones(4, dtype=np.float32), "after_loss")
    except Exception as e:
        print(f"rank {r} error after {time.time() - t0:.1f}s: {type(e).__name__}: {e}",
              flush=True)
        sys.exit(0)
    print(f"rank {r}: no error", flush=True)
    sys.exit(1)
    """
)


def spawn(script, args, env_extra=None):
    srv = _core.RendezvousServer("127.0.0.1:0", "s")
    procs = []
    for r in range(N):
        env = dict(os.environ, PERSEUS_RANK=str(r), PERSEUS_SIZE=str(N),
                   PERSEUS_LOCAL_RANK=str(r), PERSEUS_LOCAL_SIZE=str(N),
                   PERSEUS_RENDEZVOUS_ADDR="127.0.0.1", PERSEUS_RENDEZVOUS_PORT=str(srv.port),
                   PERSEUS_SECRET="s", **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return srv, procs


def finish(procs, victim, timeout=90):
    outs = {}
    for r, p in enumerate(procs):
        if r == victim:
            continue
        try:
            outs[r] = (p.wait(timeout=timeout), p.stdout.read())
        except subprocess.TimeoutExpired:
            outs[r] = ("hung", "")
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return outs


@pytest.mark.timeout(180)
def test_values_and_a_mismatch_through_relays():
    srv, procs = spawn(WORKER, ["-1", "none"])
    outs = finish(procs, None)
    srv.stop()
    for r, (rc, out) in outs.items():
        assert rc == 0 and f"rank {r} ok" in out, (r, rc, out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim, why", [
    (12, "rank 12 is gone"),   # a leaf below relay 1: relay 1 tells rank 0
    (2, "rank 2"),             # a relay: its children lose their way to rank 0
])
def test_a_rank_lost_below_a_relay_or_a_relay_is_named_everywhere(victim, why):
    srv, procs = spawn(WORKER, [str(victim), "exit"], {"GLOO_TIMEOUT_SECONDS": "10"})
    outs = finish(procs, victim)
    srv.stop()
    for r, (rc, out) in outs.items():
        assert rc == 0, (r, rc, out)
        assert f"rank {r} error after" in out and why in out, (r, out)


@pytest.mark.timeout(180)
def test_a_frozen_rank_below_a_relay_is_named_by_its_relay():
    srv, procs = spawn(WORKER, ["15", "stop"], {"GLOO_TIMEOUT_SECONDS": "5"})
    try:
        outs = finish(procs, 15)
    finally:
        procs[15].kill()
        procs[15].wait()
        srv.stop()
    for r, (rc, out) in outs.items():
        assert rc == 0, (r, rc, out)
        assert f"rank {r} error after" in out and "rank 15" in out, (r, out)

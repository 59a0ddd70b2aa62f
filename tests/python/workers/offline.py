"""PERSEUS_OFFLINE_NEG: stable steps run without the coordinator, and every
change (new name, shape, op kind, process set, missing tensor, shutdown)
returns the ranks to negotiation with correct results."""

import json
import os
import sys
import tempfile
import time

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, raises, timeline_rows
from perseus.common.timeline import timeline_file
from torch import nn

SIZES = {"w": 1000, "b": 10, "c": 5000}


def step(i, sizes=None, wait=hvd.synchronize):
    """Allreduces every tensor of ``sizes`` under its name and checks the sums."""
    sizes = SIZES if sizes is None else sizes
    r, n = hvd.rank(), hvd.size()
    ts = {k: torch.full((s,), float(r + 1 + i * j)) for j, (k, s) in enumerate(sizes.items())}
    hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=k) for k, t in ts.items()]
    for h in hs:
        wait(h)
    for j, (k, t) in enumerate(ts.items()):
        expect = float(sum(q + 1 + i * j for q in range(n)))
        close(t, torch.full_like(t, expect), f"step {i} tensor {k}")


def spin(h):
    """Waits by polling only, as some training loops do."""
    while not hvd.poll(h):
        time.sleep(0.001)
    hvd.synchronize(h)


def delta(before):
    after = hvd.counters()
    return {k: after[k] - before[k] for k in after}


def settled(i, what):
    """Runs steps until the schedule has run one whole step offline."""
    for k in range(40):  # under load a few offers may be cancelled first
        before = hvd.counters()
        step(i + k)
        d = delta(before)
        if d["negotiations_skipped"] == len(SIZES):
            # Running offline: the next step asks the coordinator nothing.
            before = hvd.counters()
            step(i + k + 1)
            d = delta(before)
            assert d["negotiation_messages"] == 0, (what, d)
            assert d["negotiations_skipped"] == len(SIZES), (what, d)
            # No control frame sent: the groups' votes are all the control traffic.
            assert d["control_frames_sent"] == 0, (what, d)
            assert d["vote_messages"] >= 1 and d["vote_bytes"] == 24 * d["vote_messages"], d
            return i + k + 2
    raise AssertionError(f"{what}: never ran offline: {hvd.counters()}")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.float64)


def train(r, n, updates=12, batch=3):
    """DistributedOptimizer runs offline and still equals one process on the whole batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(updates, n * batch, 4, generator=g, dtype=torch.float64)
    y = torch.randn(updates, n * batch, 2, generator=g, dtype=torch.float64)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    before = hvd.counters()
    rows = slice(r * batch, (r + 1) * batch)
    for u in range(updates):
        ref_opt.zero_grad()
        F.mse_loss(ref(x[u]), y[u]).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[u, rows]), y[u, rows]).backward()
        opt.step()
    d = delta(before)
    assert d["negotiations_skipped"] >= 4 * len(list(model.parameters())), d
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"offline training: {name}", rtol=1e-10, atol=1e-10)


def incomplete_after_offers(rounds=40):
    """Three whole steps, then one without "c" whose caller waits, again and again: the
    schedule is offered around the incomplete step, often after its caller began to wait.
    Every rank gives that step up and negotiates it (with the right sums), rather than
    idling for a group that never completes. Each sum is checked by its first and last
    elements only: slower checks between the steps hide the race."""
    r, n = hvd.rank(), hvd.size()
    for i in range(rounds * 4):
        sizes = SIZES if i % 4 < 3 else {"w": 1000, "b": 10}
        ts = {key: torch.full((s,), float(r + 1 + i * j))
              for j, (key, s) in enumerate(sizes.items())}
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=key) for key, t in ts.items()]
        for h in hs:
            hvd.synchronize(h)
        for j, (key, t) in enumerate(ts.items()):
            want = float(sum(q + 1 + i * j for q in range(n)))
            assert t[0].item() == want and t[-1].item() == want, (i, key)
    assert hvd.counters()["negotiations_skipped"] > 0, hvd.counters()


def stalled_offline(fail):
    """Once the steps run offline, the last rank stops submitting: 5 s late (with
    PERSEUS_STALL_CHECK_TIME_SECONDS=1 the ranks leave the schedule and rank 0 warns,
    naming it), or never (with PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2 every rank fails,
    naming it)."""
    r, n = hvd.rank(), hvd.size()
    i = settled(0, "before the stall")
    late = r == n - 1
    if not fail:
        if late:
            # The schedule is left after 1 s, and the stall check warns 1 s after that:
            # 3 s to spare for a loaded machine.
            time.sleep(5)
        step(i)
        assert (hvd.counters()["stall_warnings"] > 0) == (r == 0), hvd.counters()
        return
    missing = f"ranks [{n - 1}]"
    if late:
        time.sleep(6)
        with raises(hvd.HorovodInternalError, "stalled", missing, what="a later step"):
            step(i)
    else:
        with raises(hvd.HorovodInternalError, "stalled", missing,
                    "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2", what="the stalled step"):
            step(i)


def main():
    hvd.init()
    r = hvd.rank()
    if sys.argv[1:] == ["offers"]:
        incomplete_after_offers()
        hvd.shutdown()
        done(r)
        return
    if sys.argv[1:2] == ["stall"]:
        stalled_offline(sys.argv[2] == "fail")
        hvd.shutdown()
        done(r)
        return
    train(r, hvd.size())
    i = settled(0, "start")
    # Five more steps: nothing goes to the coordinator.
    before = hvd.counters()
    for _ in range(5):
        step(i)
        i += 1
    d = delta(before)
    assert d["negotiation_messages"] == 0 and d["negotiations_skipped"] == 15, d
    assert d["tensors"] == 15, d
    # The timeline shows the wait for the group and the vote as OFFLINE.
    path = os.path.join(tempfile.gettempdir(), f"perseus-offline-{os.getpid()}.json")
    hvd.start_timeline(path)
    step(i)
    i += 1
    hvd.stop_timeline()
    path = timeline_file(path, hvd.rank())
    with open(path) as f:
        rows = timeline_rows(json.load(f))
    os.remove(path)
    w = set(rows["allreduce.w"])
    assert {"OFFLINE", "ALLREDUCE"} <= w and "NEGOTIATE_ALLREDUCE" not in w, rows

    # Other collectives in between: back to negotiation, same results.
    x = torch.tensor([float(r)])
    hvd.broadcast_(x, root_rank=1, name="bc")
    close(x, torch.tensor([1.0]), "broadcast in offline mode")
    hvd.barrier()
    i = settled(i, "after a broadcast and a barrier")

    # A shape change on every rank: negotiated, then offline again.
    step(i, {"w": 1000, "b": 11, "c": 5000})
    i = settled(i + 1, "after a shape change")

    # A step without "c" (its caller waits on the others): the incomplete
    # group is given up, and nothing hangs.
    step(i, {"w": 1000, "b": 10})
    i = settled(i + 1, "after a missing tensor")
    step(i, {"w": 1000, "b": 10}, wait=spin)
    i = settled(i + 1, "after a missing tensor with poll")

    # Another process set.
    ps = hvd.add_process_set([0, 1])
    if r in (0, 1):
        y = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="ps", process_set=ps)
        close(y, torch.full((3,), 2.0), "process set allreduce")
    hvd.remove_process_set(ps)
    i = settled(i, "after a process set")

    # A new tensor in the step.
    step(i, {**SIZES, "d": 7})
    step(i + 1)
    assert hvd.counters()["negotiations_skipped"] > 0
    i = settled(i + 2, "after a new tensor")
    # Shutdown straight from the schedule.
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

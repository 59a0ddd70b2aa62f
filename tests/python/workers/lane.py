"""Blocking small allreduces, allgathers, broadcasts, reduce-scatters and alltoalls that
the ranks of a one-host job run among themselves (PERSEUS_LANE_BYTES): values, counters, and what sends an operation
to the engine."""

import sys
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises
from perseus.torch.horovod import mpi_ops

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def delta(before):
    after = hvd.counters()
    return {k: after[k] - before[k] for k in after}


def value(rank, dtype, numel=37):
    """Rank ``rank``'s tensor: small values, exact in every dtype and under every op."""
    base = (torch.arange(numel) % 3) + rank + 1
    if dtype == torch.bool:
        return (torch.arange(numel) + rank) % 2 == 0
    return base.to(dtype)


def expected(n, dtype, op, pre=1.0, post=1.0, numel=37):
    """The reduction of every rank's tensor, computed here from all of them."""
    if dtype == torch.bool:
        vals = torch.stack([value(q, dtype, numel) for q in range(n)])
        any_ = vals.any(0)
        return any_ if op in (hvd.Sum, hvd.Average, hvd.Max) else vals.all(0)
    vals = torch.stack([value(q, torch.float64, numel) * pre for q in range(n)])
    if not dtype.is_floating_point and pre != 1.0:
        vals = vals.trunc()
    got = {hvd.Sum: vals.sum(0), hvd.Average: vals.sum(0), hvd.Min: vals.min(0).values,
           hvd.Max: vals.max(0).values, hvd.Product: vals.prod(0)}[op]
    factor = post / n if op == hvd.Average else post
    got = got * factor
    if not dtype.is_floating_point:
        got = got.trunc()
    return got.to(dtype)


def sweep(r, n):
    """Every dtype and op, in place and not, with factors: the lane's results equal the
    reference on every rank, and every one ran in the lane (no negotiation at all)."""
    before = hvd.counters()
    ran = 0
    for dtype in DTYPES:
        for op in OPS:
            if dtype == torch.bool and op in (hvd.Product, hvd.Average):
                continue
            want = expected(n, dtype, op)
            got = hvd.allreduce(value(r, dtype), op=op)
            close(got, want, f"{dtype} {op} out of place")
            t = value(r, dtype)
            hvd.allreduce_(t, op=op, name=f"lane.{dtype}.{op}")
            close(t, want, f"{dtype} {op} in place")
            ran += 2
        if dtype.is_floating_point:
            want = expected(n, dtype, hvd.Sum, pre=0.5, post=3.0)
            got = hvd.allreduce(value(r, dtype), op=hvd.Sum, prescale_factor=0.5,
                                postscale_factor=3.0)
            close(got, want, f"{dtype} with factors")
            ran += 1
    # The largest the lane carries, and a float sum that is not exact: every rank gets
    # the same bytes, and the engine's ring agrees to rounding.
    big = torch.rand(16384, generator=torch.Generator().manual_seed(r))
    got = hvd.allreduce(big, op=hvd.Sum, name="lane.largest")
    ran += 1
    # Allgathers: stacked (one shape everywhere) and concatenated (rows differ by rank).
    for dtype in (torch.float32, torch.int64, torch.bool, torch.float16):
        gathered = hvd.allgather(value(r, dtype).reshape(-1, 1))
        want = torch.stack([value(q, dtype).reshape(-1, 1) for q in range(n)])
        close(gathered, want, f"stacked allgather of {dtype}")
        ran += 1
    ragged = torch.arange((r + 1) * 6, dtype=torch.float64).reshape(r + 1, 6) + 100 * r
    gathered = hvd.synchronize(mpi_ops._allgather_concat_async(
        ragged, "lane.ragged", hvd.global_process_set, blocking=True))
    want = torch.cat([torch.arange((q + 1) * 6, dtype=torch.float64).reshape(q + 1, 6) + 100 * q
                      for q in range(n)])
    close(gathered, want, "allgather of ragged rows")
    ran += 1
    # Broadcasts from every root, in place and not: exactly the root's bytes (a float's
    # NaN payload and negative zero included), the input of the new-tensor form untouched.
    for dtype in DTYPES:
        for root in range(n):
            mine = value(r, dtype)
            theirs = hvd.broadcast(mine, root_rank=root)
            close(theirs, value(root, dtype), f"broadcast of {dtype} from {root}")
            close(mine, value(r, dtype), f"broadcast's input of {dtype} on {r}")
            t = value(r, dtype)
            assert hvd.broadcast_(t, root, name=f"lane.bcast.{dtype}.{root}") is t
            close(t, value(root, dtype), f"in-place broadcast of {dtype} from {root}")
            ran += 2
    # Reduce-scatters of 2n+1 rows: this rank's block (the first rank one row more).
    rows = [3 if q == 0 else 2 for q in range(n)]
    start = sum(rows[:r])
    for dtype in DTYPES:
        for op in OPS:
            if dtype == torch.bool:
                continue
            want = expected(n, dtype, op, numel=(2 * n + 1) * 3).reshape(-1, 3)
            got_rs = hvd.reducescatter(value(r, dtype, (2 * n + 1) * 3).reshape(-1, 3), op=op)
            close(got_rs, want[start:start + rows[r]], f"reducescatter of {dtype} {op}")
            ran += 1
    want = expected(n, torch.float32, hvd.Average, pre=0.5, post=3.0, numel=(2 * n + 1) * 3)
    got_rs = hvd.reducescatter(value(r, torch.float32, (2 * n + 1) * 3).reshape(-1, 3),
                               op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)
    close(got_rs, want.reshape(-1, 3)[start:start + rows[r]], "reducescatter with factors")
    ran += 1
    # Alltoalls: rank s sends d + s + 1 rows to rank d (every value names its sender,
    # receiver and row), then equal parts without splits.
    def rows_from(s, d, dtype):
        k = d + s + 1
        return (torch.arange(k * 2).reshape(k, 2) + 100 * s + 10 * d).to(dtype)
    for dtype in (torch.float32, torch.int64, torch.float16, torch.uint8):
        mine = torch.cat([rows_from(r, d, dtype) for d in range(n)])
        got_a, recv = hvd.alltoall(mine, splits=[d + r + 1 for d in range(n)])
        close(got_a, torch.cat([rows_from(s, r, dtype) for s in range(n)]),
              f"alltoall of {dtype}")
        assert recv.tolist() == [r + s + 1 for s in range(n)], (r, recv)
        ran += 1
    equal = hvd.alltoall(torch.arange(n * 4, dtype=torch.float64) + 100 * r)
    close(equal, torch.cat([torch.arange(4 * r, 4 * r + 4, dtype=torch.float64) + 100 * s
                            for s in range(n)]), "alltoall in equal parts")
    # As large as the lane carries (its row counts travel apart from the data).
    k = 16384 // n
    full = hvd.alltoall(torch.arange(k * n, dtype=torch.float32) + 1e5 * r)
    close(full, torch.cat([torch.arange(k * r, k * r + k, dtype=torch.float32) + 1e5 * s
                           for s in range(n)]), "the largest alltoall")
    ran += 2
    odd = torch.tensor([float("nan"), -0.0, float("-inf"), 1e-45]) * (r + 1)
    odd[0] = torch.tensor(0x7FC00000 + r, dtype=torch.int32).view(torch.float32)
    hvd.broadcast_(odd, n - 1)
    want = torch.tensor([float("nan"), -0.0, float("-inf"), 1e-45]) * n
    want[0] = torch.tensor(0x7FC00000 + n - 1, dtype=torch.int32).view(torch.float32)
    assert torch.equal(odd.view(torch.int32), want.view(torch.int32)), (r, odd, want)
    ran += 1
    d = delta(before)
    assert d["lane_operations"] == ran, (r, ran, d)
    assert d["operations"] == ran and d["tensors"] == ran, (r, d)
    assert d["negotiation_messages"] == 0 and d["control_frames_sent"] == 0, (r, d)
    everyone = hvd.allgather(got.unsqueeze(0)).reshape(n, -1)  # through the engine
    for q in range(n):
        assert torch.equal(everyone[q], got), f"rank {q}'s sum differs from rank {r}'s"
    ring = hvd.synchronize(hvd.allreduce_async(big, op=hvd.Sum, name="ring.largest"))
    close(got, ring, "lane against ring")


def through_engine(r, n):
    """What the lane does not take, and what it gives up: each runs on the engine with
    its results and errors as before."""
    members = SUBSET.ranks
    cases = {
        "async": (n, lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(4), op=hvd.Sum))),
        "process set": (len(members), lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum,
                                                             process_set=SUBSET)),
        "above the limit": (n, lambda: hvd.allreduce(torch.ones(16385), op=hvd.Sum)),
        "Adasum": (n, lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum) * n),
        "async broadcast": (n, lambda: hvd.synchronize(hvd.broadcast_async(
            torch.full((4,), float(n if r == 0 else -1)), root_rank=0))),
        "broadcast to a process set": (len(members), lambda: hvd.broadcast(
            torch.full((4,), float(len(members) + r)), root_rank=members[0],
            process_set=SUBSET)),
        "broadcast above the limit": (n, lambda: hvd.broadcast_(
            torch.full((16385,), float(n + r)), root_rank=0)),
    }
    for what, (k, run) in cases.items():
        if "process set" in what and r not in members:
            continue
        before = hvd.counters()
        got = run()
        assert torch.allclose(got, torch.full_like(got, float(k))), (what, got)
        d = delta(before)
        assert d["lane_operations"] == 0 and d["operations"] == 1, (what, r, d)

    # Mismatches: both ranks come, with different operations under one name; every rank
    # gives it up at once (even with a long patience) and the engine names it.
    for name, make in [("lane.mm.shape", lambda: torch.ones(r + 1)),
                       ("lane.mm.dtype", lambda: torch.ones(2, dtype=torch.float32 if r == 0
                                                          else torch.float64))]:
        before = hvd.counters()
        with raises(hvd.HorovodInternalError, name, what=name):
            hvd.allreduce(make(), op=hvd.Sum, name=name)
        assert delta(before)["lane_operations"] == 0, name
    with raises(hvd.HorovodInternalError, "lane.mm.op", what="op mismatch"):
        hvd.allreduce_(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max, name="lane.mm.op")
    before = hvd.counters()
    with raises(hvd.HorovodInternalError, "lane.mm.a2a", what="alltoall mismatch"):
        hvd.alltoall(torch.ones(n, 2 + r), name="lane.mm.a2a")
    assert delta(before)["lane_operations"] == 0
    before = hvd.counters()
    with raises(hvd.HorovodInternalError, "lane.mm.rs", what="reducescatter mismatch"):
        hvd.reducescatter(torch.ones(n + r, 2), op=hvd.Sum, name="lane.mm.rs")
    assert delta(before)["lane_operations"] == 0
    for name, root, t in [("lane.mm.root", min(r, 1), torch.ones(3)),
                          ("lane.mm.bshape", 0, torch.ones(3 + r))]:
        before = hvd.counters()
        with raises(hvd.HorovodInternalError, name, what=name):
            hvd.broadcast_(t, root, name=name)
        assert delta(before)["lane_operations"] == 0, name

    # A rank that comes long after the others' patience: they gave it up, it does not
    # wait at all, and the engine runs it.
    before = hvd.counters()
    if r == n - 1:
        time.sleep(0.5)
    got = hvd.allreduce(torch.full((5,), float(r)), op=hvd.Sum, name="lane.late")
    close(got, torch.full((5,), float(n * (n - 1) // 2)), "late rank")
    assert delta(before)["lane_operations"] == 0, (r, delta(before))


def declined(r, n):
    """Run with a patience of seconds: where one rank runs an operation of the lane on
    the engine (its allgather rows pass the limit, or its timeline is recorded) or waits
    in a join, the others give their attempt up at once rather than after the patience,
    and the next operation meets in the lane again."""
    rows = 16385 if r == n - 1 else 4  # 64 KiB + 4 bytes on the last rank only
    start = time.monotonic()
    before = hvd.counters()
    got = hvd.allgather(torch.full((rows, 1), float(r)), name="lane.decline.gather")
    took = time.monotonic() - start
    want = torch.cat([torch.full((16385 if q == n - 1 else 4, 1), float(q))
                      for q in range(n)])
    close(got, want, "allgather above one rank's limit")
    assert delta(before)["lane_operations"] == 0, (r, delta(before))
    assert took < 2.5, f"rank {r} waited {took:.2f} s for a rank on the engine"
    before = hvd.counters()
    got = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="lane.decline.next")
    close(got, torch.full((3,), float(n * (n - 1) // 2)), "the next operation")
    assert delta(before)["lane_operations"] == 1, (r, delta(before))

    # A joined rank is not waited for: the others' small allreduces run on the engine
    # at once (the joined rank gives zeros), and once every rank is back from the join
    # they meet in the lane again.
    if r == n - 1:
        hvd.join()
    else:
        start = time.monotonic()
        for k in range(5):
            got = hvd.allreduce(torch.full((2,), 1.0), op=hvd.Sum, name=f"lane.join.{k}")
            close(got, torch.full((2,), float(n - 1)), f"allreduce {k} beside a joined rank")
        took = time.monotonic() - start
        assert took < 2.5, f"rank {r} waited {took:.2f} s for a joined rank"
        hvd.join()
    before = hvd.counters()
    got = hvd.allreduce(torch.full((3,), 1.0), op=hvd.Sum, name="lane.join.back")
    close(got, torch.full((3,), float(n)), "the operation after the join")
    assert delta(before)["lane_operations"] == 1, (r, delta(before))


SUBSET = None


def main():
    global SUBSET
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    SUBSET = hvd.add_process_set(list(range(n - 1)) if n > 2 else [0, 1])
    mode = sys.argv[1]
    if mode == "sweep":
        sweep(r, n)
    elif mode == "decline":
        declined(r, n)
    else:
        through_engine(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

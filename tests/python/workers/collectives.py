"""Every collective's values on every rank, every dtype and op, in the allgather mode
given by PERSEUS_CHANGE_HVD_ALLGATHER (0: stack, 1: concatenate); and process sets."""

import json
import os
import tempfile
import warnings

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises, read_timeline_while_running, timeline_rows, tol
from perseus.common import gpu, ops
from perseus.common.process_sets import process_sets
from perseus.common.timeline import timeline_file

MODE = os.environ.get("PERSEUS_CHANGE_HVD_ALLGATHER", "0")
INTS = [torch.uint8, torch.int8, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES = INTS + FLOATS
OPS = {hvd.Sum: "sum", hvd.Average: "average", hvd.Min: "min", hvd.Max: "max",
       hvd.Product: "product"}


def value(r, dtype, shape=(2, 3)):
    """Rank r's input: small positive numbers (products stay inside int8)."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n) % 3) + (r % 2) + 1).reshape(shape).to(dtype)


def bool_value(r):
    return torch.tensor([r % 2 == 0, True, False, r == 0])


def expected_reduce(inputs, op, dtype):
    stacked = torch.stack([t.double() for t in inputs])
    if op == hvd.Sum:
        out = stacked.sum(0)
    elif op == hvd.Average:
        out = stacked.mean(0)
        if not dtype.is_floating_point:
            out = out.trunc()
    elif op == hvd.Min:
        out = stacked.min(0).values
    elif op == hvd.Max:
        out = stacked.max(0).values
    else:
        out = stacked.prod(0)
    return out.to(dtype)


def check_allreduce(r, n):
    for dtype in DTYPES:
        for op, op_name in OPS.items():
            t = value(r, dtype)
            before = t.clone()
            out = hvd.allreduce(t, op=op, name=f"ar.{dtype}.{op_name}")
            exp = expected_reduce([value(i, dtype) for i in range(n)], op, dtype)
            rtol, atol = tol(dtype)
            close(out, exp, f"allreduce {dtype} {op_name}", rtol, atol)
            assert torch.equal(t, before), "allreduce modified its input"
    for op, any_ in ((hvd.Sum, True), (hvd.Max, True), (hvd.Min, False), (hvd.Product, False)):
        out = hvd.allreduce(bool_value(r), op=op)
        stacked = torch.stack([bool_value(i) for i in range(n)])
        exp = stacked.any(0) if any_ else stacked.all(0)
        close(out, exp, f"allreduce bool {OPS[op]}")

    # prescale / postscale
    for dtype in FLOATS:
        rtol, atol = tol(dtype)
        exp_sum = expected_reduce([value(i, torch.float64) for i in range(n)], hvd.Sum,
                                  torch.float64)
        out = hvd.allreduce(value(r, dtype), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=3.0)
        close(out, (exp_sum * 1.5).to(dtype), f"pre/postscale sum {dtype}", rtol, atol)
        out = hvd.allreduce(value(r, dtype), op=hvd.Average, postscale_factor=2.0)
        close(out, (exp_sum * 2.0 / n).to(dtype), f"postscale average {dtype}", rtol, atol)
        out = hvd.allreduce(value(r, dtype), prescale_factor=4.0)
        close(out, (exp_sum * 4.0 / n).to(dtype), f"prescale average {dtype}", rtol, atol)

    exp = expected_reduce([value(i, torch.float32) for i in range(n)], hvd.Sum, torch.float32)
    # in place
    t = value(r, torch.float32)
    res = hvd.allreduce_(t, op=hvd.Sum)
    assert res is t, "allreduce_ must return its input"
    close(t, exp, "allreduce_")
    # async, poll
    t = value(r, torch.float32)
    h = hvd.allreduce_async(t, op=hvd.Sum, name="async.sum")
    while not hvd.poll(h):
        pass
    close(hvd.synchronize(h), exp, "allreduce_async")
    close(t, value(r, torch.float32), "allreduce_async input untouched")
    t = value(r, torch.float32)
    h = hvd.allreduce_async_(t, op=hvd.Sum)
    assert hvd.synchronize(h) is t
    close(t, exp, "allreduce_async_")
    # non-contiguous in place
    t = value(r, torch.float32, (3, 2)).t()
    assert not t.is_contiguous()
    hvd.allreduce_(t, op=hvd.Sum)
    exp_t = expected_reduce([value(i, torch.float32, (3, 2)) for i in range(n)], hvd.Sum,
                            torch.float32).t()
    close(t, exp_t, "allreduce_ on a non-contiguous tensor")
    # scalar and empty tensors
    close(hvd.allreduce(torch.tensor(float(r)), op=hvd.Sum), torch.tensor(n * (n - 1) / 2.0),
          "scalar allreduce")
    close(hvd.allreduce(torch.zeros(0, 3), op=hvd.Sum), torch.zeros(0, 3), "empty allreduce")
    # deprecated average=
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        close(hvd.allreduce(value(r, torch.float32), average=False), exp, "average=False")
        close(hvd.allreduce(value(r, torch.float32), average=True), exp / n, "average=True")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), "no deprecation"
    with raises(ValueError, what="both op and average"):
        hvd.allreduce(value(r, torch.float32), average=True, op=hvd.Sum)
    # autograd
    x = value(r, torch.float32).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * 2).sum().backward()
    close(x.grad, torch.full_like(x, 2.0 * n), "allreduce gradient")


def check_grouped(r, n):
    dtypes = [torch.float32, torch.int32, torch.float64]
    exps = [expected_reduce([value(i, d) for i in range(n)], hvd.Sum, d) for d in dtypes]
    outs = hvd.grouped_allreduce([value(r, d) for d in dtypes], op=hvd.Sum, name="grp")
    for out, exp, d in zip(outs, exps, dtypes):
        close(out, exp, f"grouped_allreduce {d}")
    ts = [value(r, d) for d in dtypes]
    outs = hvd.grouped_allreduce_(ts, op=hvd.Sum)
    for t, out, exp in zip(ts, outs, exps):
        assert out is t
        close(t, exp, "grouped_allreduce_")
    outs = hvd.synchronize(hvd.grouped_allreduce_async([value(r, d) for d in dtypes], op=hvd.Sum))
    for out, exp in zip(outs, exps):
        close(out, exp, "grouped_allreduce_async")
    ts = [value(r, d) for d in dtypes]
    h = hvd.grouped_allreduce_async_(ts, op=hvd.Sum, name="grp_")
    hvd.synchronize(h)
    for t, exp in zip(ts, exps):
        close(t, exp, "grouped_allreduce_async_")
    avg = hvd.grouped_allreduce([value(r, torch.float64)])[0]
    close(avg, exps[2] / n, "grouped_allreduce average")
    gathered = hvd.grouped_allgather([value(r, d) for d in dtypes], name="grp.ag")
    for out, d in zip(gathered, dtypes):
        parts = [value(i, d) for i in range(n)]
        close(out, torch.stack(parts) if MODE == "0" else torch.cat(parts), "grouped_allgather")
    inputs = [torch.arange(n * 2, dtype=d).reshape(n, 2) * (r + 1) for d in dtypes]
    outs = hvd.grouped_reducescatter(inputs, op=hvd.Sum, name="grp.rs")
    for out, d in zip(outs, dtypes):
        exp = torch.arange(n * 2, dtype=d).reshape(n, 2)[r:r + 1] * (n * (n + 1) // 2)
        close(out, exp, "grouped_reducescatter")


def check_allgather(r, n):
    for dtype in DTYPES + [torch.bool]:
        t = bool_value(r).reshape(2, 2) if dtype == torch.bool else value(r, dtype)
        parts = [bool_value(i).reshape(2, 2) if dtype == torch.bool else value(i, dtype)
                 for i in range(n)]
        exp = torch.stack(parts) if MODE == "0" else torch.cat(parts)
        close(hvd.allgather(t, name=f"ag.{dtype}"), exp, f"allgather {dtype} mode {MODE}")
    exp = torch.stack([value(i, torch.float32) for i in range(n)]) if MODE == "0" else \
        torch.cat([value(i, torch.float32) for i in range(n)])
    close(hvd.synchronize(hvd.allgather_async(value(r, torch.float32))), exp, "allgather_async")
    close(hvd.allgather(torch.tensor(r)), torch.arange(n), "allgather of scalars")
    if MODE == "1":
        # Horovod layout: first dimensions may differ.
        t = torch.full((r + 1, 3), float(r))
        exp = torch.cat([torch.full((i + 1, 3), float(i)) for i in range(n)])
        close(hvd.allgather(t, name="ag.var"), exp, "variable-size allgather")
        close(hvd.allgather(torch.zeros(0, 3) if r == 0 else t), exp[1:], "with an empty part")
    else:
        t = torch.full((r + 1, 3), float(r))
        with raises((hvd.HorovodInternalError, ValueError), "PERSEUS_CHANGE_HVD_ALLGATHER",
                    what="mode-0 allgather of unequal shapes"):
            hvd.allgather(t, name="ag.unequal")
        close(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)),
              "allreduce after a failed allgather")
    # gradient: average of the output gradients, sliced back
    x = value(r, torch.float64).requires_grad_()
    hvd.allgather(x).sum().backward()
    close(x.grad, torch.ones_like(x), "allgather gradient")


def check_broadcast(r, n):
    for root in range(n):
        for dtype in DTYPES + [torch.bool]:
            t = bool_value(r) if dtype == torch.bool else value(r, dtype) * (r + 1)
            exp = bool_value(root) if dtype == torch.bool else value(root, dtype) * (root + 1)
            before = t.clone()
            close(hvd.broadcast(t, root, name=f"bc.{root}.{dtype}"), exp, f"broadcast {dtype}")
            close(t, before, "broadcast input untouched")
        t = value(r, torch.float32) * (r + 1)
        exp = value(root, torch.float32) * (root + 1)
        assert hvd.broadcast_(t, root) is t
        close(t, exp, f"broadcast_ from {root}")
        t = value(r, torch.float32) * (r + 1)
        close(hvd.synchronize(hvd.broadcast_async(t, root)), exp, "broadcast_async")
        t = value(r, torch.float32) * (r + 1)
        hvd.synchronize(hvd.broadcast_async_(t, root))
        close(t, exp, "broadcast_async_")
        t = (value(r, torch.float32, (3, 2)) * (r + 1)).t()
        hvd.broadcast_(t, root)
        close(t, (value(root, torch.float32, (3, 2)) * (root + 1)).t(), "non-contiguous bcast_")


def check_alltoall(r, n):
    def splits_of(sender):
        return [(sender + j) % 3 for j in range(n)]  # zeros included

    def rows(sender, dest, k):
        return torch.tensor([[sender * 100 + dest * 10 + i, -1] for i in range(k)],
                            dtype=torch.int64).reshape(k, 2)

    splits = splits_of(r)
    t = torch.cat([rows(r, j, splits[j]) for j in range(n)])
    out, received = hvd.alltoall(t, splits=splits, name="a2a.uneven")
    exp = torch.cat([rows(s, r, splits_of(s)[r]) for s in range(n)])
    close(out, exp, "alltoall uneven")
    close(received, torch.tensor([splits_of(s)[r] for s in range(n)], dtype=torch.int32),
          "alltoall received splits")
    out, received = hvd.synchronize(hvd.alltoall_async(t, splits=torch.tensor(splits)))
    close(out, exp, "alltoall_async")
    assert received.dtype == torch.int64, "received splits take the dtype of splits"
    # equal split, no splits given: only the output comes back
    t = torch.tensor([[r * 10 + j] for j in range(n) for _ in range(2)], dtype=torch.float32)
    out = hvd.alltoall(t)
    assert isinstance(out, torch.Tensor)
    exp = torch.tensor([[s * 10 + r] for s in range(n) for _ in range(2)], dtype=torch.float32)
    close(out, exp, "alltoall equal split")
    out, received = hvd.synchronize(hvd.alltoall_async(t))
    close(received, torch.full((n,), 2, dtype=torch.int32), "equal split received")
    x = t.clone().requires_grad_()
    hvd.alltoall(x).sum().backward()
    close(x.grad, torch.ones_like(x), "alltoall gradient")


def check_reducescatter(r, n):
    d0 = 2 * n + 1
    sizes = [d0 // n + (1 if i < d0 % n else 0) for i in range(n)]
    start = sum(sizes[:r])
    for dtype in (torch.int32, torch.float32, torch.float64):
        inputs = [torch.arange(d0 * 2, dtype=torch.float64).reshape(d0, 2) + i for i in range(n)]
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Average):
            if op == hvd.Average and not dtype.is_floating_point:
                continue
            full = expected_reduce([t.to(dtype) for t in inputs], op, dtype)
            out = hvd.reducescatter(inputs[r].to(dtype), op=op, name=f"rs.{dtype}.{OPS[op]}")
            close(out, full[start:start + sizes[r]], f"reducescatter {dtype} {OPS[op]}")
    inputs = [torch.arange(d0 * 2, dtype=torch.float64).reshape(d0, 2) + i for i in range(n)]
    full = torch.stack(inputs).sum(0)
    out = hvd.synchronize(hvd.reducescatter_async(inputs[r], op=hvd.Sum, prescale_factor=2.0,
                                                  postscale_factor=0.25))
    close(out, full[start:start + sizes[r]] * 0.5, "reducescatter_async scaled")
    close(hvd.reducescatter(inputs[r]), full[start:start + sizes[r]] / n, "default op: Average")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_large_outputs(r, n):
    """Out-of-place results of at least POOL_MIN_BYTES come from the core's pool: values
    right for every op that makes one, outputs held at once never share memory, a freed
    one's memory serves the next, and many calls do not grow the process."""
    rows = (3 << 20) // 64 + 7  # 16 float32 per row: over 3 MiB, not a multiple of n
    x = torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16) % 1000
    mine = x + r
    total = sum(x + i for i in range(n))
    held = [hvd.allreduce(mine, op=hvd.Sum, name="big.sum"),
            hvd.allreduce(mine, op=hvd.Average, name="big.avg"),
            hvd.allreduce(mine.double(), op=hvd.Max, name="big.max")]
    close(held[0], total, "large allreduce sum")
    close(held[1], total / n, "large allreduce average")
    close(held[2], (x + n - 1).double(), "large allreduce max")
    close(mine, x + r, "large allreduce input untouched")
    ptrs = {t.data_ptr() for t in held} | {mine.data_ptr()}
    assert len(ptrs) == 4, "outputs held at once share memory"
    got = hvd.broadcast(mine, n - 1, name="big.bcast")
    close(got, x + n - 1, "large broadcast")
    assert got.data_ptr() != mine.data_ptr(), "broadcast returned its input"
    close(mine, x + r, "large broadcast input untouched")
    # Past STREAM_FROM, the root's copy into its new output bypasses the cache.
    base = torch.arange(ops.STREAM_FROM // 4 + 5, dtype=torch.float32) % 977
    huge = base + r
    got = hvd.broadcast(huge, n - 1, name="huge.bcast")
    assert got.data_ptr() != huge.data_ptr(), "huge broadcast returned its input"
    assert torch.equal(got, base + n - 1), f"rank {r}: huge broadcast"
    assert torch.equal(huge, base + r), f"rank {r}: huge broadcast input changed"
    del base, huge, got
    parts = [x + i for i in range(n)]
    close(hvd.allgather(mine, name="big.gather"),
          torch.stack(parts) if MODE == "0" else torch.cat(parts), "large allgather")
    sizes = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    start = sum(sizes[:r])
    close(hvd.reducescatter(mine, op=hvd.Sum, name="big.rs"), total[start:start + sizes[r]],
          "large reducescatter")
    got, _ = hvd.alltoall(mine, splits=sizes, name="big.a2a")
    close(got, torch.cat([(x + i)[start:start + sizes[r]] for i in range(n)]), "large alltoall")
    # A freed output's memory serves the next out-of-place result of its size.
    first = held.pop(0)
    at = first.data_ptr()
    del first
    again = hvd.allreduce(mine, op=hvd.Sum, name="big.sum")
    assert again.data_ptr() == at, "a freed output's memory was not reused"
    close(again, total, "large allreduce from reused memory")
    del held, again
    # Many calls: the process stays the size it was after the first few.
    for i in range(210):
        out = hvd.allreduce(mine, op=hvd.Sum, name="big.sum")
        if i == 9:
            base = _rss_bytes()
    close(out, total, "large allreduce after many calls")
    grown = _rss_bytes() - base
    assert grown < 16 << 20, f"200 large allreduces grew the process by {grown >> 20} MiB"


def check_objects(r, n):
    obj = {"rank": r, "items": list(range(r + 1)), "text": "x" * (r * 100)}
    for root in range(n):
        got = hvd.broadcast_object(obj if r == root else None, root_rank=root, name="obj")
        assert got == {"rank": root, "items": list(range(root + 1)), "text": "x" * (root * 100)}
    got = hvd.allgather_object(obj)
    assert [g["rank"] for g in got] == list(range(n)), got
    assert got[n - 1]["text"] == "x" * ((n - 1) * 100)


def check_join(r, n):
    # The last rank joins at once: the others' allreduces get zeros from it.
    if r == n - 1:
        last = hvd.join()
    else:
        out = hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum, name="join.sum")
        close(out, torch.full((3,), float(sum(range(1, n)))), "allreduce beside a joined rank")
        if r == 0:
            # Completes only once every other rank joined, so rank 0 joins last.
            out = hvd.allreduce(torch.full((2,), 5.0), op=hvd.Sum, name="join.alone")
            close(out, torch.full((2,), 5.0), "allreduce with every other rank joined")
        last = hvd.join()
    assert last == 0, f"join returned {last}, expected rank 0 to join last"
    close(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n)), "after join")

    # Uneven data: rank i runs i + 1 unnamed allreduces, then joins; the ranks' counts of
    # unnamed requests differ after that, and the join makes their next names agree.
    for round_ in range(2):
        for _ in range(r + 1 + round_):
            hvd.allreduce(torch.ones(2), op=hvd.Sum)
        hvd.join()
        for k in range(2):
            got = hvd.allreduce(torch.full((2,), float(r + k)), op=hvd.Sum)
            close(got, torch.full((2,), float(sum(range(n)) + n * k)),
                  f"unnamed allreduce {k} after an uneven join, round {round_}")


def check_timeline(r, n):
    """Horovod's layout and names: a row per tensor named ``<op>.<name>``, with the wait
    for negotiation (NEGOTIATE_ALLREDUCE), the operation (ALLREDUCE) and its phases inside
    it (MEMCPY_IN/OUT_FUSION_BUFFER only where tensors were fused; REDUCE within the
    transport's PERSEUS_ALLREDUCE). The file is whole JSON while the job runs."""
    path = os.path.join(tempfile.gettempdir(), f"perseus-timeline-{os.getpid()}-{r}.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(4), name="timeline.op")
    pair = [torch.ones(8), torch.ones(8)]
    for h in [hvd.allreduce_async_(t, name=f"timeline.f{k}") for k, t in enumerate(pair)]:
        hvd.synchronize(h)
    path = timeline_file(path, r)
    # Before stop_timeline: what ran is on disk, as valid JSON, within a moment.
    live = read_timeline_while_running(path, "allreduce.timeline.op", "NEGOTIATE_ALLREDUCE")
    assert "ALLREDUCE" in timeline_rows(live)["allreduce.timeline.op"], live
    unnamed = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert unnamed.sum().item() == 2 * n
    hvd.barrier()
    hvd.stop_timeline()
    assert os.path.exists(path) and os.path.getsize(path) > 0, "no timeline written"
    with open(path) as f:
        events = json.load(f)
    # Everything read while it ran is still there, in the same place.
    assert events[:len(live)] == live
    header = events[0]
    assert header["pid"] == 0 and header["args"]["rank"] == r, header
    spans = timeline_rows(events)
    # mark_cycles=True: each batch of requests sent to negotiation is an instant mark.
    cycles = [e for e in events if e["name"] == "CYCLE_START"]
    assert cycles and all(e["ph"] == "i" and e["s"] == "g" and e["args"]["requests"] >= 1
                          for e in cycles), cycles
    lone = spans["allreduce.timeline.op"]
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "PERSEUS_ALLREDUCE", "REDUCE",
            "COMPLETE"} <= set(lone), lone
    outer = lone["ALLREDUCE"]
    for phase in ("PERSEUS_ALLREDUCE", "REDUCE", "COMPLETE"):
        lo, hi = lone[phase]
        assert outer[0] - 1 <= lo <= hi <= outer[1] + 1, (phase, lone)
    assert lone["REDUCE"][1] <= lone["PERSEUS_ALLREDUCE"][1] + 1, lone
    assert lone["NEGOTIATE_ALLREDUCE"][1] <= outer[0] + 1, lone
    op = next(e for e in events if e["name"] == "ALLREDUCE" and e["ts"] == outer[0])
    assert op["args"]["dtype"] == "HOROVOD_FLOAT32" and op["args"]["shape"] == "[4]", op
    fused = [spans[f"allreduce.timeline.f{k}"] for k in range(2)]
    if any("MEMCPY_IN_FUSION_BUFFER" in f for f in fused):  # fused when both came together
        assert all({"MEMCPY_IN_FUSION_BUFFER", "PERSEUS_ALLREDUCE",
                    "MEMCPY_OUT_FUSION_BUFFER"} <= set(f) for f in fused), fused
    # The automatic name keeps its one prefix; a barrier is its negotiation alone.
    auto = [row for row in spans if row.startswith("allreduce.noname.")]
    assert auto and not any(row.startswith("allreduce.allreduce.") for row in spans), spans
    barriers = [v for row, v in spans.items() if row.startswith("barrier.")]
    assert barriers and set(barriers[0]) == {"NEGOTIATE_BARRIER"}, spans
    if os.path.exists(path):
        os.remove(path)


def check_process_sets(r, n, set_a, set_b):
    a_ranks, b_ranks = list(range(n - 1)), list(range(1, n))
    assert hvd.global_process_set.ranks == list(range(n))
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r
    assert set_a.ranks == a_ranks and set_b.ranks == b_ranks, (set_a, set_b)
    assert set_a.process_set_id == 1 and set_b.process_set_id == 2, (set_a, set_b)
    assert set_a.size() == n - 1 and set_a.included() == (r in a_ranks)
    assert set_a.rank() == (a_ranks.index(r) if r in a_ranks else -1)
    twin = hvd.ProcessSet(reversed(a_ranks))
    twin.process_set_id = 1
    assert twin == set_a and set_a != set_b and "ranks=" in repr(set_a)

    def sum_of(ranks):
        return torch.full((2,), float(sum(i + 1 for i in ranks)))

    # Both sets in flight at once (rank 1 belongs to both when n == 3).
    handles = {}
    if set_a.included():
        handles["a"] = hvd.allreduce_async(torch.full((2,), float(r + 1)), op=hvd.Sum,
                                           name="ps.sum", process_set=set_a)
    if set_b.included():
        handles["b"] = hvd.allreduce_async(torch.full((2,), float(r + 1)), op=hvd.Sum,
                                           name="ps.sum.b", process_set=set_b)
    for key, h in handles.items():
        close(hvd.synchronize(h), sum_of(a_ranks if key == "a" else b_ranks), f"set {key} sum")

    for ps, ranks in ((set_a, a_ranks), (set_b, b_ranks)):
        if not ps.included():
            with raises(ValueError, what="collective on a set this rank is not in"):
                hvd.allreduce(torch.ones(1), process_set=ps)
            continue
        me = ranks.index(r)
        close(hvd.allreduce(torch.full((2,), float(r + 1)), process_set=ps),
              sum_of(ranks) / len(ranks), "set average")
        for root in ranks:  # a rank of the job, as in Horovod
            got = hvd.broadcast(torch.full((2,), float(r)), root, process_set=ps)
            close(got, torch.full((2,), float(root)), f"set broadcast root {root}")
            assert hvd.broadcast_object(f"from {r}", root, name="ps.from",
                                        process_set=ps) == f"from {root}"
        outside = next(i for i in range(n) if i not in ranks) if len(ranks) < n else n
        with raises(ValueError, f"broadcast root rank {outside} is not",
                    what="a set broadcast from a rank outside the set"):
            hvd.broadcast(torch.ones(2), outside, process_set=ps)
        # A model and its optimizer state from the set's last rank.
        model = torch.nn.Linear(2, 1)
        torch.nn.init.constant_(model.weight, float(r))
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.5)
        hvd.broadcast_parameters(model.state_dict(), ranks[-1], process_set=ps)
        hvd.broadcast_optimizer_state(opt, ranks[-1], process_set=ps)
        close(model.weight.detach(), torch.full((1, 2), float(ranks[-1])), "set parameters")
        assert opt.param_groups[0]["lr"] == 0.1 * (ranks[-1] + 1), opt.param_groups
        parts = [torch.full((2,), float(i)) for i in ranks]
        exp = torch.stack(parts) if MODE == "0" else torch.cat(parts)
        close(hvd.allgather(torch.full((2,), float(r)), process_set=ps), exp, "set allgather")
        t = torch.tensor([[r * 10 + j] for j in range(len(ranks))], dtype=torch.int32)
        out, received = hvd.alltoall(t, splits=[1] * len(ranks), process_set=ps)
        close(out, torch.tensor([[i * 10 + me] for i in ranks], dtype=torch.int32), "set a2a")
        close(received, torch.ones(len(ranks), dtype=torch.int32), "set a2a received splits")
        t = torch.arange(len(ranks) * 2, dtype=torch.float32).reshape(len(ranks), 2)
        close(hvd.reducescatter(t, op=hvd.Sum, process_set=ps), t[me:me + 1] * len(ranks),
              "set reducescatter")
        hvd.barrier(process_set=ps)
        got = hvd.broadcast_object(r if me == 0 else None, root_rank=ranks[0], name="ps.obj",
                                   process_set=ps)
        assert got == ranks[0], got
        assert hvd.allgather_object(r, process_set=ps) == ranks

    # A DistributedOptimizer on a set: members step on their average, the other ranks
    # on their own gradient (as in Horovod), with no error.
    for k, (ps, ranks) in enumerate(((set_a, a_ranks), (set_b, b_ranks))):
        w = torch.nn.Parameter(torch.zeros(3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                       named_parameters=[(f"set{k}.w", w)], process_set=ps)
        for _ in range(2):
            opt.zero_grad()
            (w * float(r + 1)).sum().backward()
            opt.step()
        grad = sum(i + 1 for i in ranks) / len(ranks) if r in ranks else r + 1
        close(w.detach(), torch.full((3,), -2.0 * grad), f"optimizer on set {k}")

    # Remove a set, use of the stale object fails, add it again, use it, remove it.
    assert hvd.remove_process_set(set_a) is True
    assert set_a.process_set_id is None
    assert hvd.remove_process_set(hvd.global_process_set) is False
    with raises(ValueError, what="collective on a removed set"):
        hvd.allreduce(torch.ones(1), process_set=set_a)
    added = hvd.add_process_set(a_ranks)
    assert added.process_set_id is not None and added.ranks == a_ranks
    if added.included():
        close(hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=added),
              sum_of(a_ranks), "re-added set")
    if n >= 3:
        other = hvd.add_process_set(hvd.ProcessSet([0, n - 1]))
        if other.included():
            close(hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=other),
                  sum_of([0, n - 1]), "added set")
        assert hvd.remove_process_set(other)
    assert hvd.remove_process_set(added)
    hvd.barrier()


def check_members_only_sets(r, n):
    """add_process_set(members_only=True): only the set's ranks call it (rank n - 1 sits
    out), they use it as any set, and the other ranks never learn of it."""
    ranks = list(range(n - 1))
    known = sorted(ps.process_set_id for ps in process_sets())
    if r in ranks:
        ps = hvd.add_process_set(ranks, members_only=True)
        assert ps.members_only and ps.included() and ps.process_set_id not in known, ps
        close(hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=ps),
              torch.full((2,), float(sum(i + 1 for i in ranks))), "members-only set sum")
        assert hvd.allgather_object(r, process_set=ps) == ranks
        with raises(ValueError, "members_only=True", "cannot be removed",
                    what="removing a members-only set"):
            hvd.remove_process_set(ps)
        again = hvd.add_process_set(hvd.ProcessSet(ranks), members_only=True)
        assert again.process_set_id not in known + [ps.process_set_id], again
        close(hvd.broadcast(torch.full((2,), float(r)), 0, process_set=again),
              torch.zeros(2), "second members-only set broadcast")
    else:
        with raises(ValueError, f"rank {r} cannot add process set {ranks}",
                    "only its members", what="members-only set from a rank outside it"):
            hvd.add_process_set(ranks, members_only=True)
        assert sorted(ps.process_set_id for ps in process_sets()) == known
    # A set every rank adds afterwards gets one id on all of them.
    later = hvd.add_process_set([n - 1])
    assert not later.members_only
    assert hvd.allgather_object(later.process_set_id) == [later.process_set_id] * n
    assert hvd.remove_process_set(later)


def main():
    n_env = int(os.environ.get("PERSEUS_SIZE") or os.environ["HOROVOD_SIZE"])
    set_a = hvd.ProcessSet(range(n_env - 1))
    hvd.init(process_sets=[set_a, list(range(1, n_env))])  # an object and a rank list
    hvd.init()  # a second init is a no-op
    r, n = hvd.rank(), hvd.size()
    assert n == n_env and hvd.is_initialized()
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_built()
    assert hvd.cuda_built() == gpu.built()
    nccl = [lib["version"] for lib in gpu.libraries() if lib["name"] == "NCCL" and lib["path"]]
    # Horovod's nccl_built() is NCCL's version code (an int compared against versions), or 0.
    code = hvd.nccl_built()
    assert type(code) is int, f"nccl_built() = {code!r}, an int in Horovod"
    if gpu.built() and nccl:
        major, minor, patch = (int(p) for p in nccl[0].split(".")[:3])
        assert code == major * (1000 if (major, minor) <= (2, 8) else 10000) + minor * 100 + patch
        assert code >= 2700
    else:
        assert code == 0
    assert not (hvd.mpi_enabled() or hvd.rocm_built()
                or hvd.ddl_built() or hvd.ccl_built() or hvd.mpi_threads_supported())
    set_b = process_sets()[2]
    check_allreduce(r, n)
    check_grouped(r, n)
    check_allgather(r, n)
    check_broadcast(r, n)
    check_alltoall(r, n)
    check_reducescatter(r, n)
    check_large_outputs(r, n)
    hvd.barrier()
    check_objects(r, n)
    check_join(r, n)
    check_timeline(r, n)
    check_process_sets(r, n, set_a, set_b)
    check_members_only_sets(r, n)
    hvd.shutdown()
    assert not hvd.is_initialized()
    done(r)


if __name__ == "__main__":
    main()

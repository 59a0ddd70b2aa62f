"""A soak of COUNT mixed operations: random kinds (allreduce with each reduction,
allgather of uneven rows, broadcast from a random root, alltoall, reducescatter), dtypes,
sizes and names, submitted asynchronously in batches whose order differs on every rank;
every result is checked against values computed here.

Usage: soak.py COUNT [SEED]
"""

import random
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import done

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.uint8, torch.int8]
FLOAT = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
OPS = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "average": hvd.Average}


def values(i, rank, count, dtype):
    """Small integers (exact in every dtype and in their sums over a few ranks)."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + i * 3 + rank * 5) % 13
    if dtype in (torch.int8, torch.int32, torch.int64):
        base = base - 6
    return base.to(dtype)


def plan(rng, i, n):
    kind = rng.choice(["allreduce", "allreduce", "allgather", "broadcast", "alltoall",
                       "reducescatter"])
    dtype = rng.choice(DTYPES)
    count = rng.choice([0, 1, 3, 64, 1000, 4097, 70_000]) if kind == "allreduce" else \
        rng.choice([1, 5, 300, 2049])
    op = rng.choice(list(OPS))
    if op == "average" and dtype not in FLOAT:
        op = "sum"
    if dtype == torch.uint8 and op == "sum":
        op = "max"  # a sum of three may pass 255
    return {"i": i, "kind": kind, "dtype": dtype, "count": count, "op": op,
            "root": rng.randrange(n), "name": f"soak.{i}.{kind}.{rng.randrange(1 << 30)}"}


def submit(p, r, n):
    i, kind, dtype, count = p["i"], p["kind"], p["dtype"], p["count"]
    if kind == "allreduce":
        return hvd.allreduce_async(values(i, r, count, dtype), op=OPS[p["op"]], name=p["name"])
    if kind == "allgather":
        return hvd.allgather_async(values(i, r, count + r, dtype), name=p["name"])
    if kind == "broadcast":
        t = values(i, r, count, dtype) if r == p["root"] else torch.zeros(count, dtype=dtype)
        return hvd.broadcast_async(t, p["root"], name=p["name"])
    if kind == "alltoall":
        return hvd.alltoall_async(values(i, r, count * n, dtype), name=p["name"])
    return hvd.reducescatter_async(values(i, r, count * n, dtype), op=hvd.Sum
                                   if p["op"] in ("sum", "average") else OPS[p["op"]],
                                   name=p["name"])


def expected(p, r, n):
    i, kind, dtype, count = p["i"], p["kind"], p["dtype"], p["count"]
    every = [values(i, q, count * (n if kind in ("alltoall", "reducescatter") else 1),
                    dtype).to(torch.float64) for q in range(n)]
    if kind == "allreduce":
        stack = torch.stack(every) if count else torch.zeros(n, 0, dtype=torch.float64)
        got = {"sum": stack.sum(0), "average": stack.sum(0) / n, "min": stack.min(0).values
               if count else stack.sum(0), "max": stack.max(0).values if count
               else stack.sum(0)}[p["op"]]
        return got.to(dtype)
    if kind == "allgather":
        return torch.cat([values(i, q, count + q, dtype) for q in range(n)])
    if kind == "broadcast":
        return values(i, p["root"], count, dtype)
    if kind == "alltoall":
        return torch.cat([values(i, q, count * n, dtype)[r * count:(r + 1) * count]
                          for q in range(n)])
    stack = torch.stack(every)
    red = stack.min(0).values if p["op"] == "min" else \
        stack.max(0).values if p["op"] == "max" else stack.sum(0)
    return red[r * count:(r + 1) * count].to(dtype)


def main():
    total, seed = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 7
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shared, mine = random.Random(seed), random.Random(seed * 1000 + r)
    i = 0
    while i < total:
        batch = [plan(shared, i + k, n) for k in range(min(shared.randint(1, 12), total - i))]
        i += len(batch)
        order = batch[:]
        mine.shuffle(order)
        handles = [(p, submit(p, r, n)) for p in order]
        for p, h in handles:
            got = hvd.synchronize(h)
            if isinstance(got, tuple):  # alltoall: (tensor, received splits)
                got, splits = got
                assert splits.tolist() == [p["count"]] * n, (p, splits)
            want = expected(p, r, n)
            if p["kind"] == "allreduce" and p["op"] == "average":
                # Scaled by 1/n rather than divided: the last bit may differ.
                rtol = 1e-2 if p["dtype"] in (torch.float16, torch.bfloat16) else 1e-6
                same = torch.allclose(got.double(), want.double(), rtol=rtol, atol=0)
            else:
                same = torch.equal(got, want)
            assert got.dtype == want.dtype and same, \
                f"rank {r}: op {p['i']} ({p['kind']} {p['op']} {p['dtype']} x{p['count']}) " \
                f"got {got[:8].tolist()} want {want[:8].tolist()}"
    print(f"rank {r}: {total} operations checked", flush=True)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

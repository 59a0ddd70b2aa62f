"""Horovod 0.28's semantics on perseus.torch.horovod: every dtype Horovod accepts through
every collective, and every differentiable op's gradient against autograd of the same
computation in one process (with Horovod's definitions of each gradient)."""

import time

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises
from perseus.common.basics import allgather_stacks

DTYPES = [d for d in (torch.uint8, torch.int8, getattr(torch, "uint16", None), torch.int16,
                      torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                      torch.float64, torch.bool) if d is not None]
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def values(rank, dtype, shape):
    """Rank ``rank``'s test tensor: small values every dtype holds exactly, sums included."""
    g = torch.Generator().manual_seed(7 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 9, shape, generator=g).to(dtype)


def reduce_ref(xs, op):
    if xs[0].dtype == torch.bool:
        stacked = torch.stack(xs)
        return stacked.all(0) if op == hvd.Min else stacked.any(0)
    wide = torch.stack([x.double() for x in xs])
    out = {hvd.Sum: wide.sum(0), hvd.Min: wide.min(0).values, hvd.Max: wide.max(0).values,
           hvd.Average: wide.sum(0) / len(xs)}[op]
    if not xs[0].is_floating_point():
        out = out.trunc()
    return out.to(xs[0].dtype)


def dtype_sweep(r, n):
    """Every dtype through allreduce (each op that applies), the grouped forms, allgather,
    broadcast, alltoall and reducescatter: the values every rank ends with."""
    shape = (2 * n, 3)
    for dtype in DTYPES:
        what = str(dtype)
        xs = [values(i, dtype, shape) for i in range(n)]
        mine = xs[r].clone()
        ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype != torch.bool else [])
        for op in ops:
            close(hvd.allreduce(mine, op=op), reduce_ref(xs, op), f"allreduce {what} op {op}")
        close(hvd.grouped_allreduce([mine, mine[:1]], op=hvd.Sum),
              [reduce_ref(xs, hvd.Sum), reduce_ref([x[:1] for x in xs], hvd.Sum)],
              f"grouped_allreduce {what}")
        t = mine.clone()
        hvd.allreduce_(t, op=hvd.Max)
        close(t, reduce_ref(xs, hvd.Max), f"allreduce_ {what}")
        gathered = torch.cat(xs) if not allgather_stacks() else torch.stack(xs)
        close(hvd.allgather(mine), gathered, f"allgather {what}")
        close(hvd.grouped_allgather([mine, mine]), [gathered, gathered],
              f"grouped_allgather {what}")
        close(hvd.broadcast(mine, n - 1), xs[n - 1], f"broadcast {what}")
        t = mine.clone()
        hvd.broadcast_(t, 0)
        close(t, xs[0], f"broadcast_ {what}")
        got = hvd.alltoall(mine)
        close(got, torch.cat([x[2 * r:2 * r + 2] for x in xs]), f"alltoall {what}")
        rows = slice(2 * r, 2 * r + 2)
        if dtype != torch.bool:
            close(hvd.reducescatter(mine, op=hvd.Sum), reduce_ref(xs, hvd.Sum)[rows],
                  f"reducescatter {what}")
            close(hvd.grouped_reducescatter([mine, mine], op=hvd.Sum),
                  [reduce_ref(xs, hvd.Sum)[rows]] * 2, f"grouped_reducescatter {what}")


# --------------------------------------------------------------------------- gradients
# Each op's gradient as Horovod 0.28 defines it, relative to autograd of the sum of every
# rank's loss in one process: allreduce and alltoall give that gradient; allgather and
# broadcast average the output gradients (1/n of it); reducescatter gathers them back
# times the scale factors, times the set's size for Sum and not divided for Average: n
# times it either way.
HOROVOD_FACTOR = {"allreduce": 1, "grouped_allreduce": 1, "alltoall": 1, "allgather": "1/n",
                  "grouped_allgather": "1/n", "broadcast": "1/n", "reducescatter": "n",
                  "grouped_reducescatter": "n"}


def factor(op_name, n):
    f = HOROVOD_FACTOR[op_name]
    return {"1/n": 1.0 / n, "n": float(n)}.get(f, f)


def one_process(op_name, xs, op, n, pre=1.0, post=1.0):
    """What every rank's outputs are, computed in one process from every rank's inputs
    (differentiable with respect to them)."""
    if op_name in ("allreduce", "grouped_allreduce"):
        total = sum(x * pre for x in xs) * post
        if op == hvd.Average:
            total = total / n
        return [total] * n
    if op_name in ("allgather", "grouped_allgather"):
        return [torch.stack(xs) if allgather_stacks() else torch.cat(xs)] * n
    if op_name == "broadcast":
        return [xs[0]] * n
    if op_name == "alltoall":  # equal splits: 2 rows to each rank
        return [torch.cat([x[2 * j:2 * j + 2] for x in xs]) for j in range(n)]
    if op_name in ("reducescatter", "grouped_reducescatter"):
        total = sum(x * pre for x in xs) * post
        if op == hvd.Average:
            total = total / n
        return [total[2 * j:2 * j + 2] for j in range(n)]
    raise AssertionError(op_name)


def distributed(op_name, x, op, pre=1.0, post=1.0):
    if op_name == "allreduce":
        return hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
    if op_name == "grouped_allreduce":
        return hvd.grouped_allreduce([x], op=op, prescale_factor=pre,
                                     postscale_factor=post)[0]
    if op_name == "allgather":
        return hvd.allgather(x)
    if op_name == "grouped_allgather":
        return hvd.grouped_allgather([x])[0]
    if op_name == "broadcast":
        return hvd.broadcast(x, 0)
    if op_name == "alltoall":
        return hvd.alltoall(x)
    if op_name == "reducescatter":
        return hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
    if op_name == "grouped_reducescatter":
        return hvd.grouped_reducescatter([x], op=op, prescale_factor=pre,
                                         postscale_factor=post)[0]
    raise AssertionError(op_name)


def gradient_sweep(r, n):
    shape = (2 * n, 3)
    reduced = ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter")
    cases = []
    for op_name in HOROVOD_FACTOR:
        for op in ((hvd.Sum, hvd.Average) if op_name in reduced else (None,)):
            cases.append((op_name, op, 1.0, 1.0))
    cases += [("allreduce", hvd.Sum, 0.5, 3.0), ("grouped_allreduce", hvd.Average, 2.0, 0.25),
              ("reducescatter", hvd.Sum, 0.5, 3.0),
              ("grouped_reducescatter", hvd.Average, 2.0, 0.25)]
    for op_name, op, pre, post in cases:
        what = f"gradient of {op_name} op={op} pre={pre} post={post}"
        xs = [torch.randn(shape, generator=torch.Generator().manual_seed(11 + i),
                          dtype=torch.float64, requires_grad=True) for i in range(n)]
        # Each rank's loss weighs its output with its own weights.
        ws = [torch.randn(one_process(op_name, xs, op, n, pre, post)[i].shape,
                          generator=torch.Generator().manual_seed(101 + i),
                          dtype=torch.float64) for i in range(n)]
        outs = one_process(op_name, xs, op, n, pre, post)
        sum(((o * w).sum() for o, w in zip(outs, ws))).backward()
        # A rank whose input reaches no output (broadcast's non-roots) gets zeros.
        g = xs[r].grad if xs[r].grad is not None else torch.zeros_like(xs[r])
        expected = g * factor(op_name, n)

        x = xs[r].detach().clone().requires_grad_(True)
        y = distributed(op_name, x, op, pre, post)
        close(y.detach(), outs[r].detach(), f"{what}: forward")
        (y * ws[r]).sum().backward()
        close(x.grad, expected, what)

    # Several tensors at once through the grouped ops, each with its own gradient.
    a = torch.full((2 * n, 2), float(r + 1), dtype=torch.float64, requires_grad=True)
    b = torch.full((2 * n,), float(r + 2), dtype=torch.float64, requires_grad=True)
    outs = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    (outs[0].sum() * 2 + outs[1].sum() * 3).backward()
    close(a.grad, torch.full_like(a, 2.0 * n), "grouped_reducescatter gradient, tensor 0")
    close(b.grad, torch.full_like(b, 3.0 * n), "grouped_reducescatter gradient, tensor 1")
    a.grad = b.grad = None
    outs = hvd.grouped_allgather([a, b])
    (outs[0].sum() * 2 + outs[1].sum() * 3).backward()
    close(a.grad, torch.full_like(a, 2.0), "grouped_allgather gradient, tensor 0")
    close(b.grad, torch.full_like(b, 3.0), "grouped_allgather gradient, tensor 1")


def uneven_allgather_gradient(r, n):
    """Concatenating allgather of different row counts: each rank's gradient is its rows."""
    if allgather_stacks():
        return
    rows = [i + 1 for i in range(n)]
    xs = [torch.full((k, 2), 1.0, dtype=torch.float64, requires_grad=True) for k in rows]
    x = xs[r]
    a, b = hvd.grouped_allgather([x, x * 2])
    weights = torch.arange(sum(rows), dtype=torch.float64).unsqueeze(1)
    ((a * weights).sum() + (b * weights).sum()).backward()
    start = sum(rows[:r])
    expected = 3 * weights[start:start + rows[r]].expand(rows[r], 2) * 1.0
    close(x.grad, expected, "uneven grouped_allgather gradient")


def errors(r, n):
    for fn in (hvd.reducescatter, lambda t: hvd.grouped_reducescatter([t]),
               hvd.reducescatter_async):
        with raises(ValueError, "scalar", what="reducescatter of a scalar"):
            fn(torch.tensor(1.0))
    for base in (NotImplementedError, RuntimeError, ValueError):
        with raises(base, "Adasum", what="reducescatter(op=Adasum)"):
            hvd.reducescatter(torch.ones(2 * n), op=hvd.Adasum)
    code = hvd.nccl_built()
    assert type(code) is int and (code == 0 or code >= 2700), code
    # Every op still runs after the errors: nothing was left half-submitted.
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(n)), "after errors")


def pending_at_shutdown(r, n):
    """An operation that finished but was not waited on keeps its result through
    shutdown(); one still pending fails with HorovodInternalError saying why (Horovod's
    handles do the same), also after init() again, when its number is a new operation's."""
    finished = hvd.allreduce_async(torch.full((2,), float(r)), op=hvd.Sum)
    while not hvd.poll(finished):
        time.sleep(0.005)
    # Submitted by rank 0 alone: it cannot complete.
    pending = hvd.allreduce_async(torch.ones(3), name="rank0.only") if r == 0 else None
    hvd.shutdown()
    close(hvd.synchronize(finished), torch.full((2,), float(n * (n - 1) // 2)),
          "a result collected before shutdown()")
    hvd.init()
    fresh = [hvd.allreduce_async(torch.ones(2), op=hvd.Sum) for _ in range(3)]
    if pending is not None:
        # Either the coordinator failed it first, seeing rank 1 shut down without it, or
        # it was still pending when this rank's shutdown() ended.
        try:
            hvd.synchronize(pending)
        except hvd.HorovodInternalError as e:
            text = str(e)
            assert ("still pending when shutdown() was called" in text
                    or ("'rank0.only' can never complete" in text
                        and "shut down without submitting it" in text)), \
                f"a handle pending at shutdown(): {text}"
        else:
            raise AssertionError("a handle pending at shutdown() gave a result")
    for h in fresh:
        close(hvd.synchronize(h), torch.full((2,), float(n)), "after init() again")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dtype_sweep(r, n)
    gradient_sweep(r, n)
    uneven_allgather_gradient(r, n)
    errors(r, n)
    pending_at_shutdown(r, n)
    done(r)


if __name__ == "__main__":
    main()

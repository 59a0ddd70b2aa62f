"""Every dtype MXNet 1.9.1 NDArrays have that Horovod's MXNet front-end accepts (uint8,
int8, int32, int64, float16, float32, float64) and bool, through every collective and its
grouped and in-place forms, on n ranks: each rank checks the values it ends with against
what numpy computes from every rank's inputs. Then the concatenating allgather after a
re-init with PERSEUS_CHANGE_HVD_ALLGATHER=1, and the collectives are not recorded by
autograd (Horovod's MXNet ops are not differentiable either). MXNet 1.9.1 has no int16 or
uint16 NDArrays (its operators refuse those dtypes), so they are not swept."""

import os

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises
from mxnet.base import MXNetError
from perseus.common.ops import STREAM_FROM

DTYPES = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool")


def value(i, rows, dtype):
    """Rank i's input: small values (sums over 3 ranks fit int8), a pattern per rank."""
    v = (np.arange(rows * 3).reshape(rows, 3) * (i + 1) + i) % 7
    return (v % 2 == 1) if dtype == "bool" else v.astype(dtype)


def nd(a, dtype):
    return mx.nd.array(a, dtype=dtype)


def tol(dtype):
    return (1e-2, 1e-2) if dtype == "float16" else (1e-6, 1e-6)


def check(out, want, dtype, what):
    assert out.dtype == np.dtype(dtype), f"{what}: dtype {out.dtype}, not {dtype}"
    rtol, atol = tol(dtype)
    close(out, np.asarray(want), f"{what} ({dtype})", rtol, atol)


def reduced(inputs, op, dtype):
    """numpy's reduction of the ranks' inputs (bool: Sum and Max are or, Min is and)."""
    stacked = np.stack(inputs).astype(np.float64)
    if op == hvd.Sum:
        out = stacked.sum(0)
    elif op == hvd.Min:
        out = stacked.min(0)
    elif op == hvd.Max:
        out = stacked.max(0)
    else:  # Average
        out = stacked.mean(0)
    return out > 0 if dtype == "bool" else out


def ops_for(dtype):
    ops = [hvd.Sum, hvd.Min, hvd.Max]
    return ops + [hvd.Average] if dtype.startswith("float") else ops


def blocks(d0, n):
    """(start, rows) of each rank's block of a reducescatter of d0 rows."""
    counts = [d0 // n + (1 if i < d0 % n else 0) for i in range(n)]
    return [(sum(counts[:i]), counts[i]) for i in range(n)]


def allreduces(r, n, dtype):
    rows = 2 * n
    inputs = [value(i, rows, dtype) for i in range(n)]
    x = nd(inputs[r], dtype)
    for op in ops_for(dtype):
        check(hvd.allreduce(x, op=op), reduced(inputs, op, dtype), dtype, f"allreduce op {op}")
        inplace = x.copy()
        assert hvd.allreduce_(inplace, op=op) is inplace
        check(inplace, reduced(inputs, op, dtype), dtype, f"allreduce_ op {op}")
    check(x, inputs[r], dtype, "allreduce left its input alone")
    if dtype == "bool":
        with raises(TypeError, "cannot be averaged", what="Average of bool"):
            hvd.allreduce(x)
    else:  # integers are scaled exactly here (a fraction would truncate, as in Horovod)
        pre = 0.5 if dtype.startswith("float") else 1.0
        check(hvd.allreduce(x, op=hvd.Sum, prescale_factor=pre, postscale_factor=3.0),
              reduced(inputs, hvd.Sum, dtype) * pre * 3.0, dtype, "allreduce with scale factors")
    other = [value(i + 1, 3, dtype) for i in range(n)]
    group = [x, nd(other[r], dtype)]
    a, b = hvd.grouped_allreduce(group, op=hvd.Sum)
    check(a, reduced(inputs, hvd.Sum, dtype), dtype, "grouped_allreduce 0")
    check(b, reduced(other, hvd.Sum, dtype), dtype, "grouped_allreduce 1")
    group = [x.copy(), nd(other[r], dtype)]
    assert hvd.grouped_allreduce_(group, op=hvd.Max) is not None
    check(group[0], reduced(inputs, hvd.Max, dtype), dtype, "grouped_allreduce_ 0")
    check(group[1], reduced(other, hvd.Max, dtype), dtype, "grouped_allreduce_ 1")
    scalars = [value(i, 1, dtype)[0, 1] for i in range(n)]
    check(hvd.allreduce(nd([scalars[r]], dtype).reshape(()), op=hvd.Max),
          np.asarray(reduced([np.asarray(s) for s in scalars], hvd.Max, dtype)), dtype,
          "allreduce of a scalar")


def gathers(r, n, dtype):
    inputs = [value(i, 2, dtype) for i in range(n)]
    x = nd(inputs[r], dtype)
    check(hvd.allgather(x), np.stack(inputs), dtype, "allgather (stacked)")
    other = [value(i + 2, 3, dtype) for i in range(n)]
    a, b = hvd.grouped_allgather([x, nd(other[r], dtype)])
    check(a, np.stack(inputs), dtype, "grouped_allgather 0")
    check(b, np.stack(other), dtype, "grouped_allgather 1")
    scalars = [value(i, 1, dtype)[0, 1] for i in range(n)]
    check(hvd.allgather(nd([scalars[r]], dtype).reshape(())), np.array(scalars), dtype,
          "allgather of scalars")


def broadcasts(r, n, dtype):
    inputs = [value(i, 2, dtype) for i in range(n)]
    x = nd(inputs[r], dtype)
    check(hvd.broadcast(x, n - 1), inputs[n - 1], dtype, "broadcast")
    check(x, inputs[r], dtype, "broadcast left its input alone")
    y = x.copy()
    assert hvd.broadcast_(y, 0) is y
    check(y, inputs[0], dtype, "broadcast_")


def alltoalls(r, n, dtype):
    rows = 2 * n
    inputs = [value(i, rows, dtype) for i in range(n)]
    out = hvd.alltoall(nd(inputs[r], dtype))
    check(out, np.concatenate([inputs[i][2 * r:2 * r + 2] for i in range(n)]), dtype,
          "alltoall without splits")
    # Rank i sends (i + j) % 2 + 1 rows to rank j: its dim 0 is their sum.
    splits = [[(i + j) % 2 + 1 for j in range(n)] for i in range(n)]
    sent = [value(i + 3, sum(splits[i]), dtype) for i in range(n)]
    out, received = hvd.alltoall(nd(sent[r], dtype),
                                 splits=mx.nd.array(splits[r], dtype="int32"))
    want = [sent[i][sum(splits[i][:r]):sum(splits[i][:r + 1])] for i in range(n)]
    check(out, np.concatenate(want), dtype, "alltoall with splits")
    check(received, [splits[i][r] for i in range(n)], "int32", "alltoall received splits")


def reducescatters(r, n, dtype):
    for d0 in (2 * n, 2 * n + 1):
        inputs = [value(i, d0, dtype) for i in range(n)]
        start, count = blocks(d0, n)[r]
        ops = [hvd.Sum, hvd.Max] + ([hvd.Average] if dtype.startswith("float") else [])
        for op in ops:
            out = hvd.reducescatter(nd(inputs[r], dtype), op=op)
            check(out, reduced(inputs, op, dtype)[start:start + count], dtype,
                  f"reducescatter of {d0} rows op {op}")
    a_in = [value(i, 2 * n, dtype) for i in range(n)]
    b_in = [value(i + 1, n + 1, dtype) for i in range(n)]
    a, b = hvd.grouped_reducescatter([nd(a_in[r], dtype), nd(b_in[r], dtype)], op=hvd.Sum)
    sa, ca = blocks(2 * n, n)[r]
    sb, cb = blocks(n + 1, n)[r]
    check(a, reduced(a_in, hvd.Sum, dtype)[sa:sa + ca], dtype, "grouped_reducescatter 0")
    check(b, reduced(b_in, hvd.Sum, dtype)[sb:sb + cb], dtype, "grouped_reducescatter 1")


def concatenating_allgather(r, n, dtype):
    inputs = [value(i, i + 1, dtype) for i in range(n)]  # rank i has i + 1 rows
    check(hvd.allgather(nd(inputs[r], dtype)), np.concatenate(inputs), dtype,
          "allgather (concatenated)")
    other = [value(i + 1, 1, dtype) for i in range(n)]
    a, b = hvd.grouped_allgather([nd(inputs[r], dtype), nd(other[r], dtype)])
    check(a, np.concatenate(inputs), dtype, "grouped_allgather (concatenated) 0")
    check(b, np.concatenate(other), dtype, "grouped_allgather (concatenated) 1")


def large_outputs(r, n):
    """Results of at least a MiB come from the core's pool of memory (float32, and bool
    retagged both ways): values right, and outputs held at once apart."""
    rows = (1 << 20) // 12 + 5
    for dtype in ("float32", "bool"):
        inputs = [value(i, rows, dtype) for i in range(n)]
        x = nd(inputs[r], dtype)
        op = hvd.Max if dtype == "bool" else hvd.Sum
        held = [hvd.allreduce(x, op=op, name=f"big.{dtype}.{k}") for k in range(2)]
        for out in held:
            check(out, reduced(inputs, op, dtype), dtype, f"large allreduce {dtype}")
        check(hvd.broadcast(x, n - 1, name=f"big.bcast.{dtype}"), inputs[n - 1], dtype,
              f"large broadcast {dtype}")
        check(x, inputs[r], dtype, f"large broadcast left its input alone {dtype}")
        held[0][:] = 0
        check(held[1], reduced(inputs, op, dtype), dtype, f"a held output kept {dtype}")
    # Past STREAM_FROM bytes the root's copy into its new output bypasses the cache.
    rows = STREAM_FROM // 12 + 5
    inputs = [value(i, rows, "float32") for i in range(n)]
    x = nd(inputs[r], "float32")
    check(hvd.broadcast(x, n - 1, name="huge.bcast"), inputs[n - 1], "float32",
          "huge broadcast")
    check(x, inputs[r], "float32", "huge broadcast left its input alone")


def not_recorded(r, n):
    """Under autograd.record() the collectives' results are not in the graph: backward
    through one raises MXNetError and leaves the input's gradient alone."""
    x = mx.nd.ones((n, 2)) * (r + 1)
    x.attach_grad()
    for name, call in (("allreduce", lambda: hvd.allreduce(x, op=hvd.Sum)),
                       ("allgather", lambda: hvd.allgather(x)),
                       ("broadcast", lambda: hvd.broadcast(x, 0)),
                       ("alltoall", lambda: hvd.alltoall(x)),
                       ("reducescatter", lambda: hvd.reducescatter(x, op=hvd.Sum))):
        with mx.autograd.record():
            y = call()
        with raises(MXNetError, "not in a computational graph", what=f"backward of {name}"):
            y.backward()
        close(x.grad, np.zeros((n, 2)), f"{name} left the gradient alone")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        allreduces(r, n, dtype)
        gathers(r, n, dtype)
        broadcasts(r, n, dtype)
        alltoalls(r, n, dtype)
        reducescatters(r, n, dtype)
    large_outputs(r, n)
    not_recorded(r, n)
    hvd.shutdown()
    os.environ["PERSEUS_CHANGE_HVD_ALLGATHER"] = "1"
    hvd.init()
    for dtype in DTYPES:
        concatenating_allgather(r, n, dtype)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

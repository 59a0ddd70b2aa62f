"""Every collective's values on NDArrays, on n ranks; then Horovod's concatenating
allgather after a re-init with PERSEUS_CHANGE_HVD_ALLGATHER=1."""

import os

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done

BASE = np.array([[0, 1, 2], [2, 1, 0]])
DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8", "int8")


def reductions(r, n):
    x = BASE * (r + 1)
    expected = {hvd.Sum: BASE * n * (n + 1) // 2, hvd.Min: BASE, hvd.Max: BASE * n,
                hvd.Product: BASE ** n * int(np.prod(np.arange(1, n + 1)))}
    for dtype in DTYPES:
        t = mx.nd.array(x, dtype=dtype)
        tol = 2e-2 if dtype == "float16" else 1e-6
        for op, want in expected.items():
            out = hvd.allreduce(t, op=op)
            close(out, want, f"allreduce {dtype} op {op}", tol, tol)
            assert out.dtype == np.dtype(dtype), out.dtype
            close(t, x, f"allreduce left its input alone ({dtype})")
            inplace = t.copy()
            assert hvd.allreduce_(inplace, op=op) is inplace
            close(inplace, want, f"allreduce_ {dtype} op {op}", tol, tol)
        if dtype.startswith("float"):
            close(hvd.allreduce(t), BASE * (n + 1) / 2, f"average {dtype}", tol, tol)
            close(hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
                  BASE * n * (n + 1) / 2 * 1.5, f"scaled {dtype}", tol, tol)
    group = [mx.nd.array(x), mx.nd.ones(4) * r]
    a, b = hvd.grouped_allreduce(group, op=hvd.Sum)
    close(a, BASE * n * (n + 1) / 2, "grouped 0")
    close(b, np.full(4, n * (n - 1) / 2), "grouped 1")
    hvd.grouped_allreduce_(group, op=hvd.Max)
    close(group[1], np.full(4, n - 1), "grouped_ in place")
    # Pending engine work on the input is waited for, and results feed later operations.
    lazy = mx.nd.ones((64, 64)) * (r + 1)
    close(hvd.allreduce(lazy * 2, op=hvd.Sum).sum().asscalar(), 2 * 64 * 64 * n * (n + 1) / 2,
          "an input still being computed")


def gather_broadcast(r, n):
    for dtype in DTYPES:
        x = mx.nd.array(BASE * (r + 1), dtype=dtype)
        close(hvd.allgather(x), np.stack([BASE * (i + 1) for i in range(n)]),
              f"allgather stack {dtype}")
        close(hvd.broadcast(x, n - 1), BASE * n, f"broadcast {dtype}")
        close(x, BASE * (r + 1), f"broadcast left its input alone ({dtype})")
    y = mx.nd.ones(3) * r
    assert hvd.broadcast_(y, 1) is y
    close(y, np.ones(3), "broadcast_")
    # Without splits Horovod 0.28 returns the rows alone; with them, also what was received.
    out = hvd.alltoall(mx.nd.arange(2 * n) + 100 * r)
    assert isinstance(out, mx.nd.NDArray), f"alltoall without splits gave {type(out)}"
    close(out, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * i for i in range(n)]),
          "alltoall equal splits")
    out, received = hvd.alltoall(mx.nd.arange(2 * n) + 100 * r, splits=[2] * n)
    close(out, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * i for i in range(n)]),
          "alltoall equal explicit splits")
    close(received, np.full(n, 2), "alltoall received splits")
    splits = list(range(1, n + 1))
    out, received = hvd.alltoall(mx.nd.arange(sum(splits)).reshape((-1, 1)) + 100 * r,
                                 splits=splits)
    start = sum(splits[:r])
    close(out, np.concatenate([np.arange(start, start + r + 1) + 100 * i
                               for i in range(n)]).reshape(-1, 1), "alltoall splits")
    close(received, np.full(n, r + 1), "alltoall splits received")
    d0 = 2 * n + 1
    close(hvd.reducescatter(mx.nd.ones((d0, 2)) * (r + 1), op=hvd.Sum),
          np.full((3 if r == 0 else 2, 2), n * (n + 1) / 2), "reducescatter")
    assert hvd.broadcast_object({"from": r} if r == 0 else None, 0) == {"from": 0}
    assert hvd.allgather_object(r * 10) == [i * 10 for i in range(n)]
    pair = hvd.add_process_set([0, 1])
    if r in (0, 1):
        close(hvd.allreduce(mx.nd.array([r]), op=hvd.Sum, process_set=pair), [1],
              "process set")
    hvd.remove_process_set(pair)
    hvd.barrier()
    last = hvd.join()
    assert hvd.allgather_object(last) == [last] * n and 0 <= last < n


def broadcast_parameters(r, n):
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Constant(r + 1))
    hvd.broadcast_parameters(net.collect_params(), root_rank=1)
    close(net.weight.data(), np.full((3, 4), 2.0), "broadcast_parameters (gluon)")
    # Deferred initialization: broadcast once the first forward pass gives the shape.
    lazy = mx.gluon.nn.Dense(2)
    lazy.initialize(mx.init.Constant(r + 1))
    hvd.broadcast_parameters(lazy.collect_params(), root_rank=0)
    lazy(mx.nd.ones((1, 5)))
    close(lazy.weight.data(), np.ones((2, 5)), "broadcast_parameters (deferred)")
    arg_params = {"w": mx.nd.ones(2) * r, "b": mx.nd.ones(1) * r}
    hvd.broadcast_parameters(arg_params, root_rank=n - 1)
    close(arg_params["w"], np.full(2, n - 1.0), "broadcast_parameters (dict)")


def concatenating_allgather(r, n):
    out = hvd.allgather(mx.nd.ones((r + 1, 2)) * r)
    close(out, np.concatenate([np.full((i + 1, 2), float(i)) for i in range(n)]),
          "allgather concat")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    reductions(r, n)
    gather_broadcast(r, n)
    broadcast_parameters(r, n)
    hvd.shutdown()
    os.environ["PERSEUS_CHANGE_HVD_ALLGATHER"] = "1"
    hvd.init()
    concatenating_allgather(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

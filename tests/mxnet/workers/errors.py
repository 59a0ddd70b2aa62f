"""Errors as the torch front-end gives them: use before init, bad arrays and arguments, and
requests that disagree across ranks (every rank fails naming the tensor; the job goes on)."""

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises

NOT_INIT = "not been initialized"


def before_init():
    for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.barrier):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn()
    t = mx.nd.ones(2)
    for fn, args in ((hvd.allreduce, (t,)), (hvd.allreduce_, (t,)), (hvd.allgather, (t,)),
                     (hvd.broadcast, (t, 0)), (hvd.alltoall, (t,)), (hvd.reducescatter, (t,))):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn(*args)


def bad_arguments(r, n):
    # Every dtype MXNet 1.9 can make from Python is supported; other inputs are refused.
    for fn, args in ((hvd.allreduce, ()), (hvd.allreduce_, ()), (hvd.allgather, ()),
                     (hvd.broadcast, (0,)), (hvd.alltoall, ()), (hvd.reducescatter, ())):
        with raises(TypeError, "expected an mxnet NDArray", what=f"{fn.__name__} of numpy"):
            fn(np.ones(2), *args)
    with raises(ValueError, "row_sparse", what="a sparse array"):
        hvd.allreduce(mx.nd.ones((2, 2)).tostype("row_sparse"))
    with raises(TypeError, "Adasum reduces floating-point tensors only", what="Adasum"):
        hvd.allreduce(mx.nd.ones(2, dtype="int32"), op=hvd.Adasum)
    with raises(ValueError, "unknown reduce op", what="unknown op"):
        hvd.allreduce(mx.nd.ones(2), op=17)
    net = mx.gluon.nn.Dense(1, in_units=2)
    net.initialize()
    with raises(ValueError, "gradient_predivide_factor", what="a zero predivide factor"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", {}, gradient_predivide_factor=0.0)
    with raises(ValueError, "invalid params", what="broadcast_parameters of a list"):
        hvd.broadcast_parameters([mx.nd.ones(1)])
    with raises(ValueError, what="broadcast root out of range"):
        hvd.broadcast(mx.nd.ones(2), n + 3)


def mismatches(r, n):
    def expect(name, submit):
        with raises(hvd.HorovodInternalError, name, what=f"mismatch {name}"):
            submit()
        close(hvd.allreduce(mx.nd.ones(3), op=hvd.Sum, name=f"after.{name}"), np.full(3, n),
              f"allreduce after {name}")

    expect("mm.shape", lambda: hvd.allreduce(mx.nd.ones(r + 1), name="mm.shape"))
    expect("mm.dtype", lambda: hvd.allreduce(
        mx.nd.ones(2, dtype="float32" if r == 0 else "float64"), name="mm.dtype"))
    expect("mm.op", lambda: hvd.allreduce(mx.nd.ones(2), op=hvd.Sum if r == 0 else hvd.Max,
                                          name="mm.op"))
    expect("mm.root", lambda: hvd.broadcast(mx.nd.ones(2), 0 if r == 0 else 1, name="mm.root"))


def main():
    before_init()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad_arguments(r, n)
    mismatches(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

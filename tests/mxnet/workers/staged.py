"""NDArrays off the host (on a GPU) cross through host memory: the core works on a copy in
mx.cpu(), and values come back into the array or onto its context.

This machine has no GPU, so mpi_ops is told that arrays on mx.cpu(1) are off the host,
which sends them down the same path a GPU array takes. Every collective's values must be
those of the plain path, on every rank, with results on the arrays' context."""

import _mxhelpers  # noqa: F401 - sets MXNet's variables first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done
from perseus.mxnet import mpi_ops

DEVICE = mx.cpu(1)
staged = []


def off_host(tensor):
    if tensor.context == DEVICE:
        staged.append(tensor.shape)
        return True
    return False


mpi_ops._off_host = off_host


def on_device(value, dtype="float32"):
    return mx.nd.array(value, ctx=DEVICE, dtype=dtype)


def check_context(t, what):
    assert t.context == DEVICE, f"{what}: result on {t.context}, not {DEVICE}"


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    base = np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])

    x = on_device(base * (r + 1))
    out = hvd.allreduce(x, op=hvd.Sum)
    close(out, base * n * (n + 1) / 2, "allreduce sum")
    check_context(out, "allreduce")
    close(x, base * (r + 1), "allreduce leaves its input alone")
    assert staged, "the array on cpu(1) was not taken through the host"

    hvd.allreduce_(x)
    close(x, base * (n + 1) / 2, "allreduce_ average, written back into the array")
    check_context(x, "allreduce_")

    pair = [on_device([r + 1.0]), on_device([[2.0 * r]], "float64")]
    hvd.grouped_allreduce_(pair, op=hvd.Sum)
    close(pair[0], [n * (n + 1) / 2], "grouped allreduce_ 0")
    close(pair[1], [[float(n * (n - 1))]], "grouped allreduce_ 1")
    assert pair[1].dtype == np.float64

    gathered = hvd.allgather(on_device([[float(r), 1.0]]))
    close(gathered, [[[float(i), 1.0]] for i in range(n)], "allgather (stacked)")
    check_context(gathered, "allgather")

    b = on_device([float(r), 7.0])
    copy = hvd.broadcast(b, root_rank=n - 1)
    close(copy, [float(n - 1), 7.0], "broadcast")
    check_context(copy, "broadcast")
    close(b, [float(r), 7.0], "broadcast leaves its input alone")
    hvd.broadcast_(b, root_rank=0)
    close(b, [0.0, 7.0], "broadcast_ written back into the array")

    got = hvd.alltoall(on_device(np.full([2 * n], float(r))))
    close(got, np.repeat(np.arange(n), 2), "alltoall without splits")
    check_context(got, "alltoall without splits")
    got, received = hvd.alltoall(on_device(np.full([2 * n], float(r))), splits=[2] * n)
    close(got, np.repeat(np.arange(n), 2), "alltoall")
    close(received, np.full(n, 2), "alltoall splits")
    check_context(got, "alltoall")
    check_context(received, "alltoall splits")

    rs = hvd.reducescatter(on_device(np.full([2 * n, 2], float(r + 1))), op=hvd.Sum)
    close(rs, np.full((2, 2), n * (n + 1) / 2), "reducescatter")
    check_context(rs, "reducescatter")
    done(r)


if __name__ == "__main__":
    main()

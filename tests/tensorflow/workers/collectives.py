"""Every collective's values and gradients, eagerly and inside tf.function, on n ranks;
then, after a re-init with PERSEUS_CHANGE_HVD_ALLGATHER=1, Horovod's concatenating
allgather."""

import os
import sys
import warnings

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import close, done

BASE = np.array([[0, 1, 2], [2, 1, 0]])
DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8,
          tf.int8)


def modes(fn):
    """``fn`` run eagerly and as a tf.function: yields (mode, fn)."""
    yield "eager", fn
    yield "graph", tf.function(fn)


def tol(dtype):
    return (2e-2, 2e-2) if dtype in (tf.float16, tf.bfloat16) else (1e-6, 1e-6)


def allreduce_values(r, n):
    x = BASE * (r + 1)
    expected = {
        hvd.Sum: BASE * n * (n + 1) // 2,
        hvd.Min: BASE,
        hvd.Max: BASE * n,
        hvd.Product: BASE ** n * int(np.prod(np.arange(1, n + 1))),
    }
    for dtype in DTYPES:
        t = tf.cast(tf.constant(x), dtype)
        for op, want in expected.items():
            for mode, f in modes(lambda v, op=op: hvd.allreduce(v, op=op)):
                close(f(t), want, f"allreduce {dtype.name} op {op} {mode}", *tol(dtype))
                assert f(t).dtype == dtype
        if dtype.is_floating:
            for mode, f in modes(lambda v: hvd.allreduce(v)):
                close(f(t), BASE * (n + 1) / 2, f"average {dtype.name} {mode}", *tol(dtype))
            for mode, f in modes(lambda v: hvd.allreduce(v, op=hvd.Sum, prescale_factor=0.5,
                                                         postscale_factor=3.0)):
                close(f(t), BASE * n * (n + 1) / 2 * 1.5, f"scaled {dtype.name} {mode}",
                      *tol(dtype))
    # A variable, a scalar, compression, and the deprecated average argument.
    v = tf.Variable(tf.constant(x, tf.float32))
    for mode, f in modes(lambda: hvd.allreduce(v, op=hvd.Sum)):
        close(f(), BASE * n * (n + 1) / 2, f"allreduce of a variable {mode}")
    for mode, f in modes(lambda: hvd.allreduce(tf.constant(float(r)), op=hvd.Sum)):
        close(f(), n * (n - 1) / 2, f"scalar {mode}")
    for mode, f in modes(lambda: hvd.allreduce(tf.constant(x, tf.float32),
                                               compression=hvd.Compression.fp16)):
        out = f()
        assert out.dtype == tf.float32, out.dtype
        close(out, BASE * (n + 1) / 2, f"fp16 compression {mode}", 1e-3, 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        close(hvd.allreduce(tf.constant(x, tf.float32), average=False),
              BASE * n * (n + 1) / 2, "average=False")


def grouped_and_sparse(r, n):
    tensors = [tf.constant(BASE * (r + 1), tf.float32), tf.fill([4], float(r)),
               tf.constant(r + 1, tf.int64)]
    for mode, f in modes(lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum)):
        a, b, c = f()
        close(a, BASE * n * (n + 1) / 2, f"grouped 0 {mode}")
        close(b, np.full(4, n * (n - 1) / 2), f"grouped 1 {mode}")
        close(c, n * (n + 1) // 2, f"grouped 2 {mode}")
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r], tf.int64),
                              tf.constant([n, 2], tf.int64))
    for op, scale in ((hvd.Average, 1.0 / n), (hvd.Sum, 1.0)):
        red = hvd.allreduce(slices, op=op)
        assert isinstance(red, tf.IndexedSlices), type(red)
        close(red.indices, np.arange(n), "slices indices")
        close(red.values, np.repeat(np.arange(1, n + 1), 2).reshape(n, 2) * scale,
              f"slices values op {op}")
        dense = tf.convert_to_tensor(red)
        close(dense, np.repeat(np.arange(1, n + 1), 2).reshape(n, 2) * scale, "slices dense")
    g = hvd.grouped_allreduce([slices, tf.ones(2)], op=hvd.Sum)
    assert isinstance(g[0], tf.IndexedSlices)
    close(g[1], np.full(2, n), "grouped with slices")


def gather_broadcast(r, n):
    for dtype in DTYPES + (tf.bool,):
        x = tf.cast(tf.constant(BASE * (r + 1) % 2 if dtype == tf.bool else BASE * (r + 1)),
                    dtype)
        for mode, f in modes(lambda v: hvd.allgather(v)):
            out = f(x)
            want = np.stack([BASE * (i + 1) for i in range(n)])
            want = want % 2 if dtype == tf.bool else want
            close(tf.cast(out, tf.float64), want, f"allgather stack {dtype.name} {mode}")
            assert out.dtype == dtype
        root = n - 1
        for mode, f in modes(lambda v, root=root: hvd.broadcast(v, root)):
            want = BASE * n % 2 if dtype == tf.bool else BASE * n
            close(tf.cast(f(x), tf.float64), want, f"broadcast {dtype.name} {mode}")
    # Every rank's result is a tensor of its own, the root's too, as in Horovod.
    x = tf.fill([3], float(r))
    out = hvd.broadcast(x, 0)
    assert out is not x, f"rank {r}: broadcast returned its input tensor"
    close(out, np.zeros(3), "broadcast from rank 0")
    out = hvd.allgather(tf.constant(float(r)))
    close(out, np.arange(n, dtype=np.float64), "allgather of scalars stacks to [n]")
    v = tf.Variable(tf.fill([3], float(r)))
    hvd.broadcast_variables([v], root_rank=1)
    close(v, np.ones(3), "broadcast_variables")
    v.assign(tf.fill([3], float(r)))
    hvd.broadcast_([v], root_rank=0)
    close(v, np.zeros(3), "broadcast_")
    assert hvd.broadcast_object({"r": r, "t": (1, [2])} if r == 1 else None, 1)["r"] == 1
    assert hvd.allgather_object(("rank", r)) == [("rank", i) for i in range(n)]


def alltoall_reducescatter(r, n):
    splits = list(range(1, n + 1))  # j + 1 rows to rank j
    rows = sum(splits)
    x = tf.constant(np.arange(rows, dtype=np.float32).reshape(rows, 1) + 100 * r)
    offset = sum(splits[:r])
    want = np.concatenate([np.arange(offset, offset + r + 1) + 100 * i for i in range(n)])
    # With splits (a list or a tensor): (output, received_splits), as Horovod 0.28.
    for given in (splits, tf.constant(splits, tf.int64)):
        for mode, f in modes(lambda v, given=given: hvd.alltoall(v, splits=given)):
            result = f(x)
            assert isinstance(result, tuple) and len(result) == 2, type(result)
            out, received = result
            close(out, want.reshape(-1, 1), f"alltoall {mode}")
            close(received, np.full(n, r + 1), f"alltoall received splits {mode}")
            assert received.dtype == tf.int32
    # Without splits: the output tensor alone, dim 0 split equally.
    for mode, f in modes(lambda v: hvd.alltoall(v)):
        out = f(tf.reshape(tf.range(2.0 * n) + 100 * r, [2 * n, 1]))
        assert isinstance(out, tf.Tensor), f"alltoall without splits {mode}: {type(out)}"
        close(out, np.concatenate([np.array([2 * r, 2 * r + 1]) + 100 * i for i in range(n)])
              .reshape(-1, 1), f"alltoall equal {mode}")
    d0 = 2 * n + 1
    for mode, f in modes(lambda v: hvd.reducescatter(v, op=hvd.Sum)):
        out = f(tf.fill([d0, 2], float(r + 1)))
        mine = 3 if r == 0 else 2
        close(out, np.full((mine, 2), n * (n + 1) / 2), f"reducescatter {mode}")
    out = hvd.reducescatter(tf.fill([d0, 2], float(r + 1)))
    close(out, np.full((3 if r == 0 else 2, 2), (n + 1) / 2), "reducescatter average")
    outs = hvd.grouped_reducescatter([tf.ones([n, 1]), tf.ones([2 * n])], op=hvd.Sum)
    close(outs[0], np.full((1, 1), n), "grouped reducescatter 0")
    close(outs[1], np.full(2, n), "grouped reducescatter 1")


def gradients(r, n):
    c = tf.constant([1.0, 2.0]) * (r + 1)
    for op, want in ((hvd.Sum, c * n), (hvd.Average, c)):
        def f(w, op=op):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(hvd.allreduce(w * c, op=op))
            return tape.gradient(loss, w)
        for mode, g in modes(f):
            close(g(tf.Variable([3.0, 4.0])), want, f"allreduce gradient op {op} {mode}")

    k = tf.constant(np.arange(1, n + 1).reshape(n, 1) * np.ones((n, 2)), tf.float32)

    def gather_grad(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allgather(w) * k)
        return tape.gradient(loss, w)
    for mode, g in modes(gather_grad):
        close(g(tf.Variable([1.0, 1.0])), np.full(2, r + 1), f"allgather gradient {mode}")

    def bcast_grad(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.broadcast(w, 0) * (r + 1))
        return tape.gradient(loss, w)
    for mode, g in modes(bcast_grad):
        close(g(tf.Variable([1.0, 1.0])), np.full(2, (n + 1) / 2 if r == 0 else 0.0),
              f"broadcast gradient {mode}")

    def a2a_grad(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.alltoall(w) * (r + 1))
        return tape.gradient(loss, w)
    for mode, g in modes(a2a_grad):
        close(g(tf.Variable(tf.zeros([2 * n]))), np.repeat(np.arange(1, n + 1), 2),
              f"alltoall gradient {mode}")

    # Uneven splits: rank r sends j + 1 rows to rank j and receives r + 1 from each;
    # the gradient of row i (sent to rank j) is rank j's weight for it.
    rows = n * (n + 1) // 2
    splits = list(range(1, n + 1))

    def a2a_splits_grad(w):
        with tf.GradientTape() as tape:
            out, _ = hvd.alltoall(w, splits=splits)
            loss = tf.reduce_sum(out * (r + 1))
        return tape.gradient(loss, w)
    for mode, g in modes(a2a_splits_grad):
        close(g(tf.Variable(tf.zeros([rows, 2]))),
              np.repeat(np.repeat(np.arange(1, n + 1), splits), 2).reshape(rows, 2),
              f"alltoall gradient with splits {mode}")

    def rs_grad(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.reducescatter(w, op=hvd.Sum) * (r + 1))
        return tape.gradient(loss, w)
    for mode, g in modes(rs_grad):  # Horovod's: the gathered gradient times n for Sum
        close(g(tf.Variable(tf.zeros([n, 2]))),
              n * np.repeat(np.arange(1, n + 1), 2).reshape(n, 2),
              f"reducescatter gradient {mode}")


def process_sets_join_barrier(r, n):
    pair = hvd.add_process_set([0, 1])
    if r in (0, 1):
        for mode, f in modes(lambda: hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum,
                                                   process_set=pair)):
            close(f(), [1.0], f"process set allreduce {mode}")
        close(hvd.allgather(tf.constant([r]), process_set=pair), [[0], [1]],
              "process set allgather")
    hvd.remove_process_set(pair)
    assert int(hvd.size_op()) == n and int(hvd.rank_op()) == r
    assert int(hvd.local_size_op()) == hvd.local_size()
    hvd.barrier()
    for mode, f in modes(lambda: hvd.join()):
        last = int(f())
        assert 0 <= last < n, last
        assert hvd.allgather_object(last) == [last] * n, "join: ranks disagree on the last"


def concatenating_allgather(r, n):
    x = tf.fill([r + 1, 2], float(r))
    want = np.concatenate([np.full((i + 1, 2), float(i)) for i in range(n)])
    for mode, f in modes(lambda v: hvd.allgather(v)):
        out = f(x)
        close(out, want, f"allgather concat {mode}")

    def grad(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allgather(w) * tf.range(1.0, want.shape[0] + 1)[:, None])
        return tape.gradient(loss, w)
    start = r * (r + 1) // 2
    for mode, g in modes(grad):
        close(g(tf.Variable(x)), np.repeat(np.arange(start + 1, start + r + 2), 2).reshape(-1, 2)
              .astype(np.float32), f"allgather concat gradient {mode}")


def lone_tensors_in_the_lane(r, n):
    """A lone small tensor's allreduce, allgather, broadcast and reducescatter, eager and
    in a graph, run among the callers (PERSEUS_LANE_BYTES) with the engine's values; a
    pair of tensors goes to the engine, where the coordinator may fuse them. On 2 ranks
    (BASE's two rows: one each for the reducescatter)."""
    before = hvd.counters()["lane_operations"]
    x = tf.constant(BASE * (r + 1), tf.float32)
    # One operation a function: a graph may run independent operations in any order.
    cases = [("allreduce", lambda v: hvd.allreduce(v, op=hvd.Sum), BASE * n * (n + 1) / 2),
             ("allgather", hvd.allgather, np.stack([BASE * (i + 1) for i in range(n)])),
             ("broadcast", lambda v: hvd.broadcast(v, n - 1), BASE * n),
             ("reducescatter", lambda v: hvd.reducescatter(v, op=hvd.Sum),
              (BASE * n * (n + 1) / 2)[r:r + 1])]
    for what, op, want in cases:
        for mode, f in modes(op):
            close(f(x), want, f"lane {what} {mode}")
    ran = hvd.counters()["lane_operations"] - before
    assert ran == 8, f"rank {r}: {ran} of 8 lone operations ran in the lane"
    pair = hvd.grouped_allreduce([x, x], op=hvd.Sum)
    close(pair[1], BASE * n * (n + 1) / 2, "grouped allreduce")
    assert hvd.counters()["lane_operations"] - before == 8


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if sys.argv[1:] == ["lane"]:
        lone_tensors_in_the_lane(r, n)
        hvd.shutdown()
        done(r)
        return
    allreduce_values(r, n)
    grouped_and_sparse(r, n)
    gather_broadcast(r, n)
    alltoall_reducescatter(r, n)
    gradients(r, n)
    process_sets_join_barrier(r, n)
    hvd.shutdown()
    os.environ["PERSEUS_CHANGE_HVD_ALLGATHER"] = "1"
    hvd.init()
    concatenating_allgather(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

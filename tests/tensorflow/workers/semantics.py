"""Horovod 0.28's semantics on perseus.tensorflow.horovod: every dtype Perseus takes
(Horovod's and more, docs/tensorflow.md) through every collective (eager and tf.function), every differentiable op's gradient against
autograd of the same computation in one process (Horovod's definitions), Horovod's
error types, an error in the middle of a batch never turning into a hang of the next,
and tf.compat.v1 sessions that run many independent collectives in any order."""

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import close, done, raises
from perseus.common.basics import allgather_stacks

DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
          tf.bfloat16, tf.float32, tf.float64, tf.bool)


def values(rank, dtype, shape):
    """Rank ``rank``'s test values (numpy): small, exact in every dtype, sums included."""
    v = np.random.default_rng(7 + rank).integers(0, 9, shape)
    return v.astype(bool) if dtype == tf.bool else v


def reduce_ref(xs, op, dtype):
    if dtype == tf.bool:
        stacked = np.stack(xs).astype(bool)
        return stacked.all(0) if op == hvd.Min else stacked.any(0)
    stacked = np.stack(xs).astype(np.float64)
    out = {hvd.Sum: stacked.sum(0), hvd.Min: stacked.min(0), hvd.Max: stacked.max(0),
           hvd.Average: stacked.sum(0) / len(xs)}[op]
    return out if dtype.is_floating else np.trunc(out)


def dtype_sweep(r, n):
    shape = (2 * n, 3)
    for dtype in DTYPES:
        xs = [values(i, dtype, shape) for i in range(n)]
        mine = tf.constant(xs[r], dtype=dtype)
        rows = slice(2 * r, 2 * r + 2)
        gathered = np.stack(xs) if allgather_stacks() else np.concatenate(xs)
        ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype.is_floating else [])

        def every_op(t=mine, ops=ops):
            out = [hvd.allreduce(t, op=op) for op in ops]
            out += hvd.grouped_allreduce([t, t[:1]], op=hvd.Sum)
            out += [hvd.allgather(t)] + hvd.grouped_allgather([t, t])
            out += [hvd.broadcast(t, n - 1), hvd.alltoall(t)]
            if t.dtype != tf.bool:
                out += [hvd.reducescatter(t, op=hvd.Sum)]
                out += hvd.grouped_reducescatter([t, t], op=hvd.Sum)
            return out

        expected = [reduce_ref(xs, op, dtype) for op in ops]
        expected += [reduce_ref(xs, hvd.Sum, dtype), reduce_ref([x[:1] for x in xs], hvd.Sum,
                                                                dtype)]
        expected += [gathered] * 3 + [xs[n - 1], np.concatenate([x[rows] for x in xs])]
        if dtype != tf.bool:
            expected += [reduce_ref(xs, hvd.Sum, dtype)[rows]] * 3
        # Exact but for Average, divided in the dtype's own precision.
        rtol = {tf.float16: 1e-2, tf.bfloat16: 1e-2, tf.float32: 1e-6, tf.float64: 1e-12}.get(
            dtype, 0)
        for mode, fn in (("eager", every_op), ("tf.function", tf.function(every_op))):
            got = fn()
            assert len(got) == len(expected)
            for i, (g, e) in enumerate(zip(got, expected)):
                assert g.dtype == dtype, f"{dtype.name} {mode} result {i}: dtype {g.dtype.name}"
                close(tf.cast(g, tf.float64) if dtype == tf.bfloat16 else g,
                      np.asarray(e, dtype=np.float64 if dtype == tf.bfloat16 else
                                 dtype.as_numpy_dtype),
                      f"{dtype.name} {mode} result {i}", rtol, 0)
        var = tf.Variable(mine)
        new = hvd.broadcast_([var], 0)
        assert isinstance(new, list) and len(new) == 1, f"broadcast_ returned {new!r}"
        close(new[0], xs[0].astype(dtype.as_numpy_dtype) if dtype != tf.bfloat16 else
              new[0], f"broadcast_ {dtype.name}", 0, 0)
        close(var, new[0], f"broadcast_ {dtype.name}: the variable", 0, 0)


# --------------------------------------------------------------------------- gradients
# Horovod's gradient of each op, relative to autograd of the sum of every rank's loss
# computed in one process: allreduce and alltoall give that gradient; allgather and
# broadcast average the output gradients (1/n of it); reducescatter gathers them back
# times the scale factors and, for Sum, the set's size (n times it either way).
FACTOR = {"allreduce": 1.0, "grouped_allreduce": 1.0, "alltoall": 1.0, "allgather": "1/n",
          "grouped_allgather": "1/n", "broadcast": "1/n", "reducescatter": "n",
          "grouped_reducescatter": "n"}


def one_process(name, xs, op, n, pre, post):
    if name in ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"):
        total = tf.add_n([x * pre for x in xs]) * post
        if op == hvd.Average:
            total = total / n
        if name.endswith("reducescatter"):
            return [total[2 * j:2 * j + 2] for j in range(n)]
        return [total] * n
    if name.endswith("allgather"):
        return [tf.stack(xs) if allgather_stacks() else tf.concat(xs, 0)] * n
    if name == "broadcast":
        return [xs[0]] * n
    if name == "alltoall":
        return [tf.concat([x[2 * j:2 * j + 2] for x in xs], 0) for j in range(n)]
    raise AssertionError(name)


def distributed(name, x, op, pre, post):
    scaled = {"prescale_factor": pre, "postscale_factor": post}
    return {
        "allreduce": lambda: hvd.allreduce(x, op=op, **scaled),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([x], op=op, **scaled)[0],
        "allgather": lambda: hvd.allgather(x),
        "grouped_allgather": lambda: hvd.grouped_allgather([x])[0],
        "broadcast": lambda: hvd.broadcast(x, 0),
        "alltoall": lambda: hvd.alltoall(x),
        "reducescatter": lambda: hvd.reducescatter(x, op=op, **scaled),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([x], op=op, **scaled)[0],
    }[name]()


def gradient_sweep(r, n):
    shape = (2 * n, 3)
    reduced = ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter")
    cases = [(name, op, 1.0, 1.0) for name in FACTOR
             for op in ((hvd.Sum, hvd.Average) if name in reduced else (None,))]
    cases += [("allreduce", hvd.Sum, 0.5, 3.0), ("reducescatter", hvd.Sum, 0.5, 3.0),
              ("grouped_reducescatter", hvd.Average, 2.0, 0.25)]
    for name, op, pre, post in cases:
        what = f"gradient of {name} op={op} pre={pre} post={post}"
        xs = [tf.constant(np.random.default_rng(11 + i).normal(size=shape)) for i in range(n)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = one_process(name, xs, op, n, pre, post)
            ws = [tf.constant(np.random.default_rng(101 + i).normal(size=o.shape))
                  for i, o in enumerate(outs)]
            loss = tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, ws)])
        g = tape.gradient(loss, xs[r])
        g = tf.zeros_like(xs[r]) if g is None else g
        f = FACTOR[name]
        expected = g * {"1/n": 1.0 / n, "n": float(n)}.get(f, f)

        def grad_of(x=xs[r], name=name, op=op, pre=pre, post=post, w=ws[r]):
            with tf.GradientTape() as t:
                t.watch(x)
                y = distributed(name, x, op, pre, post)
                own = tf.reduce_sum(y * w)
            return y, t.gradient(own, x)

        for mode, fn in (("eager", grad_of), ("tf.function", tf.function(grad_of))):
            y, got = fn()
            close(y, outs[r], f"{what} {mode}: forward")
            close(got, expected, f"{what} {mode}", 1e-9, 1e-9)

    # Several tensors through one grouped op, each with its own gradient.
    a = tf.Variable(tf.fill([2 * n, 2], float(r + 1)))
    b = tf.Variable(tf.fill([2 * n], float(r + 2)))
    with tf.GradientTape() as tape:
        outs = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
        loss = tf.reduce_sum(outs[0]) * 2 + tf.reduce_sum(outs[1]) * 3
    ga, gb = tape.gradient(loss, [a, b])
    close(ga, np.full([2 * n, 2], 2.0 * n), "grouped_reducescatter gradient, tensor 0")
    close(gb, np.full([2 * n], 3.0 * n), "grouped_reducescatter gradient, tensor 1")


# --------------------------------------------------------------------------- errors

def errors(r, n):
    for fn in (hvd.reducescatter, lambda t: hvd.grouped_reducescatter([t])):
        for base in (tf.errors.InvalidArgumentError, ValueError):
            with raises(base, "scalar", what="reducescatter of a scalar"):
                fn(tf.constant(1.0))
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([r]), tf.constant([n, 2]))
    for scale in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5}):
        with raises(NotImplementedError, "Pre/postscale_factor are not supported",
                    what=f"IndexedSlices with {scale}"):
            hvd.allreduce(slices, op=hvd.Sum, **scale)
    for base in (tf.errors.InvalidArgumentError, ValueError):
        with raises(base, "alltoall", what="alltoall splits that do not sum"):
            hvd.alltoall(tf.ones([2 * n, 1]), splits=[1] * n if n > 2 else [3, 0])


def error_in_a_batch_leaves_no_hang(r, n):
    """A batch of collectives that fails part-way (a shape every rank disagrees on) on
    every rank; then batches of unnamed collectives run as before, eager and traced."""
    stack = allgather_stacks()
    bad = [tf.ones([2, 2])] * 3 + [tf.ones([r + 1, 2]) if stack else tf.ones([2, r + 2])]
    for mode, fn in (("eager", hvd.grouped_allgather),
                     ("tf.function", tf.function(hvd.grouped_allgather)),
                     ("one by one", lambda ts: [hvd.allgather(t) for t in ts])):
        with raises(hvd.HorovodInternalError if mode != "tf.function" else tf.errors.OpError,
                    "allgather", what=f"a failing allgather batch {mode}"):
            fn(bad)
        for dtype in (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32,
                      tf.float64):
            for dim in (1, 2, 3):
                t = tf.cast(tf.fill([17] * dim, r + 1), dtype)
                close(hvd.allreduce(t, op=hvd.Sum), np.full([17] * dim, n * (n + 1) // 2),
                      f"allreduce after the failing batch ({mode})")
        got = tf.function(lambda: hvd.grouped_allreduce([tf.ones(3)] * 4, op=hvd.Sum))()
        close(got, [np.full(3, n)] * 4, f"traced batch after the failing one ({mode})")


# --------------------------------------------------------------------------- sessions

def independent_collectives_in_a_session(r, n):
    """A tf.compat.v1 graph of many collectives no op orders (several kinds, grouped ops,
    IndexedSlices): the session runs them in whatever order it picks on each rank."""
    with tf.Graph().as_default():
        outs, expected = [], []
        for i in range(16):
            x = tf.constant([float(i + r)] * 4)
            kind = i % 4
            if kind == 0:
                outs.append(hvd.allreduce(x, op=hvd.Sum))
                expected.append(np.full(4, sum(i + j for j in range(n))))
            elif kind == 1:
                outs.append(hvd.reducescatter(tf.tile(x, [n]), op=hvd.Sum))
                expected.append(np.full(4, sum(i + j for j in range(n))))
            elif kind == 2:
                outs.append(hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)[1])
                expected.append(np.full(4, 2 * sum(i + j for j in range(n))))
            else:
                s = hvd.allreduce(tf.IndexedSlices(tf.reshape(x, [1, 4]), tf.constant([r]),
                                                   tf.constant([n, 4])), op=hvd.Sum)
                outs.append(tf.reduce_sum(tf.math.unsorted_segment_sum(
                    s.values, s.indices, n), 0))
                expected.append(np.full(4, sum(i + j for j in range(n))))
        var = tf.Variable([float(r)] * 3)
        bcast = hvd.broadcast_([var], n - 1)
        with tf.compat.v1.Session() as session:
            session.run(var.initializer)
            for _ in range(3):
                for got, e in zip(session.run(outs), expected):
                    close(got, e, "a session's independent collectives")
            new = session.run(bcast)
            assert isinstance(new, list), f"broadcast_ in a graph gave {type(new)}"
            close(new[0], np.full(3, float(n - 1)), "broadcast_'s values in a graph")


def duplicate_process_sets():
    """Before init: the same set twice is refused (Horovod's ValueError), nothing starts."""
    with raises(ValueError, "duplicate", what="init with a duplicate process set"):
        hvd.init(process_sets=[[0, 1], [1, 0]])
    assert not hvd.is_initialized()


def main():
    duplicate_process_sets()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dtype_sweep(r, n)
    gradient_sweep(r, n)
    errors(r, n)
    error_in_a_batch_leaves_no_hang(r, n)
    independent_collectives_in_a_session(r, n)
    done(r)


if __name__ == "__main__":
    main()

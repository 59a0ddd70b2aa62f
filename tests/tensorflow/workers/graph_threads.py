"""Graphs whose collectives no op orders, more of them than the graph has threads: 200
independent allreduces, allgathers, reducescatters, broadcasts, alltoalls and grouped ops
(and the gradients of some) in one ``session.run`` of a tf.compat.v1 session with one
inter-op thread and with two, tf.functions side by side in such a session, then in a
tf.function run by a runtime of one inter-op thread. Each rank's session picks its own
order; every value is checked on every rank. Before graphs left the inter-op threads free
while they waited, such a session step hung."""

import os
import sys

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import close, done
from perseus.common.basics import allgather_stacks

COLLECTIVES = 200
KINDS = 8


def build(r, n):
    """The step's outputs and what each must be on this rank: COLLECTIVES collectives of
    KINDS kinds, built in an order no data dependency imposes."""
    stack = allgather_stacks()
    total = n * (n - 1) // 2  # the sum of the ranks
    outs, expected = [], []
    for i in range(COLLECTIVES):
        x = tf.fill([4], float(i + r))
        sum_x = np.full(4, float(n * i + total))
        kind = i % KINDS
        if kind == 0:
            outs.append(hvd.allreduce(x, op=hvd.Sum))
            expected.append(sum_x)
        elif kind == 1:
            outs.append(hvd.allgather(tf.reshape(x, [1, 4])))
            rows = [np.full((1, 4), float(i + j)) for j in range(n)]
            expected.append(np.stack(rows) if stack else np.concatenate(rows))
        elif kind == 2:
            outs.append(hvd.reducescatter(tf.tile(x, [n]), op=hvd.Sum))
            expected.append(sum_x)
        elif kind == 3:
            outs.append(hvd.broadcast(x, root_rank=i % n))
            expected.append(np.full(4, float(i + i % n)))
        elif kind == 4:
            outs.append(hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1])
            expected.append(2 * sum_x)
        elif kind == 5:
            outs.append(hvd.grouped_allgather([tf.reshape(x, [1, 4]), x])[1])
            rows = [np.full(4, float(i + j)) for j in range(n)]
            expected.append(np.stack(rows) if stack else np.concatenate(rows))
        elif kind == 6:
            outs.append(hvd.grouped_reducescatter([tf.tile(x, [n]), x], op=hvd.Sum)[0])
            expected.append(sum_x)
        else:
            # Row j of this rank's input goes to rank j; rank r gets row r of everyone's.
            rows = tf.stack([x + 100.0 * j for j in range(n)])
            outs.append(hvd.alltoall(rows))
            expected.append(np.stack([np.full(4, float(i + j + 100 * r)) for j in range(n)]))
    return outs, expected


def gradients(r, n):
    """Gradients of allreduces and allgathers taken in the same graph, as Horovod defines
    them: a Sum allreduce's is the output gradient summed over the ranks (n); an
    allgather's, this rank's rows of the output gradient averaged over the ranks (1)."""
    xs = [tf.fill([3], float(r + k)) for k in range(8)]
    ys = [hvd.allreduce(x, op=hvd.Sum) if k % 2 else hvd.allgather(x)
          for k, x in enumerate(xs)]
    grads = tf.gradients([tf.reduce_sum(y) for y in ys], xs)
    return grads, [np.full(3, float(n if k % 2 else 1)) for k in range(len(xs))]


def in_a_session(r, n, threads):
    with tf.Graph().as_default():
        outs, expected = build(r, n)
        grads, grads_expected = gradients(r, n)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
        with tf.compat.v1.Session(config=config) as session:
            for step in range(3):
                got, got_grads = session.run([outs, grads])
                for k, (g, e) in enumerate(zip(got, expected)):
                    close(g, e, f"collective {k} of {len(outs)} in a session of "
                                f"{threads} inter-op threads, run {step}")
                for g, e in zip(got_grads, grads_expected):
                    close(g, e, f"gradient in a session of {threads} inter-op threads")


def functions_in_a_session(r, n):
    """tf.functions traced into a session's graph, each with its own collectives, side by
    side in one step of a session of one inter-op thread."""
    with tf.Graph().as_default():
        fns = [tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum)) for _ in range(20)]
        outs = [f(tf.fill([2], float(i + r))) for i, f in enumerate(fns)]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as session:
            for i, got in enumerate(session.run(outs)):
                close(got, np.full(2, float(n * i + n * (n - 1) // 2)),
                      f"tf.function {i} of 20 in a session of one inter-op thread")


def in_a_function(r, n):
    expected = []

    @tf.function
    def step():
        outs, expected[:] = build(r, n)
        return outs

    for call in range(2):
        got = step()
        for k, (g, e) in enumerate(zip(got, expected)):
            close(g, e, f"collective {k} of {len(got)} in a tf.function, call {call}")


def main():
    # The eager runtime (and the tf.function) gets one inter-op thread.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for threads in (1, 2):
        in_a_session(r, n, threads)
    functions_in_a_session(r, n)
    in_a_function(r, n)
    done(r)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

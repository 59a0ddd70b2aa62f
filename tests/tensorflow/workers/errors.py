"""Errors as the torch front-end gives them: use before init, bad dtypes and arguments, and
requests that disagree across ranks (every rank fails naming the tensor, eagerly and in
tf.function, and the job goes on)."""

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import close, done, keras, raises

NOT_INIT = "not been initialized"


def before_init():
    assert not hvd.is_initialized()
    for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.barrier, hvd.process_set_included_op):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn()
    t = tf.ones(2)
    for fn, args in ((hvd.allreduce, (t,)), (hvd.allgather, (t,)), (hvd.broadcast, (t, 0)),
                     (hvd.alltoall, (t,)), (hvd.reducescatter, (t,)),
                     (hvd.grouped_allreduce, ([t],))):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn(*args)


def bad_arguments(r, n):
    # int16 and uint16 are Horovod's (tests/tensorflow/workers/semantics.py sweeps them).
    for bad in (tf.zeros(2, tf.complex64), tf.zeros(2, tf.uint32), tf.constant(["a", "b"])):
        for fn, args in ((hvd.allreduce, ()), (hvd.allgather, ()), (hvd.broadcast, (0,)),
                         (hvd.alltoall, ()), (hvd.reducescatter, ())):
            with raises(TypeError, bad.dtype.name, "supported dtypes",
                        what=f"{fn.__name__} of {bad.dtype.name}"):
                fn(bad, *args)
            with raises(TypeError, bad.dtype.name, what=f"{fn.__name__} in a graph"):
                tf.function(lambda v, fn=fn, args=args: fn(v, *args))(bad)
    with raises(TypeError, "Adasum reduces floating-point tensors only", what="Adasum"):
        hvd.allreduce(tf.ones(2, dtype=tf.int32), op=hvd.Adasum)
    with raises(ValueError, "unknown reduce op", what="unknown op"):
        hvd.allreduce(tf.ones(2), op=17)
    with raises(ValueError, "gradient_predivide_factor", what="predivide with Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with raises(TypeError, "Keras optimizer", what="not an optimizer"):
        hvd.DistributedOptimizer(object())
    with raises(RuntimeError, "eager", what="broadcast_global_variables when eager"):
        hvd.broadcast_global_variables(0)
    # Bad arguments are Horovod's tf.errors.InvalidArgumentError, and ValueErrors still.
    for base in (ValueError, tf.errors.InvalidArgumentError):
        with raises(base, what="broadcast root out of range"):
            hvd.broadcast(tf.ones(2), n + 3)
        with raises(base, what="alltoall splits of the wrong length"):
            hvd.alltoall(tf.ones([4, 1]), splits=[1] * (n + 1))
    with raises(tf.errors.InvalidArgumentError, what="alltoall splits in a graph"):
        tf.function(lambda: hvd.alltoall(tf.ones([4, 1]), splits=[1] * (n + 1)))()
    # Splits that are not integers are refused by type on every rank, whatever their values
    # (they were cast to int32 before), eager and when a graph is built.
    garbage = 1e30 if r == 1 else 1.0
    for splits in ([garbage] * n, tf.fill([n], garbage), tf.ones([n], tf.float16)):
        with raises(TypeError, "alltoall splits must be integers", what=f"splits {splits}"):
            hvd.alltoall(tf.ones([n, 1]), splits=splits)
        with raises(TypeError, "alltoall splits must be integers", what="splits in a graph"):
            tf.function(lambda s=splits: hvd.alltoall(tf.ones([n, 1]), splits=s))()
    w = tf.Variable([1.0, 2.0])
    with raises(NotImplementedError, "Sum and Average only", what="gradient of a Max"):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(w, op=hvd.Max))
        tape.gradient(loss, w)


def mismatches(r, n):
    def expect(name, submit):
        # Horovod's tf.errors.FailedPreconditionError, and a HorovodInternalError still.
        for base in (hvd.HorovodInternalError, tf.errors.FailedPreconditionError):
            with raises(base, name, what=f"mismatch {name}"):
                submit()
        # In a graph the error arrives as TensorFlow's UnknownError (its py_function keeps
        # no other code: docs/tensorflow.md, "Differences from Horovod"), with the message.
        with raises(tf.errors.OpError, name, "MismatchError",
                    what=f"mismatch {name} in tf.function"):
            tf.function(submit)()
        close(hvd.allreduce(tf.ones(3), op=hvd.Sum, name=f"after.{name}"), np.full(3, n),
              f"allreduce after {name}")

    expect("mm.shape", lambda: hvd.allreduce(tf.ones([r + 1]), name="mm.shape"))
    expect("mm.dtype", lambda: hvd.allreduce(tf.ones(2, tf.float32 if r == 0 else tf.float64),
                                             name="mm.dtype"))
    expect("mm.op", lambda: hvd.allreduce(tf.ones(2), op=hvd.Sum if r == 0 else hvd.Max,
                                          name="mm.op"))
    expect("mm.root", lambda: hvd.broadcast(tf.ones(2), 0 if r == 0 else 1, name="mm.root"))
    expect("mm.gather", lambda: hvd.allgather(tf.ones(2, tf.int32 if r == 0 else tf.int64),
                                              name="mm.gather"))


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

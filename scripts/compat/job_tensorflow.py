"""One cell of the compatibility matrix for TensorFlow (scripts/compat-matrix.sh), run as
``perseusrun -np 2 python job_tensorflow.py`` in a fresh virtual environment that holds
the wheel and one TensorFlow release, with Keras 3 or (``TF_USE_LEGACY_KERAS=1``)
tf-keras. Every rank checks values (checks.py) and exits non-zero on the first that is
wrong:

- allreduce (Sum, Average, int64), allgather of unequal first dimensions, broadcast,
  alltoall with splits and reducescatter;
- broadcast_variables gives every rank rank 0's weights;
- hvd.DistributedGradientTape: 2 ranks on half the batch each give what one process
  gets on the whole batch;
- Keras: ``model.fit`` with hvd.DistributedOptimizer and
  BroadcastGlobalVariablesCallback gives the same, with tf.keras's Keras.
"""

import os
import sys

from checks import ROWS, STEPS, Collectives, data, rows, same, weights

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import perseus.tensorflow.horovod as hvd
import perseus.tensorflow.keras as hvd_keras
import tensorflow as tf
from perseus.tensorflow.keras_module import KERAS3, NAME, keras


def collectives(rank, n):
    c = Collectives(rank, n)
    t = tf.constant
    same(hvd.allreduce(t(c.reduce_in), op=hvd.Sum), c.reduce_sum, "allreduce Sum")
    same(hvd.allreduce(t(c.reduce_in)), c.reduce_average, "allreduce Average")
    same(hvd.allreduce(t(c.int_in), op=hvd.Sum), c.int_sum, "allreduce int64")
    same(hvd.allgather(t(c.gather_in)), c.gathered, "allgather of unequal first dimensions")
    same(hvd.broadcast(t(c.broadcast_in), root_rank=c.root), c.broadcast_out, "broadcast")
    received, splits = hvd.alltoall(t(c.alltoall_in), splits=c.alltoall_splits)
    same(received, c.alltoall_out, "alltoall")
    same(splits, c.alltoall_received_splits, "alltoall's received splits")
    same(hvd.reducescatter(t(c.scatter_in), op=hvd.Sum), c.scattered, "reducescatter")


def forward(v, x):
    return tf.matmul(tf.tanh(tf.matmul(x, v[0]) + v[1]), v[2]) + v[3]


def tape_steps(v, x, y, distributed):
    x, y = tf.constant(x), tf.constant(y)
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((forward(v, x) - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        for var, grad in zip(v, tape.gradient(loss, v)):
            var.assign_sub(0.1 * grad)


def gradient_tape(rank, n):
    v = [tf.Variable(w) for w in weights(100 + rank)]
    hvd.broadcast_variables(v, root_rank=0)
    for var, w in zip(v, weights(100)):
        same(var, w, "broadcast_variables")
    x, y = data(n)
    tape_steps(v, x[rows(rank)], y[rows(rank)], distributed=True)
    ref = [tf.Variable(w) for w in weights(100)]
    tape_steps(ref, x, y, distributed=False)
    for var, want in zip(v, ref):
        same(var, want.numpy(), "DistributedGradientTape after training")


def keras_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.set_weights(weights(100))
    return model


def keras_fit(rank, n):
    x, y = data(n)
    # Horovod's callback broadcasts after the first batch: the ranks start equal here so
    # that the first step's averaged gradient is the whole batch's.
    model = keras_model()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse")
    model.fit(x[rows(rank)], y[rows(rank)], batch_size=ROWS, epochs=STEPS, shuffle=False,
              verbose=0, callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = keras_model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=ROWS * n, epochs=STEPS, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        same(got, want, f"Keras fit ({NAME}) after training")


def main():
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    assert n >= 2, "run me under perseusrun -np 2"
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")
    assert KERAS3 != legacy, f"TF_USE_LEGACY_KERAS={legacy} but tf.keras is {NAME}"
    collectives(rank, n)
    gradient_tape(rank, n)
    keras_fit(rank, n)
    hvd.shutdown()
    print(f"compat ok: rank {rank} of {n}, tensorflow {tf.__version__}, {NAME}, "
          f"Python {sys.version.split()[0]}", flush=True)


if __name__ == "__main__":
    main()

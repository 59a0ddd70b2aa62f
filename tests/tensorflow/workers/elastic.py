"""Elastic TensorFlow jobs (perseusrun --min-np). Every rank must end with the model of
exactly 12 steps of a scalar model, whatever failed on the way.

``elastic.py`` (Keras): ``model.fit``, 4 epochs of 3 batches, under ``hvd.elastic.run``
with KerasState and the state callbacks (committing at each epoch's end). The worker
with elastic id FAIL_ID exits with status 3 at epoch 1, batch 1 of its first round; the
others go back to the end of epoch 0 and go on.

``elastic.py session``: a tf.compat.v1 graph and session, the v1 DistributedOptimizer,
and ``TensorFlowState(session=...)`` committed every 4 steps. The worker FAIL_ID exits
before step 6 of its first round; the others go back to step 4's commit (their
variables too: without that they would end with 14 steps' model)
"""

import os
import sys

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import keras
import numpy as np
import perseus.tensorflow.horovod as hvd_tf
import perseus.tensorflow.keras as hvd
import tensorflow as tf
from _tfhelpers import done

EPOCHS, BATCHES, LR = 4, 3, 0.5


class FailOnce(keras.callbacks.Callback):
    def __init__(self, state, me):
        super().__init__()
        self.state, self.me, self.armed = state, me, True

    def on_train_batch_begin(self, batch, logs=None):
        if (self.armed and self.me == os.environ["FAIL_ID"] and self.state.epoch == 1
                and batch == 1):
            print(f"worker {self.me} fails at epoch 1 batch 1", flush=True)
            os._exit(3)


def session_job(me):
    steps, fail_at = EPOCHS * BATCHES, 6
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", [1], initializer=tf.compat.v1.zeros_initializer())
        opt = hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
        train_op = opt.minimize(tf.reduce_sum(w))  # every rank's gradient is 1
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        state = hvd_tf.elastic.TensorFlowState(session=sess, step=0)
        first_round = [True]
        state.register_reset_callbacks([lambda: first_round.__setitem__(0, False)])

        @hvd_tf.elastic.run
        def train(state):
            while state.step < steps:
                if first_round[0] and me == os.environ["FAIL_ID"] and state.step == fail_at:
                    print(f"worker {me} fails at step {fail_at}", flush=True)
                    os._exit(3)
                sess.run(train_op)
                state.step += 1
                if state.step % 4 == 0:
                    state.commit()

        train(state)
        return float(sess.run(w)[0])


def main():
    hvd.init()
    me = os.environ["PERSEUS_ELASTIC_ID"]
    if sys.argv[1:] == ["session"]:
        w = session_job(me)
        assert abs(w + EPOCHS * BATCHES * LR) < 1e-5, f"worker {me}: w = {w}"
        assert hvd.allgather_object(w) == [w] * hvd.size()
        print(f"worker {me} rank {hvd.rank()} of {hvd.size()}: w = {w}", flush=True)
        done(hvd.rank())
        return
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    # the mean of the prediction w * 1: every rank's gradient is 1, and so is the average
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)),
                  loss=lambda y, p: keras.ops.mean(p))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    fail = FailOnce(state, me)
    state.register_reset_callbacks([lambda: setattr(fail, "armed", False)])
    callbacks = [fail, hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=100)]
    x, y = np.ones((BATCHES, 1), "float32"), np.zeros((BATCHES, 1), "float32")

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, batch_size=1, initial_epoch=state.epoch, epochs=EPOCHS,
                  callbacks=callbacks, verbose=0)

    train(state)
    w = float(model.get_weights()[0][0, 0])
    assert abs(w + EPOCHS * BATCHES * LR) < 1e-5, f"worker {me}: w = {w}"
    assert state.epoch == EPOCHS and state.batch == 0, (state.epoch, state.batch)
    assert hvd.allgather_object(w) == [w] * hvd.size()
    print(f"worker {me} rank {hvd.rank()} of {hvd.size()}: w = {w}", flush=True)
    done(hvd.rank())


if __name__ == "__main__":
    main()

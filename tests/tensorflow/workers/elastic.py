"""Elastic TensorFlow jobs (perseusrun --min-np). Every rank must end with the model of
exactly 12 steps of a scalar model, whatever failed or joined on the way.

``elastic.py`` (Keras): ``model.fit``, 4 epochs of 3 batches, under ``hvd.elastic.run``
with KerasState and the state callbacks. Set in the environment:

- STYLE: ``perseus`` resumes with ``fit(initial_epoch=state.epoch, epochs=4)``,
  ``horovod`` with Horovod's ``fit(epochs=4 - state.epoch)``;
- BPC: the CommitStateCallback's batches_per_commit (default 100: epochs' ends only);
- FAIL_ID and FAIL_AT (``epoch,batch``, default ``1,1``): that worker exits with status
  3 before that batch of its first round; the others go back to their last commit;
- LEGACY_OPTIMIZER: under Keras 2, train with ``tf.keras.optimizers.legacy.SGD``;
- GROW_FILE (the discovery script's file) and GROW_AT: rank 0 adds host 127.0.0.2:1
  after that many steps; the job takes in its worker at the next commit. Each batch of
  the first round sleeps STEP_SLEEP seconds, to give the launcher the time.

``state.sizes`` (committed with the rest) holds the number of ranks at each step that
counts; each rank prints it.

``elastic.py session``: a tf.compat.v1 graph and session, the v1 DistributedOptimizer,
and ``TensorFlowState(session=...)`` committed every 4 steps. The worker FAIL_ID exits
before step 6 of its first round; the others go back to step 4's commit (their
variables too: without that they would end with 14 steps' model)
"""

import os
import sys
import time

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd_tf
import perseus.tensorflow.keras as hvd
import tensorflow as tf
from _tfhelpers import done, keras

EPOCHS, BATCHES, LR = 4, 3, 0.5


class Events(keras.callbacks.Callback):
    """The test's own doings at each batch: fail once, grow the job once, sleep (first
    round only), and record the number of ranks of each step in the state."""

    def __init__(self, state, me):
        super().__init__()
        self.state, self.me, self.first_round = state, me, True
        self.fail_at = tuple(int(v) for v in os.environ.get("FAIL_AT", "1,1").split(","))
        self.grow_at = int(os.environ.get("GROW_AT", "0"))

    def on_train_batch_begin(self, batch, logs=None):
        if not self.first_round:
            return
        if self.me == os.environ.get("FAIL_ID") and (self.state.epoch, batch) == self.fail_at:
            print(f"worker {self.me} fails at epoch {self.state.epoch} batch {batch}",
                  flush=True)
            os._exit(3)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))

    def on_train_batch_end(self, batch, logs=None):
        self.state.sizes = self.state.sizes + [hvd.size()]
        if (self.first_round and self.grow_at and hvd.rank() == 0
                and len(self.state.sizes) == self.grow_at):
            with open(os.environ["GROW_FILE"], "a") as f:
                f.write("127.0.0.2:1\n")
            print(f"worker {self.me} adds host 127.0.0.2 after {self.grow_at} steps",
                  flush=True)


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
    style = os.environ.get("STYLE", "perseus")
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    # the mean of the prediction w * 1: every rank's gradient is 1, and so is the average
    sgd = (keras.optimizers.legacy.SGD if os.environ.get("LEGACY_OPTIMIZER")
           else keras.optimizers.SGD)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(LR)),
                  loss=lambda y, p: tf.reduce_mean(p))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0, sizes=[])
    events = Events(state, me)
    state.register_reset_callbacks([lambda: setattr(events, "first_round", False)])
    # Horovod's example's order; the record of sizes goes before the commit.
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), events,
                 hvd.elastic.CommitStateCallback(
                     state, batches_per_commit=int(os.environ.get("BPC", "100")))]
    x, y = np.ones((BATCHES, 1), "float32"), np.zeros((BATCHES, 1), "float32")

    @hvd.elastic.run
    def train(state):
        if style == "horovod":
            model.fit(x, y, batch_size=1, epochs=EPOCHS - state.epoch, callbacks=callbacks,
                      verbose=0)
        else:
            model.fit(x, y, batch_size=1, initial_epoch=state.epoch, epochs=EPOCHS,
                      callbacks=callbacks, verbose=0)

    train(state)
    w = float(model.get_weights()[0][0, 0])
    print(f"worker {me} rank {hvd.rank()} sizes {state.sizes}", flush=True)
    assert abs(w + EPOCHS * BATCHES * LR) < 1e-5, f"worker {me}: w = {w}"
    assert len(state.sizes) == EPOCHS * BATCHES, state.sizes
    assert state.epoch == EPOCHS and state.batch == 0, (state.epoch, state.batch)
    assert hvd.allgather_object((w, state.sizes)) == [(w, state.sizes)] * hvd.size()
    print(f"worker {me} rank {hvd.rank()} of {hvd.size()}: w = {w}", flush=True)
    done(hvd.rank())


if __name__ == "__main__":
    main()

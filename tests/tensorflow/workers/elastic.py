"""An elastic Keras job (perseusrun --min-np): ``model.fit`` of a scalar model, 4 epochs
of 3 batches, under ``hvd.elastic.run`` with KerasState and the state callbacks
(committing at each epoch's end). The worker with elastic id FAIL_ID exits with
status 3 at epoch 1, batch 1 of its first round; the others go back to the end of
epoch 0 and go on. Every rank must end with the model of exactly 12 steps."""

import os

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import keras
import numpy as np
import perseus.tensorflow.keras as hvd
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


def main():
    hvd.init()
    me = os.environ["PERSEUS_ELASTIC_ID"]
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

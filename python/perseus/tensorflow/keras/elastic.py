"""``hvd.elastic`` for Keras (Horovod 0.28's ``horovod.tensorflow.keras.elastic``):
``model.fit`` that survives lost workers and takes in new ones (docs/elastic.md).

Typical use::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=epochs, callbacks=callbacks)

    train(state)
"""

import keras

from perseus.tensorflow.horovod.elastic import (
    ObjectState,
    State,
    TensorFlowKerasState,
    run,
)

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and picklable attributes kept across resets (see
    :class:`perseus.tensorflow.horovod.elastic.TensorFlowKerasState`)."""


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of each epoch
    (and so checks for host changes there). Place it after the ``Update*StateCallback``
    objects, so that an epoch's commit holds the epoch's count: ``fit`` starts an epoch
    from its first batch again, so a job that resumes at an epoch's start (commits at
    epochs' ends only, with a large ``batches_per_commit``) repeats no step."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self._left = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left <= 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self._left = self.batches_per_commit


class _StateCallback(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state


class UpdateBatchStateCallback(_StateCallback):
    """Keeps ``state.batch`` at the number of batches done in the epoch (0 at its end)."""

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_StateCallback):
    """Keeps ``state.epoch`` at the number of epochs done, for ``fit(initial_epoch=)``."""

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1

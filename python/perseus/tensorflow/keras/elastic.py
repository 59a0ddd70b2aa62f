"""``hvd.elastic`` for Keras (Horovod 0.28's ``horovod.tensorflow.keras.elastic``):
``model.fit`` that survives lost workers and takes in new ones (docs/elastic.md).

Typical use (either ``fit`` call works)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)  # Horovod's
        # or: model.fit(x, y, initial_epoch=state.epoch, epochs=epochs, ...)

    train(state)
"""

from perseus.tensorflow.horovod.elastic import (
    ObjectState,
    State,
    TensorFlowKerasState,
    run,
)
from perseus.tensorflow.keras_module import keras

__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and picklable attributes kept across resets (see
    :class:`perseus.tensorflow.horovod.elastic.TensorFlowKerasState`)."""


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches of an epoch and at the end
    of each epoch (and so checks for host changes there). Place it after the
    ``Update*StateCallback`` objects, so that a commit holds the counts of the batches
    and epochs it follows.

    The count starts again at each ``fit`` (each round of the job) and each epoch, so
    that the ranks of a round, old and new, commit at the same batches: a commit is a
    collective (the check for host changes).
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self._left = batches_per_commit

    def _commit(self):
        # Counted afresh before committing: commit() may raise HostsUpdatedInterrupt.
        self._left = self.batches_per_commit
        self.state.commit()

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left <= 0:
            self._commit()

    def on_epoch_end(self, epoch, logs=None):
        self._commit()


class _StateCallback(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state


class UpdateBatchStateCallback(_StateCallback):
    """Keeps ``state.batch`` at the number of batches done in the current epoch (0 at
    its end), and shortens the epoch a ``fit`` resumes in the middle of.

    An epoch that begins with ``state.batch`` = k > 0 (restored from a commit made after
    k of its batches) ends after its remaining ``steps - k`` batches, so that no step
    is done twice; ``steps`` is what ``fit`` reports (``steps_per_epoch``, or the
    batches of sized data). Keras lets a callback end an epoch only through
    ``model.stop_training``: it is set after the epoch's last batch and cleared again
    in this callback's ``on_epoch_end``, so put callbacks that stop the training at an
    epoch's end (``EarlyStopping``) after this one. Horovod shortens the epoch by
    ``params["steps"]``, which neither Keras 3 nor tf_keras reads.

    Horovod stores the index of the last batch done (one less than this count).
    """

    def __init__(self, state):
        super().__init__(state)
        self._done_before = 0  # batches of this epoch done before this fit
        self._stopped = False  # whether this callback set model.stop_training

    def on_train_begin(self, logs=None):
        self._done_before, self._stopped = 0, False

    def on_epoch_begin(self, epoch, logs=None):
        self._done_before = int(self.state.batch or 0)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._done_before + batch + 1
        steps = (self.params or {}).get("steps")
        if (self._done_before and steps and self.state.batch >= steps
                and not self.model.stop_training):
            self.model.stop_training = True
            self._stopped = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._done_before = 0
        if self._stopped:
            self.model.stop_training = False
            self._stopped = False


class UpdateEpochStateCallback(_StateCallback):
    """Keeps ``state.epoch`` at the number of epochs done, counted across resets.

    Both ways of resuming work: Horovod's ``fit(epochs=epochs - state.epoch)``, whose
    epochs Keras numbers from 0 again, and ``fit(initial_epoch=state.epoch,
    epochs=epochs)``. The first epoch of each ``fit`` is taken to be epoch
    ``state.epoch`` of the job: the difference between the two numbers is added to
    Keras' epoch.
    """

    def __init__(self, state):
        super().__init__(state)
        self._offset = None  # state.epoch - Keras' epoch, set by each fit's first epoch

    def on_train_begin(self, logs=None):
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:
            self._offset = int(self.state.epoch or 0) - epoch

    def on_epoch_end(self, epoch, logs=None):
        offset = self._offset if self._offset is not None else 0
        self.state.epoch = offset + epoch + 1

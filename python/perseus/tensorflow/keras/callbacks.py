"""Keras callbacks of Horovod 0.28 (``hvd.callbacks`` / ``hvd.keras.callbacks``), subclasses
of ``tf.keras``'s ``Callback`` (Keras 3 or Keras 2: perseus.tensorflow.keras_module)."""

import numpy as np
import tensorflow as tf

from perseus.common.ops import Average
from perseus.tensorflow.horovod.functions import broadcast_variables
from perseus.tensorflow.horovod.mpi_ops import allreduce, rank, size
from perseus.tensorflow.keras_module import (
    KERAS3,
    is_variable,
    keras,
    optimizer_variables,
    to_float,
)

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Overwrites the model's and the optimizer's variables with ``root_rank``'s before
    the first step, so that every rank starts from the same state (also after loading a
    checkpoint on the root only). ``device`` is accepted for compatibility.

    ``local_variables`` (a variable or a collection of them: ``tf.Variable`` or Keras 3's
    ``keras.Variable``) are left out of the broadcast: each rank keeps its own value, as
    for the local layers of a model-parallel job. Only the variables named are left
    out; name the optimizer's slots of a local variable too if they should stay.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self.local_variables = _variable_list(local_variables)
        self._local_ids = set()
        for var in self.local_variables:
            self._local_ids.update(_variable_ids(var))

    def _is_local(self, var):
        return not self._local_ids.isdisjoint(_variable_ids(var))

    def _broadcast(self):
        variables = list(self.model.variables)
        variables += optimizer_variables(getattr(self.model, "optimizer", None))
        if self._local_ids:
            variables = [v for v in variables if not self._is_local(v)]
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        """Broadcast, when fit has built the model already (Keras 3 does before this;
        Keras 2 has when the model has an input shape)."""
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        """Broadcast after the first batch when the model was only built by it."""
        if not self.broadcast_done:
            self._broadcast()


def _is_variable(obj):
    return is_variable(obj)


def _variable_list(variables):
    """``local_variables`` as a list of variables (ValueError for anything else)."""
    if variables is None:
        return []
    if _is_variable(variables):
        return [variables]
    try:
        variables = list(variables)
    except TypeError:
        variables = [variables]
    bad = [type(v).__name__ for v in variables if not _is_variable(v)]
    if bad:
        raise ValueError(f"local_variables must be variables (tf.Variable or keras.Variable), "
                         f"got {', '.join(sorted(set(bad)))}")
    return variables


def _variable_ids(var):
    """The ids a variable is known by: a Keras variable's and its TensorFlow variable's."""
    ids = {id(var)}
    if KERAS3 and isinstance(var, keras.Variable):
        inner = getattr(var, "value", None)
        if isinstance(inner, tf.Variable):
            ids.add(id(inner))
    return ids


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics (loss, accuracy, validation metrics) by their average
    over the ranks. Put it before callbacks that read them (checkpoints, schedules)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        """Average every numeric entry of ``logs`` over the ranks."""
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                      isinstance(np.asarray(v).item(), (int, float)))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = allreduce(values, op=Average, name="MetricAverageCallback").numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the optimizer's learning rate to ``initial_lr * multiplier(epoch)`` for epochs
    in ``[start_epoch, end_epoch)``; outside them the rate is left as it is.

    ``multiplier`` is a function of the epoch, or a number ``m`` for exponential decay:
    ``m ** (epoch - start_epoch)``. With ``staircase`` the rate changes at epoch starts;
    otherwise at every batch, with the fractional epoch ``epoch + batch /
    steps_per_epoch`` (``steps_per_epoch`` defaults to the steps ``fit`` reports, read
    when each ``fit`` begins).

    ``momentum_correction`` (Goyal et al.), as Horovod's: when the rate changes, the
    momentum of the batch that follows is multiplied by ``new_lr / old_lr``, and
    restored when that batch ends. It acts where the optimizer keeps its momentum in a
    variable that the training step reads: Keras 2's ``tf.keras.optimizers.legacy``
    optimizers. Keras 3's and Keras 2's ``tf.keras.optimizers`` compile the momentum
    into the training step as a constant, so there it has no effect.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__}: initial_lr is required (the learning "
                             f"rate the schedule multiplies)")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            base = float(multiplier)
            self.multiplier = lambda epoch: base ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self._steps = steps_per_epoch  # this fit's steps per epoch
        self._restore_momentum = None  # (variable, value) until the batch ends

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _momentum_variable(self):
        """The optimizer's momentum if a variable holds it (Keras 2's legacy optimizers
        create it on first use), else None."""
        opt = self.model.optimizer
        opt = getattr(opt, "inner_optimizer", None) or opt
        momentum = getattr(opt, "momentum", None)
        return momentum if isinstance(momentum, tf.Variable) else None

    def _set_lr(self, epoch):
        opt = self.model.optimizer
        new_lr = self.initial_lr * float(self.multiplier(epoch))
        momentum = self._momentum_variable() if self.momentum_correction else None
        if momentum is not None:
            old_lr = to_float(opt.learning_rate)
            self._restore_momentum_if_needed()
            if old_lr != 0:
                value = float(momentum.numpy())
                self._restore_momentum = (momentum, value)
                momentum.assign(value * new_lr / old_lr)
        opt.learning_rate = new_lr

    def _restore_momentum_if_needed(self):
        if self._restore_momentum is not None:
            momentum, value = self._restore_momentum
            momentum.assign(value)
            self._restore_momentum = None

    def on_train_begin(self, logs=None):
        """Smooth schedules: the steps per epoch, given or as ``fit`` reports them."""
        self._steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.staircase and not self._steps:
            raise ValueError(f"{type(self).__name__} with staircase=False needs "
                             f"steps_per_epoch (fit did not report the steps per epoch)")

    def on_epoch_begin(self, epoch, logs=None):
        """Staircase: the epoch's rate."""
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set_lr(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        """Smooth schedules: the rate at this fraction of the epoch."""
        if self.staircase or self.current_epoch is None or not self._in_range(self.current_epoch):
            return
        self._set_lr(self.current_epoch + batch / self._steps)

    def on_train_batch_end(self, batch, logs=None):
        """The momentum as it was before a correction."""
        self._restore_momentum_if_needed()

    def on_train_end(self, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        """Report the rate as ``lr`` in the logs."""
        if logs is not None:
            logs["lr"] = to_float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s warmup: the rate grows from ``initial_lr / size`` to ``initial_lr``
    over ``warmup_epochs`` epochs, batch by batch, where ``initial_lr`` is the rate
    already scaled by the number of ranks. As in Horovod, the batch that ends an epoch
    runs with that epoch's end rate: batch ``b`` of epoch ``e`` uses
    ``initial_lr / size * (1 + (size - 1) * (e + (b + 1) / steps_per_epoch) /
    warmup_epochs)``, so the warmup's last batch uses ``initial_lr``. ``size`` is the
    number of ranks at that batch (it changes when an elastic job re-forms).
    ``verbose``: rank 0 says when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            n = size()
            epoch += 1.0 / self._steps
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        """At the end of the warmup, set exactly ``initial_lr`` (rank 0 says so if
        verbose)."""
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.", flush=True)
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps the best model only (``save_best_only=True``) and
    writes it on rank 0 only: the other ranks never touch the file.

    ``monitor`` and ``mode`` (``"auto"``, ``"min"``, ``"max"``) choose what "best"
    means, as in Keras; put :class:`MetricAverageCallback` before this callback to
    judge on the ranks' average. Horovod's signature has no path: give it with
    ``filepath=`` or set ``.filepath`` before ``fit`` (Keras 3: a ``.keras`` or ``.h5``
    file, or ``.weights.h5`` with ``save_weights_only``; Keras 2: any path its
    ``ModelCheckpoint`` takes).
    """

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", *,
                 filepath=None, save_weights_only=False):
        # Keras checks the path's extension at construction; one set later is checked
        # when training begins.
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder if filepath is None else filepath,
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        """Check the path (on every rank, so that all of them stop alike)."""
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no file to write: pass filepath= or "
                             "set its .filepath before fit")
        path = str(self.filepath)
        exts = (".weights.h5",) if self.save_weights_only else (".keras", ".h5")
        if KERAS3 and not path.endswith(exts):
            raise ValueError(f"BestModelCheckpoint's filepath must end in {' or '.join(exts)}"
                             f"{' (save_weights_only=True)' if self.save_weights_only else ''},"
                             f" got {path!r}")
        self.filepath = path
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        """Rank 0: save when ``save_freq`` batches have passed and the model improved."""
        if rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        """Rank 0: save at the end of an epoch where the model improved."""
        if rank() == 0:
            super().on_epoch_end(epoch, logs)

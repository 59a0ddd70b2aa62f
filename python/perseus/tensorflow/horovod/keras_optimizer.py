"""Distributed Keras optimizers (perseus.tensorflow.keras.DistributedOptimizer, and
perseus.tensorflow.horovod.DistributedOptimizer given a Keras optimizer): the optimizer's
class gets a mixin that reduces the gradients where the Keras version in use aggregates
them, and its configuration is copied into an instance of that class."""

import tensorflow as tf

from perseus.tensorflow.horovod.aggregation import LocalAggregation, passes_per_step
from perseus.tensorflow.horovod.gradients import (
    GradientReducer,
    LocalVariables,
    reduce_except_local,
)
from perseus.tensorflow.keras_module import KERAS3 as _KERAS3
from perseus.tensorflow.keras_module import keras as _keras
from perseus.tensorflow.keras_module import other_keras_hint as _other_keras_hint

_classes = {}  # optimizer class -> its distributed subclass


class DistributedKerasOptimizer:
    """What every distributed Keras optimizer has (see :func:`wrap`)."""

    #: What perseus.tensorflow.keras.hooks looks for (it does not import this module).
    _perseus_distributed = True

    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced (only divided by the set's size
        when ``scale_local_gradients``). Register it on every rank, before training."""
        self._perseus_local.add(var, "register_local_var")

    def _perseus_reduce(self, grads, variables):
        return reduce_except_local(self._perseus_reducer, grads, variables,
                                   self._perseus_local, self._perseus_scale_local)


class _Keras3Optimizer(DistributedKerasOptimizer):
    """Mixed into a Keras 3 optimizer's class."""

    def apply(self, grads, trainable_variables=None):
        """Average the gradients over the ranks, then apply them (every
        ``backward_passes_per_step``-th call when passes are accumulated)."""
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if self._perseus_passes == 1:
            variables = (trainable_variables if trainable_variables is not None
                         else list(self._trainable_variables))
            grads = self._perseus_reduce(list(grads), variables)
        return super().apply(grads, trainable_variables)

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Remembered for _clip_gradients, which Keras calls without the variables (set
        # past Keras' attribute tracking, which would take them for optimizer state).
        object.__setattr__(self, "_perseus_step_variables", list(trainable_variables))
        return super()._backend_apply_gradients(grads, trainable_variables)

    def _clip_gradients(self, grads):
        # With gradient_accumulation_steps (backward_passes_per_step > 1) Keras calls this
        # on update steps only, with the passes' mean: reduce that.
        if self._perseus_passes > 1:
            variables = getattr(self, "_perseus_step_variables", None)
            if variables is None or len(variables) != len(grads):
                if len(self._perseus_local):
                    raise RuntimeError("cannot tell the local variables' gradients apart: "
                                       "Keras passed gradients without their variables")
                variables = None
            grads = self._perseus_reduce(list(grads), variables)
            if not self._perseus_average:
                scale = float(self._perseus_passes)
                grads = [g if g is None else g * tf.cast(scale, g.dtype) for g in grads]
        return super()._clip_gradients(grads)


class _Keras2Base(DistributedKerasOptimizer):
    """The Keras 2 (tf_keras) part shared by both kinds of its optimizers: the gradients
    are reduced where Keras 2 aggregates them across replicas, which ``apply_gradients``
    does before clipping and before the update, and which a ``LossScaleOptimizer`` does
    before its check for overflow (so that every rank skips a step, or none does). With
    ``backward_passes_per_step`` > 1 they are summed locally and reduced every that
    many calls, and ``apply_gradients`` updates on those calls only (the others count
    in ``iterations``, as Horovod's aggregation does)."""

    def _perseus_aggregate(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        aggregation = self._perseus_aggregation
        if aggregation is None:
            reduced = self._perseus_reduce(grads, variables)
        else:
            reduced = aggregation.reduce(grads, lambda gs: self._perseus_reduce(gs, variables))
        return list(zip(reduced, variables))

    def _perseus_gate(self, apply_fn):
        """``apply_fn`` on update calls; the others add one to ``iterations``."""
        return self._perseus_aggregation.apply(
            apply_fn, lambda: self.iterations.assign_add(1, read_value=False))


class _Keras2Optimizer(_Keras2Base):
    """Mixed into the class of a Keras 2 ``tf.keras.optimizers.Optimizer``."""

    def aggregate_gradients(self, grads_and_vars):
        """The gradients averaged over the ranks (Keras 2's cross-replica aggregation)."""
        return self._perseus_aggregate(grads_and_vars)

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        **kwargs):
        """Reduce the gradients (``aggregate_gradients``), then apply them (every
        ``backward_passes_per_step``-th call when passes are accumulated)."""
        if self._perseus_aggregation is None:
            return super().apply_gradients(
                grads_and_vars, name=name,
                skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        grads_and_vars = list(grads_and_vars)
        if not skip_gradients_aggregation and kwargs.pop("experimental_aggregate_gradients",
                                                         True):
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        kwargs.pop("experimental_aggregate_gradients", None)
        apply = super().apply_gradients
        return self._perseus_gate(lambda: apply(grads_and_vars, name=name,
                                                skip_gradients_aggregation=True, **kwargs))


class _Keras2LegacyOptimizer(_Keras2Base):
    """Mixed into the class of a Keras 2 ``tf.keras.optimizers.legacy.Optimizer``."""

    def _aggregate_gradients(self, grads_and_vars):
        return self._perseus_aggregate(grads_and_vars)

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """Reduce the gradients (``_aggregate_gradients``), then apply them (every
        ``backward_passes_per_step``-th call when passes are accumulated)."""
        if self._perseus_aggregation is None:
            return super().apply_gradients(grads_and_vars, name, experimental_aggregate_gradients)
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if experimental_aggregate_gradients:
            grads_and_vars = self._transform_unaggregated_gradients(grads_and_vars)
            grads_and_vars = self._aggregate_gradients(grads_and_vars)
        apply = super().apply_gradients
        return self._perseus_gate(lambda: apply(grads_and_vars, name, False))


def optimizer_classes():
    """The Keras optimizer classes DistributedOptimizer wraps."""
    legacy = None if _KERAS3 else getattr(_keras.optimizers, "legacy", None)
    return (_keras.optimizers.Optimizer,) + (() if legacy is None else (legacy.Optimizer,))


def distributed_class(base):
    cls = _classes.get(base)
    if cls is None:
        if _KERAS3:
            mixin = _Keras3Optimizer
        elif hasattr(base, "aggregate_gradients"):  # tf.keras.optimizers (Keras 2.11+)
            mixin = _Keras2Optimizer
        else:  # OptimizerV2: tf.keras.optimizers.legacy (before 2.11: tf.keras.optimizers)
            mixin = _Keras2LegacyOptimizer
        # Same name and module as the base: saved models name the plain optimizer.
        cls = type(base.__name__, (mixin, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def attach(optimizer, reducer, passes, average, scale_local=True):
    optimizer._perseus_reducer = reducer
    optimizer._perseus_passes = passes
    optimizer._perseus_average = average
    optimizer._perseus_local = LocalVariables()
    optimizer._perseus_scale_local = bool(scale_local)
    if not _KERAS3:  # Keras 3 accumulates itself (gradient_accumulation_steps)
        optimizer._perseus_aggregation = (LocalAggregation(passes, average) if passes > 1
                                          else None)


def wrap(optimizer, name, compression, sparse_as_dense, gradient_predivide_factor, op,
         backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
         process_set, scale_local_gradients):
    """A copy of Keras ``optimizer`` (same class and configuration, fresh state) whose
    updates use gradients reduced over ``process_set``; the arguments are
    DistributedOptimizer's, which its callers checked (``check_common``)."""
    if not isinstance(optimizer, optimizer_classes()):
        raise TypeError(f"expected a Keras optimizer or a tf.compat.v1.train.Optimizer, got "
                        f"{type(optimizer).__name__}{_other_keras_hint(optimizer)}")
    from perseus.tensorflow.keras import hooks  # a module of Keras's own, loaded late

    hooks.install()  # no XLA, and loss scaling decided alike on every rank
    passes, average = passes_per_step(backward_passes_per_step, average_aggregated_gradients)
    config = optimizer.get_config()
    if passes > 1 and _KERAS3:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("the optimizer already accumulates gradients "
                             "(gradient_accumulation_steps); leave backward_passes_per_step "
                             "at 1")
        config["gradient_accumulation_steps"] = passes
    if name is not None:
        config["name"] = name
    wrapped = distributed_class(type(optimizer)).from_config(config)
    reducer = GradientReducer("DistributedOptimizer", compression, op, gradient_predivide_factor,
                              sparse_as_dense, process_set)
    attach(wrapped, reducer, passes, average, scale_local_gradients)
    return wrapped

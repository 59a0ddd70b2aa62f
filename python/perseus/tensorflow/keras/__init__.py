"""Horovod 0.28's ``horovod.tensorflow.keras`` on Perseus, for the Keras that ``tf.keras``
is: Keras 3 (TensorFlow 2.16 and later), or Keras 2 (``tf_keras`` under
``TF_USE_LEGACY_KERAS=1``; perseus.tensorflow.keras_module chooses)::

    import perseus.tensorflow.keras as hvd      # or: perseus.tensorflow.horovod.keras
    hvd.init()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

A wrapped optimizer is an instance of a subclass of the optimizer's class whose updates
use the gradients averaged over the ranks. Keras 3: its ``apply`` (and so
``apply_gradients`` and ``model.fit``) reduces them first. Keras 2: the optimizer's own
aggregation step reduces them (``aggregate_gradients`` of ``tf.keras.optimizers``,
``_aggregate_gradients`` of ``tf.keras.optimizers.legacy``), which ``apply_gradients``
(and so ``minimize`` and ``model.fit``) runs before clipping and which a
``LossScaleOptimizer`` runs before its check for overflow. XLA-compiled code cannot
call the core: a model compiled with a wrapped optimizer trains with
``jit_compile=False``, whatever Keras would choose (perseus.tensorflow.keras.hooks).
"""

import tensorflow as tf

from perseus.common.ops import Average
from perseus.common.process_sets import global_process_set
from perseus.tensorflow import horovod as _hvd
from perseus.tensorflow.horovod import (  # noqa: F401 - re-exported
    Adasum,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from perseus.tensorflow.horovod import (
    global_process_set as _global,
)
from perseus.tensorflow.horovod.gradients import (
    GradientReducer,
    LocalVariables,
    reduce_except_local,
)
from perseus.tensorflow.horovod.optimizer import (
    LocalAggregation,
    _check_common,
    local_layer_variables,
    passes_per_step,
)
from perseus.tensorflow.keras import (
    callbacks,  # noqa: F401 - hvd.callbacks
    elastic,  # noqa: F401 - hvd.elastic
)
from perseus.tensorflow.keras import hooks as _hooks
from perseus.tensorflow.keras_module import KERAS3 as _KERAS3
from perseus.tensorflow.keras_module import keras as _keras
from perseus.tensorflow.keras_module import other_keras_hint as _other_keras_hint

_LegacyOptimizer = tf.compat.v1.train.Optimizer
_classes = {}  # optimizer class -> its distributed subclass


class _DistributedKerasOptimizer:
    """What every distributed Keras optimizer has (see :func:`DistributedOptimizer`)."""

    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced (only divided by the set's size
        when ``scale_local_gradients``). Register it on every rank, before training."""
        self._perseus_local.add(var, "register_local_var")

    def _perseus_reduce(self, grads, variables):
        return reduce_except_local(self._perseus_reducer, grads, variables,
                                   self._perseus_local, self._perseus_scale_local)


class _Keras3Optimizer(_DistributedKerasOptimizer):
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


class _Keras2Base(_DistributedKerasOptimizer):
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


def _optimizer_classes():
    """The Keras optimizer classes DistributedOptimizer wraps."""
    legacy = None if _KERAS3 else getattr(_keras.optimizers, "legacy", None)
    return (_keras.optimizers.Optimizer,) + (() if legacy is None else (legacy.Optimizer,))


def _distributed_class(base):
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


def _attach(optimizer, reducer, passes, average, scale_local=True):
    optimizer._perseus_reducer = reducer
    optimizer._perseus_passes = passes
    optimizer._perseus_average = average
    optimizer._perseus_local = LocalVariables()
    optimizer._perseus_scale_local = bool(scale_local)
    if not _KERAS3:  # Keras 3 accumulates itself (gradient_accumulation_steps)
        optimizer._perseus_aggregation = (LocalAggregation(passes, average) if passes > 1
                                          else None)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of Keras ``optimizer`` (same class and configuration, fresh state) whose
    updates use gradients averaged over the ranks.

    ``optimizer`` is one of ``tf.keras``'s: Keras 3's, or under Keras 2 (tf_keras) a
    ``tf.keras.optimizers`` or ``tf.keras.optimizers.legacy`` one.
    ``backward_passes_per_step`` > 1 accumulates that many steps locally (Keras 3: its
    ``gradient_accumulation_steps``) and reduces once; the aggregate is their sum, as
    in Horovod, or their mean with ``average_aggregated_gradients``.
    ``PERSEUS_ACCUMULATE_N_STEPS`` sets it (averaging) when left at 1.
    ``register_local_var(var)`` on the result keeps a variable's gradient local
    (divided by the set's size when ``scale_local_gradients``). Other arguments as
    :func:`perseus.tensorflow.horovod.DistributedOptimizer`.
    """
    if isinstance(optimizer, _LegacyOptimizer):
        return _hvd.DistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    if not isinstance(optimizer, _optimizer_classes()):
        raise TypeError(f"expected a Keras optimizer or a tf.compat.v1.train.Optimizer, got "
                        f"{type(optimizer).__name__}{_other_keras_hint(optimizer)}")
    _check_common(op, gradient_predivide_factor, num_groups, groups)
    _hooks.install()  # no XLA, and loss scaling decided alike on every rank
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
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    reducer = GradientReducer("DistributedOptimizer", compression, op, gradient_predivide_factor,
                              sparse_as_dense, process_set)
    _attach(wrapped, reducer, passes, average, scale_local_gradients)
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A :func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of
    them) are trained on each rank's own gradients: their trainable variables are
    registered with ``register_local_var``, so their gradients are not reduced (and are
    divided by the set's size when ``scale_local_gradients``). Other arguments as
    DistributedOptimizer.
    """
    local_vars = local_layer_variables(local_layers)
    wrapped = DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for v in local_vars:
        wrapped.register_local_var(v)
    return wrapped


def broadcast_global_variables(root_rank):
    """TF1 graphs only (eager Keras has no global variables): use the
    ``BroadcastGlobalVariablesCallback`` or ``broadcast_variables(model.variables)``."""
    return _hvd.broadcast_global_variables(root_rank)


def broadcast_variables(variables, root_rank, process_set=_global):
    """Overwrite each variable with ``root_rank``'s value."""
    return _hvd.broadcast_variables(variables, root_rank, process_set=process_set)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Average (or reduce) a value (array or tensor) over the ranks; returns a numpy value."""
    return _hvd.allreduce(tf.constant(value), average=average, name=name, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          compression=compression).numpy()


def allgather(value, name=None):
    """Gather a value from every rank (see ``hvd.allgather``); returns a numpy value."""
    return _hvd.allgather(tf.constant(value), name=name).numpy()


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every rank; returns a numpy value."""
    return _hvd.broadcast(tf.constant(value), root_rank, name=name).numpy()


def reducescatter(value, name=None, op=Average):
    """Reduce a value (array or tensor) over the ranks (``Average`` or ``Sum``) and return
    this rank's block of dim-0 rows (see ``hvd.reducescatter``), as a numpy value."""
    return _hvd.reducescatter(tf.constant(value), name=name, op=op).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """Load a saved Keras model and wrap its optimizer (state kept) in DistributedOptimizer.

    ``custom_optimizers``: optimizer classes the file may name besides Keras' own;
    ``custom_objects``: passed to ``tf.keras.models.load_model``.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = _keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not _KERAS3 and getattr(opt, "inner_optimizer", None) is not None:
        # Keras 2's LossScaleOptimizer aggregates through its inner optimizer.
        opt = opt.inner_optimizer
    if opt is not None and not isinstance(opt, _DistributedKerasOptimizer):
        # In place, so that the restored slots and iteration count stay.
        # A saved gradient_accumulation_steps (Keras 3) keeps accumulating (Keras averages).
        passes = (getattr(opt, "gradient_accumulation_steps", None) or 1) if _KERAS3 else 1
        opt.__class__ = _distributed_class(type(opt))
        _attach(opt, GradientReducer("DistributedOptimizer", compression), passes, True)
    if opt is not None:
        _hooks.install()
        # Compiled by Keras, with the plain optimizer: the hook did not see it.
        if getattr(model, "compiled", getattr(model, "_is_compiled", False)):
            _hooks.without_xla(model)
    return model

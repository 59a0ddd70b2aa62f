"""Horovod 0.28's ``horovod.tensorflow.keras`` on Perseus, for Keras 3 (the Keras that
TensorFlow 2.16 and later use)::

    import perseus.tensorflow.keras as hvd      # or: perseus.tensorflow.horovod.keras
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

A wrapped optimizer is an instance of a subclass of the optimizer's class: its
``apply`` (and so ``apply_gradients`` and ``model.fit``) averages the gradients over
the ranks first. XLA-compiled code cannot call the core: a model compiled with a
wrapped optimizer trains with ``jit_compile=False``, whatever Keras' ``"auto"`` would
choose on a GPU machine (perseus.tensorflow.keras.hooks).
"""

import keras
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
    _check_common,
    local_layer_variables,
    passes_per_step,
)
from perseus.tensorflow.keras import (
    callbacks,  # noqa: F401 - hvd.callbacks
    elastic,  # noqa: F401 - hvd.elastic
)
from perseus.tensorflow.keras import hooks as _hooks

_LegacyOptimizer = tf.compat.v1.train.Optimizer
_classes = {}  # optimizer class -> its distributed subclass


class _DistributedKerasOptimizer:
    """Mixed into a Keras optimizer's class (see :func:`DistributedOptimizer`)."""

    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced (only divided by the set's size
        when ``scale_local_gradients``). Register it on every rank, before training."""
        self._perseus_local.add(var, "register_local_var")

    def _perseus_reduce(self, grads, variables):
        return reduce_except_local(self._perseus_reducer, grads, variables,
                                   self._perseus_local, self._perseus_scale_local)

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


def _distributed_class(base):
    cls = _classes.get(base)
    if cls is None:
        # Same name and module as the base: saved models name the plain optimizer.
        cls = type(base.__name__, (_DistributedKerasOptimizer, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def _attach(optimizer, reducer, passes, average, scale_local=True):
    optimizer._perseus_reducer = reducer
    optimizer._perseus_passes = passes
    optimizer._perseus_average = average
    optimizer._perseus_local = LocalVariables()
    optimizer._perseus_scale_local = bool(scale_local)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of Keras ``optimizer`` (same class and configuration, fresh state) whose
    updates use gradients averaged over the ranks.

    ``backward_passes_per_step`` > 1 accumulates that many steps locally (Keras'
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
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer or a tf.compat.v1.train.Optimizer, got "
                        f"{type(optimizer).__name__}")
    _check_common(op, gradient_predivide_factor, num_groups, groups)
    _hooks.install()  # no XLA, and loss scaling decided alike on every rank
    passes, average = passes_per_step(backward_passes_per_step, average_aggregated_gradients)
    config = optimizer.get_config()
    if passes > 1:
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
    """TF1 graphs only (Keras 3 has no global variables): use the
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
    ``custom_objects``: passed to ``keras.models.load_model``.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, _DistributedKerasOptimizer):
        # In place, so that the restored slots and iteration count stay.
        # A saved gradient_accumulation_steps keeps accumulating (Keras averages).
        passes = opt.gradient_accumulation_steps or 1
        opt.__class__ = _distributed_class(type(opt))
        _attach(opt, GradientReducer("DistributedOptimizer", compression), passes, True)
    if opt is not None:
        _hooks.install()
        if model.compiled:  # by Keras, with the plain optimizer: the hook did not see it
            _hooks.without_xla(model)
    return model

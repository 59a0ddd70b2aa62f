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
from perseus.tensorflow.horovod import keras_optimizer as _keras_optimizer
from perseus.tensorflow.horovod import mpi_ops as _ops
from perseus.tensorflow.horovod.aggregation import check_common
from perseus.tensorflow.horovod.compression import Compression
from perseus.tensorflow.horovod.functions import (  # noqa: F401 - re-exported
    allgather_object,
    broadcast_object,
)
from perseus.tensorflow.horovod.functions import (
    broadcast_global_variables as _broadcast_global_variables,
)
from perseus.tensorflow.horovod.functions import broadcast_variables as _broadcast_variables
from perseus.tensorflow.horovod.gradients import GradientReducer
from perseus.tensorflow.horovod.mpi_ops import (  # noqa: F401 - re-exported
    Adasum,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
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
from perseus.tensorflow.horovod.optimizer import (
    DistributedOptimizer as _legacy_distributed_optimizer,
)
from perseus.tensorflow.horovod.optimizer import local_layer_variables
from perseus.tensorflow.keras import (
    callbacks,  # noqa: F401 - hvd.callbacks
    elastic,  # noqa: F401 - hvd.elastic
)
from perseus.tensorflow.keras import hooks as _hooks
from perseus.tensorflow.keras_module import KERAS3 as _KERAS3
from perseus.tensorflow.keras_module import keras as _keras

_LegacyOptimizer = tf.compat.v1.train.Optimizer
# What every distributed Keras optimizer is an instance of.
_DistributedKerasOptimizer = _keras_optimizer.DistributedKerasOptimizer


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
        return _legacy_distributed_optimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    check_common(op, gradient_predivide_factor, num_groups, groups)
    return _keras_optimizer.wrap(optimizer, name, compression, sparse_as_dense,
                                 gradient_predivide_factor, op, backward_passes_per_step,
                                 average_aggregated_gradients, num_groups, groups, process_set,
                                 scale_local_gradients)


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
    return _broadcast_global_variables(root_rank)


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Overwrite each variable with ``root_rank``'s value."""
    return _broadcast_variables(variables, root_rank, process_set=process_set)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Average (or reduce) a value (array or tensor) over the ranks; returns a numpy value."""
    return _ops.allreduce(tf.constant(value), average=average, name=name, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          compression=compression).numpy()


def allgather(value, name=None):
    """Gather a value from every rank (see ``hvd.allgather``); returns a numpy value."""
    return _ops.allgather(tf.constant(value), name=name).numpy()


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every rank; returns a numpy value."""
    return _ops.broadcast(tf.constant(value), root_rank, name=name).numpy()


def reducescatter(value, name=None, op=Average):
    """Reduce a value (array or tensor) over the ranks (``Average`` or ``Sum``) and return
    this rank's block of dim-0 rows (see ``hvd.reducescatter``), as a numpy value."""
    return _ops.reducescatter(tf.constant(value), name=name, op=op).numpy()


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
        opt.__class__ = _keras_optimizer.distributed_class(type(opt))
        _keras_optimizer.attach(opt, GradientReducer("DistributedOptimizer", compression), passes, True)
    if opt is not None:
        _hooks.install()
        # Compiled by Keras, with the plain optimizer: the hook did not see it.
        if getattr(model, "compiled", getattr(model, "_is_compiled", False)):
            _hooks.without_xla(model)
    return model

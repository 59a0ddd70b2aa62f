"""``DistributedOptimizer`` and ``DistributedGradientTape``: gradients averaged across ranks
before they are applied."""

import tensorflow as tf

from perseus.common.basics import generation
from perseus.common.ops import Adasum, Average
from perseus.common.process_sets import global_process_set
from perseus.tensorflow.horovod.adasum import DistributedAdasumLegacyOptimizer
from perseus.tensorflow.horovod.aggregation import (
    LocalAggregation,
    check_common,
    passes_per_step,
    warn_tape_does_not_accumulate,
)
from perseus.tensorflow.horovod.compression import Compression
from perseus.tensorflow.horovod.gradients import (
    GradientReducer,
    LocalVariables,
    reduce_except_local,
)
from perseus.tensorflow.horovod.legacy import WrappedLegacyOptimizer

_LegacyOptimizer = tf.compat.v1.train.Optimizer


def _adasum_legacy(optimizer, name, use_locking, compression, backward_passes_per_step,
                   average_aggregated_gradients, process_set):
    """The delta optimizer of a ``tf.compat.v1`` optimizer under ``op=Adasum``."""
    if average_aggregated_gradients:
        raise ValueError("DistributedOptimizer(op=Adasum) does not take "
                         "average_aggregated_gradients=True: its backward passes are local "
                         "steps, whose weight changes add up")
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    return DistributedAdasumLegacyOptimizer(optimizer, name, use_locking, compression, passes,
                                            process_set)


class _DistributedLegacyOptimizer(WrappedLegacyOptimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` averages across ranks."""

    def __init__(self, optimizer, name, use_locking, reducer, aggregation, scale_local):
        name = name or f"Distributed{type(optimizer).__name__}"
        super().__init__(optimizer, name, use_locking)
        self._reducer = reducer
        self._aggregation = aggregation
        self._local_vars = LocalVariables()
        self._scale_local = scale_local

    def register_local_var(self, var):
        """Keep ``var``'s gradient local: it is not reduced (only divided by the set's size
        when ``scale_local_gradients``). Register it on every rank, before the first
        ``compute_gradients``."""
        self._local_vars.add(var, "register_local_var")

    def _reduce(self, grads, variables):
        return reduce_except_local(self._reducer, grads, variables, self._local_vars,
                                   self._scale_local)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, averaged over the ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._aggregation is None:
            reduced = self._reduce(grads, variables)
        else:
            reduced = self._aggregation.reduce(grads, lambda gs: self._reduce(gs, variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, *args, **kwargs):
        """The wrapped optimizer's update (every ``backward_passes_per_step``-th call)."""
        if self._aggregation is None:
            return self._optimizer.apply_gradients(*args, **kwargs)
        return self._aggregation.apply(lambda: self._optimizer.apply_gradients(*args, **kwargs))


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap an optimizer so that gradients are averaged over the ranks before each update.

    ``optimizer`` is a ``tf.compat.v1.train.Optimizer`` (its ``compute_gradients``
    averages; ``minimize`` works unchanged) or a Keras optimizer (see
    :func:`perseus.tensorflow.keras.DistributedOptimizer`).

    Arguments:
        compression: ``Compression.none`` or ``Compression.fp16`` on the wire.
        sparse_as_dense: reduce ``IndexedSlices`` gradients as dense tensors.
        backward_passes_per_step: gradients of that many calls are summed locally
            (averaged with ``average_aggregated_gradients``) and reduced once.
            ``PERSEUS_ACCUMULATE_N_STEPS`` sets it (averaging) when left at 1.
        op: ``Average`` (default), ``Sum``, or ``Adasum``. With a Keras optimizer,
            Adasum combines the gradients; with a ``tf.compat.v1`` optimizer, as in
            Horovod, each rank steps locally and the weight changes are combined every
            ``backward_passes_per_step`` steps (perseus.tensorflow.horovod.adasum).
        gradient_predivide_factor: with ``Average``, divide by this factor before the
            sum and by ``size / factor`` after it.
        num_groups, groups: accepted for compatibility: every gradient of a step is
            submitted together and the core fuses them.
        process_set: the ranks that average gradients together.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` (which are not reduced) by the set's size.
        device_dense, device_sparse, use_locking: as Horovod.
    """
    check_common(op, gradient_predivide_factor, num_groups, groups)
    if not isinstance(optimizer, _LegacyOptimizer):
        from perseus.tensorflow.horovod import keras_optimizer  # Keras loads late

        return keras_optimizer.wrap(optimizer, name, compression, sparse_as_dense,
                                    gradient_predivide_factor, op, backward_passes_per_step,
                                    average_aggregated_gradients, num_groups, groups,
                                    process_set, scale_local_gradients)
    if op == Adasum:
        return _adasum_legacy(optimizer, name, use_locking, compression,
                              backward_passes_per_step, average_aggregated_gradients,
                              process_set)
    reducer = GradientReducer("DistributedOptimizer", compression, op, gradient_predivide_factor,
                              sparse_as_dense, process_set)
    passes, average = passes_per_step(backward_passes_per_step, average_aggregated_gradients)
    aggregation = LocalAggregation(passes, average) if passes > 1 else None
    return _DistributedLegacyOptimizer(optimizer, name, use_locking, reducer, aggregation,
                                       scale_local_gradients)


class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the tape's class by :func:`DistributedGradientTape`."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The tape's gradients, averaged over the ranks (local sources only scaled)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        out = reduce_except_local(self._perseus_reducer, tf.nest.flatten(grads), flat_sources,
                                  self._perseus_local, self._perseus_scale_local)
        return tf.nest.pack_sequence_as(grads, out)

    def register_local_source(self, source):
        """Exclude ``source`` (a variable) from the reduction: its gradient stays local
        (divided by the set's size when ``scale_local_gradients``)."""
        self._perseus_local.add(source, "register_local_source")

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``gradient()``, split in two lists of ``(source, gradient)`` pairs, as Horovod
        0.28 returns them: ``(local, global)``. ``local`` holds the registered local
        sources (``local_layers``), whose gradients differ from rank to rank; ``global``
        every other source, whose gradients are the same on every rank. Each keeps the
        order of ``sources`` (flattened), so that, for example, a norm can be taken of
        each part on its own."""
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients,
                                              unconnected_gradients))
        local, shared = [], []
        for source, grad in zip(tf.nest.flatten(sources), grads):
            (local if source in self._perseus_local else shared).append((source, grad))
        return local, shared


# Tapes are made anew every step: the state the switches keep across steps (down-sampling
# residuals, the step count, compute times) lives in one reducer per configuration.
_tape_reducers = {}


def _tape_reducer(compression, op, predivide, sparse_as_dense, process_set):
    key = (compression, op, float(predivide), bool(sparse_as_dense), id(process_set))
    reducer = _tape_reducers.get(key)
    if reducer is None or reducer.generation != generation():
        reducer = GradientReducer("DistributedGradientTape", compression, op, predivide,
                                  sparse_as_dense, process_set)
        _tape_reducers[key] = reducer
    return reducer


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages over the ranks.

    Use it after recording (``tape = hvd.DistributedGradientTape(tape)``) or as the
    context manager itself. Arguments as :func:`DistributedOptimizer`;
    ``register_local_source(var)`` keeps a variable's gradient local (scaled by
    1/size when ``scale_local_gradients``).
    """
    check_common(op, gradient_predivide_factor, num_groups, groups)
    warn_tape_does_not_accumulate()
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": __name__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._perseus_reducer = _tape_reducer(compression, op, gradient_predivide_factor,
                                          sparse_as_dense, process_set)
    tape._perseus_local = LocalVariables()
    tape._perseus_scale_local = scale_local_gradients
    return tape


def local_layer_variables(local_layers):
    """The trainable variables of ``local_layers`` (a Keras layer, a list of them, or
    None), checked: Horovod's ``local_layers`` argument."""
    from perseus.tensorflow.keras_module import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    try:
        local_layers = list(local_layers)
    except TypeError:
        raise ValueError(f"local_layers must be a Keras layer or a list of them, got "
                         f"{type(local_layers).__name__}") from None
    bad = [type(layer).__name__ for layer in local_layers
           if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise ValueError(f"All local layers must be of tf.keras.layers.Layer type; got "
                         f"{', '.join(bad)}")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A :func:`DistributedGradientTape` whose ``local_layers`` (a Keras layer or a list
    of them) keep their gradients local: their trainable variables are registered as
    local sources, not reduced, and divided by the set's size when
    ``scale_local_gradients``. Every other argument as DistributedGradientTape.
    """
    local_vars = local_layer_variables(local_layers)
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)
    return tape

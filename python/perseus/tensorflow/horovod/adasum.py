"""``DistributedOptimizer(op=Adasum)`` of a ``tf.compat.v1.train`` optimizer: each rank
steps on its own gradients, and every ``backward_passes_per_step``-th step the ranks'
weight changes combine by Adasum (Horovod's delta optimizer for TensorFlow 1).

For every variable ``w`` that has a gradient, over one cycle of N calls of
``apply_gradients``::

    start = w                   # first call of the cycle: the same on every rank
    w = wrapped_step(w, g)      # every call: the wrapped optimizer, this rank's gradient
    w = start + Adasum(w - start)   # N-th call: the ranks' changes combined

Adasum (docs/core-api.md) adds orthogonal changes and averages parallel ones. The
wrapped optimizer's state (momentum, Adam's moments) stays each rank's own. Works
eagerly, in ``tf.function`` and in ``tf.compat.v1`` sessions.

Keras optimizers and ``DistributedGradientTape`` combine gradients by Adasum instead
(perseus.tensorflow.horovod.optimizer).
"""

import tensorflow as tf

from perseus.common.gradients import warn_adasum_unapplied, warn_unapplied
from perseus.common.ops import Adasum
from perseus.tensorflow.horovod.legacy import WrappedLegacyOptimizer
from perseus.tensorflow.horovod.mpi_ops import grouped_allreduce


class DistributedAdasumLegacyOptimizer(WrappedLegacyOptimizer):
    """A ``tf.compat.v1.train.Optimizer`` that steps locally and combines the weight changes
    by Adasum (see the module)."""

    def __init__(self, optimizer, name, use_locking, compression, passes, process_set):
        name = name or f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(optimizer, name, use_locking)
        self._compression = compression
        self._passes = int(passes)
        self._process_set = process_set
        self._counter = None
        self._starts = {}  # id(variable) -> (variable, its value at the cycle's start)
        warn_unapplied("TensorFlow's DistributedOptimizer")
        warn_adasum_unapplied(stacklevel=4)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, this rank's own (nothing is reduced)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def _start_of(self, var):
        held = self._starts.get(id(var))
        if held is None:
            with tf.init_scope():
                start = tf.Variable(tf.zeros(var.shape, var.dtype.base_dtype),
                                    trainable=False, name="perseus_adasum_start")
            self._starts[id(var)] = held = (var, start)
        return held[1]

    def _build(self, variables):
        with tf.init_scope():
            if self._counter is None:
                self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="perseus_adasum_steps")
        return [self._start_of(v) for v in variables]

    def _snapshot(self, variables, starts):
        return tf.group(*[s.assign(tf.convert_to_tensor(v)) for v, s in zip(variables, starts)])

    def _combine(self, variables, starts):
        """Every rank's ``w`` becomes ``start + Adasum(w - start)``, the same everywhere."""
        deltas = [tf.convert_to_tensor(v) - s for v, s in zip(variables, starts)]
        combined = grouped_allreduce(deltas, op=Adasum, compression=self._compression,
                                     process_set=self._process_set,
                                     name=f"{self._name}.delta")
        return tf.group(*[v.assign(s.assign_add(c)) for v, s, c in
                          zip(variables, starts, combined)])

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's step on this rank's gradients; on every
        ``backward_passes_per_step``-th call the weight changes since the cycle began
        are combined by Adasum."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        if not variables:
            raise ValueError("No gradients provided for any variable: "
                             f"{[v.name for _, v in pairs]}")
        starts = self._build(variables)
        if tf.executing_eagerly():
            if int(self._counter.numpy()) % self._passes == 0:
                self._snapshot(variables, starts)
            self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
            if int(self._counter.assign_add(1).numpy()) % self._passes == 0:
                self._combine(variables, starts)
            return None
        first = tf.equal(self._counter % self._passes, 0)
        snap = tf.cond(first, lambda: self._snapshot(variables, starts), tf.no_op)
        with tf.control_dependencies([snap]):
            update = self._optimizer.apply_gradients(pairs, global_step=global_step,
                                                     name=name)
        with tf.control_dependencies([update]):
            count = self._counter.assign_add(1)
        return tf.cond(tf.equal(count % self._passes, 0),
                       lambda: self._combine(variables, starts), tf.no_op)

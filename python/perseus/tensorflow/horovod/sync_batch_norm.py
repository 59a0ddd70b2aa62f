"""``SyncBatchNormalization``: Keras batch normalization whose training statistics cover
the batches of every rank (a subclass of ``tf.keras.layers.BatchNormalization``, Keras 3's
or Keras 2's: perseus.tensorflow.keras_module)."""

import tensorflow as tf

from perseus.common.ops import Sum
from perseus.common.process_sets import global_process_set, process_set_size
from perseus.tensorflow.horovod.mpi_ops import grouped_allreduce
from perseus.tensorflow.keras_module import KERAS3, keras


def _global_moments(inputs, weights, axes, keepdims, process_set):
    """The mean and variance over ``axes`` of every rank's ``inputs`` together, each row
    weighted by ``weights`` (the mask: 1 or 0, broadcastable to ``inputs``)."""
    weights = tf.broadcast_to(tf.cast(weights, inputs.dtype), tf.shape(inputs))
    count = tf.reduce_sum(weights, axis=axes, keepdims=keepdims)
    total = tf.reduce_sum(inputs * weights, axis=axes, keepdims=keepdims)
    squares = tf.reduce_sum(tf.square(inputs) * weights, axis=axes, keepdims=keepdims)
    count, total, squares = grouped_allreduce([count, total, squares], op=Sum,
                                              process_set=process_set)
    count = tf.maximum(count, tf.ones_like(count))  # no rows anywhere: mean 0, var 0
    mean = total / count
    # E[x^2] - E[x]^2 can fall a rounding error below 0.
    variance = tf.maximum(squares / count - tf.square(mean), tf.zeros_like(mean))
    return mean, variance


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` whose training-mode mean and variance are
    those of the global batch: every rank's rows together, as if one process normalized
    the concatenation. Ranks may hold different numbers of rows (each rank's statistics
    are weighted by its count; a rank with an empty batch contributes nothing).

    Each training call sums the per-rank counts, sums and sums of squares in one
    allreduce (every rank of ``process_set`` must call the layer the same number of
    times). The allreduce is differentiable, so gradients flow through the global
    statistics to every rank's inputs. Inference uses the moving statistics, which
    are the same on every rank. ``fused`` is accepted as Horovod's, and must be False.
    ``process_set`` is a Perseus extension (not saved in the config).
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes through Perseus; "
                             "synchronized=True (tf.distribute's) cannot be combined with it")
        if not KERAS3:
            kwargs["fused"] = False  # Keras 2 would pick its fused kernel for 4-D inputs
        super().__init__(**kwargs)
        self.process_set = process_set

    if KERAS3:
        def _moments(self, inputs, mask):
            if process_set_size(self.process_set) == 1:
                return super()._moments(inputs, mask)
            weights = 1.0 if mask is None else tf.expand_dims(mask, -1)
            return _global_moments(inputs, weights, list(self._reduction_axes), False,
                                   self.process_set)
    else:
        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            if process_set_size(self.process_set) == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims,
                                                       mask=mask)
            weights = 1.0 if mask is None else tf.expand_dims(mask, -1)
            return _global_moments(inputs, weights, list(reduction_axes), keep_dims,
                                   self.process_set)

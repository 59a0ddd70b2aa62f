"""``SyncBatchNormalization``: Keras batch normalization whose training statistics cover
the batches of every rank."""

import keras
import tensorflow as tf

from perseus.common.ops import Sum
from perseus.common.process_sets import global_process_set, process_set_size
from perseus.tensorflow.horovod.mpi_ops import grouped_allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training-mode mean and variance are those
    of the global batch: every rank's rows together, as if one process normalized the
    concatenation. Ranks may hold different numbers of rows (each rank's statistics are
    weighted by its count; a rank with an empty batch contributes nothing).

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
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs, mask):
        if process_set_size(self.process_set) == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(inputs * weights, axis=axes)
        squares = tf.reduce_sum(tf.square(inputs) * weights, axis=axes)
        count, total, squares = grouped_allreduce([count, total, squares], op=Sum,
                                                  process_set=self.process_set)
        count = tf.maximum(count, tf.ones_like(count))  # no rows anywhere: mean 0, var 0
        mean = total / count
        # E[x^2] - E[x]^2 can fall a rounding error below 0.
        variance = tf.maximum(squares / count - tf.square(mean), tf.zeros_like(mean))
        return mean, variance

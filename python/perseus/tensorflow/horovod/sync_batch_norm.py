"""``SyncBatchNormalization``: Keras batch normalization whose training statistics cover
the batches of every rank (a subclass of ``tf.keras.layers.BatchNormalization``, Keras 3's
or Keras 2's: perseus.tensorflow.keras_module)."""

import tensorflow as tf

from perseus.common import batch_stats
from perseus.common.process_sets import global_process_set, process_set_size
from perseus.tensorflow.horovod.mpi_ops import allgather
from perseus.tensorflow.keras_module import KERAS3, keras


def _gradient_times(x, factor):
    """``x``, whose gradient is multiplied by ``factor``."""
    @tf.custom_gradient
    def scaled(x):
        return tf.identity(x), lambda dy: dy * factor
    return scaled(x)


def _global_moments(inputs, weights, axes, keepdims, process_set):
    """The mean and variance over ``axes`` of every rank's ``inputs`` together, each row
    weighted by ``weights`` (the mask: 1 or 0, broadcastable to ``inputs``): each rank's
    count, mean and M2 gathered, then merged by perseus.common.batch_stats."""
    weights = tf.broadcast_to(tf.cast(weights, inputs.dtype), tf.shape(inputs))
    count = tf.reduce_sum(weights, axis=axes, keepdims=True)
    mean = tf.math.divide_no_nan(tf.reduce_sum(inputs * weights, axis=axes, keepdims=True),
                                 count)
    m2 = tf.reduce_sum(tf.square(inputs - mean) * weights, axis=axes, keepdims=True)
    shape = tf.shape(mean)
    row = tf.concat([tf.reshape(count, [1, -1])[:, :1], tf.reshape(mean, [1, -1]),
                     tf.reshape(m2, [1, -1])], axis=1)
    # Every rank's loss depends on the merged statistics, so this rank's row takes the sum
    # of their gradients; allgather's (Horovod's) averages them: scale the gradient alone.
    rows = allgather(_gradient_times(row, process_set_size(process_set)), name=None,
                     process_set=process_set)
    rows = tf.reshape(rows, [-1, tf.shape(row)[1]])  # stacked or concatenated alike
    channels = tf.size(mean)
    total, mean, m2 = batch_stats.merge(rows[:, :1], rows[:, 1:1 + channels],
                                        rows[:, 1 + channels:],
                                        lambda t: tf.reduce_sum(t, axis=0),
                                        tf.math.divide_no_nan)
    variance = tf.math.divide_no_nan(m2, total)  # no rows anywhere: mean 0, variance 0
    mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` whose training-mode mean and variance are
    those of the global batch: every rank's rows together, as if one process normalized
    the concatenation. Ranks may hold different numbers of rows (each rank's statistics
    are weighted by its count; a rank with an empty batch contributes nothing).

    Each training call gathers the per-rank counts, means and sums of squared deviations
    in one allgather (every rank of ``process_set`` must call the layer the same number
    of times). The allgather is differentiable, so gradients flow through the global
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

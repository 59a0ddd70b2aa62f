"""Gradient compression for TensorFlow tensors (``hvd.Compression.none`` / ``.fp16``)."""

import tensorflow as tf

from perseus.common.compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    register_tensor_type,
)

register_tensor_type(
    tf.Tensor,
    is_floating=lambda t: t.dtype.is_floating,
    dtype_of=lambda t: t.dtype,
    cast=lambda t, dtype: tf.cast(t, dtype),
    float16=tf.float16,
)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]

"""Gradient compression for MXNet NDArrays (``hvd.Compression.none`` / ``.fp16``)."""

import mxnet as mx
import numpy as np

from perseus.common.compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    register_tensor_type,
)

register_tensor_type(
    mx.nd.NDArray,
    is_floating=lambda t: np.issubdtype(np.dtype(t.dtype), np.floating),
    dtype_of=lambda t: np.dtype(t.dtype),
    cast=lambda t, dtype: t.astype(dtype),
    float16=np.dtype(np.float16),
)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]

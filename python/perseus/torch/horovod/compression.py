"""Gradient compression for PyTorch tensors (``hvd.Compression.none`` / ``.fp16``)."""

import torch

from perseus.common.compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
    register_tensor_type,
)

register_tensor_type(
    torch.Tensor,
    is_floating=lambda t: t.dtype.is_floating_point,
    dtype_of=lambda t: t.dtype,
    cast=lambda t, dtype: t.to(dtype),
    float16=torch.float16,
)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]

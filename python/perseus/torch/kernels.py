"""The core's device kernels one at a time, on CUDA tensors.

The collectives and the fused optimizers run these kernels inside their own steps. This
module runs each one alone: the GPU tests compare them with torch's own operations, and
``benchmarks/kernels.py`` times them against those operations. Each call is queued on
Perseus's stream of the tensors' device, after the work torch's current stream holds
and before the work torch queues there later (events, as for the fused optimizers).
:func:`nonfinite` and :func:`top_k_` return what the device found, so they wait for it.

Tensors must be contiguous and on one CUDA device; anything else raises ``ValueError``
naming the argument. Without the CUDA driver the calls raise ``GpuUnavailableError``.
"""

import contextlib

import torch
from torch.utils.dlpack import to_dlpack

from perseus import _core
from perseus.torch._stream import ordered

__all__ = ["cast", "nonfinite", "reduce_", "scale_", "top_k_"]


def _run(call, *tensors):
    device = tensors[0].device
    # Host tensors go in unordered: the core refuses them, naming the argument.
    guard = ordered(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        return call(*(to_dlpack(t) for t in tensors))


def cast(x, dtype, scale=1.0):
    """A new tensor: float32 ``x`` times ``scale`` cast to ``dtype`` (float16 or bfloat16,
    rounding to nearest even), or float16/bfloat16 ``x`` cast to float32 (``dtype``)
    times ``scale``. The kernels of ``PERSEUS_ALLREDUCE_DTYPE`` and its gradient scale."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _run(lambda s, d: _core.gpu_cast(s, d, float(scale)), x, out)
    return out


def reduce_(dst, src, op="sum"):
    """``dst = dst (op) src`` elementwise, in place; ``op``: ``"sum"``, ``"min"``,
    ``"max"`` or ``"product"``. float32, float64, float16 and bfloat16 (the half types
    computed in float32 and rounded once). Returns ``dst``."""
    _run(lambda d, s: _core.gpu_reduce(d, s, op), dst, src)
    return dst


def scale_(x, factor):
    """``x *= factor`` in place (float32 arithmetic, float64's for float64 tensors): the
    prescale, the postscale and Average's 1/n. Returns ``x``."""
    _run(lambda t: _core.gpu_scale(t, float(factor)), x)
    return x


def nonfinite(x):
    """True when some element of ``x`` (float32 or float16) is NaN or infinite: the check
    of ``PERSEUS_ALLREDUCE_NANCHECK`` and of float16 sums."""
    return _run(_core.gpu_nonfinite, x)


def top_k_(residual, k):
    """Deep gradient compression's selection: the ``k`` elements of float32 ``residual``
    with the largest magnitudes (of several tied at the threshold, whichever the device
    reaches first), which are cleared in ``residual``. Returns ``(indices, values,
    threshold)``: int32 indices into the flattened tensor and their float32 values, in
    no particular order, and the least magnitude taken (``inf`` for ``k == 0``)."""
    flat = residual.view(-1)
    k = int(k)
    if not 0 <= k <= flat.numel():
        raise ValueError(f"top_k_: k is {k}; the residual has {flat.numel()} elements")
    indices = torch.empty(k, dtype=torch.int32, device=flat.device)
    values = torch.empty(k, dtype=torch.float32, device=flat.device)
    taken, threshold = _run(lambda x, i, v: _core.gpu_top_k(x, k, i, v), flat, indices, values)
    return indices[:taken], values[:taken], threshold

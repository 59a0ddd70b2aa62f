"""Gradient compression applied around allreduce (Horovod's ``Compression``), once for all
front-ends. A front-end registers how to query and cast its tensor type with
:func:`register_tensor_type`.
"""

_adapters = []  # (tensor class, _DtypeAdapter)


class _DtypeAdapter:
    __slots__ = ("cast", "dtype_of", "float16", "is_floating")

    def __init__(self, is_floating, dtype_of, cast, float16):
        self.is_floating, self.dtype_of, self.cast, self.float16 = (
            is_floating, dtype_of, cast, float16)


def register_tensor_type(cls, *, is_floating, dtype_of, cast, float16):
    """Teach the compressors a framework's tensor class.

    ``is_floating(t) -> bool``, ``dtype_of(t) -> dtype``, ``cast(t, dtype) -> tensor``,
    and ``float16``: that framework's half-precision dtype.
    """
    _adapters.insert(0, (cls, _DtypeAdapter(is_floating, dtype_of, cast, float16)))


def _adapter(tensor):
    for cls, adapter in _adapters:
        if isinstance(tensor, cls):
            return adapter
    raise TypeError(f"Compression does not know tensors of type {type(tensor).__name__}")


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor):
        """Compress a tensor; return it with the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Undo ``compress`` with its context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: tensors go over the wire as they are."""

    @staticmethod
    def compress(tensor):
        """Return the tensor unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 and cast the result back."""

    @staticmethod
    def compress(tensor):
        """Cast a floating-point tensor to float16; ctx is its original dtype."""
        a = _adapter(tensor)
        if a.is_floating(tensor):
            return a.cast(tensor, a.float16), a.dtype_of(tensor)
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Cast back to the original dtype."""
        if ctx is None:
            return tensor
        a = _adapter(tensor)
        return tensor if a.dtype_of(tensor) == ctx else a.cast(tensor, ctx)


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    #: Do not compress the gradients. This is the default.
    none = NoneCompressor

    #: Compress all floating point gradients to 16-bit.
    fp16 = FP16Compressor

"""Collectives on MXNet NDArrays: the ``horovod.mxnet`` operations of Horovod 0.28.

NDArrays cross as DLPack capsules, with MXNet's asynchronous engine respected: inputs
are exported with ``to_dlpack_for_read`` (which waits for pending writes), buffers the
core writes with ``to_dlpack_for_write`` (which waits for pending reads and writes), and
results the core allocates come back through ``mx.nd.from_dlpack``. Every call returns
once the collective is done, so what follows in the engine sees the result.

NDArrays on a GPU cross through host memory: the core reads and writes a copy in
``mx.cpu()``, which is copied back into the array (or results into arrays on its
context). Perseus's NCCL path serves PyTorch's CUDA tensors only (docs/gpu.md).

Argument errors that Horovod's MXNet front-end reports from its C++ side (alltoall's
splits) raise :class:`MXNetValueError`, both an ``mxnet.base.MXNetError`` (as Horovod)
and a ``ValueError`` (as Perseus's other front-ends).
"""

import ctypes
import numbers

import mxnet as mx
import numpy as np

from perseus.common import basics as _basics
from perseus.common import ops as _ops
from perseus.common.basics import (  # noqa: F401 - re-exported
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from perseus.common.exceptions import HorovodInternalError  # noqa: F401 - re-exported
from perseus.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from perseus.common.process_sets import (  # noqa: F401 - re-exported
    ProcessSet,
    add_process_set,
    global_process_set,
    process_set_size,
    remove_process_set,
)
from perseus.common.timeline import start_timeline, stop_timeline  # noqa: F401 - re-exported

_SUPPORTED_DTYPES = (np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64,
                     np.bool_)


class MXNetValueError(mx.base.MXNetError, ValueError):
    """A bad argument that Horovod's MXNet front-end reports as ``mxnet.base.MXNetError``
    (its C++ checks surface through MXNet): both that and a ``ValueError``, so either
    ``except`` clause catches it."""


# --------------------------------------------------------------------------- DLPack bool
#
# MXNet 1.9 tags bool arrays in DLPack as 1-bit unsigned integers (stored one byte per
# element all the same), which the core does not read; the core's bool is DLPack's
# kDLBool (8 bits). The tag of the capsules that cross is rewritten, both ways.

class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensorHead(ctypes.Structure):
    """The start of DLPack's ``DLTensor``, up to its dtype (MXNet's ``DLContext`` and the
    core's ``DLDevice`` have the same layout)."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32), ("dtype", _DLDataType)]


# A function object of our own: MXNet's capsule deleter calls
# ctypes.pythonapi.PyCapsule_GetPointer with its own argument types, which must stay as
# they are.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_MX_BOOL = (1, 1)    # kDLUInt, 1 bit: MXNet 1.9's bool
_CORE_BOOL = (6, 8)  # kDLBool, 8 bits: the core's bool


def _retag(capsule, old, new):
    """Rewrite the dtype of a ``dltensor`` capsule from ``old`` to ``new`` (code, bits);
    other dtypes are left alone. Returns the capsule."""
    dtype = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor")).dtype
    if (dtype.code, dtype.bits) == old:
        dtype.code, dtype.bits = new
    return capsule


def _export(capsule):
    """An MXNet capsule, as the core reads it."""
    return _retag(capsule, _MX_BOOL, _CORE_BOOL)


def _check(tensor):
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"expected an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise ValueError(f"{tensor.stype} NDArrays are not supported; use dense arrays")
    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError:  # MXNet's own types (bfloat16) are not numpy's
        dtype = None
    if dtype is None or dtype.type not in _SUPPORTED_DTYPES:
        names = ", ".join(np.dtype(d).name for d in _SUPPORTED_DTYPES)
        shown = dtype.name if dtype is not None else str(tensor.dtype)
        raise TypeError(f"Perseus does not support NDArrays of dtype {shown}; "
                        f"supported dtypes: {names}")
    return tensor


def _off_host(tensor):
    """True when ``tensor`` is not in host memory (a GPU array), so the core works on a
    copy in ``mx.cpu()``."""
    return tensor.context.device_type != "cpu"


def _default_layout_copy(tensor):
    """A copy of ``tensor`` in MXNet's default layout (through numpy): arrays that oneDNN
    (MKLDNN) keeps in its own blocked layout, such as convolution weights after a forward
    pass, cannot be exported through DLPack."""
    return mx.nd.array(tensor.asnumpy(), ctx=tensor.context, dtype=tensor.dtype)


def _readable(tensor):
    """``(array, capsule)`` for the core to read ``tensor``: the array itself, or its copy
    in host memory (a GPU array, or one oneDNN keeps in its own layout)."""
    if _off_host(tensor):
        copy = tensor.as_in_context(mx.cpu())
        return copy, _export(copy.to_dlpack_for_read())
    try:
        return tensor, _export(tensor.to_dlpack_for_read())
    except mx.base.MXNetError:
        copy = _default_layout_copy(tensor)
        return copy, _export(copy.to_dlpack_for_read())


def _writable(tensor):
    """``(buffer, capsule, finish)`` for the core to write ``tensor``'s new value:
    ``finish()`` (after the core is done) puts it in ``tensor`` and returns ``tensor``.
    The buffer starts with ``tensor``'s values (an in-place reduction reads them)."""
    if _off_host(tensor):
        copy = tensor.as_in_context(mx.cpu())
    else:
        try:
            return tensor, _export(tensor.to_dlpack_for_write()), lambda: tensor
        except mx.base.MXNetError:
            copy = _default_layout_copy(tensor)

    def finish():
        tensor[:] = copy
        return tensor
    return copy, _export(copy.to_dlpack_for_write()), finish


def _imported(handle, ctx):
    """The result the core allocated, on ``ctx`` (the input's context)."""
    out = mx.nd.from_dlpack(_retag(handle.output(), _CORE_BOOL, _MX_BOOL))
    return out if out.context == ctx else out.as_in_context(ctx)


def _group_names(name, n):
    return [None] * n if name is None else [f"{name}.{i}" for i in range(n)]


# --------------------------------------------------------------------------- allreduce

def _new_output(tensor):
    """A new NDArray like ``tensor`` for an out-of-place result (contents unspecified).
    Large host arrays come from the core's pool of memory already faulted in, to which
    they return when freed (a fresh allocation faults in every page again)."""
    if (tensor.context.device_type == "cpu"
            and tensor.size * np.dtype(tensor.dtype).itemsize >= _ops.POOL_MIN_BYTES):
        cap = _ops.empty_like(_export(tensor.to_dlpack_for_read()))
        return mx.nd.from_dlpack(_retag(cap, _CORE_BOOL, _MX_BOOL))
    return mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)


def _allreduce_into(tensor, output, name, op, prescale_factor, postscale_factor, process_set,
                    gradient=False, blocking=False):
    """Start reducing ``tensor`` into ``output`` (the same array: in place); ``blocking``:
    the caller waits at once, so a small one may complete among the callers."""
    _check(tensor)
    if output is tensor:
        src, cap, done = _writable(tensor)
        inp = cap
    else:
        src, inp = _readable(tensor)
        _, cap, done = _writable(output)
    return _ops.allreduce_async(inp, cap, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set,
                                keep=(tensor, output, src), finish=lambda _h: done(),
                                gradient=gradient, blocking=blocking)


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """Average (or reduce with ``op``) ``tensor`` over the set; returns a new NDArray.

    ``priority`` is accepted for compatibility. ``name`` keys the operation across
    ranks (default: the call order, the same on every rank).
    """
    op = _ops.resolve_op(op, average)
    output = _new_output(_check(tensor))
    return _allreduce_into(tensor, output, name, op, prescale_factor, postscale_factor,
                           process_set, blocking=True).wait()


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """Like :func:`allreduce`, writing the result into ``tensor``; returns it."""
    op = _ops.resolve_op(op, average)
    return _allreduce_into(tensor, tensor, name, op, prescale_factor, postscale_factor,
                           process_set, blocking=True).wait()


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    """Reduce a list of NDArrays as one group; returns the list of new arrays."""
    op = _ops.resolve_op(op, average)
    outs = [mx.nd.empty(_check(t).shape, ctx=t.context, dtype=t.dtype) for t in tensors]
    return _ops.GroupHandle([
        _allreduce_into(t, o, n, op, prescale_factor, postscale_factor, process_set)
        for t, o, n in zip(tensors, outs, _group_names(name, len(tensors)))]).wait()


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None,
                       gradient=False):
    """Reduce a list of NDArrays in place as one group; returns the list."""
    op = _ops.resolve_op(op, average)
    for t in tensors:  # all checked before any is submitted
        _check(t)
    return _ops.GroupHandle([
        _allreduce_into(t, t, n, op, prescale_factor, postscale_factor, process_set, gradient)
        for t, n in zip(tensors, _group_names(name, len(tensors)))]).wait()


# --------------------------------------------------------------------------- allgather

def _allgather(tensor, name, process_set, stack):
    _check(tensor)
    if tensor.ndim == 0:  # MXNet's expand_dims refuses a scalar
        src = tensor.reshape((1,))
    else:
        src = tensor.expand_dims(0) if stack else tensor
    src, cap = _readable(src)
    return _ops.allgather_async(cap, name=name, stack=stack, process_set=process_set,
                                keep=(tensor, src),
                                finish=lambda h: _imported(h, tensor.context))


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Gather ``tensor`` from every rank of the set.

    ``PERSEUS_CHANGE_HVD_ALLGATHER=0`` (the default): equal shapes, stacked into
    ``[set size, *shape]``. ``=1``: concatenated along dim 0, as Horovod does.
    """
    return _allgather(tensor, name, process_set, _basics.allgather_stacks()).wait()


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """Gather each NDArray of a list; returns the list of results."""
    stack = _basics.allgather_stacks()
    for t in tensors:  # all checked before any is submitted
        _check(t)
    return _ops.GroupHandle([_allgather(t, n, process_set, stack)
                             for t, n in zip(tensors, _group_names(name, len(tensors)))]).wait()


# --------------------------------------------------------------------------- broadcast

def _broadcast_into(buf, root_rank, name, process_set, keep):
    """A broadcast into ``buf`` that its caller waits for at once (``blocking``: a small
    one may complete among the callers, PERSEUS_LANE_BYTES)."""
    target, cap, done = _writable(buf)
    return _ops.broadcast_async(cap, root_rank=root_rank, name=name, process_set=process_set,
                                keep=(keep, buf, target), finish=lambda _h: done(),
                                blocking=True)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """``root_rank``'s value of ``tensor`` (a rank of the job, in the set), as a new NDArray
    (not recorded by autograd, as no collective here is)."""
    with mx.autograd.pause():
        out = _new_output(_check(tensor))
        if _basics.rank() != root_rank:  # the broadcast overwrites all of it
            return _broadcast_into(out, root_rank, name, process_set, tensor).wait()
        # The root sends its input as it lies and copies it into the output meanwhile,
        # both only reading it, rather than copying first and sending the copy.
        src, cap = _readable(tensor)
        handle = _ops.broadcast_async(cap, root_rank=root_rank, name=name,
                                      process_set=process_set, keep=(tensor, src, out),
                                      finish=lambda _h: out, blocking=True)
        try:
            _ops.copy_result(out.context.device_type == "cpu",
                             out.size * np.dtype(out.dtype).itemsize,
                             lambda: (_export(out.to_dlpack_for_write()), cap),
                             lambda: tensor.copyto(out))
        except BaseException:
            handle.wait()  # the others take part: finish it, then raise, leaving none
            raise
    return handle.wait()


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    return _broadcast_into(_check(tensor), root_rank, name, process_set, None).wait()


# --------------------------------------------------------------------------- alltoall, reducescatter

def _alltoall_splits(tensor, splits, process_set):
    """Horovod's checks of alltoall's arguments: the splits as a list of ints (None
    without), or :class:`MXNetValueError` saying what is wrong."""
    if tensor.ndim == 0:
        raise MXNetValueError("alltoall does not support scalar inputs")
    set_size = process_set_size(process_set)
    d0 = tensor.shape[0]
    if splits is None:
        if d0 % set_size:
            raise MXNetValueError(f"alltoall without splits needs a first dimension ({d0}) "
                                  f"divisible by the number of ranks of the set ({set_size})")
        return None
    if isinstance(splits, (mx.nd.NDArray, np.ndarray)):
        try:
            kind = np.dtype(splits.dtype).kind
        except TypeError:  # MXNet's own types (bfloat16)
            kind = None
        if kind not in ("i", "u"):
            raise MXNetValueError(f"alltoall expects splits to contain integers, got an array "
                                  f"of {splits.dtype}")
        values = (splits.asnumpy() if isinstance(splits, mx.nd.NDArray) else splits).reshape(-1)
        splits = [int(s) for s in values]
    else:
        values = list(splits)
        if not all(isinstance(s, numbers.Integral) for s in values):
            raise MXNetValueError(f"alltoall expects splits to contain integers, got {values}")
        splits = [int(s) for s in values]
    if len(splits) != set_size:
        raise MXNetValueError(f"alltoall splits must have one entry per rank of the set "
                              f"({set_size}), got {len(splits)}: {splits}")
    if any(s < 0 for s in splits):
        raise MXNetValueError(f"alltoall splits must be non-negative, got {splits}")
    if sum(splits) != d0:
        raise MXNetValueError(f"alltoall splits {splits} sum to {sum(splits)}, not to the "
                              f"first dimension ({d0})")
    return splits


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[i]`` rows (dim 0) of ``tensor`` to rank i of the set (without
    ``splits``: equal blocks, dim 0 divisible by the set size).

    Returns, as Horovod 0.28's MXNet alltoall: with ``splits`` given, ``(received rows,
    received_splits)``, the rows each rank sent here as an int32 NDArray; without
    ``splits``, the received rows alone.

    ``splits`` (a list, or an integer NDArray or numpy array) must hold one non-negative
    integer per rank of the set, summing to dim 0. Bad splits, dim 0 not divisible without
    them, or a scalar raise :class:`MXNetValueError` (an ``mxnet.base.MXNetError``, as
    Horovod's, and a ``ValueError``).
    """
    _check(tensor)
    want_splits = splits is not None
    splits = _alltoall_splits(tensor, splits, process_set)

    def finish(h):
        out = _imported(h, tensor.context)
        if not want_splits:
            return out
        return out, mx.nd.array(h.recv_splits(), ctx=tensor.context, dtype=np.int32)

    src, cap = _readable(tensor)
    return _ops.alltoall_async(cap, splits=splits, name=name, process_set=process_set,
                               keep=(tensor, src), finish=finish, blocking=True).wait()


def _check_reducescatter(tensor, what="reducescatter"):
    if _check(tensor).ndim == 0:
        raise ValueError(f"{what} does not support scalar inputs")
    return tensor


def _reducescatter(tensor, op, name, process_set, prescale_factor, postscale_factor,
                   blocking=False):
    """``blocking``: the caller waits for this one at once (a small one may complete
    among the callers, PERSEUS_LANE_BYTES)."""
    src, cap = _readable(tensor)
    return _ops.reducescatter_async(
        cap, name=name, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set, keep=(tensor, src),
        finish=lambda h: _imported(h, tensor.context), blocking=blocking)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over the set; returns this rank's block of dim-0 rows (the first
    ``d0 % size`` ranks get one more). A scalar raises ``ValueError``, as in Horovod."""
    return _reducescatter(_check_reducescatter(tensor), op, name, process_set, prescale_factor,
                          postscale_factor, blocking=True).wait()


def grouped_reducescatter(tensors, op=Average, name=None, priority=0,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter each NDArray of a list as one group; returns the list of this
    rank's blocks, as :func:`reducescatter` gives them."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped_reducescatter takes a list of NDArrays, "
                        f"got {type(tensors).__name__}")
    for t in tensors:  # all checked before any is submitted
        _check_reducescatter(t, "grouped_reducescatter")
    return _ops.GroupHandle([
        _reducescatter(t, op, n, process_set, prescale_factor, postscale_factor)
        for t, n in zip(tensors, _group_names(name, len(tensors)))]).wait()


def join():
    """Declare that this rank has no more data; returns the rank that joined last."""
    return _ops.join()


def barrier(process_set=global_process_set):
    """Block until every rank of the set reached the barrier."""
    _ops.barrier(process_set)

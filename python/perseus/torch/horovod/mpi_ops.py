"""Collectives on PyTorch tensors: the ``horovod.torch`` operations of Horovod 0.28.

Tensors reach the core as DLPack capsules of contiguous memory; the handles of
:mod:`perseus.common.ops` keep them alive until the operation completes. CUDA tensors
are exported on Perseus's stream of their device (docs/gpu.md): torch makes that
stream wait for the work queued so far on the current stream.
"""

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from perseus.common import basics as _basics
from perseus.common import gpu as _gpu
from perseus.common import ops as _ops
from perseus.common.basics import (  # noqa: F401 - re-exported
    ccl_built,
    counters,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
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
from perseus.common.exceptions import (  # noqa: F401 - re-exported
    HorovodInternalError,
    HostsUpdatedInterrupt,
    PerseusInternalError,
    UnsupportedOperationError,
)
from perseus.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from perseus.common.process_sets import (  # noqa: F401 - re-exported
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from perseus.common.process_sets import process_set_size as _ps_size
from perseus.common.process_sets import set_rank as _set_rank
from perseus.common.timeline import start_timeline, stop_timeline  # noqa: F401
from perseus.torch.horovod.compression import Compression

# Horovod's torch dtypes (uint16 where torch has it: 2.3 and later).
_SUPPORTED_DTYPES = tuple(
    d for d in (torch.uint8, torch.int8, getattr(torch, "uint16", None), torch.int16,
                torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
                torch.float64, torch.bool)
    if d is not None)
_SUPPORTED = frozenset(_SUPPORTED_DTYPES)  # for the per-call check: a hash, not a scan


# --------------------------------------------------------------------------- tensor adaptation
# Capsules come from torch.utils.dlpack.to_dlpack: the same export as Tensor.__dlpack__
# without its Python-level argument handling, which costs several microseconds a call.

def _check_tensor(tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in _SUPPORTED_DTYPES)
        raise TypeError(f"Perseus does not support tensors of dtype {tensor.dtype}; "
                        f"supported dtypes: {names}")
    if tensor.is_cpu:
        pass
    elif tensor.is_cuda:
        if not _gpu.built():
            raise _gpu.GpuUnavailableError(
                f"a tensor on {tensor.device} reached a build of Perseus without GPU support "
                "(the cuda feature); move it to the CPU")
    else:
        raise ValueError(f"tensors on {tensor.device} are not supported: Perseus handles CPU "
                         "and CUDA tensors")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{tensor.layout} tensors are not supported here; sparse gradients go "
                         "through sparse_allreduce_async or DistributedOptimizer")


def _capsule(t):
    """The DLPack capsule of contiguous ``t``; a CUDA tensor's is made on Perseus's stream
    of its device, which then waits for the work torch queued on the current stream."""
    if t.is_cpu:
        return _to_dlpack(t)
    with torch.cuda.device(t.device):
        return t.__dlpack__(stream=_gpu.stream(t.device.index))


def _export(tensor):
    """A contiguous detached tensor with ``tensor``'s values, and its DLPack capsule."""
    t = _detached(tensor)
    if not t.is_contiguous():
        t = t.contiguous()
    return t, _capsule(t)


def _new_output(tensor):
    """A new contiguous tensor like ``tensor`` for an out-of-place result (contents
    unspecified). Large host tensors come from the core's pool of memory already
    faulted in, to which they return when freed: a fresh allocation would fault in
    every page again, which costs more than the collective."""
    if (tensor.is_cpu and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() >= _ops.POOL_MIN_BYTES):
        return torch.from_dlpack(_ops.empty_like(_to_dlpack(tensor.detach())))
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _detached(tensor):
    """``tensor`` without its autograd history, for export: itself when it has none
    (detach costs ~0.3 us a call)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _in_place(tensor):
    """Buffer, capsule and finish callback for an operation writing into ``tensor``."""
    if tensor.is_contiguous():
        buf = _detached(tensor)
        return buf, _capsule(buf), lambda _h: tensor

    buf = tensor.detach().contiguous()

    def finish(_h):
        with torch.no_grad():
            tensor.copy_(buf)
        return tensor

    return buf, _capsule(buf), finish


def _copy_plain(out, src):
    with torch.no_grad():
        out.copy_(src)


def _tensor_of(capsule):
    """The tensor the core allocated for an output (in host memory)."""
    if capsule is None:
        raise HorovodInternalError("the core returned no output tensor")
    return torch.from_dlpack(capsule)


def _output(handle):
    """The tensor the core allocated for ``handle`` (in host memory)."""
    return _tensor_of(handle.output())


def _on_device_of(like, out):
    """The core's host output ``out`` on ``like``'s device."""
    return out if like.is_cpu else out.to(like.device)


def _output_on(like):
    """A finish callback giving the core's output on ``like``'s device."""
    if like.is_cpu:
        return _output
    return lambda h: _on_device_of(like, _output(h))


# --------------------------------------------------------------------------- allreduce

def _allreduce_views(tensor, output):
    """What the core needs to reduce checked ``tensor`` into ``output`` (``None``: into
    itself): the input's and the output's capsules, what must live until the end, and
    the callback giving the result."""
    if output is None:
        buf, cap, finish = _in_place(tensor)
        return cap, cap, (tensor, buf), finish
    buf, cap = _export(tensor)
    return cap, _capsule(output), (tensor, buf, output), lambda _h: output


def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set,
                     gradient=False, blocking=False):
    _check_tensor(tensor)
    cap, out_cap, keep, finish = _allreduce_views(tensor, output)
    return _ops.allreduce_async(cap, out_cap, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set,
                                keep=keep, finish=finish, gradient=gradient,
                                blocking=blocking)


def _allreduce_now(tensor, output, name, op, prescale_factor, postscale_factor, process_set):
    """The reduction of checked ``tensor`` into ``output`` (``None``: into itself), waited
    for. A contiguous tensor reduced into itself, the usual lone small allreduce, takes
    the shortest way: the Python calls around it are a large part of its time."""
    if output is None and tensor.is_contiguous():
        buf = _detached(tensor)
        cap = _capsule(buf)
        _ops.allreduce_now(cap, cap, name, op, prescale_factor, postscale_factor, process_set,
                           (tensor, buf))
        return tensor
    cap, out_cap, keep, finish = _allreduce_views(tensor, output)
    _ops.allreduce_now(cap, out_cap, name, op, prescale_factor, postscale_factor, process_set,
                       keep)
    return finish(None)


def gradient_allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, process_set):
    """In-place allreduce of a gradient: float32 travels as PERSEUS_ALLREDUCE_DTYPE says."""
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                            process_set, gradient=True)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start averaging (or reducing with ``op``) ``tensor`` over all ranks; returns a handle.

    The input is not modified; ``synchronize(handle)`` returns a new tensor. The
    operation is keyed by ``name`` (auto-generated when None): every rank must
    submit the same dtype and shape under one name. ``average`` is deprecated (use
    ``op``). ``prescale_factor`` multiplies the input before the reduction,
    ``postscale_factor`` the result after it.
    """
    op = _ops.resolve_op(op, average)
    _check_tensor(tensor)
    output = _new_output(tensor)
    return _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Like :func:`allreduce_async`, but the result overwrites ``tensor``."""
    op = _ops.resolve_op(op, average)
    _check_tensor(tensor)
    if tensor.is_contiguous():
        # The usual case, many small gradients at once: the shortest way, as in
        # _allreduce_now (the Python around the core call is most of its cost).
        buf = _detached(tensor)
        cap = _capsule(buf)
        hid = _ops.submit_allreduce(cap, cap, name, op, prescale_factor, postscale_factor,
                                    process_set)
        return _ops.Handle(hid, (tensor, buf, cap), lambda _h: tensor)
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                            process_set)


def _allreduce_new(tensor, name, op, prescale_factor, postscale_factor, process_set):
    """The reduction of ``tensor`` into a new tensor, waited for."""
    _check_tensor(tensor)
    return _allreduce_now(tensor, _new_output(tensor), name, op, prescale_factor,
                          postscale_factor, process_set)


def _differentiable(tensor):
    """True when a result must carry a gradient function (autograd's Function.apply
    costs microseconds, the most of a small collective's time, and is skipped
    otherwise: the result is the same tensor without one)."""
    return tensor.requires_grad and torch.is_grad_enabled()


class _Allreduce(torch.autograd.Function):
    """Allreduce with a gradient: the gradient is allreduced the same way."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return _allreduce_new(tensor, name, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        grad = allreduce(grad_output, op=op, prescale_factor=pre, postscale_factor=post,
                         process_set=ps)
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Average (or reduce with ``op``) ``tensor`` over all ranks and return the result.

    The input is not modified. Differentiable: the gradient is allreduced with the
    same op. ``compression`` (e.g. ``Compression.fp16``) is applied on the wire.
    See :func:`allreduce_async` for the other arguments.
    """
    op = _ops.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    args = (compressed, name, op, prescale_factor, postscale_factor, process_set)
    if isinstance(compressed, torch.Tensor) and not _differentiable(compressed):
        reduced = _allreduce_new(*args)
    else:
        reduced = _Allreduce.apply(*args)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Average (or reduce with ``op``) ``tensor`` in place over all ranks; returns it."""
    op = _ops.resolve_op(op, average)
    _check_tensor(tensor)
    return _allreduce_now(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


def _group_names(name, n):
    return [None] * n if name is None else [f"{name}.{i}" for i in range(n)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start allreducing a list of tensors as one group; ``synchronize`` returns a list."""
    op = _ops.resolve_op(op, average)
    return _ops.GroupHandle([
        allreduce_async(t, None, n, op, prescale_factor, postscale_factor, process_set)
        for t, n in zip(tensors, _group_names(name, len(tensors)))])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Like :func:`grouped_allreduce_async`, writing each result into its input."""
    op = _ops.resolve_op(op, average)
    return _ops.GroupHandle([
        allreduce_async_(t, None, n, op, prescale_factor, postscale_factor, process_set)
        for t, n in zip(tensors, _group_names(name, len(tensors)))])


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            list(tensors), None, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors as one group; returns the list of results (differentiable)."""
    op = _ops.resolve_op(op, average)
    if not tensors:
        return []
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors in place as one group; returns the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor by gathering every rank's indices and values.

    Returns a handle: ``synchronize(handle)`` (or ``handle()``) gives the summed
    sparse tensor (values divided by the set size for ``Average``).
    """
    op = _ops.check_op(op)
    if op not in (Average, Sum):
        raise ValueError("sparse allreduce supports only Average and Sum")
    t = tensor
    h_values = _allgather_concat_async(t._values(), f"{name}.values", process_set)
    h_indices = _allgather_concat_async(t._indices().t().contiguous(), f"{name}.indices",
                                        process_set)

    def finish(results):
        values, indices = results
        if op == Average:
            values = values / _ps_size(process_set)
        return torch.sparse_coo_tensor(indices.t(), values, t.size(), check_invariants=True)

    return _ops.GroupHandle([h_values, h_indices], finish)


# --------------------------------------------------------------------------- allgather

def _allgather_source(tensor, stack):
    """What an allgather of ``tensor`` sends: with a leading dimension of 1 when the
    result stacks, a scalar as one row when it concatenates."""
    if stack:
        return tensor.unsqueeze(0)
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _allgather_concat_async(tensor, name, process_set, blocking=False):
    """Horovod-style allgather (concatenate along dim 0) whatever the allgather mode.
    ``blocking``: the caller waits at once, so a small one may complete among the
    callers before this returns (PERSEUS_LANE_BYTES)."""
    _check_tensor(tensor)
    buf, cap = _export(_allgather_source(tensor, False))
    return _ops.allgather_async(cap, name=name, stack=False, process_set=process_set,
                                keep=(tensor, buf), finish=_output_on(tensor),
                                blocking=blocking)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering ``tensor`` from every rank; returns a handle.

    With ``PERSEUS_CHANGE_HVD_ALLGATHER=0`` (the default) every rank sends the same
    shape and the result stacks them: shape ``[size, *tensor.shape]``. With ``=1``
    the tensors are concatenated along dimension 0 as Horovod does, so their first
    dimensions may differ.
    """
    return _allgather_async(tensor, name, process_set)


def _allgather_async(tensor, name, process_set):
    _check_tensor(tensor)
    if not _basics.allgather_stacks():
        return _allgather_concat_async(tensor, name, process_set)
    return _stacked_allgather_async(tensor, name, process_set)


def stacked_allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering ``tensor``, of one shape on every rank (a rank whose shape differs
    fails the operation on every rank, naming it), into ``[size, *tensor.shape]``
    whatever ``PERSEUS_CHANGE_HVD_ALLGATHER`` says."""
    return _stacked_allgather_async(tensor, name, process_set)


def _stacked_allgather_async(tensor, name, process_set):
    buf, cap = _export(_allgather_source(tensor, True))
    return _ops.allgather_async(cap, name=name, stack=True, process_set=process_set,
                                keep=(tensor, buf), finish=_output_on(tensor))


def _allgather_grads(grads, shapes, stack, process_set):
    """Horovod's gradient of an allgather of tensors of ``shapes``: the output gradients
    averaged over the set, then this rank's rows of each."""
    reduced = grouped_allreduce(grads, op=Average, process_set=process_set)
    r = _set_rank(process_set)
    if stack:
        return [g[r] for g in reduced]
    rows = [s[0] if len(s) else 1 for s in shapes]
    counts = synchronize(_allgather_concat_async(torch.tensor(rows), None, process_set))
    offsets = counts.reshape(-1, len(rows))[:r].sum(0).tolist()
    return [g.narrow(0, o, n).reshape(s) for g, o, n, s in zip(reduced, offsets, rows, shapes)]


def _allgather_now(tensor, name, process_set):
    """:func:`allgather`'s result, waited for in one call: no handle, so a small one in
    the lane (PERSEUS_LANE_BYTES) costs little more than the exchange."""
    _check_tensor(tensor)
    stack = _basics.allgather_stacks()
    buf, cap = _export(_allgather_source(tensor, stack))
    out = _tensor_of(_ops.allgather_now(cap, name, stack, process_set, (tensor, buf)))
    return _on_device_of(tensor, out)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape = tensor.shape
        ctx.process_set = process_set
        ctx.stack = _basics.allgather_stacks()
        return _allgather_now(tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad, = _allgather_grads([grad_output], [ctx.shape], ctx.stack, ctx.process_set)
        return grad, None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Gather ``tensor`` from every rank (see :func:`allgather_async` for the layout).

    Differentiable: the gradient is the average of the result's gradients, sliced
    back to this rank's part.
    """
    if isinstance(tensor, torch.Tensor) and not _differentiable(tensor):
        return _allgather_now(tensor, name, process_set)
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start gathering each tensor of a list; ``synchronize`` returns the list of results."""
    return _ops.GroupHandle([allgather_async(t, n, process_set)
                             for t, n in zip(tensors, _group_names(name, len(tensors)))])


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        ctx.stack = _basics.allgather_stacks()
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_allgather_grads(list(grads), ctx.shapes, ctx.stack,
                                              ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gather each tensor of a list from every rank; returns the list of results
    (differentiable, as :func:`allgather`)."""
    if not tensors:
        return []
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# --------------------------------------------------------------------------- broadcast

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start broadcasting ``tensor`` from ``root_rank``; the result is a new tensor.

    ``root_rank`` is a rank of the job (as in Horovod), one of ``process_set``'s. Every
    rank must submit the same dtype and shape under one name.
    """
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def _broadcast_async(tensor, root_rank, name, process_set, blocking):
    """:func:`broadcast_async`; ``blocking``: the caller waits at once, so a small one
    may complete among the callers before this returns (PERSEUS_LANE_BYTES)."""
    _check_tensor(tensor)
    out = _new_output(tensor)
    if _basics.rank() != root_rank:  # the broadcast overwrites all of it
        return _ops.broadcast_async(_capsule(out), root_rank=root_rank, name=name,
                                    process_set=process_set, keep=(tensor, out),
                                    finish=lambda _h: out, blocking=blocking)
    # The root sends its input as it lies and copies it into the output meanwhile, both
    # only reading it, rather than copying first and sending the copy.
    src, cap = _export(tensor)
    handle = _ops.broadcast_async(cap, root_rank=root_rank, name=name,
                                  process_set=process_set, keep=(tensor, src, out),
                                  finish=lambda _h: out, blocking=blocking)
    try:
        _ops.copy_result(out.is_cpu, out.numel() * out.element_size(),
                         lambda: (_to_dlpack(out), _to_dlpack(src)),
                         lambda: _copy_plain(out, src))
    except BaseException:
        synchronize(handle)  # the others take part: finish it, then raise, leaving none
        raise
    return handle


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start broadcasting ``tensor`` from ``root_rank`` in place; returns a handle."""
    return _broadcast_async_(tensor, root_rank, name, process_set, False)


def _broadcast_async_(tensor, root_rank, name, process_set, blocking):
    """:func:`broadcast_async_`; ``blocking`` as for :func:`_broadcast_async`."""
    _check_tensor(tensor)
    buf, cap, finish = _in_place(tensor)
    return _ops.broadcast_async(cap, root_rank=root_rank, name=name, process_set=process_set,
                                keep=(tensor, buf), finish=finish, blocking=blocking)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(_broadcast_async(tensor, root_rank, name, process_set, True))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:  # a rank of the job, as in Horovod
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s value of ``tensor`` on every rank (input not modified)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    return synchronize(_broadcast_async_(tensor, root_rank, name, process_set, True))


# --------------------------------------------------------------------------- alltoall

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``.

    ``splits[i]`` rows (dim 0) of ``tensor`` go to rank i of the set, in order;
    without ``splits`` dim 0 is split equally. ``received_splits[i]`` is the number
    of rows that came from rank i.
    """
    return _alltoall_async(tensor, splits, name, process_set, False)


def _alltoall_async(tensor, splits, name, process_set, blocking):
    """:func:`alltoall_async`; ``blocking`` as for :func:`_broadcast_async`."""
    _check_tensor(tensor)
    splits_dtype = torch.int32
    if isinstance(splits, torch.Tensor):
        # Refused by type before anything else, so every rank refuses alike.
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise TypeError(f"alltoall splits must be integers (rows for each rank), got a "
                            f"tensor of {splits.dtype}")
        splits_dtype = splits.dtype
        splits = splits.tolist()
    elif splits is not None:
        splits = list(splits)
    buf, cap = _export(tensor)

    def finish(h):
        out = _output_on(tensor)(h)
        return out, torch.tensor(h.recv_splits(), dtype=splits_dtype)

    return _ops.alltoall_async(cap, splits=splits, name=name, process_set=process_set,
                               keep=(tensor, buf), finish=finish, blocking=blocking)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(_alltoall_async(tensor, splits, name, process_set, True))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_):
        grad, _ = synchronize(_alltoall_async(grad_output, ctx.received, None, ctx.process_set,
                                              True))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter rows of ``tensor`` to every rank and gather the rows sent to this one.

    Returns the gathered tensor, and, when ``splits`` is given, also the tensor of
    rows received from each rank (as Horovod 0.28 does). Differentiable.
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# --------------------------------------------------------------------------- reducescatter

def _check_reducescatter(tensor):
    _check_tensor(tensor)
    if tensor.dim() == 0:
        raise ValueError("Reducescatter does not support scalar inputs: it scatters the rows "
                         "of a tensor of one dimension or more")


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start a reduce-scatter: reduce ``tensor`` over the set, keep this rank's rows.

    Dim 0 is split as evenly as possible, the first ``d0 % size`` ranks getting one
    more row. ``synchronize`` returns this rank's block.
    """
    return _reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                postscale_factor, False)


def _reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor,
                         blocking):
    """:func:`reducescatter_async`; ``blocking`` as for :func:`_broadcast_async`."""
    _check_reducescatter(tensor)
    buf, cap = _export(tensor)
    return _ops.reducescatter_async(cap, name=name, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=process_set,
                                    keep=(tensor, buf), finish=_output_on(tensor),
                                    blocking=blocking)


def _reducescatter_grads(grads, op, process_set, scale):
    """Horovod 0.28's gradient of a reducescatter: the output gradients times the prescale
    and postscale factors (``scale``), times the set's size for Sum (not divided for
    Average), gathered back to every rank's rows (so learning rates tuned under Horovod
    stay right)."""
    if op not in (Average, Sum):
        raise UnsupportedOperationError(
            "reducescatter gradients exist for Sum and Average only")
    if op == Sum:
        scale *= _ps_size(process_set)
    handles = [_allgather_concat_async(g * scale if scale != 1.0 else g, None, process_set)
               for g in grads]
    return [synchronize(h) for h in handles]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        return synchronize(_reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                                postscale_factor, True))

    @staticmethod
    def backward(ctx, grad_output):
        grad, = _reducescatter_grads([grad_output], *ctx.args)
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over the set and return this rank's block of rows.

    Differentiable as in Horovod: the gradient is the output gradients times the scale
    factors (and the set's size for Sum), allgathered."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start reduce-scattering each tensor of a list; ``synchronize`` returns a list."""
    for t in tensors:
        _check_reducescatter(t)
    return _ops.GroupHandle([
        reducescatter_async(t, n, op, process_set, prescale_factor, postscale_factor)
        for t, n in zip(tensors, _group_names(name, len(tensors)))])


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *_reducescatter_grads(list(grads), *ctx.args))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter each tensor of a list; returns the list of this rank's blocks
    (differentiable, as :func:`reducescatter`)."""
    if not tensors:
        return []
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                       postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(outs, ctxs)]


# --------------------------------------------------------------------------- completion

def poll(handle):
    """True once the asynchronous operation behind ``handle`` has completed."""
    return handle.poll()


def synchronize(handle):
    """Wait for ``handle``'s operation and return its result.

    Allreduce, allgather, broadcast and reducescatter give a tensor; alltoall gives
    ``(output, received_splits)``; grouped operations a list. Raises
    ``HorovodInternalError`` when the collective failed.
    """
    if handle is None:
        return None
    return handle.wait()


def join(device=-1):
    """Declare that this rank has no more data; returns the rank that joined last.

    Until every rank joined, this rank contributes zeros to the allreduces the
    others still run. ``device`` is accepted for Horovod compatibility (CPU only).
    """
    return _ops.join()


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` has reached the barrier."""
    _ops.barrier(process_set)

"""The ``perseus`` backend of torch.distributed (docs/torch_distributed.md).

``import perseus`` registers it: ``dist.init_process_group("perseus")`` (or a device map
naming it, ``"cpu:perseus,cuda:nccl"``), and ``new_group(..., backend="perseus")``, give
process groups whose collectives run on the Perseus core. The group is a Python
``torch.distributed.ProcessGroup`` (torch's own mechanism for out-of-tree backends), so
nothing of libtorch is linked into the core.

Each group reduces over a Perseus process set of its ranks: the global set for the
default group, one its members register among themselves for a subgroup. Its operations
are unnamed: the core names them by their order, which torch already requires to be the
same on every rank of a group. Each returns a :class:`Work` whose ``wait()`` waits on
the calling thread and whose ``get_future()`` (DDP, ``async_op=True`` callbacks)
completes from Perseus's completion thread.
"""

import threading

import torch
import torch.distributed as dist

from perseus.common import knobs
from perseus.common import ops as _ops
from perseus.common.exceptions import HorovodInternalError
from perseus.torch import completion, startup
from perseus.torch.horovod import mpi_ops

NAME = "perseus"

_RedOp = dist.ReduceOp.RedOpType
# torch's reduction -> Perseus's (PREMUL_SUM and the bitwise ones are handled apart).
_OPS = {_RedOp.SUM: _ops.Sum, _RedOp.AVG: _ops.Average, _RedOp.PRODUCT: _ops.Product,
        _RedOp.MIN: _ops.Min, _RedOp.MAX: _ops.Max}
_BITWISE = {_RedOp.BAND: torch.bitwise_and, _RedOp.BOR: torch.bitwise_or,
            _RedOp.BXOR: torch.bitwise_xor}


class UnsupportedError(RuntimeError):
    """What torch asked of the ``perseus`` backend that it cannot do, named."""


# --------------------------------------------------------------------------- work

class Work(dist.Work):
    """One operation of the backend. ``finish(result)`` turns the core's result into the
    list of output tensors (writing them where torch wants them); ``wait()`` and the
    future both run it once."""

    def __init__(self, handle, finish, devices=None, limit=None):
        super().__init__()
        self._handle = handle
        self._finish = finish
        self._limit = limit  # (seconds, the group's ranks): the group's timeout
        self._lock = threading.Lock()
        self._done = False
        self._value = None
        self._error = None
        self._devices = devices
        self._future = None
        if not BACKEND_CLASS:
            _unfinished.add(self)

    def _complete(self, timeout=None):
        with self._lock:
            if not self._done:
                try:
                    result = None if self._handle is None else self._wait(timeout)
                    self._value = self._finish(result)
                except TimeoutError:
                    self._error = _timed_out(self._limit, timeout)
                except Exception as e:  # noqa: BLE001 - raised by wait() and the future
                    self._error = e
                self._done = True
                self._handle = None
                _unfinished.discard(self)
        if self._error is not None:
            raise self._error
        return self._value

    def _wait(self, timeout):
        """The handle's result, within ``timeout`` (seconds) or the group's timeout."""
        if timeout is None and self._limit is not None:
            timeout = self._limit[0]
        return self._handle.wait() if timeout is None else self._handle.wait(timeout)

    def wait(self, timeout=None):
        """Wait for the operation; raises its error (``HorovodInternalError`` and its
        kinds) when it failed, and torch's ``DistBackendError`` when it did not finish
        within ``timeout`` (a ``timedelta``; none or zero: the group's timeout, from
        ``init_process_group`` or ``new_group``)."""
        self._complete(_seconds(timeout))
        return True

    def is_completed(self):
        """Whether the operation finished (a failure counts)."""
        return self._done or (self._handle is not None and self._handle.poll())

    def is_success(self):
        """Whether the operation finished without an error."""
        return self._done and self._error is None

    def exception(self):
        """The operation's error, or None."""
        return self._error

    def result(self):
        """The output tensors, once finished."""
        return self._complete()

    def get_future(self):
        """A ``torch.futures.Future`` of the output tensors, completed by Perseus's
        completion thread (or already, when the work finished)."""
        if self._future is None:
            future = torch.futures.Future(devices=self._devices)
            if BACKEND_CLASS:
                completion.completions().submit(self._complete, future)
            else:
                # Older torch waits on the future from C++ holding the GIL (DDP's check
                # of the parameters' shapes), so Perseus's thread could not complete it.
                try:
                    future.set_result(self._complete())
                except Exception as e:  # noqa: BLE001 - raised through the callback
                    future.set_exception(e)
            # An error set on the future is no error when torch reads it from C++; one
            # raised by a callback is.
            self._future = future.then(completion._value)
        return self._future


# Before torch 2.9 torch keeps only the C++ part of a work a Python backend returns: the
# Python object, which its wait() and get_future() live on, must be kept here until the
# work finished, or torch's wait() finds none and waits forever.
_unfinished = set()


def _seconds(timeout):
    """A torch timeout (``timedelta``, seconds, or none) in seconds; None for none or
    zero (torch's "the default")."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


def _timed_out(limit, timeout):
    """torch's error for an operation of the ``perseus`` backend past its timeout."""
    seconds = timeout if timeout is not None else limit[0] if limit else None
    group = f"the group of ranks {limit[1]}" if limit else "its group"
    return dist.DistBackendError(
        f"perseus: an operation of {group} did not finish within {seconds:g} s (the "
        f"timeout given to wait(), or the group's from init_process_group or new_group): "
        f"a rank of the group has not reached it, or is stuck. The operation is still in "
        f"flight; the stall check (PERSEUS_STALL_CHECK_TIME_SECONDS) names the ranks "
        f"missing from it")


def _joined(works):
    """One work for several: it finishes with all of them, their outputs in order."""
    return Work(None, lambda _result: [t for w in works for t in w.result()])


# --------------------------------------------------------------------------- the group

def _one(tensors, what):
    if len(tensors) != 1:
        raise UnsupportedError(f"perseus: {what} takes one tensor per process (torch's "
                               f"multi-device form is gone), got {len(tensors)}")
    return tensors[0]


def _plain(t):
    """``t``, or for a bool tensor its bytes (uint8, the same storage): DLPack has no
    bool before torch 2.2."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _landing(output):
    """A contiguous host ``output`` as the buffer a collective writes its result into
    (its bytes, and their DLPack capsule); ``(None, None)`` for any other, which gets
    the core's result copied in."""
    if output.is_cpu and output.is_contiguous():
        buf = _plain(output.detach())
        return buf, mpi_ops._capsule(buf)
    return None, None


def _core_result(handle):
    """The result the core made for ``handle``, or None when it wrote the caller's
    output (see :func:`_landing`)."""
    capsule = handle.output()
    return None if capsule is None else torch.from_dlpack(capsule)


def _landed(output, result):
    """``output``, holding ``result`` where the core did not write it in place."""
    return output if result is None else _written(output, result)


def _devices(tensor):
    return [tensor.device] if tensor.is_cuda else None


def _written(dst, src):
    """``dst`` holding ``src``'s values (shape aside); returns ``dst``."""
    with torch.no_grad():
        dst.view(-1).copy_(src.reshape(-1)) if dst.is_contiguous() else \
            dst.copy_(src.reshape(dst.shape))
    return dst


class _Collectives:
    """The collectives, over ``self._ranks`` (global ranks, by group rank) and Perseus
    process set ``self._ps``; mixed into a torch ``Backend`` or ``ProcessGroup``."""

    def _setup(self, ranks, process_set, timeout=None):
        self._ranks = list(ranks)
        self._ps = process_set
        seconds = _seconds(timeout)
        self._limit = None if seconds is None else (seconds, self._ranks)
        self._lanes = _Lanes(process_set, self._limit)

    def getBackendName(self):
        return NAME

    def __repr__(self):
        return f"<perseus {type(self).__name__} of ranks {self._ranks}>"

    # ------------------------------------------------------------------ helpers

    def _work(self, handle, finish, devices=None):
        return Work(handle, finish, devices, self._limit)

    def _global(self, group_rank, what):
        if not 0 <= group_rank < len(self._ranks):
            raise ValueError(f"perseus: {what} rank {group_rank} is not a rank of this "
                             f"group of {len(self._ranks)}")
        return self._ranks[group_rank]

    def _reduction(self, op):
        """``(Perseus op, prescale factor)`` for torch's ``op``; bitwise ones: (None, fn)."""
        kind = getattr(op, "op", op)  # a ReduceOp, or its RedOpType
        if kind in _OPS:
            return _OPS[kind], 1.0
        if kind in _BITWISE:
            return None, _BITWISE[kind]
        if kind == _RedOp.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if factor is None:
                raise UnsupportedError("perseus: this torch gives Python backends no "
                                       "PREMUL_SUM factor; use SUM and scale the tensor")
            if isinstance(factor, torch.Tensor):
                factor = float(factor.reshape(-1)[0])
            return _ops.Sum, float(factor)
        raise UnsupportedError(f"perseus: no reduction {kind}")

    def _allreduce_work(self, tensor, op, blocking=True):
        given = tensor
        if tensor.dtype == torch.bool:  # as gloo: a sum is an "or", a product an "and"
            kind = getattr(op, "op", op)  # a ReduceOp, or its RedOpType
            op = (_RedOp.MIN if kind in (_RedOp.MIN, _RedOp.PRODUCT, _RedOp.BAND) else
                  _RedOp.BXOR if kind == _RedOp.BXOR else _RedOp.MAX)
            tensor = _plain(tensor)
        rop, extra = self._reduction(op)
        if rop is None:  # bitwise: every rank's values, combined here
            handle = mpi_ops.stacked_allgather_async(tensor, process_set=self._ps)

            def finish(stacked):
                out = stacked[0]
                for row in stacked[1:]:
                    out = extra(out, row)
                return [_written(given, out)]
            return self._work(handle, finish, _devices(tensor))
        # Blocking: a caller that waits at once may see a small one complete among the
        # callers before this returns (PERSEUS_LANE_BYTES), after waiting up to
        # PERSEUS_LANE_PATIENCE_US for the others.
        handle = mpi_ops._allreduce_async(tensor, None, None, rop, extra, 1.0, self._ps,
                                          blocking=blocking)
        return self._work(handle, lambda _r: [given], _devices(tensor))

    # ------------------------------------------------------------------ allreduce

    def allreduce(self, tensors, opts=None):
        """``all_reduce``: every ReduceOp (bitwise ones by gathering the values)."""
        tensor = _one(tensors, "all_reduce")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # The lane only for a caller that waits at once (async_op=False, torch 2.6 and
        # later say so): DDP's gradient buckets (asyncOp=True) overlap the backward pass
        # and must not wait for the other ranks here.
        blocking = not getattr(opts, "asyncOp", False)
        return self._allreduce_work(tensor, op, blocking)

    def allreduce_coalesced(self, tensors, opts=None):
        """``all_reduce_coalesced``: the tensors reduced in one batch (fused)."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        rop, extra = self._reduction(op)
        if rop is None:
            works = [self._allreduce_work(t, op) for t in tensors]
            return _joined(works)
        handle = mpi_ops.grouped_allreduce_async_(list(tensors), op=rop, prescale_factor=extra,
                                                  process_set=self._ps)
        return self._work(handle, lambda _r: list(tensors), _devices(tensors[0]) if tensors else None)

    def reduce(self, tensors, opts):
        """``reduce``: the root's tensor gets the reduction; the others' stay as they were."""
        tensor = _one(tensors, "reduce")
        self._global(opts.rootRank, "reduce's root")
        rop, extra = self._reduction(opts.reduceOp)
        mine = opts.rootRank == self.rank()
        if rop is None:
            inner = self._allreduce_work(tensor.clone(), opts.reduceOp)
            return self._work(None, lambda _r: [_written(tensor, inner.result()[0]) if mine
                                          else tensor])
        # Blocking, as all_reduce's: a small one may complete among the callers.
        handle = mpi_ops._allreduce_async(tensor, mpi_ops._new_output(tensor), None, rop, extra,
                                          1.0, self._ps, blocking=True)
        return self._work(handle, lambda out: [_written(tensor, out) if mine else tensor],
                    _devices(tensor))

    # ------------------------------------------------------------------ gathers

    def _gather_flat(self, tensor):
        """A handle whose result is every rank's ``tensor`` flattened, concatenated in
        rank order (sizes may differ between ranks)."""
        return mpi_ops._allgather_concat_async(_plain(tensor).reshape(-1), None, self._ps,
                                               blocking=True)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``all_gather``: ``output_tensors[0][i]`` gets rank i's tensor."""
        tensor = _one(input_tensors, "all_gather")
        outputs = _one(output_tensors, "all_gather")
        self._check_count(outputs, "all_gather's output list")
        handle = self._gather_flat(tensor)

        def finish(flat):
            self._scatter_into(flat, outputs, "all_gather")
            return list(outputs)
        return self._work(handle, finish, _devices(tensor))

    def _check_count(self, tensors, what):
        if len(tensors) != self.size():
            raise ValueError(f"perseus: {what} holds {len(tensors)} tensors for a group of "
                             f"{self.size()} ranks")

    @staticmethod
    def _scatter_into(flat, outputs, what):
        sizes = [t.numel() for t in outputs]
        if sum(sizes) != flat.numel():
            raise ValueError(f"perseus: {what}: the ranks sent {flat.numel()} elements in "
                             f"all, the outputs hold {sum(sizes)}")
        for out, part in zip(outputs, torch.split(flat, sizes)):
            _written(out, part)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """``all_gather_coalesced``: each input gathered into its output list."""
        works = [self.allgather([outs], [t]) for outs, t in zip(output_lists, input_tensors)]
        return _joined(works)

    def _allgather_into(self, output, input):
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"perseus: all_gather_into_tensor's output holds "
                             f"{output.numel()} elements; {self.size()} ranks of "
                             f"{input.numel()} need {input.numel() * self.size()}")
        src, cap = mpi_ops._export(_plain(input).reshape(-1))
        dst, out_cap = _landing(output)
        # Blocking, as all_reduce's: a small one may complete among the callers.
        handle = _ops.allgather_async(cap, stack=False, process_set=self._ps,
                                      keep=(input, src, dst), finish=_core_result,
                                      out=out_cap, blocking=True)
        return self._work(handle, lambda flat: [_landed(output, flat)], _devices(input))

    def _allgather_base(self, output, input, opts=None):
        """``all_gather_into_tensor`` (torch before 2.6)."""
        return self._allgather_into(output, input)

    def all_gather_single(self, output, input, opts=None):
        """``all_gather_into_tensor``."""
        return self._allgather_into(output, input)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_into_tensor`` under a coalescing manager."""
        works = [self._allgather_into(o, i) for o, i in zip(outputs, inputs)]
        return _joined(works)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        """``gather``: the root's ``output_tensors[0][i]`` gets rank i's tensor."""
        tensor = _one(input_tensors, "gather")
        self._global(opts.rootRank, "gather's root")
        mine = opts.rootRank == self.rank()
        outputs = _one(output_tensors, "gather") if mine else []
        if mine:
            self._check_count(outputs, "gather's output list")
        handle = self._gather_flat(tensor)

        def finish(flat):
            if mine:
                self._scatter_into(flat, outputs, "gather")
            return list(outputs)
        return self._work(handle, finish, _devices(tensor))

    # ------------------------------------------------------------------ broadcast, scatter

    def broadcast(self, tensors, opts):
        """``broadcast`` from ``opts.rootRank`` (a rank of the group)."""
        tensor = _one(tensors, "broadcast")
        root = self._global(opts.rootRank, "broadcast's root")
        # Blocking, as all_reduce's: a small one may complete among the callers.
        handle = mpi_ops._broadcast_async_(_plain(tensor), root, None, self._ps, True)
        return self._work(handle, lambda _r: [tensor], _devices(tensor))

    def scatter(self, output_tensors, input_tensors, opts):
        """``scatter``: rank i's tensor gets the root's ``input_tensors[0][i]``."""
        out = _one(output_tensors, "scatter")
        self._global(opts.rootRank, "scatter's root")
        mine = opts.rootRank == self.rank()
        size = self.size()
        if mine:
            inputs = _one(input_tensors, "scatter")
            self._check_count(inputs, "scatter's input list")
            flat = torch.cat([_plain(t).reshape(-1) for t in inputs])
            splits = [t.numel() for t in inputs]
        else:
            flat = _plain(out).new_empty(0)
            splits = [0] * size
        handle = mpi_ops._alltoall_async(flat, splits, None, self._ps, True)
        return self._work(handle, lambda result: [_written(out, result[0])], _devices(out))

    # ------------------------------------------------------------------ reduce-scatter

    def _reduce_scatter_flat(self, output, flat, op, what):
        """``output`` gets this rank's block of the reduction of ``flat`` (of
        ``size * output.numel()`` elements)."""
        if flat.numel() != output.numel() * self.size():
            raise ValueError(f"perseus: {what}'s input holds {flat.numel()} elements; "
                             f"{self.size()} ranks of {output.numel()} need "
                             f"{output.numel() * self.size()}")
        rop, extra = self._reduction(op)
        if rop is None:
            inner = self._allreduce_work(flat.clone(), op)
            start = self.rank() * output.numel()
            return self._work(None, lambda _r: [_written(
                output, inner.result()[0][start:start + output.numel()])])
        src, cap = mpi_ops._export(flat.reshape(self.size(), -1))
        dst, out_cap = _landing(output)
        # Blocking, as all_reduce's: a small one may complete among the callers.
        handle = _ops.reducescatter_async(cap, op=rop, prescale_factor=extra,
                                          process_set=self._ps, keep=(flat, src, dst),
                                          finish=_core_result, out=out_cap, blocking=True)
        return self._work(handle, lambda block: [_landed(output, block)], _devices(output))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        """``reduce_scatter``: this rank's tensor gets the reduction of every rank's
        ``input_tensors[0][rank]``."""
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_tensors, "reduce_scatter")
        self._check_count(inputs, "reduce_scatter's input list")
        sizes = {t.numel() for t in inputs}
        if sizes != {out.numel()}:
            raise ValueError(f"perseus: reduce_scatter's inputs hold {sorted(sizes)} "
                             f"elements, its output {out.numel()}: they must match")
        flat = torch.cat([t.reshape(-1) for t in inputs])
        return self._reduce_scatter_flat(out, flat, opts.reduceOp, "reduce_scatter")

    def _reduce_scatter_base(self, output, input, opts):
        """``reduce_scatter_tensor`` (torch before 2.6)."""
        return self._reduce_scatter_flat(output, input.reshape(-1), opts.reduceOp,
                                         "reduce_scatter_tensor")

    def reduce_scatter_single(self, output, input, opts):
        """``reduce_scatter_tensor``."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        """``reduce_scatter_tensor`` under a coalescing manager."""
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined(works)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ------------------------------------------------------------------ all-to-all

    def _alltoall_rows(self, output, input, output_splits, input_splits):
        size = self.size()
        rows = input.shape[0] if input.dim() else 1
        if not input_splits:
            if rows % size:
                raise ValueError(f"perseus: all_to_all_single: {rows} rows do not split "
                                 f"evenly over {size} ranks; give input_split_sizes")
            input_splits = [rows // size] * size
        expected = list(output_splits) if output_splits else None
        src, cap = mpi_ops._export(_plain(input))
        dst, out_cap = _landing(output)
        handle = _ops.alltoall_async(cap, splits=[int(k) for k in input_splits],
                                     process_set=self._ps, keep=(input, src, dst),
                                     finish=lambda h: (_core_result(h), h.recv_splits()),
                                     out=out_cap, blocking=True)

        def finish(result):
            out, received = result
            got = [int(n) for n in received]
            if expected is not None and got != expected:
                raise ValueError(f"perseus: all_to_all_single: output_split_sizes "
                                 f"{expected}, but the ranks sent {got} rows")
            return [_landed(output, out)]
        return self._work(handle, finish, _devices(input))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``all_to_all_single`` (torch before 2.6)."""
        return self._alltoall_rows(output, input, output_split_sizes, input_split_sizes)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """``all_to_all_single``: rows of ``input`` to each rank by ``input_split_sizes``."""
        return self._alltoall_rows(output, input, output_split_sizes, input_split_sizes)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``all_to_all``: ``input_tensors[i]`` to rank i; ``output_tensors[i]`` from it."""
        self._check_count(input_tensors, "all_to_all's input list")
        self._check_count(output_tensors, "all_to_all's output list")
        flat = torch.cat([_plain(t).reshape(-1) for t in input_tensors])
        handle = mpi_ops._alltoall_async(flat, [t.numel() for t in input_tensors], None,
                                         self._ps, True)

        def finish(result):
            self._scatter_into(result[0], output_tensors, "all_to_all")
            return list(output_tensors)
        return self._work(handle, finish, _devices(flat))

    # ------------------------------------------------------------------ point to point

    def _p2p(self, tensor, peer, tag, sending):
        me = self._ranks[self.rank()]
        other = self._global(peer, "the peer")
        if other == me:
            raise ValueError(f"perseus: rank {me} cannot {'send to' if sending else 'receive from'}"
                             " itself")
        src, dst = (me, other) if sending else (other, me)
        return self._lanes.submit(tensor, src, dst, tag)

    def send(self, tensors, dstRank, tag=0):
        """``send``/``isend`` to group rank ``dstRank``: a broadcast from this rank in the
        process set of the two ranks, named by direction, tag and count."""
        return self._p2p(_one(tensors, "send"), dstRank, tag, True)

    def recv(self, tensors, srcRank, tag=0):
        """``recv``/``irecv`` from group rank ``srcRank`` (see :meth:`send`)."""
        return self._p2p(_one(tensors, "recv"), srcRank, tag, False)

    def recvAnysource(self, tensors, tag=0):
        raise UnsupportedError("perseus: recv from any source is not supported: name the "
                               "source rank")

    recv_anysource = recvAnysource

    # ------------------------------------------------------------------ barrier

    def barrier(self, opts=None):
        """``barrier``: every rank of the group reached it."""
        return self._work(_ops.barrier_async(self._ps), lambda _r: [])


# torch 2.9 and later let Python subclass a c10d Backend: torch's own ProcessGroup then
# holds it for the devices a map gives it, next to other backends (NCCL for CUDA), and
# everything of torch that knows process groups (torch.compile, split_group, group
# names) works as with gloo. Before, a backend in Python is a whole ProcessGroup.
try:
    from torch._C._distributed_c10d import Backend as _C10dBackend

    class _Probe(_C10dBackend):
        pass

    _Probe(0, 1)
    BACKEND_CLASS = True
except (ImportError, TypeError):  # "No constructor defined!"
    _C10dBackend, BACKEND_CLASS = None, False


if BACKEND_CLASS:
    class PerseusBackend(_Collectives, _C10dBackend):
        """The ``perseus`` c10d backend, held by one of torch's process groups."""

        def __init__(self, rank, size, ranks, process_set, timeout=None):
            super().__init__(rank, size)
            self._setup(ranks, process_set, timeout)
            self._options = _C10dBackend.Options(NAME)
            if timeout is not None:
                self._options._timeout = timeout

        @property
        def options(self):
            # Defined here: torch's C++ side reads a Python backend's options through
            # this attribute, and the inherited one would call back into it forever.
            return self._options

        @property
        def supports_coalescing(self):
            return False

        @property
        def supports_splitting(self):
            # torch asks a backend to split on the ranks outside the split too, and
            # cannot take a Python backend's "none": split_group is served apart
            # (:func:`_split_group`).
            return False


class ProcessGroupPerseus(_Collectives, dist.ProcessGroup):
    """The ``perseus`` backend as a whole torch ProcessGroup (torch before 2.9)."""

    def __init__(self, rank, size, ranks, process_set, timeout=None):
        super().__init__(rank, size)
        self._setup(ranks, process_set, timeout)
        self._group_name = self._group_desc = ""

    def name(self):
        return NAME

    # A group without C++ backends keeps its name and description itself.
    def getGroupName(self):
        return self._group_name

    def setGroupName(self, name):
        self._group_name = name

    def getGroupDesc(self):
        return self._group_desc

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def _get_backend(self, device):
        # torch asks a group's backend for a device (batch_isend_irecv, for whether it
        # coalesces): the group is its own backend, and does not coalesce.
        return self


# --------------------------------------------------------------------------- point to point

class _Lanes:
    """Point-to-point transfers: each pair of ranks shares a Perseus process set of the
    two, registered by them alone at their first transfer. That registration blocks
    until the peer reaches its own first transfer with this rank, so it runs on a
    thread of that peer's lane: ``isend`` returns at once even when the peer is busy
    sending to a third rank (a ring of sends completes). Transfers are named
    ``p2p.SRC>DST.TAG.COUNT``, counted on each side alike, so the n-th send from SRC to
    DST with TAG meets the n-th receive there, as torch defines it."""

    def __init__(self, process_set, limit=None):
        self._world = process_set
        self._limit = limit  # the group's timeout, for each transfer's work
        self._lock = threading.Lock()
        self._sets = {}  # peer -> its pair's process set, once registered
        self._queues = {}  # peer -> queue of transfers waiting for the registration
        self._counts = {}

    def _name(self, src, dst, tag):
        key = (src, dst, tag)
        with self._lock:
            self._counts[key] = k = self._counts.get(key, 0) + 1
        return f"p2p.{src}>{dst}.{tag}.{k}"

    def submit(self, tensor, src, dst, tag):
        from perseus import _core

        me = _core.rank()
        peer = dst if src == me else src
        name = self._name(src, dst, tag)
        work = _Deferred(tensor, self._limit)
        with self._lock:
            ps = self._sets.get(peer)
            if ps is None and _core.size() == 2 and self._world.process_set_id == 0:
                ps = self._sets[peer] = self._world
            if ps is None:
                waiting = self._queues.get(peer)
                if waiting is None:
                    self._queues[peer] = waiting = [(work, src, name)]
                    threading.Thread(target=self._register, args=(peer,), daemon=True,
                                     name=f"perseus-p2p-{peer}").start()
                else:
                    waiting.append((work, src, name))
                return work
        work.start(ps, src, name)
        return work

    def _register(self, peer):
        from perseus import _core

        try:
            ps = startup.set_of_ranks(tuple(sorted((_core.rank(), peer))))
            error = None
        except Exception as e:  # noqa: BLE001 - each waiting transfer raises it
            ps, error = None, e
        with self._lock:
            waiting = self._queues.pop(peer)
            if ps is not None:
                self._sets[peer] = ps
        for work, src, name in waiting:
            if error is not None:
                work.fail(error)
            else:
                work.start(ps, src, name)


class _Deferred(Work):
    """A transfer's work, whose collective may start later (see :class:`_Lanes`)."""

    def __init__(self, tensor, limit=None):
        super().__init__(None, lambda _r: [tensor], _devices(tensor), limit)
        self._tensor = tensor
        self._started = threading.Event()
        self._failure = None

    def start(self, ps, src, name):
        try:
            self._handle = mpi_ops.broadcast_async_(_plain(self._tensor), src, name=name,
                                                    process_set=ps)
        except Exception as e:  # noqa: BLE001 - raised by wait()
            self._failure = e
        self._started.set()

    def fail(self, error):
        self._failure = error
        self._started.set()

    def _complete(self, timeout=None):
        # The timeout bounds the wait for the pair's registration (the peer's first
        # transfer with this rank) and then the transfer's own.
        limit = timeout if timeout is not None else self._limit[0] if self._limit else None
        if not self._started.wait(limit):
            with self._lock:
                if not self._done:
                    self._error, self._done = _timed_out(self._limit, timeout), True
        elif self._failure is not None:
            self._error, self._done = self._failure, True
        return super()._complete(timeout)

    def is_completed(self):
        return self._started.is_set() and super().is_completed()


# --------------------------------------------------------------------------- registration

def _create(options, backend_options=None):
    """torch's creator of a ``perseus`` group (its extended form, which gives the group's
    global ranks)."""
    rank, size = options.group_rank, options.group_size
    ranks = list(options.global_ranks_in_group) or list(range(size))
    if ranks != sorted(ranks):
        raise UnsupportedError(f"perseus: a group's ranks must be in increasing order, got "
                               f"{ranks}")
    if not options.global_ranks_in_group:  # the default group: Perseus starts with it
        startup.start(rank, size, options.store)
    cls = PerseusBackend if BACKEND_CLASS else ProcessGroupPerseus
    return cls(rank, size, ranks, _process_set_of(ranks), options.timeout)


def _process_set_of(ranks):
    """The Perseus process set of global ``ranks`` (sorted), registered by them alone the
    first time (a collective over them)."""
    from perseus import _core

    if not _core.is_initialized():
        raise HorovodInternalError("perseus: a subgroup needs Perseus running: make the "
                                   "default group with the perseus backend first")
    if len(ranks) == _core.size():
        return mpi_ops.global_process_set
    return startup.set_of_ranks(tuple(ranks))


def serving(requested):
    """The backend that serves an ``init_process_group(requested)`` after ``import
    perseus``: ``perseus`` in place of gloo (``"gloo"``, or no choice on a machine
    without CUDA, where torch would take gloo), unless ``PERSEUS_DDP=0``; anything
    else as asked. A device map stays as it is. Before torch 2.9 (no c10d Backend in
    Python) gloo stays: the backend is then a whole ProcessGroup, which torch.compile
    and split_group do not take as they take gloo's."""
    try:
        on = knobs.get("PERSEUS_DDP")
    except ValueError:  # said by name when a DDP model is built
        on = False
    if not on or not BACKEND_CLASS or NAME.upper() not in dist.Backend._plugins:
        return requested
    if requested is None:
        return NAME if not torch.cuda.is_available() else None
    if str(requested).lower() == "gloo":
        return NAME
    return requested


_original_split_group = None


def _split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None,
                 group_desc=None, *args, **kwargs):
    """``split_group`` of a ``perseus`` group: each rank of the parent makes the group of
    its own split with ``new_group(..., use_local_synchronization=True)`` (its ranks
    sorted); a rank in no split gets ``GroupMember.NON_GROUP_MEMBER``. Other groups
    split as torch splits them."""
    parent = parent_pg if parent_pg is not None else dist.distributed_c10d._get_default_group()
    if dist.get_backend(parent) != NAME:
        return _original_split_group(parent_pg, split_ranks, timeout, pg_options, group_desc,
                                     *args, **kwargs)
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    globals_of = dist.get_process_group_ranks(parent)
    me = dist.get_rank(parent)
    mine = None
    for split in split_ranks:
        if not split or len(split) != len(set(split)):
            raise ValueError(f"a split group cannot be empty or hold a rank twice: {split}")
        if me in split:
            mine = split
    if mine is None:
        return dist.GroupMember.NON_GROUP_MEMBER
    return dist.new_group(ranks=sorted(globals_of[r] for r in mine), timeout=timeout,
                          backend=NAME, use_local_synchronization=True,
                          group_desc=group_desc)


def register():
    """Register the ``perseus`` backend with torch.distributed (``import perseus`` does;
    idempotent), and serve ``split_group`` of its groups."""
    global _original_split_group
    if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    # Perseus records its collectives itself (its flight recorder, docs/reliability.md):
    # torch's recorder for backends that do not, a hook on every collective, would cost
    # about 100 µs a call for the same record.
    recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(recording, set):
        recording.add(NAME)
    if hasattr(dist, "split_group") and _original_split_group is None:
        _original_split_group = dist.split_group
        _split_group.__wrapped__ = dist.split_group
        _split_group.__doc__ = dist.split_group.__doc__
        dist.split_group = dist.distributed_c10d.split_group = _split_group

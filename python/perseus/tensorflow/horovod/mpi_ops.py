"""Collectives on TensorFlow tensors: the ``horovod.tensorflow`` operations of Horovod 0.28.

Every function works in eager mode and inside graphs (see :mod:`.bridge` for how and
what it costs), and is differentiable as Horovod's ops are: the gradient of an
allreduce is the same allreduce of the gradient; of an allgather, the averaged
gradient sliced back to this rank's rows; of a broadcast, the averaged gradient on
the root and zeros elsewhere; of an alltoall, the reverse alltoall; of a
reduce-scatter, the gathered gradient.
"""

import tensorflow as tf

from perseus import _core
from perseus.common import basics as _basics
from perseus.common import ops as _ops
from perseus.common.basics import (  # noqa: F401 - re-exported
    ccl_built,
    counters,
    cross_rank,
    cross_size,
    ddl_built,
    gloo_built,
    gloo_enabled,
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
)
from perseus.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from perseus.common.process_sets import (  # noqa: F401 - re-exported
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from perseus.common.process_sets import process_set_id as _ps_id
from perseus.common.process_sets import process_set_size as _ps_size
from perseus.common.process_sets import set_rank as _set_rank
from perseus.common.timeline import start_timeline, stop_timeline  # noqa: F401
from perseus.tensorflow.horovod import bridge as _bridge
from perseus.tensorflow.horovod.compression import Compression
from perseus.tensorflow.horovod.errors import InvalidArgumentError as _InvalidArgument


def init(comm=None, process_sets=None):
    """Start Perseus on this rank (see :func:`perseus.common.basics.init`)."""
    _basics.init(comm, process_sets)


def cuda_built():
    """False: Perseus's NCCL path serves PyTorch's CUDA tensors only; TensorFlow's GPU
    tensors cross through host memory (docs/gpu.md)."""
    return False


def _rows_shape(shape):
    """Static shape of a result whose first dimension is only known at run time."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else tf.TensorShape([None])


# --------------------------------------------------------------------------- eager bodies
# Each takes eager tensors, submits to the core and waits; ``run`` calls it directly
# (eager) or from a py_function (graphs).

def allreduce_now(tensors, names, op, prescale_factor, postscale_factor, process_set,
                  gradient=False):
    """Reduce each eager tensor of ``tensors`` (submitted together); returns the results.
    Every copy is made before the first submission, so that the requests follow each
    other closely and the coordinator can fuse them."""
    handles = []
    copies = [_bridge.fresh_copy(t) for t in tensors]
    # A lone tensor is waited for at once: a small one may complete among the callers
    # (PERSEUS_LANE_BYTES).
    blocking = len(copies) == 1
    for (buf, cap), name in zip(copies, names):
        handles.append(_ops.allreduce_async(
            cap, cap, name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set, keep=buf,
            finish=lambda _h, b=buf: b, gradient=gradient, blocking=blocking))
    return _ops.GroupHandle(handles).wait()


def _allgather_now(tensors, names, stack, process_set):
    handles = []
    blocking = len(tensors) == 1  # as in allreduce_now
    for t, name in zip(tensors, names):
        src = tf.reshape(t, [1]) if not stack and t.shape.rank == 0 else t
        if stack:
            src = tf.expand_dims(src, 0)
        handles.append(_ops.allgather_async(
            _bridge.export(src), name=name, stack=stack, process_set=process_set, keep=src,
            finish=lambda h: _bridge.imported(h.output()), blocking=blocking))
    return _ops.GroupHandle(handles).wait()


def _group_names(name, n):
    return [None] * n if name is None else [f"{name}.{i}" for i in range(n)]


# --------------------------------------------------------------------------- allreduce

def _reduce_grad(op, prescale_factor, postscale_factor, process_set):
    def grad(*dys):
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"the gradient of an allreduce exists for Sum and Average only, not "
                f"{_ops._OP_NAMES.get(op, op)}")
        return _grouped_allreduce_raw(list(dys), None, op, prescale_factor, postscale_factor,
                                      process_set)
    return grad


def _grouped_allreduce_raw(tensors, name, op, prescale_factor, postscale_factor, process_set,
                           gradient=False):
    """Differentiable reduction of dense tensors, submitted as one group."""
    tensors = [_bridge.as_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = _bridge.op_name(name, "PerseusAllreduce")
    names = _group_names(name, len(tensors)) if len(tensors) > 1 else [name]

    @tf.custom_gradient
    def reduce(*xs):
        def body(*eager):
            return allreduce_now(eager, names, op, prescale_factor, postscale_factor,
                                 process_set, gradient)
        outs = _bridge.run(body, xs, [x.dtype for x in xs], "PerseusAllreduce")
        for out, x in zip(outs, xs):
            out.set_shape(x.shape)
        return outs, _reduce_grad(op, prescale_factor, postscale_factor, process_set)

    return list(reduce(*tensors))


def _sparse_allreduce(slices, name, op, process_set, prescale_factor=1.0,
                      postscale_factor=1.0):
    """IndexedSlices: every rank's values and indices gathered (Horovod's way), in one op."""
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    names = [f"{name}.values", f"{name}.indices"] if name else None
    values, indices = _grouped_allgather([slices.values, slices.indices], names, process_set,
                                         stack=False)
    if op == Average:
        values = values / tf.cast(_ps_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Average (or reduce with ``op``) ``tensor`` over the ranks of ``process_set``.

    Returns a new tensor (eager or symbolic, as the input). ``tf.IndexedSlices`` are
    reduced by gathering every rank's values and indices. ``compression`` applies on
    the wire; ``prescale_factor``/``postscale_factor`` multiply before/after the sum.
    ``name`` keys the operation across ranks (default: the call order, the same on
    every rank). ``device_*`` and ``ignore_name_scope`` are accepted for compatibility.
    """
    op = _ops.check_op(_ops.resolve_op(op, average))
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, process_set, prescale_factor,
                                 postscale_factor)
    compressed, ctx = compression.compress(_bridge.as_tensor(tensor))
    reduced = _grouped_allreduce_raw([compressed], name, op, prescale_factor, postscale_factor,
                                     process_set)[0]
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors as one group (one graph op); returns the list of results."""
    op = _ops.check_op(_ops.resolve_op(op, average))
    tensors = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    results = list(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _sparse_allreduce(t, name and f"{name}.{i}", op, process_set,
                                           prescale_factor, postscale_factor)
    compressed, ctxs = [], []
    for i in dense:
        c, ctx = compression.compress(_bridge.as_tensor(tensors[i]))
        compressed.append(c)
        ctxs.append(ctx)
    reduced = _grouped_allreduce_raw(compressed, name, op, prescale_factor,
                                     postscale_factor, process_set)
    for i, r, ctx in zip(dense, reduced, ctxs):
        results[i] = compression.decompress(r, ctx)
    return results


# --------------------------------------------------------------------------- allgather

def _allgather_concat(tensor, name, process_set):
    """Horovod's allgather (concatenate along dim 0) whatever PERSEUS_CHANGE_HVD_ALLGATHER."""
    return _grouped_allgather([tensor], [name], process_set, stack=False)[0]


def _gathered_shape(shape, stack, set_size):
    if stack:
        return tf.TensorShape([set_size]).concatenate(shape)
    return _rows_shape(shape) if shape.rank else tf.TensorShape([set_size])


def _allgather_grads(dys, xs, outs, stack, process_set):
    """Horovod's gradient of allgathers: each output gradient averaged over the set, then
    this rank's rows of it."""
    dys = [tf.zeros_like(o) if dy is None else dy for dy, o in zip(dys, outs)]
    reduced = _grouped_allreduce_raw(dys, None, Average, 1.0, 1.0, process_set)
    r = _set_rank(process_set)
    if stack:
        return [g[r] for g in reduced]
    rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else
                     tf.constant(1, tf.int64) for x in xs])
    counts = tf.reshape(_allgather_concat(rows, None, process_set), [-1, len(xs)])
    offsets = tf.reduce_sum(counts[:r], axis=0)
    grads = []
    for i, (g, x) in enumerate(zip(reduced, xs)):
        rest = tf.shape(g, out_type=tf.int64)[1:]
        part = tf.slice(g, tf.concat([offsets[i:i + 1], tf.zeros_like(rest)], 0),
                        tf.concat([rows[i:i + 1], rest], 0))
        grads.append(tf.reshape(part, tf.shape(x)))
    return grads


def _grouped_allgather(tensors, names, process_set, stack):
    """Gathers each tensor, all in one op (one submission batch, fused where they fit);
    ``names``: one per tensor, or None."""
    ts = [_bridge.as_tensor(t) for t in tensors]
    if not ts:
        return []
    set_size = _ps_size(process_set)
    names = [_bridge.op_name(n, "PerseusAllgather") for n in (names or [None] * len(ts))]

    @tf.custom_gradient
    def gather(*xs):
        def body(*e):
            return _allgather_now(e, names, stack, process_set)
        outs = _bridge.run(body, xs, [x.dtype for x in xs], "PerseusAllgather")
        for out, x in zip(outs, xs):
            out.set_shape(_gathered_shape(x.shape, stack, set_size))

        def grad(*dys):
            return _allgather_grads(dys, xs, outs, stack, process_set)
        return outs, grad

    return list(gather(*ts))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Gather ``tensor`` from every rank of the set.

    With ``PERSEUS_CHANGE_HVD_ALLGATHER=0`` (the default) every rank sends the same
    shape and the result stacks them: ``[set size, *tensor.shape]``. With ``=1`` the
    tensors are concatenated along dimension 0, as Horovod does, so their first
    dimensions may differ. Differentiable.
    """
    return _grouped_allgather([tensor], [name], process_set, _basics.allgather_stacks())[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Gather each tensor of a list (one op); returns the list of results. Differentiable."""
    tensors = list(tensors)
    names = _group_names(name, len(tensors)) if name is not None else None
    return _grouped_allgather(tensors, names, process_set, _basics.allgather_stacks())


# --------------------------------------------------------------------------- broadcast

def _broadcast_now(tensors, root_rank, names, process_set):
    # The root only sends: its input goes as it lies, and its result is a new tensor
    # object over the same (immutable) buffer, as Horovod's root gets a tensor of its own.
    # The others receive into new buffers, no copy of their input first.
    root = rank() == root_rank
    handles = []
    blocking = len(tensors) == 1  # as in allreduce_now
    for t, name in zip(tensors, names):
        buf, cap = (t, _bridge.export(t)) if root else _bridge.empty_like(t)
        result = tf.identity(buf) if root else buf
        handles.append(_ops.broadcast_async(cap, root_rank=root_rank, name=name,
                                            process_set=process_set, keep=buf,
                                            finish=lambda _h, b=result: b, blocking=blocking))
    return _ops.GroupHandle(handles).wait()


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Return ``root_rank``'s value of ``tensor`` on every rank of the set (a rank of the job).

    Differentiable: the root receives the averaged gradient, the others zeros.
    """
    t = _bridge.as_tensor(tensor)
    root_rank = int(root_rank)
    name = _bridge.op_name(name, "PerseusBroadcast")

    @tf.custom_gradient
    def bcast(x):
        def body(e):
            return _broadcast_now([e], root_rank, [name], process_set)
        out = _bridge.run(body, [x], [x.dtype], "PerseusBroadcast")[0]
        out.set_shape(x.shape)

        def grad(dy):
            reduced = _grouped_allreduce_raw([dy], None, Average, 1.0, 1.0, process_set)[0]
            return reduced if rank() == root_rank else reduced * 0
        return out, grad

    return bcast(t)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite each variable with ``root_rank``'s value; returns the list of their new
    values (tensors read after the assignments), as Horovod does."""
    variables = list(variables)
    values = [tf.convert_to_tensor(v) for v in variables]
    names = _group_names(_bridge.op_name(name, "PerseusBroadcastVariables"), len(values))
    outs = _bridge.run(lambda *e: _broadcast_now(e, int(root_rank), names, process_set),
                       values, [v.dtype for v in values], "PerseusBroadcastVariables")
    for o, v in zip(outs, values):
        o.set_shape(v.shape)
    assigns = [v.assign(o) for v, o in zip(variables, outs)]
    with tf.control_dependencies(assigns):  # Horovod returns the variables' new values
        return [tf.identity(v) for v in variables]


# --------------------------------------------------------------------------- alltoall

def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send ``splits[i]`` rows (dim 0) of ``tensor`` to rank i of the set, in order.

    Returns the rows received (concatenated in rank order) and, when ``splits`` is
    given, also the int32 tensor of how many rows came from each rank: ``output`` or
    ``(output, received_splits)``, as Horovod 0.28 does. Without ``splits`` dim 0 is
    split equally. Differentiable in the tensor (the gradient is the reverse alltoall).
    """
    t = _bridge.as_tensor(tensor)
    set_size = _ps_size(process_set)
    name = _bridge.op_name(name, "PerseusAlltoall")
    if splits is None:
        splits_t = None
    else:
        splits_t = tf.convert_to_tensor(splits)
        # Refused by type when the graph is built, so every rank refuses alike.
        if not splits_t.dtype.is_integer:
            raise TypeError(f"alltoall splits must be integers (rows for each rank), got a "
                            f"tensor of {splits_t.dtype.name}")
        splits_t = tf.cast(splits_t, tf.int32)

    def body(e, *s):
        sp = [int(v) for v in s[0].numpy().reshape(-1)] if s else None
        h = _ops.alltoall_async(_bridge.export(e), splits=sp, name=name,
                                process_set=process_set, keep=e,
                                finish=lambda h: (_bridge.imported(h.output()),
                                                  tf.constant(h.recv_splits(), tf.int32)),
                                blocking=True)
        return h.wait()

    @tf.custom_gradient
    def exchange(x):
        inputs = [x] if splits_t is None else [x, splits_t]
        out, received = _bridge.run(body, inputs, [x.dtype, tf.int32], "PerseusAlltoall")
        out.set_shape(_rows_shape(x.shape))
        received.set_shape([set_size])

        def grad(dy, _dsplits=None):
            # Each rank sends back what it received from each rank.
            back, _ = alltoall(dy, received, process_set=process_set)
            return back
        return (out, received), grad

    out, received = exchange(t)
    if splits is None:
        return out
    return out, tf.stop_gradient(received)


# --------------------------------------------------------------------------- reducescatter

def _reducescatter_grads(dys, op, prescale_factor, postscale_factor, process_set):
    """Horovod 0.28's gradient of reducescatters: each output gradient times the scale
    factors, times the set's size for Sum (not divided for Average), gathered back to
    every rank's rows."""
    if op not in (Average, Sum):
        raise NotImplementedError("reducescatter gradients exist for Sum and Average only")
    scale = prescale_factor * postscale_factor * (_ps_size(process_set) if op == Sum else 1)
    scaled = [dy * tf.cast(scale, dy.dtype) if scale != 1.0 else dy for dy in dys]
    return _grouped_allgather(scaled, None, process_set, stack=False)


def _grouped_reducescatter(tensors, names, op, prescale_factor, postscale_factor,
                           process_set):
    """Reduce-scatters each tensor, all in one op; ``names``: one per tensor, or None."""
    for t in tensors:
        if t.shape.rank == 0:
            raise _InvalidArgument("Reducescatter does not support scalar inputs: it "
                                   "scatters the rows of a tensor of one dimension or more")
    names = [_bridge.op_name(n, "PerseusReducescatter") for n in (names or [None] * len(tensors))]

    @tf.custom_gradient
    def scatter(*xs):
        def body(*e):
            blocking = len(e) == 1  # as in allreduce_now
            return _ops.GroupHandle([_ops.reducescatter_async(
                _bridge.export(x), name=n, op=op, prescale_factor=prescale_factor,
                postscale_factor=postscale_factor, process_set=process_set, keep=x,
                finish=lambda h: _bridge.imported(h.output()), blocking=blocking)
                for x, n in zip(e, names)]).wait()
        outs = _bridge.run(body, xs, [x.dtype for x in xs], "PerseusReducescatter")
        for out, x in zip(outs, xs):
            out.set_shape(_rows_shape(x.shape))

        def grad(*dys):
            return _reducescatter_grads(dys, op, prescale_factor, postscale_factor,
                                        process_set)
        return outs, grad

    return list(scatter(*tensors))


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over the set and return this rank's block of dim-0 rows.

    Dim 0 is split as evenly as possible, the first ``d0 % size`` ranks getting one
    more row. Differentiable for Sum and Average, as in Horovod: the gradient is the
    output gradient times the scale factors (and the set's size for Sum), allgathered.
    """
    op = _ops.check_op(op)
    compressed, ctx = compression.compress(_bridge.as_tensor(tensor))
    out = _grouped_reducescatter([compressed], [name], op, prescale_factor, postscale_factor,
                                 process_set)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          name=None, process_set=global_process_set, ignore_name_scope=False,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reduce-scatter each tensor of a list (one op); returns the list of this rank's
    blocks. Differentiable as :func:`reducescatter`."""
    op = _ops.check_op(op)
    pairs = [compression.compress(_bridge.as_tensor(t)) for t in tensors]
    if not pairs:
        return []
    names = _group_names(name, len(pairs)) if name is not None else None
    outs = _grouped_reducescatter([c for c, _ in pairs], names, op, prescale_factor,
                                  postscale_factor, process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# --------------------------------------------------------------------------- join, barrier

def join(process_set=global_process_set):
    """Declare that this rank has no more data; returns the rank that joined last.

    Until every rank joined, this rank contributes zeros to the others' allreduces.
    """
    out = _bridge.run(lambda: [tf.constant(_ops.join(process_set), tf.int32)], [], [tf.int32],
                      "PerseusJoin")[0]
    out.set_shape([])
    return out


def barrier(process_set=global_process_set):
    """Block until every rank of the set reached the barrier (a no-output op in graphs)."""
    if tf.executing_eagerly():
        _ops.barrier(process_set)
        return None

    def body():
        _ops.barrier(process_set)
        return [tf.constant(0, tf.int32)]
    return _bridge.run(body, [], [tf.int32], "PerseusBarrier")[0].op


# --------------------------------------------------------------------------- topology as tensors

def size_op(process_set_id=0, name=None):
    """The number of ranks (of a process set), as an int32 tensor."""
    return tf.constant(_ps_size(process_set_id), tf.int32, name=name)


def rank_op(name=None):
    """This rank, as an int32 tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_size_op(name=None):
    """Ranks on this host, as an int32 tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def local_rank_op(name=None):
    """This rank's index on its host, as an int32 tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    """Whether this rank belongs to a process set, as an int32 tensor: 1 or 0.

    ``process_set_id`` is the set's id (``ProcessSet.process_set_id``; a registered
    ``ProcessSet`` is taken too). Where Horovod returns a negative error code, this
    raises ``ValueError``: before ``init()``, or for an id no set has.
    """
    _basics.check_initialized()
    if isinstance(process_set_id, ProcessSet):
        process_set_id = _ps_id(process_set_id)
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, int):
        raise TypeError(f"process_set_id must be an int (or a ProcessSet), got "
                        f"{type(process_set_id).__name__}")
    if process_set_id not in _core.process_set_ids():
        raise ValueError(f"no process set has id {process_set_id} (registered ids: "
                         f"{sorted(_core.process_set_ids())})")
    included = rank() in _core.process_set_ranks(process_set_id)
    return tf.constant(int(included), tf.int32, name=name)

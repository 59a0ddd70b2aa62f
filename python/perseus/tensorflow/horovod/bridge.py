"""How TensorFlow tensors reach the core, in eager mode and inside graphs.

Eager tensors cross as DLPack capsules, without copies: the input is exported with
``tf.experimental.dlpack.to_dlpack``; results the core allocates come back through
``from_dlpack``; results written in place go into a ``DeepCopy`` of the input, a buffer
no other tensor shares. Inside a graph (``tf.function``, a ``tf.compat.v1`` session)
each collective is one ``tf.py_function`` op that runs the same eager code when the
graph executes; its static shape is set from what the collective guarantees. Code that
XLA compiles (``jit_compile=True``) cannot hold a py_function: there a collective is
refused by name when traced.

Tensors on a GPU cross through host memory: each collective's inputs are copied to the
host, the collective and every op of its body run on the CPU, and its outputs are copied
back to the device of its first GPU input. (Perseus's NCCL path serves PyTorch's CUDA
tensors only; docs/gpu.md.)

Names in graphs: the core matches operations across ranks by name. Inside
``tf.function`` the py_function ops are stateful, so automatic control dependencies
run them in program order, and unnamed collectives are named by that order, as in
eager mode. A ``tf.compat.v1`` graph has no such order (a session runs independent
ops in any order), so there an unnamed collective is named when the graph is built,
after its op: the same on every rank that builds the same graph.
"""

import contextlib
import os
import threading

import tensorflow as tf
from tensorflow.python.ops import control_flow_util as _control_flow

from perseus.tensorflow.horovod.errors import as_tf_error

_to_dlpack = tf.experimental.dlpack.to_dlpack
_from_dlpack = tf.experimental.dlpack.from_dlpack

SUPPORTED_DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
                    tf.bfloat16, tf.float32, tf.float64, tf.bool)

def as_tensor(value):
    """``value`` as a tf.Tensor (variables are read), with its dtype checked."""
    if isinstance(value, tf.IndexedSlices):
        raise TypeError("IndexedSlices are reduced through allreduce (allgather of values "
                        "and indices), not through this collective")
    t = tf.convert_to_tensor(value)
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"Perseus does not support tensors of dtype {t.dtype.name}; "
                        f"supported dtypes: {names}")
    return t


def _gpu_device(t):
    """The device of ``t`` when it lives on a GPU, else None."""
    device = getattr(t, "device", "") or ""
    return device if ":GPU:" in device.upper() else None


def _on_cpu(t):
    device = _gpu_device(t)
    if device is not None:
        raise ValueError(f"a tensor on {device} reached the core, which takes TensorFlow "
                         "tensors in host memory only; collectives go through bridge.run, "
                         "which copies them to the host")
    return t


def export(t):
    """DLPack capsule of eager tensor ``t`` (read-only use by the core)."""
    return _to_dlpack(_on_cpu(t))


def fresh_copy(t):
    """A new eager tensor with ``t``'s values in a buffer nobody else holds, and its capsule:
    the core may write into it."""
    buf = tf.raw_ops.DeepCopy(x=_on_cpu(t))
    return buf, _to_dlpack(buf)


def empty_like(t):
    """A new eager tensor shaped and typed like ``t``, its values unspecified (for a
    result the core writes whole), and its capsule."""
    buf = tf.raw_ops.Empty(shape=tf.shape(t), dtype=t.dtype)
    return buf, _to_dlpack(buf)


def imported(capsule):
    """The eager tensor over a capsule the core allocated."""
    return _from_dlpack(capsule)


def op_name(name, kind):
    """The name a collective carries: ``name`` if given; in a ``tf.compat.v1`` graph a
    unique name made from ``kind`` now; otherwise None (named by call order)."""
    if name is not None or tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "_building_function", False):
        return None
    return graph.unique_name(kind)


def run(fn, inputs, out_dtypes, kind):
    """``fn(*inputs)`` now when eager; otherwise a py_function op (named after ``kind``)
    with that body.

    ``fn`` takes and returns eager tensors (a list, one per ``out_dtypes``). Returns
    the list of outputs (symbolic in a graph, with unknown shapes: callers set them).
    """
    body = through_host(fn)
    if tf.executing_eagerly():
        return list(body(*inputs))
    if _control_flow.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise NotImplementedError(
            f"perseus: {kind} cannot run in code compiled by XLA (a tf.function with "
            "jit_compile=True, or called from one): XLA cannot call the Perseus core. "
            "Compile that function with jit_compile=False (Keras models compiled with a "
            "Perseus DistributedOptimizer already are)")
    graph = tf.compat.v1.get_default_graph()
    chained = _chained(graph)
    with tf.control_dependencies([_order.last] if chained and _order.last is not None else []):
        outs = tf.py_function(body, list(inputs), list(out_dtypes), name=kind)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if chained and outs:
        _order.last = outs[0].op
    return outs


# --------------------------------------------------------------------------- graphs' order
# Each collective's op holds the thread that runs it until every rank has submitted it. A
# tf.compat.v1 session runs independent ops in an order of its own, different on each
# rank, on its inter-op threads: ranks whose threads all wait on collectives the others
# have not reached would hang. Two things keep sessions going. The collectives one call
# makes (a grouped op's parts, a gradient batch's dense and sparse reductions) run in the
# order they were made, the same on every rank, one after another (``ordered``). And
# sessions get enough inter-op threads for every collective of a step to wait at once
# (``SESSION_THREADS``, set at init where the program set none). A tf.function needs
# neither: py_functions are stateful, so it runs them in program order.

#: Inter-op threads Perseus gives TensorFlow at ``init()`` where the program chose none:
#: how many independent collectives one ``session.run`` may hold waiting at once.
SESSION_THREADS = 64

_order = threading.local()


@contextlib.contextmanager
def ordered():
    """Collectives made inside run in the order they are made, in a tf.compat.v1 graph."""
    outer = getattr(_order, "depth", 0)
    if outer == 0:
        _order.last = None
    _order.depth = outer + 1
    try:
        yield
    finally:
        _order.depth = outer
        if outer == 0:
            _order.last = None


def _chained(graph):
    """Whether a collective made now in ``graph`` follows the one made before it: inside
    :func:`ordered`, in a tf.compat.v1 graph (not a tf.function), outside control flow."""
    return (getattr(_order, "depth", 0) > 0
            and not getattr(graph, "_building_function", False)
            and graph._get_control_flow_context() is None)


def give_sessions_threads():
    """Raise TensorFlow's inter-op threads to :data:`SESSION_THREADS` (or the number of
    cores, if more) where the program set none and the runtime has not started: sessions
    made without a config of their own take it, and then hold a thread for each of a
    step's collectives while they wait. Returns the number now set (0: left to TF)."""
    if tf.config.threading.get_inter_op_parallelism_threads() == 0:
        try:
            tf.config.threading.set_inter_op_parallelism_threads(
                max(SESSION_THREADS, os.cpu_count() or 1))
        except RuntimeError:
            pass  # the runtime started already: its threads stay as they are
    return tf.config.threading.get_inter_op_parallelism_threads()


def through_host(fn):
    """``fn`` for eager tensors on any device: inputs on a GPU are copied to host memory,
    ``fn`` runs with every op it makes placed on the CPU (on a machine with a GPU, ops
    go there by default), and when some input was on a GPU the outputs are copied back
    to the first such input's device."""
    def body(*xs):
        gpu = next((d for d in map(_gpu_device, xs) if d is not None), None)
        with tf.device("/cpu:0"):
            host = [tf.identity(x) if _gpu_device(x) is not None else x for x in xs]
            try:
                outs = list(fn(*host))
            except Exception as e:  # re-raised as the tf.errors type Horovod raises for it
                converted = as_tf_error(e)
                if converted is e:
                    raise
                raise converted from e
        if gpu is None:
            return outs
        with tf.device(gpu):
            return [tf.identity(o) for o in outs]
    return body

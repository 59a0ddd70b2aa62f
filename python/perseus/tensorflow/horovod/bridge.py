"""How TensorFlow tensors reach the core, in eager mode and inside graphs.

Eager tensors cross as DLPack capsules, without copies: the input is exported with
``tf.experimental.dlpack.to_dlpack``; results the core allocates come back through
``from_dlpack``; results written in place go into a ``DeepCopy`` of the input, a buffer
no other tensor shares. Inside a graph (``tf.function``, a ``tf.compat.v1`` session)
each collective is a ``tf.py_function`` that runs the same eager code when the graph
executes (in a session's graph on a thread of its own: "graphs' threads" below); its
static shape is set from what the collective guarantees. Code that XLA compiles
(``jit_compile=True``) cannot hold a py_function: there a collective is refused by name
when traced.

Tensors on a GPU cross through host memory: each collective's inputs are copied to the
host, the collective and every op of its body run on the CPU, and its outputs are copied
back to the device of its first GPU input. (Perseus's NCCL path serves PyTorch's CUDA
tensors only; docs/gpu.md.)

Names in graphs: the core matches operations across ranks by name. Inside a
``tf.function`` called from eager code the collectives' ops are stateful, so automatic
control dependencies run them in program order, and unnamed collectives are named by
that order, as in eager mode. A ``tf.compat.v1`` graph has no such order (a session
runs independent ops, and the functions traced into it, in any order), so there an
unnamed collective is named when the graph is built, after its op: the same on every
rank that builds the same graph.
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util as _control_flow
from tensorflow.python.ops import gen_dataset_ops as _dataset_ops
from tensorflow.python.ops import gen_experimental_dataset_ops as _data_ops

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
    """The name a collective carries: ``name`` if given; in a ``tf.compat.v1`` graph (also
    in a function traced into one) a unique name made from ``kind`` now, in the outermost
    graph; otherwise (eager code, a tf.function called from it) None: named by call
    order."""
    if name is not None or tf.executing_eagerly():
        return name
    if tf.compat.v1.executing_eagerly_outside_functions():
        return None
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph.unique_name(kind)


def run(fn, inputs, out_dtypes, kind):
    """``fn(*inputs)`` now when eager; otherwise graph ops (named after ``kind``) that run
    that body when the graph executes: in a tf.function called from eager code on the
    thread that runs the op, in a tf.compat.v1 graph on a thread of their own.

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
    if tf.compat.v1.executing_eagerly_outside_functions():
        # A tf.function called from eager code: its stateful ops run one after another in
        # program order, the same on every rank, so no wait can block another's submission.
        return _blocking_op(body, list(inputs), list(out_dtypes), kind)
    return _off_the_inter_op_threads(body, list(inputs), list(out_dtypes), kind)


def _blocking_op(body, inputs, out_dtypes, kind):
    """The py_function op that runs ``body(*inputs)`` on the thread that runs the op: the
    outputs, a list (with unknown shapes)."""
    outs = tf.py_function(body, inputs, out_dtypes, name=kind)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


# --------------------------------------------------------------------------- graphs' threads
# A collective waits until every rank has submitted it. As a plain py_function it would
# wait on one of the graph's inter-op threads, and a tf.compat.v1 session runs the
# independent ops of a step in an order of its own, different on each rank: ranks whose
# threads all wait on collectives the others have not reached yet would hang, with any
# number of threads (a session may have one; a step may hold hundreds of collectives).
# So in a graph each collective is a one-element dataset whose map calls the body, on a
# private pool of one thread, read by ``DatasetToSingleElement``, an asynchronous kernel:
# the inter-op thread is free again as soon as the op starts. However the session orders
# a step's ops, and however few threads it has, every collective of the step is
# submitted on every rank, so every one completes. A tf.function called from eager code
# needs none of this: its py_functions are stateful, so they run in program order, the
# same on every rank, and each blocks the thread that runs it (``_blocking_op``). One
# traced for a tf.compat.v1 graph may run in a session beside other ops: it takes the
# threaded path. The threaded path's cost per op and step: docs/tensorflow.md.

#: Threads of the pool that runs one collective's body in a graph.
_BODY_THREADS = 1


def _off_the_inter_op_threads(body, inputs, out_dtypes, kind):
    """The graph ops that run ``body(*inputs)`` on a thread of their own: the outputs, a
    list (with unknown shapes)."""
    with tf.name_scope(kind), tf.device("/cpu:0"):
        source = tf.data.Dataset.from_tensors(tuple(inputs) if inputs else (tf.constant(0),))
        args = (lambda *xs: xs) if inputs else (lambda _: ())

        def call(*xs):
            return tuple(_blocking_op(body, list(args(*xs)), out_dtypes, kind))

        mapped = source.map(call)
        types = [tf.as_dtype(d) for d in out_dtypes]
        shapes = [None] * len(types)
        pooled = _data_ops.private_thread_pool_dataset(
            mapped._variant_tensor, _BODY_THREADS, output_types=types, output_shapes=shapes)
        outs = _dataset_ops.dataset_to_single_element(pooled, output_types=types,
                                                      output_shapes=shapes)
    device = next(filter(None, map(_gpu_device, inputs)), None)
    if device is None:
        return list(outs)
    with tf.device(device):
        return [tf.identity(o) for o in outs]


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

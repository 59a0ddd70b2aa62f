"""Horovod 0.28's ``horovod.tensorflow`` API on Perseus:
``import perseus.tensorflow.horovod as hvd``.

Typical TF2 use::

    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)

``hvd.keras`` is :mod:`perseus.tensorflow.keras` (callbacks as ``hvd.keras.callbacks``).
"""

from perseus.tensorflow.horovod import elastic
from perseus.tensorflow.horovod.compression import Compression
from perseus.tensorflow.horovod.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from perseus.tensorflow.horovod.mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    PerseusInternalError,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    ccl_built,
    counters,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    reducescatter,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from perseus.tensorflow.horovod.optimizer import (
    DistributedGradientTape,
    DistributedOptimizer,
    PartialDistributedGradientTape,
)

__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "PartialDistributedGradientTape", "PerseusInternalError", "ProcessSet", "Product", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built", "counters",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
    "init", "is_homogeneous", "is_initialized", "join", "keras", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline",
]


def __getattr__(name):
    # hvd.keras and SyncBatchNormalization are imported on first use: Keras adds a
    # second or more to the import.
    if name == "keras":
        from perseus.tensorflow import keras

        return keras
    if name == "SyncBatchNormalization":
        from perseus.tensorflow.horovod.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

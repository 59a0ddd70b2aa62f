"""Perseus for MXNet (seed 003 §4.6, §4.7): ``import perseus.mxnet as hvd``.

Two ways in, as Horovod and AIACC users know them:

- the Horovod API (``horovod.mxnet`` of Horovod 0.28): ``hvd.init()``,
  ``hvd.broadcast_parameters(net.collect_params())``, ``hvd.DistributedTrainer(params,
  opt)`` (gluon) or ``hvd.DistributedOptimizer(opt)`` (Module API), and the collectives;
- the Perseus KVStore: ``kv = perseus.mxnet.create("dist_sync_perseus")`` (or
  ``mx.kv.create("dist_sync_perseus")``, or the name itself) passed where MXNet takes a
  kvstore (``mod.fit(kvstore=kv)``, ``gluon.Trainer(..., kvstore=kv)``), with
  ``kv.local_rank``, ``init(key, value, param_only=False)`` and
  ``push(key, value, op=PerseusOp.Sum / Max / Min)``.

``DistributedTrainer`` and ``DistributedOptimizer`` honour the PERSEUS_* gradient switches
(NaN check, accumulation, down-sampling, perf check, fusion); the KVStore takes MXNet's
``set_gradient_compression``. ``start_timeline`` / ``stop_timeline`` and Horovod's
capability checks (``mpi_built``, ``nccl_built``, ...) are here too.

``PerseusSyncBatchNorm(comm_scope=0 or 1)`` normalizes with the batch statistics of the
host's ranks or of every rank. ``hvd.elastic`` (``run``, ``MXNetState``) trains through
the resets of an elastic job (docs/elastic.md).
"""

import mxnet as _mx

from perseus import support as _support

# Before anything of Perseus's reaches MXNet: an unsupported one is named here.
_support.check("mxnet", _mx.__version__)

from perseus.mxnet import elastic
from perseus.mxnet.compression import Compression
from perseus.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from perseus.mxnet.kvstore import PerseusKVStore, PerseusOp, create
from perseus.mxnet.mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    MXNetValueError,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from perseus.mxnet.sync_batch_norm import PerseusSyncBatchNorm
from perseus.mxnet.trainer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "DistributedTrainer",
    "HorovodInternalError", "MXNetValueError", "Max", "Min", "PerseusKVStore", "PerseusOp", "PerseusSyncBatchNorm",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "allreduce_", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "broadcast_parameters", "ccl_built", "create", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set",
    "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]

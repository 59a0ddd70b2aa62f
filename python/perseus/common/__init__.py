"""The one Python facade over ``perseus._core``, shared by every framework front-end.

Nothing here imports a framework: tensors arrive as DLPack capsules, and each
front-end adapts its own tensor type (see ``perseus.torch.horovod.mpi_ops``).
"""

from perseus.common.basics import (
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
from perseus.common.exceptions import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    PerseusInternalError,
)
from perseus.common.ops import Adasum, Average, Handle, Max, Min, Product, Sum
from perseus.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum",
    "Average",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "PerseusInternalError",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "counters",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
]

"""Lifecycle and topology: ``init``, ``shutdown``, ranks and sizes, build queries."""

import atexit
import functools
import os

from perseus import _core
from perseus.common import elastic, flight_recorder, knobs
from perseus.common import process_sets as _process_sets
from perseus.common import rank_copy as _rank_copy

_NOT_INITIALIZED = "Perseus has not been initialized; use hvd.init()."

_config = None  # the effective configuration, cached by init()
_stacks = None  # allgather_stacks(), cached by init(): it is on every allgather's path
_generation = 0  # how many times init() started the engine in this process


def init(comm=None, process_sets=None):
    """Start Perseus on this rank: rendezvous with the others and start the engine.

    ``process_sets`` registers process sets up front: a list of :class:`ProcessSet`
    objects or of rank lists (``"dynamic"`` is accepted and means nothing: sets can
    always be added later with ``add_process_set``). Their ids are assigned in order.
    Calling ``init()`` again while initialized does nothing. Invalid environment
    values raise ``ValueError`` naming the variable.

    In a process a rank started (a DataLoader worker, forked, spawned or from a
    forkserver) ``init()`` joins nothing: the process answers for that rank, and its
    collectives raise ``ValueError`` saying why (``perseus.common.rank_copy``).
    """
    global _config, _generation, _stacks
    if comm is not None:
        raise NotImplementedError(
            "Perseus does not use MPI: init(comm=...) is not supported; "
            "pass process_sets=[...] to init() or use add_process_set()")
    if _core.is_initialized() or _core.not_a_rank() is not None:
        return
    copy = _rank_copy.copy_of()
    if copy is not None:
        _core.init_copy(*copy)
        return
    sets = _process_sets._normalize(process_sets)
    iface = knobs.get("PERSEUS_NCCL_NETWORK_INTERFACE")
    if iface:
        # NCCL reads its own variable when a communicator is formed (docs/gpu.md).
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    start = functools.partial(_core.init, [ps.ranks for ps in sets] if sets else None)
    # Processes this one starts meanwhile wait for its mark instead of joining the job.
    _rank_copy.begin()
    try:
        if elastic.enabled():
            elastic.start(start)  # in the job's next round that forms
        else:
            _start_knowing_rank0(start)
        _config = dict(_core.config())
        _stacks = not knobs.get("PERSEUS_CHANGE_HVD_ALLGATHER", _config)
        _generation += 1
        if _generation == 1:
            atexit.register(_close_timeline)
        if _core.rank() == 0:
            for note in _core.config_notes():
                _core.log("INFO", note)
        _process_sets._after_init(sets)
        flight_recorder.watch()
        _rank_copy.mark([_core.rank(), _core.size(), _core.local_rank(),
                         _core.local_size(), _core.cross_rank(), _core.cross_size()])
    finally:
        _rank_copy.end_pending()


def _start_knowing_rank0(start):
    """``start()``; where mpirun spread the job over hosts without telling the ranks
    where rank 0 is, rank 0 tells them through MPI (mpi4py) and the start is retried
    (the core refused before any connection, on every rank alike)."""
    from perseus.common import mpi_address

    try:
        start()
    except _core.Rank0AddressUnknown:
        if not mpi_address.learn_rank0_address():
            raise
        start()


def restart():
    """Leave the current round of an elastic job and join the next: ``shutdown()``,
    then ``init()``."""
    shutdown()
    init()


def _close_timeline():
    """At exit without ``shutdown()``: finish the timeline's JSON, so the file opens."""
    if _core.is_initialized():
        _core.stop_timeline()


def shutdown():
    """Stop the engine and leave the job; pending operations fail. ``init()`` may follow."""
    global _config, _stacks
    from perseus.common import ops

    if _core.is_initialized():
        ops._before_shutdown()
    _core.shutdown()
    _rank_copy.unmark()
    _config = _stacks = None
    ops._after_shutdown()
    _process_sets._after_shutdown()


def generation():
    """How many times ``init()`` started Perseus in this process: state kept across steps
    by a front-end belongs to one generation (the configuration may change in between)."""
    return _generation


def is_initialized():
    """Whether ``init()`` has run (and ``shutdown()`` has not); also in a process a rank
    started after its ``init()``, which answers for the rank but runs no collectives."""
    return _core.is_initialized() or _core.not_a_rank() is not None


def check_initialized():
    """Raise ``ValueError`` unless Perseus is initialized in this rank's own process."""
    if not _core.is_initialized():
        why = _core.not_a_rank()
        raise ValueError(why if why is not None else _NOT_INITIALIZED)


def config():
    """The effective configuration (variable name -> value), as read by ``init()``."""
    check_initialized()
    global _config
    if _config is None:
        _config = dict(_core.config())
    return _config


def counters():
    """What the engine did on this rank so far: ``operations`` (collectives run),
    ``tensors``, ``fused_buffers`` and the largest one's bytes (``fused_bytes_max``),
    ``negotiation_messages``, ``cache_hits``, ``bytes_intra_host`` and
    ``bytes_inter_host`` (payload bytes sent), ``compression_resends`` (float16
    gradient buffers that overflowed and were reduced again in float32), and
    ``negotiations_skipped`` (tensors run from an offline schedule,
    PERSEUS_OFFLINE_NEG, without asking the coordinator), ``bytes_extra_streams``
    (payload bytes sent on streams other than the first, PERSEUS_ALLREDUCE_STREAMS),
    ``nccl_operations`` (collectives of CUDA tensors NCCL carried, docs/gpu.md),
    ``autotune_changes`` (settings HOROVOD_AUTOTUNE sent this rank),
    ``stall_warnings`` (rank 0: stall warnings given), and the control plane:
    ``control_frames_sent``, ``control_bytes_sent``, ``control_frames_received`` and
    ``control_bytes_received`` (frame headers included) on the negotiation streams to
    and from rank 0, ``vote_messages`` and ``vote_bytes`` this rank sent in the
    offline schedule's votes (PERSEUS_OFFLINE_NEG), and ``lane_operations``
    (operations the callers ran among the ranks themselves, PERSEUS_LANE_BYTES; also in
    ``operations``); the transport: ``transfer_rounds`` (rounds of messages this rank's
    collectives ran, each waiting for the last) and ``linked_peers`` (the peers it holds
    data links to, made as its collectives first needed them)."""
    check_initialized()
    return dict(_core.counters())


def set_fusion_threshold(nbytes):
    """Largest fused buffer from now on, in bytes (0 disables fusion); rank 0's value
    decides. DistributedOptimizer calls this for ``PERSEUS_ALLREDUCE_FUSION``."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"the fusion threshold must be >= 0 bytes, got {nbytes}")
    _core.set_fusion_threshold(nbytes)


def allgather_stacks():
    """True when allgather stacks equal shapes (``PERSEUS_CHANGE_HVD_ALLGATHER=0``)."""
    if _stacks is None:  # not initialized (config() says so), or a rank's copy
        return not knobs.get("PERSEUS_CHANGE_HVD_ALLGATHER", config())
    return _stacks


def size():
    """Number of ranks in the job."""
    return _core.size()


def rank():
    """This rank's index in the job, from 0 to ``size() - 1``."""
    return _core.rank()


def local_size():
    """Number of ranks on this host."""
    return _core.local_size()


def local_rank():
    """This rank's index among the ranks on its host."""
    return _core.local_rank()


def cross_size():
    """Number of hosts (ranks with the same local rank across hosts)."""
    return _core.cross_size()


def cross_rank():
    """This host's index among the hosts."""
    return _core.cross_rank()


def is_homogeneous():
    """Whether every host runs the same number of ranks."""
    return local_size() * cross_size() == size()


def mpi_threads_supported():
    """Always False: Perseus does not use MPI."""
    return False


def mpi_built():
    """False: Perseus is not built with MPI."""
    return False


def mpi_enabled():
    """False: Perseus never runs collectives over MPI."""
    return False


def gloo_built():
    """True: Perseus's own TCP/shared-memory transport takes Gloo's place."""
    return True


def gloo_enabled():
    """True: collectives run over Perseus's own (Gloo-like) controller."""
    return True


def nccl_built():
    """NCCL's version code, as Horovod's ``nccl_built()`` returns it (``2708`` for 2.7.8,
    ``22809`` for 2.28.9), when this build has the GPU path and NCCL can be loaded
    (docs/gpu.md); 0 otherwise."""
    if not _core.GPU_BUILT:
        return 0
    from perseus.common import gpu

    for lib in gpu.libraries():
        if lib["name"] == "NCCL" and lib["path"]:
            return nccl_version_code(lib["version"])
    return 0


def nccl_version_code(version):
    """NCCL's ``NCCL_VERSION_CODE`` for a version ``"major.minor.patch"``: NCCL 2.8 and
    older code it ``major*1000 + minor*100 + patch``, later ones ``major*10000 +
    minor*100 + patch``."""
    major, minor, patch = ([int(p) for p in version.split(".")[:3]] + [0, 0, 0])[:3]
    scale = 1000 if (major, minor) <= (2, 8) else 10000
    return major * scale + minor * 100 + patch


def ddl_built():
    """False: no IBM DDL support."""
    return False


def ccl_built():
    """False: no oneCCL support."""
    return False


def cuda_built():
    """True when this build reduces CUDA tensors (the GPU path, docs/gpu.md)."""
    return bool(_core.GPU_BUILT)


def rocm_built():
    """False: no ROCm support."""
    return False

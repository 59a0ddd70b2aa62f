"""Broadcast and gather arbitrary picklable Python objects (framework-neutral).

Objects travel as pickled bytes in numpy ``uint8`` buffers (cloudpickle when it
is installed, so lambdas and local classes work too).
"""

import pickle

from perseus.common import ops
from perseus.common.process_sets import (
    global_process_set,
    process_set_size,
    root_in_set,
    set_rank,
)

try:
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle


def dumps(obj):
    """Serialize ``obj`` to bytes (cloudpickle if available, else pickle)."""
    return _pickler.dumps(obj)


def loads(data):
    """Deserialize bytes made by :func:`dumps`."""
    return pickle.loads(data)


class _Capsule:
    """Lets ``numpy.from_dlpack`` take a bare capsule that the core allocated."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def _np():
    import numpy

    return numpy


def _as_numpy(capsule):
    return _np().from_dlpack(_Capsule(capsule))


def _broadcast(array, root_rank, name, process_set):
    ops.broadcast_async(array.__dlpack__(), root_rank=root_rank, name=name,
                        process_set=process_set, keep=array).wait()


def _allgather(array, name, process_set):
    h = ops.allgather_async(array.__dlpack__(), name=name, stack=False, process_set=process_set,
                            keep=array, finish=lambda h: _as_numpy(h.output()))
    return h.wait()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Send ``obj`` from ``root_rank`` (a rank of the job, in the set) to every rank of
    the set; return it.

    Every rank of the set must call this; non-root ranks' ``obj`` is ignored. The
    default name is the same on every rank, whatever each rank passes as ``obj``.
    """
    np = _np()
    name = name or "broadcast_object"
    if set_rank(process_set) == root_in_set(process_set, root_rank):
        data = np.frombuffer(bytearray(dumps(obj)), dtype=np.uint8)
        _broadcast(np.array([data.size], dtype=np.int64), root_rank, name + ".sz", process_set)
        _broadcast(data, root_rank, name + ".t", process_set)
        return obj
    sz = np.zeros(1, dtype=np.int64)
    _broadcast(sz, root_rank, name + ".sz", process_set)
    data = np.zeros(int(sz[0]), dtype=np.uint8)
    _broadcast(data, root_rank, name + ".t", process_set)
    return loads(data.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Gather ``obj`` from every rank of the set; returns the list in set-rank order."""
    np = _np()
    name = name or "allgather_object"
    data = np.frombuffer(bytearray(dumps(obj)), dtype=np.uint8)
    sizes = _allgather(np.array([data.size], dtype=np.int64), name + ".sz", process_set)
    gathered = _allgather(data, name + ".t", process_set)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = process_set_size(process_set)
    return [loads(gathered[offsets[i]:offsets[i + 1]].tobytes()) for i in range(n)]

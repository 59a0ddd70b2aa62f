"""The Perseus KVStore (seed 003 §4.6.1): ``perseus.mxnet.create("dist_sync_perseus")``.

A ``mx.kvstore.KVStoreBase`` without servers: ``push`` reduces across every rank at
once (Sum by default, or Max / Min), and the store keeps one value per key on every
rank. Keys initialized normally hold weights: with an optimizer set
(``set_optimizer``, which the gluon Trainer and the Module API do), a push applies the
update to the weight and ``pull`` returns the weight. Keys initialized with
``param_only=True`` hold values that are synchronized but never updated by the store
(feature maps, statistics, anything reduced once): ``pull`` returns the last reduction.
Usable from the Module API (``mod.fit(kvstore=kv)``) and gluon
(``Trainer(params, opt, kvstore=kv)``).
"""

import pickle

import mxnet as mx

from perseus.common import basics
from perseus.common import ops as _ops
from perseus.mxnet.mpi_ops import allreduce_, barrier, broadcast_


class PerseusOp:
    """The reductions a push can ask for."""

    Sum = _ops.Sum
    Max = _ops.Max
    Min = _ops.Min


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


@mx.kvstore.KVStoreBase.register
class PerseusKVStore(mx.kvstore.KVStoreBase):
    """See the module documentation; made by :func:`create`."""

    def __init__(self, name="dist_sync_perseus"):
        basics.init()
        self._type = name
        self._store = {}  # key -> NDArray (this rank's copy)
        self._param_only = set()
        self._updater = None

    # ------------------------------------------------------------------ identity

    @property
    def type(self):
        """The store's type; it contains ``dist`` and ``_sync``, so MXNet treats it as a
        synchronous distributed store (Module scales the batch by ``num_workers``)."""
        return self._type

    @property
    def rank(self):
        """This worker's rank."""
        return basics.rank()

    @property
    def num_workers(self):
        """The number of workers."""
        return basics.size()

    @property
    def local_rank(self):
        """This worker's index on its host: the device to bind (``mx.gpu(kv.local_rank)``)."""
        return basics.local_rank()

    @staticmethod
    def is_capable(capability):
        """The store applies optimizers (``KVStoreBase.OPTIMIZER``)."""
        return capability == mx.kvstore.KVStoreBase.OPTIMIZER

    # ------------------------------------------------------------------ data

    def _name(self, key):
        return f"kvstore.{key}"

    def init(self, key, value, param_only=False):
        """Store rank 0's ``value`` for ``key`` on every rank (lists: one value per key).

        ``param_only``: the key holds values that the store synchronizes but never
        updates with the optimizer.
        """
        for k, v in zip(_as_list(key), _as_list(value) if isinstance(key, (list, tuple))
                        else [value]):
            stored = _as_list(v)[0].copy()
            broadcast_(stored, 0, name=self._name(k) + ".init")
            self._store[k] = stored
            if param_only:
                self._param_only.add(k)
            else:
                self._param_only.discard(k)

    def _reduce(self, key, values, op):
        """The local sum of ``values`` (one per device), then the reduction across ranks."""
        values = _as_list(values)
        total = values[0].copy()
        for v in values[1:]:
            total += v.as_in_context(total.context)
        return allreduce_(total, op=op, name=self._name(key))

    def push(self, key, value, priority=0, op=PerseusOp.Sum):
        """Reduce ``value`` (an NDArray, or a list of them summed locally first) across the
        ranks with ``op`` (``PerseusOp.Sum``, ``Max`` or ``Min``). A weight key with an
        optimizer set is updated with the result; any other key stores it."""
        keys = _as_list(key)
        values = value if isinstance(key, (list, tuple)) else [value]
        for k, v in zip(keys, values):
            if k not in self._store:
                raise KeyError(f"kvstore: key {k!r} was not initialized (call init first)")
            reduced = self._reduce(k, v, op)
            if self._updater is not None and k not in self._param_only:
                self._updater(k, reduced, self._store[k])
            else:
                self._store[k] = reduced

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copy the key's value (the weight, or the last reduction) into ``out``."""
        keys = _as_list(key)
        outs = out if isinstance(key, (list, tuple)) else [out]
        for k, o in zip(keys, outs):
            if k not in self._store:
                raise KeyError(f"kvstore: key {k!r} was not initialized (call init first)")
            for dst in _as_list(o):
                self._store[k].copyto(dst)

    def pushpull(self, key, value, out=None, priority=0):
        """``push`` then ``pull``; without ``out`` the result lands in ``value``."""
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)

    def broadcast(self, key, value, out, priority=0):
        """``init`` with rank 0's value, then ``pull`` it into ``out``."""
        self.init(key, value)
        self.pull(key, out, priority)

    # ------------------------------------------------------------------ optimizer

    def set_optimizer(self, optimizer):
        """Pushes to weight keys update them with ``optimizer`` (the same on every rank)."""
        self._updater = mx.optimizer.get_updater(optimizer)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Write the optimizer's state to ``fname``."""
        if self._updater is None:
            raise RuntimeError("kvstore: no optimizer is set")
        with open(fname, "wb") as f:
            f.write(self._updater.get_states(dump_optimizer))

    def load_optimizer_states(self, fname):
        """Read the optimizer's state from ``fname``."""
        if self._updater is None:
            raise RuntimeError("kvstore: no optimizer is set")
        with open(fname, "rb") as f:
            self._updater.set_states(f.read())

    def _barrier(self):
        """Wait until every worker reached this point."""
        barrier()

    def _send_command_to_servers(self, head, body):
        raise NotImplementedError("the Perseus KVStore has no servers")

    def __getstate__(self):
        raise pickle.PicklingError("a kvstore cannot be pickled")


def create(name="dist_sync_perseus"):
    """The Perseus KVStore for ``name`` ``"dist_sync_perseus"`` (or any name with
    ``perseus`` in it); initializes Perseus if needed."""
    if not isinstance(name, str) or "perseus" not in name:
        raise ValueError(f"perseus.mxnet.create makes the Perseus KVStore "
                         f"('dist_sync_perseus'), not {name!r}: use mx.kv.create for others")
    return PerseusKVStore(name)

"""The Perseus KVStore (seed 003 §4.6.1): ``perseus.mxnet.create("dist_sync_perseus")``,
or MXNet's own ``mx.kv.create("dist_sync_perseus")`` and
``gluon.Trainer(..., kvstore="dist_sync_perseus")`` once ``perseus.mxnet`` is imported.

A ``mx.kvstore.KVStoreBase`` without servers: ``push`` reduces across every rank at
once (Sum by default, or Max / Min), and the store keeps one value per key on every
rank. Keys initialized normally hold weights: with an optimizer set
(``set_optimizer``, which the gluon Trainer and the Module API do), a push applies the
update to the weight and ``pull`` returns the weight. Keys initialized with
``param_only=True`` hold values that are synchronized but never updated by the store
(feature maps, statistics, anything reduced once): ``pull`` returns the last reduction.
Usable from the Module API (``mod.fit(kvstore=kv)``) and gluon
(``Trainer(params, opt, kvstore=kv)``).

Sums pushed to weight keys are gradients: they travel as ``PERSEUS_ALLREDUCE_DTYPE``
says, and ``set_gradient_compression`` quantizes them as MXNet's ``2bit`` and ``1bit``
compressions do, sending the packed codes. ``param_only`` keys and Max / Min pushes are
reduced exactly.

``push(key, value, op)``: seed 003 passes the op third, where MXNet's ``push`` takes
``priority``. A :class:`PerseusOp` there is the op; a plain int stays a priority.
"""

import enum
import math
import pickle

import mxnet as mx
import numpy as np

from perseus.common import basics
from perseus.common import ops as _ops
from perseus.common.process_sets import global_process_set
from perseus.mxnet.mpi_ops import _allgather, _allreduce_into, barrier, broadcast_


class PerseusOp(enum.IntEnum):
    """The reductions a push can ask for: ints equal to Horovod's ``Sum``, ``Max`` and
    ``Min``, of their own type so that ``push`` knows one in its ``priority`` slot."""

    Sum = _ops.Sum
    Max = _ops.Max
    Min = _ops.Min


def _op_and_priority(priority, op, what):
    """``(op, priority)`` of a push or pushpull: a :class:`PerseusOp` given where MXNet
    takes the priority (seed 003's ``push(key, value, op)``) is the op."""
    if isinstance(priority, PerseusOp):
        if op is not None:
            raise TypeError(f"kvstore {what}: the op is given twice (PerseusOp."
                            f"{priority.name} where MXNet takes the priority, and op={op!r})")
        return priority, 0
    return (PerseusOp.Sum if op is None else op), priority


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


class LowBitCompression:
    """MXNet's gradient compression with error feedback, for one store.

    ``2bit``: each pushed value plus its key's residual becomes +threshold (when it
    reaches ``threshold``), -threshold (when it reaches ``-threshold``) or 0, and the
    residual keeps the difference. ``1bit``: it becomes +1 (above ``threshold``) or -1,
    and the residual keeps the difference. The codes travel packed (4 or 8 to a byte) in
    an allgather, and every rank decodes and sums them.
    """

    TYPES = ("2bit", "1bit")

    def __init__(self, kind, threshold):
        self.kind = kind
        self.threshold = np.float32(threshold)
        self._residuals = {}  # key -> float32 numpy residual

    def __repr__(self):
        return f"LowBitCompression({self.kind!r}, threshold={float(self.threshold)})"

    def quantize(self, key, values):
        """The packed codes (uint8) of float32 ``values`` (flat numpy) plus the key's
        residual, which keeps what the codes leave out."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != values.shape:
            residual = np.zeros_like(values)
            self._residuals[key] = residual
        residual += values
        t = self.threshold
        if self.kind == "1bit":
            up = residual > t
            residual[up] -= np.float32(1)
            residual[~up] += np.float32(1)
            return np.packbits(up)
        up = residual >= t
        down = residual <= -t
        residual[up] -= t
        residual[down] += t
        codes = up.astype(np.uint8) | (down.astype(np.uint8) << 1)
        codes = np.concatenate([codes, np.zeros(-codes.size % 4, np.uint8)]).reshape(-1, 4)
        return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4)
                | (codes[:, 3] << 6)).astype(np.uint8)

    def decode_sum(self, gathered, count):
        """The sum over the ranks of the values that the rows of ``gathered`` (one row of
        packed codes per rank) stand for: ``count`` float32 values."""
        if self.kind == "1bit":
            bits = np.unpackbits(gathered, axis=1)[:, :count].astype(np.int32)
            return (2 * bits - 1).sum(axis=0).astype(np.float32)
        codes = (gathered[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        codes = codes.reshape(gathered.shape[0], -1)[:, :count]
        steps = (codes == 1).sum(axis=0) - (codes == 2).sum(axis=0)
        return steps.astype(np.float32) * self.threshold


def _compression_from(params):
    """The compression that MXNet's ``compression_params`` ask for (None: 'none')."""
    if not isinstance(params, dict):
        raise TypeError(f"set_gradient_compression takes a dict such as "
                        f"{{'type': '2bit', 'threshold': 0.5}}, got {type(params).__name__}")
    unknown = sorted(set(params) - {"type", "threshold"})
    if unknown:
        raise ValueError(f"set_gradient_compression: unknown parameter(s) {unknown}; "
                         f"only 'type' and 'threshold' exist")
    if "type" not in params:
        raise ValueError("set_gradient_compression needs a 'type': 'none', '2bit' or '1bit'")
    kind = params["type"]
    if kind == "none":
        return None
    if kind not in LowBitCompression.TYPES:
        raise ValueError(f"unknown gradient compression type {kind!r}: "
                         f"'none', '2bit' or '1bit'")
    raw = params.get("threshold", 0.5)
    try:
        threshold = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"gradient compression threshold must be a number, "
                         f"got {raw!r}") from None
    if not math.isfinite(threshold):
        raise ValueError(f"gradient compression threshold must be finite, got {raw!r}")
    if kind == "2bit" and threshold <= 0:
        raise ValueError(f"2bit gradient compression needs a threshold > 0, got {raw!r}")
    return LowBitCompression(kind, threshold)


@mx.kvstore.KVStoreBase.register
class PerseusKVStore(mx.kvstore.KVStoreBase):
    """See the module documentation; made by :func:`create`, or by MXNet's
    ``mx.kv.create`` under the names ``"dist_sync_perseus"`` and ``"perseuskvstore"``."""

    def __init__(self, name="dist_sync_perseus"):
        basics.init()
        self._type = name
        self._store = {}  # key -> NDArray (this rank's copy)
        self._param_only = set()
        self._updater = None
        self._compression = None

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
        """The local sum of ``values`` (one per device), then the reduction across ranks.
        Sums for weight keys are gradients; with a gradient compression set, their
        quantized codes travel instead."""
        values = _as_list(values)
        total = values[0].copy()
        for v in values[1:]:
            total += v.as_in_context(total.context)
        gradient = op == _ops.Sum and key not in self._param_only
        if gradient and self._compression is not None and total.size > 0:
            return self._compressed_sum(key, total)
        return _allreduce_into(total, total, self._name(key), op, 1.0, 1.0, global_process_set,
                               gradient).wait()

    def _compressed_sum(self, key, total):
        """The sum over the ranks of the quantized ``total``: each rank's packed codes are
        gathered, decoded and added up."""
        if np.dtype(total.dtype) != np.float32:
            raise TypeError(f"kvstore: {self._compression.kind} gradient compression takes "
                            f"float32 values (as MXNet's); key {key!r} holds "
                            f"{np.dtype(total.dtype).name}")
        codes = self._compression.quantize(key, total.asnumpy().reshape(-1))
        gathered = _allgather(mx.nd.array(codes, dtype=np.uint8), self._name(key) + ".codes",
                              global_process_set, True).wait()
        summed = self._compression.decode_sum(gathered.asnumpy(), total.size)
        return mx.nd.array(summed.reshape(total.shape), ctx=total.context, dtype=np.float32)

    def push(self, key, value, priority=0, op=None):
        """Reduce ``value`` (an NDArray, or a list of them summed locally first) across the
        ranks with ``op`` (``PerseusOp.Sum``, the default, ``Max`` or ``Min``). A weight key
        with an optimizer set is updated with the result; any other key stores it.

        ``priority`` is accepted for MXNet's callers and unused. A :class:`PerseusOp` passed
        third (``push(key, value, PerseusOp.Max)``, as seed 003 writes it) is the op; given
        there and as ``op=`` too, ``TypeError``."""
        op, _ = _op_and_priority(priority, op, "push")
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

    def pushpull(self, key, value, out=None, priority=0, op=None):
        """``push`` (with ``op``, as :meth:`push` takes it) then ``pull``; without ``out``
        the result lands in ``value``. A :class:`PerseusOp` in the ``priority`` slot is the
        op; one in the ``out`` slot (MXNet's third argument) raises ``TypeError``."""
        if isinstance(out, PerseusOp):
            raise TypeError(f"kvstore pushpull: the third argument is out, as in MXNet; "
                            f"pass the op as op=PerseusOp.{out.name}")
        op, priority = _op_and_priority(priority, op, "pushpull")
        self.push(key, value, priority, op=op)
        self.pull(key, value if out is None else out, priority)

    def broadcast(self, key, value, out, priority=0):
        """``init`` with rank 0's value, then ``pull`` it into ``out``."""
        self.init(key, value)
        self.pull(key, out, priority)

    # ------------------------------------------------------------------ compression

    def set_gradient_compression(self, compression_params):
        """Quantize pushed gradients, as MXNet's kvstore does (call it on every rank):
        ``{'type': '2bit', 'threshold': t}`` sends each value plus its residual as
        +t, 0 or -t, ``{'type': '1bit', 'threshold': t}`` as +1 (above t) or -1, and the
        quantization error stays in a per-key residual for the next push;
        ``{'type': 'none'}`` turns it off. ``threshold`` defaults to 0.5.

        Applies to Sum pushes to weight keys (not ``param_only`` keys, not Max / Min).
        The codes travel packed, 4 (2bit) or 8 (1bit) to a byte, in an allgather: each
        rank sends 1/16 (1/32) of a float32 value's bytes per value to each other rank.
        Raises ``ValueError`` naming an unknown type or parameter or a bad threshold.
        """
        self._compression = _compression_from(compression_params)

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


# MXNet's register() keys a store by its lower-cased class name ("perseuskvstore");
# mx.kv.create() and gluon.Trainer(kvstore=...) look names up in the same registry, so
# the name users pass (seed 003: --kv-store dist_sync_perseus) gets its own entry.
mx.kvstore.KVStoreBase.kv_registry["dist_sync_perseus"] = PerseusKVStore


def create(name="dist_sync_perseus"):
    """The Perseus KVStore for ``name`` ``"dist_sync_perseus"`` (or any name with
    ``perseus`` in it); initializes Perseus if needed."""
    if not isinstance(name, str) or "perseus" not in name:
        raise ValueError(f"perseus.mxnet.create makes the Perseus KVStore "
                         f"('dist_sync_perseus'), not {name!r}: use mx.kv.create for others")
    return PerseusKVStore(name)

"""``PerseusSyncBatchNorm`` (seed 003 §4.7): batch normalization whose statistics are
those of the ranks of this host (``comm_scope=0``) or of the whole job (``comm_scope=1``),
built on Perseus' collectives without patching MXNet.

The cross-rank work is one MXNet custom operator (``mx.operator.CustomOp``, registered as
``perseus_sync_batch_norm``) on per-channel vectors, around MXNet's own operators for the
rest, so the layer runs imperatively, after ``hybridize()`` and in symbol graphs. Importing this module (``import perseus.mxnet`` does) also makes it
reachable as MXNet's own contrib layers are: ``mx.gluon.contrib.nn.PerseusSyncBatchNorm``
(gluon) and ``mx.sym.contrib.PerseusSyncBatchNorm`` (symbol).
"""

import threading

import mxnet as mx
import numpy as np

from perseus.common import basics, batch_stats
from perseus.common.objects import allgather_object
from perseus.common.ops import Sum
from perseus.common.process_sets import add_process_set, global_process_set
from perseus.mxnet.mpi_ops import allgather, allreduce

OP_TYPE = "perseus_sync_batch_norm"

# (generation, ranks per host) -> this rank's host set, made once per init().
_host_sets = {}
_host_lock = threading.Lock()

# A layer's calls are named ``<layer>.<i % _NAME_CYCLE>``: concurrent calls of one layer
# (MXNet's engine may run independent ones at once, in any order) pair up across ranks
# by call, and the names come back often enough for the response cache.
_NAME_CYCLE = 64


def host_process_set():
    """The process set of the ranks on this host (the global set on one host). A
    collective the first time after each ``init()``: every rank must call it."""
    with _host_lock:
        key = basics.generation()
        if key not in _host_sets:
            hosts = allgather_object(basics.cross_rank(), name="PerseusSyncBatchNorm.hosts")
            groups = sorted({h: [r for r, g in enumerate(hosts) if g == h]
                             for h in hosts}.items())
            mine = global_process_set
            if len(groups) > 1:
                for host, ranks in groups:
                    ps = add_process_set(ranks)
                    if host == basics.cross_rank():
                        mine = ps
            _host_sets.clear()
            _host_sets[key] = mine
        return _host_sets[key]


def _check_scope(comm_scope):
    if comm_scope not in (0, 1):
        raise ValueError(f"comm_scope must be 0 (this host) or 1 (every rank), got "
                         f"{comm_scope!r}")
    return comm_scope


def _bool(value):
    return value if isinstance(value, bool) else str(value) in ("True", "true", "1")


def _divide(a, b):
    """``a / b``, 0 where ``b`` is 0."""
    return np.divide(a, np.where(b == 0, 1, b)) * (b != 0)


class _SyncStatsOp(mx.operator.CustomOp):
    """The cross-rank step of the layer, on per-channel vectors only.

    Forward: this rank's count (from ``x``'s shape), mean and M2 per channel are gathered
    from the scope's ranks in one allgather and merged (perseus.common.batch_stats) into
    the mean and the (biased) variance of the scope's batch; they move the running
    statistics. Outside training (or with ``use_global_stats``) the running statistics
    come out instead. Gamma and beta come out reshaped to broadcast along axis 1 (gamma
    as ones with ``fix_gamma``). Backward: the gradients of the mean and variance are
    summed over the scope in one allreduce (every rank's loss depends on the shared
    statistics), giving those of this rank's mean and M2.
    """

    def __init__(self, momentum, fix_gamma, use_global_stats, comm_scope, key):
        super().__init__()
        self._momentum, self._fix_gamma = momentum, fix_gamma
        self._use_global_stats = use_global_stats
        self._comm_scope, self._key = comm_scope, key
        self._batch_stats = False
        self._merged = None  # this rank's count and mean, the scope's count and mean

    def _scope(self):
        return host_process_set() if self._comm_scope == 0 else global_process_set

    def forward(self, is_train, req, in_data, out_data, aux):
        """Outputs: the mean, variance, gamma and beta to normalize with."""
        moments, shape, gamma, beta = in_data
        running_mean, running_var = aux
        channels = gamma.shape[0]
        dtype = out_data[0].dtype
        bshape = out_data[0].shape
        self._batch_stats = bool(is_train) and not self._use_global_stats
        if self._batch_stats:
            dims = [int(d) for d in shape.asnumpy()]
            count = int(np.prod(dims)) // dims[1]
            local = moments.asnumpy().astype(np.float64) if count else np.zeros(2 * channels)
            row = np.concatenate([[float(count)], local])
            rows = allgather(mx.nd.array(row, dtype="float64"), process_set=self._scope(),
                             name=f"PerseusSyncBatchNorm.{self._key}.forward")
            rows = rows.asnumpy().reshape(-1, row.size)
            total, mean64, m2 = batch_stats.merge(
                rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:],
                lambda t: t.sum(0), _divide)
            total = float(total[0])
            self._merged = (float(count), local[:channels], total, mean64)
            ctx = moments.context
            mean = mx.nd.array(mean64, ctx=ctx, dtype=dtype)
            var = mx.nd.array(_divide(m2, total), ctx=ctx, dtype=dtype)
            m = self._momentum
            running_mean[:] = running_mean * m + mean.astype(running_mean.dtype) * (1 - m)
            running_var[:] = running_var * m + var.astype(running_var.dtype) * (1 - m)
        else:
            mean, var = running_mean.astype(dtype), running_var.astype(dtype)
        if self._fix_gamma:
            gamma = mx.nd.ones_like(gamma)
        for i, v in enumerate((mean, var, gamma, beta)):
            self.assign(out_data[i], req[i], v.reshape(bshape))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        """Gradients of this rank's mean and M2 (through the scope's statistics), gamma
        and beta."""
        channels = in_data[2].shape[0]
        dmean, dvar, dgamma, dbeta = (g.reshape((channels,)) for g in out_grad)
        dmoments = mx.nd.zeros_like(in_data[0])
        if self._batch_stats:
            sums = allreduce(mx.nd.concat(dmean, dvar, dim=0).astype("float64"), op=Sum,
                             process_set=self._scope(),
                             name=f"PerseusSyncBatchNorm.{self._key}.backward").asnumpy()
            count, mean, total, total_mean = self._merged
            dm, dm2 = batch_stats.merge_gradients(count, mean, total, total_mean,
                                                  sums[:channels], sums[channels:])
            dmoments = mx.nd.array(np.concatenate([dm, dm2]), ctx=in_data[0].context)
        self.assign(in_grad[0], req[0], dmoments.astype(in_grad[0].dtype))
        self.assign(in_grad[1], req[1], mx.nd.zeros_like(in_grad[1]))
        self.assign(in_grad[2], req[2], mx.nd.zeros_like(dgamma) if self._fix_gamma else dgamma)
        self.assign(in_grad[3], req[3], dbeta)


@mx.operator.register(OP_TYPE)
class _SyncStatsProp(mx.operator.CustomOpProp):
    """Arguments ``moments`` (2C: this rank's per-channel mean of x, then its M2, the sum
    of squared deviations from that mean),
    ``shape`` (x's shape, int64), ``gamma`` and ``beta`` (C); auxiliary states
    ``moving_mean`` and ``moving_var`` (C, updated in training); outputs ``mean``, ``var``,
    ``gamma`` and ``beta`` shaped (1, C, 1, ...) like x. Parameters arrive as strings:
    ``momentum``, ``fix_gamma``, ``use_global_stats``, ``comm_scope`` and ``key`` (the
    collectives' name, the same on every rank)."""

    def __init__(self, momentum="0.9", fix_gamma="True", use_global_stats="False",
                 comm_scope="0", key=""):
        super().__init__(need_top_grad=True)
        self._args = {"momentum": float(momentum), "fix_gamma": _bool(fix_gamma),
                      "use_global_stats": _bool(use_global_stats),
                      "comm_scope": _check_scope(int(comm_scope)), "key": key}

    def list_arguments(self):
        return ["moments", "shape", "gamma", "beta"]

    def list_outputs(self):
        return ["mean", "var", "gamma_out", "beta_out"]

    def list_auxiliary_states(self):
        return ["moving_mean", "moving_var"]

    def infer_shape(self, in_shape):
        moments, shape = in_shape[0], in_shape[1]
        ndim = shape[0] if shape else 0
        if ndim < 2:
            raise ValueError(f"PerseusSyncBatchNorm needs data of shape (N, C, ...), got "
                             f"{ndim} dimension(s)")
        chan = (moments[0] // 2,)
        bshape = (1, chan[0]) + (1,) * (ndim - 2)
        return [moments, shape, chan, chan], [bshape] * 4, [chan, chan]

    def infer_type(self, in_type):
        dtype = in_type[0]
        return [dtype, np.int64, dtype, dtype], [dtype] * 4, [dtype, dtype]

    def create_operator(self, ctx, in_shapes, in_dtypes):
        return _SyncStatsOp(**self._args)


def _sync_batch_norm(F, x, gamma, beta, moving_mean, moving_var, eps, name=None, **op_args):
    """The layer in ``F`` (``mx.nd`` or ``mx.sym``): ``(output, mean, var)``. Every large
    tensor goes through MXNet's own operators; the custom operator sees the per-channel
    vectors only (which keeps it clear of oneDNN's blocked layouts, which MXNet 1.9 hands
    to custom operators corrupted)."""
    local_mean = F.mean(x, axis=1, exclude=True, keepdims=True)
    m2 = F.sum(F.square(F.broadcast_sub(x, local_mean)), axis=1, exclude=True)
    moments = F.concat(F.reshape(local_mean, shape=(-1,)), m2, dim=0)
    mean, var, gamma, beta = F.Custom(moments, F.shape_array(x), gamma, beta, moving_mean,
                                      moving_var, op_type=OP_TYPE, name=name, **op_args)
    scale = F.broadcast_mul(gamma, F.rsqrt(var + eps))
    out = F.broadcast_add(F.broadcast_mul(F.broadcast_sub(x, mean), scale), beta)
    return out, mean, var


class PerseusSyncBatchNorm(mx.gluon.HybridBlock):
    """Batch normalization over axis 1 with statistics from several ranks.

    Arguments as ``mx.gluon.contrib.nn.SyncBatchNorm`` (``num_devices`` is accepted and
    unused: the ranks decide), plus ``comm_scope``: 0 takes the batch statistics over the
    ranks of this host, 1 over every rank. In training, the mean and variance come from
    the union of the ranks' batches (the variance is the biased one, as MXNet's), the
    input's gradient comes from the union's too, and the running statistics move by
    ``momentum``; outside training (or with ``use_global_stats``) the running statistics
    normalize. A ``HybridBlock``: it may be hybridized, alone or inside a hybridized
    network. Also ``mx.gluon.contrib.nn.PerseusSyncBatchNorm``.
    """

    def __init__(self, in_channels=0, num_devices=None, momentum=0.9, epsilon=1e-5,
                 center=True, scale=True, use_global_stats=False, beta_initializer="zeros",
                 gamma_initializer="ones", running_mean_initializer="zeros",
                 running_variance_initializer="ones", comm_scope=0, **kwargs):
        super().__init__(**kwargs)
        self.comm_scope = _check_scope(comm_scope)
        self._eps = epsilon
        self._op_args = {"momentum": momentum, "fix_gamma": not scale,
                         "use_global_stats": use_global_stats, "comm_scope": comm_scope}
        self._calls = 0
        shape = (in_channels,)
        with self.name_scope():
            self.gamma = self.params.get("gamma", grad_req="write" if scale else "null",
                                         shape=shape, init=gamma_initializer,
                                         allow_deferred_init=True, differentiable=scale)
            self.beta = self.params.get("beta", grad_req="write" if center else "null",
                                        shape=shape, init=beta_initializer,
                                        allow_deferred_init=True, differentiable=center)
            self.running_mean = self.params.get("running_mean", grad_req="null", shape=shape,
                                                init=running_mean_initializer,
                                                allow_deferred_init=True, differentiable=False)
            self.running_var = self.params.get("running_var", grad_req="null", shape=shape,
                                               init=running_variance_initializer,
                                               allow_deferred_init=True, differentiable=False)

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        """Normalize ``x`` (N, C, ...) with the statistics of the scope's batch."""
        if self.comm_scope == 0 and basics.is_initialized():
            host_process_set()  # the first time, a collective: here, not in MXNet's threads
        key = f"{self.name}.{self._calls % _NAME_CYCLE}"
        self._calls += 1
        return _sync_batch_norm(F, x, gamma, beta, running_mean, running_var, self._eps,
                                key=key, name="stats", **self._op_args)[0]

    def __repr__(self):
        channels = self.gamma.shape[0] if self.gamma.shape else 0
        return (f"{self.__class__.__name__}(comm_scope={self.comm_scope}, "
                f"in_channels={channels}, eps={self._eps}, {self._op_args})")


def sym_perseus_sync_batch_norm(data=None, gamma=None, beta=None, moving_mean=None,
                                moving_var=None, eps=1e-3, momentum=0.9, fix_gamma=True,
                                use_global_stats=False, output_mean_var=False, ndev=None,
                                key=None, comm_scope=0, name=None, attr=None):
    """``mx.sym.contrib.PerseusSyncBatchNorm``: the symbol form, with the inputs and
    parameters of ``mx.sym.contrib.SyncBatchNorm`` (``ndev`` is accepted and unused: the
    ranks decide) plus ``comm_scope`` (0: this host's ranks, 1: every rank).

    ``data`` (N, C, ...) is required. Inputs left out become the variables
    ``<name>_gamma`` and ``<name>_beta`` and the auxiliary states ``<name>_moving_mean``
    and ``<name>_moving_var``, which training moves by ``momentum``. ``key`` names the
    layer's collectives and must be the same on every rank (default: ``name``). Returns
    the output, or with ``output_mean_var`` a group of the output and the mean and
    variance used (C each).
    """
    _check_scope(comm_scope)
    if data is None:
        raise TypeError("PerseusSyncBatchNorm needs data")
    name = mx.name.NameManager.current.get(name, "perseussyncbatchnorm")
    gamma = mx.sym.var(f"{name}_gamma") if gamma is None else gamma
    beta = mx.sym.var(f"{name}_beta") if beta is None else beta
    moving_mean = mx.sym.var(f"{name}_moving_mean") if moving_mean is None else moving_mean
    moving_var = mx.sym.var(f"{name}_moving_var") if moving_var is None else moving_var
    with mx.AttrScope(**(attr or {})):
        out, mean, var = _sync_batch_norm(
            mx.sym, data, gamma, beta, moving_mean, moving_var, eps, name=name,
            momentum=momentum, fix_gamma=fix_gamma, use_global_stats=use_global_stats,
            comm_scope=comm_scope, key=name if key is None else key)
    if not output_mean_var:
        return out
    return mx.sym.Group([out, mean.reshape((-1,)), var.reshape((-1,))])


mx.gluon.contrib.nn.PerseusSyncBatchNorm = PerseusSyncBatchNorm
mx.sym.contrib.PerseusSyncBatchNorm = sym_perseus_sync_batch_norm

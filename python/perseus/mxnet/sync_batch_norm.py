"""``PerseusSyncBatchNorm`` (seed 003 §4.7): batch normalization whose statistics are
averaged over the ranks of this host (``comm_scope=0``) or of the whole job
(``comm_scope=1``), built on Perseus' collectives without patching MXNet."""

import mxnet as mx

from perseus.common import basics
from perseus.common.objects import allgather_object
from perseus.common.ops import Sum
from perseus.common.process_sets import add_process_set, global_process_set
from perseus.mxnet.mpi_ops import allreduce

# (generation, ranks per host) -> this rank's host set, made once per init().
_host_sets = {}


def host_process_set():
    """The process set of the ranks on this host (the global set on one host). A
    collective the first time after each ``init()``: every rank must call it."""
    key = basics.generation()
    if key not in _host_sets:
        hosts = allgather_object(basics.cross_rank(), name="PerseusSyncBatchNorm.hosts")
        groups = sorted({h: [r for r, g in enumerate(hosts) if g == h] for h in hosts}.items())
        mine = global_process_set
        if len(groups) > 1:
            for host, ranks in groups:
                ps = add_process_set(ranks)
                if host == basics.cross_rank():
                    mine = ps
        _host_sets.clear()
        _host_sets[key] = mine
    return _host_sets[key]


class _SumAcrossRanks(mx.autograd.Function):
    """Sum over a process set whose gradient is the same sum of the gradients."""

    def __init__(self, process_set):
        super().__init__()
        self._process_set = process_set

    def forward(self, x):
        return allreduce(x, op=Sum, process_set=self._process_set)

    def backward(self, dy):
        return allreduce(dy, op=Sum, process_set=self._process_set)


class PerseusSyncBatchNorm(mx.gluon.Block):
    """Batch normalization over axis 1 with statistics from several ranks.

    Arguments as ``mx.gluon.contrib.nn.SyncBatchNorm`` (``num_devices`` is accepted and
    unused: the ranks decide), plus ``comm_scope``: 0 averages the batch statistics
    over the ranks of this host, 1 over every rank. In training, the mean and variance
    come from the union of the ranks' batches (the variance is the biased one, as
    MXNet's), gradients flow through the reduction, and the running statistics move by
    ``momentum``; outside training the running statistics normalize.
    """

    def __init__(self, in_channels=0, num_devices=None, momentum=0.9, epsilon=1e-5,
                 center=True, scale=True, use_global_stats=False, beta_initializer="zeros",
                 gamma_initializer="ones", running_mean_initializer="zeros",
                 running_variance_initializer="ones", comm_scope=0, **kwargs):
        super().__init__(**kwargs)
        if comm_scope not in (0, 1):
            raise ValueError(f"comm_scope must be 0 (this host) or 1 (every rank), got "
                             f"{comm_scope!r}")
        self.comm_scope = comm_scope
        self._momentum, self._epsilon = momentum, epsilon
        self._use_global_stats = use_global_stats
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

    def _process_set(self):
        return host_process_set() if self.comm_scope == 0 else global_process_set

    def _finish_shapes(self, channels):
        for p in (self.gamma, self.beta, self.running_mean, self.running_var):
            if p.shape[0] == 0:
                p.shape = (channels,)
                p._finish_deferred_init()

    def forward(self, x):
        """Normalize ``x`` (N, C, ...) with the statistics of the scope's batch."""
        channels = x.shape[1]
        self._finish_shapes(channels)
        bshape = (1, channels) + (1,) * (x.ndim - 2)
        gamma, beta = self.gamma.data(x.context), self.beta.data(x.context)
        if not mx.autograd.is_training() or self._use_global_stats:
            mean = self.running_mean.data(x.context)
            var = self.running_var.data(x.context)
        else:
            axes = tuple(a for a in range(x.ndim) if a != 1)
            ps = self._process_set()
            local = mx.nd.concat(x.sum(axis=axes), (x * x).sum(axis=axes), dim=0)
            sums = _SumAcrossRanks(ps)(local)
            count = allreduce(mx.nd.array([x.size // channels], dtype="float64"), op=Sum,
                              process_set=ps).asscalar()
            mean = sums[:channels] / count
            var = sums[channels:] / count - mean * mean
            with mx.autograd.pause():
                m = self._momentum
                for p, v in ((self.running_mean, mean), (self.running_var, var)):
                    p.set_data(p.data(x.context) * m + v.detach() * (1 - m))
        norm = (x - mean.reshape(bshape)) / mx.nd.sqrt(var.reshape(bshape) + self._epsilon)
        return norm * gamma.reshape(bshape) + beta.reshape(bshape)

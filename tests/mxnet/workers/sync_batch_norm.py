"""PerseusSyncBatchNorm against a reference computed on the gathered batch: outputs, input
gradients and running statistics, with comm_scope=1 (every rank) and comm_scope=0 (the
ranks of this host; run with -H 127.0.0.1:2,127.0.0.2:1 the hosts differ), as a Block and
after hybridize()."""

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises

SHAPE = (2, 3, 4)  # per rank: batch, channels, width
EPS = 1e-5


def reference(xs, ws, mine):
    """BatchNorm on the concatenation of ``xs`` (the scope's batches), gamma 1 and beta 0:
    this rank's output, the gradient of sum(y * w) for this rank's rows, and the mean
    and (biased) variance."""
    x = mx.nd.array(np.concatenate(xs))
    w = mx.nd.array(np.concatenate(ws))
    x.attach_grad()
    with mx.autograd.record():
        mean = x.mean(axis=(0, 2), keepdims=True)
        var = ((x - mean) ** 2).mean(axis=(0, 2), keepdims=True)
        y = (x - mean) / mx.nd.sqrt(var + EPS)
        loss = (y * w).sum()
    loss.backward()
    rows = slice(mine * SHAPE[0], (mine + 1) * SHAPE[0])
    return (y[rows].asnumpy(), x.grad[rows].asnumpy(), mean.reshape(-1).asnumpy(),
            var.reshape(-1).asnumpy())


def check(scope, members, r, hybridize):
    rng = np.random.RandomState(r)
    x_np = rng.randn(*SHAPE).astype(np.float32) * (r + 1) + r
    w_np = np.random.RandomState(100 + r).randn(*SHAPE).astype(np.float32)
    xs = hvd.allgather_object(x_np)
    ws = hvd.allgather_object(w_np)
    y_ref, g_ref, mean_ref, var_ref = reference([xs[i] for i in members],
                                                [ws[i] for i in members], members.index(r))
    bn = hvd.PerseusSyncBatchNorm(comm_scope=scope, momentum=0.9, epsilon=EPS)
    bn.initialize()
    if hybridize:
        bn.hybridize()
    x = mx.nd.array(x_np)
    x.attach_grad()
    with mx.autograd.record():
        y = bn(x)
        loss = (y * mx.nd.array(w_np)).sum()
    loss.backward()
    what = f"comm_scope={scope}, hybridized={hybridize}"
    close(y, y_ref, f"{what}: output", 1e-4, 1e-4)
    close(x.grad, g_ref, f"{what}: input gradient", 1e-3, 1e-4)
    close(bn.running_mean.data(), 0.1 * mean_ref, f"{what}: running mean", 1e-4, 1e-5)
    close(bn.running_var.data(), 0.9 + 0.1 * var_ref, f"{what}: running variance", 1e-4, 1e-5)
    # Outside training the running statistics normalize, and nothing is communicated.
    out = bn(x)
    close(out, (x_np - 0.1 * mean_ref.reshape(1, 3, 1)) /
          np.sqrt(0.9 + 0.1 * var_ref.reshape(1, 3, 1) + EPS), f"{what}: inference", 1e-4, 1e-4)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    hosts = hvd.allgather_object(hvd.cross_rank())
    for hybridize in (False, True):
        check(1, list(range(n)), r, hybridize)
        check(0, [i for i in range(n) if hosts[i] == hosts[r]], r, hybridize)
    with raises(ValueError, "comm_scope", what="a bad comm_scope"):
        hvd.PerseusSyncBatchNorm(comm_scope=2)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

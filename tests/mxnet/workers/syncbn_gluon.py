"""The gluon PerseusSyncBatchNorm against an ordinary gluon BatchNorm on the concatenated
batch of every rank (each rank has its own data and its own batch size): outputs, input
gradients, gamma's and beta's (and the Conv2Ds') gradients, running statistics over two
steps, then inference. argv[1] says how it runs:

- ``imperative``: ``perseus.mxnet.PerseusSyncBatchNorm`` as a Block;
- ``hybridized``: the same after ``hybridize()``;
- ``sequential``: ``mx.gluon.contrib.nn.PerseusSyncBatchNorm`` between two Conv2D in a
  hybridized HybridSequential.
"""

import sys

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done

EPS, MOMENTUM = 1e-5, 0.9


def batch(step, r, shape):
    """Rank ``r``'s input and loss weights at ``step``: ``r + 2`` rows of its own."""
    rng = np.random.RandomState(10 * step + r)
    x = (rng.randn(r + 2, *shape) * (r + 1) + r).astype(np.float32)
    return x, rng


def set_params(block, seed):
    """The same values on every rank (and in the reference): gamma and beta not 1 and 0."""
    rng = np.random.RandomState(seed)
    for p in block.collect_params().values():
        if p.name.endswith(("running_mean", "running_var")):
            continue
        p.set_data(mx.nd.array(rng.rand(*p.shape) + 0.5))


def build(mode):
    """``(net, sync_bn, layer before it or None, layer after it or None, channels, input
    shape of one row)`` for ``mode``."""
    if mode == "sequential":
        # 8 channels: oneDNN keeps the convolutions' outputs and input gradients in its
        # blocked layout (nChw8c), which custom operators must never see.
        net = mx.gluon.nn.HybridSequential()
        head = mx.gluon.nn.Conv2D(8, 3, in_channels=2)
        bn = mx.gluon.contrib.nn.PerseusSyncBatchNorm(comm_scope=1, momentum=MOMENTUM,
                                                      epsilon=EPS)
        assert isinstance(bn, hvd.PerseusSyncBatchNorm), type(bn)
        tail = mx.gluon.nn.Conv2D(4, 1, in_channels=8)
        net.add(head, bn, tail)
        net.initialize()
        net.hybridize()
        return net, bn, head, tail, 8, (2, 5, 5)
    bn = hvd.PerseusSyncBatchNorm(comm_scope=1, momentum=MOMENTUM, epsilon=EPS)
    assert isinstance(bn, mx.gluon.HybridBlock), type(bn).__mro__
    bn.initialize()
    if mode == "hybridized":
        bn.hybridize()
    return bn, bn, None, None, 3, (3, 4)


def reference(head, bn, tail, xs, ws, r):
    """One training step of the ordinary layers on the concatenated batch. Returns this
    rank's rows of the output and of the input's gradient, and the gradients this rank's
    rows alone give the parameters (what a data-parallel rank holds before the trainer
    averages): gamma's and beta's, and the convolutions' weights' and biases'."""
    rows = slice(sum(len(x) for x in xs[:r]), sum(len(x) for x in xs[:r + 1]))
    x_all, w = mx.nd.array(np.concatenate(xs)), mx.nd.array(np.concatenate(ws))
    z = head(x_all) if head is not None else x_all
    z.attach_grad()
    with mx.autograd.record():
        u = bn(z)
    u_out = u.detach()
    u_out.attach_grad()
    with mx.autograd.record():
        y = tail(u_out) if tail is not None else u_out
        loss = (y * w).sum()
    loss.backward()
    du = u_out.grad
    u.backward(du)
    bshape = (1, -1) + (1,) * (u.ndim - 2)
    x_hat = (u - bn.beta.data().reshape(bshape)) / bn.gamma.data().reshape(bshape)
    axes = tuple(a for a in range(u.ndim) if a != 1)
    local = {"gamma": (du * x_hat)[rows].sum(axis=axes), "beta": du[rows].sum(axis=axes)}
    if tail is not None:
        u_mine = u_out[rows]
        with mx.autograd.record():
            (tail(u_mine) * w[rows]).sum().backward()
        local.update(tail_weight=tail.weight.grad(), tail_bias=tail.bias.grad())
    if head is None:
        return y[rows], z.grad[rows], local
    x_mine = x_all[rows]
    x_mine.attach_grad()
    with mx.autograd.record():
        (head(x_mine) * z.grad[rows]).sum().backward()
    local.update(head_weight=head.weight.grad(), head_bias=head.bias.grad())
    return y[rows], x_mine.grad, local


def main():
    mode = sys.argv[1]
    hvd.init()
    r = hvd.rank()
    net, bn, head, tail, channels, shape = build(mode)
    ref_bn = mx.gluon.nn.BatchNorm(momentum=MOMENTUM, epsilon=EPS, in_channels=channels)
    ref_bn.initialize()
    net(mx.nd.zeros((1,) + shape))  # finish the deferred shapes (inference: no statistics)
    ref_head = ref_tail = None
    if head is not None:
        ref_head = mx.gluon.nn.Conv2D(channels, 3, in_channels=2)
        ref_tail = mx.gluon.nn.Conv2D(4, 1, in_channels=channels)
        for seed, (mine, ref) in enumerate([(head, ref_head), (tail, ref_tail)]):
            ref.initialize()
            set_params(mine, seed)
            set_params(ref, seed)
    set_params(bn, 2)
    set_params(ref_bn, 2)
    for step in range(2):
        x_np, rng = batch(step, r, shape)
        x = mx.nd.array(x_np)
        x.attach_grad()
        with mx.autograd.record():
            y = net(x)
        w_np = rng.randn(*y.shape).astype(np.float32)
        with mx.autograd.record():
            loss = (y * mx.nd.array(w_np)).sum()
        loss.backward()
        y_ref, g_ref, local = reference(ref_head, ref_bn, ref_tail, hvd.allgather_object(x_np),
                                        hvd.allgather_object(w_np), r)
        what = f"{mode}, step {step}, rank {r}"
        close(y, y_ref, f"{what}: output", 1e-4, 1e-4)
        close(x.grad, g_ref, f"{what}: input gradient", 1e-3, 1e-4)
        close(bn.gamma.grad(), local["gamma"], f"{what}: gamma gradient", 1e-3, 1e-4)
        close(bn.beta.grad(), local["beta"], f"{what}: beta gradient", 1e-4, 1e-4)
        for name, layer in (("head", head), ("tail", tail)):
            if layer is not None:
                close(layer.weight.grad(), local[f"{name}_weight"],
                      f"{what}: {name} conv weight gradient", 1e-3, 1e-3)
                close(layer.bias.grad(), local[f"{name}_bias"],
                      f"{what}: {name} conv bias gradient", 1e-3, 1e-3)
        close(bn.running_mean.data(), ref_bn.running_mean.data(), f"{what}: running mean",
              1e-4, 1e-5)
        close(bn.running_var.data(), ref_bn.running_var.data(), f"{what}: running var",
              1e-4, 1e-5)
    # Outside training the running statistics normalize: this rank's data alone.
    x = mx.nd.array(batch(5, r, shape)[0])
    if head is not None:
        expect = ref_tail(ref_bn(ref_head(x)))
    else:
        expect = ref_bn(x)
    close(net(x), expect, f"{mode}, rank {r}: inference", 1e-4, 1e-4)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

"""MXNet's own AMP (mxnet.contrib.amp, bfloat16 on the CPU) with DistributedTrainer:
amp.init_trainer, then amp.scale_loss around backward, with and without amp.unscale
before the step. The weights must follow one process's AMP training on the whole batch
(the loss scale must come off exactly once, and the 1/size exactly once), be the same
on every rank, and an overflow of rank 0's loss must skip that step on every rank, where
each rank's scaler halves its scale."""

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, make_net, regression_batch
from mxnet.contrib import amp

ROWS, STEPS, OVERFLOW_AT = 4, 4, 2
OPT = {"learning_rate": 0.05, "momentum": 0.9}


def weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def train(net, trainer, x, y, step, overflow, unscale):
    with mx.autograd.record():
        loss = ((net(mx.nd.array(x)) - mx.nd.array(y)) ** 2).sum()
        if overflow:
            loss = loss * 1e38  # times the loss scale: beyond float32, inf gradients
        with amp.scale_loss(loss, trainer) as scaled:
            scaled.backward()
    if unscale:
        amp.unscale(trainer)
    trainer.step(x.shape[0])


def run(unscale):
    r, n = hvd.rank(), hvd.size()
    what = "amp.unscale, step" if unscale else "scale_loss, step"
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", OPT)
    amp.init_trainer(trainer)
    ref = make_net()
    ref_trainer = mx.gluon.Trainer(ref.collect_params(), "sgd", OPT, kvstore=None)
    amp.init_trainer(ref_trainer)
    start = weights(net)
    xs, ys = regression_batch(n, ROWS * STEPS)
    for step in range(STEPS):
        whole = slice(step * n * ROWS, (step + 1) * n * ROWS)
        x, y = xs[whole], ys[whole]
        before = weights(net)
        mine = slice(r * ROWS, (r + 1) * ROWS)
        train(net, trainer, x[mine], y[mine], step, r == 0 and step == OVERFLOW_AT, unscale)
        train(ref, ref_trainer, x, y, step, step == OVERFLOW_AT, unscale)
        now = weights(net)
        moved = any(not np.array_equal(a, b) for a, b in zip(now, before))
        assert moved == (step != OVERFLOW_AT), f"{what}, step {step}: weights moved: {moved}"
        scales = hvd.allgather_object(trainer._amp_loss_scaler.loss_scale,
                                      name=f"{what}.scale.{step}")
        assert len(set(scales)) == 1, f"{what}, step {step}: loss scales {scales}"
        for theirs in hvd.allgather_object(now, name=f"{what}.weights.{step}"):
            assert all(np.array_equal(a, b) for a, b in zip(theirs, now)), \
                f"{what}, step {step}: ranks differ"
    # The overflow halved the scale the next step used (MXNet applies it a step later).
    assert trainer._amp_loss_scaler.loss_scale == ref_trainer._amp_loss_scaler.loss_scale
    # How far each weight moved, against the reference's: a scale applied twice or not at
    # all (the loss scale, or the 1/size) would be off by that factor.
    for got, want, w0 in zip(weights(net), weights(ref), start):
        close(got - w0, want - w0, f"{what}: weight change", 3e-2, 3e-3)


amp.init(target_dtype="bfloat16")
hvd.init()
run(unscale=False)
run(unscale=True)
done(hvd.rank())

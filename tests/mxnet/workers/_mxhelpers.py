"""Assertions shared by the MXNet worker scripts (a failure exits non-zero): the torch
workers' helpers, which import no framework until asked."""

import os
import sys
from pathlib import Path

os.environ.setdefault("MXNET_USE_OPERATOR_TUNING", "0")  # fast start (seed 003 §4.6.1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import close_array as close  # noqa: F401 - re-exported
from _helpers import done, raises, regression_batch  # noqa: F401 - re-exported


def make_net():
    """The workers' small regression net, with the same start on every rank."""
    import mxnet as mx
    import numpy as np

    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(3, activation="tanh", in_units=5), mx.gluon.nn.Dense(1, in_units=3))
    rng = np.random.RandomState(7)
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.randn(*p.shape) * 0.5))
    return net


def train_gluon(trainer_for, xs, ys, batch, steps):
    """``steps`` steps of :func:`make_net` on ``xs``, ``ys`` (squared error) with the
    trainer ``trainer_for(params)`` makes; returns the trainer and the weights."""
    import mxnet as mx

    net = make_net()
    trainer = trainer_for(net.collect_params())
    for _ in range(steps):
        with mx.autograd.record():
            loss = ((net(mx.nd.array(xs)) - mx.nd.array(ys)) ** 2).sum()
        loss.backward()
        trainer.step(batch)
    return trainer, [p.data().asnumpy() for p in net.collect_params().values()]

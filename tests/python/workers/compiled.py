"""hvd.DistributedOptimizer with a ``torch.compile``d model (AOTAutograd compiles the
backward; the gradient hooks run where autograd accumulates each parameter's gradient,
outside the compiled graph): every gradient is reduced, and training gives what one
process gets on the whole batch. Plainly and with PERSEUS_OVERLAP_BACKWARD_AND_STEP=1,
whose steps run from those hooks."""

import os

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, small_mlp, step_batch, whole_batch_training
from perseus import _core

STEPS, ROWS = 3, 6


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(what, overlapped):
    r, n = hvd.rank(), hvd.size()
    net = small_mlp()
    opt = hvd.DistributedOptimizer(make_opt(net.parameters()),
                                   named_parameters=net.named_parameters())
    assert opt._overlap == overlapped, f"{what}: the overlapped step is {opt._overlap}"
    compiled = torch.compile(net, backend="aot_eager")
    before = _core.counters()["operations"]
    rows = slice(r * ROWS, (r + 1) * ROWS)
    for step in range(STEPS):
        x, y = step_batch(n, ROWS, step)
        opt.zero_grad()
        F.mse_loss(compiled(x[rows]), y[rows]).backward()
        opt.step()
    ops = _core.counters()["operations"] - before
    assert ops >= STEPS, f"{what}: {ops} reductions in {STEPS} steps"
    for got, want in zip(net.parameters(), whole_batch_training(n, ROWS, STEPS, make_opt)):
        close(got.detach(), want, f"{what}: weights", rtol=1e-5, atol=1e-6)


hvd.init()
train("compiled", overlapped=False)
os.environ["PERSEUS_OVERLAP_BACKWARD_AND_STEP"] = "1"
train("compiled, overlapped step", overlapped=True)
done(hvd.rank())

"""torch's gradient clipping between backward and ``step()``, without Horovod's
``synchronize()`` first: the clip waits for the reductions in flight and clips the
averaged gradients, so training equals one process clipping its whole batch's gradient.
Before, the clip read and scaled gradients that the reduction was still writing, and the
ranks' weights parted. A model with a 4 MiB weight (reduced in its own memory) and small
ones (fused); clip_grad_norm_ given a generator, clip_grad_value_ given one tensor, the
name bound at import (after perseus.torch.horovod, before any optimizer was made),
get_total_norm on the gradients; step() then does not warn or reduce again."""

import warnings

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done
from perseus import _core
from torch import nn
from torch.nn.utils import clip_grad_norm_

ROWS, STEPS = 4, 3


def make_net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 1024 * 1024 // 16), nn.Tanh(),
                         nn.Linear(1024 * 1024 // 16, 4))


def batch(n, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n * ROWS, 16, generator=g), torch.randn(n * ROWS, 4, generator=g)


def clip_norm(net):
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)


def clip_value(net):
    for p in net.parameters():
        torch.nn.utils.clip_grad_value_(p, 1e-4)


def clip_imported(net):
    clip_grad_norm_(list(net.parameters()), 0.05, norm_type=1.0)


def clip_by_total_norm(net):
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    torch.nn.utils.clip_grads_with_norm_(net.parameters(), 0.05, norm)
    return norm


def train(clip, distributed):
    r, n = hvd.rank(), hvd.size()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    rows = slice(r * ROWS, (r + 1) * ROWS) if distributed else slice(None)
    norms = []
    for step in range(STEPS):
        x, y = batch(n, step)
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        norms.append(clip(net))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # step() after the clip's wait: no warning
            before = _core.counters()["operations"]
            opt.step()
            assert _core.counters()["operations"] == before, \
                f"{clip.__name__}: step() reduced again at step {step}"
    return [p.detach() for p in net.parameters()], norms


hvd.init()
for clip in (clip_norm, clip_value, clip_imported, clip_by_total_norm):
    got, got_norms = train(clip, True)
    want, want_norms = train(clip, False)
    for i, (a, b) in enumerate(zip(got, want)):
        close(a, b, f"{clip.__name__}: parameter {i}", rtol=1e-5, atol=1e-6)
    for step, (a, b) in enumerate(zip(got_norms, want_norms)):
        if a is not None:
            close(a, b, f"{clip.__name__}: the gradients' norm at step {step}", rtol=1e-5,
                  atol=1e-7)
    for theirs in hvd.allgather_object(got):
        for a, b in zip(theirs, got):
            assert torch.equal(a, b), f"{clip.__name__}: the ranks' weights differ"
done(hvd.rank())

"""AMP O2 under hvd.DistributedOptimizer on every rank: the reductions run on the model's
float16 gradients and land in the float32 masters, with the plain torch AMP loop (no
synchronize(): GradScaler.unscale_ waits for the reductions) and with Horovod's recipe
(synchronize(), then step() within skip_synchronize()). Every rank must end with the
same masters and weights, close to one process's O2 training on the whole batch. With
PERSEUS_FUSED_OPTIMIZER=1 the steps must be the core's fused ones."""

import os
import warnings

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, count_fused_steps, done, small_mlp, step_batch, torch_own_step
from perseus.torch import amp
from torch import nn

STEPS, ROWS, SCALE, MAX_NORM = 4, 6, 256.0, 1.0
FUSED = os.environ.get("PERSEUS_FUSED_OPTIMIZER") == "1"

calls = count_fused_steps()


model = small_mlp


def batch(n, step):
    return step_batch(n, ROWS, step)


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(n):
    """One process, the whole batch, O2 by hand."""
    net = model()
    pairs = []
    for p in net.parameters():
        p.data = p.data.half()
        pairs.append((p, nn.Parameter(p.detach().float())))
    masters = [m for _, m in pairs]
    opt = make_opt(masters)
    for step in range(STEPS):
        x, y = batch(n, step)
        opt.zero_grad()
        (F.mse_loss(net(x.half()).float(), y) * SCALE).backward()
        for p, m in pairs:
            m.grad = p.grad.float() / SCALE
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        torch_own_step(opt)
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
    return masters


def check(recipe, want):
    r, n = hvd.rank(), hvd.size()
    net = model()
    opt = make_opt(net.parameters())
    amp.amp_decorate(net, opt)
    opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    assert opt._requires_update == set(net.parameters()), "hooks on the model's parameters"
    assert all(p.dtype == torch.float16 for p in opt._requires_update)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    before = len(calls)
    rows = slice(r * ROWS, (r + 1) * ROWS)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = batch(n, step)
            opt.zero_grad()
            scaler.scale(F.mse_loss(net(x[rows]), y[rows])).backward()
            if recipe == "horovod":
                opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(amp.amp_parameters(opt), MAX_NORM)
            if recipe == "horovod":
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
    twice = [w for w in seen if "skip_synchronize" in str(w.message)]
    assert not twice, f"{recipe}: {twice[0].message}"
    assert scaler.get_scale() == SCALE, f"{recipe}: a step overflowed"
    fused_steps = sum(1 for o in calls[before:] if o is opt)
    assert fused_steps == (STEPS if FUSED else 0), (recipe, fused_steps)
    masters = [p for g in opt.param_groups for p in g["params"]]
    for got, expect in zip(masters, want):
        close(got.detach(), expect.detach(), f"{recipe}: master", rtol=1e-2, atol=2e-3)
    for got, m in zip(net.parameters(), masters):
        assert torch.equal(got, m.detach().half()), f"{recipe}: the model is its masters"
    mine = [p.detach() for p in masters]
    for theirs in hvd.allgather_object(mine, name=f"{recipe}.masters"):
        assert all(torch.equal(a, b) for a, b in zip(theirs, mine)), f"{recipe}: ranks differ"


hvd.init()
want = reference(hvd.size())
check("plain", want)
check("horovod", want)
done(hvd.rank())

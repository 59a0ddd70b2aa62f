"""Seed 001's script, unchanged, after ``import perseus``: DDP with
``AIAK_FUSED_OPTIMIZER=1`` in the environment (the steps of torch.optim.SGD and AdamW are
the core's fused step), and ``torch.optim.LAMB`` and ``torch.cuda.amp.aiak_amp_*`` where
seed 001 calls them.

``aiak_names.py fused|torch``: ``fused`` expects the fused step at every step (the
variable is set), ``torch`` expects none (it is not). Either way the model must be what
one process gets with torch's own step on the whole batch.
"""

import os
import sys

import perseus  # noqa: F401 - before torch, as seed 003 asks
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim  # noqa: PLR0402 - seed 001's own line
from _helpers import close, count_fused_steps, done, torch_own_step
from perseus.torch import amp as pamp
from perseus.torch import optim as poptim
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROWS, STEPS = 8, 4
want_fused = sys.argv[1] == "fused"

# The names seed 001's code uses are Perseus's.
assert optim.LAMB is poptim.LAMB
assert torch.cuda.amp.aiak_amp_decorate is pamp.amp_decorate
assert torch.cuda.amp.aiak_amp_parameters is pamp.amp_parameters


def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(n):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(ROWS * n, 5, generator=g)
    return x, x.sum(1, keepdim=True).cos()


dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
x, y = batch(n)
rows = slice(rank * ROWS, (rank + 1) * ROWS)
for make in (lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
             lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1)):
    calls = count_fused_steps()
    net = DDP(model())
    opt = make(net.parameters())
    ref = model()
    ref_opt = make(ref.parameters())
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch_own_step(ref_opt)
    kind = type(opt).__name__
    assert len(calls) == (STEPS if want_fused else 0), f"rank {rank}: {kind}: {len(calls)} " \
        f"fused steps in {STEPS}"
    for p, q in zip(net.module.parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"rank {rank}: {kind} after {STEPS} steps",
              rtol=1e-5, atol=1e-6)

# Seed 001's LAMB line, with its arguments.
net = model()
opt = optim.LAMB(net.parameters(), lr=0.01, weight_decay=0.01, eps=1e-8, betas=(0.9, 0.999))
before = [p.detach().clone() for p in net.parameters()]
F.mse_loss(net(x), y).backward()
opt.step()
assert all(not torch.equal(b, p) for b, p in zip(before, net.parameters())), "LAMB: no step"
done(rank)
dist.barrier()
sys.stdout.flush()
os._exit(0)

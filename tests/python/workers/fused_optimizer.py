"""Fused optimizers on every rank (run with PERSEUS_FUSED_OPTIMIZER=1): DistributedOptimizer
over torch.optim.Adam / SGD takes the core's fused step, over FusedLAMB the fused LAMB, and
over an amsgrad Adam torch's own step (with a warning). Every rank must end with the
weights one process gets from the whole batch."""

import sys

import perseus.torch.horovod as hvd
import perseus.torch.optim as fused
import torch
import torch.nn.functional as F
from _helpers import close, count_fused_steps, done, small_mlp, step_batch, torch_own_step

STEPS, ROWS = 4, 5
# "cuda" as the first argument: the model trains on the GPU (the reference on the CPU).
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"


model = small_mlp


def batch(n, step):
    return step_batch(n, ROWS, step)


def train(net, opt, rows, n, step_fn=None):
    device = next(net.parameters()).device
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(n, step))
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        (step_fn or opt.step)()


calls = count_fused_steps()


def check(make_opt, what, expect_fused):
    r, n = hvd.rank(), hvd.size()
    ref = model()
    ref_opt = make_opt(ref.parameters())
    train(ref, ref_opt, slice(None), n,
          None if isinstance(ref_opt, fused.FusedOptimizer) else lambda: torch_own_step(ref_opt))
    net = model().to(DEVICE)
    before = len(calls)
    opt = hvd.DistributedOptimizer(make_opt(net.parameters()),
                                   named_parameters=net.named_parameters())
    train(net, opt, slice(r * ROWS, (r + 1) * ROWS), n)
    fused_steps = sum(1 for o in calls[before:] if o is opt)
    assert fused_steps == (STEPS if expect_fused else 0), (what, fused_steps)
    for a, b in zip(net.parameters(), ref.parameters()):
        close(a.detach().cpu(), b.detach(), what, rtol=2e-5, atol=2e-6)
    mine = [p.detach().cpu() for p in net.parameters()]
    for theirs in hvd.allgather_object(mine, name=f"{what}.params"):
        assert all(torch.equal(a, b) for a, b in zip(theirs, mine)), f"{what}: ranks differ"
    return opt


hvd.init()
# The reference runs torch's own step (calls outside a DistributedOptimizer are not
# counted): the fused step through DistributedOptimizer must land on it.
opt = check(lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01), "Adam", True)
assert isinstance(next(iter(opt.state.values()))["step"], torch.Tensor), "torch's state kept"
check(lambda p: torch.optim.AdamW(p, lr=0.01), "AdamW", True)
check(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "SGD", True)
check(lambda p: fused.LAMB(p, lr=0.01, weight_decay=0.01), "LAMB", True)
check(lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True), "Adam amsgrad", False)
done(hvd.rank())

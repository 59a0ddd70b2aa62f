"""torch's own AMP (a float32 model, GradScaler, no amp_decorate) under
hvd.DistributedOptimizer, where only rank 0's loss overflows at step OVERFLOW_AT.
GradScaler.unscale_ waits for the reductions, so it finds the inf in the averaged
gradients on every rank: every rank skips that step and halves its scale, and the
weights stay the same on every rank and close to one process's training on the whole
batch. Both loops: scaler.step() alone (it unscales), and unscale_, clipping, step()."""

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, small_mlp, step_batch, whole_batch_training

STEPS, ROWS, SCALE, OVERFLOW_AT, MAX_NORM = 4, 6, 2.0**16, 1, 1.0


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(n, clip):
    """One process, the whole batch, the overflowed step skipped."""
    return whole_batch_training(n, ROWS, STEPS, make_opt, skipped=(OVERFLOW_AT,),
                                max_norm=MAX_NORM if clip else None)


def train(clip):
    r, n = hvd.rank(), hvd.size()
    net = small_mlp()
    opt = hvd.DistributedOptimizer(make_opt(net.parameters()),
                                   named_parameters=net.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    rows = slice(r * ROWS, (r + 1) * ROWS)
    what = "unscale_, clip, step" if clip else "scaler.step alone"
    for step in range(STEPS):
        x, y = step_batch(n, ROWS, step)
        opt.zero_grad()
        loss = F.mse_loss(net(x[rows]), y[rows])
        if r == 0 and step == OVERFLOW_AT:
            loss = loss * 1e36  # scaled by 2**16: beyond float32, inf gradients
        before = [p.detach().clone() for p in net.parameters()]
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        want = SCALE / 2 if step >= OVERFLOW_AT else SCALE
        scales = hvd.allgather_object(scaler.get_scale(), name=f"{what}.scale.{step}")
        assert scales == [want] * n, f"{what}, step {step}: scales {scales}"
        if step == OVERFLOW_AT:
            for p, b in zip(net.parameters(), before):
                assert torch.equal(p.detach(), b), f"{what}: the overflowed step moved p"
        mine = [p.detach() for p in net.parameters()]
        for theirs in hvd.allgather_object(mine, name=f"{what}.weights.{step}"):
            assert all(torch.equal(a, b) for a, b in zip(theirs, mine)), \
                f"{what}, step {step}: ranks differ"
    for got, expect in zip(net.parameters(), reference(n, clip)):
        close(got.detach(), expect, f"{what}: weights", rtol=1e-5, atol=1e-6)


hvd.init()
train(clip=False)
train(clip=True)
done(hvd.rank())

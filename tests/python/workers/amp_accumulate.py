"""PERSEUS_ACCUMULATE_N_STEPS=2 with torch.amp.GradScaler, the loop unchanged: scale,
backward, (unscale_, clip,) scaler.step, update, on every iteration. The scale must hold
within each window of N calls (the accumulated gradients share one scale), the weights
move once per window by the window's averaged gradient, clipped once, and an overflow
on rank 0 in the middle of a window must skip that whole window on every rank and halve
the scale. Checked against one process training on the whole batch, one window at a
time: the float32 model with both loops, and AMP O2 (amp_decorate) with its clipping of
amp_parameters(). Last, AMP O2 in bfloat16 without a scaler, clipping amp_parameters()
on every call: within a window the model's gradients must stay where backward leaves
them, to be reduced whole at the window's end, so there is nothing to clip yet."""

import os

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, small_mlp, step_batch
from perseus.torch import amp

N = int(os.environ["PERSEUS_ACCUMULATE_N_STEPS"])
STEPS, ROWS, SCALE, MAX_NORM = 3 * N, 6, 2.0**10, 0.5
OVERFLOW_AT = N  # the first call of the second window: its whole window is skipped


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def scale_after(step):
    """The scale after ``update()`` at ``step`` (growth_interval=1: a window that steps
    doubles it, an overflowed one halves it; the calls within a window keep it)."""
    scale = SCALE
    for s in range(step + 1):
        if (s + 1) % N == 0:
            overflowed = s // N == OVERFLOW_AT // N
            scale = scale / 2 if overflowed else scale * 2
    return scale


def reference(n, clip, skipped):
    """One process, the whole batch: each window's gradient is the mean of its N calls'
    gradients, clipped once; the ``skipped`` window does not step."""
    net = small_mlp()
    opt = make_opt(net.parameters())
    for window in range(STEPS // N):
        opt.zero_grad()
        for k in range(N):
            x, y = step_batch(n, ROWS, window * N + k)
            (F.mse_loss(net(x), y) / N).backward()
        if window == skipped:
            continue
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        opt.step()
    return [p.detach() for p in net.parameters()]


def train_unscaled():
    """AMP O2 in bfloat16, no GradScaler, amp_parameters() clipped on every call."""
    r, n = hvd.rank(), hvd.size()
    net = small_mlp()
    net, opt = amp.amp_decorate(net, make_opt(net.parameters()), dtype=torch.bfloat16)
    opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    rows = slice(r * ROWS, (r + 1) * ROWS)
    for step in range(STEPS):
        x, y = step_batch(n, ROWS, step)
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        torch.nn.utils.clip_grad_norm_(list(amp.amp_parameters(opt)), MAX_NORM)
        opt.step()
    masters = list(amp.amp_parameters(opt))
    for theirs in hvd.allgather_object([m.detach() for m in masters], name="bf16.weights"):
        assert all(torch.equal(a, b.detach()) for a, b in zip(theirs, masters)), \
            "bfloat16 O2: ranks differ"
    for got, expect in zip(masters, reference(n, clip=True, skipped=None)):
        close(got.detach(), expect, "bfloat16 O2, clipping every call: weights",
              rtol=2e-2, atol=2e-2)


def train(clip, o2):
    r, n = hvd.rank(), hvd.size()
    what = ("AMP O2, " if o2 else "") + ("unscale_, clip, step" if clip else "scaler.step")
    net = small_mlp()
    opt = make_opt(net.parameters())
    if o2:
        net, opt = amp.amp_decorate(net, opt)
    opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    rows = slice(r * ROWS, (r + 1) * ROWS)
    weights = list(amp.amp_parameters(opt)) if o2 else list(net.parameters())
    for step in range(STEPS):
        x, y = step_batch(n, ROWS, step)
        opt.zero_grad()
        loss = F.mse_loss(net(x[rows]), y[rows])
        if r == 0 and step == OVERFLOW_AT:
            loss = loss * 1e36  # beyond float32 (and float16) once scaled: inf gradients
        before = [w.detach().clone() for w in weights]
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            clipped = list(amp.amp_parameters(opt)) if o2 else list(net.parameters())
            torch.nn.utils.clip_grad_norm_(clipped, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        scales = hvd.allgather_object(scaler.get_scale(), name=f"{what}.scale.{step}")
        assert scales == [scale_after(step)] * n, \
            f"{what}, step {step}: scales {scales}, expected {scale_after(step)}"
        moved = any(not torch.equal(w.detach(), b) for w, b in zip(weights, before))
        steps_here = (step + 1) % N == 0 and step // N != OVERFLOW_AT // N
        assert moved == steps_here, f"{what}, step {step}: weights moved: {moved}"
        mine = [w.detach() for w in weights]
        for theirs in hvd.allgather_object(mine, name=f"{what}.weights.{step}"):
            assert all(torch.equal(a, b) for a, b in zip(theirs, mine)), \
                f"{what}, step {step}: ranks differ"
    tol = {"rtol": 2e-3, "atol": 2e-3} if o2 else {"rtol": 1e-5, "atol": 1e-6}
    for got, expect in zip(weights, reference(n, clip, skipped=OVERFLOW_AT // N)):
        close(got.detach(), expect, f"{what}: weights", **tol)


hvd.init()
for o2 in (False, True):
    for clip in (False, True):
        train(clip, o2)
train_unscaled()
done(hvd.rank())

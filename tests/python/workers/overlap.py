"""PERSEUS_OVERLAP_BACKWARD_AND_STEP=1: parameters step as their reduced gradients arrive.

Usage: overlap.py sgd|adam   6 steps of a 3-layer model whose first layer's backward is
                             slow (0.3 s): after backward() returns, before step(), the
                             last layer has already stepped; after the steps every rank
                             equals one process that averaged the ranks' gradients and
                             stepped torch's optimizer (Adam's step counts included), the
                             per-tensor clipping of the environment too
       overlap.py explicit   synchronize() and step() under skip_synchronize(): no
                             parameter steps twice; torch's clip_grad_norm_ after a
                             backward that stepped parameters warns, once, that it
                             cannot reach them, naming PERSEUS_CLIP_GRAD_FUNC
       overlap.py refused    step(closure) is refused, naming the switch; so is the
                             switch itself under PERSEUS_ALLREDUCE_NANCHECK=1, and so are
                             it and DGC when a GradScaler scales the loss (only
                             until that scaler's update())
"""

import os
import sys
import time
import warnings

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises

STEPS, DIMS = 6, (12, 16, 16, 4)


class SlowBackward(torch.autograd.Function):
    """Identity forward; backward sleeps, so reductions started earlier can finish."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.3)
        return grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x):
        x = self.layers[0](x)
        x = SlowBackward.apply(torch.tanh(x))
        for layer in self.layers[1:]:
            x = layer(torch.tanh(x))
        return x


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, DIMS[0], generator=g), torch.randn(8, DIMS[-1], generator=g)


def make_optimizer(kind, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)


def clip(grads):
    func = os.environ.get("PERSEUS_CLIP_GRAD_FUNC")
    limit = float(os.environ.get("PERSEUS_CLIP_GRAD_FUNC_PARAMS", "0"))
    for g in grads:
        if func == "value":
            g.clamp_(-limit, limit)
        elif func == "norm":
            g.mul_(min(1.0, limit / (float(g.norm()) + 1e-6)))


def reference(kind, n):
    """One process: the average of every rank's gradient, clipped per tensor, then
    torch's own step."""
    model = Net()
    opt = make_optimizer(kind, model.parameters())
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(n):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(batch(r, step)[0]), batch(r, step)[1]).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / n
        clip(grads)
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        opt.step()
    return model


def train(kind, explicit=False):
    n = hvd.size()
    model = Net()
    opt = hvd.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                   named_parameters=model.named_parameters())
    last = model.layers[-1].weight
    moved_early = 0
    for step in range(STEPS):
        opt.zero_grad()
        before = last.detach().clone()
        x, y = batch(hvd.rank(), step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        moved_early += int(not torch.equal(before, last.detach()))
        if explicit:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    want = reference(kind, n)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        close(p.detach(), q.detach(), name, rtol=1e-5, atol=1e-6)
    if kind == "adam":
        steps = {int(opt.state[p]["step"]) for p in model.parameters()}
        assert steps == {STEPS}, steps
    return moved_early


def clip_after_backward():
    model = Net()
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters())
    seen = []  # per step: whether parameters had stepped before the clip, its warnings
    for step in range(3):
        opt.zero_grad()
        x, y = batch(hvd.rank(), step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        stepped = bool(opt._overlapped)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seen.append((stepped, [str(w.message) for w in caught
                               if issubclass(w.category, RuntimeWarning)]))
        opt.step()
    assert any(stepped for stepped, _ in seen), f"nothing stepped during backward: {seen}"
    first = next(i for i, (stepped, _) in enumerate(seen) if stepped)
    for i, (_, messages) in enumerate(seen):
        if i != first:
            assert not messages, f"step {i}: warned again or early: {messages}"
    [message] = seen[first][1]
    for part in ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1", "clip_grad_norm_",
                 "PERSEUS_CLIP_GRAD_FUNC"):
        assert part in message, f"{part!r} not in the warning: {message}"


def main():
    mode = sys.argv[1]
    hvd.init()
    if mode in ("sgd", "adam"):
        moved = train(mode)
        # The last layer's reduction finishes while the slow first layer's backward runs:
        # usually at every step, but 3 ranks on 2 cores may see one finish just after
        # backward (then opt.step() takes it, as the values checked above show), so the
        # check asks for the overlap to have happened, not for it at every step.
        assert moved >= 1, f"the last layer never stepped during backward ({STEPS} steps)"
        print(f"rank {hvd.rank()}: stepped during backward {moved} of {STEPS}", flush=True)
    elif mode == "explicit":
        train("sgd", explicit=True)
        clip_after_backward()
    elif os.environ.get("PERSEUS_ALLREDUCE_NANCHECK") == "1":
        model = Net()
        with raises(ValueError, "PERSEUS_OVERLAP_BACKWARD_AND_STEP=1",
                    "PERSEUS_ALLREDUCE_NANCHECK=1", what="overlap with the NaN check"):
            hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                     named_parameters=model.named_parameters())
    else:
        model = Net()
        opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                       named_parameters=model.named_parameters())
        torch.nn.functional.mse_loss(model(batch(0, 0)[0]), batch(0, 0)[1]).backward()
        with raises(ValueError, "PERSEUS_OVERLAP_BACKWARD_AND_STEP=1", "step(closure)",
                    what="a closure"):
            opt.step(lambda: None)
        opt.step()
        # A GradScaler of another optimizer that has finished its iteration (update())
        # leaves a later backward, not scaled, to the overlapped step.
        os.environ.pop("PERSEUS_OVERLAP_BACKWARD_AND_STEP")
        model = Net()
        other = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                         named_parameters=model.named_parameters())
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.nn.functional.mse_loss(model(batch(0, 0)[0]),
                                                  batch(0, 0)[1])).backward()
        scaler.step(other)
        scaler.update()
        os.environ["PERSEUS_OVERLAP_BACKWARD_AND_STEP"] = "1"
        model = Net()
        opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                       named_parameters=model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.mse_loss(model(batch(0, 0)[0]), batch(0, 0)[1]).backward()
        opt.step()
        assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        # Under a GradScaler gradients arrive multiplied by the scale: the overlapped step
        # and DGC, which use them as backward produces them, refuse them by name.
        for switch in ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1", "PERSEUS_DGC=1"):
            if switch == "PERSEUS_DGC=1":
                os.environ.pop("PERSEUS_OVERLAP_BACKWARD_AND_STEP")
                os.environ["PERSEUS_DGC"] = "1"
            model = Net()
            opt = hvd.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                           named_parameters=model.named_parameters())
            x, y = batch(0, 0)
            with raises(ValueError, switch, "does not go with torch.amp.GradScaler",
                        what=f"{switch} under a GradScaler"):
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    r = hvd.rank()
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

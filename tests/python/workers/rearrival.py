"""hvd.DistributedOptimizer when a parameter's gradient arrives in parts after its
reduction started: a module run twice under reentrant ``torch.utils.checkpoint`` (each
run's backward is a backward pass of its own, so the module's gradient hook fires twice),
and two ``backward()`` calls per step with the default ``backward_passes_per_step=1``.
Horovod asserts "Gradients were computed more than backward_passes_per_step times" there,
after backward added the second part into a gradient its reduction was writing. Each
case must give what one process gets on the whole batch: plainly, with ``groups=2``, with
fp16 compression, over ``backward_passes_per_step=2``, and with ``op=Sum`` (which a
second reduction of a gradient reduced already would multiply by the ranks), alone and
with groups (a group's reduction, waited for when one member arrives again, gives the
others their result early). Under the
overlapped step, which may have stepped the parameter already, the second part is
refused with an error that names the parameter and the way out."""

import os

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, raises
from torch import nn
from torch.utils.checkpoint import checkpoint

ROWS, STEPS, VOCAB = 4, 4, 40


class Shared(nn.Module):
    """An embedding tied to the output layer, one block run twice (ALBERT-like), and an
    output scale whose gradient arrives once, first."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.scale = nn.Parameter(torch.ones(1))
        self.reentrant = reentrant

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        for _ in range(2):
            h = (checkpoint(self.block, h, use_reentrant=True) if self.reentrant
                 else self.block(h))
        return (h @ self.emb.weight.t()) * self.scale


def batch(n, step):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (ROWS * n, 5), generator=g),
            torch.randint(0, VOCAB, (ROWS * n,), generator=g))


def train(distributed, reentrant=True, calls=1, passes=1, lr=0.1, **kwargs):
    """``calls`` backward() per step over parts of the batch (each its share of the
    mean); on the ranks' rows, or in one process on the whole batch."""
    r, n = hvd.rank(), hvd.size()
    net = Shared(reentrant)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if kwargs.get("groups") == "pair":  # reduced together: the scale arrives once
        kwargs["groups"] = [[net.scale, net.block[2].bias]]
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                       backward_passes_per_step=passes, **kwargs)
    for step in range(STEPS):
        x, y = batch(n, step)
        if distributed:
            x, y = x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]
        opt.zero_grad()
        for xs, ys in zip(x.chunk(calls), y.chunk(calls)):
            (F.cross_entropy(net(xs), ys) / calls).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def check(what, atol=1e-6, want_lr=0.1, **kwargs):
    got = train(True, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k in ("reentrant", "calls")}
    want = train(False, lr=want_lr, **kwargs)
    for i, (a, b) in enumerate(zip(got, want)):
        close(a, b, f"{what}: parameter {i} after {STEPS} steps", rtol=1e-4, atol=atol)
    for theirs in hvd.allgather_object(got):
        for a, b in zip(theirs, got):
            assert torch.equal(a, b), f"{what}: the ranks' weights differ"


hvd.init()
n = hvd.size()
check("reentrant checkpoint")
check("reentrant checkpoint, groups=2", groups=2)
check("reentrant checkpoint, fp16", atol=2e-3, compression=hvd.Compression.fp16)
check("reentrant checkpoint, backward_passes_per_step=2", calls=2, passes=2)
check("two backward() calls per step", reentrant=False, calls=2)
# Sum adds the ranks' gradients: n times the average, the reference's lr times n for SGD.
check("reentrant checkpoint, op=Sum", op=hvd.Sum, lr=0.1 / n, want_lr=0.1)
check("reentrant checkpoint, groups=2, op=Sum", groups=2, op=hvd.Sum, lr=0.1 / n,
      want_lr=0.1)
check("reentrant checkpoint, a group of one gradient arriving again and one not, op=Sum",
      groups="pair", op=hvd.Sum, lr=0.1 / n, want_lr=0.1)
os.environ["PERSEUS_OVERLAP_BACKWARD_AND_STEP"] = "1"
with raises(RuntimeError, "'block.", "arrived again", "use_reentrant=False",
            "PERSEUS_OVERLAP_BACKWARD_AND_STEP", what="the overlapped step"):
    train(True)
done(hvd.rank())

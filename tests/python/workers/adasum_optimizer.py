"""hvd.DistributedOptimizer(op=hvd.Adasum): each rank steps on its own batch with its
own optimizer state, then every rank's weights become the start plus the Adasum of the
ranks' weight changes. Checked against a replay of every rank's local step (torch's own
step, each rank's optimizer state kept apart) combined by the NumPy rule of
_adasum_rule.py: Adam, SGD with momentum over two backward passes per step, fp16
compression, a process set, bits alike on every rank, a GradScaler whose overflow on one
rank skips the step on every rank, and the refusals."""

import copy
import os

import numpy as np
import perseus.torch.horovod as hvd
import torch
from _adasum_rule import reference
from _helpers import close, done, raises, torch_own_step
from perseus.torch import amp
from torch import nn

hvd.init()
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
MODEL0 = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
STEPS = 3


def batch(k, step, part):
    """Rank ``k``'s data for ``step`` (backward pass ``part``): different on each rank."""
    rng = np.random.RandomState(1000 * k + 10 * step + part)
    return torch.tensor(rng.randn(8, 4)), torch.tensor(rng.randn(8, 2))


def backward(model, k, step, part):
    x, y = batch(k, step, part)
    nn.functional.mse_loss(model(x), y).backward()


def replay(make_opt, ranks, passes, skipped=None):
    """The weights after STEPS steps, computed here for all of ``ranks``; the step
    ``skipped`` is not taken (by any rank)."""
    models = [copy.deepcopy(MODEL0) for _ in ranks]
    opts = [make_opt(m.parameters()) for m in models]
    current = [p.detach().clone() for p in MODEL0.parameters()]
    for step in range(STEPS):
        if step == skipped:
            continue
        changes = []
        for model, opt, k in zip(models, opts, ranks):
            with torch.no_grad():
                for p, c in zip(model.parameters(), current):
                    p.copy_(c)
            opt.zero_grad()
            for part in range(passes):
                backward(model, k, step, part)
            torch_own_step(opt)
            changes.append([p.detach() - c for p, c in zip(model.parameters(), current)])
        current = [c + torch.from_numpy(reference([ch[i].numpy() for ch in changes]))
                   .reshape(c.shape) for i, c in enumerate(current)]
    return current


def train(make_opt, passes=1, process_set=hvd.global_process_set, **kwargs):
    model = copy.deepcopy(MODEL0)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=passes, process_set=process_set,
                                   **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        for part in range(passes):
            backward(model, r, step, part)
        opt.step()
    return model, opt


def check(what, make_opt, passes=1, ranks=None, process_set=hvd.global_process_set,
          rtol=1e-10, atol=1e-12, **kwargs):
    ranks = list(range(n)) if ranks is None else ranks
    model, _ = train(make_opt, passes, process_set, **kwargs)
    want = replay(make_opt, ranks, passes)
    for (name, p), w in zip(model.named_parameters(), want):
        close(p.detach(), w, f"{what}: {name}", rtol=rtol, atol=atol)
    # A local step alone would differ: the check is not vacuous.
    alone = replay(make_opt, [r], passes)
    assert any(not torch.allclose(p.detach(), w, rtol=1e-6, atol=1e-8)
               for p, w in zip(model.parameters(), alone)), f"{what}: no rank's change mixed"
    weights = torch.cat([p.detach().ravel() for p in model.parameters()])
    everyone = hvd.allgather_object(weights, name=f"bits.{what}", process_set=process_set)
    assert all(torch.equal(everyone[0], w) for w in everyone), f"{what}: ranks differ"


check("adam", lambda ps: torch.optim.Adam(ps, lr=0.05))
check("sgd momentum, 2 passes", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), passes=2)
check("sgd fp16 wire", lambda ps: torch.optim.SGD(ps, lr=0.1),
      compression=hvd.Compression.fp16, rtol=5e-3, atol=5e-4)



def scaled(overflow_at):
    """torch.amp.GradScaler around the Adasum optimizer, rank 0's loss overflowing at step
    ``overflow_at``. Each rank unscales its own gradients, so the ranks must agree: every
    one skips that step (a rank skipping alone left the others waiting in the weight
    changes' reduction, which then paired its next step with their current one)."""
    def make_opt(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = copy.deepcopy(MODEL0)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(r, step, 0)
        loss = nn.functional.mse_loss(model(x), y)
        if r == 0 and step == overflow_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales = hvd.allgather_object(scaler.get_scale(), name=f"adasum.scale.{step}")
        want = 2.0**10 if step < overflow_at else 2.0**9
        assert scales == [want] * n, f"GradScaler, step {step}: scales {scales}"
    for (name, p), w in zip(model.named_parameters(),
                            replay(make_opt, list(range(n)), 1, skipped=overflow_at)):
        close(p.detach(), w, f"GradScaler, overflow skipped everywhere: {name}",
              rtol=1e-10, atol=1e-12)


scaled(overflow_at=1)

# The wrapped optimizer keeps its class, its state and Horovod's contract.
model, opt = train(lambda ps: torch.optim.Adam(ps, lr=0.05))
assert isinstance(opt, torch.optim.Adam) and opt.op == hvd.Adasum
assert all(opt.state[p]["step"] == STEPS for p in model.parameters())
opt.synchronize()
with raises(AssertionError, "Skipping synchronization is not supported", what="skip"), \
        opt.skip_synchronize():
    pass

if n >= 3:
    pair_set = hvd.add_process_set([0, n - 1])
    if pair_set.included():
        check("process set", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
              ranks=[0, n - 1], process_set=pair_set)
    hvd.remove_process_set(pair_set)

os.environ["PERSEUS_DGC"] = "1"
with raises(ValueError, "op=Adasum) does not go with PERSEUS_DGC=1", what="Adasum with DGC"):
    hvd.DistributedOptimizer(torch.optim.SGD(MODEL0.parameters(), lr=0.1), op=hvd.Adasum)
del os.environ["PERSEUS_DGC"]
half_net = nn.Linear(4, 2)
half_opt = torch.optim.SGD(half_net.parameters(), lr=0.1)
amp.amp_decorate(half_net, half_opt)
with raises(ValueError, "does not go with an optimizer under aiak_amp_decorate",
            what="Adasum with AMP O2"):
    hvd.DistributedOptimizer(half_opt, op=hvd.Adasum)
with raises(ValueError, "gradient_predivide_factor not supported with op != Average",
            what="Adasum with a predivide factor"):
    hvd.DistributedOptimizer(torch.optim.SGD(MODEL0.parameters(), lr=0.1), op=hvd.Adasum,
                             gradient_predivide_factor=2.0)
done(r)

"""hvd.DistributedOptimizer while the set of trained parameters changes, as in
fine-tuning: a layer frozen when the optimizer is wrapped and unfrozen later, a layer
frozen later, and a parameter group added with ``add_param_group``. Each phase must give
what one process gets on the whole batch with the same schedule: a parameter unfrozen
later is averaged (it had no gradient hook; before, each rank stepped on its own
gradient and the ranks parted), a parameter frozen later does not move (before, it got a
zero gradient, and momentum and weight decay moved it), and an added group is averaged.
Plainly, with ``groups=2``, over two backward passes per step, and with the overlapped
step; then ``op=Adasum``'s add_param_group (its weight changes need names)."""

import os

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, small_mlp, step_batch

ROWS = 4
# step -> what changes before it: ("unfreeze"|"freeze", layer) or ("add", None)
SCHEDULE = {2: ("unfreeze", 0), 4: ("freeze", 2), 6: ("add", None)}
STEPS = 8


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)


def train(r, n, distributed, passes=1, **kwargs):
    """Trains :func:`small_mlp` (plus a bias added in the ``add`` phase) by SCHEDULE; on
    ``n`` ranks of ROWS rows, or in one process on the whole batch. Returns the
    parameters after each step."""
    net = small_mlp()
    net[0].requires_grad_(False)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = make_opt(net.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                       backward_passes_per_step=passes, **kwargs)
    rows = slice(r * ROWS, (r + 1) * ROWS) if distributed else slice(None)
    added = False
    history = []
    for step in range(STEPS):
        change, layer = SCHEDULE.get(step, (None, None))
        if change == "unfreeze":
            net[layer].requires_grad_(True)
        elif change == "freeze":
            net[layer].requires_grad_(False)
        elif change == "add":
            opt.add_param_group({"params": [extra], "lr": 0.2})
            added = True
        x, y = step_batch(n, ROWS * passes, step)
        opt.zero_grad()
        for part in range(passes):
            xs, ys = (t.view(passes, n * ROWS, -1)[part] for t in (x, y))
            out = net(xs[rows]) + (extra if added else 0)
            # The whole batch's mean over the passes: one process divides by them too.
            (F.mse_loss(out, ys[rows]) / passes).backward()
        opt.step()
        history.append([p.detach().clone() for p in [*net.parameters(), extra]])
    return history


def check(what, passes=1, **kwargs):
    r, n = hvd.rank(), hvd.size()
    got = train(r, n, True, passes, **kwargs)
    want = train(r, n, False, passes)
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            close(a, b, f"{what}: parameter {i} after step {step}", rtol=1e-5, atol=1e-6)
    # The phases did what they say: frozen layers kept their weights meanwhile.
    assert torch.equal(got[0][0], got[1][0]) and not torch.equal(got[1][0], got[2][0]), \
        f"{what}: layer 0 should stay frozen for steps 0-1 and train from step 2"
    assert torch.equal(got[3][2], got[4][2]) and torch.equal(got[3][2], got[7][2]), \
        f"{what}: layer 2 should stay frozen from step 4"
    assert not torch.equal(got[5][4], got[6][4]), f"{what}: the added group should train"
    everyone = hvd.allgather_object(got[-1])
    for theirs in everyone:
        for a, b in zip(theirs, got[-1]):
            assert torch.equal(a, b), f"{what}: the ranks' weights differ"


def check_adasum_add_param_group():
    r = hvd.rank()
    net = small_mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Adasum,
                                   named_parameters=net.named_parameters())
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    assert opt._parameter_names[extra] == "allreduce.noname.1.0"
    x, y = step_batch(hvd.size(), ROWS, 0)
    rows = slice(r * ROWS, (r + 1) * ROWS)
    opt.zero_grad()
    F.mse_loss(net(x[rows]) + extra, y[rows]).backward()
    opt.step()
    for theirs in hvd.allgather_object(extra.detach()):
        assert torch.equal(theirs, extra.detach()), "Adasum: the added group's weights differ"
    assert extra.abs().sum() > 0, "Adasum: the added group did not train"


def check_name_clash():
    net = small_mlp()
    taken = [("allreduce.noname.1.0", p) for p in net[0].parameters()][:1]
    named = taken + [(f"p{i}", p) for i, p in enumerate(net.parameters()) if i > 0]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=named)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    except ValueError as e:
        assert "allreduce.noname.1.0" in str(e) and "named_parameters" in str(e), str(e)
    else:
        raise AssertionError("an added parameter took a name another one has")
    assert len(opt.param_groups) == 1, "the refused group stayed in the optimizer"


hvd.init()
check("plain")
check("groups=2", groups=2)
check("backward_passes_per_step=2", passes=2)
check_adasum_add_param_group()
check_name_clash()
os.environ["PERSEUS_OVERLAP_BACKWARD_AND_STEP"] = "1"
check("overlapped step")
done(hvd.rank())

"""torch's DistributedDataParallel after ``import perseus``: DDP's gradient buckets are
averaged by Perseus, and training gives what one process gets on the whole batch.

``ddp.py CHECK [PORT]``: CHECK is
- ``train``: started by a launcher (torchrun, perseusrun); Perseus must reduce
  (PERSEUS_DDP=0: it must not, and must not even start);
- ``spawn``: this script spawns 2 ranks that get their ranks only from
  ``init_process_group(rank=..., world_size=...)``, torch's store at 127.0.0.1:PORT;
- ``user-hook``: a hook the user registers before the first forward is kept, and one
  registered after Perseus's is refused with a message saying why;
- ``peer-exit``: rank 1 exits after 2 steps; every other rank's next backward must
  raise an error naming the lost rank.
Each rank starts from its own weights; DDP's broadcast gives them rank 0's.
"""

import os
import sys

import perseus  # noqa: F401 - before torch, as seed 003 asks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _helpers import close, done, raises
from perseus import ddp as pddp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROWS, STEPS = 8, 5


def model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def batch(n):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS * n, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(net, rank, n, steps=STEPS, on_step=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(n)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()


def reference(n):
    """One process, the whole batch, rank 0's starting weights."""
    net = model(100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(n)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def check_trained(ddp, rank, n):
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), f"rank {rank}: models differ"
    for p, q in zip(ddp.module.parameters(), reference(n).parameters()):
        close(p.detach(), q.detach(), f"rank {rank}: the model after {STEPS} steps",
              rtol=1e-5, atol=1e-6)


def end(rank):
    done(rank)
    # Both ranks are done; skip the gloo group's teardown, which races in torch 2.15
    # (see ddp_amp.py).
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def check_train():
    from perseus import _core

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    # Under perseusrun Perseus started to give torch its variables, whatever PERSEUS_DDP.
    before = _core.counters()["operations"] if _core.is_initialized() else 0
    ddp = DDP(model(100 + rank), bucket_cap_mb=0.004)
    train(ddp, rank, n)
    check_trained(ddp, rank, n)
    ops = _core.counters()["operations"] - before if _core.is_initialized() else 0
    if pddp.enabled():
        assert pddp.hooked(ddp), f"rank {rank}: Perseus did not take DDP's allreduce"
        assert ops >= STEPS, f"rank {rank}: Perseus ran {ops} collectives in {STEPS} steps"
        assert (_core.rank(), _core.size()) == (rank, n)
    else:
        assert not pddp.hooked(ddp) and ops == 0, f"rank {rank}: PERSEUS_DDP=0 ignored ({ops})"
    end(rank)


def spawned(rank, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    ddp = DDP(model(100 + rank), bucket_cap_mb=0.004)
    train(ddp, rank, n)
    check_trained(ddp, rank, n)
    assert pddp.hooked(ddp), f"rank {rank}: Perseus did not take DDP's allreduce"
    assert os.environ["PERSEUS_LOCAL_SIZE"] == str(n), "the ranks share one host"
    end(rank)


def check_user_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = DDP(model(100 + rank), bucket_cap_mb=0.004)
    mine.register_comm_hook(None, default_hooks.allreduce_hook)
    train(mine, rank, n)
    check_trained(mine, rank, n)
    assert not pddp.hooked(mine), f"rank {rank}: Perseus replaced the user's hook"
    theirs = DDP(model(0))
    train(theirs, rank, n, steps=1)
    assert pddp.hooked(theirs)
    with raises(RuntimeError, "before the first forward", "PERSEUS_DDP=0",
                what="a hook after the first forward"):
        theirs.register_comm_hook(None, default_hooks.allreduce_hook)
    end(rank)


def check_powersgd(expect):
    """AIAK_POWERSGD_COMPRESSION=1 from step AIAK_START_COMPRESS_ITER. ``exact``: one row
    per rank, so each weight gradient's average has rank <= the ranks, and an
    approximation of that rank is exact; ``lossy``: rank 1 of larger gradients."""
    from perseus import _core

    global ROWS
    ROWS = 1 if expect == "exact" else ROWS
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    # under perseusrun torch's variables came from Perseus, through two broadcasts
    before = _core.counters()["operations"] if _core.is_initialized() else 0
    ddp = DDP(model(100 + rank))
    train(ddp, rank, n)
    assert pddp.hooked(ddp) and ddp._perseus.powersgd.step == STEPS
    ops = _core.counters()["operations"] - before
    start = int(os.environ["AIAK_START_COMPRESS_ITER"])
    # one collective a step before the start, two (P, then Q) after
    assert ops == start + 2 * (STEPS - start), f"rank {rank}: {ops} collectives"
    if expect == "exact":
        check_trained(ddp, rank, n)
    else:
        flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(n)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], g) for g in gathered), f"rank {rank}: differ"
        exact = torch.cat([p.detach().flatten() for p in reference(n).parameters()])
        gap = (flat - exact).abs().max().item()
        assert gap > 1e-4, f"rank {rank}: rank-1 PowerSGD matched exact averaging ({gap})"
    end(rank)


def check_peer_exit():
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model(100 + rank))

    def leave(step):
        if rank == 1 and step == 2:
            os._exit(3)

    try:
        train(ddp, rank, n, steps=6, on_step=leave)
    except RuntimeError as e:
        message = " ".join(str(e).split())
        print(f"rank {rank} error: {message}", flush=True)
        assert "rank 1" in message, f"rank {rank}: the error names no rank: {message}"
    else:
        raise AssertionError(f"rank {rank}: backward after rank 1 left raised nothing")
    done(rank)
    os._exit(0)


if __name__ == "__main__":
    check = sys.argv[1]
    if check == "spawn":
        torch.multiprocessing.spawn(spawned, args=(2, int(sys.argv[2])), nprocs=2)
    else:
        {"train": check_train, "user-hook": check_user_hook, "peer-exit": check_peer_exit,
         "powersgd": lambda: check_powersgd(sys.argv[2])}[check]()

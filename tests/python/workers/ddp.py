"""torch's DistributedDataParallel after ``import perseus``: DDP's gradient buckets are
averaged by Perseus, and training gives what one process gets on the whole batch.

``ddp.py CHECK [PORT]``: CHECK is
- ``train``: started by a launcher (torchrun, perseusrun); Perseus must reduce
  (PERSEUS_DDP=0: it must not, and must not even start);
- ``compiled``: the same under ``torch.compile``;
- ``spawn``: this script spawns 2 ranks that get their ranks only from
  ``init_process_group(rank=..., world_size=...)``, torch's store at 127.0.0.1:PORT;
- ``user-hook``: a hook the user registers before the first forward is kept, and one
  registered after Perseus's is refused with a message saying why;
- ``peer-exit``: rank 1 exits after 2 steps; every other rank's next backward must
  raise an error naming the lost rank;
- ``switches``: PERSEUS_ACCUMULATE_N_STEPS=2, PERSEUS_ALLREDUCE_FUSION=3,
  PERSEUS_PERF_CHECK_N_STEPS=2 and PERSEUS_ALLREDUCE_NANCHECK=1 act on DDP (see
  check_switches);
- ``downsample``: PERSEUS_DOWNSAMPLE_N_ELEMENTS=2 with PERSEUS_GRADIENT_MOMENTUM=0.5;
- ``subgroups plain|powersgd``: 4 ranks, DDP models on subgroups (data parallel in pairs),
  however torch made them, each reduced by a Perseus process set that the group's ranks
  register among themselves (see check_subgroups).
Each rank starts from its own weights; DDP's broadcast gives them rank 0's.
"""

import os
import sys
import time
import warnings

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


def batch(n, data=7):
    g = torch.Generator().manual_seed(data)
    x = torch.randn(ROWS * n, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(net, rank, n, steps=STEPS, on_step=None, data=7):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(n, data)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        opt.zero_grad()
        F.mse_loss(net(x[rows]), y[rows]).backward()
        opt.step()


def reference(n, seed=100, data=7):
    """One process, the whole batch, rank 0's starting weights."""
    net = model(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(n, data)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def check_trained(ddp, rank, n, group=None, seed=100, data=7):
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(n)]
    dist.all_gather(gathered, flat, group=group)
    assert all(torch.equal(gathered[0], g) for g in gathered), f"rank {rank}: models differ"
    for p, q in zip(ddp.module.parameters(), reference(n, seed, data).parameters()):
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


def check_compiled():
    """``torch.compile`` over the DDP model (dynamo splits the graph at the buckets and
    AOTAutograd compiles backward): Perseus still reduces every bucket, and training
    gives what one process gets on the whole batch."""
    from perseus import _core

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    before = _core.counters()["operations"]
    # Dynamo's DDP graph splitting needs buckets no smaller than DDP's first one (1 MiB).
    ddp = DDP(model(100 + rank))
    train(torch.compile(ddp, backend="aot_eager"), rank, n)
    check_trained(ddp, rank, n)
    ops = _core.counters()["operations"] - before
    assert pddp.hooked(ddp) and ops >= STEPS, f"rank {rank}: {ops} collectives, compiled"
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
    # DDP's own collectives (the bucket order it broadcasts after the first backward) on
    # a gloo group of every rank, so that Perseus counts the hook's alone; building the
    # model starts Perseus's side of DDP (which exchanges torch's groups)
    ddp = DDP(model(100 + rank), process_group=dist.new_group(backend="gloo"))
    before = _core.counters()["operations"]
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


def check_subgroups(compression):
    """Data parallel in pairs on 4 ranks: pairs {0, 2} and {1, 3} (new_subgroups), a
    DeviceMesh's ``dp`` dimension (pairs {0, 1} and {2, 3}), its ``pp`` dimension with a
    hook registered by hand with the group as its state, a pair {1, 2} from split_group
    and, at the same time, a pair {0, 3} that only ranks 0 and 3 create
    (use_local_synchronization=True). Each pair trains on its own data from its first
    rank's weights, and must end as one process on the pair's whole batch. Each group's
    ranks register its process set among themselves: a rank knows the sets of its own
    groups and no others, and groups of the same ranks share one."""
    import warnings

    from perseus import _core
    from perseus.common import process_sets
    from torch.distributed.device_mesh import init_device_mesh

    global ROWS
    ROWS = 1 if compression == "powersgd" else ROWS  # rank-2 PowerSGD is exact on pairs
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4

    def pair_trains(group, hook=None):
        members = dist.get_process_group_ranks(group)
        first, n = min(members), len(members)
        before = _core.counters()["operations"] if _core.is_initialized() else 0
        ddp = DDP(model(100 + rank), process_group=group, bucket_cap_mb=0.004)
        if hook is not None:
            ddp.register_comm_hook(group, hook)
        me = sorted(members).index(rank)
        train(ddp, me, n, data=7 + first)
        check_trained(ddp, rank, n, group=group, seed=100 + first, data=7 + first)
        return ddp, _core.counters()["operations"] - before

    strided, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    ddp, ops = pair_trains(strided)
    assert pddp.hooked(ddp), f"rank {rank}: Perseus did not take the pair's allreduce"
    assert ddp._perseus.process_set.ranks == [rank % 2, rank % 2 + 2], ddp._perseus.process_set
    assert ops >= STEPS, f"rank {rank}: Perseus ran {ops} collectives in {STEPS} steps"
    if compression == "powersgd":
        assert ddp._perseus.powersgd.step == STEPS

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ddp, ops = pair_trains(mesh.get_group("dp"))
    assert pddp.hooked(ddp) and ddp._perseus.process_set.ranks == [rank - rank % 2,
                                                                   rank - rank % 2 + 1]
    assert ops >= STEPS, f"rank {rank}: Perseus ran {ops} collectives on the mesh's pair"

    # by hand, with the group as the hook's state (torch's own hooks take it so)
    ddp, ops = pair_trains(mesh.get_group("pp"), hook=pddp.allreduce_hook)
    assert not pddp.hooked(ddp) and ops >= STEPS, f"rank {rank}: {ops} collectives by hand"
    # the pp pairs are the strided ones: their set is reused
    mine = sorted(tuple(ps.ranks) for ps in process_sets.process_sets())
    strided_pair, dp_pair = (rank % 2, rank % 2 + 2), (rank - rank % 2, rank - rank % 2 + 1)
    expect = sorted([(0, 1, 2, 3), strided_pair, dp_pair])
    assert mine == expect, f"rank {rank}: {mine}"

    # Made by every rank; then, while 1 and 2 train on theirs, 0 and 3 make a pair
    # that ranks 1 and 2 never see, and train on it.
    split = dist.split_group(split_ranks=[[1, 2]])
    pair = (1, 2) if rank in (1, 2) else (0, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = split if rank in (1, 2) else dist.new_group([0, 3],
                                                            use_local_synchronization=True)
        ddp, ops = pair_trains(group)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not said, f"rank {rank}: {said}"
    assert pddp.hooked(ddp) and ops >= STEPS, f"rank {rank}: {ops} collectives on {pair}"
    assert tuple(ddp._perseus.process_set.ranks) == pair, ddp._perseus.process_set
    assert ddp._perseus.process_set.members_only
    mine = sorted(tuple(ps.ranks) for ps in process_sets.process_sets())
    assert mine == sorted(expect + [pair]), f"rank {rank}: {mine}"
    end(rank)


def check_switches():
    """The gradient switches on DDP (the environment sets them, see the module doc):
    the buckets are cut in three, one step in two only accumulates (no collective, no
    update), the updates equal one process's on both steps' batches together, the slow
    last rank is named by the perf check, and a NaN from rank 1 fails every rank's
    backward naming the parameters."""
    from perseus import _core

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(model(100 + rank), bucket_cap_mb=0.004)
    said = " ".join(str(w.message) for w in caught)
    assert "PERSEUS_ALLREDUCE_FUSION=3 sets this DistributedDataParallel's buckets" in said, said
    total = sum(p.numel() * 4 for p in ddp.parameters())
    assert ddp.bucket_bytes_cap == -(-total // 3), (ddp.bucket_bytes_cap, total)

    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    calls, sent = 6, []
    for call in range(calls):
        x, y = batch(n, data=20 + call)
        if rank == n - 1:
            time.sleep(0.04)
        before = _core.counters()["bytes_intra_host"]
        opt.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        opt.step()
        sent.append(_core.counters()["bytes_intra_host"] - before)
    # the calls that accumulate send no gradient (the perf check's few bytes at most)
    held, reduced = sent[0::2], sent[1::2]
    assert max(held) < 1024 and min(reduced) >= total // 2, f"rank {rank}: {sent}"

    # one process: each update on both calls' batches together
    net = model(100)
    ref = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for update in range(calls // 2):
        xs, ys = zip(*(batch(n, data=20 + 2 * update + i) for i in range(2)))
        ref.zero_grad()
        F.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        ref.step()
    for p, q in zip(ddp.module.parameters(), net.parameters()):
        close(p.detach(), q.detach(), f"rank {rank}: after {calls} accumulated calls",
              rtol=1e-5, atol=1e-6)

    # a NaN in rank 1's input: the window's last step fails on every rank
    for call in range(2):
        x, y = batch(n, data=40)
        if call == 1 and rank == 1:
            x = x.clone()
            x[rank * ROWS, 0] = float("nan")
        opt.zero_grad()
        loss = F.mse_loss(ddp(x[rows]), y[rows])
        if call == 0:
            loss.backward()
            continue
        with raises(RuntimeError, "FloatingPointError: PERSEUS_ALLREDUCE_NANCHECK", "4.weight",
                    "it came from rank 1 (",
                    what=f"rank {rank}: NaN check"):
            loss.backward()
    end(rank)


def check_downsample():
    """PERSEUS_DOWNSAMPLE_N_ELEMENTS=2, PERSEUS_GRADIENT_MOMENTUM=0.5: two backward passes
    on the same batch (after one that lays DDP's buckets out) bring the two halves of
    the averaged gradient in turn, the rest zero; the second half has grown by the
    momentum (0.5 of the share kept from the pass before plus the new gradient)."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model(100 + rank))
    x, y = batch(n)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    grads = []
    for _ in range(3):  # the first pass lays DDP's buckets out (its residual starts anew)
        ddp.zero_grad()
        F.mse_loss(ddp(x[rows]), y[rows]).backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
    net = model(100)
    F.mse_loss(net(x), y).backward()
    factors = set()
    for g1, g2, p in zip(grads[1], grads[2], net.parameters()):
        full = p.grad
        first, second = g1 != 0, g2 != 0
        assert not (first & second).any() and (first | second).all(), f"rank {rank}"
        close(g2[second], 1.5 * full[second], f"rank {rank}: the other half, with momentum",
              rtol=1e-5, atol=1e-7)
        # the first half got the first pass's kept share too, unless DDP's new layout
        # started its residual anew
        factors.update(round(float(f), 4) for f in (g1[first] / full[first]).unique())
    assert factors in ({1.0}, {1.5}), f"rank {rank}: {factors}"
    end(rank)


if __name__ == "__main__":
    check = sys.argv[1]
    if check == "spawn":
        torch.multiprocessing.spawn(spawned, args=(2, int(sys.argv[2])), nprocs=2)
    else:
        {"train": check_train, "compiled": check_compiled, "user-hook": check_user_hook,
         "peer-exit": check_peer_exit, "switches": check_switches,
         "downsample": check_downsample,
         "powersgd": lambda: check_powersgd(sys.argv[2]),
         "subgroups": lambda: check_subgroups(sys.argv[2])}[check]()

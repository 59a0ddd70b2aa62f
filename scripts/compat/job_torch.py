"""One cell of the compatibility matrix for torch (scripts/compat-matrix.sh), run as
``perseusrun -np 2 python job_torch.py`` in a fresh virtual environment that holds the
wheel and one torch release. Every rank checks values (checks.py) and exits non-zero on
the first that is wrong:

- allreduce (Sum, Average, int64), allgather of unequal first dimensions, broadcast,
  alltoall with splits and reducescatter;
- broadcast_parameters gives every rank rank 0's weights;
- hvd.DistributedOptimizer: 2 ranks on half the batch each give what one process gets
  on the whole batch;
- torch's DistributedDataParallel after ``import perseus``: the same, and its buckets
  were reduced by Perseus;
- the ``perseus`` backend of torch.distributed: collectives on a group of it, and DDP
  on that group through torch's own allreduce hook.
"""

import os
import sys

import perseus  # noqa: F401 - before torch: DDP goes through Perseus
import perseus.torch.horovod as hvd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checks import STEPS, Collectives, data, rows, same, weights


def collectives(rank, n):
    c = Collectives(rank, n)
    t = torch.from_numpy
    same(hvd.allreduce(t(c.reduce_in), op=hvd.Sum), c.reduce_sum, "allreduce Sum")
    same(hvd.allreduce(t(c.reduce_in)), c.reduce_average, "allreduce Average")
    same(hvd.allreduce(t(c.int_in), op=hvd.Sum), c.int_sum, "allreduce int64")
    same(hvd.allgather(t(c.gather_in)), c.gathered, "allgather of unequal first dimensions")
    same(hvd.broadcast(t(c.broadcast_in), root_rank=c.root), c.broadcast_out, "broadcast")
    received, splits = hvd.alltoall(t(c.alltoall_in),
                                    splits=torch.tensor(c.alltoall_splits, dtype=torch.int32))
    same(received, c.alltoall_out, "alltoall")
    same(splits, c.alltoall_received_splits, "alltoall's received splits")
    same(hvd.reducescatter(t(c.scatter_in), op=hvd.Sum), c.scattered, "reducescatter")


def model(seed):
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights(seed)):
            p.copy_(torch.from_numpy(w.T if w.ndim == 2 else w))
    return net


def train(net, opt, x, y):
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()


def sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def check_model(net, n, what):
    """``net`` equals rank 0's start trained by one process on the whole batch."""
    ref = model(100)
    train(ref, sgd(ref), *data(n))
    for p, q in zip(net.parameters(), ref.parameters()):
        same(p.detach(), q.detach().numpy(), what)


def distributed_optimizer(rank, n):
    net = model(100 + rank)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for p, q in zip(net.parameters(), model(100).parameters()):
        same(p.detach(), q.detach().numpy(), "broadcast_parameters")
    opt = hvd.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    x, y = data(n)
    train(net, opt, x[rows(rank)], y[rows(rank)])
    check_model(net, n, "DistributedOptimizer after training")


def ddp(rank, n):
    from perseus import _core
    from perseus import ddp as pddp

    dist.init_process_group("gloo")
    assert (dist.get_rank(), dist.get_world_size()) == (rank, n), "torch's ranks"
    before = _core.counters()["operations"]
    net = torch.nn.parallel.DistributedDataParallel(model(100 + rank))
    x, y = data(n)
    train(net, sgd(net), x[rows(rank)], y[rows(rank)])
    check_model(net.module, n, "DDP after training")
    assert pddp.hooked(net), "Perseus did not take DDP's allreduce"
    ops = _core.counters()["operations"] - before
    assert ops >= STEPS, f"Perseus ran {ops} collectives in {STEPS} DDP steps"
    dist.barrier()


def backend(rank, n):
    """torch.distributed's collectives on a group of the ``perseus`` backend (a c10d
    Backend from torch 2.9, a whole ProcessGroup before), and a DDP model on it reduced
    by DDP's own reducer."""
    group = dist.new_group(backend="perseus")
    assert dist.get_backend(group) == "perseus", dist.get_backend(group)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    same(t, torch.full((3,), float(n * (n + 1) // 2)).numpy(), "perseus all_reduce")
    outs = [torch.empty(q + 1) for q in range(n)]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)), group=group)
    for q, o in enumerate(outs):
        same(o, torch.full((q + 1,), float(q)).numpy(), "perseus all_gather, uneven")
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=n - 1, group=group)
    same(b, torch.full((2,), float(n - 1)).numpy(), "perseus broadcast")
    out = torch.empty(n)
    dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + 10 * rank, group=group)
    same(out, (torch.arange(n, dtype=torch.float32) * 10 + rank).numpy(), "perseus all_to_all")
    flags = torch.tensor([rank == 0, True, False])
    dist.all_reduce(flags, group=group)
    same(flags, torch.tensor([True, True, False]).numpy(), "perseus all_reduce of bool")
    net = torch.nn.parallel.DistributedDataParallel(model(100 + rank), process_group=group)
    net._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    x, y = data(n)
    train(net, sgd(net), x[rows(rank)], y[rows(rank)])
    check_model(net.module, n, "DDP on a perseus group")
    dist.barrier(group=group)


def main():
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    assert n >= 2, "run me under perseusrun -np 2"
    collectives(rank, n)
    distributed_optimizer(rank, n)
    ddp(rank, n)
    backend(rank, n)
    print(f"compat ok: rank {rank} of {n}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}", flush=True)
    # gloo's teardown at exit races in some torch releases; every check has passed.
    os._exit(0)


if __name__ == "__main__":
    main()

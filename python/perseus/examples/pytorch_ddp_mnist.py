"""A plain PyTorch DistributedDataParallel script, accelerated by one added line,
``import perseus``: DDP's gradient buckets are then averaged by Perseus (docs/torch_distributed.md).

    torchrun --nproc_per_node 2 examples/pytorch_ddp_mnist.py --epochs 2
    perseusrun -np 2 python examples/pytorch_ddp_mnist.py --epochs 2

The same small CNN and synthetic MNIST-like data as pytorch_mnist.py; everything
else is torch's own API: init_process_group, DistributedDataParallel,
all_reduce for the metrics. Set PERSEUS_DDP=0 to run the same script on torch's
communication alone.
"""

import os
import time

# The one added line; seed 003 puts it before torch (it is used below, for the log).
import perseus
import torch
import torch.distributed as dist
from pytorch_mnist import (
    Net,
    class_patterns,
    evaluate,
    parse_args,
    synthetic_mnist,
    train_epoch,
)
from torch.nn.parallel import DistributedDataParallel as DDP


def mean(value):
    """The mean of a scalar over all ranks (torch.distributed, not Perseus)."""
    t = torch.tensor(float(value))
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def main():
    args = parse_args(__doc__.split("\n")[0])
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(args.seed)

    patterns = class_patterns(torch.Generator().manual_seed(args.seed))
    train_x, train_y = synthetic_mnist(args.train_size, args.seed + 1, patterns)
    test_x, test_y = synthetic_mnist(args.test_size, args.seed + 2, patterns)
    shard = slice(rank, None, size)
    train_x, train_y, test_x, test_y = train_x[shard], train_y[shard], test_x[shard], test_y[shard]

    model = DDP(Net())  # broadcasts rank 0's weights; its buckets go through Perseus
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    shuffle = torch.Generator().manual_seed(args.seed + rank)
    loss, accuracy = float("nan"), 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.time()
        train_loss = mean(train_epoch(model, optimizer, train_x, train_y, args.batch_size,
                                      shuffle))
        loss, accuracy = evaluate(model.module, test_x, test_y, 256)
        loss, accuracy = mean(loss), mean(accuracy)
        if rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f} test loss {loss:.4f} "
                  f"accuracy {accuracy:.4f} ({time.time() - start:.1f} s, size {size}, "
                  f"perseus {perseus.ddp.hooked(model)})", flush=True)
    if rank == 0:
        print(f"final loss {loss:.4f} accuracy {accuracy:.4f}", flush=True)
    dist.barrier()
    # torch 2.15's gloo teardown can abort at exit; every rank is done here.
    os._exit(0)


if __name__ == "__main__":
    main()

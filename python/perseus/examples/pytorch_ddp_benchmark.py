"""DDP synthetic benchmark: images per second of a model on random data, trained by torch's
own DistributedDataParallel script with one added line, ``import perseus`` (seed 003,
§2.1.2). Start it as seed 003 does:

    python -m torch.distributed.launch --nproc_per_node=2 --nnodes=1 --node_rank=0 \\
        --master_addr=localhost --master_port=6006 examples/pytorch_ddp_benchmark.py

or with ``torchrun --nproc_per_node 2`` or ``perseusrun -np 2 python``. With
``PERSEUS_DDP=0`` DDP keeps torch's own communication: the same script measures both.
``--single`` trains the model alone in one process, without a process group or DDP: the
baseline of scaling efficiency (benchmarks/resnet_scaling.py).

``--model`` is a torchvision model name when torchvision is installed (``resnet50``, for
GPUs) or ``small-resnet`` (the default, for CPUs). Rank 0 prints the rate of each
iteration, then the mean per process and the total.
"""

import argparse
import os
import timeit

import numpy as np
import perseus  # noqa: F401 - the added line: before torch, as seed 003 asks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from perseus import ddp as perseus_ddp
from synthetic_models import build_model, synthetic_batch
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-resnet")
    p.add_argument("--batch-size", type=int, default=32, help="images per step per process")
    p.add_argument("--image-size", type=int, default=None,
                   help="default: 64 for small-resnet, 224 for torchvision models")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: the cores / local processes)")
    p.add_argument("--single", action="store_true",
                   help="one process alone: no process group, no DDP, no communication")
    # torch.distributed.launch without --use_env passes the local rank as an argument.
    p.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    args = parse_args()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if args.single:
        rank, size = 0, 1
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = args.local_rank if args.local_rank is not None else \
        int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_size))
    device = torch.device("cuda" if cuda else "cpu")
    image = args.image_size or (64 if args.model == "small-resnet" else 224)

    torch.manual_seed(1234)
    model = build_model(args.model).to(device)
    ddp = model if args.single else DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01 * size)
    data, target = synthetic_batch(args.batch_size, image, device)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(ddp(data), target).backward()
        optimizer.step()

    def log(text):
        if rank == 0:
            print(text, flush=True)

    timeit.timeit(step, number=args.num_warmup_batches)
    where = "GPU" if cuda else "CPU"
    reducer = "none (one process alone)" if args.single else \
        "Perseus" if perseus_ddp.hooked(ddp) else "torch"
    log(f"Model: {args.model}, batch size {args.batch_size}, {size} processes; "
        f"gradients reduced by {reducer}")
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per {where}")
    mean, spread = np.mean(rates), 1.96 * np.std(rates)
    log(f"Img/sec per {where}: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {size} {where}(s): {size * mean:.1f} +-{size * spread:.1f}")
    if args.single:
        return
    dist.barrier()
    # torch 2.15's gloo teardown can abort at exit ("terminate called without an active
    # exception", PERSEUS_DDP=0 too); every rank is done here.
    os._exit(0)


if __name__ == "__main__":
    main()

"""Elastic synthetic benchmark: images per second of a model on random data, in a job
whose workers may fail or join (the job of seed 004, docs/elastic.md).

    perseusrun -np 3 --min-np=1 --max-np=5 --verbose --log-level=DEBUG \\
        --host-discovery-script ./discover_hosts.sh \\
        python examples/pytorch_synthetic_benchmark_elastic.py --num-iters=1000

Each iteration times ``--num-batches-per-iter`` training steps and commits the state
(model, optimizer, iteration, the rates so far). After a reset the ranks warm up again
and go on from the last commit with the new number of workers. At the end rank 0
prints the mean rate per worker and the total of the last round.

``--model`` is a torchvision model name when torchvision is installed (``resnet50``,
as in Horovod's benchmark, for GPUs) or ``small-resnet`` (the default: a residual
network defined here that runs on CPUs in seconds).
"""

import argparse
import os
import timeit

import numpy as np
import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from synthetic_models import build_model, synthetic_batch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small-resnet")
    p.add_argument("--batch-size", type=int, default=32, help="images per step per worker")
    p.add_argument("--image-size", type=int, default=None,
                   help="default: 64 for small-resnet, 224 for torchvision models")
    p.add_argument("--num-warmup-batches", type=int, default=10,
                   help="steps before timing, at the start of each round")
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one worker")
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="compress gradients to float16 for the allreduce")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    device = torch.device("cuda" if cuda else "cpu")
    size = args.image_size or (64 if args.model == "small-resnet" else 224)

    torch.manual_seed(1234)
    model = build_model(args.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    data, target = synthetic_batch(args.batch_size, size, device)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def on_reset():  # the new number of workers: Horovod's learning-rate rule
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, iteration=0, rates=[])
    state.register_reset_callbacks([on_reset])
    where = "GPU" if cuda else "CPU"

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    @hvd.elastic.run
    def benchmark(state):
        log(f"Model: {args.model}, batch size {args.batch_size}, {hvd.size()} workers; "
            f"warming up ({args.num_warmup_batches} steps)")
        timeit.timeit(step, number=args.num_warmup_batches)
        while state.iteration < args.num_iters:
            seconds = timeit.timeit(step, number=args.num_batches_per_iter)
            rate = args.batch_size * args.num_batches_per_iter / seconds
            log(f"Iter #{state.iteration}: {rate:.1f} img/sec per {where} "
                f"({hvd.size()} workers)")
            state.rates.append(rate)
            state.iteration += 1
            state.commit()

    benchmark(state)
    mean, spread = np.mean(state.rates), 1.96 * np.std(state.rates)
    log(f"Img/sec per {where}: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} {where}(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * spread:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""A Horovod-style PyTorch training function run on a Ray cluster by perseus.ray's
RayExecutor, as a ``horovod.ray`` program does (only its import differs):

    python examples/ray_pytorch_mnist.py --num-workers 2        # a local Ray, or
    RAY_ADDRESS=HEAD:6379 python examples/ray_pytorch_mnist.py  # a running cluster

Each worker is a Ray actor; the function calls ``hvd.init()`` and trains a small CNN on
its shard of the synthetic MNIST-like data of ``synthetic_mnist.py``. The driver gets every
rank's final loss, by rank.
"""

import argparse
import os
import sys

import ray
from perseus.ray import RayExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def train(epochs, batch_size):
    import perseus.torch.horovod as hvd
    import torch
    import torch.nn.functional as F
    from synthetic_mnist import load

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    x, y = load(1024, seed=0)
    images = torch.from_numpy(x[hvd.rank()::hvd.size()]).permute(0, 3, 1, 2).contiguous()
    labels = torch.from_numpy(y[hvd.rank()::hvd.size()])
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(8 * 13 * 13, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size()),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for _ in range(epochs):
        for i in range(0, len(images), batch_size):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[i:i + batch_size]), labels[i:i + batch_size])
            loss.backward()
            optimizer.step()
    return hvd.allreduce(loss.detach(), name="final_loss").item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args()
    # The workers import synthetic_mnist from this directory.
    path = os.pathsep.join(x for x in (HERE, os.environ.get("PYTHONPATH")) if x)
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": path}})
    sys.path.insert(0, HERE)
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=a.num_workers, use_gpu=False)
    executor.start()
    losses = executor.run(train, kwargs={"epochs": a.epochs, "batch_size": a.batch_size})
    executor.shutdown()
    print(f"final loss, averaged over the ranks, as each rank saw it: {losses}")


if __name__ == "__main__":
    main()

"""A Horovod-style PyTorch training function run on a Ray cluster by perseus.ray's
RayExecutor, as a ``horovod.ray`` program does (only its import differs):

    python examples/ray_pytorch_mnist.py --num-workers 2        # a local Ray, or
    RAY_ADDRESS=HEAD:6379 python examples/ray_pytorch_mnist.py  # a running cluster

Each worker is a Ray actor and runs ``cluster_training.train``: ``hvd.init()``, then a
small CNN trained on its shard of the synthetic MNIST-like data. The driver gets every
rank's final loss, by rank.
"""

import argparse
import os
import sys

import ray
from perseus.ray import RayExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


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
    from cluster_training import train  # this directory, as the workers see it

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=a.num_workers, use_gpu=False)
    executor.start()
    losses = executor.run(train, kwargs={"epochs": a.epochs, "batch_size": a.batch_size})
    executor.shutdown()
    print(f"final loss, averaged over the ranks, as each rank saw it: {losses}")


if __name__ == "__main__":
    main()

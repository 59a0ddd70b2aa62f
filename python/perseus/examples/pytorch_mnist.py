"""Horovod-style data-parallel training of a small CNN on a synthetic MNIST-like set.

    perseusrun -np 2 python examples/pytorch_mnist.py --epochs 2

Nothing is downloaded: 28x28 images are drawn from ten fixed class patterns (seeded
random strokes), shifted by a few pixels and covered in noise. Every rank builds the
same data set, trains on its own shard and averages gradients through Perseus.
The only change from a Horovod script is the import line.
"""

import argparse
import math
import os
import time

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from torch import nn


def parse_args(description=None):
    p = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=6000)
    p.add_argument("--test-size", type=int, default=1000)
    return p.parse_args()


def class_patterns(gen):
    """Ten 28x28 prototypes, each a few thick random strokes (digit-like blobs)."""
    patterns = torch.zeros(10, 28, 28)
    ys, xs = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
    for c in range(10):
        for _ in range(3):
            (x0, y0), (x1, y1) = (torch.rand(2, 2, generator=gen) * 16 + 6).tolist()
            for t in torch.linspace(0, 1, 12).tolist():
                cx, cy = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                blob = torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / 3.0)
                patterns[c] = torch.maximum(patterns[c], blob)
    return patterns


def synthetic_mnist(n, seed, patterns):
    """``n`` images (N, 1, 28, 28), normalized like MNIST, and their labels."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    images = torch.empty(n, 1, 28, 28)
    for i in range(n):
        dy, dx = shifts[i].tolist()
        images[i, 0] = torch.roll(patterns[labels[i]], shifts=(dy, dx), dims=(0, 1))
    images += 0.35 * torch.randn(images.shape, generator=gen)
    return (images - 0.13) / 0.31, labels


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def metric_average(value, name):
    """The mean of a scalar over all ranks."""
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def train_epoch(model, optimizer, images, labels, batch_size, shuffle):
    """One pass over this rank's shard in a shuffled order; the mean batch loss."""
    model.train()
    order = torch.randperm(len(images), generator=shuffle)
    steps = math.ceil(len(images) / batch_size)
    total = 0.0
    for step in range(steps):
        idx = order[step * batch_size:(step + 1) * batch_size]
        optimizer.zero_grad()
        batch_loss = F.cross_entropy(model(images[idx]), labels[idx])
        batch_loss.backward()
        optimizer.step()
        total += batch_loss.item()
    return total / steps


def evaluate(model, images, labels, batch_size):
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            out = model(images[i:i + batch_size])
            loss += F.cross_entropy(out, labels[i:i + batch_size], reduction="sum").item()
            correct += (out.argmax(1) == labels[i:i + batch_size]).sum().item()
    n = max(len(images), 1)
    return loss / n, correct / n


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    # Share the CPU cores between the ranks of this host.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    # Same data on every rank (same seeds); each rank keeps its shard.
    patterns = class_patterns(torch.Generator().manual_seed(args.seed))
    train_x, train_y = synthetic_mnist(args.train_size, args.seed + 1, patterns)
    test_x, test_y = synthetic_mnist(args.test_size, args.seed + 2, patterns)
    shard = slice(hvd.rank(), None, hvd.size())
    train_x, train_y, test_x, test_y = train_x[shard], train_y[shard], test_x[shard], test_y[shard]

    model = Net()
    # Horovod's rule: scale the learning rate by the number of ranks.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    shuffle = torch.Generator().manual_seed(args.seed + hvd.rank())
    loss, accuracy = float("nan"), 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.time()
        train_loss = train_epoch(model, optimizer, train_x, train_y, args.batch_size, shuffle)
        train_loss = metric_average(train_loss, "avg_train_loss")
        loss, accuracy = evaluate(model, test_x, test_y, 256)
        loss = metric_average(loss, "avg_loss")
        accuracy = metric_average(accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f} test loss {loss:.4f} "
                  f"accuracy {accuracy:.4f} ({time.time() - start:.1f} s, size {hvd.size()})",
                  flush=True)
    if hvd.rank() == 0:
        print(f"final loss {loss:.4f} accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

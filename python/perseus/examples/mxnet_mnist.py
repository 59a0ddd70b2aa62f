"""Gluon training with Perseus' Horovod API (seed 003 §4.6.2): one import changed.

    perseusrun -np 2 python examples/mxnet_mnist.py --epochs 2

A small CNN on the synthetic MNIST-like set of synthetic_mnist.py. Each rank trains on
its shard; ``hvd.broadcast_parameters`` gives every rank rank 0's initial weights and
``hvd.DistributedTrainer`` averages the gradients. Rank 0 prints the test accuracy.
"""

import argparse
import os
import sys

os.environ.setdefault("MXNET_USE_OPERATOR_TUNING", "0")  # fast start (seed 003 §4.6.1)
import mxnet as mx
import perseus.mxnet as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_mnist


def build():
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(16, 3, activation="relu"), mx.gluon.nn.MaxPool2D(),
            mx.gluon.nn.Conv2D(32, 3, activation="relu"), mx.gluon.nn.MaxPool2D(),
            mx.gluon.nn.Flatten(), mx.gluon.nn.Dense(64, activation="relu"),
            mx.gluon.nn.Dense(10))
    return net


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    p.add_argument("--train-size", type=int, default=6000)
    a = p.parse_args()

    hvd.init()
    patterns = synthetic_mnist.class_patterns()
    x, y = synthetic_mnist.load(a.train_size, seed=1, patterns=patterns)
    x_test, y_test = synthetic_mnist.load(1000, seed=2, patterns=patterns)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]  # this rank's shard
    to_nchw = (0, 3, 1, 2)
    train = mx.gluon.data.DataLoader(
        mx.gluon.data.ArrayDataset(x.transpose(to_nchw), y.astype("float32")),
        batch_size=a.batch_size, shuffle=True, last_batch="discard")

    net = build()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net(mx.nd.zeros((1, 1, 28, 28)))  # materialize the parameters
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    opt = mx.optimizer.create("sgd", learning_rate=a.lr * hvd.size(), momentum=0.9)
    trainer = hvd.DistributedTrainer(net.collect_params(), opt)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    for epoch in range(a.epochs):
        total = mx.nd.zeros(1)
        for data, label in train:
            with mx.autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(a.batch_size)
            total += loss.mean()
        mean_loss = hvd.allreduce(total / len(train), name="epoch_loss").asscalar()
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {mean_loss:.4f}")
    pred = net(mx.nd.array(x_test.transpose(to_nchw))).argmax(axis=1)
    acc = (pred == mx.nd.array(y_test.astype("float32"))).mean().asscalar()
    if hvd.rank() == 0:
        print(f"final accuracy {acc:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""The Module API with the Perseus KVStore (seed 003 §4.6.1): the kvstore is the only change.

    perseusrun -np 2 python examples/mxnet_kvstore_module.py --epochs 2

An MLP on the synthetic MNIST-like set of synthetic_mnist.py, trained with
``mod.fit(..., kvstore=kv)`` where ``kv = perseus.mxnet.create("dist_sync_perseus")``.
Each rank reads its shard; the store sums the gradients of every rank and applies the
optimizer, as MXNet's dist_sync store does, without parameter servers.
"""

import argparse
import logging
import os
import sys

os.environ.setdefault("MXNET_USE_OPERATOR_TUNING", "0")  # fast start (seed 003 §4.6.1)
import mxnet as mx
import perseus.mxnet as perseus_kv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_mnist


def symbol():
    data = mx.sym.Flatten(mx.sym.Variable("data"))
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=128, name="fc1"),
                          act_type="relu")
    out = mx.sym.FullyConnected(h, num_hidden=10, name="fc2")
    return mx.sym.SoftmaxOutput(out, name="softmax")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--kv-store", default="dist_sync_perseus")
    a = p.parse_args()

    kv = (perseus_kv.create(a.kv_store) if "perseus" in a.kv_store
          else mx.kvstore.create(a.kv_store))
    patterns = synthetic_mnist.class_patterns()
    x, y = synthetic_mnist.load(4000, seed=1, patterns=patterns)
    x, y = x[kv.rank::kv.num_workers], y[kv.rank::kv.num_workers]
    x_test, y_test = synthetic_mnist.load(1000, seed=2, patterns=patterns)
    train = mx.io.NDArrayIter(x, y.astype("float32"), a.batch_size, shuffle=True,
                              label_name="softmax_label")
    test = mx.io.NDArrayIter(x_test, y_test.astype("float32"), 250,
                             label_name="softmax_label")

    if kv.rank == 0:
        logging.basicConfig(level=logging.INFO)
    mx.random.seed(42)  # the store starts every rank from rank 0's weights anyway
    mod = mx.mod.Module(symbol(), context=mx.cpu(kv.local_rank))
    mod.fit(train, num_epoch=a.epochs, kvstore=kv, optimizer="sgd",
            optimizer_params={"learning_rate": a.lr, "momentum": 0.9},
            initializer=mx.init.Xavier())
    acc = dict(mod.score(test, "acc"))["accuracy"]
    if kv.rank == 0:
        print(f"final accuracy {acc:.4f}")


if __name__ == "__main__":
    main()

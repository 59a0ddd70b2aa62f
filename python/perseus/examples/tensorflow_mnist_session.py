"""TF1-style training in a tf.compat.v1 Session with Perseus' Horovod API.

    perseusrun -np 2 python examples/tensorflow_mnist_session.py --steps 200

A softmax-regression-plus-hidden-layer model built as a graph with placeholders; the
DistributedOptimizer averages the gradients inside the graph (one op per step) and
``hvd.broadcast_global_variables(0)`` gives every rank rank 0's initial weights.
Data: the synthetic MNIST-like set of synthetic_mnist.py, a shard per rank.
"""

import argparse
import os
import sys

import perseus.tensorflow.horovod as hvd
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_mnist


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one rank")
    a = p.parse_args()

    hvd.init()
    patterns = synthetic_mnist.class_patterns()
    x, y = synthetic_mnist.load(4000, seed=1, patterns=patterns)
    x, y = x[hvd.rank()::hvd.size()].reshape(-1, 784), y[hvd.rank()::hvd.size()]
    x_test, y_test = synthetic_mnist.load(1000, seed=2, patterns=patterns)

    graph = tf.Graph()
    with graph.as_default():
        images = tf.compat.v1.placeholder(tf.float32, [None, 784])
        labels = tf.compat.v1.placeholder(tf.int64, [None])
        hidden = synthetic_mnist.dense_v1(images, 128, "hidden", tf.nn.relu)
        logits = synthetic_mnist.dense_v1(hidden, 10, "logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
        opt = tf.compat.v1.train.MomentumOptimizer(a.lr * hvd.size(), 0.9)
        opt = hvd.DistributedOptimizer(opt)
        train = opt.minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
        bcast = hvd.broadcast_global_variables(0)

    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        sess.run(bcast)
        for step in range(a.steps):
            lo = step * a.batch_size % (len(x) - a.batch_size)
            _, value = sess.run([train, loss], {images: x[lo:lo + a.batch_size],
                                                labels: y[lo:lo + a.batch_size]})
            if step % 50 == 0 and hvd.rank() == 0:
                print(f"step {step} loss {value:.4f}")
        acc = sess.run(accuracy, {images: x_test.reshape(-1, 784), labels: y_test})
    if hvd.rank() == 0:
        print(f"final accuracy {acc:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

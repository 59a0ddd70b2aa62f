"""Keras training with Perseus' Horovod API: model.fit on every rank, one import changed.

    perseusrun -np 2 python examples/tensorflow_keras_mnist.py --epochs 3

A small CNN on the synthetic MNIST-like set of synthetic_mnist.py. Each rank takes
its shard of the training set; DistributedOptimizer averages the gradients; the
callbacks broadcast rank 0's initial state, average the epoch metrics over the ranks
and warm the learning rate up to lr x size. Only rank 0 writes checkpoints and prints.
"""

import argparse
import os
import sys

import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from tensorflow import keras  # Keras 3, or tf-keras under TF_USE_LEGACY_KERAS=1

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_mnist


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    p.add_argument("--train-size", type=int, default=6000)
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves a model here")
    a = p.parse_args()

    hvd.init()
    patterns = synthetic_mnist.class_patterns()
    x, y = synthetic_mnist.load(a.train_size, seed=1, patterns=patterns)
    x_test, y_test = synthetic_mnist.load(1000, seed=2, patterns=patterns)
    # Each rank its own shard.
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]

    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    scaled_lr = a.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.keras.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.keras.callbacks.MetricAverageCallback(),
        hvd.keras.callbacks.LearningRateWarmupCallback(scaled_lr, warmup_epochs=1,
                                                       verbose=hvd.rank() == 0),
    ]
    if a.checkpoint_dir and hvd.rank() == 0:
        os.makedirs(a.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(a.checkpoint_dir, "checkpoint-{epoch}.keras")))
    model.fit(x, y, batch_size=a.batch_size, epochs=a.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    loss, acc = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"final loss {loss:.4f} accuracy {acc:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    tf.get_logger().setLevel("ERROR")
    main()

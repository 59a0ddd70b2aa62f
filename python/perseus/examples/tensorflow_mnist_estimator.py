"""Estimator-style training: a model_fn and an input_fn run by a MonitoredTrainingSession
with BroadcastGlobalVariablesHook, as tf.estimator did before TensorFlow 2.16 removed it.

    perseusrun -np 2 python examples/tensorflow_mnist_estimator.py --steps 300

The structure is the Estimator's: ``input_fn`` yields this rank's shard as a tf.data
pipeline, ``model_fn(features, labels)`` returns the loss and the train op (with
Perseus' DistributedOptimizer), and the hooks broadcast rank 0's initial variables and
stop after ``--steps``. Only rank 0 writes checkpoints (``--model-dir``).
"""

import argparse
import os
import sys
import tempfile

import perseus.tensorflow.horovod as hvd
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_mnist


def input_fn(batch_size):
    x, y = synthetic_mnist.load(4000, seed=1)
    ds = tf.data.Dataset.from_tensor_slices((x.reshape(-1, 784), y))
    # shard() before shuffle() and repeat(), as the seed's guide says.
    ds = ds.shard(hvd.size(), hvd.rank()).shuffle(1000, seed=hvd.rank()).repeat()
    return tf.compat.v1.data.make_one_shot_iterator(ds.batch(batch_size)).get_next()


def model_fn(features, labels, lr):
    hidden = synthetic_mnist.dense_v1(features, 128, "hidden", tf.nn.relu)
    logits = synthetic_mnist.dense_v1(hidden, 10, "logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(lr * hvd.size()))
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return loss, train_op


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--model-dir", default=None)
    a = p.parse_args()

    hvd.init()
    model_dir = a.model_dir or (tempfile.mkdtemp(prefix="perseus-estimator-") if hvd.rank() == 0
                                else None)
    with tf.Graph().as_default():
        features, labels = input_fn(a.batch_size)
        loss, train_op = model_fn(features, labels, a.lr)
        hooks = [hvd.BroadcastGlobalVariablesHook(0),
                 tf.compat.v1.train.StopAtStepHook(last_step=a.steps)]
        # Checkpoints on rank 0 only, so that ranks do not overwrite each other's.
        checkpoint_dir = model_dir if hvd.rank() == 0 else None
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                                         hooks=hooks) as sess:
            step = 0
            while not sess.should_stop():
                _, value = sess.run([train_op, loss])
                if step % 100 == 0 and hvd.rank() == 0:
                    print(f"step {step} loss {value:.4f}")
                step += 1
    if hvd.rank() == 0:
        print(f"final loss {value:.4f}; checkpoints in {model_dir}")
    hvd.shutdown()


if __name__ == "__main__":
    main()

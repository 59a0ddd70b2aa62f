"""Training throughput on synthetic data, TF2 style (GradientTape in a tf.function), with
Perseus or, for the scaling baseline, without it.

    perseusrun -np 2 python examples/tensorflow2_synthetic_benchmark.py
    python examples/tensorflow2_synthetic_benchmark.py --no-perseus     # one plain process

Prints images/s per rank and in total (rank 0), and a last line ``RESULT {json}`` for
benchmarks/tensorflow_scaling.py. ``--model mlp`` (default) is communication-heavy
(about 6.3 M parameters on a small batch); ``--model cnn`` is compute-heavy.
"""

import argparse
import json
import os
import time
import timeit

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
from tensorflow import keras  # Keras 3, or tf-keras under TF_USE_LEGACY_KERAS=1


def build(model_name, classes=10):
    if model_name == "mlp":
        return keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten(),
                                 keras.layers.Dense(1536, activation="relu"),
                                 keras.layers.Dense(1536, activation="relu"),
                                 keras.layers.Dense(classes)])
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(classes),
    ])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--fp16-allreduce", action="store_true", help="Compression.fp16")
    p.add_argument("--no-perseus", action="store_true", help="plain TensorFlow, one process")
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow's intra- and inter-op threads per process (0: its default)")
    a = p.parse_args()
    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)

    if a.no_perseus:
        hvd, rank, size = None, 0, 1
    else:
        import perseus.tensorflow.horovod as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

    keras.utils.set_random_seed(rank)
    model = build(a.model)
    opt = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.uniform([a.batch_size, 32, 32, 3])
    target = tf.random.uniform([a.batch_size], maxval=10, dtype=tf.int64)

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        if hvd is not None:
            compression = hvd.Compression.fp16 if a.fp16_allreduce else hvd.Compression.none
            tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if hvd is not None and first_batch:
            # After the first step, so that the optimizer's variables exist.
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    step(True)
    timeit.timeit(lambda: step(False), number=a.num_warmup_batches)
    rates = []
    for _ in range(a.num_iters):
        t = timeit.timeit(lambda: step(False), number=a.num_batches_per_iter)
        rates.append(a.batch_size * a.num_batches_per_iter / t)
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if rank == 0:
        print(f"Model {a.model} ({params / 1e6:.1f} M parameters), batch {a.batch_size} per "
              f"rank, {size} rank(s){'' if hvd else ', without Perseus'}")
        print(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
        print(f"Total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
        print("RESULT " + json.dumps({"model": a.model, "ranks": size, "perseus": hvd is not None,
                                      "batch": a.batch_size, "params": params, "threads": a.threads,
                                      "img_per_sec_per_rank": mean, "total": size * mean,
                                      "time": time.time()}))
    if hvd is not None:
        hvd.shutdown()


if __name__ == "__main__":
    main()

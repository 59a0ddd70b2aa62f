"""Keras fit with the callbacks (broadcast, metric average, warmup, schedule), load_model,
and the Estimator-style session loop with BroadcastGlobalVariablesHook, with tf.keras's
Keras (Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1: Horovod's script, unchanged)."""

import os
import sys

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import perseus.tensorflow.keras as hvd_keras
import tensorflow as tf
from _tfhelpers import KERAS3, close, done, keras, raises, vname

ROWS = 8


class LocalLoss(keras.callbacks.Callback):
    """Records this rank's own epoch loss (placed before MetricAverageCallback)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(logs["loss"])


def model_for(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def fit_with_callbacks(r, n, workdir):
    rng = np.random.RandomState(r)
    x = rng.randn(ROWS, 4).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    # Different initial weights on every rank: the broadcast must make them rank 0's.
    model = model_for(100 + r)
    base_lr = 0.01 * n
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(base_lr,
                                                                          momentum=0.5)),
                  loss="mse")
    local = LocalLoss()
    callbacks = [
        hvd.keras.callbacks.BroadcastGlobalVariablesCallback(0),
        local,
        hvd.keras.callbacks.MetricAverageCallback(),
        hvd.keras.callbacks.LearningRateWarmupCallback(base_lr, warmup_epochs=2),
        hvd_keras.callbacks.LearningRateScheduleCallback(base_lr, lambda e: 0.5 ** (e - 1),
                                                         start_epoch=2),
    ]
    history = model.fit(x, y, batch_size=ROWS // 2, epochs=4, shuffle=False, verbose=0,
                        callbacks=callbacks)
    # Same weights everywhere; the averaged loss is the mean of the ranks' own.
    for w in model.trainable_variables:
        g = hvd.allgather(tf.convert_to_tensor(w)).numpy()
        close(g[1:], np.repeat(g[:1], n - 1, axis=0), f"weights after fit ({vname(w)})", 0, 0)
    own = hvd.allgather_object(local.losses)
    close(history.history["loss"], np.mean(own, axis=0), "MetricAverageCallback")
    # Warmup: the last batch of epoch e < 2 runs at base/n * (e' * (n-1)/2 + 1) with
    # e' = e + 1 (as in Horovod, batch b of 2 at e + (b + 1) / 2); then the schedule:
    # base * 0.5 ** (e - 1).
    want = [base_lr / n * ((e + 1) * (n - 1) / 2 + 1) for e in range(1)]
    want += [base_lr, base_lr * 0.5, base_lr * 0.25]
    close(history.history["lr"], want, "learning rates logged per epoch", 1e-6, 1e-7)
    return model


def save_and_load(r, n, model, workdir):
    path = os.path.join(workdir, "model.keras")
    if r == 0:
        model.save(path)
    hvd.barrier()
    loaded = hvd_keras.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, hvd_keras._DistributedKerasOptimizer), type(opt)
    assert isinstance(opt, keras.optimizers.SGD), type(opt)
    close(opt.iterations, model.optimizer.iterations, "iterations restored")
    rng = np.random.RandomState(10 + r)
    loaded.fit(rng.randn(4, 4).astype(np.float32), np.zeros((4, 1), np.float32), verbose=0,
               batch_size=4)
    for w in loaded.trainable_variables:
        g = hvd.allgather(tf.convert_to_tensor(w)).numpy()
        close(g[1:], np.repeat(g[:1], n - 1, axis=0), "weights after load_model + fit", 0, 0)
    close(hvd_keras.allreduce(np.float32(r), op=hvd.Sum), n * (n - 1) / 2, "keras allreduce")
    close(hvd_keras.broadcast(np.arange(3) + r, 1), np.arange(3) + 1, "keras broadcast")
    close(hvd_keras.allgather(np.array([r])), np.arange(n).reshape(n, 1), "keras allgather")
    with raises(RuntimeError, "eager", what="broadcast_global_variables when eager"):
        hvd_keras.broadcast_global_variables(0)
    # A model saved compiled with XLA loads for training without it: XLA cannot reach
    # the core (its fit would fail, the reduction refused by name).
    keras.utils.set_random_seed(3)  # the same initial weights on every rank
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    xla_path = os.path.join(workdir, f"xla-{r}.keras")
    plain.save(xla_path)
    loaded = hvd_keras.load_model(xla_path)
    assert loaded.jit_compile is False, loaded.jit_compile
    loaded.fit(np.ones((4, 4), np.float32) * (r + 1), np.zeros((4, 1), np.float32),
               verbose=0, batch_size=4)
    g = hvd.allgather(tf.convert_to_tensor(loaded.trainable_variables[0])).numpy()
    close(g[1:], np.repeat(g[:1], n - 1, axis=0), "weights after loading an XLA model", 0, 0)


def which_keras():
    """Perseus uses tf.keras's Keras; under Keras 2 a Keras 3 optimizer is refused with
    the reason."""
    assert keras.optimizers.SGD is tf.keras.optimizers.SGD, (keras, tf.keras)
    assert isinstance(hvd.keras.callbacks.MetricAverageCallback(), keras.callbacks.Callback)
    if KERAS3:
        return
    import keras as keras3

    with raises(TypeError, "comes from the keras package", "TF_USE_LEGACY_KERAS",
                what="a Keras 3 optimizer under Keras 2"):
        hvd.DistributedOptimizer(keras3.optimizers.SGD(0.01))


def estimator_style(r, n, workdir):
    """model_fn / input_fn with MonitoredTrainingSession and the hook, as Estimators did."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(r)  # different initial values on every rank
        x = tf.compat.v1.random_normal([4, 3], seed=7)
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = opt.minimize(loss, global_step=step)
        seen = {}

        class Watch(tf.compat.v1.train.SessionRunHook):
            def after_create_session(self, session, coord):
                seen["first"] = session.run(w)  # runs after the broadcast hook's

            def end(self, session):
                seen["final"] = session.run(w)

        hooks = [hvd.BroadcastGlobalVariablesHook(0), Watch(),
                 tf.compat.v1.train.StopAtStepHook(last_step=3)]
        ckpt = os.path.join(workdir, "ckpt") if r == 0 else None
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=hooks,
                                                         save_checkpoint_steps=2) as sess:
            while not sess.should_stop():
                sess.run(train)
    gathered = hvd.allgather_object((seen["first"], seen["final"]))
    assert not np.allclose(seen["first"], seen["final"]), "the loop did not train"
    for f0, f1 in gathered[1:]:
        close(f0, gathered[0][0], "hook broadcast the initial weights", 0, 0)
        close(f1, gathered[0][1], "weights after the session loop", 0, 0)


def main():
    workdir = sys.argv[1]
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    which_keras()
    model = fit_with_callbacks(r, n, workdir)
    save_and_load(r, n, model, workdir)
    estimator_style(r, n, workdir)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

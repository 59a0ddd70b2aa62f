"""The Keras callbacks as Horovod 0.28 defines them, on n ranks: the learning rate of
every batch under LearningRateScheduleCallback (a constant multiplier is exponential
decay, by epoch or by fractions of one) and LearningRateWarmupCallback (Horovod's
schedule, the number of ranks read at each batch, rank 0 alone reporting the end,
initial_lr required); the momentum correction (Keras 2's legacy optimizers);
BroadcastGlobalVariablesCallback's local_variables; and
compile(experimental_run_tf_function=False) as Horovod's TF2 examples write it."""

import contextlib
import io

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.keras as hvd
import tensorflow as tf
from _tfhelpers import KERAS3, close, done, keras, raises, to_float, vname
from perseus.tensorflow.keras import callbacks as callbacks_module

STEPS = 4  # batches per epoch


class Rates(keras.callbacks.Callback):
    """The learning rate each batch runs with (put it after the schedules), and the
    momentum, before and after the batch."""

    def __init__(self):
        super().__init__()
        self.rates, self.momenta, self.after = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(to_float(self.model.optimizer.learning_rate))
        self.momenta.append(to_float(self.model.optimizer.momentum))

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(to_float(self.model.optimizer.momentum))


def fit_rates(schedule, epochs, lr=0.3, sgd=None, rates=None):
    """Per-batch rates (epochs x STEPS) and the logged ``lr`` of a fit under ``schedule``."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    sgd = sgd or keras.optimizers.SGD(lr)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd), loss="mse")
    rates = rates or Rates()
    x, y = np.ones((STEPS * 2, 2), np.float32), np.zeros((STEPS * 2, 1), np.float32)
    # The recorder after the schedule: on_train_batch_end restores the momentum first.
    history = model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[schedule, rates])
    return np.array(rates.rates).reshape(epochs, STEPS), history.history.get("lr")


def schedules():
    # A constant multiplier: initial_lr * m ** (epoch - start_epoch) in [start, end); the
    # optimizer's own rate before, the last one after.
    got, logged = fit_rates(hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=1.0, multiplier=0.5, start_epoch=1, end_epoch=4), epochs=5)
    want = np.repeat([[0.3], [1.0], [0.5], [0.25], [0.25]], STEPS, axis=1)
    close(got, want, "staircase schedule, constant multiplier", 1e-6, 1e-7)
    close(logged, want[:, -1], "staircase schedule: logged lr", 1e-6, 1e-7)
    # Not staircase: by fractions of an epoch, epoch + batch / steps.
    got, _ = fit_rates(hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=1.0, multiplier=0.5, start_epoch=1, end_epoch=3, staircase=False),
        epochs=4)
    want = np.array([[0.5 ** (e - 1 + b / STEPS) for b in range(STEPS)] for e in range(4)])
    want[0], want[3] = 0.3, want[2, -1]
    close(got, want, "smooth schedule, constant multiplier", 1e-6, 1e-7)
    # A function is called with the (fractional) epoch as it is.
    got, _ = fit_rates(hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=2.0, multiplier=lambda e: 1 / (1 + e), staircase=False), epochs=2)
    want = np.array([[2.0 / (1 + e + b / STEPS) for b in range(STEPS)] for e in range(2)])
    close(got, want, "smooth schedule, multiplier function", 1e-6, 1e-7)
    # Without the steps per epoch (data of unknown length), a smooth schedule cannot work.
    unknown = tf.data.Dataset.from_generator(
        lambda: iter([(np.ones((2, 2), np.float32), np.zeros((2, 1), np.float32))]),
        output_signature=(tf.TensorSpec((2, 2), tf.float32), tf.TensorSpec((2, 1), tf.float32)))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    smooth = hvd.callbacks.LearningRateScheduleCallback(1.0, 0.5, staircase=False)
    with raises(ValueError, "needs steps_per_epoch", what="smooth schedule, unknown steps"):
        model.fit(unknown, epochs=1, callbacks=[smooth], verbose=0)


def warmup(r, n):
    base, warm = 0.4, 2

    def horovods(size):
        # batch b of epoch e < warm runs with epoch e + (b + 1) / steps: the warmup's last
        # batch runs at base exactly; after the warmup the rate stays base
        return np.array([[base / size * ((e + (b + 1) / STEPS) * (size - 1) / warm + 1)
                          if e < warm else base for b in range(STEPS)] for e in range(3)])

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got, logged = fit_rates(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=base, warmup_epochs=warm, verbose=1), epochs=3)
    close(got, horovods(n), "warmup: each batch's rate", 1e-6, 1e-7)
    close(logged, horovods(n)[:, -1], "warmup: logged lr", 1e-6, 1e-7)
    said = out.getvalue()
    if r == 0:
        assert "Epoch 2: finished gradual learning rate warmup to 0.4." in said, said
    else:
        assert "finished gradual learning rate warmup" not in said, f"rank {r} said: {said}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fit_rates(hvd.callbacks.LearningRateWarmupCallback(base, warmup_epochs=1), epochs=1)
    assert "finished gradual" not in out.getvalue(), f"verbose=0 said: {out.getvalue()}"

    # The number of ranks is read when each batch starts (an elastic job re-forms with
    # another): here the callback is made at n ranks and trains "at" n + 2.
    cb = hvd.callbacks.LearningRateWarmupCallback(base, warmup_epochs=warm)
    real_size = callbacks_module.size
    callbacks_module.size = lambda: n + 2
    try:
        got, _ = fit_rates(cb, epochs=3)
    finally:
        callbacks_module.size = real_size
    close(got, horovods(n + 2), "warmup: rates at the size of each batch", 1e-6, 1e-7)

    for make in (lambda: hvd.callbacks.LearningRateWarmupCallback(initial_lr=None),
                 lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5)):
        with raises(ValueError, "initial_lr is required", what="initial_lr=None"):
            make()


def momentum_correction():
    """Keras 2's legacy optimizers keep the momentum in a variable: as in Horovod, each
    batch whose rate the schedule changed runs with momentum * new_lr / old_lr, and the
    momentum is restored when the batch ends."""
    if KERAS3:
        return
    for correct in (True, False):
        rates = Rates()
        got, _ = fit_rates(hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=1.0, multiplier=0.5, start_epoch=1, end_epoch=3,
            momentum_correction=correct), epochs=3,
            sgd=keras.optimizers.legacy.SGD(0.3, momentum=0.9), rates=rates)
        momenta = np.array(rates.momenta).reshape(3, STEPS)
        want = np.full((3, STEPS), 0.9)
        if correct:  # the first batch of epochs 1 (0.3 -> 1.0) and 2 (1.0 -> 0.5)
            want[1, 0], want[2, 0] = 0.9 * 1.0 / 0.3, 0.9 * 0.5
        close(momenta, want, f"momentum_correction={correct}", 1e-6, 1e-6)
        close(rates.after, np.full(3 * STEPS, 0.9), "momentum restored after each batch",
              1e-6, 1e-6)
        close(got[:, 0], [0.3, 1.0, 0.5], "rates with a legacy optimizer", 1e-6, 1e-7)


def broadcast_local_variables(r, n):
    keras.utils.set_random_seed(100 + r)  # different weights on every rank
    x, y = np.ones((2, 3), np.float32), np.zeros((2, 2), np.float32)

    def model_and_own():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(2)])
        # A rate of 0: fit's step changes nothing, the broadcast alone does.
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                      loss="mse")
        return model, [v.numpy() for v in model.weights]

    def check(local, kept, what):
        # kept: the indices in model.weights (kernel, bias, kernel, bias) that stay local
        model, own = model_and_own()
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local(model))
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[cb])
        assert cb.broadcast_done, what
        root = hvd.broadcast_object(own, 0)
        for i, v in enumerate(model.weights):
            close(v, own[i] if i in kept else root[i], f"{what}: {vname(v)}", 0, 0)
        kernels = hvd.allgather_object(model.layers[1].kernel.numpy())
        assert not np.array_equal(kernels[0], kernels[-1]), f"{what}: local kernel broadcast"

    check(lambda m: m.layers[1].trainable_variables, {2, 3}, "a local layer's variables")
    check(lambda m: m.layers[1].kernel, {2}, "one Keras variable")
    if KERAS3:
        check(lambda m: [m.layers[1].kernel.value], {2},
              "the TensorFlow variable of a Keras one")
    for bad in ([np.ones(2)], tf.constant(1.0), ["kernel"]):
        with raises(ValueError, "local_variables must be variables", what=f"{bad!r}"):
            hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=bad)
    # Without local variables every weight is rank 0's.
    model, own = model_and_own()
    model.fit(x, y, batch_size=2, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for v, want in zip(model.weights, hvd.broadcast_object(own, 0)):
        close(v, want, f"no local variables: {vname(v)}", 0, 0)


def horovod_compile(r, n):
    # Horovod's TF2 Keras examples pass experimental_run_tf_function=False, which Keras 3
    # has no use for (nor takes).
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  metrics=["mae"], experimental_run_tf_function=False)
    model.fit(np.full((1, 1), r + 1.0, np.float32), np.ones((1, 1), np.float32), verbose=0)
    # d/dw (w x - 1)^2 at w = 0 is -2x, averaged over the ranks: -(n + 1)
    close(model.get_weights()[0], np.full((1, 1), 0.1 * (n + 1), np.float32),
          "one step after compile(experimental_run_tf_function=False)", 1e-6, 1e-7)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    schedules()
    warmup(r, n)
    momentum_correction()
    broadcast_local_variables(r, n)
    horovod_compile(r, n)
    done(r)


if __name__ == "__main__":
    main()

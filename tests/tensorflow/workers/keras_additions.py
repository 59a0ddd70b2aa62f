"""perseus.tensorflow.keras's Horovod 0.28 additions on n ranks: reducescatter, the timeline,
the capability checks, PartialDistributedOptimizer (fit, and accumulated passes), training
without XLA, loss scaling alike on every rank, and callbacks.BestModelCheckpoint (rank 0 alone writes the best epoch's
model).

argv[1]: a directory every rank can write (each rank gives the checkpoint its own name,
so that a file written by any rank but 0 would show)."""

import json
import os
import sys

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import perseus.tensorflow.keras as hvd_keras
import tensorflow as tf
from _tfhelpers import KERAS3, check_local_update, close, done, keras, raises, to_float, vname
from perseus.common import basics


def reducescatter(r, n):
    d0 = 2 * n + 1
    value = np.arange(d0 * 2, dtype=np.float32).reshape(d0, 2) * (r + 1)
    whole = np.arange(d0 * 2, dtype=np.float32).reshape(d0, 2)
    lo = 0 if r == 0 else 3 + 2 * (r - 1)  # rank 0 gets the one extra row
    hi = lo + (3 if r == 0 else 2)
    got = hvd_keras.reducescatter(value, op=hvd.Sum)
    assert isinstance(got, np.ndarray), type(got)
    close(got, whole[lo:hi] * n * (n + 1) / 2, "keras reducescatter Sum")
    close(hvd_keras.reducescatter(value, name="keras.rs"), whole[lo:hi] * (n + 1) / 2,
          "keras reducescatter Average (default)")


def timeline(r, n, workdir):
    path = os.path.join(workdir, "timeline.json")
    hvd_keras.start_timeline(path)
    close(hvd_keras.allreduce(np.ones(3, np.float32), name="keras.timeline.probe", op=hvd.Sum),
          np.full(3, n), "allreduce under the timeline")
    hvd_keras.stop_timeline()
    hvd_keras.allreduce(np.ones(3, np.float32), name="keras.after.stop")
    mine = path if r == 0 else f"{path}.{r}"
    with open(mine) as f:
        events = json.load(f)
    # Horovod's layout: a pid per tensor, named <op>.<name> by its process_name metadata.
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e["name"] == "process_name" and "name" in e["args"]}
    names = {(rows[e["pid"]], e["name"]) for e in events if e["ph"] == "X"}
    assert ("allreduce.keras.timeline.probe", "ALLREDUCE") in names, sorted(names)[:20]
    assert ("allreduce.keras.timeline.probe", "NEGOTIATE_ALLREDUCE") in names, sorted(names)
    assert not any("keras.after.stop" in row for row in rows.values()), "recorded after stop"
    with raises(ValueError, "file path", what="start_timeline without a path"):
        hvd_keras.start_timeline("")


def capabilities():
    want = {"mpi_threads_supported": False, "mpi_enabled": False, "mpi_built": False,
            "gloo_enabled": True, "gloo_built": True, "ddl_built": False, "ccl_built": False,
            "rocm_built": False, "cuda_built": False, "nccl_built": basics.nccl_built()}
    for name, value in want.items():
        got = getattr(hvd_keras, name)()
        assert got is value, f"hvd.keras.{name}() = {got!r}, expected {value!r}"
        assert getattr(hvd, name)() is value, f"hvd.{name} and hvd.keras.{name} disagree"


def two_layer_model(seed):
    keras.utils.set_random_seed(seed)
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(1, name="local")
    return keras.Sequential([keras.Input((4,)), shared, local]), shared, local


def own_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def sgd_classes():
    """The Keras SGD classes to wrap: Keras 2 has its legacy optimizers too."""
    if KERAS3:
        return [keras.optimizers.SGD]
    return [keras.optimizers.SGD, keras.optimizers.legacy.SGD]


def partial_fit(r, n):
    for sgd in sgd_classes():
        partial_fit_of(r, n, sgd)


def partial_fit_of(r, n, sgd):
    """One fit step (the whole local batch): shared layers take the averaged gradient,
    the local layer its own divided by the size."""
    model, shared, local = two_layer_model(5)
    rng = np.random.RandomState(60 + r)
    x, y = rng.randn(6, 4).astype(np.float32), rng.randn(6, 1).astype(np.float32)
    own = own_gradients(model, x, y)
    everyone = hvd.allgather_object(own)
    before = [v.numpy() for v in model.trainable_variables]
    lr = 0.1
    opt = hvd_keras.PartialDistributedOptimizer(sgd(lr), local_layers=[local])
    assert isinstance(opt, sgd), type(opt)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    check_local_update(model, local, shared, before, own, everyone, n, lr,
                       f"PartialDistributedOptimizer({sgd.__module__}) fit")


def partial_accumulated(r, n):
    """backward_passes_per_step=2: two passes of constant gradients, then one update; the
    local layer keeps its own aggregate (divided by the size)."""
    model, _shared, local = two_layer_model(6)
    variables = model.trainable_variables
    local_ids = {id(v) for v in local.trainable_weights}
    for sgd in sgd_classes():
        for average in (True, False):
            what = f"{sgd.__module__}, average={average}"
            opt = hvd_keras.PartialDistributedOptimizer(
                sgd(1.0), local_layers=local, backward_passes_per_step=2,
                average_aggregated_gradients=average)
            before = [v.numpy() for v in variables]
            passes = [[tf.fill(v.shape, float(r + 1 + k)) for v in variables]
                      for k in range(2)]
            opt.apply_gradients(zip(passes[0], variables))
            for v, b in zip(variables, before):
                close(v, b, f"no update after the first pass ({what})", 0, 0)
            opt.apply_gradients(zip(passes[1], variables))
            # Per rank the aggregate is (r + 1) + (r + 2), halved when averaged.
            agg = [(2 * i + 3) / (2 if average else 1) for i in range(n)]
            for v, b in zip(variables, before):
                g = agg[r] / n if id(v) in local_ids else np.mean(agg)
                close(v, b - g, f"accumulated update of {vname(v)} ({what})", 1e-5, 1e-5)


def partial_errors():
    with raises(ValueError, "All local layers must be of tf.keras.layers.Layer type", "str",
                what="a string among the local layers"):
        hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                              local_layers=["dense"])


class Score(keras.callbacks.Callback):
    """Logs a made-up ``score`` per epoch (best: epoch 1 for min, epoch 2 for max) and
    records the weights each epoch ended with."""

    SCORES = (3.0, 1.0, 5.0, 2.0)

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.SCORES[epoch]
        self.weights.append([w.copy() for w in self.model.get_weights()])


def best_checkpoint(r, n, workdir):
    rng = np.random.RandomState(r)
    x = rng.randn(8, 4).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss="mse")
    score = Score()
    lowest = hvd_keras.callbacks.BestModelCheckpoint(monitor="score", mode="min",
                                                     filepath=os.path.join(workdir,
                                                                           f"min.{r}.keras"))
    highest = hvd_keras.callbacks.BestModelCheckpoint(monitor="score", mode="max",
                                                      save_weights_only=True)
    highest.filepath = os.path.join(workdir, f"max.{r}.weights.h5")  # set later, as Horovod's
    assert isinstance(lowest, keras.callbacks.ModelCheckpoint) and lowest.save_best_only
    model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0,
              callbacks=[score, lowest, highest])
    hvd.barrier()  # rank 0 is done writing
    written = sorted(f for f in os.listdir(workdir) if f.startswith(("min.", "max.")))
    assert written == ["max.0.weights.h5", "min.0.keras"], written
    final = model.get_weights()
    assert not np.allclose(final[0], score.weights[1][0]), "training did not move"
    if r == 0:
        saved = keras.models.load_model(os.path.join(workdir, "min.0.keras"))
        for got, want in zip(saved.get_weights(), score.weights[1]):
            close(got, want, "min checkpoint holds epoch 1's weights", 0, 0)
        model.load_weights(os.path.join(workdir, "max.0.weights.h5"))
        for got, want in zip(model.get_weights(), score.weights[2]):
            close(got, want, "max checkpoint holds epoch 2's weights", 0, 0)
    hvd.barrier()

    no_path = hvd_keras.callbacks.BestModelCheckpoint()
    with raises(ValueError, "BestModelCheckpoint has no file to write", what="no filepath"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[no_path])
    if KERAS3:  # Keras 2's ModelCheckpoint takes any path (a SavedModel's directory too)
        no_path.filepath = os.path.join(workdir, "best.txt")
        with raises(ValueError, "must end in .keras or .h5", "best.txt", what="bad extension"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[no_path])


def without_xla(r, n):
    """XLA-compiled code cannot call the core: a model compiled with a Perseus optimizer
    trains with jit_compile=False (a warning when True was asked for; Keras 3's "auto"
    resolved as on a GPU machine, where Keras picks XLA), and trains alike on every
    rank; other models keep XLA; a collective in a jit_compile=True function is refused
    by name."""
    import warnings

    for asked in (True, "auto") if KERAS3 else (True,):
        model, _, _ = two_layer_model(7)
        if asked == "auto":  # Keras' choice on a machine with a GPU
            model._resolve_auto_jit_compile = lambda: True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                          loss="mse", jit_compile=asked)
        said = [str(w.message) for w in caught if "perseus" in str(w.message)]
        assert model.jit_compile is False, f"jit_compile={asked!r}: {model.jit_compile}"
        want = ("perseus: code compiled by XLA cannot call the Perseus core, which reduces "
                "this model's gradients; proceeding with jit_compile=False")
        assert said == ([want] if asked is True else []), f"jit_compile={asked!r}: {said}"
        rng = np.random.RandomState(70 + r)
        x, y = rng.randn(4, 4).astype(np.float32), rng.randn(4, 1).astype(np.float32)
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights = hvd.allgather_object([v.numpy() for v in model.trainable_variables])
        for i, w in enumerate(weights[0]):
            close(weights[-1][i], w, f"weights alike after fit, jit_compile={asked!r}", 0, 0)
    plain, _, _ = two_layer_model(7)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    assert plain.jit_compile is True, "a model without a Perseus optimizer lost XLA"
    step = tf.function(lambda: hvd.allreduce(tf.ones(2), name="xla.refused"), jit_compile=True)
    with raises(NotImplementedError, "perseus: PerseusAllreduce cannot run in code compiled "
                "by XLA", "jit_compile=False", what="an allreduce under XLA"):
        step()


def loss_scale_alike(r, n):
    """mixed_float16: Keras wraps the Perseus optimizer in a LossScaleOptimizer. Rank 0's
    first batch overflows float16 and the other ranks' do not: every rank skips that
    step and halves the scale; the next step, finite everywhere, moves every rank's
    weights alike. (Keras 3: through the hook on check_finite; Keras 2: its
    LossScaleOptimizer has the Perseus optimizer reduce before it checks.)"""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, _, _ = two_layer_model(9)
        model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                      loss="mse")
        before = [v.numpy() for v in model.trainable_variables]
        x = np.full((4, 4), 3000.0 if r == 0 else 0.001, np.float32)
        model.fit(x, np.zeros((4, 1), np.float32), batch_size=4, verbose=0)
        opt = model.optimizer
        assert isinstance(opt, keras.mixed_precision.LossScaleOptimizer), type(opt)
        for v, b in zip(model.trainable_variables, before):
            close(v, b, f"rank {r}: the overflowed step was skipped", 0, 0)
        scales = hvd.allgather_object(to_float(opt.dynamic_scale if KERAS3 else
                                               opt.loss_scale))
        assert scales == [2.0 ** 14] * n, f"loss scales after the overflow: {scales}"
        x = np.full((4, 4), 0.5 * (r + 1), np.float32)
        model.fit(x, np.ones((4, 1), np.float32), batch_size=4, verbose=0)
        after = [v.numpy() for v in model.trainable_variables]
        assert any(not np.array_equal(a, b) for a, b in zip(after, before)), "no step taken"
        weights = hvd.allgather_object(after)
        for i, w in enumerate(weights[0]):
            close(weights[-1][i], w, "weights alike after the finite step", 0, 0)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main():
    workdir = sys.argv[1]
    hvd_keras.init()
    r, n = hvd_keras.rank(), hvd_keras.size()
    reducescatter(r, n)
    timeline(r, n, workdir)
    capabilities()
    partial_fit(r, n)
    partial_accumulated(r, n)
    partial_errors()
    without_xla(r, n)
    loss_scale_alike(r, n)
    best_checkpoint(r, n, workdir)
    hvd_keras.shutdown()
    done(r)


if __name__ == "__main__":
    main()

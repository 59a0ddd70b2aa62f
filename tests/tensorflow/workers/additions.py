"""perseus.tensorflow.horovod's Horovod 0.28 additions on n ranks: process_set_included_op,
broadcast_object_fn, PartialDistributedGradientTape, DistributedOptimizer's
register_local_var (Keras and tf.compat.v1), SyncBatchNormalization's statistics,
moving averages and gradients against one process normalizing the whole batch, and
op=Adasum on gradients (tape and Keras optimizer) against the NumPy rule."""

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _adasum_rule import reference as adasum_reference
from _tfhelpers import KERAS3, check_local_update, close, done, keras, raises, vname


def modes(fn):
    """``fn`` run eagerly and as a tf.function: yields (mode, fn)."""
    yield "eager", fn
    yield "graph", tf.function(fn)


def included_op(r, n):
    for mode, f in modes(lambda: hvd.process_set_included_op()):
        out = f()
        assert out.dtype == tf.int32, out.dtype
        close(out, 1, f"process_set_included_op of the global set {mode}")
    first = hvd.add_process_set([0])
    try:
        want = 1 if r == 0 else 0
        close(hvd.process_set_included_op(first.process_set_id), want,
              "process_set_included_op by id")
        close(hvd.process_set_included_op(first), want, "process_set_included_op by set")
        with raises(ValueError, "no process set has id 999", what="unknown process set id"):
            hvd.process_set_included_op(999)
        with raises(TypeError, "process_set_id must be an int", what="id of a wrong type"):
            hvd.process_set_included_op("0")
    finally:
        hvd.remove_process_set(first)


def object_fn(r, n):
    bcast = hvd.broadcast_object_fn(root_rank=n - 1)
    got = bcast({"from": r, "data": [r] * 3})
    assert got == {"from": n - 1, "data": [n - 1] * 3}, got
    # The same function again, with another object: the root's each time.
    assert bcast(("second", r)) == ("second", n - 1)
    named = hvd.broadcast_object_fn(root_rank=0, name="named.fn")
    assert named(r + 10) == 10


def two_layer_model(seed):
    """A shared Dense and a 'local' Dense, alike on every rank."""
    keras.utils.set_random_seed(seed)
    shared = keras.layers.Dense(3, name="shared")
    local = keras.layers.Dense(1, name="local")
    model = keras.Sequential([keras.Input((4,)), shared, local])
    return model, shared, local


def rank_batch(r):
    rng = np.random.RandomState(40 + r)
    return rng.randn(5, 4).astype(np.float32), rng.randn(5, 1).astype(np.float32)


def local_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return tape.gradient(loss, model.trainable_variables)


def partial_tape(r, n):
    model, shared, local = two_layer_model(1)
    x, y = rank_batch(r)
    own = [g.numpy() for g in local_grads(model, x, y)]
    everyone = hvd.allgather_object(own)
    shared_ids = {id(v) for v in shared.trainable_weights}
    for scale_local in (True, False):
        def step(scale_local=scale_local):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=local,
                                                      scale_local_gradients=scale_local)
            return tape.gradient(loss, model.trainable_variables)
        # The same gradients, split into the local layer's and the shared ones.
        def split(scale_local=scale_local):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            tape = hvd.PartialDistributedGradientTape(
                tape, local_layers=local, scale_local_gradients=scale_local)
            return tape.get_local_and_global_gradients(loss, model.trainable_variables)
        for mode, f in modes(step):
            grads = f()
            for i, (v, g) in enumerate(zip(model.trainable_variables, grads)):
                if id(v) in shared_ids:
                    want = np.mean([e[i] for e in everyone], axis=0)
                else:
                    want = own[i] / n if scale_local else own[i]
                close(g, want, f"partial tape {vname(v)} scale_local={scale_local} {mode}",
                      1e-5, 1e-6)
            mine, common = (split if mode == "eager" else tf.function(split))()
            # Horovod's pairs: (variable, gradient), local ones first.
            pairs = list(zip(model.trainable_variables, grads))
            want = ([p for p in pairs if id(p[0]) not in shared_ids],
                    [p for p in pairs if id(p[0]) in shared_ids])
            if (len(mine), len(common)) != tuple(map(len, want)):
                raise AssertionError(f"get_local_and_global_gradients split {len(mine)}/"
                                     f"{len(common)}, want {len(want[0])}/{len(want[1])}")
            for (v, got), (wv, w) in zip(list(mine) + list(common), want[0] + want[1]):
                # A tf.function returns a variable's value; eager code, the variable.
                if mode == "eager":
                    assert v is wv, f"split pairs {vname(v)} where {vname(wv)} was due"
                else:
                    close(v, wv, f"split pairs' sources {mode}")
                close(got, w, f"split gradients scale_local={scale_local} {mode}", 1e-6, 1e-7)
    # A list of layers is taken too; everything else is refused, naming the cause.
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    grads = hvd.PartialDistributedGradientTape(tape, local_layers=[shared, local]).gradient(
        loss, model.trainable_variables)
    for g, o in zip(grads, own):
        close(g, o / n, "every layer local: own gradients / size", 1e-5, 1e-6)
    with raises(ValueError, "All local layers must be of tf.keras.layers.Layer type",
                "Variable", what="a variable as a local layer"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[local.kernel])
    with raises(ValueError, "Keras layer", what="a number as local_layers"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=3)
    with raises(TypeError, "register_local_source takes a variable", what="a tensor source"):
        hvd.DistributedGradientTape(tf.GradientTape()).register_local_source(tf.ones(2))


def adasum_gradients(r, n):
    """DistributedGradientTape(op=Adasum) and a Keras DistributedOptimizer(op=Adasum):
    each gradient becomes the Adasum of the ranks' gradients (Horovod's TF behaviour),
    eagerly and in a tf.function."""
    model, _, _ = two_layer_model(3)
    x, y = rank_batch(r)
    everyone = hvd.allgather_object([g.numpy() for g in local_grads(model, x, y)])
    want = [adasum_reference([e[i] for e in everyone]).reshape(everyone[0][i].shape)
            for i in range(len(everyone[0]))]

    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        return tape.gradient(loss, model.trainable_variables)

    for mode, f in modes(tape_step):
        for v, g, w in zip(model.trainable_variables, f(), want):
            close(g, w, f"Adasum tape {vname(v)} {mode}", 1e-5, 1e-6)
    # Adasum is not the average here: the check can fail.
    mean = np.mean([e[0] for e in everyone], axis=0)
    assert not np.allclose(want[0], mean, rtol=1e-3), "Adasum equals the mean"
    before = [v.numpy() for v in model.trainable_variables]
    lr = 0.1
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), op=hvd.Adasum)
    opt.apply_gradients(zip(local_grads(model, x, y), model.trainable_variables))
    for v, b, w in zip(model.trainable_variables, before, want):
        close(v, b - lr * w, f"Adasum Keras step {vname(v)}", 1e-5, 1e-6)


# Horovod's delta optimizer: rank k's gradient of w is the constant ADASUM_GRADS(k)[i].
ADASUM_SHAPES = ((3,), (2, 2))


def adasum_grads(k):
    rng = np.random.RandomState(60 + k)
    return [rng.randn(*shape).astype(np.float32) for shape in ADASUM_SHAPES]


class DeltaReplay:
    """Every rank's local steps (SGD with ``momentum``, TensorFlow's rule: accum = mu *
    accum + g, w -= lr * accum) replayed in NumPy; every ``passes``-th step the weight
    changes since the cycle's start combine by the Adasum rule."""

    def __init__(self, n, start, lr, momentum, passes):
        self.n, self.lr, self.mu, self.passes = n, lr, momentum, passes
        self.start = [np.array(w, np.float64) for w in start]
        self.w = [[w.copy() for w in self.start] for _ in range(n)]
        self.acc = [[np.zeros_like(w) for w in self.start] for _ in range(n)]
        self.calls = 0

    def step(self):
        for k in range(self.n):
            for i, g in enumerate(adasum_grads(k)):
                self.acc[k][i] = self.mu * self.acc[k][i] + g
                self.w[k][i] = self.w[k][i] - self.lr * self.acc[k][i]
        self.calls += 1
        if self.calls % self.passes == 0:
            for i, s in enumerate(self.start):
                s += adasum_reference([self.w[k][i] - s for k in range(self.n)]).reshape(s.shape)
            self.w = [[s.copy() for s in self.start] for _ in range(self.n)]


def adasum_legacy_session(r, n):
    """A tf.compat.v1 optimizer under op=Adasum in a session: Momentum, 2 local steps per
    combination, over 2 cycles; the weights in between are each rank's own."""
    graph = tf.Graph()
    init = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.float32)]
    with graph.as_default():
        ws = [tf.compat.v1.get_variable(f"w{i}", initializer=tf.constant(v))
              for i, v in enumerate(init)]
        loss = tf.add_n([tf.reduce_sum(w * g) for w, g in zip(ws, adasum_grads(r))])
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
                                       op=hvd.Adasum, backward_passes_per_step=2)
        train = opt.minimize(loss)
        replay = DeltaReplay(n, init, 0.1, 0.9, 2)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(1, 5):
                sess.run(train)
                replay.step()
                got = sess.run(ws)
                for i, (g, w) in enumerate(zip(got, replay.w[r])):
                    close(g, w, f"v1 Adasum session, step {step}, w{i}", 1e-5, 1e-6)
    everyone = hvd.allgather_object([g.tobytes() for g in got])
    assert all(e == everyone[0] for e in everyone), "the combined weights differ in bits"
    # The ranks' changes are not parallel: Adasum is neither their sum nor their mean.
    start = [np.array(v, np.float64) for v in init]
    changes = [-0.1 * (1 + 0.9 + 1) * adasum_grads(k)[0] for k in range(n)]
    assert not np.allclose(got[0], start[0] + np.mean(changes, axis=0), rtol=1e-3)
    assert not np.allclose(got[0], start[0] + np.sum(changes, axis=0), rtol=1e-3)


def adasum_legacy_eager(r, n):
    """The same optimizer eagerly and in a tf.function (one combination per step), and on
    the float16 wire; average_aggregated_gradients is refused."""
    for mode, wire, tol in (("eager", hvd.Compression.none, 1e-5),
                            ("tf.function", hvd.Compression.none, 1e-5),
                            ("eager, fp16 wire", hvd.Compression.fp16, 2e-3)):
        init = [np.full(shape, 0.5, np.float32) for shape in ADASUM_SHAPES]
        ws = [tf.Variable(v) for v in init]
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.2),
                                       op=hvd.Adasum, compression=wire)

        def step(opt=opt, ws=ws):
            opt.apply_gradients(zip([tf.constant(g) for g in adasum_grads(r)], ws))

        run = tf.function(step) if mode == "tf.function" else step
        replay = DeltaReplay(n, init, 0.2, 0.0, 1)
        for i in range(2):
            run()
            replay.step()
            for j, (v, w) in enumerate(zip(ws, replay.w[r])):
                close(v, w, f"v1 Adasum {mode}, step {i + 1}, w{j}", tol, tol)
    with raises(ValueError, "average_aggregated_gradients=True",
                what="Adasum with averaged passes"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 op=hvd.Adasum, backward_passes_per_step=2,
                                 average_aggregated_gradients=True)


def register_local_var_keras(r, n):
    model, shared, local = two_layer_model(2)
    x, y = rank_batch(r)
    own = [g.numpy() for g in local_grads(model, x, y)]
    everyone = hvd.allgather_object(own)
    before = [v.numpy() for v in model.trainable_variables]
    lr = 0.1
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr))
    for v in local.trainable_weights:
        opt.register_local_var(v)
    with raises(TypeError, "register_local_var takes a variable", what="a tensor"):
        opt.register_local_var(tf.ones(2))
    opt.apply_gradients(zip(local_grads(model, x, y), model.trainable_variables))
    check_local_update(model, local, shared, before, own, everyone, n, lr,
                       "keras register_local_var")


def register_local_var_legacy(r, n):
    graph = tf.Graph()
    with graph.as_default():
        shared = tf.compat.v1.get_variable("shared", initializer=tf.constant([1.0, 2.0]))
        own = tf.compat.v1.get_variable("own", initializer=tf.constant([3.0]))
        c = float(r + 1)
        loss = c * tf.reduce_sum(shared) + c * tf.reduce_sum(own)  # both gradients: r + 1
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
        opt.register_local_var(own)
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            got_shared, got_own = sess.run([shared, own])
    close(got_shared, np.array([1.0, 2.0]) - (n + 1) / 2, "legacy shared: averaged gradient")
    close(got_own, np.array([3.0]) - (r + 1) / n, "legacy local: own gradient / size")


# --------------------------------------------------------------------------- SyncBatchNormalization

FEATURES = 3


def global_batch(n, spatial):
    """Every rank's rows (rank r holds 2 + r of them) and the loss weights, alike
    everywhere; with ``spatial`` the rows are [4, 2, FEATURES] images."""
    rng = np.random.RandomState(7)
    counts = [2 + i for i in range(n)]
    shape = (4, 2, FEATURES) if spatial else (FEATURES,)
    rows = [(rng.randn(c, *shape) * (i + 1) + 3.0 * i).astype(np.float32)
            for i, c in enumerate(counts)]
    weights = rng.randn(sum(counts), *shape).astype(np.float32)
    return rows, weights, counts


def plain_batch_norm(**kw):
    """Keras' BatchNormalization, unfused as SyncBatchNormalization is (Keras 2's fused
    kernel, its choice for 4-D inputs, moves the moving variance by the unbiased one)."""
    if not KERAS3:
        kw["fused"] = False
    return keras.layers.BatchNormalization(**kw)


def bn_pair(sync_cls, shape, **kw):
    """A SyncBatchNormalization and a plain one with the same non-trivial parameters, for
    inputs of ``shape``."""
    layers = [sync_cls(**kw), plain_batch_norm(**kw)]
    for layer in layers:
        layer.build((None, *shape[1:]))
        layer.gamma.assign([1.5, 0.5, 2.0])
        layer.beta.assign([0.1, -0.2, 0.3])
    return layers


def sync_batch_norm_stats(r, n):
    for spatial in (False, True):
        rows, weights, counts = global_batch(n, spatial)
        mine = tf.constant(rows[r])
        whole = tf.constant(np.concatenate(rows))
        start = sum(counts[:r])
        for mode in ("eager", "graph"):
            sync, ref = bn_pair(hvd.SyncBatchNormalization, whole.shape, momentum=0.5)

            def train_call(layer, x):
                return layer(x, training=True)
            call = tf.function(train_call) if mode == "graph" else train_call
            got = call(sync, mine)
            want = call(ref, whole).numpy()
            what = f"SyncBatchNormalization spatial={spatial} {mode}"
            close(got, want[start:start + counts[r]], f"{what}: outputs", 1e-4, 1e-4)
            # The moving statistics moved to the global batch's, the same on every rank.
            close(sync.moving_mean, ref.moving_mean, f"{what}: moving mean", 1e-5, 1e-5)
            close(sync.moving_variance, ref.moving_variance, f"{what}: moving variance",
                  1e-4, 1e-4)
            # Inference uses the moving statistics.
            close(sync(mine, training=False), ref(whole, training=False).numpy()[
                start:start + counts[r]], f"{what}: inference", 1e-4, 1e-4)

        # Gradients through the global statistics: the loss is the sum over every rank
        # of its rows' weighted outputs; this rank's input gradient is that loss's
        # gradient at its rows, and gamma's and beta's sum over the ranks is the whole's.
        sync, ref = bn_pair(hvd.SyncBatchNormalization, whole.shape)
        w_mine = weights[start:start + counts[r]]
        x = tf.Variable(mine)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sync(x, training=True) * w_mine)
        gx, gg, gb = tape.gradient(loss, [x, sync.gamma, sync.beta])
        xw = tf.Variable(whole)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ref(xw, training=True) * weights)
        wx, wg, wb = tape.gradient(loss, [xw, ref.gamma, ref.beta])
        what = f"SyncBatchNormalization gradients spatial={spatial}"
        close(gx, wx.numpy()[start:start + counts[r]], f"{what}: input", 1e-4, 1e-4)
        close(hvd.allreduce(gg, op=hvd.Sum), wg, f"{what}: gamma", 1e-4, 1e-4)
        close(hvd.allreduce(gb, op=hvd.Sum), wb, f"{what}: beta", 1e-4, 1e-4)


def sync_batch_norm_training_step(r, n):
    """One SGD step of Dense -> SyncBatchNormalization on each rank's rows, gradients
    summed over the ranks, gives the weights of one process's step on the whole batch."""
    rows, weights, counts = global_batch(n, spatial=False)
    start = sum(counts[:r])

    def build(bn_cls):
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(FEATURES),
                                 bn_cls(momentum=0.0)])

    def loss_fn(model, x, w):
        # Divided by the whole batch's rows, so that the ranks' sum is the whole's mean.
        return tf.reduce_sum(model(x, training=True) * w) / sum(counts)

    model = build(hvd.SyncBatchNormalization)
    ref = build(plain_batch_norm)
    opt, ref_opt = keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.5)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, w):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, w)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Sum)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    grads = step(tf.constant(rows[r]), tf.constant(weights[start:start + counts[r]]))
    with tf.GradientTape() as tape:
        loss = loss_fn(ref, tf.constant(np.concatenate(rows)), tf.constant(weights))
    ref_grads = tape.gradient(loss, ref.trainable_variables)
    ref_opt.apply_gradients(zip(ref_grads, ref.trainable_variables))
    assert np.abs(ref_grads[0].numpy()).max() > 1e-3, "the Dense kernel gets no gradient"
    for g, rg, v in zip(grads, ref_grads, ref.trainable_variables):
        close(g, rg, f"training step gradient of {vname(v)}", 1e-4, 1e-5)
    for v, rv in zip(model.variables, ref.variables):
        close(v, rv, f"after the step: {vname(rv)}", 1e-4, 1e-5)


def sync_batch_norm_arguments():
    with raises(ValueError, "does not support fused=True", what="fused=True"):
        hvd.SyncBatchNormalization(fused=True)
    with raises(ValueError, "synchronized=True", what="synchronized=True"):
        hvd.SyncBatchNormalization(synchronized=True)
    layer = hvd.SyncBatchNormalization(axis=1, momentum=0.9)
    assert isinstance(layer, keras.layers.BatchNormalization)
    assert layer.name.startswith("sync_batch_normalization"), layer.name
    clone = hvd.SyncBatchNormalization.from_config(layer.get_config())
    assert clone.axis == 1 and clone.momentum == 0.9


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    included_op(r, n)
    object_fn(r, n)
    partial_tape(r, n)
    register_local_var_keras(r, n)
    register_local_var_legacy(r, n)
    adasum_gradients(r, n)
    adasum_legacy_session(r, n)
    adasum_legacy_eager(r, n)
    sync_batch_norm_stats(r, n)
    sync_batch_norm_training_step(r, n)
    sync_batch_norm_arguments()
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

"""Data-parallel training equals one process on the whole batch: DistributedGradientTape
(eager and tf.function), the Keras DistributedOptimizer (custom loop, minimize, fit,
accumulated passes; under Keras 2 both tf.keras.optimizers and
tf.keras.optimizers.legacy) and the tf.compat.v1 DistributedOptimizer (session,
accumulated passes, eager). Every rank ends with the same weights as the reference each
rank computes alone."""

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import KERAS3, close, done, keras, regression_batch, vname

ROWS = 4  # per rank
STEPS = 3


def shard(a, r):
    return a[r * ROWS:(r + 1) * ROWS]


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(1)])


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


def same_everywhere(model, what):
    for w in model.trainable_variables:
        gathered = hvd.allgather(tf.convert_to_tensor(w)).numpy()
        for other in gathered:
            close(other, gathered[0], f"{what}: ranks differ on {vname(w)}", 0, 0)


def reference(x, y, lr=0.1, momentum=0.9, steps=STEPS, seed=0):
    model = make_model(seed)
    opt = keras.optimizers.SGD(lr, momentum=momentum)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    return weights(model)


def tape_training(r, n, x, y, want):
    for mode in ("eager", "graph"):
        model = make_model()
        opt = keras.optimizers.SGD(0.1, momentum=0.9)

        def step(xb, yb, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        fn = step if mode == "eager" else tf.function(step)
        for _ in range(STEPS):
            fn(shard(x, r), shard(y, r))
        for got, ref in zip(weights(model), want):
            close(got, ref, f"DistributedGradientTape {mode}", 1e-5, 1e-6)
        same_everywhere(model, f"tape {mode}")

    # As the context manager itself, with a local source.
    model = make_model()
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_mean((model(shard(x, r)) - shard(y, r)) ** 2)
    bias = model.trainable_variables[-1]
    tape.register_local_source(bias)
    grads = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as local:
        own = tf.reduce_mean((model(shard(x, r)) - shard(y, r)) ** 2)
    close(grads[-1], local.gradient(own, bias) / n, "local source: own gradient / size")


def sgd_classes():
    """The Keras SGD classes to wrap: Keras 2 has its legacy optimizers too."""
    if KERAS3:
        return [("", keras.optimizers.SGD)]
    return [("", keras.optimizers.SGD), ("legacy ", keras.optimizers.legacy.SGD)]


def keras_optimizer(r, n, x, y, want):
    for kind, sgd in sgd_classes():
        keras_optimizer_of(r, n, x, y, want, kind, sgd)


def keras_optimizer_of(r, n, x, y, want, kind, sgd):
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(0.1, momentum=0.9))
    assert isinstance(opt, sgd), type(opt)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    for _ in range(STEPS):
        step(shard(x, r), shard(y, r))
    for got, ref in zip(weights(model), want):
        close(got, ref, f"Keras {kind}DistributedOptimizer, custom loop", 1e-5, 1e-6)

    if not KERAS3:
        # Keras 2's minimize (eagerly, a loss callable), as Horovod's TF2 examples use it.
        model = make_model()
        opt = hvd.DistributedOptimizer(sgd(0.1, momentum=0.9))
        xs, ys = shard(x, r), shard(y, r)
        for _ in range(STEPS):
            opt.minimize(lambda: tf.reduce_mean((model(xs) - ys) ** 2),
                         model.trainable_variables)
        for got, ref in zip(weights(model), want):
            close(got, ref, f"Keras {kind}DistributedOptimizer, minimize", 1e-5, 1e-6)

    # model.fit: one batch per step, no shuffling.
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(0.1, momentum=0.9)), loss="mse")
    model.fit(shard(x, r), shard(y, r), batch_size=ROWS, epochs=STEPS, shuffle=False, verbose=0)
    for got, ref in zip(weights(model), want):
        close(got, ref, f"Keras {kind}DistributedOptimizer, fit", 1e-5, 1e-6)
    same_everywhere(model, f"{kind}fit")

    # Two passes of half a shard each, averaged, make one step of the whole batch.
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(0.1, momentum=0.9), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(shard(x, r), shard(y, r), batch_size=ROWS // 2, epochs=STEPS, shuffle=False,
              verbose=0)
    for got, ref in zip(weights(model), want):
        close(got, ref, f"Keras {kind}backward_passes_per_step=2 (averaged)", 1e-5, 1e-6)
    # Keras 2: every pass counts in the optimizer's iterations, as in Horovod; Keras 3's
    # gradient_accumulation_steps counts the updates.
    close(opt.iterations, STEPS if KERAS3 else 2 * STEPS, f"Keras {kind}iterations", 0, 0)
    # Horovod's default sums the passes: the same as twice the learning rate here.
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(0.05, momentum=0.9), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(shard(x, r), shard(y, r), batch_size=ROWS // 2, epochs=STEPS, shuffle=False,
              verbose=0)
    for got, ref in zip(weights(model), want):
        close(got, ref, f"Keras {kind}backward_passes_per_step=2 (summed)", 1e-5, 1e-6)


def legacy_graph(r, n, x, y, passes, use_hvd):
    """Weights after STEPS updates with a tf.compat.v1 MomentumOptimizer in a session."""
    init = [w.copy() for w in weights(make_model())]
    graph = tf.Graph()
    with graph.as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [None, 5])
        yp = tf.compat.v1.placeholder(tf.float32, [None, 1])
        ws = [tf.compat.v1.get_variable(f"w{i}", initializer=w) for i, w in enumerate(init)]
        pred = tf.matmul(tf.tanh(tf.matmul(xp, ws[0]) + ws[1]), ws[2]) + ws[3]
        loss = tf.reduce_mean((pred - yp) ** 2)
        opt = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        if use_hvd:
            opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=passes,
                                           average_aggregated_gradients=True)
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            if use_hvd:
                sess.run(hvd.broadcast_global_variables(0))
            for _ in range(STEPS):
                if not use_hvd:
                    sess.run(train, {xp: x, yp: y})
                    continue
                for p in range(passes):
                    rows = slice(p * ROWS // passes, (p + 1) * ROWS // passes)
                    sess.run(train, {xp: shard(x, r)[rows], yp: shard(y, r)[rows]})
            return sess.run(ws)


def legacy_optimizer(r, n, x, y):
    want = legacy_graph(r, n, x, y, 1, use_hvd=False)
    for passes in (1, 2):
        got = legacy_graph(r, n, x, y, passes, use_hvd=True)
        for g, w in zip(got, want):
            close(g, w, f"tf.compat.v1 DistributedOptimizer, {passes} passes", 1e-5, 1e-6)

    # Eagerly, through minimize with a loss callable (tf.Variables: Keras 3 variables are
    # not tf.compat.v1 optimizers' business).
    def run(opt, xs, ys):
        ws = [tf.Variable(w) for w in weights(make_model())]

        def loss():
            pred = tf.matmul(tf.tanh(tf.matmul(xs, ws[0]) + ws[1]), ws[2]) + ws[3]
            return tf.reduce_mean((pred - ys) ** 2)
        for _ in range(STEPS):
            opt.minimize(loss, var_list=ws)
        return ws

    got = run(hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)),
              shard(x, r), shard(y, r))
    ref = run(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), x, y)
    for g, w in zip(got, ref):
        close(g, w, "tf.compat.v1 DistributedOptimizer, eager", 1e-5, 1e-6)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = regression_batch(n, ROWS)
    want = reference(x, y)
    tape_training(r, n, x, y, want)
    keras_optimizer(r, n, x, y, want)
    legacy_optimizer(r, n, x, y)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

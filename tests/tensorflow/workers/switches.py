"""The PERSEUS_* switches act on TensorFlow gradient reductions as on torch's: each is set
before a fresh init() of this process, and its effect checked."""

import os
import warnings

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import perseus.tensorflow.horovod as hvd
import tensorflow as tf
from _tfhelpers import KERAS3, close, done, keras, raises
from perseus.common import ops
from perseus.tensorflow.horovod import bridge

SWITCHES = ("PERSEUS_ALLREDUCE_NANCHECK", "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
            "PERSEUS_ALLREDUCE_DTYPE", "PERSEUS_ACCUMULATE_N_STEPS", "PERSEUS_ALLREDUCE_FUSION",
            "HOROVOD_CYCLE_TIME")


def start(**env):
    for key in SWITCHES:
        os.environ.pop(key, None)
    os.environ.update({k: str(v) for k, v in env.items()})
    hvd.init()
    return hvd.rank(), hvd.size()


def tape_grads(w, c, graph=False):
    def run():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * c)
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]
    return tf.function(run)() if graph else run()


def nancheck():
    r, _ = start(PERSEUS_ALLREDUCE_NANCHECK=1)
    w = tf.Variable(tf.ones(4), name="w_nan")
    bad = tf.constant([1.0, np.nan, 1.0, 1.0]) if r == 1 else tf.ones(4)
    with raises(FloatingPointError, "PERSEUS_ALLREDUCE_NANCHECK", "w_nan", "rank 1",
                what="NaN from rank 1"):
        tape_grads(w, bad)
    with raises(tf.errors.OpError, "PERSEUS_ALLREDUCE_NANCHECK", "rank 1",
                what="NaN from rank 1 in tf.function"):
        tape_grads(w, bad, graph=True)
    close(tape_grads(w, tf.ones(4)), np.ones(4), "finite gradients pass")
    hvd.shutdown()


def downsample():
    r, n = start(PERSEUS_DOWNSAMPLE_N_ELEMENTS=2)
    w = tf.Variable(tf.zeros(4))
    c = tf.fill([4], float(r + 1))
    mean = (n + 1) / 2
    # Step 0 sends elements 0 and 2; step 1 elements 1 and 3, with their residual.
    close(tape_grads(w, c), [mean, 0, mean, 0], "down-sampled step 0")
    close(tape_grads(w, c), [0, 2 * mean, 0, 2 * mean], "down-sampled step 1")
    hvd.shutdown()


def wire_dtype():
    sent = {}
    for dtype in (1, 0):
        start(PERSEUS_ALLREDUCE_DTYPE=dtype)
        w = tf.Variable(tf.zeros(65536))
        before = hvd.counters()["bytes_intra_host"]
        g = tape_grads(w, tf.fill([65536], 0.1))
        close(g, np.full(65536, 0.1), f"gradient with PERSEUS_ALLREDUCE_DTYPE={dtype}", 1e-3,
              1e-3)
        sent[dtype] = hvd.counters()["bytes_intra_host"] - before
        hvd.shutdown()
    assert sent[0] <= 0.55 * sent[1], f"float16 links should halve the bytes: {sent}"


def gate(name):
    """An allreduce started here, to be waited for later."""
    buf, cap = bridge.fresh_copy(tf.zeros(1))
    return ops.allreduce_async(cap, cap, name=f"fusion.gate.{name}", keep=buf)


def accumulate_and_fusion():
    # A long cycle time: requests made while another awaits its answer are held that long.
    r, n = start(PERSEUS_ACCUMULATE_N_STEPS=2, PERSEUS_ALLREDUCE_FUSION=2,
                 HOROVOD_CYCLE_TIME=300)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    if KERAS3:
        assert opt.gradient_accumulation_steps == 2, opt.gradient_accumulation_steps
    else:
        assert opt._perseus_aggregation.passes == 2, opt._perseus_aggregation
    ws = [tf.Variable(tf.zeros(1024)) for _ in range(4)]
    # Two calls: the first only accumulates, the second applies the mean of both, averaged
    # over the ranks: -(1 + 2) / 2 * mean(r + 1).
    for k in (1, 2):
        grads = [tf.fill([1024], float(k * (r + 1))) for _ in ws]
        # Each rank starts its own gate before the step and joins the others' after it, so
        # during the step every rank awaits an answer: its four gradients are held and sent
        # in one message after the cycle time. The last of those messages makes all four
        # ready together, however slowly any rank enqueues them.
        own = gate(r) if k == 2 else None
        opt.apply_gradients(zip(grads, ws))
        if k == 2:
            others = [gate(q) for q in range(n) if q != r]
            for h in [own, *others]:
                h.wait()
        want = 0.0 if k == 1 else -1.5 * (n + 1) / 2
        close(ws[0], np.full(1024, want), f"PERSEUS_ACCUMULATE_N_STEPS call {k}")
    fused = hvd.counters()["fused_bytes_max"]
    assert 0 < fused <= 2 * 4096, f"PERSEUS_ALLREDUCE_FUSION=2: largest buffer {fused} bytes"
    # A tape has no call to skip: it reduces every gradient() call, and says so once.
    w = tf.Variable(tf.ones(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            close(tape_grads(w, tf.fill([4], float(r + 1))), np.full(4, (n + 1) / 2),
                  "a tape under PERSEUS_ACCUMULATE_N_STEPS=2")
    said = [str(c.message) for c in caught if "PERSEUS_ACCUMULATE_N_STEPS=2" in str(c.message)]
    assert len(said) == 1 and "DistributedGradientTape" in said[0], said
    hvd.shutdown()
    return r


def main():
    nancheck()
    downsample()
    wire_dtype()
    r = accumulate_and_fusion()
    done(r)


if __name__ == "__main__":
    main()

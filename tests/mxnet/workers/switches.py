"""The PERSEUS_* gradient switches in DistributedTrainer (gluon) and DistributedOptimizer
(through MXNet's own Updater, as the Module API calls it), against references computed
here. argv[1] names the switch the launcher set: nancheck, accumulate, downsample or
perfcheck."""

import sys
import time

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, make_net, raises, regression_batch

ROWS = 4  # per rank and step
OPT = {"learning_rate": 0.1, "momentum": 0.9}


def backward(net, x, y):
    with mx.autograd.record():
        loss = ((net(mx.nd.array(x)) - mx.nd.array(y)) ** 2).sum()
    loss.backward()


def weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def rows(a, call, r, n):
    """Rank r's rows of call ``call`` (every call and rank has its own)."""
    start = (call * n + r) * ROWS
    return a[start:start + ROWS]


def reference_trainer():
    net = make_net()
    return net, mx.gluon.Trainer(net.collect_params(), "sgd", OPT, kvstore=None)


# --------------------------------------------------------------------------- NaN check

def nancheck_trainer(r, n):
    x, y = regression_batch(n, ROWS)
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", OPT)
    before = weights(net)
    backward(net, x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS])
    bad = net[0].weight
    if r == 1:
        bad.grad()[0, 0] = float("nan")
    with raises(FloatingPointError, "PERSEUS_ALLREDUCE_NANCHECK", f"gradient of {bad.name}",
                f"rank 1 ({bad.name})", "not applied", what="DistributedTrainer NaN"):
        trainer.step(ROWS)
    for got, want in zip(weights(net), before):
        close(got, want, "weights after the refused step", 0, 0)
    # The next (finite) step is an ordinary one: the weights of one step on the whole batch.
    backward(net, x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS])
    trainer.step(ROWS)
    ref, ref_trainer = reference_trainer()
    backward(ref, x, y)
    ref_trainer.step(ROWS * n)
    for got, want in zip(weights(net), weights(ref)):
        close(got, want, "the step after the refused one", 1e-5, 1e-6)


def nancheck_optimizer(r, n):
    sgd = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, param_idx2name={0: "w_a", 1: "w_b"})
    # MXNet's Updater alone would update w_a, then w_b, in separate calls.
    sgd.aggregate_num = 1
    opt = hvd.DistributedOptimizer(sgd)
    updater = mx.optimizer.get_updater(opt)  # what Module.update() calls, with every index
    w = [mx.nd.ones(3), mx.nd.ones((2, 2))]
    g = [mx.nd.ones(3) * (r + 1), mx.nd.ones((2, 2)) * (r + 1)]
    if r == 1:
        g[1][1, 1] = float("inf")
    with raises(FloatingPointError, "gradient of w_b", "rank 1 (w_b)", what="optimizer Inf"):
        updater([0, 1], g, w)
    # One decision for the whole step: w_a is not updated either.
    close(w[0], np.ones(3), "w_a after the refused step", 0, 0)
    close(w[1], np.ones((2, 2)), "w_b after the refused step", 0, 0)
    updater([0, 1], [mx.nd.ones(3) * (r + 1), mx.nd.ones((2, 2)) * (r + 1)], w)
    mean = (n + 1) / 2  # the average over the ranks of r + 1
    close(w[0], np.full(3, 1 - 0.1 * mean), "w_a after a finite step")
    close(w[1], np.full((2, 2), 1 - 0.1 * mean), "w_b after a finite step")


# --------------------------------------------------------------------------- accumulation

def accumulate_trainer(r, n):
    """PERSEUS_ACCUMULATE_N_STEPS=2: calls 1 and 3 only accumulate; calls 2 and 4 update
    with the average of two calls' gradients, which equals one step on both calls' rows
    of every rank."""
    x, y = regression_batch(4 * n, ROWS)
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", OPT)
    ref, ref_trainer = reference_trainer()
    for call in range(4):
        before = weights(net)
        backward(net, rows(x, call, r, n), rows(y, call, r, n))
        trainer.step(ROWS)
        if call % 2 == 0:
            for got, want in zip(weights(net), before):
                close(got, want, f"call {call + 1} only accumulates", 0, 0)
            continue
        both = [np.concatenate([rows(a, c, q, n) for c in (call - 1, call) for q in range(n)])
                for a in (x, y)]
        backward(ref, *both)
        ref_trainer.step(2 * n * ROWS)
        for got, want in zip(weights(net), weights(ref)):
            close(got, want, f"DistributedTrainer after call {call + 1}", 1e-5, 1e-6)


def accumulate_optimizer(r, n):
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    updater = mx.optimizer.get_updater(opt)
    ref_updater = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    w = mx.nd.array([1.0, 2.0, 3.0])
    w_ref = w.copy()

    def grad(call, q):
        return np.array([call + 1, -(call + 1), 0.5], dtype=np.float32) * (q + 1)

    for call in range(4):
        before = w.asnumpy()
        updater([0], [mx.nd.array(grad(call, r))], [w])
        if call % 2 == 0:
            close(w, before, f"optimizer call {call + 1} only accumulates", 0, 0)
            continue
        avg = np.mean([(grad(call - 1, q) + grad(call, q)) / 2 for q in range(n)], axis=0)
        ref_updater(0, mx.nd.array(avg), w_ref)
        close(w, w_ref, f"DistributedOptimizer after call {call + 1}")


# --------------------------------------------------------------------------- down-sampling

def downsample_optimizer(r, n):
    """PERSEUS_DOWNSAMPLE_N_ELEMENTS=2, PERSEUS_GRADIENT_MOMENTUM=0.5: each call sends the
    elements offset::2 (offset 0, 1, 0, 1) of gradient + 0.5 x residual; the others wait."""
    sgd = mx.optimizer.SGD(learning_rate=1.0)
    sgd.aggregate_num = 0  # the wrapped optimizer takes one parameter at a time
    updater = mx.optimizer.get_updater(hvd.DistributedOptimizer(sgd))
    w = mx.nd.zeros(5)
    want = np.zeros(5, dtype=np.float32)
    residual = [None] * n

    def grad(call, q):
        return (np.arange(5) * (q + 1) + call + 1).astype(np.float32)

    for call in range(4):
        updater([0], [mx.nd.array(grad(call, r))], [w])
        offset = call % 2
        total = np.zeros(5, dtype=np.float32)
        for q in range(n):
            acc = grad(call, q) if residual[q] is None else residual[q] * 0.5 + grad(call, q)
            total[offset::2] += acc[offset::2]
            acc[offset::2] = 0
            residual[q] = acc
        want -= total / n
        close(w, want, f"down-sampled update {call + 1}")


# --------------------------------------------------------------------------- perf check

def perfcheck_trainer(r, n):
    """PERSEUS_PERF_CHECK_N_STEPS=2: rank 1 computes 0.3 s longer each step, so it says
    so (the test reads the output)."""
    x, y = regression_batch(n, ROWS)
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", OPT)
    for _ in range(5):
        if r == 1:
            time.sleep(0.3)
        backward(net, x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS])
        trainer.step(ROWS)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mode = sys.argv[1]
    if mode == "nancheck":
        nancheck_trainer(r, n)
        nancheck_optimizer(r, n)
    elif mode == "accumulate":
        accumulate_trainer(r, n)
        accumulate_optimizer(r, n)
    elif mode == "downsample":
        downsample_optimizer(r, n)
    elif mode == "perfcheck":
        perfcheck_trainer(r, n)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

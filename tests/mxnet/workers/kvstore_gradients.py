"""The Perseus KVStore's gradient pushes: set_gradient_compression (MXNet's 2bit and 1bit
quantization with a per-key residual) against a reference quantizer written here, the
bytes it sends, its errors; and (argv[1] == "dtype", launched with
PERSEUS_ALLREDUCE_DTYPE=0) float16 on the wire for gradient pushes only."""

import sys

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises
from perseus.common.basics import counters

SHAPE = (3, 7)  # 21 values: not a whole number of bytes of codes


def reference(kind, threshold, pushes):
    """What one rank's successive pushes stand for after quantization, element by
    element as MXNet's kernels do it (float32 residual starting at zero)."""
    t = np.float32(threshold)
    residual = np.zeros(pushes[0].size, dtype=np.float32)
    out = []
    for values in pushes:
        sent = np.zeros(values.size, dtype=np.float32)
        for i, v in enumerate(values.reshape(-1)):
            residual[i] += np.float32(v)
            if kind == "2bit":
                if residual[i] >= t:
                    sent[i] = t
                    residual[i] -= t
                elif residual[i] <= -t:
                    sent[i] = -t
                    residual[i] += t
            elif residual[i] > t:  # 1bit
                sent[i] = 1
                residual[i] -= np.float32(1)
            else:
                sent[i] = -1
                residual[i] += np.float32(1)
        out.append(sent.reshape(values.shape))
    return out


def values(q, k):
    """Rank q's k-th push: values in (-1, 1), different on every rank and push."""
    return np.random.RandomState(100 * q + k).uniform(-1, 1, SHAPE).astype(np.float32)


def check_quantized_sums(kv, r, n, kind, threshold, key):
    kv.init(key, mx.nd.zeros(SHAPE))
    refs = [reference(kind, threshold, [values(q, k) for k in range(3)]) for q in range(n)]
    out = mx.nd.zeros(SHAPE)
    for k in range(3):
        kv.push(key, mx.nd.array(values(r, k)))
        kv.pull(key, out=out)
        want = sum(refs[q][k] for q in range(n))
        close(out, want, f"{kind} push {k + 1}: the sum of every rank's quantized values")
        exact = sum(values(q, k) for q in range(n))
        assert not np.allclose(out.asnumpy(), exact, atol=1e-3), f"{kind}: not quantized"


def compression(r, n):
    kv = hvd.create("dist_sync_perseus")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    check_quantized_sums(kv, r, n, "2bit", 0.5, "g2")
    # A list of values (one per device) is summed locally, then quantized once.
    kv.init("dev", mx.nd.zeros(SHAPE))
    a, b = values(r, 7), values(r, 8)
    kv.push("dev", [mx.nd.array(a), mx.nd.array(b)])
    out = mx.nd.zeros(SHAPE)
    kv.pull("dev", out=out)
    want = sum(reference("2bit", 0.5, [values(q, 7) + values(q, 8)])[0] for q in range(n))
    close(out, want, "2bit push of a list of values")
    # param_only keys and Max / Min stay exact.
    kv.init("stat", mx.nd.zeros(SHAPE), param_only=True)
    kv.push("stat", mx.nd.array(values(r, 0) * 0.1))
    kv.pull("stat", out=out)
    close(out, sum(values(q, 0) * 0.1 for q in range(n)), "a param_only key is not quantized")
    kv.push("g2", mx.nd.array(values(r, 5)), op=hvd.PerseusOp.Max)
    kv.pull("g2", out=out)
    close(out, np.max([values(q, 5) for q in range(n)], axis=0), "Max is not quantized")

    kv.set_gradient_compression({"type": "1bit", "threshold": 0.0})
    check_quantized_sums(kv, r, n, "1bit", 0.0, "g1")
    kv.set_gradient_compression({"type": "1bit", "threshold": 0.25})
    check_quantized_sums(kv, r, n, "1bit", 0.25, "g1b")

    # The codes travel packed: 2 bits per value instead of a float32's 32 (on 2 ranks
    # 1/16 of a float32 allreduce's bytes).
    big = mx.nd.array(np.random.RandomState(r).uniform(-1, 1, 1 << 16).astype(np.float32))
    kv.init("big", mx.nd.zeros(big.shape))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    c0 = counters()
    kv.push("big", big)
    c1 = counters()
    kv.set_gradient_compression({"type": "none"})
    kv.push("big", big)
    c2 = counters()
    packed = c1["bytes_intra_host"] - c0["bytes_intra_host"]
    full = c2["bytes_intra_host"] - c1["bytes_intra_host"]
    assert packed > 0 and full >= 16 * packed, f"bytes sent: 2bit {packed}, float32 {full}"
    # 'none': exact sums again.
    kv.init("plain", mx.nd.zeros(SHAPE))
    kv.push("plain", mx.nd.array(values(r, 0)))
    kv.pull("plain", out=out)
    close(out, sum(values(q, 0) for q in range(n)), "'none' turns compression off")

    for params, exc, fragment in (
            ({"type": "3bit"}, ValueError, "unknown gradient compression type '3bit'"),
            ({"type": "2bit", "threshold": 0}, ValueError, "threshold > 0"),
            ({"type": "2bit", "threshold": -0.5}, ValueError, "threshold > 0"),
            ({"type": "2bit", "threshold": "big"}, ValueError, "must be a number, got 'big'"),
            ({"type": "1bit", "threshold": float("inf")}, ValueError, "must be finite"),
            ({"threshold": 0.5}, ValueError, "needs a 'type'"),
            ({"type": "2bit", "thresh": 0.5}, ValueError, "unknown parameter(s) ['thresh']"),
            ("2bit", TypeError, "takes a dict")):
        with raises(exc, fragment, what=f"set_gradient_compression({params!r})"):
            kv.set_gradient_compression(params)
    kv.set_gradient_compression({"type": "2bit"})  # threshold 0.5 by default
    kv.init("f64", mx.nd.zeros(2, dtype="float64"))
    with raises(TypeError, "float32", "'f64'", "float64", what="2bit of float64 values"):
        kv.push("f64", mx.nd.ones(2, dtype="float64"))
    gluon_trainer(r, n)


def gluon_trainer(r, n):
    """gluon.Trainer(..., kvstore=kv, compression_params=...) sets the store's compression:
    w's gradient is 0.3 + 0.5 r on rank r; SGD (lr 1) applies the sum of the quantized
    gradients."""
    kv = hvd.create("dist_sync_perseus")
    net = mx.gluon.nn.Dense(1, in_units=1, use_bias=False)
    net.initialize(mx.init.Zero())
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0}, kvstore=kv,
                               compression_params={"type": "2bit", "threshold": 0.5})
    grads = [np.full((1, 1), 0.3 + 0.5 * q, dtype=np.float32) for q in range(n)]
    refs = [reference("2bit", 0.5, [grads[q]] * 3) for q in range(n)]
    want = np.zeros((1, 1), dtype=np.float32)
    for k in range(3):
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 1))).sum() * (0.3 + 0.5 * r)
        loss.backward()
        trainer.step(1)
        want -= sum(refs[q][k] for q in range(n))
        close(net.weight.data(), want, f"gluon.Trainer with 2bit compression, step {k + 1}")


def dtype(r, n):
    """PERSEUS_ALLREDUCE_DTYPE=0: Sum pushes to weight keys are gradients and travel as
    float16 (half the bytes, float16-rounded sums); param_only keys and Max stay exact."""
    kv = hvd.create("dist_sync_perseus")

    def v(q):
        return np.random.RandomState(q).uniform(0.1, 1, 256).astype(np.float32)

    exact = sum(v(q) for q in range(n))
    kv.init("w", mx.nd.zeros(256))
    kv.init("p", mx.nd.zeros(256), param_only=True)
    out = mx.nd.zeros(256)
    c0 = counters()
    kv.push("p", mx.nd.array(v(r)))
    c1 = counters()
    kv.pull("p", out=out)
    close(out, exact, "a param_only push is exact", 0, 0)
    kv.push("w", mx.nd.array(v(r)))
    c2 = counters()
    kv.pull("w", out=out)
    close(out, exact, "a gradient push, through float16", 2e-3, 0)
    assert np.abs(out.asnumpy() - exact).max() > 1e-6, \
        f"a gradient push did not travel as float16: {out.asnumpy()} == {exact}"
    exact_bytes = c1["bytes_intra_host"] - c0["bytes_intra_host"]
    gradient_bytes = c2["bytes_intra_host"] - c1["bytes_intra_host"]
    assert exact_bytes == 2 * gradient_bytes > 0, (exact_bytes, gradient_bytes)
    kv.push("w", mx.nd.array(v(r)), op=hvd.PerseusOp.Max)
    kv.pull("w", out=out)
    close(out, np.max([v(q) for q in range(n)], axis=0), "Max pushes are exact", 0, 0)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    {"compression": compression, "dtype": dtype}[sys.argv[1]](r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

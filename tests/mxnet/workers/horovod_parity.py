"""Where perseus.mxnet meets Horovod 0.28's MXNet front-end and seed 003's KVStore, one
mode per argv[1]:

- ``alltoall_errors``: bad splits (not summing to dim 0, wrong length, negative, floats in a
  list, a float NDArray or numpy array), dim 0 not divisible without splits and a scalar
  raise an error that is both ``mxnet.base.MXNetError`` (as Horovod's) and ``ValueError``;
  integer splits of every kind still work afterwards;
- ``scalar_reducescatter``: reducescatter and grouped_reducescatter of a scalar raise
  Horovod's ``ValueError``, and nothing of the group is submitted;
- ``kvstore_names``: ``mx.kv.create("dist_sync_perseus")``, ``gluon.Trainer(...,
  kvstore="dist_sync_perseus")`` and the Module API by name make the Perseus KVStore
  (which trains as one process on the whole batch); the class's name still works;
- ``push_op``: seed 003's ``push(key, value, op)``: a PerseusOp in MXNet's priority slot
  is the op, a plain int stays a priority, the op given twice raises ``TypeError``.
"""

import sys

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, make_net, raises, regression_batch, train_gluon
from mxnet.base import MXNetError

ROWS = 4  # per rank
STEPS = 3
OPT = {"learning_rate": 0.1, "momentum": 0.9}


def alltoall_errors(r, n):
    floats = [1.5, 2.5] + [4] * (n - 2)  # sums to dim 0 below
    cases = [
        ("splits not summing to dim 0", "sum to",
         lambda: hvd.alltoall(mx.nd.ones((n + 1, 2)), splits=[1] * n)),
        ("dim 0 not divisible without splits", "divisible",
         lambda: hvd.alltoall(mx.nd.ones((n + 1,)))),
        ("too many splits", "one entry per rank",
         lambda: hvd.alltoall(mx.nd.ones((n + 1,)), splits=[1] * (n + 1))),
        ("too few splits", "one entry per rank", lambda: hvd.alltoall(mx.nd.ones((n,)),
                                                                      splits=[n])),
        ("negative splits", "non-negative",
         lambda: hvd.alltoall(mx.nd.ones((n,)), splits=[-1, n + 1] + [0] * (n - 2))),
        ("float splits in a list", "splits to contain integers",
         lambda: hvd.alltoall(mx.nd.ones((int(sum(floats)),)), splits=floats)),
        ("a float NDArray of splits", "splits to contain integers",
         lambda: hvd.alltoall(mx.nd.ones((2 * n,)), splits=mx.nd.array([2.0] * n))),
        ("a float numpy array of splits", "splits to contain integers",
         lambda: hvd.alltoall(mx.nd.ones((2 * n,)), splits=np.full(n, 2.0))),
        ("a scalar", "scalar", lambda: hvd.alltoall(mx.nd.array([3.0]).reshape(()))),
    ]
    for what, fragment, call in cases:
        # Horovod-style code catches MXNetError, Perseus-style code ValueError: both work.
        with raises(MXNetError, fragment, what=f"alltoall, {what}"):
            call()
        with raises(ValueError, fragment, what=f"alltoall, {what}"):
            call()
    # Integer splits of every kind, after the errors: nothing was left half-submitted.
    rows = mx.nd.arange(2 * n).reshape((-1, 1)) + 100 * r
    want = np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * i for i in range(n)])
    for given in ([2] * n, (2,) * n, [np.int64(2)] * n, np.full(n, 2, np.int64),
                  mx.nd.array([2] * n, dtype="int32"), mx.nd.array([2] * n, dtype="int64"),
                  mx.nd.array([2] * n, dtype="uint8")):
        out, received = hvd.alltoall(rows, splits=given)
        close(out, want.reshape(-1, 1), f"alltoall with splits {given!r}")
        close(received, np.full(n, 2), f"received splits with {given!r}")
    # The class raised, exported for except clauses.
    assert issubclass(hvd.MXNetValueError, MXNetError)
    assert issubclass(hvd.MXNetValueError, ValueError)


def scalar_reducescatter(r, n):
    scalar = mx.nd.array([float(r)]).reshape(())
    assert scalar.shape == ()
    with raises(ValueError, "reducescatter does not support scalar inputs",
                what="reducescatter of a scalar"):
        hvd.reducescatter(scalar, op=hvd.Sum)
    for op in (hvd.Sum, hvd.Average):
        with raises(ValueError, "grouped_reducescatter does not support scalar inputs",
                    what="grouped_reducescatter with a scalar"):
            hvd.grouped_reducescatter([mx.nd.ones((n,)), scalar], op=op)
    # The group's first array was not submitted: the next reducescatter pairs up as usual.
    out = hvd.grouped_reducescatter([mx.nd.ones((n, 2)) * (r + 1)], op=hvd.Sum)
    close(out[0], np.full((1, 2), n * (n + 1) / 2), "grouped_reducescatter after the errors")
    close(hvd.reducescatter(mx.nd.ones((n,)) * (r + 1), op=hvd.Sum), [n * (n + 1) / 2],
          "reducescatter after the errors")


def _train(trainer_for, xs, ys, batch):
    return train_gluon(trainer_for, xs, ys, batch, STEPS)


def kvstore_names(r, n):
    for name in ("dist_sync_perseus", "DIST_SYNC_PERSEUS", "perseuskvstore"):
        kv = mx.kv.create(name)
        assert isinstance(kv, hvd.PerseusKVStore), f"mx.kv.create({name!r}) made {type(kv)}"
        assert (kv.type, kv.rank, kv.num_workers) == ("dist_sync_perseus", r, n), \
            (kv.type, kv.rank, kv.num_workers)
    kv = mx.kv.create("dist_sync_perseus")
    kv.init("k", mx.nd.ones(2) * (r + 5))
    kv.push("k", mx.nd.ones(2) * r)
    out = mx.nd.zeros(2)
    kv.pull("k", out=out)
    close(out, np.full(2, n * (n - 1) / 2), "a push through mx.kv.create's store")
    # gluon.Trainer by name: the global batch, as with dist_sync, equals one process.
    x, y = regression_batch(n, ROWS)
    _, want = _train(lambda p: mx.gluon.Trainer(p, "sgd", OPT, kvstore=None), x, y, ROWS * n)
    trainer, got = _train(lambda p: mx.gluon.Trainer(p, "sgd", OPT, kvstore="dist_sync_perseus"),
                          x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS], ROWS * n)
    assert isinstance(trainer._kvstore, hvd.PerseusKVStore), type(trainer._kvstore)
    for g, w in zip(got, want):
        close(g, w, 'gluon.Trainer(kvstore="dist_sync_perseus")', 1e-5, 1e-6)
    # The Module API by name.
    data, label = mx.sym.Variable("data"), mx.sym.Variable("label")
    out_ = mx.sym.FullyConnected(mx.sym.Activation(
        mx.sym.FullyConnected(data, num_hidden=3, name="fc1"), act_type="tanh"),
        num_hidden=1, name="fc2")
    mod = mx.mod.Module(mx.sym.MakeLoss(mx.sym.sum(mx.sym.square(out_ - label))),
                        data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[("data", (ROWS, 5))], label_shapes=[("label", (ROWS, 1))])
    net = make_net()
    (w1, b1), (w2, b2) = [(layer.weight.data(), layer.bias.data()) for layer in net]
    mod.init_params(arg_params={"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2,
                                "fc2_bias": b2})
    mod.init_optimizer(kvstore="dist_sync_perseus", optimizer="sgd", optimizer_params=OPT)
    assert isinstance(mod._kvstore, hvd.PerseusKVStore), type(mod._kvstore)
    batch = mx.io.DataBatch([mx.nd.array(x[r * ROWS:(r + 1) * ROWS])],
                            [mx.nd.array(y[r * ROWS:(r + 1) * ROWS])])
    for _ in range(STEPS):
        mod.forward_backward(batch)
        mod.update()
    args, _ = mod.get_params()
    for k, w in zip(("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"), want):
        close(args[k], w, f'Module(kvstore="dist_sync_perseus") {k}', 1e-5, 1e-6)


def push_op(r, n):
    assert (hvd.PerseusOp.Sum, hvd.PerseusOp.Max, hvd.PerseusOp.Min) == (hvd.Sum, hvd.Max,
                                                                          hvd.Min)
    kv = hvd.create("dist_sync_perseus")
    kv.init("m", mx.nd.zeros(2), param_only=True)
    out = mx.nd.zeros(2)
    mine = mx.nd.array([r, -r])
    for op, want in ((hvd.PerseusOp.Max, [n - 1, 0]), (hvd.PerseusOp.Min, [0, -(n - 1)]),
                     (hvd.PerseusOp.Sum, [n * (n - 1) / 2, -n * (n - 1) / 2])):
        kv.push("m", mine, op)  # seed 003: push(key_name, ndarray, op)
        kv.pull("m", out=out)
        close(out, want, f"push(key, value, {op!r})")
    kv.push("m", mine, 4)  # a plain int is MXNet's priority (4 is also Max's code): a Sum
    kv.pull("m", out=out)
    close(out, [n * (n - 1) / 2, -n * (n - 1) / 2], "push(key, value, priority)")
    kv.push("m", mine, priority=-3, op=hvd.PerseusOp.Max)
    kv.pull("m", out=out)
    close(out, [n - 1, 0], "push with priority= and op=")
    kv.pushpull("m", mine, out, hvd.PerseusOp.Min)  # the priority slot of pushpull
    close(out, [0, -(n - 1)], "pushpull(key, value, out, op)")
    inplace = mine.copy()
    kv.pushpull("m", inplace, op=hvd.PerseusOp.Max)
    close(inplace, [n - 1, 0], "pushpull(key, value, op=) in place")
    with raises(TypeError, "given twice", what="push with the op twice"):
        kv.push("m", mine, hvd.PerseusOp.Max, op=hvd.PerseusOp.Min)
    with raises(TypeError, "op=", what="pushpull with the op where out goes"):
        kv.pushpull("m", mine, hvd.PerseusOp.Max)
    # Nothing was pushed by the refused calls: the ranks are still in step.
    kv.push("m", mine, op=hvd.PerseusOp.Min)
    kv.pull("m", out=out)
    close(out, [0, -(n - 1)], "push after the refused calls")


def main():
    mode = sys.argv[1]
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    {"alltoall_errors": alltoall_errors, "scalar_reducescatter": scalar_reducescatter,
     "kvstore_names": kvstore_names, "push_op": push_op}[mode](r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

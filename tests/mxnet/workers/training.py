"""Data-parallel training equals one process on the whole batch: DistributedTrainer (gluon,
with and without fp16 compression), DistributedOptimizer (Module API), and the Perseus
KVStore under gluon.Trainer and under the Module API; then the KVStore's own operations
(push with Max and Min, param_only keys, errors)."""

import _mxhelpers  # environment first; its train_gluon below
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, make_net, raises, regression_batch

ROWS = 4  # per rank
STEPS = 3
OPT = {"learning_rate": 0.1, "momentum": 0.9}


def shard(a, r):
    return a[r * ROWS:(r + 1) * ROWS]


def train_gluon(trainer_for, xs, ys, batch):
    return _mxhelpers.train_gluon(trainer_for, xs, ys, batch, STEPS)[1]


def gluon_training(r, n, x, y, want):
    got = train_gluon(lambda p: hvd.DistributedTrainer(p, "sgd", OPT), shard(x, r), shard(y, r),
                      ROWS)
    for g, w in zip(got, want):
        close(g, w, "DistributedTrainer", 1e-5, 1e-6)
    got = train_gluon(lambda p: hvd.DistributedTrainer(p, "sgd", OPT,
                                                       compression=hvd.Compression.fp16),
                      shard(x, r), shard(y, r), ROWS)
    for g, w in zip(got, want):
        close(g, w, "DistributedTrainer with fp16 compression", 2e-2, 2e-3)
    # The KVStore sums over the ranks: step() takes the global batch, as with dist_sync.
    kv = hvd.create("dist_sync_perseus")
    assert (kv.rank, kv.num_workers, kv.local_rank) == (r, n, hvd.local_rank())
    got = train_gluon(lambda p: mx.gluon.Trainer(p, "sgd", OPT, kvstore=kv), shard(x, r),
                      shard(y, r), ROWS * n)
    for g, w in zip(got, want):
        close(g, w, "gluon.Trainer with the Perseus KVStore", 1e-5, 1e-6)


def module_for(xs, ys, batch):
    data_ = mx.sym.Variable("data")
    label = mx.sym.Variable("label")
    h = mx.sym.Activation(mx.sym.FullyConnected(data_, num_hidden=3, name="fc1"),
                          act_type="tanh")
    out = mx.sym.FullyConnected(h, num_hidden=1, name="fc2")
    loss = mx.sym.MakeLoss(mx.sym.sum(mx.sym.square(out - label)))
    mod = mx.mod.Module(loss, data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[("data", (batch, 5))], label_shapes=[("label", (batch, 1))])
    net = make_net()
    (w1, b1), (w2, b2) = [(layer.weight.data(), layer.bias.data()) for layer in net]
    mod.init_params(arg_params={"fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2,
                                "fc2_bias": b2})
    batch_ = mx.io.DataBatch([mx.nd.array(xs)], [mx.nd.array(ys)])
    return mod, batch_


def module_training(r, n, x, y, want):
    def run(kvstore, optimizer, params=None):
        mod, batch = module_for(shard(x, r), shard(y, r), ROWS)
        mod.init_optimizer(kvstore=kvstore, optimizer=optimizer, optimizer_params=params or ())
        for _ in range(STEPS):
            mod.forward_backward(batch)
            mod.update()
        args, _ = mod.get_params()
        return [args[k].asnumpy() for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")]

    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(rescale_grad=1.0 / ROWS, **OPT))
    for g, w in zip(run(None, opt), want):
        close(g, w, "Module API with DistributedOptimizer", 1e-5, 1e-6)
    # Module scales the gradients by 1 / (batch x num_workers) for a dist_sync store.
    kv = hvd.create("dist_sync_perseus")
    for g, w in zip(run(kv, "sgd", OPT), want):
        close(g, w, "Module API with the Perseus KVStore", 1e-5, 1e-6)


def kvstore_ops(r, n):
    kv = hvd.create("dist_sync_perseus")
    kv.init("w", mx.nd.ones(3) * (r + 7))  # rank 0's value everywhere
    out = mx.nd.zeros(3)
    kv.pull("w", out=out)
    close(out, np.full(3, 7.0), "init takes rank 0's value")
    kv.push("w", mx.nd.ones(3) * r)
    kv.pull("w", out=out)
    close(out, np.full(3, n * (n - 1) / 2), "push sums without an optimizer")
    kv.init("softmax", mx.nd.zeros(2), param_only=True)
    for op, want in ((hvd.PerseusOp.Max, [n - 1, 0]), (hvd.PerseusOp.Min, [0, -(n - 1)])):
        kv.push("softmax", mx.nd.array([r, -r]), op=op)
        kv.pull("softmax", out=out[:2])
        close(out[:2], want, f"push with {op}")
    # With an optimizer, weight keys are updated; param_only keys are only reduced.
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    kv.pushpull("w", mx.nd.ones(3), out=out)
    close(out, np.full(3, n * (n - 1) / 2 - 0.5 * n), "a weight key is updated")
    kv.push("softmax", mx.nd.array([r, r]), op=hvd.PerseusOp.Max)
    kv.pull("softmax", out=out[:2])
    close(out[:2], [n - 1, n - 1], "a param_only key is not updated")
    summed = mx.nd.ones(2) * r
    kv.pushpull("softmax", summed)
    close(summed, np.full(2, n * (n - 1) / 2), "pushpull without out writes the value")
    kv.init(["a", "b"], [mx.nd.ones(1) * r, mx.nd.ones(1) * (r + 1)], param_only=True)
    outs = [mx.nd.zeros(1), mx.nd.zeros(1)]
    kv.pull(["a", "b"], out=outs)
    close(outs[1], [1.0], "lists of keys")
    kv._barrier()
    with raises(KeyError, "not initialized", what="push of an unknown key"):
        kv.push("nope", mx.nd.ones(1))
    with raises(ValueError, "dist_sync_perseus", what="another kvstore name"):
        hvd.create("device")
    assert kv.is_capable(mx.kvstore.KVStoreBase.OPTIMIZER)
    assert "dist" in kv.type and "_sync" in kv.type


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x, y = regression_batch(n, ROWS)
    want = train_gluon(lambda p: mx.gluon.Trainer(p, "sgd", OPT, kvstore=None), x, y, ROWS * n)
    gluon_training(r, n, x, y, want)
    module_training(r, n, x, y, want)
    kvstore_ops(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

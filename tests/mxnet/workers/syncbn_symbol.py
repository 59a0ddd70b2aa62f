"""``mx.sym.contrib.PerseusSyncBatchNorm`` in a bound symbol graph against an ordinary gluon
BatchNorm on the concatenated batch of every rank (each rank has its own data and batch
size): outputs, gradients of data, gamma and beta, the auxiliary moving statistics over
two steps, ``output_mean_var``, ``fix_gamma`` (MXNet's default: gamma is 1 and gets no
gradient), both scopes (one host), inference, and a bad ``comm_scope``."""

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises

CHANNELS, EPS, MOMENTUM = 3, 1e-5, 0.9


def reference(bn, xs, ws, r):
    """One training step of ``bn`` on the concatenated batch: this rank's rows of the
    output and of the input's gradient, the batch mean and variance, and the gradients
    this rank's rows alone give gamma and beta."""
    rows = slice(sum(len(x) for x in xs[:r]), sum(len(x) for x in xs[:r + 1]))
    x, w = mx.nd.array(np.concatenate(xs)), mx.nd.array(np.concatenate(ws))
    x.attach_grad()
    with mx.autograd.record():
        y = bn(x)
        loss = (y * w).sum()
    loss.backward()
    xn = x.asnumpy().astype(np.float64)
    mean, var = xn.mean(axis=(0, 2)), xn.var(axis=(0, 2))
    x_hat = (xn - mean.reshape(1, -1, 1)) / np.sqrt(var.reshape(1, -1, 1) + EPS)
    wn = w.asnumpy()
    return (y[rows], x.grad[rows], mean, var, (wn * x_hat)[rows].sum(axis=(0, 2)),
            wn[rows].sum(axis=(0, 2)))


def check(fix_gamma, scope, r):
    shape = (r + 2, CHANNELS, 4)
    data = mx.sym.var("data")
    sym = mx.sym.contrib.PerseusSyncBatchNorm(data, eps=EPS, momentum=MOMENTUM,
                                              fix_gamma=fix_gamma, output_mean_var=True,
                                              comm_scope=scope, name="sbn")
    assert sym.list_arguments() == ["data", "sbn_gamma", "sbn_beta"], sym.list_arguments()
    assert sym.list_auxiliary_states() == ["sbn_moving_mean", "sbn_moving_var"], \
        sym.list_auxiliary_states()
    exe = sym.simple_bind(mx.cpu(), data=shape, grad_req="write")
    rng = np.random.RandomState(3)
    gamma, beta = rng.rand(CHANNELS) + 0.5, rng.rand(CHANNELS) - 0.5
    exe.arg_dict["sbn_gamma"][:] = gamma
    exe.arg_dict["sbn_beta"][:] = beta
    exe.aux_dict["sbn_moving_mean"][:] = 0
    exe.aux_dict["sbn_moving_var"][:] = 1
    ref = mx.gluon.nn.BatchNorm(momentum=MOMENTUM, epsilon=EPS, in_channels=CHANNELS,
                                scale=not fix_gamma)
    ref.initialize()
    ref.gamma.set_data(mx.nd.array(np.ones(CHANNELS) if fix_gamma else gamma))
    ref.beta.set_data(mx.nd.array(beta))
    for step in range(2):
        rng = np.random.RandomState(10 * step + r)
        x_np = (rng.randn(*shape) * (r + 1) + r).astype(np.float32)
        w_np = rng.randn(*shape).astype(np.float32)
        exe.arg_dict["data"][:] = x_np
        out, mean, var = exe.forward(is_train=True)
        exe.backward(out_grads=[mx.nd.array(w_np), mx.nd.zeros(CHANNELS),
                                mx.nd.zeros(CHANNELS)])
        y_ref, g_ref, mean_ref, var_ref, dgamma, dbeta = reference(
            ref, hvd.allgather_object(x_np), hvd.allgather_object(w_np), r)
        what = f"symbol, fix_gamma={fix_gamma}, comm_scope={scope}, step {step}, rank {r}"
        close(out, y_ref, f"{what}: output", 1e-4, 1e-4)
        close(mean, mean_ref, f"{what}: output mean", 1e-5, 1e-5)
        close(var, var_ref, f"{what}: output var", 1e-4, 1e-5)
        close(exe.grad_dict["data"], g_ref, f"{what}: data gradient", 1e-3, 1e-4)
        close(exe.grad_dict["sbn_gamma"], np.zeros(CHANNELS) if fix_gamma else dgamma,
              f"{what}: gamma gradient", 1e-3, 1e-4)
        close(exe.grad_dict["sbn_beta"], dbeta, f"{what}: beta gradient", 1e-4, 1e-4)
        close(exe.aux_dict["sbn_moving_mean"], ref.running_mean.data(),
              f"{what}: moving mean", 1e-4, 1e-5)
        close(exe.aux_dict["sbn_moving_var"], ref.running_var.data(),
              f"{what}: moving var", 1e-4, 1e-5)
    # Inference (is_train=False): the moving statistics normalize this rank's data alone.
    x_np = np.random.RandomState(50 + r).randn(*shape).astype(np.float32)
    exe.arg_dict["data"][:] = x_np
    close(exe.forward(is_train=False)[0], ref(mx.nd.array(x_np)),
          f"symbol, fix_gamma={fix_gamma}, rank {r}: inference", 1e-4, 1e-4)


def main():
    hvd.init()
    r = hvd.rank()
    check(False, 1, r)
    # One host: comm_scope=0 is every rank too; its process set is looked up in MXNet's
    # custom-operator thread here (no gluon layer ran before).
    check(True, 0, r)
    with raises(ValueError, "comm_scope", what="a bad comm_scope"):
        mx.sym.contrib.PerseusSyncBatchNorm(mx.sym.var("data"), comm_scope=2)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

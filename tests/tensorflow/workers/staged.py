"""Tensors on a device other than host memory cross through the host (bridge.through_host).

This machine has no GPU, so the CPU is split into two logical devices and the bridge is
told that /cpu:1 is the device. Everything runs under ``tf.device("/cpu:1")``, so that
ops go there by default, as they go to the GPU on a GPU machine: inputs are copied to
/cpu:0, the collective runs there, and results come back to /cpu:1. Every
collective's values must be those of the plain path, on every rank, and the results must
be on the inputs' device."""

import _tfhelpers  # noqa: F401 - quiets TensorFlow's logging first
import numpy as np
import tensorflow as tf

cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import perseus.tensorflow.horovod as hvd
from _tfhelpers import close, done, raises
from perseus.tensorflow.horovod import bridge

DEVICE = "CPU:1"
seen = []


def device_of(t):
    """The stand-in for a GPU test: /cpu:1 is "the device"."""
    device = getattr(t, "device", "") or ""
    if device.upper().endswith(DEVICE):
        seen.append(device)
        return device
    return None


bridge._gpu_device = device_of


def on_device(value, dtype=tf.float32):
    with tf.device("/cpu:1"):
        return tf.identity(tf.cast(tf.constant(value), dtype))


def check_device(t, what):
    assert t.device.upper().endswith(DEVICE), f"{what}: result on {t.device}, not /cpu:1"


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    base = np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])

    x = on_device(base * (r + 1))
    check_device(x, "input")
    out = hvd.allreduce(x, op=hvd.Sum)
    close(out, base * n * (n + 1) / 2, "allreduce sum")
    check_device(out, "allreduce")
    assert seen, "the input on /cpu:1 was not taken through the host"

    outs = hvd.grouped_allreduce([x, on_device([r + 1.0], tf.float64)])
    close(outs[0], base * (n + 1) / 2, "grouped average 0")
    close(outs[1], [(n + 1) / 2], "grouped average 1")
    assert outs[1].dtype == tf.float64
    for o in outs:
        check_device(o, "grouped allreduce")

    gathered = hvd.allgather(on_device([[float(r), 1.0]]))
    close(gathered, [[[float(i), 1.0]] for i in range(n)], "allgather (stacked)")
    check_device(gathered, "allgather")

    b = hvd.broadcast(on_device([float(r), 7.0]), root_rank=n - 1)
    close(b, [float(n - 1), 7.0], "broadcast")
    check_device(b, "broadcast")

    got = hvd.alltoall(on_device(np.full([2 * n], float(r))))
    close(got, np.repeat(np.arange(n), 2), "alltoall")
    check_device(got, "alltoall")
    got, received = hvd.alltoall(on_device(np.full([2 * n], float(r))), splits=[2] * n)
    close(got, np.repeat(np.arange(n), 2), "alltoall with splits")
    close(received, np.full(n, 2), "alltoall splits")
    check_device(got, "alltoall with splits")

    rs = hvd.reducescatter(on_device(np.full([2 * n, 2], float(r + 1))), op=hvd.Sum)
    close(rs, np.full((2, 2), n * (n + 1) / 2), "reducescatter")
    check_device(rs, "reducescatter")

    # Inside tf.function: a py_function body placed on the device sees device tensors.
    f = tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum))
    close(f(x), base * n * (n + 1) / 2, "allreduce in tf.function")

    # A training step: the tape's gradients are on the device, reduced through the host.
    with tf.device("/cpu:1"):
        w = tf.Variable([1.0, 2.0])
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(w * on_device([r + 1.0, 2.0 * (r + 1)]))
    g = tape.gradient(loss, [w])[0]
    close(g, [(n + 1) / 2, (n + 1)], "averaged gradient")
    check_device(g, "gradient")

    # The core itself never takes a device tensor: the bridge says why, naming it.
    with raises(ValueError, "reached the core", what="export of a device tensor"):
        bridge.export(x)
    done(r)


if __name__ == "__main__":
    with tf.device("/cpu:1"):
        main()

"""Assertions shared by the TensorFlow worker scripts (a failure exits non-zero): the torch
workers' helpers, which import no framework until asked.

``from _tfhelpers import keras, KERAS3``: the Keras that ``tf.keras`` is (Keras 3, or
tf_keras under ``TF_USE_LEGACY_KERAS=1``), as perseus.tensorflow.keras_module chooses it
for Perseus; the Keras workers use it, so that the same worker tests either."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import close_array as close  # re-exported too
from _helpers import done, raises, regression_batch  # noqa: F401 - re-exported


def __getattr__(name):
    # Imported when asked for: the workers that use no Keras do not load it.
    if name in ("keras", "KERAS3"):
        from perseus.tensorflow import keras_module

        return getattr(keras_module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vname(v):
    """A variable's path (Keras 3) or name (tf.Variable, Keras 2), for messages."""
    return getattr(v, "path", None) or v.name


def to_float(value):
    """A learning rate, loss scale or momentum (a Keras or TensorFlow variable) as a
    float."""
    import numpy as np

    return float(np.asarray(value.numpy() if hasattr(value, "numpy") else value))


def check_local_update(model, local, shared, before, own, everyone, n, lr, what):
    """After one SGD step of ``model``: ``local``'s weights moved by this rank's own
    gradient (``own``) divided by ``n``, the others by the average over the ranks
    (``everyone``); local kernels differ between ranks, shared ones do not."""
    import numpy as np
    import perseus.tensorflow.horovod as hvd

    local_ids = {id(v) for v in local.trainable_weights}
    for i, v in enumerate(model.trainable_variables):
        g = own[i] / n if id(v) in local_ids else np.mean([e[i] for e in everyone], axis=0)
        close(v, before[i] - lr * g, f"{what}: {vname(v)}", 1e-5, 1e-6)
    kernels = hvd.allgather_object([local.kernel.numpy(), shared.kernel.numpy()])
    assert not np.allclose(kernels[0][0], kernels[1][0]), f"{what}: local kernels averaged"
    close(kernels[1][1], kernels[0][1], f"{what}: shared kernels alike", 0, 0)

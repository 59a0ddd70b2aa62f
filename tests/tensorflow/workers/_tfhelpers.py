"""Assertions shared by the TensorFlow worker scripts (a failure exits non-zero): the torch
workers' helpers, which import no framework until asked."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import close_array as close  # re-exported too
from _helpers import done, raises, regression_batch  # noqa: F401 - re-exported


def check_local_update(model, local, shared, before, own, everyone, n, lr, what):
    """After one SGD step of ``model``: ``local``'s weights moved by this rank's own
    gradient (``own``) divided by ``n``, the others by the average over the ranks
    (``everyone``); local kernels differ between ranks, shared ones do not."""
    import numpy as np
    import perseus.tensorflow.horovod as hvd

    local_ids = {id(v) for v in local.trainable_weights}
    for i, v in enumerate(model.trainable_variables):
        g = own[i] / n if id(v) in local_ids else np.mean([e[i] for e in everyone], axis=0)
        close(v, before[i] - lr * g, f"{what}: {v.path}", 1e-5, 1e-6)
    kernels = hvd.allgather_object([local.kernel.numpy(), shared.kernel.numpy()])
    assert not np.allclose(kernels[0][0], kernels[1][0]), f"{what}: local kernels averaged"
    close(kernels[1][1], kernels[0][1], f"{what}: shared kernels alike", 0, 0)

"""Assertions shared by the TensorFlow worker scripts (a failure exits non-zero)."""

import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# raises() and done() are the torch workers' own (that module imports torch lazily).
sys.path.append(str(Path(__file__).parents[2] / "python" / "workers"))
from _helpers import done, raises  # noqa: F401 - re-exported


def close(actual, expected, what, rtol=1e-6, atol=1e-6):
    """Assert values (tensors or arrays) are equal within tolerance, shapes included."""
    a = np.asarray(actual.numpy() if hasattr(actual, "numpy") else actual)
    e = np.asarray(expected.numpy() if hasattr(expected, "numpy") else expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}\n{a}\n{e}")
    np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol,
                               atol=atol, err_msg=what)

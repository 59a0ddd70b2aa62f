"""Assertions shared by the worker scripts (each worker exits non-zero on failure).

``raises`` and ``done`` serve the TensorFlow workers too, so torch is imported only by
the torch helpers."""

import contextlib
import sys

OK_MARK = "WORKER OK"


def close(actual, expected, what, rtol=None, atol=None):
    """Assert tensors are equal (or close for floats), with dtype and shape."""
    import torch

    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=False)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}\nactual={actual}\nexpected={expected}") from None


def tol(dtype):
    """(rtol, atol) suited to a dtype's precision."""
    import torch

    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 2e-2
    if dtype == torch.float32:
        return 1e-5, 1e-5
    if dtype == torch.float64:
        return 1e-10, 1e-10
    return 0, 0


@contextlib.contextmanager
def raises(exc_type, *fragments, what=""):
    """Assert the block raises ``exc_type`` whose message contains every fragment."""
    try:
        yield
    except exc_type as e:
        msg = str(e)
        for f in fragments:
            assert f in msg, f"{what}: expected {f!r} in the error message, got: {msg}"
    else:
        raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing was raised")


def done(rank):
    """Report success (the test counts these marks)."""
    print(f"{OK_MARK} rank {rank}", flush=True)
    sys.stdout.flush()

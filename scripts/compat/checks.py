"""What every compatibility job checks, in NumPy: the inputs and the expected results of
each collective on rank ``rank`` of ``n``, the training data, and the comparison (the
framework's tensors arrive as anything ``numpy.asarray`` takes, or with ``.numpy()`` or
``.asnumpy()``)."""

import os

import numpy as np

ROWS, STEPS = 4, 4  # rows per rank, training steps

# Horovod's allgather: tensors of different first dimensions are concatenated (before
# the front-end is imported).
os.environ["PERSEUS_CHANGE_HVD_ALLGATHER"] = "1"


def same(actual, expected, what, tol=1e-5):
    """Assert equal shape and dtype, and values within ``tol``."""
    for method in ("numpy", "asnumpy"):
        if hasattr(actual, method):
            actual = getattr(actual, method)()
            break
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: got {actual.dtype} {actual.shape}, expected "
                             f"{expected.dtype} {expected.shape}")
    if not np.allclose(actual, expected, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: got {actual}, expected {expected}")


class Collectives:
    """Inputs and expected outputs of rank ``rank`` of ``n``."""

    def __init__(self, rank, n):
        base = np.arange(6, dtype=np.float32)
        self.reduce_in = base + rank
        self.reduce_sum = sum(base + r for r in range(n))
        self.reduce_average = self.reduce_sum / n
        self.int_in = np.array([rank], np.int64)
        self.int_sum = np.array([n * (n - 1) // 2], np.int64)
        # allgather: rank r gives r + 1 rows of r
        self.gather_in = np.full((rank + 1, 2), rank, np.float32)
        self.gathered = np.concatenate([np.full((r + 1, 2), r, np.float32) for r in range(n)])
        # broadcast from the last rank
        self.root = n - 1
        self.broadcast_in = np.full(3, rank, np.float32)
        self.broadcast_out = np.full(3, n - 1, np.float32)
        # alltoall: rank r sends r + 1 values of 10 r + d to each rank d
        self.alltoall_splits = [rank + 1] * n
        self.alltoall_in = np.concatenate([np.full(rank + 1, 10.0 * rank + d, np.float32)
                                           for d in range(n)])
        self.alltoall_out = np.concatenate([np.full(r + 1, 10.0 * r + rank, np.float32)
                                            for r in range(n)])
        self.alltoall_received_splits = np.array([r + 1 for r in range(n)], np.int32)
        # reducescatter: 2 rows each of the sum
        grid = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
        self.scatter_in = grid * (rank + 1)
        self.scattered = (grid * sum(r + 1 for r in range(n)))[2 * rank:2 * rank + 2]


def data(n):
    """The whole batch of ``n`` ranks (ROWS each): inputs of 3 features, and targets."""
    rng = np.random.RandomState(11)
    x = rng.randn(ROWS * n, 3).astype(np.float32)
    return x, np.cos(x.sum(axis=1, keepdims=True))


def rows(rank):
    """This rank's rows of the batch."""
    return slice(rank * ROWS, (rank + 1) * ROWS)


def weights(seed):
    """The 3-8-1 network's weights (kernels in, out), the same for every framework."""
    rng = np.random.RandomState(seed)
    return [rng.randn(3, 8).astype(np.float32) * 0.5, np.zeros(8, np.float32),
            rng.randn(8, 1).astype(np.float32) * 0.5, np.zeros(1, np.float32)]

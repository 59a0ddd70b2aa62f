"""PerseusSyncBatchNorm as a HybridBlock and a symbol on 2 ranks with different data and
batch sizes, against ordinary BatchNorm on the concatenated batch (workers/syncbn_*.py)."""

import pytest


@pytest.mark.parametrize("mode", ["imperative", "hybridized", "sequential"])
def test_gluon_sync_batch_norm(run_framework, mode):
    """Outputs, input and parameter gradients and running statistics over two steps, then
    inference: as a Block, after hybridize(), and as mx.gluon.contrib.nn's after a Conv2D
    in a hybridized HybridSequential."""
    run_framework(2, "syncbn_gluon.py", mode)


def test_symbol_sync_batch_norm(run_framework):
    """mx.sym.contrib.PerseusSyncBatchNorm bound in an executor: outputs, mean and var,
    gradients, moving statistics over two steps, fix_gamma, inference, a bad comm_scope."""
    run_framework(2, "syncbn_symbol.py")

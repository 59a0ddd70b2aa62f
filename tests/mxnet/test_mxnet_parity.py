"""perseus.mxnet where it meets Horovod 0.28's MXNet front-end and seed 003's KVStore:
alltoall's argument errors, scalar reducescatters, the KVStore by name and seed 003's
push(key, value, op), and a sweep of every dtype through every collective (workers/)."""

import pytest


def test_alltoall_argument_errors_are_mxnet_errors(run_framework):
    """Splits not summing to dim 0, of the wrong length, negative or not integers (a list,
    a float NDArray, a float numpy array), dim 0 not divisible without splits and a scalar
    raise hvd.MXNetValueError: caught as mxnet.base.MXNetError (Horovod) and as
    ValueError; integer splits of every kind work afterwards."""
    run_framework(2, "horovod_parity.py", "alltoall_errors")


def test_reducescatter_refuses_scalars(run_framework):
    """reducescatter / grouped_reducescatter of a scalar: Horovod's ValueError, with
    nothing of the group submitted (the next reducescatters pair up)."""
    run_framework(2, "horovod_parity.py", "scalar_reducescatter")


def test_kvstore_by_name(run_framework):
    """mx.kv.create("dist_sync_perseus") (any case) and "perseuskvstore" make the Perseus
    KVStore; gluon.Trainer(kvstore="dist_sync_perseus") and the Module API by name train
    as one process on the whole batch."""
    run_framework(2, "horovod_parity.py", "kvstore_names")


def test_kvstore_push_takes_the_op_third(run_framework):
    """Seed 003's push(key, value, PerseusOp.Max / Min / Sum) reduces with that op; a plain
    int there stays MXNet's priority; pushpull takes the op too; the op given twice, or
    where pushpull's out goes, raises TypeError without pushing."""
    run_framework(2, "horovod_parity.py", "push_op")


@pytest.mark.parametrize("n", [2, 3])
def test_dtype_sweep(run_framework, n):
    """uint8, int8, int32, int64, float16, float32, float64 and bool through allreduce (Sum,
    Min, Max, Average for floats; in place; scaled; grouped), allgather (stacked, scalars,
    grouped, then concatenated), broadcast (and in place), alltoall (with and without
    splits), reducescatter (even and uneven, grouped): every rank's values against numpy.
    The collectives are not recorded by autograd, as Horovod's MXNet ops."""
    run_framework(n, "dtypes.py")

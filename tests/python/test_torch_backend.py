"""The ``perseus`` backend of torch.distributed (perseus.torch.backend): values of every
collective against a one-process reference on 2 and 3 ranks, point to point, subgroups
and a 2-D DeviceMesh, DDP and FSDP2 training, gloo served by perseus after ``import
perseus``, a mismatch named on every rank, and the group's timeout
(workers/torch_backend.py)."""

import pytest

pytest.importorskip("torch")

SIZES = [2, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", SIZES)
def test_every_collective_equals_one_process(run_workers, n):
    run_workers(n, "torch_backend.py", "collectives", timeout=280)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", SIZES)
def test_point_to_point(run_workers, n):
    run_workers(n, "torch_backend.py", "p2p", timeout=180)


@pytest.mark.timeout(200)
def test_a_2d_device_mesh_reduces_along_each_dimension(run_workers):
    pytest.importorskip("torch.distributed.device_mesh", reason="DeviceMesh: torch 2.2+")
    run_workers(4, "torch_backend.py", "mesh", timeout=180)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ddp", ["1", "0"])
def test_ddp_and_fsdp2_train_as_one_process(run_workers, ddp):
    """PERSEUS_DDP=0: DDP's own reducer reduces through the backend; 1: Perseus's hook."""
    run_workers(2, "torch_backend.py", "training", env={"PERSEUS_DDP": ddp}, timeout=280)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ddp", ["1", "0"])
def test_gloo_is_served_by_perseus_unless_perseus_ddp_is_0(run_workers, ddp):
    """Before torch 2.9 (no c10d Backend in Python) gloo stays gloo, and the worker
    checks that instead."""
    run_workers(2, "torch_backend.py", "gloo", env={"PERSEUS_DDP": ddp}, timeout=180)


@pytest.mark.timeout(200)
def test_mismatches_are_named_on_every_rank_and_timeouts_raise(run_workers):
    run_workers(3, "torch_backend.py", "errors", timeout=180)

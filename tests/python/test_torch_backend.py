"""The ``perseus`` backend of torch.distributed (perseus.torch.backend): values of every
collective against a one-process reference on 2 and 3 ranks, point to point, subgroups
and a 2-D DeviceMesh, DDP and FSDP2 training, gloo served by perseus after ``import
perseus``, torch's functional collectives (compiled too), a mismatch named on every
rank, the group's timeout, and a lost rank named (workers/torch_backend.py)."""

import os
import subprocess
import sys

import pytest
from _launch_helpers import clean_env, free_port

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


@pytest.mark.timeout(120)
def test_a_rank_that_exits_fails_the_others_next_collective_naming_it():
    # Started directly: perseusrun and torchrun would stop the survivors themselves.
    n = 3
    worker = os.path.join(os.path.dirname(__file__), "workers", "torch_backend.py")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=n,
                    LOCAL_WORLD_SIZE=n, PERSEUS_MASTER_PORT=free_port(),
                    GLOO_TIMEOUT_SECONDS=20, OMP_NUM_THREADS=1)
    procs = [subprocess.Popen([sys.executable, worker, "dead"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert procs[n - 1].returncode == 3, outs[n - 1]
    for r in range(n - 1):
        assert procs[r].returncode == 0 and f"WORKER OK rank {r}" in outs[r], outs[r]

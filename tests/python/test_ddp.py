"""``import perseus`` and torch's DistributedDataParallel (perseus.torch.ddp, docs/torch_distributed.md):
DDP's buckets are averaged by Perseus under torchrun, perseusrun and
``torch.multiprocessing.spawn``, the models end as one process on the whole batch
would have them, a user's hook is kept, seed 001's PowerSGD compresses them, the
gradient switches act on them, and a bad value and a lost rank give clear errors. The
checks run in workers/ddp.py, on every rank."""

import os
import subprocess
import sys

import pytest
from _launch_helpers import PKG_ROOT, clean_env, free_port, run

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

PY = sys.executable
WORKER = os.path.join(os.path.dirname(__file__), "workers", "ddp.py")
OK = "WORKER OK"


def torchrun(*check, n=2, **env):
    cmd = [PY, "-W", "ignore::FutureWarning", "-m", "torch.distributed.run",
           "--nproc_per_node", str(n), "--master_port", str(free_port()), WORKER, *check]
    return run(cmd, clean_env(PERSEUS_MASTER_PORT=free_port(), OMP_NUM_THREADS=1, **env),
               timeout=90)


def perseusrun(*check, n=2, **env):
    cmd = [PY, "-m", "perseus.runner.launch", "-np", str(n), PY, WORKER, *check]
    return run(cmd, clean_env(OMP_NUM_THREADS=1, **env), timeout=90)


def assert_ok(rc, out, n):
    assert rc == 0 and out.count(OK) == n, f"exit {rc}, {out.count(OK)} of {n} ranks OK\n{out}"


@pytest.mark.timeout(120)
def test_torchrun_ddp_reduces_through_perseus():
    rc, out = torchrun("train")
    assert_ok(rc, out, 2)
    # rank 0 drew a secret and passed it through torch's store
    assert "unauthenticated" not in out, out


@pytest.mark.timeout(120)
def test_the_ddp_example_trains_through_perseus():
    example = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                           "pytorch_ddp_mnist.py")
    rc, out = run([PY, "-m", "perseus.runner.launch", "-np", "2", PY, example, "--epochs", "1",
                   "--train-size", "1200", "--test-size", "200"],
                  clean_env(OMP_NUM_THREADS=1), timeout=90)
    assert rc == 0 and "size 2, perseus True" in out and "final loss" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ddp", ["1"])
def test_seed_003s_ddp_benchmark_under_torch_distributed_launch(ddp):
    # seed 003, 2.1.2: the DDP benchmark started by torch.distributed.launch (which passes
    # --local-rank); PERSEUS_DDP=0 measures torch's own communication with the same script
    # (the script's reducer line says "torch" then; test_perseus_ddp_0_leaves_ddp_to_torch
    # covers PERSEUS_DDP=0 itself, so CI runs "1" alone)
    example = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                           "pytorch_ddp_benchmark.py")
    cmd = [PY, "-W", "ignore::FutureWarning", "-m", "torch.distributed.launch",
           "--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=localhost",
           f"--master_port={free_port()}", example, "--num-iters", "2",
           "--num-batches-per-iter", "2", "--num-warmup-batches", "1", "--batch-size", "8"]
    rc, out = run(cmd, clean_env(PERSEUS_MASTER_PORT=free_port(), OMP_NUM_THREADS=1,
                                 PERSEUS_DDP=ddp), timeout=100)
    reducer = "Perseus" if ddp == "1" else "torch"
    assert rc == 0 and f"2 processes; gradients reduced by {reducer}" in out, out
    assert "Iter #1:" in out and "Total img/sec on 2 CPU(s)" in out, out


@pytest.mark.timeout(120)
def test_the_ddp_benchmark_alone_trains_without_a_process_group():
    # --single: the baseline of benchmarks/resnet_scaling.py, one process, no DDP
    example = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples",
                           "pytorch_ddp_benchmark.py")
    cmd = [PY, example, "--single", "--threads", "1", "--num-iters", "1",
           "--num-batches-per-iter", "1", "--num-warmup-batches", "1", "--batch-size", "4"]
    rc, out = run(cmd, clean_env(), timeout=100)
    assert rc == 0 and "1 processes; gradients reduced by none (one process alone)" in out, out
    assert "Total img/sec on 1 CPU(s)" in out, out


@pytest.mark.timeout(120)
def test_perseusrun_gives_init_process_group_its_variables():
    # three ranks: the average is not a single addition
    assert_ok(*perseusrun("train", n=3), 3)


@pytest.mark.timeout(120)
def test_a_compiled_ddp_model_reduces_through_perseus():
    # torch.compile splits the graph at DDP's buckets; Perseus's hook still reduces them
    assert_ok(*perseusrun("compiled"), 2)


@pytest.mark.timeout(120)
def test_perseus_ddp_0_leaves_ddp_to_torch():
    assert_ok(*perseusrun("train", PERSEUS_DDP=0), 2)


@pytest.mark.timeout(120)
def test_spawned_ranks_meet_through_torchs_store():
    rc, out = run([PY, WORKER, "spawn", str(free_port())], clean_env(OMP_NUM_THREADS=1),
                  timeout=90)
    assert_ok(rc, out, 2)
    assert "unauthenticated" not in out, out


@pytest.mark.timeout(120)
def test_a_users_hook_is_kept_and_a_late_one_refused():
    assert_ok(*torchrun("user-hook"), 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variable,value,message", [
    ("PERSEUS_DDP", "2", "PERSEUS_DDP must be 0 or 1 (or true/false), got '2'"),
    ("AIAK_MATRIX_APPROXIMATION_RANK", "0",
     "AIAK_MATRIX_APPROXIMATION_RANK must be an integer from 1 to 1024, got '0'"),
    ("AIAK_POWERSGD_COMPRESSION", "on",
     "AIAK_POWERSGD_COMPRESSION must be 0 or 1 (or true/false), got 'on'"),
])
def test_a_bad_value_fails_every_rank_naming_it(variable, value, message):
    rc, out = torchrun("train", **{variable: value})
    assert rc != 0, out
    for rank in (0, 1):
        assert f"[rank{rank}]: ValueError: {message}" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,start", [(2, 1), (3, 0)])
def test_powersgd_of_rank_n_is_exact_on_gradients_of_rank_n(n, start):
    # One row per rank: the averaged weight gradients have rank <= n, so PowerSGD of
    # rank n must give what exact averaging gives; from step 0 it also spans DDP's
    # rebuild of its buckets after the first step.
    assert_ok(*perseusrun("powersgd", "exact", n=n, AIAK_POWERSGD_COMPRESSION=1,
                          AIAK_MATRIX_APPROXIMATION_RANK=n, AIAK_START_COMPRESS_ITER=start), n)


@pytest.mark.timeout(120)
def test_powersgd_of_rank_1_compresses_and_keeps_the_ranks_equal():
    assert_ok(*torchrun("powersgd", "lossy", AIAK_POWERSGD_COMPRESSION=1,
                        AIAK_START_COMPRESS_ITER=2), 2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("compression,env", [
    ("plain", {}),
    ("powersgd", {"AIAK_POWERSGD_COMPRESSION": 1, "AIAK_MATRIX_APPROXIMATION_RANK": 2,
                  "AIAK_START_COMPRESS_ITER": 0}),
])
def test_ddp_on_subgroups_reduces_over_each_groups_ranks(compression, env):
    assert_ok(*perseusrun("subgroups", compression, n=4, **env), 4)


@pytest.mark.timeout(120)
def test_gradient_switches_act_on_ddp():
    """Fusion shapes the buckets, accumulation keeps one call in two local and trains as
    one process on both batches, the perf check names the slow rank, and the NaN check
    fails every rank's backward naming the parameters and the rank (workers/ddp.py)."""
    rc, out = perseusrun("switches", PERSEUS_ACCUMULATE_N_STEPS=2, PERSEUS_ALLREDUCE_FUSION=3,
                         PERSEUS_PERF_CHECK_N_STEPS=2, PERSEUS_ALLREDUCE_NANCHECK=1)
    assert_ok(rc, out, 2)
    reports = [line for line in out.splitlines() if "PERSEUS_PERF_CHECK_N_STEPS:" in line]
    assert reports and all(line.startswith("[1]<stderr>:") for line in reports), out
    assert all("local rank 1) computed" in line for line in reports), reports


@pytest.mark.timeout(120)
def test_downsampling_with_momentum_acts_on_ddps_buckets():
    assert_ok(*perseusrun("downsample", PERSEUS_DOWNSAMPLE_N_ELEMENTS=2,
                          PERSEUS_GRADIENT_MOMENTUM=0.5), 2)


@pytest.mark.timeout(120)
def test_a_rank_that_exits_fails_the_others_backward_naming_it():
    # Started directly: torchrun and perseusrun would stop the survivor themselves.
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=2,
                    LOCAL_WORLD_SIZE=2, PERSEUS_MASTER_PORT=free_port(),
                    GLOO_TIMEOUT_SECONDS=20)
    procs = [subprocess.Popen([PY, WORKER, "peer-exit"], env=dict(env, RANK=str(r),
                              LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert procs[1].returncode == 3, outs[1]
    assert procs[0].returncode == 0 and OK in outs[0], outs[0]
    # the collective's own error, raised by backward (wrapped by torch when the allreduce
    # failed after its hook returned)
    assert "rank 0 error: " in outs[0] and "rank 1 is gone" in outs[0], outs[0]


PATCHED = ("from torch.nn.parallel import DistributedDataParallel as D; "
           "import torch.distributed as dist; "
           "print(D.__init__.__module__, dist.init_process_group.__module__)")


@pytest.mark.parametrize("imports", ["import perseus, torch", "import torch, perseus"])
def test_import_perseus_before_or_after_torch_patches_ddp(imports):
    out = subprocess.run([PY, "-c", f"{imports}; {PATCHED}"], env=clean_env(),
                         capture_output=True, text=True, check=True, cwd=PKG_ROOT)
    assert out.stdout.split() == ["perseus.torch.ddp", "perseus.torch.ddp"], out


def test_import_perseus_alone_imports_no_framework():
    code = ("import sys, perseus; "
            "print(sorted(m for m in ('torch', 'numpy', 'perseus._core') if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], env=clean_env(), capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out


def test_the_old_module_names_are_the_torch_modules_themselves():
    code = ("import perseus.ddp, perseus.powersgd, perseus.aiak, perseus.torch as t, sys; "
            "import perseus.torch.ddp, perseus.torch.powersgd, perseus.torch.aiak; "
            "print(perseus.ddp is t.ddp, perseus.powersgd is t.powersgd, "
            "perseus.aiak is t.aiak, sys.modules['perseus.ddp'] is t.ddp)")
    out = subprocess.run([PY, "-c", code], env=clean_env(), capture_output=True, text=True,
                         check=True, cwd=PKG_ROOT)
    assert out.stdout.split() == ["True"] * 4, out


def test_after_import_perseus_the_old_names_are_attributes_too():
    code = ("import torch, perseus; import perseus.torch as t; "
            "print(perseus.ddp is t.ddp, perseus.powersgd is t.powersgd, perseus.aiak is t.aiak)")
    out = subprocess.run([PY, "-c", code], env=clean_env(), capture_output=True, text=True,
                         check=True, cwd=PKG_ROOT)
    assert out.stdout.split() == ["True"] * 3, out

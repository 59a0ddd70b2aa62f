"""Settings: a bad value fails init() naming it, thread affinity, the variables of seed
001 and the other spellings that read as Perseus's own; and the framework-free facade
before init()."""

import os
import subprocess
import sys

import pytest
from _launch_helpers import clean_env


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variable,value", [
    ("PERSEUS_CHANGE_HVD_ALLGATHER", "7"),
    ("HOROVOD_FUSION_THRESHOLD", "abc"),
    ("HOROVOD_CYCLE_TIME", "-1"),
    ("PERSEUS_ACCUMULATE_N_STEPS", "0"),
    ("PERSEUS_ALLREDUCE_NANCHECK", "yes"),
    ("PERSEUS_ALLREDUCE_FUSION", "129"),
    ("PERSEUS_GLOO_NETWORK_INTERFACE", "no-such-if0"),
    ("PERSEUS_ALLREDUCE_DTYPE", "3"),
    ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "0"),
    ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "1e9"),
    ("PERSEUS_ALLREDUCE_MODE", "2"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "yes"),
    ("PERSEUS_OFFLINE_NEG", "2"),
    ("PERSEUS_ALLREDUCE_STREAMS", "0"),
    ("PERSEUS_ALLREDUCE_STREAMS", "13"),
    ("PERSEUS_NCCL_ENABLE", "2"),
    ("PERSEUS_NCCL_NONBLOCKING", "on"),
    ("PERSEUS_STALL_CHECK_TIME_SECONDS", "-5"),
    ("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", "1e3"),
    ("PERSEUS_DOWNSAMPLE_N_ELEMENTS", "0"),
    ("PERSEUS_GRADIENT_MOMENTUM", "1.5"),
    ("PERSEUS_PERF_CHECK_N_STEPS", "-1"),
    ("AIAK_FP16_COMPRESSION", "2"),
    ("AIAK_HIERARCHICAL_ALLREDUCE", "yes"),
    ("AIAK_FUSED_OPTIMIZER", "2"),
    ("GLOO_TIMEOUT_SECONDS", "0"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "5m"),
    ("PERSEUS_ALLREDUCE_NANHECK", "yes"),
    ("HOROVOD_STALL_CHECK_DISABLE", "yes"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1"),
    ("HOROVOD_NUM_NCCL_STREAMS", "13"),
    ("HOROVOD_AUTOTUNE", "yes"),
    ("HOROVOD_THREAD_AFFINITY", "0"),  # one core for the host's two ranks
    ("HOROVOD_THREAD_AFFINITY", "0,x"),
    ("HOROVOD_THREAD_AFFINITY", "1000,1001"),  # cores no rank here may run on
    ("HOROVOD_LOG_LEVEL", "loud"),
    ("PERSEUS_LOG_LEVEL", "warn"),
    ("HOROVOD_LOG_HIDE_TIME", "yes"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "2"),
    ("HOROVOD_CYCLE_TIME", "1e300"),  # was a PanicException: no Duration holds it
    ("HOROVOD_CYCLE_TIME", "60001"),
])
def test_invalid_env_value_fails_init(run_workers, variable, value):
    run_workers(2, "bad_env.py", variable, env={variable: value}, timeout=60)


@pytest.mark.timeout(90)
def test_thread_affinity_pins_each_ranks_engine_thread_to_its_core(run_workers):
    """Local rank 0 on core 1, local rank 1 on core 0 (the reverse of the usual order);
    the ranks themselves left where they were (PERSEUS_BIND_CORES=0)."""
    run_workers(2, "affinity.py", env={"HOROVOD_THREAD_AFFINITY": "1, 0",
                                       "PERSEUS_BIND_CORES": "0"}, timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bind", [None, "0"])
def test_perseusrun_gives_each_local_rank_its_own_share_of_the_cores(run_workers, bind):
    """Unset under perseusrun: from init on each rank (and the engine thread it starts)
    runs on its own run of the cores; 0: the ranks keep every core they had."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no share to give each of 2 ranks")
    env = {} if bind is None else {"PERSEUS_BIND_CORES": bind}
    run_workers(2, "bind.py", "bound" if bind is None else "free", env=env, timeout=60)


@pytest.mark.timeout(30)
def test_facade_without_init():
    from perseus import common
    from perseus.common import gpu

    assert common.gloo_built() and not common.mpi_built()
    assert common.cuda_built() == gpu.built()
    assert not common.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        common.rank()
    assert common.global_process_set.process_set_id == 0
    assert common.global_process_set.size() is None
    assert common.ops.check_op(common.Adasum) == common.Adasum


EFFECTIVE = ("from perseus.common import basics as c; c.init(); cfg = c.config(); "
             "print(repr((cfg['PERSEUS_ALLREDUCE_DTYPE'], cfg['PERSEUS_ALLREDUCE_MODE'], "
             "cfg['PERSEUS_FUSED_OPTIMIZER'])))")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env,dtype,mode,fused", [
    ({}, "2", "", "0"),
    ({"AIAK_FP16_COMPRESSION": "1"}, "0", "", "0"),
    ({"AIAK_FP16_COMPRESSION": "0"}, "1", "", "0"),
    ({"AIAK_FP16_COMPRESSION": "1", "PERSEUS_ALLREDUCE_DTYPE": "2"}, "2", "", "0"),
    ({"AIAK_HIERARCHICAL_ALLREDUCE": "1"}, "2", "1", "0"),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "2", "0", "0"),
    ({"AIAK_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "2", "0", "0"),
    ({"AIAK_HIERARCHICAL_ALLREDUCE": "0", "PERSEUS_ALLREDUCE_MODE": "1"}, "2", "1", "0"),
    ({"AIAK_FUSED_OPTIMIZER": "1"}, "2", "", "1"),
    ({"AIAK_FUSED_OPTIMIZER": "1", "PERSEUS_FUSED_OPTIMIZER": "0"}, "2", "", "0"),
])
def test_seed_001s_switches_read_as_perseus_own(env, dtype, mode, fused):
    out = subprocess.run([sys.executable, "-c", EFFECTIVE], env=clean_env(**env),
                         capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr((dtype, mode, fused)), (env, out.stdout)


SETTING = ("import sys; from perseus.common import basics as c; c.init(); "
           "print(c.config()[sys.argv[1]])")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,env,value,note", [
    ("GLOO_TIMEOUT_SECONDS", {}, "60", None),
    # seed 004's job sets Horovod's name
    ("GLOO_TIMEOUT_SECONDS", {"HOROVOD_GLOO_TIMEOUT_SECONDS": "300"}, "300", None),
    ("GLOO_TIMEOUT_SECONDS", {"GLOO_TIMEOUT_SECONDS": "20", "HOROVOD_GLOO_TIMEOUT_SECONDS": "300"},
     "20", "GLOO_TIMEOUT_SECONDS=20 takes precedence over HOROVOD_GLOO_TIMEOUT_SECONDS=300"),
    ("PERSEUS_ALLREDUCE_NANCHECK", {}, "0", None),
    # seed 003 spells it NANHECK
    ("PERSEUS_ALLREDUCE_NANCHECK", {"PERSEUS_ALLREDUCE_NANHECK": "1"}, "1", None),
    ("PERSEUS_ALLREDUCE_NANCHECK",
     {"PERSEUS_ALLREDUCE_NANCHECK": "0", "PERSEUS_ALLREDUCE_NANHECK": "1"}, "0",
     "PERSEUS_ALLREDUCE_NANCHECK=0 takes precedence over PERSEUS_ALLREDUCE_NANHECK=1"),
    # Horovod's stall check and NCCL stream variables (horovodrun's flags set them)
    ("PERSEUS_STALL_CHECK_TIME_SECONDS", {"HOROVOD_STALL_CHECK_TIME_SECONDS": "7"}, "7", None),
    ("PERSEUS_STALL_CHECK_TIME_SECONDS", {"HOROVOD_STALL_CHECK_DISABLE": "1"}, "0", None),
    ("PERSEUS_STALL_CHECK_TIME_SECONDS",
     {"HOROVOD_STALL_CHECK_DISABLE": "1", "PERSEUS_STALL_CHECK_TIME_SECONDS": "9"}, "9", None),
    ("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"},
     "30", None),
    ("PERSEUS_ALLREDUCE_MODE",
     {"PERSEUS_ALLREDUCE_MODE": "1", "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "1",
     "PERSEUS_ALLREDUCE_MODE=1 takes precedence over HOROVOD_HIERARCHICAL_ALLREDUCE=0"),
    ("HOROVOD_NUM_NCCL_STREAMS", {}, "1", None),
    ("HOROVOD_NUM_NCCL_STREAMS", {"HOROVOD_NUM_NCCL_STREAMS": "5"}, "5", None),
    ("HOROVOD_NUM_NCCL_STREAMS",
     {"PERSEUS_ALLREDUCE_STREAMS": "2", "HOROVOD_NUM_NCCL_STREAMS": "5"}, "2",
     "PERSEUS_ALLREDUCE_STREAMS=2 takes precedence over HOROVOD_NUM_NCCL_STREAMS=5"),
])
def test_settings_read_their_other_spelling_too(name, env, value, note):
    out = subprocess.run([sys.executable, "-c", SETTING, name], env=clean_env(**env),
                         capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == value, (env, out.stdout)
    assert (note in out.stderr) if note else "takes precedence" not in out.stderr, out.stderr

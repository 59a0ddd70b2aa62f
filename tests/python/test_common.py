"""The framework-free facade: configuration errors at init(), and the variables of
seed 001 that read as Perseus's own."""

import subprocess
import sys
import warnings

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
    """Local rank 0 on core 1, local rank 1 on core 0 (the reverse of the usual order)."""
    run_workers(2, "affinity.py", env={"HOROVOD_THREAD_AFFINITY": "1, 0"}, timeout=60)


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


def test_accelerations_a_front_end_does_not_apply_are_named_once():
    from perseus.common.gradients import warn_unapplied

    env = {"PERSEUS_DGC": "1", "PERSEUS_OVERLAP_BACKWARD_AND_STEP": "0",
           "AIAK_FUSED_OPTIMIZER": "1"}
    with pytest.warns(RuntimeWarning) as seen:
        assert warn_unapplied("the test's trainer", environ=env) == [
            "PERSEUS_DGC", "PERSEUS_FUSED_OPTIMIZER"]
    assert [str(w.message) for w in seen] == [
        ("PERSEUS_DGC=1 (--dgc) acts on torch's hvd.DistributedOptimizer only: the test's "
         "trainer trains without it"),
        ("PERSEUS_FUSED_OPTIMIZER=1 (--fuse-optimizer) acts on torch's "
         "hvd.DistributedOptimizer only: the test's trainer trains without it")]
    assert warn_unapplied("the test's trainer", environ=env) == []  # once per process
    # DDP takes the fused step (import perseus), so only DGC is named there
    with pytest.warns(RuntimeWarning, match="the test's DDP trains without it"):
        assert warn_unapplied("the test's DDP", fused_applies=True,
                              environ=dict(env, PERSEUS_FUSED_OPTIMIZER="1")) == ["PERSEUS_DGC"]
    assert warn_unapplied("a plain job", environ={}) == []


def test_adasum_optimizers_name_the_gradient_switches_they_do_not_apply():
    from perseus.common.gradients import warn_adasum_unapplied

    cfg = {"PERSEUS_ACCUMULATE_N_STEPS": "4", "PERSEUS_ALLREDUCE_NANCHECK": "1",
           "PERSEUS_DOWNSAMPLE_N_ELEMENTS": "1", "PERSEUS_PERF_CHECK_N_STEPS": "0"}
    with pytest.warns(RuntimeWarning) as seen:
        assert warn_adasum_unapplied(cfg=cfg) == ["PERSEUS_ACCUMULATE_N_STEPS",
                                                  "PERSEUS_ALLREDUCE_NANCHECK"]
    assert [str(w.message) for w in seen] == [
        ("PERSEUS_ACCUMULATE_N_STEPS, PERSEUS_ALLREDUCE_NANCHECK act on gradient allreduces: "
         "DistributedOptimizer(op=Adasum) reduces weight changes and trains without them")]
    with pytest.warns(RuntimeWarning, match="DOWNSAMPLE_N_ELEMENTS, PERSEUS_PERF_CHECK"):
        assert warn_adasum_unapplied(cfg={"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2",
                                          "PERSEUS_PERF_CHECK_N_STEPS": "5"}) == [
            "PERSEUS_DOWNSAMPLE_N_ELEMENTS", "PERSEUS_PERF_CHECK_N_STEPS"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_adasum_unapplied(cfg={}) == []


def test_a_rank_copy_is_a_process_under_the_mark_of_another_live_one_of_that_job(
        monkeypatch):
    """rank_copy.copy_of(): only a process that inherited another running process's
    mark, made with the same rank variables, answers for that rank."""
    import os

    from perseus.common import rank_copy

    # Through monkeypatch first, so that the test ends with the variable as it found it
    # (mark() below sets it behind monkeypatch's back).
    monkeypatch.setenv(rank_copy.MARK, "")
    for k in ("PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_MASTER_PORT"):
        monkeypatch.setenv(k, {"PERSEUS_RANK": "1", "PERSEUS_SIZE": "4"}.get(k, "7000"))
    rank_copy.mark([1, 4, 1, 2, 0, 2])
    mark = os.environ[rank_copy.MARK]
    assert mark.startswith(f"{os.getpid()}:1:4:1:2:0:2:"), mark
    assert rank_copy.copy_of() is None  # the rank itself
    parent = os.getppid()  # as a child of the rank sees the mark
    monkeypatch.setenv(rank_copy.MARK, mark.replace(f"{os.getpid()}:", f"{parent}:", 1))
    topology, why = rank_copy.copy_of()
    assert topology == [1, 4, 1, 2, 0, 2]
    assert f"started by rank 1 (pid {parent})" in why and "__name__" in why, why
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7001")  # another job's rank
    assert rank_copy.copy_of() is None
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7000")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv(rank_copy.MARK, mark.replace(f"{os.getpid()}:", f"{dead}:", 1))
    assert rank_copy.copy_of() is None  # a mark left by a rank that has ended
    monkeypatch.setenv(rank_copy.MARK, "1:garbage")
    assert rank_copy.copy_of() is None
    rank_copy.unmark()
    assert rank_copy.MARK not in os.environ
    # A process no launcher started is a job of its own (a script run from a notebook
    # that called hvd.init() alone): it leaves no mark for the processes it starts.
    for k in rank_copy._IDENTITY:
        monkeypatch.delenv(k, raising=False)
    rank_copy.mark([0, 1, 0, 1, 0, 1])
    assert rank_copy.MARK not in os.environ


@pytest.mark.timeout(60)
def test_a_process_that_finds_its_ranks_init_under_way_and_failed_says_so(monkeypatch):
    """A process that finds no mark but a rank's announcement of its init() waits for
    that rank's mark; an announcement with no init() behind it any more (the rank's
    failed) is an error saying so, and another job's announcement is not waited for."""
    from perseus.common import rank_copy

    monkeypatch.setenv("PERSEUS_RANK", "3")
    monkeypatch.setenv("PERSEUS_SIZE", "4")
    monkeypatch.delenv(rank_copy.MARK, raising=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv(rank_copy.PENDING, f"{sleeper.pid}:{rank_copy._identity()}")
        with pytest.raises(RuntimeError, match=rf"started by a rank \(pid {sleeper.pid}\) "
                                               r"whose own hvd.init\(\) was under way; that "
                                               r"init\(\) ended without success"):
            rank_copy.copy_of()
        monkeypatch.setenv(rank_copy.PENDING, f"{sleeper.pid}:0123456789abcdef")
        assert rank_copy.copy_of() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_copy_answers_for_its_rank_as_it_is_now_and_finds_it_without_the_mark(
        monkeypatch, tmp_path):
    """A forkserver keeps the environment it started with: a worker it starts after an
    elastic reset inherits the mark of the old round, and one whose forkserver started
    before the rank's init() inherits none. Both find the rank's file and answer for
    the rank as it is now."""
    import os

    from perseus.common import rank_copy

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the files' folder, for this test only
    monkeypatch.setattr(rank_copy.tempfile, "tempdir", None)
    monkeypatch.setenv(rank_copy.MARK, "")
    for k in ("PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_MASTER_PORT"):
        monkeypatch.setenv(k, {"PERSEUS_RANK": "1", "PERSEUS_SIZE": "4"}.get(k, "7000"))
    probe = ("from perseus.common import rank_copy; c = rank_copy.copy_of(); "
             "print(c and c[0], c and c[1].split(')')[0])")

    def child(env):
        # This process is the rank; a child (as a forkserver's worker, a generation
        # nearer) runs what init() runs first.
        env = {**env, "TMPDIR": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        return out.stdout.strip()

    # A file left by a rank that was killed is removed by the next rank's first mark.
    folder = tmp_path / f"perseus-ranks-{os.getuid()}"
    folder.mkdir(mode=0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (folder / dead).write_text("1:0:2:0:2:0:1:digest")
    monkeypatch.setattr(rank_copy, "_cleanup_registered", False)
    rank_copy.mark([1, 4, 1, 2, 0, 2])  # the first round
    assert sorted(p.name for p in folder.iterdir()) == [str(os.getpid())]
    first_round = clean_env(**{k: os.environ[k] for k in
                               (rank_copy.MARK, "PERSEUS_RANK", "PERSEUS_SIZE",
                                "PERSEUS_MASTER_PORT")})
    me = f"started by rank {{}} (pid {os.getpid()}"
    assert child(first_round) == f"[1, 4, 1, 2, 0, 2] this process was {me.format(1)}"
    # An elastic reset: shutdown(), then init() as rank 2 of 3.
    rank_copy.unmark()
    assert not (tmp_path / f"perseus-ranks-{os.getuid()}" / str(os.getpid())).exists()
    rank_copy.mark([2, 3, 0, 1, 1, 3])
    assert child(first_round) == f"[2, 3, 0, 1, 1, 3] this process was {me.format(2)}"
    # No mark in the environment (the forkserver started before init()).
    no_mark = {k: v for k, v in first_round.items() if k != rank_copy.MARK}
    assert child(no_mark) == f"[2, 3, 0, 1, 1, 3] this process was {me.format(2)}"
    # Not a copy: another job's rank, or a file the rank did not write (a process id
    # reused after a rank was killed before it could remove its file).
    assert child({**no_mark, "PERSEUS_MASTER_PORT": "7001"}) == "None None"
    path = tmp_path / f"perseus-ranks-{os.getuid()}" / str(os.getpid())
    start, rest = path.read_text().split(":", 1)
    path.write_text(f"{int(start) + 1}:{rest}")
    assert child(no_mark) == "None None"
    # Gone at shutdown: a worker with the old mark answers from it; one without, not at all.
    rank_copy.mark([2, 3, 0, 1, 1, 3])
    rank_copy.unmark()
    assert not path.exists()
    assert child(first_round) == f"[1, 4, 1, 2, 0, 2] this process was {me.format(1)}"
    assert child(no_mark) == "None None"

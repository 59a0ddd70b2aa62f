"""perseus.tensorflow.horovod and perseus.tensorflow.keras on 2 and 3 ranks (workers/).

The Keras tests run twice: with the Keras that ``tf.keras`` is in the environment (Keras 3
unless TF_USE_LEGACY_KERAS says otherwise), and with Keras 2 (``tf_keras``, under
TF_USE_LEGACY_KERAS=1), where most of Horovod's Keras users are. The workers use
``tf.keras``'s Keras too (workers/_tfhelpers.py), so the same worker tests either."""

import re

import pytest

TF_KERAS = {"TF_USE_LEGACY_KERAS": "1"}
# Keras tests: once as the environment has it, once under tf_keras (Keras 2).
EITHER_KERAS = pytest.mark.parametrize("keras_env", [{}, TF_KERAS], ids=["keras", "tf_keras"])


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_values_and_gradients(run_framework, n):
    """Every op's values for every dtype and its gradient, eager and in tf.function;
    process sets, join, barrier; then the concatenating allgather after a re-init."""
    run_framework(n, "collectives.py")


def test_lone_tensors_in_the_lane(run_framework):
    """A lone small allreduce, allgather, broadcast and reducescatter run among the callers
    through shared memory (PERSEUS_LANE_BYTES); the patience is long, so that the ranks
    always meet."""
    run_framework(2, "collectives.py", "lane", env={"PERSEUS_LANE_PATIENCE_US": "5000000"})


def test_collectives_between_hosts(run_framework):
    """The same over TCP between two loopback "hosts"."""
    run_framework(2, "collectives.py", hosts="127.0.0.1:1,127.0.0.2:1")


@pytest.mark.parametrize("n, keras_env", [(2, {}), (3, {}), (2, TF_KERAS)],
                         ids=["2-keras", "3-keras", "2-tf_keras"])
def test_training_equals_one_process(run_framework, n, keras_env):
    """Tape, Keras and tf.compat.v1 optimizers (and accumulated passes) give every rank the
    weights of one process trained on the whole batch; under tf_keras both its
    optimizers and its legacy ones, through apply_gradients, minimize and fit."""
    run_framework(n, "training.py", env=keras_env)


@EITHER_KERAS
def test_keras_fit_callbacks_load_model_and_hooks(run_framework, tmp_path, keras_env):
    """fit with the broadcast, metric-average, warmup and schedule callbacks; load_model;
    MonitoredTrainingSession with BroadcastGlobalVariablesHook; tf.keras's Keras is the
    one used (under tf_keras, a Keras 3 optimizer is refused, saying why)."""
    run_framework(2, "keras_fit.py", tmp_path, env=keras_env)
    assert (tmp_path / "model.keras").exists()
    assert any((tmp_path / "ckpt").glob("checkpoint")), "rank 0's checkpoint was not written"


@EITHER_KERAS
def test_keras_callbacks_as_horovod_defines_them(run_framework, keras_env):
    """Each batch's learning rate under LearningRateScheduleCallback (a constant
    multiplier decays exponentially, by epochs or their fractions) and
    LearningRateWarmupCallback (Horovod's per-batch values, the number of ranks read at
    each batch, rank 0 alone reporting the end, initial_lr required); under tf_keras
    the momentum correction of its legacy optimizers;
    BroadcastGlobalVariablesCallback(local_variables=...) leaves those variables alone;
    compile(experimental_run_tf_function=False) as in Horovod's examples."""
    run_framework(2, "keras_callbacks.py", env=keras_env)


def test_errors(run_framework):
    """Use before init, bad dtypes and arguments, and cross-rank mismatches on every rank."""
    run_framework(2, "errors.py")


def test_device_tensors_cross_through_the_host(run_framework):
    """Tensors on a device (a GPU; here a second logical CPU standing in for one) are
    copied to the host, reduced there and copied back: every collective's values, eager,
    in tf.function and through DistributedGradientTape, with results on the device."""
    run_framework(2, "staged.py")


@EITHER_KERAS
def test_switches_apply_to_tf_gradients(run_framework, keras_env):
    """PERSEUS_ALLREDUCE_NANCHECK, DOWNSAMPLE_N_ELEMENTS, ALLREDUCE_DTYPE,
    ACCUMULATE_N_STEPS (a Keras optimizer's) and ALLREDUCE_FUSION on TensorFlow gradient
    reductions."""
    run_framework(2, "switches.py", env=keras_env)


@pytest.mark.parametrize("script, args, expect", [
    ("tensorflow_keras_mnist.py", ["--epochs", "1", "--train-size", "512"], "final loss"),
    ("tensorflow_mnist_session.py", ["--steps", "20"], "final accuracy"),
    ("tensorflow_mnist_estimator.py", ["--steps", "20"], "checkpoints in"),
    ("tensorflow2_synthetic_benchmark.py", ["--num-iters", "1", "--num-batches-per-iter", "2",
                                            "--num-warmup-batches", "1"], "RESULT"),
])
def test_examples_run(run_example, script, args, expect):
    """Each TensorFlow example trains on 2 ranks through the launcher and reports."""
    run_example(script, *args, expect=expect)


def _sizes(out):
    """Each rank's ``sizes [...]`` line: the number of ranks at each step that counted."""
    return {tuple(map(int, re.findall(r"\d+", m))) for m in re.findall(r"sizes \[(.*)\]", out)}


@pytest.mark.parametrize("style, keras_env", [
    ("perseus", {}), ("horovod", {}), ("horovod", {**TF_KERAS, "LEGACY_OPTIMIZER": "1"})],
    ids=["perseus", "horovod", "horovod-tf_keras-legacy"])
def test_elastic_fit_goes_on_without_a_failed_worker(run_framework, style, keras_env):
    """perseusrun --min-np 2 on three "hosts": the worker of the first (rank 0) fails in
    epoch 1; the two others go back to their commit at the end of epoch 0, re-form, and
    end with the model of exactly 12 steps and state.epoch 4 (docs/elastic.md), whether
    fit resumes with initial_epoch=state.epoch or Horovod's epochs=epochs - state.epoch
    (and under tf_keras, with a legacy optimizer)."""
    out = run_framework(3, "elastic.py", hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                        flags=["--min-np", "2"], oks=2,
                        env={"FAIL_ID": "127.0.0.1[0]", "GLOO_TIMEOUT_SECONDS": "30",
                             "STYLE": style, **keras_env})
    assert "worker 127.0.0.1[0] failed with exit code 3" in out, out
    assert "round 1: 2 workers (127.0.0.2[0], 127.0.0.3[0])" in out, out
    assert out.count("of 2: w = -6.0") == 2, out
    assert _sizes(out) == {(3,) * 3 + (2,) * 9}, out


@EITHER_KERAS
def test_elastic_fit_resumes_in_the_middle_of_an_epoch(run_framework, keras_env):
    """Horovod's example's way: fit(epochs=epochs - state.epoch) and a commit after every
    batch. The second host's worker fails before batch 2 of epoch 1; the other goes
    back to the commit after batch 1, runs the one batch left of epoch 1 (not 3), then
    epochs 2 and 3: exactly 12 steps, state.epoch 4."""
    out = run_framework(2, "elastic.py", hosts="127.0.0.1:1,127.0.0.2:1",
                        flags=["--min-np", "1"], oks=1,
                        env={"FAIL_ID": "127.0.0.2[0]", "FAIL_AT": "1,2", "BPC": "1",
                             "STYLE": "horovod", "GLOO_TIMEOUT_SECONDS": "30", **keras_env})
    assert "worker 127.0.0.2[0] fails at epoch 1 batch 2" in out, out
    assert "round 1: 1 workers (127.0.0.1[0])" in out, out
    assert out.count("of 1: w = -6.0") == 1, out
    assert _sizes(out) == {(2,) * 5 + (1,) * 7}, out


def test_elastic_fit_replaces_a_failed_worker_in_the_middle_of_a_count(run_framework):
    """Two workers of three "hosts", committing every 2 batches: the second fails before
    batch 1 of epoch 1, one batch into the count; the third host's worker replaces it.
    The survivor and the new worker count the batches to their next commit from the
    start of the new fit alike (else they commit at different batches and wait on each
    other), and end with the model of exactly 12 steps."""
    out = run_framework(2, "elastic.py", hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                        flags=["--min-np", "2", "--max-np", "2"], oks=2, timeout=120,
                        env={"FAIL_ID": "127.0.0.2[0]", "FAIL_AT": "1,1", "BPC": "2",
                             "STYLE": "horovod", "GLOO_TIMEOUT_SECONDS": "30",
                             "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS": "20"})
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.3[0])" in out, out
    assert out.count("of 2: w = -6.0") == 2, out
    assert _sizes(out) == {(2,) * 12}, out


@EITHER_KERAS
def test_elastic_fit_takes_in_a_new_worker_at_a_commit(run_framework, tmp_path, keras_env):
    """A job of one worker, committing every 2 batches, grows by a discovered host after
    its second step. The next commit interrupts the fit; the new worker takes rank 0's
    state, and both count the batches to their next commit afresh. Rank 0's training
    step, traced by Keras at one rank, still reduces the gradients at two (else the new
    worker waits for it forever): both end with the model of exactly 12 steps."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")
    out = run_framework(1, "elastic.py", oks=2, timeout=120,
                        flags=["--min-np", "1", "--max-np", "2",
                               "--host-discovery-script", f"cat {hosts}"],
                        env={"GROW_FILE": str(hosts), "GROW_AT": "2", "STEP_SLEEP": "0.5",
                             "BPC": "2", "STYLE": "horovod", "GLOO_TIMEOUT_SECONDS": "30",
                             "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS": "30", **keras_env})
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.2[0])" in out, out
    assert out.count("of 2: w = -6.0") == 2, out
    (seen,) = _sizes(out)  # one history on both ranks, the new one's from rank 0's state
    ones = seen.count(1)
    assert ones >= 2 and seen == (1,) * ones + (2,) * (12 - ones), out


def test_elastic_session_goes_on_without_a_failed_worker(run_framework):
    """The same with a tf.compat.v1 session: TensorFlowState(session=...) keeps the
    graph's variables; rank 1's worker fails before step 6, and the two others go back
    to the commit of step 4, variables included."""
    out = run_framework(3, "elastic.py", "session",
                        hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                        flags=["--min-np", "2"], oks=2,
                        env={"FAIL_ID": "127.0.0.2[0]", "GLOO_TIMEOUT_SECONDS": "30"})
    assert "worker 127.0.0.2[0] failed with exit code 3" in out, out
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.3[0])" in out, out
    assert out.count("of 2: w = -6.0") == 2, out


@EITHER_KERAS
def test_horovod_additions(run_framework, keras_env):
    """process_set_included_op, broadcast_object_fn, PartialDistributedGradientTape,
    register_local_var (Keras and tf.compat.v1 optimizers) and SyncBatchNormalization
    (uneven per-rank batches against one process on the whole batch: outputs, moving
    statistics, gradients and one training step)."""
    run_framework(2, "additions.py", env=keras_env)


@EITHER_KERAS
def test_keras_additions(run_framework, tmp_path, keras_env):
    """hvd.keras reducescatter, start/stop_timeline, the capability checks,
    PartialDistributedOptimizer (fit and accumulated passes; under tf_keras its legacy
    optimizers too), training without XLA, loss scaling alike on every rank, and
    BestModelCheckpoint."""
    run_framework(2, "keras_additions.py", tmp_path, env=keras_env)
    # Each rank named its checkpoints after itself: rank 0's alone exist.
    assert sorted(p.name for p in tmp_path.glob("m*.*")) == ["max.0.weights.h5", "min.0.keras"]


def test_local_gradients_scale_by_the_size_when_a_traced_step_runs(monkeypatch):
    """PartialDistributed*'s scaling of local gradients (1 / the set's size) in a traced
    step of an elastic job follows the set's size at each run: Keras keeps its traced
    step across the job's rounds, and the size changes between them."""
    tf = pytest.importorskip("tensorflow")
    from perseus.common import elastic
    from perseus.common.process_sets import ProcessSet
    from perseus.tensorflow.horovod import gradients

    ps = ProcessSet([0, 1])

    class Reducer:  # the reduction of shared gradients is not under test here
        process_set = ps

        def reduce(self, grads, variables):
            return grads

    v = tf.Variable(1.0)
    local = gradients.LocalVariables()
    local.add(v, "test")
    for elastic_job, after_resize in ((False, 0.5), (True, 0.25)):
        monkeypatch.setattr(elastic, "enabled", lambda on=elastic_job: on)
        ps.ranks = [0, 1]

        @tf.function
        def step():
            (g,) = gradients.reduce_except_local(Reducer(), [tf.constant(1.0)], [v], local,
                                                 True)
            return g

        assert float(step()) == 0.5
        ps.ranks = [0, 1, 2, 3]  # a later round of the job, the same traced step
        assert float(step()) == after_resize, elastic_job


# Stacking (0) and concatenating (1) allgathers, each on 3 ranks (uneven first
# dimensions), and concatenation on 2 too.
@pytest.mark.parametrize("n,mode", [(2, "1"), (3, "1"), (3, "0")])
def test_horovod_semantics(run_framework, n, mode):
    """Every dtype Perseus takes (Horovod's and more) through every collective (eager and
    tf.function), each differentiable op's gradient against one process's autograd under
    Horovod's definitions, Horovod's error types, no hang after an error in a batch, and
    a tf.compat.v1 session of many independent collectives (sparse ones too)."""
    run_framework(n, "semantics.py", env={"PERSEUS_CHANGE_HVD_ALLGATHER": mode})


@pytest.mark.parametrize("n", [2, 3])
def test_graphs_with_more_collectives_than_threads(run_framework, n):
    """200 independent collectives of every kind (and gradients) in one session.run of a
    session with one inter-op thread and with two, and in a tf.function: no hang, every
    value right on every rank."""
    run_framework(n, "graph_threads.py")

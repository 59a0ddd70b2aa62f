"""perseus.tensorflow.horovod and perseus.tensorflow.keras on 2 and 3 ranks (workers/)."""

import pytest


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_values_and_gradients(run_framework, n):
    """Every op's values for every dtype and its gradient, eager and in tf.function;
    process sets, join, barrier; then the concatenating allgather after a re-init."""
    run_framework(n, "collectives.py")


def test_collectives_between_hosts(run_framework):
    """The same over TCP between two loopback "hosts"."""
    run_framework(2, "collectives.py", hosts="127.0.0.1:1,127.0.0.2:1")


@pytest.mark.parametrize("n", [2, 3])
def test_training_equals_one_process(run_framework, n):
    """Tape, Keras and tf.compat.v1 optimizers (and accumulated passes) give every rank the
    weights of one process trained on the whole batch."""
    run_framework(n, "training.py")


def test_keras_fit_callbacks_load_model_and_hooks(run_framework, tmp_path):
    """fit with the broadcast, metric-average, warmup and schedule callbacks; load_model;
    MonitoredTrainingSession with BroadcastGlobalVariablesHook."""
    run_framework(2, "keras_fit.py", tmp_path)
    assert (tmp_path / "model.keras").exists()
    assert any((tmp_path / "ckpt").glob("checkpoint")), "rank 0's checkpoint was not written"


def test_errors(run_framework):
    """Use before init, bad dtypes and arguments, and cross-rank mismatches on every rank."""
    run_framework(2, "errors.py")


def test_device_tensors_cross_through_the_host(run_framework):
    """Tensors on a device (a GPU; here a second logical CPU standing in for one) are
    copied to the host, reduced there and copied back: every collective's values, eager,
    in tf.function and through DistributedGradientTape, with results on the device."""
    run_framework(2, "staged.py")


def test_switches_apply_to_tf_gradients(run_framework):
    """PERSEUS_ALLREDUCE_NANCHECK, DOWNSAMPLE_N_ELEMENTS, ALLREDUCE_DTYPE,
    ACCUMULATE_N_STEPS and ALLREDUCE_FUSION on TensorFlow gradient reductions."""
    run_framework(2, "switches.py")


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


def test_elastic_fit_goes_on_without_a_failed_worker(run_framework):
    """perseusrun --min-np 2 on three "hosts": the worker of the first (rank 0) fails in
    epoch 1; the two others go back to their commit at the end of epoch 0, re-form, and
    end with the model of exactly 12 steps (docs/elastic.md)."""
    out = run_framework(3, "elastic.py", hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                        flags=["--min-np", "2"], oks=2,
                        env={"FAIL_ID": "127.0.0.1[0]", "GLOO_TIMEOUT_SECONDS": "30"})
    assert "worker 127.0.0.1[0] failed with exit code 3" in out, out
    assert "round 1: 2 workers (127.0.0.2[0], 127.0.0.3[0])" in out, out
    assert out.count("of 2: w = -6.0") == 2, out


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


def test_horovod_additions(run_framework):
    """process_set_included_op, broadcast_object_fn, PartialDistributedGradientTape,
    register_local_var (Keras and tf.compat.v1 optimizers) and SyncBatchNormalization
    (uneven per-rank batches against one process on the whole batch: outputs, moving
    statistics, gradients and one training step)."""
    run_framework(2, "additions.py")


def test_keras_additions(run_framework, tmp_path):
    """hvd.keras reducescatter, start/stop_timeline, the capability checks,
    PartialDistributedOptimizer (fit and accumulated passes) and BestModelCheckpoint."""
    run_framework(2, "keras_additions.py", tmp_path)
    # Each rank named its checkpoints after itself: rank 0's alone exist.
    assert sorted(p.name for p in tmp_path.glob("m*.*")) == ["max.0.weights.h5", "min.0.keras"]

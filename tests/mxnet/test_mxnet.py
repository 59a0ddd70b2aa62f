"""perseus.mxnet: the Horovod API, the Perseus KVStore and PerseusSyncBatchNorm on 2 and 3
ranks (workers/), in the MXNet virtual environment."""

import pytest


@pytest.mark.parametrize("n", [2, 3])
def test_collectives(run_framework, n):
    """Every op's values for every dtype, in place and not, broadcast_parameters (also
    deferred), process sets, join; then the concatenating allgather after a re-init."""
    run_framework(n, "collectives.py")


@pytest.mark.parametrize("n", [2, 3])
def test_training_equals_one_process(run_framework, n):
    """DistributedTrainer, DistributedOptimizer (Module API) and the KVStore (gluon and
    Module) give every rank the weights of one process on the whole batch; the KVStore's
    push with Max and Min, param_only keys and its errors."""
    run_framework(n, "training.py")


def test_sync_batch_norm_scopes(run_framework):
    """comm_scope=1 (every rank) and comm_scope=0 (ranks 0 and 1 share a host, rank 2 is
    alone) against a reference on the gathered batch: outputs, gradients, running stats."""
    run_framework(3, "sync_batch_norm.py", hosts="127.0.0.1:2,127.0.0.2:1")


def test_device_arrays_cross_through_the_host(run_framework):
    """Arrays off the host (a GPU's; here mx.cpu(1) standing in for one) are copied to
    mx.cpu(), reduced there and copied back: every collective's values, in place and
    not, with results on the arrays' context."""
    run_framework(2, "staged.py")


def test_errors(run_framework):
    """Use before init, bad arrays and arguments, and cross-rank mismatches on every rank."""
    run_framework(2, "errors.py")


@pytest.mark.parametrize("script, expect", [
    ("mxnet_mnist.py", "final accuracy"),
    ("mxnet_kvstore_module.py", "final accuracy"),
])
def test_examples_run(run_example, script, expect):
    """Both MXNet examples train on 2 ranks through the launcher and report."""
    out = run_example(script, "--epochs", "1", expect=expect)
    accuracy = float(out.rsplit(expect, 1)[1].split()[0])
    assert accuracy > 0.5, f"{script} did not learn: accuracy {accuracy}\n{out}"


def test_elastic_training_goes_on_without_a_failed_worker(run_framework):
    """perseusrun --min-np 2 on three "hosts": the second host's worker fails before step
    6; the others restore step 4's commit (weight, momentum, step counts) and end with
    the model of exactly 12 steps (docs/elastic.md)."""
    out = run_framework(3, "elastic.py", "fail", hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                        flags=["--min-np", "2"], oks=2,
                        env={"FAIL_ID": "127.0.0.2[0]", "GLOO_TIMEOUT_SECONDS": "30"})
    assert "worker 127.0.0.2[0] failed with exit code 3" in out, out
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.3[0])" in out, out
    assert out.count("sizes [3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2]") == 2, out


def test_elastic_new_worker_takes_rank_0s_model_and_momentum(run_framework, tmp_path):
    """A host that the discovery script adds after step 4 gets a worker at a commit; it
    ends with the weight and momentum of every step, received from rank 0."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    out = run_framework(2, "elastic.py", "grow", str(hosts), oks=3,
                        flags=["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                               f"cat {hosts}"],
                        env={"STEP_SLEEP": "0.4", "GLOO_TIMEOUT_SECONDS": "30"})
    assert "round 1: 3 workers (127.0.0.1[0], 127.0.0.2[0], 127.0.0.3[0])" in out, out
    assert out.count("WORKER OK") == 3, out

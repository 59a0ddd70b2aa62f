"""perseus.ray and perseus.spark with TensorFlow workers: a Ray cluster of two nodes and a
Spark standalone cluster (a master and two workers), each started on this machine by its
test (skipped where Ray, pyspark or Java is missing)."""

import os
import secrets
import shutil
import sys

import pytest

# Ray reads its authentication settings when imported: the cluster's token is made first.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
os.environ.setdefault("RAY_AUTH_MODE", "token")
pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
TESTS_PYTHON = os.path.join(os.path.dirname(HERE), "python")
PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")
PATH = os.pathsep.join(p for p in (WORKERS, PYTHON, os.environ.get("PYTHONPATH")) if p)
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture
def clusters():
    """tests/python's ``_clusters`` (the Ray cluster and the Spark session), with this
    directory's workers importable here too."""
    sys.path[:0] = [TESTS_PYTHON, WORKERS]
    try:
        import _clusters

        yield _clusters
    finally:
        sys.path.remove(TESTS_PYTHON)
        sys.path.remove(WORKERS)


def check(results):
    """Two ranks' results of ``cluster_tf.allreduce_and_step``, in rank order."""
    assert [r["rank"] for r in results] == [0, 1], results
    base = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    for r in results:
        assert r["size"] == 2, r
        assert r["sum"] == [[v * 3 for v in row] for row in base], r
        assert r["average"] == [[v * 1.5 for v in row] for row in base], r
        # d/dw of sum(w*w)*(rank+1) is 2w(rank+1); averaged over ranks 1 and 2: 3w.
        assert r["grad"] == [3.0, 6.0], r


@pytest.mark.timeout(300)
def test_a_tensorflow_allreduce_on_ray(clusters):
    pytest.importorskip("ray")
    import cluster_tf
    from perseus.ray import RayExecutor

    with clusters.ray_cluster(PATH, QUIET):
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
        executor.start()
        try:
            results = executor.run(cluster_tf.allreduce_and_step)
        finally:
            executor.shutdown()
    check(results)


@pytest.mark.timeout(300)
def test_a_tensorflow_allreduce_on_spark(clusters):
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java (java on PATH or JAVA_HOME)")
    import cluster_tf
    from perseus.spark import run

    with clusters.spark_session(PATH, env_vars=QUIET):
        results = run(cluster_tf.allreduce_and_step, num_proc=2)
    check(results)

"""perseus.spark.run on a Spark standalone cluster (a master and two workers of one core)
this module starts on 127.0.0.1; skipped where pyspark or Java is missing."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("torch")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java (java on PATH or JAVA_HOME)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")


@pytest.fixture(scope="module")
def spark():
    """A SparkSession on a standalone cluster that ``_spark_cluster.py`` keeps: its own
    ports and directories, its JVMs stopped at the end."""
    path = os.pathsep.join(p for p in (WORKERS, PYTHON, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, WORKERS)
    tmp = tempfile.mkdtemp(prefix="perseus-spark-")
    keeper = subprocess.Popen([sys.executable, os.path.join(HERE, "_spark_cluster.py"), tmp],
                              env=dict(os.environ, PYTHONPATH=path), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    session = None
    try:
        line = keeper.stdout.readline()
        assert line.startswith("ready "), line + keeper.stdout.read()
        from pyspark.sql import SparkSession

        session = (SparkSession.builder.master(line.split()[1])
                   .appName("perseus-spark-tests")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.executor.cores", "1")
                   .config("spark.executor.memory", "512m")
                   .config("spark.local.dir", tmp)
                   .config("spark.ui.enabled", "false")
                   # A failed barrier stage is not tried again: the test sees the failure.
                   .config("spark.stage.maxConsecutiveAttempts", "1")
                   .config("spark.task.maxFailures", "1")
                   .config("spark.executorEnv.PYTHONPATH", path)
                   .config("spark.executorEnv.OMP_NUM_THREADS", "1")
                   .config("spark.pyspark.python", sys.executable)
                   .getOrCreate())
        yield session
    finally:
        if session is not None:
            session.stop()
        keeper.stdin.close()
        keeper.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(400)
def test_a_horovod_style_run_trains_and_returns_results_by_rank(spark):
    import cluster_fns
    from perseus.spark import run

    topo = run(cluster_fns.topology, num_proc=2)
    assert [t["rank"] for t in topo] == [0, 1], topo
    assert all(t["size"] == 2 and t["local_size"] == 2 for t in topo), topo
    assert topo[0]["pid"] != topo[1]["pid"], "two ranks in one process"
    results = run(cluster_fns.train, kwargs={"steps": 5}, num_proc=2)
    assert [r for r, _ in results] == [0, 1]
    for rank, diff in results:
        assert diff < 1e-5, f"rank {rank} ended {diff} from one process on the whole batch"
    # Spark reuses its Python workers: a second job in them starts afresh.
    assert [t["rank"] for t in run(cluster_fns.topology, num_proc=2)] == [0, 1]


@pytest.mark.timeout(400)
def test_a_failing_rank_fails_the_run_with_its_traceback(spark):
    import cluster_fns
    from perseus.spark import run

    with pytest.raises(RuntimeError) as e:
        run(cluster_fns.fail_on_rank_1, num_proc=2)
    text = str(e.value)
    # Rank 1's own error and traceback; rank 0's allreduce failed naming rank 1.
    assert "rank 1 raised:" in text and "ValueError: boom from rank 1" in text, text
    assert "fail_on_rank_1" in text, text
    assert "rank 0 raised:" in text and "rank 1" in text.split("rank 0 raised:")[1], text
    # The cluster is usable afterwards.
    assert [t["rank"] for t in run(cluster_fns.topology, num_proc=2)] == [0, 1]


def test_arguments_are_checked():
    from perseus.spark import run, run_elastic

    with pytest.raises(ValueError, match="use_gloo and use_mpi"):
        run(print, use_gloo=True, use_mpi=True)
    with pytest.raises(TypeError, match="function"):
        run(3)
    with pytest.raises(NotImplementedError, match="run_elastic"):
        run_elastic(print)


@pytest.mark.timeout(300)
def test_the_spark_example_runs_as_it_is():
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples",
                           "spark_pytorch_mnist.py")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(p for p in (PYTHON, os.environ.get("PYTHONPATH"))
                                          if p))
    done = subprocess.run([sys.executable, example, "--num-proc", "2", "--epochs", "1"],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = [t for t in done.stdout.splitlines() if t.startswith("final loss")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in line[0].split("[")[1].rstrip("]").split(",")]
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 3, losses

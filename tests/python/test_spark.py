"""perseus.spark.run on a Spark standalone cluster (a master and two workers of one core)
this module starts on 127.0.0.1; skipped where pyspark or Java is missing."""

import os
import shutil
import subprocess
import sys

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
    """A SparkSession on a standalone cluster of a master and two workers on this machine
    (``_clusters.spark_session``)."""
    import _clusters

    sys.path.insert(0, WORKERS)
    path = os.pathsep.join(p for p in (WORKERS, PYTHON, os.environ.get("PYTHONPATH")) if p)
    with _clusters.spark_session(path) as session:
        yield session


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
    with pytest.raises(TypeError, match="function"):
        run_elastic(3)


def test_agents_hold_slots_per_host_and_are_dropped_when_they_stop_beating(monkeypatch):
    import time

    from perseus import _core
    from perseus.spark import elastic

    monkeypatch.setattr(elastic, "SILENCE_SECONDS", 0.5)
    server = _core.RendezvousServer("127.0.0.1:0", "s")
    try:
        agents = elastic.Agents(server)
        for aid, host in (("0.0", "a"), ("1.0", "a"), ("2.0", "b")):
            server.set(f"spark/agent/{aid}", host.encode())
        assert agents.hosts() == {"a": 2, "b": 1}
        assert agents.order("a", 1, {"X": "1"}) == ("1.0", 0)
        assert server.get("spark/run/1.0/0") == b'{"X": "1"}'
        assert agents.order("a", 1, {}) == ("1.0", 1)
        assert agents.order("a", 5, {}) is None
        time.sleep(0.3)
        for aid in ("1.0", "2.0"):
            server.set(f"spark/beat/{aid}", b"1")
        time.sleep(0.3)
        # Agent 0.0 never beat: gone. Slot a[0] has no agent, a[1] still counts.
        assert agents.hosts() == {"a": 2, "b": 1}
        assert not agents.live("0.0") and agents.live("1.0")
        assert agents.order("a", 0, {}) is None
        # A retried task on host a takes the free slot a[0].
        server.set("spark/agent/0.1", b"a")
        assert agents.hosts() == {"a": 2, "b": 1}
        assert agents.order("a", 0, {}) == ("0.1", 0)
        agents.stop_all()
        assert server.get("spark/run/1.0/2") == b"stop"
        assert server.get("spark/run/0.1/1") == b"stop"
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_run_elastic_goes_on_from_the_last_commit_when_a_worker_is_killed(spark):
    import cluster_fns
    from perseus.spark import run_elastic

    with pytest.raises(ValueError, match="min_np"):
        run_elastic(print, num_proc=2, min_np=3)
    # The cluster has two task slots. Rank 1 kills its own process at batch 3 of the first
    # round: its slot is blacklisted, and rank 0 goes on alone from its last commit.
    results = run_elastic(cluster_fns.elastic_train, kwargs={"batches": 8, "kill_at": 3},
                          num_proc=2, min_np=1, max_np=2, start_timeout=120,
                          elastic_timeout=60)
    assert len(results) == 1, results
    done, sizes, round_, _ = results[0]
    assert done == list(range(8)), done  # batch 3's uncommitted append was rolled back
    assert sizes == [2] * 3 + [1] * 5, sizes
    assert round_ == 1, round_


@pytest.mark.timeout(300)
def test_run_elastic_stops_naming_spark_when_a_task_is_lost_for_good(spark, tmp_path):
    import time

    import cluster_fns
    from perseus.spark import run, run_elastic

    # Rank 1 kills its Spark task's Python worker. The session allows one failure per
    # task, so Spark aborts the job of the tasks: no slot can come back, and the run
    # stops at once, naming that, instead of waiting out elastic_timeout.
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Spark job of its tasks ended"):
        run_elastic(cluster_fns.elastic_train,
                    kwargs={"batches": 8, "kill_at": 3, "kill_parent": True,
                            "pid_dir": str(tmp_path)},
                    num_proc=2, min_np=1, max_np=2, start_timeout=120, elastic_timeout=120)
    assert time.monotonic() - started < 100
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) >= 2, pids

    def running(pid):
        # A dead worker whose agent died too waits, a zombie, for the cluster's keeper
        # (their subreaper) to reap it at the end: dead is what counts.
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 15
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "a worker outlived its task"
    # Every task of both elastic jobs ended: both slots take the next job.
    assert [t["rank"] for t in run(cluster_fns.topology, num_proc=2)] == [0, 1]


@pytest.mark.timeout(300)
def test_the_spark_example_runs_as_it_is():
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples",
                           "spark_pytorch_mnist.py")
    from _spark_cluster import JVM_OPTIONS

    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, JAVA_TOOL_OPTIONS=JVM_OPTIONS,
               PYTHONPATH=os.pathsep.join(p for p in (PYTHON, os.environ.get("PYTHONPATH"))
                                          if p))
    done = subprocess.run([sys.executable, example, "--num-proc", "2", "--epochs", "1"],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = [t for t in done.stdout.splitlines() if t.startswith("final loss")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in line[0].split("[")[1].rstrip("]").split(",")]
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 3, losses

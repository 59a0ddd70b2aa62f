"""perseus.ray.RayExecutor on a Ray cluster of two nodes this module starts on this
machine (skipped where Ray is not installed)."""

import os
import secrets
import subprocess
import sys
import time

import pytest

# Ray reads its authentication settings when imported: the cluster's token is made first.
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
os.environ.setdefault("RAY_AUTH_MODE", "token")
ray = pytest.importorskip("ray")
pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
PYTHON = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster on this machine of a head and one worker node, each a ``ray start`` of
    its own, on free ports and with this module's token (``_clusters.ray_cluster``)."""
    import _clusters

    sys.path.insert(0, WORKERS)
    path = os.pathsep.join(p for p in (WORKERS, PYTHON, os.environ.get("PYTHONPATH")) if p)
    with _clusters.ray_cluster(path) as add_node:
        yield add_node


@pytest.mark.timeout(300)
def test_a_horovod_style_program_trains_and_returns_results_by_rank(cluster):
    import cluster_fns
    from perseus.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, use_gpu=False)
    executor.start()
    try:
        topo = executor.run(cluster_fns.topology)
        assert [t["rank"] for t in topo] == [0, 1], topo
        assert all(t["size"] == 2 and t["local_size"] == 2 for t in topo), topo
        assert sorted(t["local_rank"] for t in topo) == [0, 1], topo
        assert topo[0]["pid"] != topo[1]["pid"]
        results = executor.run(cluster_fns.train, kwargs={"steps": 5})
        assert [r for r, _ in results] == [0, 1]
        for rank, diff in results:
            assert diff < 1e-5, f"rank {rank} ended {diff} from one process on the whole batch"
        refs = executor.run_remote(cluster_fns.topology)
        assert [t["rank"] for t in ray.get(refs)] == [0, 1]
        got = []
        assert executor.run(cluster_fns.log_steps, callbacks=[got.append]) == [0, 1]
        assert got == [{"step": i, "rank": 0} for i in range(3)], got
    finally:
        executor.shutdown()


@pytest.mark.timeout(300)
def test_executables_keep_state_and_execute_single_runs_on_rank_0(cluster):
    import cluster_fns
    from perseus.ray import RayExecutor

    # One worker on each of the two Ray nodes (a placement group spread over them).
    executor = RayExecutor(RayExecutor.create_settings(), num_hosts=2, num_workers_per_host=1)
    executor.start(executable_cls=cluster_fns.Counter, executable_args=[10])
    try:
        assert [t["rank"] for t in executor.run(cluster_fns.topology)] == [0, 1]
        assert executor.execute(lambda c: c.bump()) == [11, 11]
        assert executor.execute_single(lambda c: c.bump()) == 12
        assert executor.execute(lambda c: c.value) == [12, 11]
    finally:
        executor.shutdown()


@pytest.mark.timeout(300)
def test_a_failing_worker_raises_its_traceback_and_stops_the_others(cluster):
    import cluster_fns
    from perseus.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    executor.start()
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        executor.run(cluster_fns.fail_on_rank_1)
    text = str(e.value)
    assert "boom from rank 1" in text and "fail_on_rank_1" in text, text
    assert isinstance(e.value, ValueError) or "ValueError" in text
    assert executor.workers == [], "the actors were not stopped"
    with pytest.raises(RuntimeError, match="start"):
        executor.run(cluster_fns.topology)


def test_bad_arguments_are_named():
    from perseus.ray import RayExecutor

    with pytest.raises(ValueError, match="num_workers or num_hosts"):
        RayExecutor(RayExecutor.create_settings())
    with pytest.raises(ValueError, match="cpus_per_worker"):
        RayExecutor(num_workers=2, cpus_per_worker=0)
    with pytest.raises(ValueError, match="not both"):
        RayExecutor(num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers needs a positive min_workers"):
        RayExecutor(max_workers=2)
    with pytest.raises(ValueError, match="below min_workers"):
        RayExecutor(min_workers=3, max_workers=2)
    elastic = RayExecutor(min_workers=1, max_workers=2)
    elastic._started = True  # what start() records; no Ray needed for the refusals
    with pytest.raises(NotImplementedError, match="run_remote"):
        elastic.run_remote(print)
    with pytest.raises(NotImplementedError, match="execute_single"):
        elastic.execute_single(print)


def test_ray_discovery_counts_slots_of_live_nodes_by_address():
    from perseus.ray.elastic import RayHostDiscovery

    class FakeRay:
        @staticmethod
        def nodes():
            return [
                {"Alive": True, "NodeManagerAddress": "10.0.0.1",
                 "Resources": {"CPU": 8.0, "GPU": 2.0}},
                {"Alive": True, "NodeManagerAddress": "10.0.0.1",
                 "Resources": {"CPU": 3.0}},  # a second node at the same address
                {"Alive": False, "NodeManagerAddress": "10.0.0.2",
                 "Resources": {"CPU": 64.0, "GPU": 8.0}},
                {"Alive": True, "NodeManagerAddress": "10.0.0.3",
                 "Resources": {"CPU": 1.0, "GPU": 4.0}},
            ]

    assert RayHostDiscovery(FakeRay, 2)() == {"10.0.0.1": 5}
    assert RayHostDiscovery(FakeRay, 1)() == {"10.0.0.1": 11, "10.0.0.3": 1}
    assert RayHostDiscovery(FakeRay, 1, 1)() == {"10.0.0.1": 2, "10.0.0.3": 1}


@pytest.mark.timeout(300)
def test_elastic_training_goes_on_from_the_last_commit_when_a_worker_is_killed(cluster):
    import cluster_fns
    from perseus.ray import RayExecutor

    # The cluster offers 4 slots (2 CPUs on each of its nodes, both at 127.0.0.1).
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1,
                           max_workers=2, elastic_timeout=60)
    executor.start()
    logged = []
    results = executor.run(cluster_fns.elastic_train, kwargs={"batches": 8, "kill_at": 3, "log": True},
                           callbacks=[logged.append])
    executor.shutdown()
    # Two workers finished: the first one, and the one started in the killed one's place.
    assert len(results) == 2, results
    for done, sizes, round_, _ in results:
        # Batch 3's uncommitted append was rolled back: every batch exactly once.
        assert done == list(range(8)), done
        assert sizes == [2] * 8, sizes
        assert round_ == 1, round_
    assert results[0][3] == results[1][3], "the ranks' weights differ"
    assert logged == [{"batch": b} for b in range(8)], logged


@pytest.mark.timeout(300)
def test_the_ray_example_runs_as_it_is(cluster):
    example = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples",
                           "ray_pytorch_mnist.py")
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address,
               PYTHONPATH=os.pathsep.join(p for p in (PYTHON, os.environ.get("PYTHONPATH"))
                                          if p))
    done = subprocess.run([sys.executable, example, "--num-workers", "2", "--epochs", "1"],
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [t for t in done.stdout.splitlines() if t.startswith("final loss")]
    assert line, done.stdout + done.stderr
    losses = [float(v) for v in line[0].split("[")[1].rstrip("]").split(",")]
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 3, losses


def test_elastic_ray_executors_arguments_are_horovods():
    from perseus.ray import ElasticRayExecutor

    with pytest.warns(DeprecationWarning, match="is deprecated"):
        settings = ElasticRayExecutor.create_settings(min_np=2, max_np=4, verbose=True)
    assert (settings.min_num_proc, settings.max_num_proc) == (2, 4)
    assert settings.extra == {"verbose": True}
    with pytest.raises(ValueError, match="use_gpu must be True"):
        ElasticRayExecutor(settings, gpus_per_slot=1)
    with pytest.raises(ValueError, match="settings.discovery"):
        ElasticRayExecutor(settings, override_discovery=False)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2, env_vars={"A": 1})
    assert executor._executor.min_workers == 2 and executor._executor.max_workers == 4
    assert executor._executor.cpus_per_worker == 2


@pytest.mark.timeout(300)
def test_a_horovod_style_elastic_ray_executor_program_runs_on_its_discovery(cluster,
                                                                            capfd):
    import cluster_fns
    from perseus.ray import ElasticRayExecutor

    # Horovod's HostDiscovery: two slots at the address of this machine's Ray nodes, and
    # a host with no Ray node, which is named and left out (no start timeout waited).
    address = ray.nodes()[0]["NodeManagerAddress"]

    class Discovery:
        def find_available_hosts_and_slots(self):
            return {"198.51.100.7": 1, address: 2}

    settings = ElasticRayExecutor.create_settings(min_num_proc=1, timeout_s=60)
    settings.discovery = Discovery()
    executor = ElasticRayExecutor(settings, override_discovery=False,
                                  env_vars={"PERSEUS_TEST_MARK": "elastic"})
    executor.start()
    topo = executor.run(cluster_fns.topology)
    assert [t["rank"] for t in topo] == [0, 1], topo
    assert all(t["size"] == 2 and t["mark"] == "elastic" for t in topo), topo
    err = capfd.readouterr().err
    assert err.count("the discovery names host 198.51.100.7, which is no live Ray node") \
        == 1, err


@pytest.mark.timeout(300)
def test_elastic_training_grows_when_ray_adds_a_node(cluster, tmp_path):
    import threading

    import cluster_fns
    from perseus.ray import RayExecutor

    # A worker takes a node's 2 CPUs: 2 slots, then 3 once the test adds a third node
    # during the run (this module's last test: the node stays until the cluster stops).
    marker = tmp_path / "started"

    def add_node_once_started():
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster()

    adder = threading.Thread(target=add_node_once_started, daemon=True)
    adder.start()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1,
                           max_workers=3, cpus_per_worker=2, elastic_timeout=60)
    executor.start()
    try:
        results = executor.run(cluster_fns.elastic_grow, kwargs={"marker": str(marker)})
    finally:
        executor.shutdown()
    adder.join(timeout=10)
    assert len(results) == 3, results
    for done, sizes, round_ in results:
        # The newcomer got rank 0's state: every batch exactly once, on every worker.
        assert done == list(range(len(done))), done
        assert sizes[0] == 2 and sizes[-1] == 3, sizes
        assert sorted(sizes) == sizes and set(sizes) == {2, 3}, sizes
        assert round_ == 1, round_
    assert len({len(done) for done, _, _ in results}) == 1, results

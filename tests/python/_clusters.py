"""The Ray cluster and the Spark session the Ray and Spark tests run on (tests/python with
torch workers, tests/tensorflow with TensorFlow ones): each one a context manager that
starts its engine on this machine through its keeper script and stops exactly what that
started."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from _spark_cluster import JVM_OPTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
#: Seconds a keeper has to answer (its every engine start is bounded by 120 s).
ANSWER_SECONDS = 300


def _worker_env(pythonpath):
    """What every worker's environment gets, on either engine."""
    return {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}


def _answer(keeper):
    """The keeper's next line, or '' when it gave none within ANSWER_SECONDS."""
    line = []
    reader = threading.Thread(target=lambda: line.append(keeper.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(ANSWER_SECONDS)
    return line[0] if line else ""


def _keeper(script, tmp, env):
    """Starts the keeper ``script`` of this directory; returns it and its ``ready`` line's
    argument (or stops it and raises with what it printed)."""
    keeper = subprocess.Popen([sys.executable, os.path.join(HERE, script), tmp], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = _answer(keeper)
    if not line.startswith("ready "):
        _stop(keeper)
        raise RuntimeError(f"{script} did not start within {ANSWER_SECONDS} s: "
                           f"{line}{keeper.stdout.read()}")
    return keeper, line.split()[1]


def _stop(keeper):
    """Closes the keeper's input, on which it stops what it started; kills it if it has
    not ended within a minute."""
    keeper.stdin.close()
    try:
        keeper.wait(timeout=60)
    except subprocess.TimeoutExpired:
        keeper.kill()
        keeper.wait()


@contextlib.contextmanager
def ray_cluster(pythonpath, env_vars=None):
    """A Ray cluster of a head and one worker node (two ``ray start``, on free ports, with
    the caller's ``RAY_AUTH_TOKEN``, set before Ray was imported), and this process
    connected to it; workers see ``pythonpath`` and ``env_vars``. Yields a function that
    adds one more worker node of 2 CPUs and returns once it runs."""
    import ray

    workers = _worker_env(pythonpath)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **workers)
    tmp = tempfile.mkdtemp(prefix="pr-", dir="/tmp")  # Ray's socket paths must stay short
    keeper = None
    try:
        keeper, port = _keeper("_ray_cluster.py", tmp, env)
        ray.init(address=f"127.0.0.1:{port}",
                 runtime_env={"env_vars": dict(env_vars or {}, **workers)})
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2, ray.nodes()

        def add_node():
            keeper.stdin.write("add\n")
            keeper.stdin.flush()
            answer = _answer(keeper)
            assert answer.startswith("added"), answer

        yield add_node
    finally:
        ray.shutdown()
        if keeper is not None:
            _stop(keeper)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def spark_session(pythonpath, standalone=True, env_vars=None):
    """A SparkSession whose tasks see ``pythonpath`` and ``env_vars``: on a standalone
    cluster of a master and two one-core workers that ``_spark_cluster.py`` keeps, or,
    where not ``standalone``, in local mode with two task slots. Its own ports and
    directories; a failed task or barrier stage is not tried again."""
    from pyspark.sql import SparkSession

    workers = _worker_env(pythonpath)
    tmp = tempfile.mkdtemp(prefix="perseus-spark-")
    keeper = session = None
    try:
        master = "local[2]"
        if standalone:
            keeper, master = _keeper("_spark_cluster.py", tmp,
                                     dict(os.environ, PYTHONPATH=pythonpath))
        builder = (SparkSession.builder.master(master)
                   .appName("perseus-spark-tests")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1")
                   .config("spark.executor.cores", "1")
                   .config("spark.executor.memory", "512m")
                   .config("spark.local.dir", tmp)
                   .config("spark.ui.enabled", "false")
                   .config("spark.stage.maxConsecutiveAttempts", "1")
                   .config("spark.task.maxFailures", "1")
                   .config("spark.pyspark.python", sys.executable)
                   .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
                   .config("spark.executor.extraJavaOptions", JVM_OPTIONS))
        for name, value in dict(env_vars or {}, **workers).items():
            builder = builder.config(f"spark.executorEnv.{name}", value)
        session = builder.getOrCreate()
        yield session
    finally:
        if session is not None:
            session.stop()
        if keeper is not None:
            _stop(keeper)
        shutil.rmtree(tmp, ignore_errors=True)

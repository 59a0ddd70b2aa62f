"""perseus.spark.run_elastic: perseusrun's elastic driver with Spark tasks for hosts.

The driver runs a rendezvous store and one Spark job of ``max_np`` tasks. Each task is
an *agent*: it registers its host at the store (``spark/agent/<id>``), beats there every
second, and runs, one after the other, the workers the driver asks of it
(``spark/run/<id>/<n>``: the worker's variables), each a process of its own
(``python -m perseus.spark.worker``) that it stops when asked (``spark/kill/<id>/<n>``)
and whose exit status and result it reports (``spark/exit/...``, ``spark/result/...``).

The driver is :class:`perseus.runner.elastic.ElasticJob`. Its hosts are the agents' hosts,
with one slot per live agent, and launching a worker on a slot asks that slot's agent.
A worker that fails leaves its slot blacklisted, and the others re-form from their last
commit. So does one whose agent stops beating: the Spark task was lost, and with it the
slot. Agents that Spark starts later (a retried task) add slots, which the running
workers take in at their next ``state.commit()``. When the job ends the driver tells
every agent to stop, and the Spark job ends.
"""

import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from perseus.common import knobs
from perseus.runner import elastic as _elastic

#: Seconds between two beats of an agent.
BEAT_SECONDS = 1.0
#: An agent whose beat has not changed for this long is gone (its Spark task was lost).
SILENCE_SECONDS = 10.0
#: Seconds a stopped worker has between SIGTERM and SIGKILL.
GRACE_SECONDS = 5.0
#: The return code given to a worker whose agent was lost.
AGENT_LOST = -signal.SIGKILL
_PREFIX = "spark/agent/"


# ---------------------------------------------------------------------------- agent


def _agent(payload, secret, where, timeout):
    """The body of every Spark task of the job: register, beat, run workers until told
    to stop."""

    def body(index, _rows):
        from pyspark import TaskContext, cloudpickle

        from perseus import _core
        from perseus.common.exceptions import HorovodInternalError
        from perseus.runner.job import _parent_death_signal

        aid = f"{index}.{TaskContext.get().attemptNumber()}"
        addr, port = where
        client = _core.RendezvousClient(addr, port, secret, timeout)
        client.set(f"{_PREFIX}{aid}", socket.gethostname().encode())
        stop = threading.Event()

        def beat():
            beats = _core.RendezvousClient(addr, port, secret, timeout)
            n = 0
            while not stop.wait(BEAT_SECONDS):
                n += 1
                try:
                    beats.set(f"spark/beat/{aid}", str(n).encode())
                except HorovodInternalError:
                    return

        threading.Thread(target=beat, daemon=True).start()
        work = tempfile.mkdtemp(prefix="perseus-spark-agent-")
        fn_path = os.path.join(work, "payload")
        with open(fn_path, "wb") as f:
            f.write(cloudpickle.dumps(payload))
        try:
            n = 0
            while True:
                try:
                    order = client.get(f"spark/run/{aid}/{n}", BEAT_SECONDS)
                except HorovodInternalError:
                    continue  # nothing yet
                if order == b"stop":
                    break
                env = dict(os.environ, **json.loads(order), PERSEUS_SECRET=secret)
                result_path = os.path.join(work, f"result.{n}")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "perseus.spark.worker", fn_path, result_path],
                    env=env, start_new_session=True,
                    preexec_fn=_parent_death_signal())  # noqa: PLW1509
                _watch(proc, client, f"spark/kill/{aid}/{n}")
                try:
                    with open(result_path, "rb") as f:
                        result = f.read()
                except OSError:
                    why = f"the worker ended without a result (return code {proc.returncode})"
                    result = cloudpickle.dumps(("error", -1, why))
                client.set(f"spark/result/{aid}/{n}", result)
                client.set(f"spark/exit/{aid}/{n}", str(proc.returncode).encode())
                n += 1
        finally:
            stop.set()
        yield aid

    return body


def _watch(proc, client, kill_key):
    """Wait for the worker ``proc``; stop its process group when the driver sets
    ``kill_key`` (SIGTERM, then SIGKILL after the grace period)."""
    from perseus.common.exceptions import HorovodInternalError

    while proc.poll() is None:
        try:
            client.get(kill_key, 0.2)
        except HorovodInternalError:
            continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(GRACE_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
        proc.wait()


# ---------------------------------------------------------------------------- driver


class Agents:
    """The driver's view of the agents: which beat lately, and their slots. A new agent
    takes the lowest slot of its host that no live agent holds; ``hosts()`` (the
    discovery ElasticJob calls) gives each host as many slots as its highest live one
    needs, and a slot between whose agent is gone has none (launching there fails, and
    the slot is blacklisted)."""

    def __init__(self, server):
        self.server = server
        self._lock = threading.Lock()
        self._seen = {}  # agent id -> (last beat, driver time it changed)
        self._slot = {}  # agent id -> (host, index)
        self._next = {}  # agent id -> the number of its next order
        self.ended = threading.Event()  # set when the Spark job of the agents ended

    def _refresh(self):
        now = time.monotonic()
        published = self.server.keys()  # the store's sorted keys (not a dict)
        for key in published:
            if not key.startswith(_PREFIX):
                continue
            aid = key[len(_PREFIX):]
            beat = self.server.get(f"spark/beat/{aid}")
            last = self._seen.get(aid)
            if last is None or last[0] != beat:
                self._seen[aid] = (beat, now)
            if aid not in self._slot and self._live(aid, now):
                host = self.server.get(key).decode()
                taken = {i for a, (h, i) in self._slot.items()
                         if h == host and self._live(a, now)}
                self._slot[aid] = (host, min(set(range(len(taken) + 1)) - taken))

    def _live(self, aid, now):
        return not self.ended.is_set() and now - self._seen[aid][1] < SILENCE_SECONDS

    def live(self, aid):
        with self._lock:
            self._refresh()
            return self._live(aid, time.monotonic())

    def hosts(self):
        """``{host: slots}`` of the live agents."""
        with self._lock:
            self._refresh()
            now = time.monotonic()
            found = {}
            for aid, (host, i) in self._slot.items():
                if self._live(aid, now):
                    found[host] = max(found.get(host, 0), i + 1)
            return found

    def count(self):
        with self._lock:
            self._refresh()
            now = time.monotonic()
            return sum(self._live(a, now) for a in self._slot)

    def order(self, host, index, env):
        """Ask the live agent of slot ``host[index]`` to run a worker with ``env``; returns
        ``(agent id, order number)``, or None when no live agent holds the slot."""
        with self._lock:
            self._refresh()
            now = time.monotonic()
            aid = next((a for a, slot in self._slot.items()
                        if slot == (host, index) and self._live(a, now)), None)
            if aid is None:
                return None
            n = self._next[aid] = self._next.get(aid, -1) + 1
        self.server.set(f"spark/run/{aid}/{n}", json.dumps(env).encode())
        return aid, n

    def stop_all(self):
        """Tell every agent to end (at its next order)."""
        with self._lock:
            self._refresh()
            for aid in self._seen:
                self.server.set(f"spark/run/{aid}/{self._next.get(aid, -1) + 1}", b"stop")


class SparkJobEnded(RuntimeError):
    """The Spark job that runs the agents ended while the elastic job ran."""


class _AgentProcess:
    """A worker run by an agent, seen as the launcher sees a process."""

    def __init__(self, agents, aid, n, error=None):
        self.agents, self.aid, self.n = agents, aid, n
        self.returncode = None if error is None else 1
        self.error, self.result = error, None

    def wait(self):
        server = self.agents.server
        while self.returncode is None:
            code = server.get(f"spark/exit/{self.aid}/{self.n}")
            if code is not None:
                outcome = pickle.loads(server.get(f"spark/result/{self.aid}/{self.n}"))
                if outcome[0] == "ok":
                    self.result = outcome[1:]
                else:
                    self.error = outcome[2]
                self.returncode = int(code)
            elif not self.agents.live(self.aid):
                self.error = f"its Spark task (agent {self.aid}) was lost"
                self.returncode = AGENT_LOST
            else:
                time.sleep(0.05)
        return self.returncode

    def poll(self):
        return self.returncode

    def kill(self):
        """Ask the agent to stop the worker's process group."""
        self.agents.server.set(f"spark/kill/{self.aid}/{self.n}", b"1")


class SparkWorker(_elastic.ManagedWorker):
    """One worker of the elastic job, run by the agent of its slot, with the interface
    ElasticJob drives (that of :class:`perseus.runner.job.Rank`)."""

    def __init__(self, agents, slot, env):
        self.agents, self.slot, self.env = agents, slot, env
        self.argv = [f"a worker of Spark task slot {slot.id}"]
        self.proc = None

    def start(self, out, err, lock, output_dir=None, size=None):
        ordered = self.agents.order(self.slot.hostname, self.slot.index,
                                    dict(self.env, **self.slot.env()))
        if ordered is None:
            self.proc = _AgentProcess(self.agents, None, None,
                                      error=f"no live Spark task holds slot {self.slot.id}")
        else:
            self.proc = _AgentProcess(self.agents, *ordered)


def _spark_reason(error):
    """The line of a Spark job's error that says why (Py4J's first line names only the
    call that failed), at most 500 characters."""
    lines = [t.strip() for t in str(error).splitlines() if t.strip()] or [repr(error)]
    return next((t for t in lines if "aborted" in t), lines[0])[:500]


def run_elastic(fn, args=(), kwargs=None, num_proc=None, min_np=None, max_np=None,
                start_timeout=None, elastic_timeout=None, reset_limit=None, env=None,
                stdout=None, stderr=None, verbose=1, nics=None,
                prefix_output_with_timestamp=False):
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark tasks, as Horovod's
    ``horovod.spark.run_elastic``: ``max_np`` tasks (default ``num_proc``, itself the
    context's default parallelism) each run workers; the job starts once ``num_proc``
    tasks are up (within ``start_timeout``), and goes on while at least ``min_np``
    (default ``num_proc``) workers are left. The function trains with
    ``hvd.elastic.run``. Returns what each worker that finished returned, by its last
    rank; raises RuntimeError with the driver's reason and the workers' tracebacks when
    the job fails."""
    del stdout, stderr, verbose, nics, prefix_output_with_timestamp
    from perseus.runner import launch
    from perseus.spark.runner import _spark_context

    if not callable(fn):
        raise TypeError(f"perseus.spark.run_elastic needs a function to run, got "
                        f"{type(fn).__name__}")
    sc = _spark_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    min_np = num_proc if min_np is None else min_np
    max_np = num_proc if max_np is None else max_np
    for name, value in (("num_proc", num_proc), ("min_np", min_np), ("max_np", max_np)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"perseus.spark.run_elastic needs {name} >= 1, got {value!r}")
    if not min_np <= num_proc <= max_np:
        raise ValueError(f"perseus.spark.run_elastic needs min_np ({min_np}) <= num_proc "
                         f"({num_proc}) <= max_np ({max_np})")
    if start_timeout is None:
        start_timeout = knobs.get("HOROVOD_SPARK_START_TIMEOUT")
    if elastic_timeout is None:
        elastic_timeout = knobs.get("PERSEUS_ELASTIC_TIMEOUT")
    secret = secrets.token_hex(16)
    server = launch.start_rendezvous(secret)
    addr = sc.getConf().get("spark.driver.host") or socket.gethostname()
    body = _agent((fn, tuple(args), dict(kwargs or {})), secret, (addr, server.port),
                  float(start_timeout))
    group = f"perseus.spark.run_elastic.{secrets.token_hex(4)}"
    spark_error = []

    def spark_job():
        sc.setJobGroup(group, "perseus.spark.run_elastic", interruptOnCancel=True)
        try:
            sc.parallelize(range(max_np), max_np).mapPartitionsWithIndex(body).collect()
        except Exception as e:  # noqa: BLE001 - reported by the driver
            spark_error.append(e)
        finally:
            agents.ended.set()  # every agent is gone: its workers with it

    agents = Agents(server)
    thread = threading.Thread(target=spark_job, daemon=True, name="perseus-spark-job")
    thread.start()
    workers = []
    job = None
    try:
        deadline = time.monotonic() + start_timeout
        while agents.count() < num_proc:
            if spark_error or not thread.is_alive():
                why = _spark_reason(spark_error[0]) if spark_error else "its tasks returned"
                raise SparkJobEnded(f"perseus.spark.run_elastic: the Spark job ended before "
                                    f"its tasks started: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"perseus.spark.run_elastic: {agents.count()} of {num_proc} Spark tasks "
                    f"started within {start_timeout:g} s (start_timeout); the cluster needs "
                    f"{num_proc} free task slots")
            time.sleep(0.1)
        common = {"PERSEUS_RENDEZVOUS_ADDR": addr, "PERSEUS_RENDEZVOUS_PORT": str(server.port),
                  "PERSEUS_START_TIMEOUT": f"{start_timeout:g}",
                  "PERSEUS_ELASTIC_TIMEOUT": f"{elastic_timeout:g}",
                  **{k: str(v) for k, v in (env or {}).items()}}

        def launch_worker(slot):
            worker = SparkWorker(agents, slot, common)
            workers.append(worker)
            return worker

        def discover():
            # The tasks end only when told to, after the job: a Spark job that ended
            # before failed (its tasks lost beyond spark.task.maxFailures, the
            # application stopped), and no slot will come back.
            if agents.ended.is_set():
                why = _spark_reason(spark_error[0]) if spark_error else "its tasks returned"
                raise SparkJobEnded(f"perseus.spark.run_elastic: the Spark job of its tasks "
                                    f"ended during the run ({why}); stopping the job")
            return agents.hosts()

        job = _elastic.ElasticJob(discover, launch_worker, server, min_np, max_np,
                                  num_proc, elastic_timeout=elastic_timeout,
                                  reset_limit=reset_limit, start_timeout=start_timeout)
        job.who = "perseus.spark"
        status = job.run()
    finally:
        agents.stop_all()
        thread.join(GRACE_SECONDS + 2 * BEAT_SECONDS)
        if thread.is_alive():
            sc.cancelJobGroup(group)
            thread.join()
        server.stop()
    return _elastic.results(job, status, workers, "perseus.spark.run_elastic")

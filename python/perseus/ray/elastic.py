"""RayExecutor's elastic mode (``min_workers``/``max_workers``): perseusrun's elastic
driver (:class:`perseus.runner.elastic.ElasticJob`) with Ray's nodes for hosts and a Ray
actor for each worker.

Hosts come from Ray itself: every live node offers as many slots as it has CPUs (and,
with ``use_gpu``, GPUs) for a worker, and nodes of one address add up, as Horovod's Ray
discovery counts them. A worker is an actor placed on its host through Ray's
``node:<address>`` resource; it gets the driver's rendezvous address and the job secret
as environment variables, then runs the function, whose ``hvd.elastic.run`` takes its
place in each round. An actor that dies (its node lost, its process killed) or whose
function raises counts as a failed worker: the driver leaves its slot out (or its host,
where the host has one slot) and the others re-form from their last commit, with new
workers on free slots up to ``max_workers``. Nodes that join the Ray cluster add
workers at the next ``state.commit()``.
"""

import secrets
import signal
import sys
import threading

from perseus.ray import ray_logger
from perseus.ray.worker import Worker
from perseus.runner import elastic as _elastic

#: Seconds between two looks at Ray's nodes.
DISCOVERY_SECONDS = 1.0
#: The return code a worker whose actor died is given (its process was killed).
ACTOR_DIED = -signal.SIGKILL


class RayHostDiscovery:
    """``{node address: slots}`` of Ray's live nodes, for ``cpus_per_worker`` CPUs (and
    ``gpus_per_worker`` GPUs where not 0) a worker."""

    def __init__(self, ray, cpus_per_worker, gpus_per_worker=0):
        self.ray, self.cpus, self.gpus = ray, cpus_per_worker, gpus_per_worker

    def __call__(self):
        hosts = {}
        for node in self.ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            slots = int(have.get("CPU", 0) // self.cpus)
            if self.gpus:
                slots = min(slots, int(have.get("GPU", 0) // self.gpus))
            if slots > 0:
                address = node["NodeManagerAddress"]
                hosts[address] = hosts.get(address, 0) + slots
        return hosts


class OnRayNodes:
    """The hosts of ``discovery`` (Horovod's ``find_available_hosts_and_slots()``) that
    are live Ray nodes' addresses. A host that is not gets no worker, where its actor
    would wait for the start timeout and its slot then for ``elastic_timeout``: it is
    named on standard error once, beside the nodes' addresses."""

    def __init__(self, ray, discovery):
        self.ray, self.discovery, self.named = ray, discovery, set()

    def __call__(self):
        nodes = {n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}
        hosts = dict(self.discovery.find_available_hosts_and_slots())
        for host in sorted(set(hosts) - nodes - self.named):
            self.named.add(host)
            print(f"perseus.ray: the discovery names host {host}, which is no live Ray "
                  f"node (their addresses: {', '.join(sorted(nodes))}); it gets no worker",
                  file=sys.stderr, flush=True)
        return {h: n for h, n in hosts.items() if h in nodes}


class _ActorProcess:
    """A worker's actor seen as the launcher sees a process: ``wait()`` (0 when the
    function returned, 1 when it raised, :data:`ACTOR_DIED` when the actor died),
    ``poll()``, and ``kill()``."""

    def __init__(self, ray, actor, ref):
        self._ray, self.actor, self._ref = ray, actor, ref
        self.returncode = None
        self.result = None  # (rank, value) when the function returned
        self.error = None  # what Ray said when it did not
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._waited = False

    def wait(self):
        with self._lock:
            first, self._waited = not self._waited, True
        if not first:
            self._done.wait()
            return self.returncode
        exceptions = self._ray.exceptions
        try:
            self.result = self._ray.get(self._ref)
            code = 0
        except exceptions.RayActorError as e:
            self.error, code = str(e), ACTOR_DIED
        except exceptions.RayError as e:  # the function raised (RayTaskError), or worse
            self.error, code = str(e), 1
        self.returncode = code
        self._done.set()
        return code

    def poll(self):
        return self.returncode

    def kill(self):
        self._ray.kill(self.actor, no_restart=True)


class ActorWorker(_elastic.ManagedWorker):
    """One worker of the elastic job, an actor on ``slot``'s host, with the interface
    ElasticJob drives (that of :class:`perseus.runner.job.Rank`)."""

    def __init__(self, ray, slot, options, env, queue, executable, fn):
        self._ray, self.slot = ray, slot
        self.argv = [f"a Ray actor on {slot.hostname}"]
        self._options, self._env, self._queue = options, env, queue
        self._executable, self._fn = executable, fn
        self.proc = None

    def start(self, out, err, lock, output_dir=None, size=None):
        """Start the actor and the function on it (its output goes to Ray's logs)."""
        options = dict(self._options, resources={f"node:{self.slot.hostname}": 0.001})
        actor = self._ray.remote(Worker).options(**options).remote()
        actor.set_env.remote(dict(self._env, **self.slot.env()))
        actor.set_queue.remote(self._queue)
        actor.start_executable.remote(*self._executable)
        self.proc = _ActorProcess(self._ray, actor, actor.execute_ranked.remote(self._fn))


def run(ray, executor, fn, callbacks=None):
    """Run ``fn(executable)`` elastically on ``executor``'s Ray cluster; returns what each
    worker that finished returned, by its last rank. Raises RuntimeError, with the
    driver's reason and the failed workers' errors, when the job fails."""
    from perseus.runner import launch

    secret = secrets.token_hex(16)
    server = launch.start_rendezvous(secret)
    relay = ray_logger.Relay(ray, callbacks)
    started = []
    try:
        env = {"PERSEUS_RENDEZVOUS_ADDR": ray.util.get_node_ip_address(),
               "PERSEUS_RENDEZVOUS_PORT": str(server.port), "PERSEUS_SECRET": secret,
               "PERSEUS_START_TIMEOUT": str(executor.settings.timeout_s),
               "PERSEUS_ELASTIC_TIMEOUT": f"{executor.elastic_timeout:g}",
               **executor.extra_env}
        options = {"num_cpus": executor.cpus_per_worker, "num_gpus": executor.gpus_per_worker}

        def launch_worker(slot):
            worker = ActorWorker(ray, slot, options, env, relay.queue, executor.executable,
                                 fn)
            started.append(worker)
            return worker

        most = executor.max_workers or sys.maxsize
        discovery = executor.discovery
        job = _elastic.ElasticJob(
            RayHostDiscovery(ray, executor.cpus_per_worker, executor.gpus_per_worker)
            if discovery is None else OnRayNodes(ray, discovery),
            launch_worker, server, executor.min_workers, most, most,
            elastic_timeout=executor.elastic_timeout, reset_limit=executor.reset_limit,
            interval=DISCOVERY_SECONDS, start_timeout=executor.settings.timeout_s,
            cooldown=executor.cooldown_range)
        job.who = "perseus.ray"
        status = job.run()
    finally:
        for worker in started:  # finished ones too: an actor holds its CPUs until killed
            if worker.proc is not None:
                worker.proc.kill()
        server.stop()
        relay.close()
    return _elastic.results(job, status, started, "perseus.ray")

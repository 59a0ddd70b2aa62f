"""RayExecutor: a Perseus job whose ranks are Ray actors.

The executor starts one actor per worker (on ``num_hosts`` hosts of
``num_workers_per_host`` each, through a placement group, or ``num_workers`` wherever Ray
places them), asks each for its node's address, and gives each its rank the way
perseusrun does (ranks of one host consecutive, ``perseus.runner.hosts.place``). Rank 0's
actor picks a free port on its node; every actor then gets the topology, that address and
port, and a fresh secret as environment variables, so ``hvd.init()`` inside the function
an actor runs joins the job. A function that fails on one rank ends the run on every
rank: the executor kills the actors (the others would wait for it in their next
collective) and raises the failing rank's error, its traceback included.

With ``min_workers`` instead, the executor runs an elastic job (perseus.ray.elastic):
workers come and go with Ray's nodes, and training goes on from its last commit.
"""

import secrets
from dataclasses import dataclass

from perseus.ray import elastic, ray_logger
from perseus.ray.worker import Worker
from perseus.runner.hosts import place_by_host

#: Seconds a placement group may take to be ready, by default (Horovod's).
PLACEMENT_GROUP_TIMEOUT_S = 100


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("perseus.ray needs Ray: pip install 'ray[default]'") from None
    return ray


@dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's settings object).
    ``timeout_s`` bounds the job's start (PERSEUS_START_TIMEOUT); the ssh fields are
    accepted for compatibility and unused, since the actors meet through Ray."""

    timeout_s: int = 30
    ssh_identity_file: str = None
    ssh_str: str = None
    placement_group_timeout_s: int = PLACEMENT_GROUP_TIMEOUT_S
    nics: set = None


class RayExecutor:
    """Runs functions on a Perseus job of Ray actors, as ``horovod.ray.RayExecutor``.

    ``num_workers`` actors (or ``num_hosts`` x ``num_workers_per_host``), each with
    ``cpus_per_worker`` CPUs and, with ``use_gpu``, ``gpus_per_worker`` GPUs (default 1).
    With ``min_workers`` (and ``max_workers``, unbounded when None) the job is elastic:
    ``run``/``execute`` start workers on whatever slots Ray's nodes offer, from
    ``min_workers`` up to ``max_workers``, and re-form them as nodes or workers come and
    go (``reset_limit``, ``cooldown_range`` and ``elastic_timeout`` as perseusrun's
    ``--reset-limit``, ``--blacklist-cooldown-range`` and ``--elastic-timeout``)."""

    @classmethod
    def create_settings(cls, timeout_s=30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s=PLACEMENT_GROUP_TIMEOUT_S, nics=None):
        return RaySettings(timeout_s, ssh_identity_file, ssh_str, placement_group_timeout_s,
                           nics)

    def __init__(self, settings=None, num_workers=None, num_hosts=None,
                 num_workers_per_host=1, cpus_per_worker=1, use_gpu=False,
                 gpus_per_worker=None, use_current_placement_group=True, min_workers=None,
                 max_workers=None, reset_limit=None, cooldown_range=None,
                 elastic_timeout=600, override_discovery=True):
        if max_workers is not None and not min_workers:
            raise ValueError("RayExecutor: max_workers needs a positive min_workers "
                             "(an elastic job)")
        self.elastic = min_workers is not None
        if self.elastic and (num_workers is not None or num_hosts is not None):
            raise ValueError("RayExecutor: give min_workers/max_workers (an elastic job) or "
                             "num_workers/num_hosts (a fixed one), not both")
        if not self.elastic and (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor needs either num_workers or num_hosts "
                             "(with num_workers_per_host), not both")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host),
                            ("cpus_per_worker", cpus_per_worker),
                            ("min_workers", min_workers), ("max_workers", max_workers)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive int, got {value!r}")
        if max_workers is not None and max_workers < min_workers:
            raise ValueError(f"RayExecutor: max_workers ({max_workers}) is below min_workers "
                             f"({min_workers})")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
            raise ValueError(f"RayExecutor: gpus_per_worker must be >= 1, got {gpus_per_worker}")
        self.settings = settings or RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = (min_workers if self.elastic else num_workers
                            if num_workers is not None else num_hosts * num_workers_per_host)
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout = elastic_timeout
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_gpu = use_gpu
        self.workers = []
        self.executable = (None, None, None)  # an elastic job's (cls, args, kwargs)
        self.extra_env = {}
        #: Elastic jobs with ``override_discovery=False``: ``settings.discovery``, an
        #: object with Horovod's ``find_available_hosts_and_slots()`` whose hosts replace
        #: Ray's nodes.
        self.discovery = None
        if self.elastic and not override_discovery:
            self.discovery = getattr(self.settings, "discovery", None)
            if self.discovery is None:
                raise ValueError("RayExecutor: override_discovery=False needs "
                                 "settings.discovery (find_available_hosts_and_slots())")
        self._started = False
        self._group = None

    # ----------------------------------------------------------------- start, shutdown

    def _actors(self, ray):
        options = {"num_cpus": self.cpus_per_worker, "num_gpus": self.gpus_per_worker}
        cls = ray.remote(Worker)
        if self.num_hosts is None:
            return [cls.options(**options).remote() for _ in range(self.num_workers)]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_host = {"CPU": self.cpus_per_worker * self.num_workers_per_host}
        if self.gpus_per_worker:
            per_host["GPU"] = self.gpus_per_worker * self.num_workers_per_host
        self._group = placement_group([per_host] * self.num_hosts, strategy="STRICT_SPREAD")
        ready, _ = ray.wait([self._group.ready()],
                            timeout=self.settings.placement_group_timeout_s)
        if not ready:
            raise TimeoutError(
                f"Ray could not place {self.num_hosts} hosts of {per_host} within "
                f"{self.settings.placement_group_timeout_s} s (placement_group_timeout_s)")
        return [cls.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=i // self.num_workers_per_host))
                .remote() for i in range(self.num_workers)]

    def start(self, executable_cls=None, executable_args=None, executable_kwargs=None,
              extra_env_vars=None):
        """Starts the actors and gives each its rank; ``executable_cls(*args, **kwargs)`` is
        then made on every worker, for :meth:`execute`. In an elastic job the workers start
        with each run instead, and each makes its executable then."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        self.extra_env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
        if self.elastic:
            self.executable = (executable_cls, executable_args, executable_kwargs)
            self._started = True
            return
        actors = self._actors(ray)
        order, slots = place_by_host(ray.get([a.node.remote() for a in actors]))
        self.workers = [actors[i] for i in order]
        port = ray.get(self.workers[0].free_port.remote())
        common = {"PERSEUS_MASTER_ADDR": slots[0].hostname, "PERSEUS_MASTER_PORT": str(port),
                  "PERSEUS_SECRET": secrets.token_hex(16),
                  "PERSEUS_START_TIMEOUT": str(self.settings.timeout_s), **self.extra_env}
        ray.get([w.set_env.remote(dict(common, **slot.env()))
                 for w, slot in zip(self.workers, slots)])
        ray.get([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                 for w in self.workers])
        self._started = True

    def shutdown(self):
        """Stops every actor (and frees the placement group)."""
        ray = _ray()
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self._started = False
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None

    # ----------------------------------------------------------------- running

    def _check_started(self):
        if not self._started:
            raise RuntimeError("RayExecutor: call start() before running functions")

    def _gather(self, refs, relay=None):
        """Every rank's result, by rank; on the first failure every actor is stopped (the
        others would wait for the failed rank) and its error raised. ``relay`` (a
        ray_logger.Relay) is closed once the results are in."""
        ray = _ray()
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(done[0])
                except Exception:
                    self.shutdown()
                    raise
            results = ray.get(list(refs))
        finally:
            if relay is not None:
                relay.close()
        return results

    def _relay(self, callbacks):
        """A Relay for ``callbacks``, its queue given to every worker (none: no queue)."""
        ray = _ray()
        relay = ray_logger.Relay(ray, callbacks)
        ray.get([w.set_queue.remote(relay.queue) for w in self.workers])
        return relay

    def run_remote(self, fn, args=None, kwargs=None):
        """Starts ``fn(*args, **kwargs)`` on every worker; returns Ray object refs, by rank.
        Not in an elastic job, whose workers change (as in Horovod)."""
        self._check_started()
        if self.elastic:
            raise NotImplementedError("RayExecutor.run_remote: an elastic job's workers come "
                                      "and go, so it has no refs to give; use run()")
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def run(self, fn, args=None, kwargs=None, callbacks=None):
        """``fn(*args, **kwargs)`` on every worker; returns each rank's result, by rank.
        Each of ``callbacks`` is called on the driver with every dict rank 0 logs through
        :func:`perseus.ray.ray_logger.log`."""
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return self.execute(lambda _executable: fn(*args, **kwargs), callbacks)

    def execute(self, fn, callbacks=None):
        """``fn(executable)`` on every worker (the object :meth:`start` made); by rank.
        ``callbacks`` as for :meth:`run`."""
        self._check_started()
        if self.elastic:
            return elastic.run(_ray(), self, fn, callbacks)
        relay = self._relay(callbacks)
        return self._gather([w.execute.remote(fn) for w in self.workers], relay)

    def execute_single(self, fn):
        """``fn(executable)`` on the worker of rank 0 only (not in an elastic job, as in
        Horovod)."""
        self._check_started()
        if self.elastic:
            raise NotImplementedError("RayExecutor.execute_single: an elastic job has no "
                                      "lasting rank 0; use execute()")
        return _ray().get(self.workers[0].execute.remote(fn))

"""ElasticRayExecutor: Horovod 0.28's older elastic API for Ray (deprecated there since
0.25, still exported), on :class:`perseus.ray.RayExecutor`'s elastic mode.

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=8)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    results = executor.run(train)       # train() trains with hvd.elastic.run

A slot is what RayExecutor calls a worker: ``cpus_per_slot`` CPUs (and ``gpus_per_slot``
GPUs with ``use_gpu``) of a live Ray node. ``override_discovery=False`` keeps the hosts
of ``settings.discovery`` (an object with Horovod's ``find_available_hosts_and_slots()``)
instead of Ray's nodes.
"""

import warnings
from dataclasses import dataclass, field

from perseus.ray.executor import RayExecutor, RaySettings


@dataclass
class ElasticRaySettings(RaySettings):
    """What :meth:`ElasticRayExecutor.create_settings` returns."""

    min_num_proc: int = 1
    max_num_proc: int = None
    reset_limit: int = None
    elastic_timeout: int = 600
    discovery: object = None
    #: Horovod's other settings (``verbose`` and the like), accepted and kept.
    extra: dict = field(default_factory=dict)


class ElasticRayExecutor:
    """An elastic Perseus job of Ray actors, as ``horovod.ray.ElasticRayExecutor``."""

    @staticmethod
    def create_settings(min_num_proc=1, max_num_proc=None, reset_limit=None,
                        elastic_timeout=600, timeout_s=30, ssh_identity_file=None, nics=None,
                        min_np=None, max_np=None, **kwargs):
        """The job's settings; ``min_np``/``max_np`` are Horovod's deprecated names of
        ``min_num_proc``/``max_num_proc``."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead",
                          DeprecationWarning, stacklevel=2)
            if min_num_proc == 1:
                min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead",
                          DeprecationWarning, stacklevel=2)
            if max_num_proc is None:
                max_num_proc = max_np
        discovery = kwargs.pop("discovery", None)
        return ElasticRaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                                  nics=nics, min_num_proc=min_num_proc,
                                  max_num_proc=max_num_proc, reset_limit=reset_limit,
                                  elastic_timeout=elastic_timeout, discovery=discovery,
                                  extra=kwargs)

    def __init__(self, settings, use_gpu=False, cpus_per_slot=1, gpus_per_slot=None,
                 env_vars=None, override_discovery=True):
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be "
                             "True if gpus_per_slot is set.")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        self.settings = settings
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, \
            gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self._executor = RayExecutor(
            settings, cpus_per_worker=cpus_per_slot, use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot if use_gpu else None,
            min_workers=settings.min_num_proc, max_workers=settings.max_num_proc,
            reset_limit=settings.reset_limit, elastic_timeout=settings.elastic_timeout,
            override_discovery=override_discovery)

    def start(self):
        """Readies the job (Ray is initialized here when it was not)."""
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn, callbacks=None):
        """``worker_fn()`` on every worker, elastically; returns what each worker that
        finished returned, by its last rank. ``callbacks`` get every dict rank 0 logs
        through :func:`perseus.ray.ray_logger.log`."""
        return self._executor.run(worker_fn, callbacks=callbacks)

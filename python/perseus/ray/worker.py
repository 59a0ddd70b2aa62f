"""The body of every Ray actor of a RayExecutor: one rank (or elastic worker) each."""

import os

from perseus import _netif
from perseus.common import knobs
from perseus.ray import ray_logger


class Worker:
    """What the driver calls on an actor; calls run in the order they are made."""

    def __init__(self):
        self.executable = None

    def node(self):
        """The address of this actor's Ray node."""
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self):
        return _netif.free_port()

    def set_env(self, env):
        os.environ.update(env)

    def set_queue(self, queue):
        """Where :func:`perseus.ray.ray_logger.log` sends (None: nowhere)."""
        ray_logger.configure(queue)

    def start_executable(self, cls, args, kwargs):
        if cls is not None:
            self.executable = cls(*(args or ()), **(kwargs or {}))

    def execute(self, fn):
        return fn(self.executable)

    def run(self, fn, args, kwargs):
        return fn(*(args or ()), **(kwargs or {}))

    def execute_ranked(self, fn):
        """``(rank, fn(executable))``, the rank being the one this process had last: an
        elastic worker's rank changes from round to round."""
        value = fn(self.executable)
        return int(knobs.text("PERSEUS_RANK") or -1), value

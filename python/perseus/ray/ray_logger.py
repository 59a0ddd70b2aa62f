"""Values a worker logs for the driver's callbacks (Horovod's ``horovod.ray.ray_logger``).

On a worker, ``ray_logger.log({"loss": ...})`` puts the dict on a Ray queue that the
executor gave the actor for this run; on the driver, :class:`Relay` takes each one off
and calls every callback of ``RayExecutor.run(..., callbacks=[...])`` with it. Only rank
0 logs unless ``chief_only=False``.
"""

import threading
import warnings

from perseus.common import knobs

#: How long the driver waits on the queue before it looks whether the run ended (s).
POLL_SECONDS = 0.1

_queue = None
_warned = False


def configure(queue):
    """Send this worker's logs to ``queue`` (the executor calls it on each actor)."""
    global _queue
    _queue = queue


def log(info_dict, chief_only=True):
    """Send ``info_dict`` (picklable) to the driver's callbacks; with ``chief_only``, only
    from the worker of rank 0. Outside a run with callbacks it warns once and drops it."""
    global _warned
    if chief_only and knobs.text("PERSEUS_RANK") != "0":
        return
    if _queue is None:
        if not _warned:
            _warned = True
            warnings.warn("perseus.ray.ray_logger.log called, but this run has no callbacks "
                          "(RayExecutor.run(..., callbacks=[...]))", stacklevel=2)
        return
    _queue.put(info_dict)


class Relay:
    """The driver's end: a Ray queue for the workers, and a thread that calls each of
    ``callbacks`` with every value that arrives, in order, until :meth:`close` (which
    delivers what is left first). Without callbacks it does nothing and ``queue`` is
    None."""

    def __init__(self, ray, callbacks):
        self.callbacks = list(callbacks or ())
        self.queue = None
        self._done = threading.Event()
        self._thread = None
        self._error = None  # the first error a callback raised, raised again by close()
        if self.callbacks:
            from ray.util.queue import Queue

            # No CPU held: the workers may take every CPU of the cluster.
            self.queue = Queue(actor_options={"num_cpus": 0})
            self._thread = threading.Thread(target=self._pump, daemon=True,
                                            name="perseus-ray-callbacks")
            self._thread.start()

    def _pump(self):
        from ray.util.queue import Empty

        while True:
            try:
                value = self.queue.get(timeout=POLL_SECONDS)
            except Empty:
                if self._done.is_set():
                    return
                continue
            try:
                for callback in self.callbacks:
                    callback(value)
            except BaseException as e:  # noqa: BLE001 - raised again by close()
                self._error = e
                return

    def close(self):
        """Deliver what is queued, then stop the thread and the queue's actor; raises the
        error of a callback that failed (the values after it went undelivered)."""
        if self.queue is None:
            return
        self._done.set()
        self._thread.join()
        self.queue.shutdown()
        self.queue = None
        if self._error is not None:
            raise self._error

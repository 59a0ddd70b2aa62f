"""Starting every rank from the same state: variables, objects, and the TF1 helpers."""

import tensorflow as tf

from perseus.common.objects import allgather_object as _allgather_object
from perseus.common.objects import broadcast_object as _broadcast_object
from perseus.common.process_sets import global_process_set
from perseus.tensorflow.horovod.mpi_ops import broadcast_

__all__ = ["BroadcastGlobalVariablesHook", "allgather_object", "broadcast_global_variables",
           "broadcast_object", "broadcast_object_fn", "broadcast_variables"]


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Overwrite each variable with ``root_rank``'s value.

    Eager: done on return. In a graph: returns the op that does it.
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    result = broadcast_(variables, root_rank, name="broadcast_variables",
                        process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*result)


def broadcast_global_variables(root_rank):
    """The op that overwrites every global variable with ``root_rank``'s (graph mode only).

    Run it once after the variables are initialized:
    ``sess.run(hvd.broadcast_global_variables(0))``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution: use "
            "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Send a picklable object from ``root_rank`` to every rank; returns it.

    ``session`` is accepted for compatibility: objects travel at once, outside graphs.
    """
    return _broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``fn(obj)`` that sends ``obj`` from ``root_rank`` to every rank of the set
    and returns it, as :func:`broadcast_object` with these arguments does; call it any
    number of times (on every rank of the set each time). ``session`` is accepted for
    compatibility."""
    root_rank = int(root_rank)
    name = name or "broadcast_object_fn"

    def broadcast_fn(obj):
        return _broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return broadcast_fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Gather a picklable object from every rank; returns the list in rank order."""
    return _allgather_object(obj, name=name, process_set=process_set)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A SessionRunHook (``MonitoredTrainingSession``, Estimator-style loops) that
    broadcasts every global variable from ``root_rank`` once the session is created,
    so that all ranks start from the same weights, also when restored from a checkpoint.
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        """Build the broadcast op in the session's graph."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        """Run the broadcast."""
        session.run(self.bcast_op)

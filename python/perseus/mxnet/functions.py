"""Starting every rank from the same state: parameters and objects."""

import types

import mxnet as mx

from perseus.common.objects import allgather_object, broadcast_object
from perseus.common.process_sets import global_process_set
from perseus.mxnet.mpi_ops import broadcast_

__all__ = ["allgather_object", "broadcast_object", "broadcast_parameters"]


def _broadcast_parameter(p, root_rank, name, process_set):
    arrays = p.list_data()
    broadcast_(arrays[0], root_rank, name=name, process_set=process_set)
    for other in arrays[1:]:
        arrays[0].copyto(other)


def _broadcast_after_init(p, root_rank, name, process_set):
    """Wrap a deferred parameter's initialization so that it broadcasts once it has data."""
    original = p._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        _broadcast_parameter(self, root_rank, name, process_set)
    return types.MethodType(init_then_broadcast, p)


def broadcast_parameters(params, root_rank=0, prefix=None, process_set=global_process_set):
    """Overwrite parameters with ``root_rank``'s values, in place.

    ``params``: a gluon ``ParameterDict`` (``net.collect_params()``) or a dict of
    NDArrays (the Module API's ``arg_params``). Parameters whose shape is not known yet
    (deferred initialization) are broadcast as soon as they are initialized, so every
    rank must run its first forward pass.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {type(prefix).__name__}")
    prefix = prefix or ""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError(f"invalid params of type: {type(params)}")  # noqa: TRY004 - as Horovod
    for name, p in sorted(params.items()):
        key = f"{prefix}{name}"
        if isinstance(p, mx.gluon.Parameter):
            try:
                p.list_data()
            except mx.gluon.parameter.DeferredInitializationError:
                p._init_impl = _broadcast_after_init(p, root_rank, key, process_set)
                continue
            _broadcast_parameter(p, root_rank, key, process_set)
        else:
            broadcast_(p, root_rank, name=key, process_set=process_set)

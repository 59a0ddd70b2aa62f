"""Helpers to start training from one rank's state: parameters, optimizer state, objects."""

import torch

from perseus.common.objects import allgather_object, broadcast_object
from perseus.common.process_sets import global_process_set
from perseus.torch.horovod.mpi_ops import broadcast_async_, synchronize

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrite parameters (or any tensors) in place with ``root_rank``'s values.

    ``params`` is a ``state_dict()``, ``named_parameters()`` (or any iterable of
    ``(name, tensor)``), or a list of tensors. Typically called once after the model
    is built, so that every rank starts from the same weights.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"invalid params of type: {type(params)}") from None
    handles = [broadcast_async_(p, root_rank, name, process_set)
               for name, p in items if p is not None]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set):
    """Make every rank's optimizer state (buffers and hyper-parameters) equal ``root_rank``'s.

    The root's ``state_dict()`` is sent as one object and loaded on the other ranks,
    so state that the root has but others have not created yet arrives as well.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    state = optimizer.state_dict() if process_set.rank() == root_rank else None
    state = broadcast_object(state, root_rank, name="optimizer_state", process_set=process_set)
    if process_set.rank() != root_rank:
        optimizer.load_state_dict(state)

"""Helpers to start training from one rank's state: parameters, optimizer state, objects."""

import torch

from perseus.common.basics import rank
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
    ``root_rank`` is a rank of the job. The optimizer's ``param_groups`` list, its group
    dicts and its ``state`` stay the same objects, filled with the root's values: a
    learning-rate scheduler made before ``DistributedOptimizer`` wrapped the optimizer
    holds them, and must go on steering the wrapper's groups.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not optimizer.state:
        _create_state(optimizer)
    root = rank() == root_rank
    state = optimizer.state_dict() if root else None
    state = broadcast_object(state, root_rank, name="optimizer_state", process_set=process_set)
    if not root:
        groups, held = optimizer.param_groups, optimizer.state
        dicts = list(groups)
        optimizer.load_state_dict(state)  # casts and places the state as torch does
        for old, new in zip(dicts, optimizer.param_groups):
            old.update(new)
        groups[:] = dicts
        loaded = optimizer.state
        if loaded is not held:
            held.clear()
            held.update(loaded)
        optimizer.param_groups, optimizer.state = groups, held


def _create_state(optimizer):
    """Horovod's start of an optimizer that holds no state yet: every parameter that
    requires a gradient and has none gets a zero-filled ``.grad`` (code that reads the
    gradients right after, to broadcast them for one, finds them), and one step of the
    wrapped optimizer, reducing nothing, creates its state (momentum buffers, Adam's
    moments and step count) as Horovod's ``broadcast_optimizer_state`` does (a gradient
    already there is zeroed too, as there)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.LBFGS):
                    p.grad.requires_grad_(True)
    getattr(optimizer, "_step_locally", optimizer.step)()

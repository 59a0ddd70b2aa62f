"""torch's gradient clipping waits for a ``DistributedOptimizer``'s reductions in flight.

Between ``loss.backward()`` and ``step()`` the gradients are being averaged in place. A
clip then (``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` without
``optimizer.synchronize()`` first, which Horovod's documentation asks for) would read
and scale them while the reduction writes them: each rank gets other bytes, and the
ranks' weights part with no error. Once a ``DistributedOptimizer`` exists, torch's
clipping functions (``clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``
and ``get_total_norm``, under every name ``torch.nn.utils`` and its ``clip_grad`` module
give them) first wait for the reductions of the optimizers whose gradients they were given. They
then clip the averaged gradients, as Horovod's ``synchronize()``, clip, then
``skip_synchronize()`` pattern does, and ``step()`` does not synchronize again. A name
bound by ``from torch.nn.utils import clip_grad_norm_`` before the first
``DistributedOptimizer`` was made keeps torch's own function.
"""

import functools
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from perseus.torch import amp as _amp

_PATCHED = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm")
# The DistributedOptimizers alive in this process (each adds itself when made).
_optimizers = weakref.WeakSet()
_patched = False


def track(optimizer):
    """Makes torch's clipping functions wait for ``optimizer``'s reductions in flight
    (through its ``_wait_before_reading_grads()``); patches them the first time."""
    _optimizers.add(optimizer)
    _patch()


def _wait_for(tensors, given_grads):
    """Waits for the reductions of every tracked optimizer with reductions in flight
    that owns one of ``tensors`` (parameters, or with ``given_grads`` their gradients)."""
    busy = [opt for opt in list(_optimizers) if opt._handles]
    if not busy:
        return
    # Under AMP O2 the gradients of masters come from their model parameters.
    wanted = {id(t) for t in tensors} | {id(_amp.working(t)) for t in tensors}
    for opt in busy:
        if given_grads:
            mine = {id(p.grad) for p in opt._requires_update if p.grad is not None}
        else:
            mine = {id(p) for p in opt._requires_update}
        if wanted & mine:
            opt._wait_before_reading_grads()


def _waiting(func, given_grads):
    @functools.wraps(func)
    def clip(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        else:
            parameters = list(parameters)  # a generator is read once, here
        _wait_for(parameters, given_grads)
        return func(parameters, *args, **kwargs)

    clip._perseus_waits = True
    return clip


def _patch():
    global _patched
    if _patched:
        return
    _patched = True
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    for name in _PATCHED:
        func = getattr(torch.nn.utils, name, None)
        if func is None:
            continue  # an older torch
        waiting = _waiting(func, given_grads=name == "get_total_norm")
        # Every name the function has there: torch 2.15's clip_grad module calls its
        # own _get_total_norm and _clip_grads_with_norm_, exported without the "_".
        for module in modules:
            for attr in (name, "_" + name):
                if getattr(module, attr, None) is func:
                    setattr(module, attr, waiting)

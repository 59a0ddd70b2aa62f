"""torch's gradient clipping waits for a ``DistributedOptimizer``'s reductions in flight.

Between ``loss.backward()`` and ``step()`` the gradients are being averaged in place. A
clip then (``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` without
``optimizer.synchronize()`` first, which Horovod's documentation asks for) would read
and scale them while the reduction writes them: each rank gets other bytes, and the
ranks' weights part with no error. From ``import perseus.torch.horovod`` on, torch's
clipping functions (``clip_grad_norm_``, ``clip_grad_value_``, ``clip_grads_with_norm_``
and ``get_total_norm``, under their public names in ``torch.nn.utils`` and its
``clip_grad`` module) first wait for the reductions of the ``DistributedOptimizer``s
whose gradients they were given (none: they wait for nothing). They then clip the
averaged gradients, as Horovod's ``synchronize()``, clip, then ``skip_synchronize()``
pattern does, and ``step()`` does not synchronize again. A name bound by
``from torch.nn.utils import clip_grad_norm_`` before ``perseus.torch.horovod`` was
imported keeps torch's own function. Under the overlapped step some parameters have
stepped before such a clip, which cannot reach them: the first such clip warns. Under
``PERSEUS_ACCUMULATE_N_STEPS`` the calls within a window leave an optimizer's gradients
out: they hold a partial sum of this rank's own, so clipping them would clip each share
again at every call. Such a clip finds no gradient of that optimizer (``clip_grad_norm_``
returns a norm of 0 if it had no other), as after a ``GradScaler``'s ``unscale_`` there,
and the window's last call clips the reduced sum once.
"""

import functools
import threading
import warnings
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from perseus.torch import amp as _amp

_PATCHED = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm")
# torch's own functions, for Perseus's own clipping (the overlapped step clips each
# gradient as its reduction lands, while others are still in flight).
_TORCH = {name: getattr(torch.nn.utils, name) for name in _PATCHED
          if hasattr(torch.nn.utils, name)}
# Set on a thread while Perseus's own clipping runs torch's functions: nothing waits then.
_own = threading.local()
# The DistributedOptimizers alive in this process (each adds itself when made).
_optimizers = weakref.WeakSet()
# Those warned that the overlapped step had stepped parameters before a clip.
_warned = weakref.WeakSet()


def track(optimizer):
    """Makes torch's clipping functions wait for ``optimizer``'s reductions in flight
    (through its ``_wait_before_reading_grads()``)."""
    _optimizers.add(optimizer)


def torch_own(name):
    """torch's ``torch.nn.utils.<name>``, waiting for no reduction (nor do the clipping
    functions it calls)."""
    func = _TORCH[name]

    def own(*args, **kwargs):
        _own.running = True
        try:
            return func(*args, **kwargs)
        finally:
            _own.running = False

    return own


def _wait_for(tensors, given_grads, what):
    """Waits for the reductions of every tracked optimizer with reductions in flight
    that owns one of ``tensors`` (parameters, or with ``given_grads`` their gradients).
    Warns, once per optimizer, when some of them stepped already under the overlapped
    step: the clip ``what`` cannot reach those."""
    concerned = [opt for opt in list(_optimizers) if opt._handles or opt._overlapped]
    if not concerned:
        return
    # Under AMP O2 the gradients of masters come from their model parameters.
    wanted = {id(t) for t in tensors} | {id(_amp.working(t)) for t in tensors}

    def ids(params):
        if given_grads:
            return {id(p.grad) for p in params if p.grad is not None}
        return {id(p) for p in params}

    for opt in concerned:
        if not wanted & ids(opt._requires_update):
            continue
        if opt._overlapped and wanted & ids(opt._overlapped) and opt not in _warned:
            _warned.add(opt)
            warnings.warn(
                f"PERSEUS_OVERLAP_BACKWARD_AND_STEP=1: {len(opt._overlapped)} parameters "
                "stepped during backward, as soon as their averaged gradients landed, so "
                f"this {what} after backward reaches only those that have not stepped yet; "
                "let Perseus clip each gradient before its update instead "
                "(PERSEUS_CLIP_GRAD_FUNC=norm or value, PERSEUS_CLIP_GRAD_FUNC_PARAMS)",
                RuntimeWarning, stacklevel=3)
        if opt._handles:
            opt._wait_before_reading_grads()


def _outside_windows(tensors, given_grads):
    """``tensors`` (parameters, or with ``given_grads`` their gradients) less those of
    tracked optimizers within a PERSEUS_ACCUMULATE_N_STEPS window, whose gradients hold
    a partial, unreduced sum that only the window's last call may clip."""
    accumulating = [opt for opt in list(_optimizers) if opt._accumulating()]
    if not accumulating:
        return tensors
    left_out = set()
    for opt in accumulating:
        for w in opt._requires_update:
            if given_grads:
                if w.grad is not None:
                    left_out.add(id(w.grad))
            else:
                left_out.add(id(w))
    if given_grads:
        return [t for t in tensors if id(t) not in left_out]
    # A master's gradient comes from its model parameter (AMP O2).
    return [t for t in tensors
            if id(t) not in left_out and id(_amp.working(t)) not in left_out]


def _waiting(func, given_grads, value_clip):
    @functools.wraps(func)
    def clip(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        else:
            parameters = list(parameters)  # a generator is read once, here
        if not getattr(_own, "running", False):
            _wait_for(parameters, given_grads, func.__name__)
            parameters = _outside_windows(parameters, given_grads)
            if value_clip and all(p.grad is None for p in parameters):
                # torch's clip_grad_value_ fails on no gradient at all, which a window
                # (or a GradScaler's unscale_ within one) leaves.
                return None
        return func(parameters, *args, **kwargs)

    return clip


def _patch():
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    for name, func in _TORCH.items():  # an older torch lacks some
        waiting = _waiting(func, given_grads=name == "get_total_norm",
                           value_clip=name == "clip_grad_value_")
        # The public names only: torch's own functions call private ones (torch 2.15's
        # clip_grad_norm_ calls _get_total_norm), which must not wait, so that the
        # overlapped step's clipping (torch_own) never waits for the reductions.
        for module in modules:
            if getattr(module, name, None) is func:
                setattr(module, name, waiting)


# At import, so that names a script binds after ``import perseus.torch.horovod`` wait.
_patch()

"""AMP O2: a model in float16 (or bfloat16) with float32 master weights in the optimizer.

Seed 001's ``aiak_amp_decorate``: one call after building the model and the optimizer,
before ``DistributedDataParallel`` or ``hvd.DistributedOptimizer``, and the native torch
AMP loop (``autocast``, ``GradScaler``) runs unchanged::

    model, optimizer = perseus.torch.amp.amp_decorate(model, optimizer)
    scaler = torch.amp.GradScaler()
    ...
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(perseus.torch.amp.amp_parameters(optimizer), max_norm)
    scaler.step(optimizer)
    scaler.update()

What it does:

- The model's floating parameters and buffers become ``dtype``, except those of batch
  norm layers with ``keep_batchnorm_fp32``. Its ``forward`` casts floating inputs to
  ``dtype`` and floating outputs to float32.
- Each parameter it cast is replaced, in the optimizer's groups, by a float32 *master*
  copy of its cast value (its state, if any, moves along): every rank's masters then
  equal what its model holds, whichever rank's weights are broadcast. The optimizer updates the
  masters; after each step they are copied into the model.
- Backward leaves half-precision gradients on the model. Before they are read
  (``GradScaler.unscale_``, the optimizer's ``step``, :func:`amp_parameters`) they are
  *moved*: added into the masters' float32 gradients, and the model's cleared, so
  accumulation over several backward passes sums exactly as torch would.
- With ``hvd.DistributedOptimizer`` the reductions run on the model's half-precision
  gradients (half the bytes), and the move follows them. ``GradScaler.unscale_`` on such
  an optimizer first waits for the reductions, so the plain AMP loop needs no
  ``synchronize()``; the Horovod recipe (``synchronize()``, then ``step()`` within
  ``skip_synchronize()``) works too. The same holds for an ``hvd.DistributedOptimizer``
  without ``amp_decorate`` (torch's own AMP, float32 weights): ``unscale_`` checks for
  infs in the reduced gradients, never in gradients that the core is still writing, so
  every rank skips an overflowed step, or none does.
- A model weight written from outside (``hvd.broadcast_parameters``,
  ``model.load_state_dict``) is seen by its version counter, and its master is refreshed
  from it before the next step.
- A ``GradScaler`` that has unscaled a decorated optimizer keeps its scale within
  ``min_loss_scale``/``max_loss_scale`` in ``update``, or at ``loss_scale`` when that
  is a number.
"""

import types
import weakref
from collections import defaultdict

import torch
from torch.utils.weak import WeakIdKeyDictionary

try:  # torch 2.3 and later: one GradScaler for every device, torch.cuda.amp's its subclass
    from torch.amp import grad_scaler as _grad_scaler
except ImportError:  # torch 2.1 and 2.2: CUDA's is the only one
    from torch.cuda.amp import grad_scaler as _grad_scaler

OptState = _grad_scaler.OptState
_refresh_per_optimizer_state = _grad_scaler._refresh_per_optimizer_state

__all__ = ["amp_decorate", "amp_parameters", "is_decorated"]

_HALF = (torch.float16, torch.bfloat16)
_BATCHNORM = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.SyncBatchNorm)


class _Link:
    """A model parameter and its master, with the model's version last seen and the
    scale bounds of the ``amp_decorate`` call that made it."""

    __slots__ = ("bounds", "model", "version")

    def __init__(self, model, bounds):
        self.model = model
        self.version = model._version
        self.bounds = bounds


# master parameter -> _Link; weak, so a dropped optimizer frees its masters (keyed by
# identity: tensors compare elementwise).
_links = WeakIdKeyDictionary()


def is_decorated(optimizer):
    """True when ``optimizer`` holds master weights made by :func:`amp_decorate`."""
    return any(p in _links for g in optimizer.param_groups for p in g["params"])


def pairs(optimizer):
    """(model parameter, master) for each master in ``optimizer``'s groups."""
    return [(_links[p].model, p) for g in optimizer.param_groups for p in g["params"]
            if p in _links]


def working(param):
    """The tensor backward writes ``param``'s gradient into: its model parameter for a
    master, else ``param`` itself."""
    link = _links.get(param)
    return param if link is None else link.model


def move_grads(optimizer):
    """Adds the model's gradients into the masters' (float32) and clears the model's.
    Refreshes first any master whose model weight was written from outside. An
    ``hvd.DistributedOptimizer`` first waits for its reductions in flight."""
    if _accumulating(optimizer):
        return
    before = getattr(optimizer, "_wait_before_reading_grads", None)
    if before is not None:
        before()
    for model_p, master in pairs(optimizer):
        link = _links[master]
        if model_p._version != link.version:
            with torch.no_grad():
                master.copy_(model_p)
            link.version = model_p._version
        g = model_p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.to_dense()
        if master.grad is None:
            master.grad = g.to(torch.float32, copy=True)
        else:
            master.grad.add_(g)
        model_p.grad = None


def _accumulating(optimizer):
    """True when ``optimizer`` is an ``hvd.DistributedOptimizer`` whose next ``step()``
    only accumulates (``PERSEUS_ACCUMULATE_N_STEPS``): its gradients are a partial,
    unreduced sum, to be left where backward writes them."""
    accumulating = getattr(optimizer, "_accumulating", None)
    return accumulating is not None and accumulating()


def copy_to_model(optimizer):
    """Writes the masters into the model (cast to its dtype) after a step."""
    links = pairs(optimizer)
    if not links:
        return
    models = [m for m, _ in links]
    with torch.no_grad():
        try:
            torch._foreach_copy_(models, [p for _, p in links])
        except (RuntimeError, TypeError):
            for m, p in links:
                m.copy_(p)
    for m, p in links:
        _links[p].version = m._version


def amp_parameters(optimizer):
    """The parameters ``optimizer`` updates (float32 masters where ``amp_decorate`` made
    them), with the model's latest gradients moved onto them: what gradient clipping
    should see (seed 001's ``aiak_amp_parameters``)."""
    move_grads(optimizer)
    for group in optimizer.param_groups:
        yield from group["params"]


def amp_decorate(model, optimizer, keep_batchnorm_fp32=True, loss_scale=None, num_losses=1,
                 min_loss_scale=None, max_loss_scale=2.0 ** 24, dtype=torch.float16):
    """Puts ``model`` in ``dtype`` with float32 master weights in ``optimizer`` (AMP O2).

    Arguments:
        model: a ``torch.nn.Module``, or a list of them, all of whose parameters the
            optimizer may hold.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters, not yet
            wrapped by ``hvd.DistributedOptimizer`` (wrap it after this call).
        keep_batchnorm_fp32: batch norm layers stay float32.
        loss_scale: None or ``"dynamic"`` lets ``GradScaler`` adapt the scale; a number
            holds it there.
        num_losses: accepted for compatibility (one ``GradScaler`` serves every loss).
        min_loss_scale, max_loss_scale: bounds on the dynamic scale.
        dtype: ``torch.float16`` (O2) or ``torch.bfloat16``.

    Returns ``(model, optimizer)``, the same objects, changed in place.
    """
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in models:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"amp_decorate: model must be a torch.nn.Module, not "
                            f"{type(m).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"amp_decorate: optimizer must be a torch.optim.Optimizer, not "
                        f"{type(optimizer).__name__}")
    if hasattr(optimizer, "synchronize"):
        raise ValueError("amp_decorate: call it before hvd.DistributedOptimizer wraps the "
                         "optimizer")
    if dtype not in _HALF:
        raise ValueError(f"amp_decorate: dtype must be torch.float16 or torch.bfloat16, "
                         f"not {dtype}")
    if is_decorated(optimizer):
        raise RuntimeError("amp_decorate: this optimizer is already decorated")
    fixed = _check_scales(loss_scale, num_losses, min_loss_scale, max_loss_scale)

    keep = set()
    for m in models:
        for module in m.modules():
            if keep_batchnorm_fp32 and isinstance(module, _BATCHNORM):
                keep.update(id(p) for p in module.parameters(recurse=False))
    cast = {}
    for m in models:
        for p in m.parameters():
            if p.is_floating_point() and p.dtype == torch.float32 and id(p) not in keep:
                cast[id(p)] = p
    masters = {}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if id(p) not in cast:
                continue
            # From the rounded value, as every rank's model will hold it: a rank whose
            # weights are then broadcast from another refreshes its masters from them,
            # and must end with the same masters as the root.
            master = torch.nn.Parameter(p.detach().to(dtype).to(torch.float32),
                                        requires_grad=p.requires_grad)
            if p.grad is not None:
                master.grad = p.grad.detach().clone()
            masters[id(p)] = master
            group["params"][i] = master
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[master] = state

    for m in models:
        for module in m.modules():
            if keep_batchnorm_fp32 and isinstance(module, _BATCHNORM):
                continue
            _cast_module(module, dtype)
        _patch_forward(m, dtype)
    bounds = {"fixed": fixed, "min": min_loss_scale, "max": max_loss_scale}
    for pid, master in masters.items():
        model_p = cast[pid]
        model_p.grad = None
        _links[master] = _Link(model_p, bounds)
    patch_grad_scaler()
    _patch_optimizer(optimizer)
    return model, optimizer


def _check_scales(loss_scale, num_losses, min_loss_scale, max_loss_scale):
    """Validates the scale arguments; returns the fixed scale or None."""
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp_decorate: num_losses must be an integer >= 1, not "
                         f"{num_losses!r}")
    for name, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not v > 0):
            raise ValueError(f"amp_decorate: {name} must be a number > 0 or None, not {v!r}")
    if min_loss_scale is not None and max_loss_scale is not None \
            and min_loss_scale > max_loss_scale:
        raise ValueError(f"amp_decorate: min_loss_scale {min_loss_scale} is above "
                         f"max_loss_scale {max_loss_scale}")
    if loss_scale is None or loss_scale == "dynamic":
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
            or not loss_scale > 0:
        raise ValueError(f"amp_decorate: loss_scale must be None, 'dynamic' or a number > 0, "
                         f"not {loss_scale!r}")
    return float(loss_scale)


def _cast_module(module, dtype):
    """Casts the module's own float32 parameters and buffers, keeping the Parameter
    objects (the optimizer and hooks hold them)."""
    for p in module.parameters(recurse=False):
        if p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.dtype == torch.float32:
            setattr(module, name, b.to(dtype))


def _convert(value, dtype):
    """``value`` with every floating tensor in it cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_convert(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _convert(v, dtype)) for k, v in value.items())
    return value


def _patch_forward(model, dtype):
    """``model.forward`` casts floating inputs to ``dtype`` and floating outputs to
    float32."""
    inner = model.forward

    def forward(*args, **kwargs):
        out = inner(*_convert(args, dtype), **_convert(kwargs, dtype))
        return _convert(out, torch.float32)

    model.forward = forward


def _patch_optimizer(optimizer):
    """The plain optimizer's ``step`` moves the gradients first and copies the masters
    into the model after; its ``zero_grad`` clears the model's gradients too.
    (``hvd.DistributedOptimizer`` does the same in its own methods.)"""
    step, zero_grad = optimizer.step, optimizer.zero_grad

    # Bound methods, as torch's LR schedulers expect of ``optimizer.step``.
    def amp_step(self, *args, **kwargs):
        move_grads(self)
        result = step(*args, **kwargs)
        copy_to_model(self)
        return result

    def amp_zero_grad(self, set_to_none=True):
        for model_p, _ in pairs(self):
            model_p.grad = None
        return zero_grad(set_to_none=set_to_none)

    amp_step.__doc__ = step.__doc__
    amp_zero_grad.__doc__ = zero_grad.__doc__
    optimizer.step = types.MethodType(amp_step, optimizer)
    optimizer.zero_grad = types.MethodType(amp_zero_grad, optimizer)


_scaler_patched = False
# GradScalers with scaling on that have scaled a loss since their last update().
_scaling = weakref.WeakSet()


def grad_scaler_in_use():
    """Whether a ``GradScaler`` with scaling on has scaled a loss and not yet finished its
    iteration with ``update()`` (seen once :func:`patch_grad_scaler` ran): gradients that
    backward produces meanwhile may be multiplied by its scale."""
    return len(_scaling) > 0


def _hold(scaler, optimizer):
    """``unscale_`` within a ``PERSEUS_ACCUMULATE_N_STEPS`` window: the gradients are a
    partial sum, each call's share multiplied by the same scale, so none is divided yet;
    they are hidden until ``step()`` (clipping them would clip a partial sum) and the
    scaler records no overflow, so every rank takes the ``step()`` that only counts.
    ``update()`` then keeps the scale. The window's last call unscales the reduced sum
    once, and an overflow anywhere in the window shows there, on every rank."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the "
                           "last update().")
    if state["stage"] is OptState.STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    scale, _ = scaler._check_scale_growth_tracker("unscale_")
    optimizer._hide_grads()
    state["found_inf_per_device"] = {scale.device: torch.zeros((), dtype=torch.float32,
                                                               device=scale.device)}
    state["stage"] = OptState.UNSCALED
    scaler._perseus_holding = True


def patch_grad_scaler():
    """Once per process: ``GradScaler.unscale_`` waits for an ``hvd.DistributedOptimizer``'s
    reductions in flight and moves a decorated optimizer's gradients first (under
    ``op=Adasum``, which unscales each rank's own gradients, the ranks then agree on an
    overflow), and a scaler
    that has unscaled a decorated one keeps its scale within that decoration's bounds in
    ``update``. Under ``PERSEUS_ACCUMULATE_N_STEPS`` the calls within a window hold the
    scale and leave the gradients scaled (:func:`_hold`); a ``step`` that the scaler
    skips for an overflow ends the window."""
    global _scaler_patched
    if _scaler_patched:
        return
    _scaler_patched = True
    scaler = _grad_scaler.GradScaler
    unscale, update, scale, step = scaler.unscale_, scaler.update, scaler.scale, scaler.step

    def scale_(self, outputs):
        if self.is_enabled():
            _scaling.add(self)
        return scale(self, outputs)

    def unscale_(self, optimizer):
        if self.is_enabled() and _accumulating(optimizer):
            return _hold(self, optimizer)
        before = getattr(optimizer, "_wait_before_reading_grads", None)  # hvd.DistributedOptimizer
        if before is not None:
            before()
        links = pairs(optimizer)
        if links:
            self._perseus_amp_bounds = _links[links[0][1]].bounds
            move_grads(optimizer)
        result = unscale(self, optimizer)
        agree = getattr(optimizer, "_overflow_anywhere", None)  # op=Adasum: own gradients
        if agree is not None and self.is_enabled():
            agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])
        return result

    def step_(self, optimizer, *args, **kwargs):
        calls = getattr(optimizer, "_step_calls", None)
        result = step(self, optimizer, *args, **kwargs)
        if calls is not None and optimizer._step_calls == calls:
            optimizer._step_skipped()
        return result

    def update_(self, new_scale=None):
        _scaling.discard(self)
        if getattr(self, "_perseus_holding", False) and self.is_enabled():
            # An explicit new scale waits for the window's end, as the automatic one does.
            self._perseus_holding = False
            if new_scale is not None:
                self._perseus_new_scale = new_scale
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            return None
        if new_scale is None:
            new_scale = getattr(self, "_perseus_new_scale", None)
        self._perseus_new_scale = None
        result = update(self, new_scale)
        bounds = getattr(self, "_perseus_amp_bounds", None)
        if bounds and self.is_enabled() and self._scale is not None:
            if bounds["fixed"] is not None:
                self._scale.fill_(bounds["fixed"])
            elif bounds["min"] is not None or bounds["max"] is not None:
                self._scale.clamp_(min=bounds["min"], max=bounds["max"])
        return result

    unscale_.__doc__ = unscale.__doc__
    update_.__doc__ = update.__doc__
    scale_.__doc__ = scale.__doc__
    step_.__doc__ = step.__doc__
    scaler.unscale_ = unscale_
    scaler.update = update_
    scaler.scale = scale_
    scaler.step = step_

"""Fused optimizers (seed 001's fused optimizer and LAMB), run by the Rust core.

Each parameter's whole update (weight decay, moments, bias correction, the step) is one
pass over its memory: on the CPU the passes are shared among the cores, on a GPU they are
the core's NVRTC kernels queued on Perseus's stream (ordered after and before torch's
current stream by events). ::

    from perseus.torch import optim
    optimizer = optim.LAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

:class:`FusedSGD`, :class:`FusedAdam` and :class:`FusedAdamW` take torch.optim's
arguments and keep torch's state (``momentum_buffer``; ``step``, ``exp_avg``,
``exp_avg_sq``), so a state dict moves between them and torch's classes.
``PERSEUS_FUSED_OPTIMIZER=1`` makes ``hvd.DistributedOptimizer`` take the steps of a
wrapped ``torch.optim.SGD``, ``Adam`` or ``AdamW`` this way, unchanged otherwise.
Parameters must be float32 and contiguous, gradients dense (docs/optimizers.md).
"""

import inspect

import torch
from torch.utils.dlpack import to_dlpack

from perseus import _core
from perseus.torch._stream import ordered

__all__ = ["LAMB", "FusedAdam", "FusedAdamW", "FusedLAMB", "FusedOptimizer", "FusedSGD"]


# --------------------------------------------------------------------------- the step


def _diagnose(optimizer, plan):
    """Names the parameter the core could not take (called after it refused a step):
    a sparse gradient, a dtype other than float32, or memory that is not contiguous."""
    for gi, (_, _, group) in enumerate(plan):
        label = f"{type(optimizer).__name__} group {gi}"
        params = [p for p in group["params"] if p.grad is not None]
        for i, p in enumerate(params):
            g = p.grad
            if g.is_sparse:
                raise RuntimeError(f"{label}: parameter {i} has a sparse gradient; fused "
                                   "optimizers take dense gradients")
            if p.dtype != torch.float32:
                raise TypeError(f"{label}: parameter {i} is {p.dtype}; fused optimizers "
                                "update float32 parameters")
            if not p.is_contiguous() or not g.is_contiguous():
                raise ValueError(f"{label}: parameter {i} or its gradient is not contiguous")


def _slots(state_of, params, kind, hyper, step_tensor):
    """The core's slots for ``params`` (those with gradients): capsules of the weight,
    the gradient and the state (created on first use, as torch creates it; ``step`` as a
    tensor, as torch keeps it, when ``step_tensor``) and the step count. Returns the
    slots and, for ``step`` tensors, (slot index, tensor) to advance."""
    slots, step_tensors = [], []
    if kind == "sgd":
        if hyper["momentum"] == 0:
            return [(to_dlpack(p), to_dlpack(p.grad), (), 1) for p in params], []
        for p in params:
            state = state_of[p]
            buf = state.get("momentum_buffer")
            step = 2
            if buf is None:
                buf = state["momentum_buffer"] = torch.empty_like(
                    p, memory_format=torch.contiguous_format)
                step = 1
            slots.append((to_dlpack(p), to_dlpack(p.grad), (to_dlpack(buf),), step))
        return slots, []
    for p in params:
        state = state_of[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0) if step_tensor else 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        step = state["step"]
        if type(step) is int:
            step = state["step"] = step + 1
        else:
            step_tensors.append((len(slots), step))
        slots.append((to_dlpack(p), to_dlpack(p.grad),
                      (to_dlpack(state["exp_avg"]), to_dlpack(state["exp_avg_sq"])), step))
    return slots, step_tensors


def run_step(optimizer, plan, torch_state=False):
    """One fused step. ``plan``: per parameter group, ``(kind, hyper, group)``; state
    lives in ``optimizer.state`` under torch's names (``torch_state``: created exactly as
    torch's own step would, for a torch.optim optimizer)."""
    groups = []
    device = None
    with torch.no_grad():
        try:
            for kind, hyper, group in plan:
                params = [p for p in group["params"] if p.grad is not None]
                if device is None and params:
                    device = params[0].device
                slots, step_tensors = _slots(optimizer.state, params, kind, hyper,
                                             torch_state)
                if step_tensors:
                    ts = [t for _, t in step_tensors]
                    torch._foreach_add_(ts, 1)
                    for (k, _), value in zip(step_tensors, torch.stack(ts).tolist()):
                        slots[k] = (*slots[k][:3], int(value))
                groups.append((kind, hyper, slots))
            if device is None:
                return
            if device.type != "cuda":
                _core.optimizer_step(groups)
                return
            # Torch's stream waits for the step: what it reads or frees later comes after.
            with ordered(device):
                _core.optimizer_step(groups)
        except (RuntimeError, TypeError, ValueError):
            _diagnose(optimizer, plan)
            raise


def _betas(group):
    b1, b2 = group["betas"]
    return float(b1), float(b2)


def _sgd_hyper(group):
    return {"lr": float(group["lr"]), "momentum": float(group["momentum"]),
            "dampening": float(group["dampening"]),
            "weight_decay": float(group["weight_decay"]),
            "nesterov": float(bool(group["nesterov"])),
            "maximize": float(bool(group.get("maximize", False)))}


def _adam_hyper(group):
    b1, b2 = _betas(group)
    return {"lr": float(group["lr"]), "beta1": b1, "beta2": b2, "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "maximize": float(bool(group.get("maximize", False)))}


def torch_rule(optimizer, step):
    """The fused plan of ``optimizer``'s next step when ``step`` (the step function that
    would run) is ``torch.optim.SGD``'s or ``Adam``'s (AdamW's is Adam's) and every
    group and tensor suits the fused step; else ``(None, why)``. Used by
    ``DistributedOptimizer`` under PERSEUS_FUSED_OPTIMIZER=1."""
    raw = inspect.unwrap(getattr(step, "__func__", step))
    if raw is inspect.unwrap(torch.optim.SGD.step):
        kind = "sgd"
    elif raw is inspect.unwrap(torch.optim.Adam.step):
        kind = "adam"
    else:
        return None, f"{type(optimizer).__name__} is not torch.optim.SGD, Adam or AdamW"
    plan = []
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return None, "differentiable=True"
        if kind == "sgd":
            plan.append(("sgd", _sgd_hyper(group), group))
            continue
        if group.get("amsgrad", False):
            return None, "amsgrad=True"
        if group.get("capturable", False):
            return None, "capturable=True"
        decoupled = group.get("decoupled_weight_decay",
                              isinstance(optimizer, torch.optim.AdamW))
        plan.append(("adamw" if decoupled else "adam", _adam_hyper(group), group))
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if p.dtype != torch.float32:
                return None, f"a parameter is {p.dtype} (the fused step takes float32)"
            if g.is_sparse:
                return None, "a gradient is sparse"
            if not (p.is_contiguous() and g.is_contiguous()):
                return None, "a parameter or gradient is not contiguous"
            for t in optimizer.state.get(p, {}).values():
                if isinstance(t, torch.Tensor) and t.dim() and not t.is_contiguous():
                    return None, "optimizer state is not contiguous"
    return plan, None


# --------------------------------------------------------------------------- the classes

class FusedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose ``step`` is the core's fused step."""

    def _plan(self):
        """Per parameter group: ``(kind, hyper-parameters, group)`` for the core."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """One fused step; ``closure`` (re-evaluating the loss) runs first, with grad."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        run_step(self, self._plan())
        return loss


class FusedSGD(FusedOptimizer):
    """SGD with momentum, dampening, weight decay and Nesterov, as ``torch.optim.SGD``."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                      "weight_decay": weight_decay, "nesterov": nesterov,
                                      "maximize": maximize})

    def _plan(self):
        return [("sgd", _sgd_hyper(g), g) for g in self.param_groups]


def _check_adam_args(lr, betas, eps, weight_decay):
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class FusedAdam(FusedOptimizer):
    """Adam, as ``torch.optim.Adam``; ``adam_w_mode=True`` is AdamW (decoupled decay)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, adam_w_mode=False, maximize=False):
        _check_adam_args(lr, betas, eps, weight_decay)
        if amsgrad:
            raise ValueError("the fused Adam has no amsgrad variant; use torch.optim.Adam")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                      "weight_decay": weight_decay, "adam_w_mode": adam_w_mode,
                                      "maximize": maximize})

    def _plan(self):
        return [("adamw" if g["adam_w_mode"] else "adam", _adam_hyper(g), g)
                for g in self.param_groups]


class FusedAdamW(FusedAdam):
    """AdamW, as ``torch.optim.AdamW`` (weight decay 0.01 by default)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode=True,
                         maximize=maximize)


class FusedLAMB(FusedOptimizer):
    """LAMB (layer-wise adaptive moments, for very large batches), with seed 001's
    arguments.

    Per step: the gradients are scaled down when their global norm (over every group)
    exceeds ``max_grad_norm`` (0: never); each parameter's Adam-style update (with
    ``weight_decay * w`` added in ``adam_w_mode``, or the decay in the gradient without
    it) is scaled by the trust ratio ``|w| / |update|``. ``always_adapt=False`` applies
    the ratio only with weight decay, as apex's FusedLAMB does. ``set_grad_none``:
    ``zero_grad()`` sets gradients to None.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, grad_averaging=True, set_grad_none=True,
                 max_grad_norm=1.0, bias_correction=True, always_adapt=True):
        _check_adam_args(lr, betas, eps, weight_decay)
        if max_grad_norm < 0.0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                      "weight_decay": weight_decay, "adam_w_mode": adam_w_mode,
                                      "grad_averaging": grad_averaging,
                                      "max_grad_norm": max_grad_norm,
                                      "bias_correction": bias_correction,
                                      "always_adapt": always_adapt})
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none=None):
        """Clear the gradients: to None when ``set_grad_none`` (the default)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None
                          else set_to_none)

    def _plan(self):
        plan = []
        for g in self.param_groups:
            b1, b2 = _betas(g)
            plan.append(("lamb", {
                "lr": float(g["lr"]), "beta1": b1, "beta2": b2, "eps": float(g["eps"]),
                "weight_decay": float(g["weight_decay"]),
                "adam_w_mode": float(bool(g["adam_w_mode"])),
                "grad_averaging": float(bool(g["grad_averaging"])),
                "bias_correction": float(bool(g["bias_correction"])),
                "max_grad_norm": float(g["max_grad_norm"]),
                "always_adapt": float(bool(g["always_adapt"]))}, g))
        return plan


LAMB = FusedLAMB

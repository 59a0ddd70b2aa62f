"""Seed 001's (AIAK-Training's) names in torch's own namespaces, set by ``import perseus``
once torch is imported, so that its scripts run unchanged:

- ``torch.cuda.amp.aiak_amp_decorate`` and ``torch.cuda.amp.aiak_amp_parameters``:
  :func:`perseus.torch.amp.amp_decorate` and :func:`~perseus.torch.amp.amp_parameters`
  (AMP O2, docs/amp.md);
- ``torch.optim.LAMB``: :class:`perseus.torch.optim.LAMB` (docs/optimizers.md);
- with ``AIAK_FUSED_OPTIMIZER=1`` (or ``PERSEUS_FUSED_OPTIMIZER=1``, which wins) in the
  environment, the steps of ``torch.optim.SGD``, ``Adam`` and ``AdamW`` are the core's
  fused step, with or without ``hvd.DistributedOptimizer`` (seed 001 sets the variable
  for DDP jobs). Where a step cannot be fused (``amsgrad``, a float16 parameter...)
  torch's runs, and the first time the reason is warned.

Names torch has already are left alone.
"""

import functools
import warnings


def install():
    """Set the names in torch's namespaces (idempotent)."""
    import torch

    from perseus.common.gradients import fused_optimizer_wanted
    from perseus.torch import amp, optim

    for name, value in (("aiak_amp_decorate", amp.amp_decorate),
                        ("aiak_amp_parameters", amp.amp_parameters)):
        if not hasattr(torch.cuda.amp, name):
            setattr(torch.cuda.amp, name, value)
    if not hasattr(torch.optim, "LAMB"):
        torch.optim.LAMB = optim.LAMB
    if fused_optimizer_wanted():
        for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
            if "step" in vars(cls) and not hasattr(vars(cls)["step"], "_perseus_fused"):
                cls.step = _fused_step(vars(cls)["step"])


def _fused_step(torch_step):
    """``torch_step`` (a torch.optim class's own step) as the core's fused step."""
    from perseus.torch import optim

    @functools.wraps(torch_step)
    def step(self, closure=None):
        plan, why = optim.torch_rule(self, torch_step)
        if plan is None:
            if getattr(self, "_perseus_fused_refused", None) != why:
                self._perseus_fused_refused = why
                warnings.warn(f"AIAK_FUSED_OPTIMIZER: {why}, so torch's own step runs",
                              RuntimeWarning, stacklevel=2)
            return torch_step(self, closure)
        import torch

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            optim.run_step(self, plan, torch_state=True)
        return loss

    step._perseus_fused = True
    return step

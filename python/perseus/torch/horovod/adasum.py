"""``DistributedOptimizer(op=Adasum)``: each rank steps on its own gradients, then the
ranks' weight changes combine by Adasum (Horovod's delta optimizer).

One step, for every parameter ``w`` that requires a gradient::

    start = w                 # the same on every rank
    w = wrapped_step(w, g)    # the wrapped optimizer, on this rank's gradient only
    w = start + Adasum(w - start)

Adasum (``allreduce(op=Adasum)``, docs/core-api.md) adds orthogonal changes and averages
parallel ones, so the learning rate is the one of a single rank. The optimizer's own
state (momentum, Adam's moments) stays each rank's own, as under Horovod.

Unlike Horovod, which steps each parameter from its gradient hook with the other
parameters hidden from the optimizer, the wrapped optimizer takes one whole step in
``step()``: optimizers that look at all parameters at once (a global norm) keep their
meaning. The weight changes go out together there, fused by the core.
"""

from contextlib import contextmanager

import torch

from perseus.common.gradients import warn_adasum_unapplied
from perseus.common.ops import Adasum, Max
from perseus.common.process_sets import global_process_set
from perseus.torch import amp as _amp
from perseus.torch.horovod.mpi_ops import allreduce, allreduce_async_, synchronize
from perseus.torch.horovod.parameter_names import name_added_group, parameter_names


class _DistributedAdasumOptimizer:
    """Mixed into the wrapped optimizer's class for ``op=Adasum`` (see the module)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 process_set=global_process_set):
        super().__init__(params)
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = Adasum
        self.process_set = process_set
        # Each parameter's value before the local step, kept between steps (no allocation
        # per step).
        self._starts = {}
        warn_adasum_unapplied(stacklevel=4)
        # GradScaler.unscale_ lets the ranks agree on an overflow (_overflow_anywhere()).
        _amp.patch_grad_scaler()

    def add_param_group(self, param_group):
        """torch's ``add_param_group``; the new group's weight changes are combined like
        the others' (under the names ``parameter_names.name_added_group`` gives)."""
        super().add_param_group(param_group)
        if "_parameter_names" not in self.__dict__:
            return  # torch's __init__ adding the wrapped optimizer's groups
        name_added_group(self._parameter_names, self.param_groups)

    def set_backward_passes_per_step(self, passes):
        """Backward passes accumulated locally per step (gradients add up in ``.grad``
        until ``step()``)."""
        self.backward_passes_per_step = passes

    def synchronize(self):
        """Nothing to wait for: the weight changes are reduced inside ``step()``."""

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using the "
                             "Adasum optimizer: its step() reduces the weight changes")
        yield  # pragma: no cover

    def _overflow_anywhere(self, found_inf_per_device):
        """Called by ``GradScaler.unscale_`` with the overflow flags it found in this rank's
        own gradients (each rank steps on its own here, unlike the averaging optimizer,
        whose gradients are already reduced): the flags become whether any rank of the set
        found one, so every rank skips the step or none does. A rank skipping alone would
        leave the others waiting in the weight changes' reduction, and its next step's
        changes would then pair with their current ones."""
        flags = list(found_inf_per_device.values())
        mine = torch.zeros(1, dtype=torch.float32)
        for f in flags:
            mine = torch.maximum(mine, f.detach().reshape(1).to("cpu", torch.float32))
        anywhere = allreduce(mine, name="adasum.overflow", op=Max,
                             process_set=self.process_set).item()
        for f in flags:
            f.fill_(anywhere)

    def _trainable(self):
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _step_locally(self):
        """The wrapped optimizer's own step on this rank's gradients, reducing nothing:
        ``broadcast_optimizer_state``'s zero-gradient step that creates the state."""
        return super().step()

    def step(self, closure=None):
        """The wrapped optimizer's step on this rank's gradients, then the weights of every
        rank set to the start plus the Adasum of the ranks' changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._trainable()
        with torch.no_grad():
            for p in params:
                start = self._starts.get(p)
                if start is None or start.shape != p.shape or start.dtype != p.dtype:
                    self._starts[p] = start = torch.empty_like(p)
                start.copy_(p)
            super().step()
            pending = []
            for p in params:
                delta = p.sub(self._starts[p])
                wire, ctx = self._compression.compress(delta)
                handle = allreduce_async_(wire, name=f"adasum.{self._parameter_names[p]}",
                                          op=Adasum, process_set=self.process_set)
                pending.append((p, handle, ctx))
            for p, handle, ctx in pending:
                combined = self._compression.decompress(synchronize(handle), ctx)
                p.copy_(self._starts[p].add_(combined.to(p.dtype)))
        return loss

"""The PERSEUS_* gradient switches on DistributedDataParallel's buckets
(docs/torch_distributed.md), as ``DistributedOptimizer`` applies them to its gradients:

- PERSEUS_ALLREDUCE_FUSION=N cuts the model's gradients into about N buckets
  (:func:`bucket_cap_mb`) and sets the core's fusion threshold to one bucket's bytes;
- PERSEUS_ACCUMULATE_N_STEPS=N keeps N-1 backward passes local (each bucket adds into
  a sum of its own) and reduces their average at the N-th; the optimizers that hold the
  model's parameters skip the steps in between (:func:`skip_held_steps`);
- PERSEUS_ALLREDUCE_NANCHECK=1 checks each reduced bucket and fails backward on every
  rank (torch raises a ``RuntimeError`` carrying our ``FloatingPointError``), naming the
  bucket's parameters and the ranks whose own gradient was not finite;
- PERSEUS_DOWNSAMPLE_N_ELEMENTS with PERSEUS_GRADIENT_MOMENTUM sends a rotating slice
  of each bucket's residual (perseus.common.downsample);
- PERSEUS_PERF_CHECK_N_STEPS=N compares the ranks' compute times every N steps.

A step is one backward pass that reduces: DDP hands its buckets to the hook in index
order on every rank, so bucket 0 starts a step everywhere, whatever forwards ran for
evaluation in between.
"""

import time
import warnings
import weakref

import torch

from perseus.common.downsample import DownSampler
from perseus.common.gradients import Switches, perf_check, raise_nonfinite

__all__ = ["BucketSwitches", "bucket_cap_mb", "fusion_threshold", "skip_held_steps",
           "unapplied_with_own_hook"]

# The name a switch's findings carry (perf check, NaN check).
_WHERE = "DistributedDataParallel"


def _switches():
    """The switches as this process's environment sets them (before init too: a DDP
    model's buckets are laid out before Perseus starts)."""
    return Switches(None)


def _trained_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def bucket_cap_mb(module, given):
    """PERSEUS_ALLREDUCE_FUSION=N: DDP's ``bucket_cap_mb`` that cuts ``module``'s
    trained parameters into about N buckets (0: one bucket per parameter); None when
    the variable is unset. ``given`` is the script's own ``bucket_cap_mb`` (None: not
    given), which the switch replaces, saying so."""
    switches = _switches()
    cap = switches.fusion_threshold(_trained_bytes(module))
    if cap is None:
        return None
    mb = cap / 2**20
    if given is not None and given != mb:
        warnings.warn(f"PERSEUS_ALLREDUCE_FUSION={switches.fusion} sets this "
                      f"DistributedDataParallel's buckets to {mb:.4g} MiB in place of its "
                      f"bucket_cap_mb={given}", RuntimeWarning, stacklevel=4)
    return mb


def fusion_threshold(module):
    """The core's fusion threshold for ``module``'s gradients under
    PERSEUS_ALLREDUCE_FUSION (None: unset): one bucket's bytes."""
    return _switches().fusion_threshold(_trained_bytes(module))


class BucketSwitches:
    """The switches' state for one DDP model: accumulated sums by parameter,
    down-sampling residuals by bucket layout, the step count, and the perf check's times.
    ``names`` maps each parameter to its name in the model."""

    def __init__(self, switches, names, params):
        self.accumulate = switches.accumulate
        self.nancheck = switches.nancheck
        self.perf_every = switches.perf_every
        self.sampler = (DownSampler(switches.downsample_n, switches.momentum, torch.clone,
                                    lambda n, like: like.new_zeros(n))
                        if switches.downsample_n > 1 else None)
        self.names = names
        self.params = list(params)
        self.steps = 0  # backward passes that reached the hook
        self.holding = False  # the current step only accumulates
        self._sums = {}  # accumulated local gradient by parameter (a layout may change)
        self._times = []  # compute time of each step since the last perf check
        self._step_end = None  # when the last step's last bucket was done

    @classmethod
    def of(cls, module, powersgd):
        """The switches for a DDP model over ``module`` (None when none is set).
        PowerSGD (seed 001) compresses the buckets itself: down-sampling is left out,
        saying so once."""
        switches = _switches()
        if powersgd and switches.downsample_n > 1:
            warnings.warn("PERSEUS_DOWNSAMPLE_N_ELEMENTS does not apply with "
                          "AIAK_POWERSGD_COMPRESSION=1, which compresses DDP's buckets "
                          "itself: this model trains without down-sampling",
                          RuntimeWarning, stacklevel=4)
            switches.downsample_n = 1
        if not switches.set_on_gradients():
            return None
        names = {p: name for name, p in module.named_parameters()}
        made = cls(switches, names, (p for p in module.parameters() if p.requires_grad))
        if made.accumulate > 1:
            _holding.add(made)
            _install_step_hook()
        return made

    # ---------------------------------------------------------------- steps

    def begin(self, bucket, process_set):
        """Called for every bucket before it is reduced: bucket 0 starts a step; the
        last one ends its compute, and every PERSEUS_PERF_CHECK_N_STEPS steps the ranks
        then compare compute times (the check's own wait falls outside them)."""
        if bucket.index() == 0:
            self.steps += 1
            self.holding = self.accumulate > 1 and self.steps % self.accumulate != 0
        if self.perf_every > 0 and bucket.is_last():
            if self._step_end is not None:
                # compute: from the end of the last step to this step's last gradient
                self._times.append(time.perf_counter() - self._step_end)
            if len(self._times) >= self.perf_every:
                times, self._times = self._times, []
                perf_check(times, self.perf_every, _WHERE, process_set)

    def hold(self, bucket):
        """Under accumulation, outside a window's last step: adds the bucket to its
        sum and returns True (the bucket is not reduced now)."""
        if not self.holding:
            return False
        if bucket.is_last():
            self._step_end = time.perf_counter()
        for p, grad in zip(bucket.parameters(), _slices(bucket)):
            kept = self._sums.get(p)
            if kept is None:
                self._sums[p] = grad.clone()
            else:
                kept.add_(grad)
        return True

    def release(self, bucket):
        """At a window's last step: the bucket's buffer becomes the average of the
        window's local gradients."""
        if self.accumulate <= 1:
            return
        for p, grad in zip(bucket.parameters(), _slices(bucket)):
            kept = self._sums.pop(p, None)
            if kept is not None:
                grad.add_(kept)
        bucket.buffer().div_(self.accumulate)

    def reduced(self, bucket, own, name, process_set):
        """Called once a bucket's reduction is in (``own``: :meth:`own_flags` taken
        before it): the NaN check, and the last bucket ends a step."""
        if bucket.is_last():
            self._step_end = time.perf_counter()
        self._check(bucket, own, name, process_set)

    # ---------------------------------------------------------------- down-sampling

    def sample(self, bucket):
        """The tensor to send for the bucket (a slice of its residual under
        down-sampling, else the buffer itself) and the ``Sampled`` to restore it."""
        buf = bucket.buffer()
        if self.sampler is None or not buf.is_floating_point():
            return buf, None
        update = self.steps // max(self.accumulate, 1)
        # keyed by the bucket's parameters: DDP lays its buckets out again after the
        # first step, and a residual must not land on another layout
        layout = tuple(id(p) for p in bucket.parameters())
        return self.sampler.send(layout, buf, update)

    # ---------------------------------------------------------------- NaN check

    def own_flags(self, bucket):
        """This rank's gradients of the bucket's parameters: whether each is finite, as
        flags on their device (read only when the reduced bucket is not finite)."""
        if not self.nancheck:
            return None
        return [(self.names.get(p, "?"), torch.isfinite(g).all())
                for p, g in zip(bucket.parameters(), _slices(bucket))]

    def _check(self, bucket, own, name, process_set):
        """PERSEUS_ALLREDUCE_NANCHECK on a reduced bucket: every rank holds the same
        sums, so every rank raises together, naming the bad parameters and where their
        NaN or Inf came from."""
        if own is None or bool(torch.isfinite(bucket.buffer()).all()):
            return
        bad = [self.names.get(p, "?") for p, g in zip(bucket.parameters(), _slices(bucket))
               if not bool(torch.isfinite(g).all())]
        mine = [n for n, flag in own if not bool(flag)]
        raise_nonfinite(bad, mine, f"{name}.bucket{bucket.index()}", process_set)


def _slices(bucket):
    """The bucket's buffer cut at its parameters (DDP lays them out in that order)."""
    buf, out, at = bucket.buffer(), [], 0
    for p in bucket.parameters():
        out.append(buf[at:at + p.numel()])
        at += p.numel()
    return out


# ---------------------------------------------------------------- the optimizer's step

_holding = weakref.WeakSet()  # every BucketSwitches that accumulates
_step_hook = []


def skip_held_steps(optimizer, args, kwargs):
    """torch's optimizer step pre-hook: inside an accumulation window the gradients of
    the models' parameters are local and partial (their sum waits in the hook), so the
    step leaves those parameters alone: their ``.grad`` is cleared, which every torch
    optimizer skips, and the window's average arrives at its last step."""
    held = [s for s in _holding if s.holding]
    if not held:
        return
    mine = {id(p) for s in held for p in s.params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in mine:
                p.grad = None


def _install_step_hook():
    if not _step_hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook.append(register_optimizer_step_pre_hook(skip_held_steps))


def unapplied_with_own_hook():
    """The switches set in the environment that a model keeping its own communication
    hook trains without."""
    return _switches().set_on_gradients()

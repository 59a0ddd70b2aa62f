"""The steps of ``DistributedOptimizer``: ``step()`` waits for the gradients' reductions
(or, under PERSEUS_OVERLAP_BACKWARD_AND_STEP, steps each parameter as its gradient
arrives), applies PERSEUS_ACCUMULATE_N_STEPS, the fused optimizer and DGC's update, and
times the compute between steps for PERSEUS_PERF_CHECK_N_STEPS. The reductions are
:class:`~perseus.torch.horovod.optimizer._DistributedOptimizer`'s."""

import time
import warnings
from contextlib import contextmanager

import torch

from perseus.torch import amp as _amp
from perseus.torch import optim as _fused
from perseus.torch.horovod import clipping as _clipping


class _Stepping:
    """Mixed into ``DistributedOptimizer``'s class after its reductions, before the
    wrapped optimizer's class (whose ``step`` and ``zero_grad`` ``super()`` reaches)."""

    def _step_ready(self, wait=False):
        """PERSEUS_OVERLAP_BACKWARD_AND_STEP: steps the parameters whose reductions have
        finished, during backward (called from the gradient hooks) and in ``step()``,
        while the other reductions go on. A parameter's gradient is complete when its
        hook runs, and no later part of backward reads its value, so it may change. With
        ``wait``, every reduction is waited for, oldest first, and whatever has finished
        meanwhile steps with it."""
        while self._handles:
            ready = [(k, h, c) for k, (h, c) in self._handles.items()
                     if h is not None and h.poll()]
            if not ready:
                if not wait:
                    return
                key = next(k for k, (h, _) in self._handles.items() if h is not None)
                ready = [(key, *self._handles[key])]
            params = []
            for key, handle, ctx in ready:
                del self._handles[key]
                params += self._receive(key, handle, ctx)
            self._overlapped.update(params)
            self._update(params)

    def _update(self, params):
        """One step of ``params`` alone (each parameter group narrowed to them for the
        wrapped optimizer's step), after PERSEUS_CLIP_GRAD_FUNC clipped each gradient
        (DGC clips its own, before accumulating)."""
        if self._clip is not None:
            func, limit = self._clip
            for p in params:
                if func == "value":
                    _clipping.torch_own("clip_grad_value_")([p], limit)
                else:
                    _clipping.torch_own("clip_grad_norm_")([p], limit)
        compressed = self._dgc.compressed if self._dgc is not None else {}
        mine = {}
        for p in params:
            if p not in compressed:
                mine.setdefault(self._group_of[p], []).append(p)
        if mine:
            held = [group["params"] for group in self.param_groups]
            try:
                for i, group in enumerate(self.param_groups):
                    group["params"] = mine.get(i, [])
                super().step()
            finally:
                for group, kept in zip(self.param_groups, held):
                    group["params"] = kept
        if compressed:
            self._dgc.apply([p for p in params if p in compressed])

    def _overlapped_step(self, closure):
        """``step()`` under PERSEUS_OVERLAP_BACKWARD_AND_STEP: the parameters not stepped
        during backward step as their reductions finish (or, after an explicit
        ``synchronize()``, all at once)."""
        if closure is not None:
            raise ValueError("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1: step(closure) is not "
                             "supported (parameters step during backward)")
        if (self._should_synchronize and not self._auto_synchronized
                and self.process_set.included()):
            self._start_all()
            self._step_ready(wait=True)
            self._updates += 1
        rest = [p for p in self._requires_update
                if p not in self._overlapped and p.grad is not None]
        if rest:
            self._update(rest)
        self._overlapped.clear()
        self._end_window()

    def _wait_before_reading_grads(self):
        """Called before ``GradScaler.unscale_`` reads the gradients, and under AMP O2
        before they move onto the masters (``amp_parameters``): reductions in flight are
        waited for first, and ``step()`` then does not synchronize again. Between the
        passes that ``backward_passes_per_step`` accumulates nothing is in flight."""
        in_flight = any(handle is not None for handle, _ in self._handles.values())
        # A parameter unfrozen since the last step has no reduction in flight yet.
        in_flight = self._hook_unfrozen() or in_flight
        if in_flight and self._should_synchronize:
            self.synchronize()
            self._auto_synchronized = True

    def _accumulating(self):
        """True when the next ``step()`` only accumulates (PERSEUS_ACCUMULATE_N_STEPS):
        the gradients then hold a partial sum of this rank's own, not yet reduced."""
        return self._accumulate > 1 and self._accumulated + 1 < self._accumulate

    def _hide_grads(self):
        """A GradScaler's ``unscale_`` within an accumulation window: the gradients
        backward wrote (the model's, under AMP O2) are set aside until ``step()`` puts
        them back, so that clipping between the two, meant for the update, finds none."""
        for group in self.param_groups:
            for p in group["params"]:
                w = _amp.working(p)
                if w.grad is not None:
                    self._hidden.append((w, w.grad))
                    w.grad = None

    def _restore_grads(self):
        """Puts back what :meth:`_hide_grads` set aside."""
        hidden, self._hidden = self._hidden, []
        for w, g in hidden:
            w.grad = g if w.grad is None else w.grad.add_(g)

    def _step_skipped(self):
        """A GradScaler skipped ``step()`` for an overflow in the reduced gradients (the
        same on every rank): under PERSEUS_ACCUMULATE_N_STEPS the window ends there, and
        the next ``zero_grad()`` clears its gradients."""
        self._restore_grads()
        if self._accumulate > 1:
            self._accumulated = 0

    @contextmanager
    def skip_synchronize(self):
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` first).

        Typical use: ``optimizer.synchronize()``, clip gradients, then
        ``with optimizer.skip_synchronize(): optimizer.step()``.
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _step_locally(self):
        """The wrapped optimizer's own step on this rank's gradients, reducing nothing:
        ``broadcast_optimizer_state``'s zero-gradient step that creates the state."""
        return super().step()

    def step(self, closure=None):
        """Wait for the averaged gradients, then take the wrapped optimizer's step.

        With PERSEUS_ACCUMULATE_N_STEPS=N only every N-th call communicates and updates;
        the calls in between only let gradients accumulate (running ``closure`` if given).
        """
        self._step_calls += 1
        self._restore_grads()
        if self._accumulate > 1:
            self._accumulated += 1
            if self._accumulated < self._accumulate:
                if closure is None:
                    return None
                with torch.enable_grad():
                    return closure()
            try:
                return self._step_now(closure)
            finally:
                # Only now: AMP O2's moves within this step must see the window ended.
                self._accumulated = 0
        return self._step_now(closure)

    def _step_now(self, closure):
        """The step that communicates and updates (every N-th ``step()`` call under
        PERSEUS_ACCUMULATE_N_STEPS)."""
        entered = time.perf_counter()
        timed = self._perf_every > 0 and bool(self._hook_handles)
        if timed and self._last_step_end is not None:
            self._compute_times.append(entered - self._last_step_end)
        if self._overlap and self._hook_handles:
            self._overlapped_step(closure)
            result = None
        else:
            result = self._synchronized_step(closure)
        self._synchronized = False
        self._auto_synchronized = False
        if timed:
            if len(self._compute_times) >= self._perf_every:
                self._perf_check()
            self._last_step_end = time.perf_counter()
        return result

    def _synchronized_step(self, closure):
        """``step()`` once every reduction is waited for: the wrapped optimizer's step.

        A ``closure`` (zero_grad, forward, backward: the gradients this step uses) runs
        where the wrapped optimizer calls it, and its gradients are averaged before the
        call returns. Horovod synchronizes before the closure runs, so the step reads the
        closure's gradients while they are being reduced, and the ranks part."""
        if closure is not None:
            if self._dgc is not None and self._hook_handles:
                raise ValueError("PERSEUS_DGC=1: step(closure) is not supported (DGC steps "
                                 "its compressed parameters apart from the closure's "
                                 "gradients); call backward() before step()")
            closure = self._reducing(closure)
        else:
            if self._should_synchronize and not self._auto_synchronized:
                if self._synchronized:
                    warnings.warn("optimizer.step() called without "
                                  "optimizer.skip_synchronize() context after "
                                  "optimizer.synchronize(). This can cause training slowdown. "
                                  "You may want to consider using "
                                  "optimizer.skip_synchronize() context if you use "
                                  "optimizer.synchronize() in your code.", stacklevel=4)
                self.synchronize()
            if self._amp:
                _amp.move_grads(self)
        result = self._wrapped_step(closure)
        if self._amp:
            _amp.copy_to_model(self)
        return result

    def _reducing(self, closure):
        """``closure``, then the wait for the averages of the gradients it computed."""
        def reduced():
            with torch.enable_grad():
                loss = closure()
            if self._should_synchronize:
                self.synchronize()
            if self._amp:
                _amp.move_grads(self)
            return loss

        return reduced

    def _wrapped_step(self, closure):
        """The wrapped optimizer's step; under DGC, the compressed parameters' own."""
        if self._dgc is None or not self._hook_handles:
            return self._torch_step(closure)
        # DGC's parameters step apart: their gradient already holds momentum and weight
        # decay. Without a gradient during torch's step, SGD leaves them alone.
        held = [(p, p.grad) for p in self._dgc.compressed if p.grad is not None]
        for p, _ in held:
            p.grad = None
        try:
            result = self._torch_step(closure)
        finally:
            for p, g in held:
                p.grad = g
        self._dgc.apply([p for p, _ in held])
        return result

    def _torch_step(self, closure):
        """The wrapped optimizer's own step. With PERSEUS_FUSED_OPTIMIZER=1 the step of a
        torch.optim SGD, Adam or AdamW is the core's fused step (perseus.torch.optim);
        where it cannot be (amsgrad, a float16 parameter, ...) torch's step runs, and
        the first time the reason is printed."""
        base_step = super().step
        if self._fused_optimizer and not isinstance(self, _fused.FusedOptimizer):
            plan, why = _fused.torch_rule(self, base_step)
            if plan is not None:
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                _fused.run_step(self, plan, torch_state=True)
                return loss
            if self._fused_refused != why:
                self._fused_refused = why
                warnings.warn(f"PERSEUS_FUSED_OPTIMIZER: {why}, so torch's own step runs",
                              stacklevel=6)
        return base_step(closure)

    def zero_grad(self, *args, **kwargs):
        """Clear gradients; refused while gradient reductions are in flight. Between the
        steps that PERSEUS_ACCUMULATE_N_STEPS accumulates over it keeps them."""
        if self._accumulated:
            return None
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        self._end_window()
        if self._amp:
            for model_p, _ in _amp.pairs(self):
                model_p.grad = None
        return super().zero_grad(*args, **kwargs)

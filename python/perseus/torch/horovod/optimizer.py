"""``DistributedOptimizer``: averages gradients across ranks while backward still runs."""

from contextlib import contextmanager

import torch

from perseus.common import elastic as _elastic
from perseus.common import knobs
from perseus.common.basics import config as _config
from perseus.common.basics import set_fusion_threshold
from perseus.common.downsample import DownSampler
from perseus.common.exceptions import NameInFlightError
from perseus.common.gradients import (
    Switches,
    check_optimizer_args,
    perf_check,
    raise_nonfinite,
    scale_factors,
)
from perseus.common.ops import GroupHandle
from perseus.common.process_sets import global_process_set
from perseus.torch import amp as _amp
from perseus.torch import dgc as _dgc
from perseus.torch import optim as _fused
from perseus.torch.horovod import clipping as _clipping
from perseus.torch.horovod.adasum import _DistributedAdasumOptimizer
from perseus.torch.horovod.compression import Compression
from perseus.torch.horovod.functions import broadcast_object
from perseus.torch.horovod.mpi_ops import (
    Adasum,
    Average,
    gradient_allreduce_async_,
    rank,
    size,
    sparse_allreduce_async,
    stacked_allgather_async,
    synchronize,
)
from perseus.torch.horovod.parameter_names import name_added_group, parameter_names
from perseus.torch.horovod.stepping import _Stepping


class _Sampled:
    """A down-sampled gradient's :class:`~perseus.common.downsample.Sampled` and its
    compression's context."""

    __slots__ = ("ctx", "sampled")

    def __init__(self, sampled, ctx):
        self.sampled, self.ctx = sampled, ctx


def _split_list(items, n):
    """``items`` cut into ``n`` consecutive chunks whose lengths differ by at most one."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def _read_flags(flags):
    """The values of 0-d bool tensors, read with one wait per device they are on."""
    out = [True] * len(flags)
    by_device = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([flags[i] for i in idx]).tolist()):
            out[i] = v
    return out


class _DistributedOptimizer(_Stepping):
    """Mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`): the
    reductions of the gradients here, the steps in :class:`_Stepping`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        super().__init__(params)
        self._compression = compression

        # With AMP O2 (perseus.torch.amp) the groups hold float32 masters; gradients
        # arrive on, and are reduced as, the model's half-precision parameters.
        self._amp = _amp.is_decorated(self)
        self._auto_synchronized = False
        # GradScaler.unscale_ waits for the reductions (see _wait_before_reading_grads()).
        _amp.patch_grad_scaler()
        self._parameter_names = parameter_names(self.param_groups, named_parameters,
                                                _amp.working)
        switches = Switches(_config())
        # PERSEUS_ACCUMULATE_N_STEPS: step() applies every N-th call (see step()).
        self._accumulate = switches.accumulate
        self._accumulated = 0
        self._hidden = []  # gradients a GradScaler's unscale_ hid within a window
        self._step_calls = 0  # GradScaler.step sees whether it called step()
        # PERSEUS_ALLREDUCE_NANCHECK: reduced gradients are checked (see _check_finite()).
        self._nancheck = switches.nancheck
        self._nonfinite_here = []
        # PERSEUS_DOWNSAMPLE_N_ELEMENTS / PERSEUS_GRADIENT_MOMENTUM: see _downsample().
        self._downsample_n = switches.downsample_n
        self._sampler = DownSampler(switches.downsample_n, switches.momentum, torch.clone,
                                    lambda n, like: like.new_zeros(n))
        self._updates = 0
        # PERSEUS_FUSED_OPTIMIZER: see _wrapped_step().
        self._fused_optimizer = switches.fused_optimizer
        self._fused_refused = None
        # PERSEUS_PERF_CHECK_N_STEPS: see _perf_check().
        self._perf_every = switches.perf_every
        self._compute_times = []
        self._last_step_end = None
        # PERSEUS_ALLREDUCE_FUSION=N: fused buffers of 1/N of the gradient bytes.
        if switches.fusion is not None:
            working = (_amp.working(p) for group in self.param_groups
                       for p in group["params"] if p.requires_grad)
            total = sum(w.numel() * w.element_size() for w in working)
            set_fusion_threshold(switches.fusion_threshold(total))
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: self._passes_per_update() for v in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles = {}
        # Parameters whose gradient of this window went to a reduction (in flight or
        # received), and what the earlier reductions of a gradient that arrived again
        # gave (see _arrives_again()).
        self._sent = set()
        self._carry = {}
        self._hook_handles = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        # PERSEUS_DGC: deep gradient compression of the weight gradients (perseus.torch.dgc).
        seed_000 = _dgc.Settings.from_env()
        self._dgc = self._dgc_state(seed_000)
        # PERSEUS_OVERLAP_BACKWARD_AND_STEP: see _step_ready().
        self._overlap = self._overlap_state(seed_000)
        self._clip = None if self._dgc is not None or not seed_000.clip_grad_func \
            else (seed_000.clip_grad_func, seed_000.clip_grad_param)
        self._overlapped = set()
        self._group_of = {_amp.working(p): i for i, group in enumerate(self.param_groups)
                          for p in group["params"]}
        # PERSEUS_ACCUMULATE_N_STEPS on one rank too: the reduction applies the 1/N as
        # backward ends the window, so clipping before step() sees the average there too.
        # An elastic job that starts on one worker may grow: it reduces from the start
        # (perseusrun marks its workers PERSEUS_ELASTIC=1; Horovod's launcher
        # HOROVOD_ELASTIC=1).
        # A rank outside ``process_set`` steps on its own gradients, as in Horovod.
        self._hooked = ((size() > 1 or _elastic.enabled()
                         or knobs.text("HOROVOD_ELASTIC") == "1" or self._accumulate > 1)
                        and process_set.included() is not False)
        self._frozen = []  # parameters without a hook: they did not train when last seen
        if self._hooked:
            self._register_hooks()
        self._tracking = True  # add_param_group() from now on names and hooks new groups
        _clipping.track(self)  # torch's clipping waits for the reductions in flight

    def _dgc_state(self, settings):
        """DGC's state when PERSEUS_DGC=1 (None otherwise), after checking that the
        optimizer and the other switches allow it."""
        if not settings.on:
            return None
        refused = None
        if not isinstance(self, torch.optim.SGD):
            refused = f"only torch.optim.SGD (seed 000), not {type(self).__name__}"
        elif self._amp:
            refused = "not an optimizer under aiak_amp_decorate (AMP O2)"
        elif self._groups is not None:
            refused = "not with groups= (each weight's pairs are gathered on their own)"
        elif self._downsample_n > 1:
            refused = "not with PERSEUS_DOWNSAMPLE_N_ELEMENTS > 1"
        if refused:
            raise ValueError(f"PERSEUS_DGC=1 (perseusrun --dgc) compresses the gradients of "
                             f"{refused}")
        return _dgc.DGC(settings, self, rank())

    def _overlap_state(self, settings):
        """Whether each parameter steps as soon as its reduced gradient is there
        (PERSEUS_OVERLAP_BACKWARD_AND_STEP=1), after checking what it cannot go with."""
        if not settings.overlap:
            return False
        refused = None
        if self._fused_optimizer or isinstance(self, _fused.FusedOptimizer):
            refused = "the fused optimizer (seed 000: they are incompatible)"
        elif self._amp:
            refused = "an optimizer under aiak_amp_decorate (AMP O2)"
        elif self._nancheck:
            refused = "PERSEUS_ALLREDUCE_NANCHECK=1 (a late NaN would find weights updated)"
        if refused:
            raise ValueError("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1 (perseusrun "
                             f"--overlap-backward-and-step) does not go with {refused}")
        return True

    def set_epoch(self, epoch):
        """Tell DGC's warm-up (PERSEUS_DGC_WARMUP_EPOCHS) the epoch now starting;
        ``DistributedSampler.set_epoch`` does it too."""
        _dgc.set_epoch(epoch)

    def _positions(self):
        """Each parameter in the order torch's ``state_dict`` numbers them."""
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self, *args, **kwargs):
        """The wrapped optimizer's state; under DGC also what each weight holds back
        (``"perseus_dgc"``: momentum and velocity by parameter number), so a checkpoint
        or an elastic commit resumes exactly."""
        state = super().state_dict(*args, **kwargs)
        if self._dgc is not None:
            state["perseus_dgc"] = self._dgc.state(self._positions())
        return state

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Load optimizer state; pending gradient reductions are forgotten. DGC's held
        back gradients come back from ``"perseus_dgc"`` when the state has them, and are
        cleared when it does not."""
        held = state_dict.get("perseus_dgc") if isinstance(state_dict, dict) else None
        if isinstance(state_dict, dict) and "perseus_dgc" in state_dict:
            state_dict = {k: v for k, v in state_dict.items() if k != "perseus_dgc"}
        if self._dgc is not None:
            self._dgc.load(held or {}, self._positions())
        self._handles = {}
        self._end_window()
        self._overlapped.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._accumulated = 0
        self._hidden = []
        self._sampler.reset()
        self._updates = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self._passes_per_update()
        super().load_state_dict(state_dict, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes accumulate locally before gradients are reduced."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self._passes_per_update()

    def _passes_per_update(self):
        """Backward passes between two gradient reductions."""
        return self.backward_passes_per_step * self._accumulate

    def _form_groups(self):
        if isinstance(self._groups, list):
            groups = [tuple(g) for g in self._groups]
        else:
            params = [_amp.working(p) for group in self.param_groups for p in group["params"]
                      if p.requires_grad]
            # Every rank must form the same groups: take rank 0's parameter order.
            order = broadcast_object([self._parameter_names.get(p) for p in params],
                                     root_rank=0, name="DistributedOptimizer.groups",
                                     process_set=self.process_set)
            position = {n: i for i, n in enumerate(order)}
            params.sort(key=lambda p: position[self._parameter_names.get(p)])
            groups = [tuple(g) for g in _split_list(params, self._groups) if g]
        for group in groups:
            for p in group:
                self._p_to_group[p] = group
            self._group_counts[group] = 0

    def _register_hooks(self):
        if self._groups is not None:
            self._form_groups()
        for group in self.param_groups:
            for p in group["params"]:
                w = _amp.working(p)
                if w.requires_grad:
                    self._hook(w)
                else:
                    self._frozen.append(w)

    def _hook(self, w):
        """Reduces ``w``'s gradient from now on, as backward accumulates it (DGC
        compresses it if it takes such a weight)."""
        if self._dgc is not None:
            self._dgc.consider(w, self.param_groups[self._group_of[w]])
        self._requires_update.add(w)
        self._allreduce_delay[w] = self._passes_per_update()
        self._hook_handles.append(w.register_hook(self._make_prehook(w)))
        self._hook_handles.append(w.register_post_accumulate_grad_hook(self._make_hook(w)))

    def add_param_group(self, param_group):
        """torch's ``add_param_group``; the new group's gradients are averaged like the
        others'. Its parameters keep the names ``named_parameters`` gave them, and the
        others are named ``allreduce.noname.<group>.<index>`` (the same on every rank when
        every rank adds the same groups)."""
        super().add_param_group(param_group)
        if not self.__dict__.get("_tracking"):
            return  # torch's __init__ adding the wrapped optimizer's groups
        index = len(self.param_groups) - 1
        for w in name_added_group(self._parameter_names, self.param_groups, _amp.working):
            self._group_of[w] = index
            if self._hooked:
                self._frozen.append(w)
        self._hook_unfrozen()

    def _hook_unfrozen(self):
        """Hooks the parameters that train now (``requires_grad``) but had no hook: those
        frozen when the hooks were registered and unfrozen since, and those of a group
        added later. Their gradient of the step now ending, computed before the hook was
        there, is reduced in ``synchronize()``. Returns whether any was hooked."""
        unfrozen = [w for w in self._frozen if w.requires_grad]
        if not unfrozen:
            return False
        self._frozen = [w for w in self._frozen if not w.requires_grad]
        for w in unfrozen:
            self._hook(w)
        return True

    def _scale_factors(self):
        # With PERSEUS_ACCUMULATE_N_STEPS=N the gradient holds the sum of N steps: send
        # their average.
        return scale_factors(self.op, self.gradient_predivide_factor, 1.0 / self._accumulate)

    def _note_nonfinite(self, name, tensor):
        """For the NaN check: whether this rank's own gradient is finite, as a flag on its
        device. Queued before the gradient's allreduce and read only when a reduced
        gradient is not finite, so a CUDA model's backward pass never waits for it."""
        if self._nancheck:
            self._nonfinite_here.append((name, torch.isfinite(tensor).all()))

    def _check_finite(self, params):
        """PERSEUS_ALLREDUCE_NANCHECK: every rank holds the same reduced gradients, so every
        rank takes the same decision here; the ranks' own findings say where it came from.
        The flags of all gradients are read with one wait per device, not one per tensor."""
        grads = [(self._parameter_names.get(p, "?"), p.grad) for p in params
                 if p.grad is not None]
        finite = _read_flags([torch.isfinite(g).all() for _, g in grads])
        bad = [name for (name, _), ok in zip(grads, finite) if not ok]
        here, self._nonfinite_here = self._nonfinite_here, []
        if bad:
            own = _read_flags([flag for _, flag in here])
            mine = [name for (name, _), ok in zip(here, own) if not ok]
            raise_nonfinite(bad, mine, "DistributedOptimizer", self.process_set)

    def _downsample(self, p, tensor):
        """PERSEUS_DOWNSAMPLE_N_ELEMENTS=N (:mod:`perseus.common.downsample`): the slice of
        this parameter's residual to send at this update, and its ``Sampled``; a sparse or
        integer gradient, or N of 1, goes as it is (None)."""
        if (self._downsample_n <= 1 or p.grad.is_sparse or tensor.is_sparse
                or not tensor.is_floating_point()):
            return tensor, None
        return self._sampler.send(p, tensor.reshape(-1), self._updates)

    def _send_form(self, p, tensor):
        """The tensor as it goes to the wire (down-sampled, then compressed) and the
        context that :meth:`_restore` needs."""
        sent, sampled = self._downsample(p, tensor)
        compressed, ctx = self._compression.compress(sent)
        if sampled is None:
            return compressed, ctx
        return compressed, _Sampled(sampled, ctx)

    def _restore(self, p, output, ctx):
        """Writes a reduced gradient back into ``p.grad``; a down-sampled one lands on its
        elements, the others get zero (their share waits in the residual); DGC's gathered
        pairs are added up densely."""
        if isinstance(ctx, _dgc.Sent):
            self._dgc.receive(p, output, ctx, self.op == Average)
            return
        if not isinstance(ctx, _Sampled):
            p.grad.set_(self._compression.decompress(output, ctx))
            return
        reduced = self._compression.decompress(output, ctx.ctx)
        grad = p.grad.view(-1) if p.grad.is_contiguous() else None
        if grad is None:
            p.grad = torch.zeros_like(p)
            grad = p.grad.view(-1)
        DownSampler.restore(grad, reduced, ctx.sampled)

    def _perf_check(self):
        """PERSEUS_PERF_CHECK_N_STEPS=N: every N steps compare compute times (from the end
        of one ``step()`` to the start of the next) across ranks."""
        times, self._compute_times = self._compute_times, []
        perf_check(times, self._perf_every, "DistributedOptimizer", self.process_set)

    @contextmanager
    def _shared_names_explained(self):
        """A name already in flight, from an optimizer's reduction, most likely comes from
        two optimizers whose ``named_parameters`` give the same names (two models, each
        ``nn.Sequential``, trained through one backward pass): the error says so."""
        try:
            yield
        except NameInFlightError as e:
            raise NameInFlightError(
                f"{e}. Two DistributedOptimizers name their gradients alike (two models "
                "whose named_parameters() give the same names, reduced in the same "
                "backward pass): give each its own names, e.g. named_parameters=[('gen.' + "
                "n, p) for n, p in gen.named_parameters()]") from None

    def _allreduce_grad_async(self, p):
        with self._shared_names_explained():
            return self._allreduce_grad_async_unexplained(p)

    def _allreduce_grad_async_unexplained(self, p):
        if p.grad is None:
            # Not computed here (e.g. an unused branch), but others may have computed it.
            p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor.coalesce(), name, self.op,
                                              self.process_set), None
            tensor = tensor.to_dense()
        self._note_nonfinite(name, tensor)
        if self._dgc is not None:
            ranks = self.process_set.size()
            if self._dgc.takes(p, tensor):
                # PERSEUS_ACCUMULATE_N_STEPS: the gradient holds N steps' sum.
                packet, sent = self._dgc.pack(p, tensor, ranks, scale=1.0 / self._accumulate)
                return stacked_allgather_async(packet, f"DGC.{name}", self.process_set), sent
            tensor = self._dgc.clip(tensor, ranks)
        compressed, ctx = self._send_form(p, tensor)
        pre, post = self._scale_factors()
        handle = gradient_allreduce_async_(compressed, name, self.op, pre, post, self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, params):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        name = self._parameter_names.get(params[0])
        for p in params:
            self._note_nonfinite(self._parameter_names.get(p), p.grad)
        compressed, ctxs = zip(*[self._send_form(p, p.grad) for p in params])
        pre, post = self._scale_factors()
        with self._shared_names_explained():
            handle = GroupHandle([
                gradient_allreduce_async_(t, f"{name}.{i}", self.op, pre, post,
                                          self.process_set)
                for i, t in enumerate(compressed)])
        return handle, ctxs

    def _refuse_scaled_gradients(self):
        """The overlapped step and DGC use each gradient as its hook sees it, before a
        GradScaler could unscale it (or skip an overflowed step): refused by name."""
        switch = ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1 (--overlap-backward-and-step)"
                  if self._overlap else "PERSEUS_DGC=1 (--dgc)")
        raise ValueError(f"{switch} does not go with torch.amp.GradScaler: it uses each "
                         "gradient as backward produces it, still multiplied by the loss "
                         "scale, before the scaler unscales it or skips an overflowed "
                         "step. Train without the scaler (bfloat16 autocast needs none) "
                         "or without the switch")

    def _make_hook(self, p):
        def hook(*_):
            if (self._overlap or self._dgc is not None) and _amp.grad_scaler_in_use():
                self._refuse_scaled_gradients()
            submit()
            if self._overlap and self._handles:
                self._step_ready()

        def submit():
            self._auto_synchronized = False
            assert not p.grad.requires_grad
            if self._allreduce_delay[p] <= 0:
                return  # counted already, it waits for the rest of its group
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                group = self._p_to_group.get(p)
                if group is not None:
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._grouped_allreduce_grad_async(group)
                        for gp in group:
                            self._handles.pop(gp, None)
                        self._sent.update(group)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
                    self._sent.add(p)
            self._handles[p] = (handle, ctx)

        return hook

    def _make_prehook(self, p):
        def prehook(_grad):
            if p in self._sent:
                self._arrives_again(p)

        return prehook

    def _arrives_again(self, p):
        """Runs before backward adds to ``p.grad`` a gradient that arrives after ``p``'s
        reduction of this window started: a module run twice under reentrant
        ``torch.utils.checkpoint`` (each run's backward is a backward pass of its own), or
        more ``backward()`` calls before ``step()`` than ``backward_passes_per_step``.
        Horovod asserts there, after backward has added the new part into a gradient
        that its reduction was writing. Here the reduction is waited for first, its
        average set aside, and the new part goes to a reduction of its own; the
        averages add up in ``synchronize()``, so the result is the average of the whole
        gradient, as when it arrives at once."""
        name = self._parameter_names.get(p, "?")
        refused = ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1 (a parameter steps once its "
                   "reduction lands)" if self._overlap else
                   "PERSEUS_DGC=1" if self._dgc is not None else
                   "PERSEUS_DOWNSAMPLE_N_ELEMENTS > 1" if self._downsample_n > 1 else
                   "a sparse gradient" if p.grad is not None and p.grad.is_sparse else None)
        if refused:
            raise RuntimeError(
                f"the gradient of '{name}' arrived again after its reduction started in this "
                "window (a module run twice under reentrant torch.utils.checkpoint, or more "
                "backward() calls before step() than backward_passes_per_step); the parts "
                f"cannot be reduced one after another with {refused}. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or set "
                "backward_passes_per_step to the backward() calls per step")
        group = self._p_to_group.get(p)
        key = group if group is not None and group in self._handles else p
        if key in self._handles:
            handle, ctx = self._handles.pop(key)
            self._receive(key, handle, ctx)  # adds the earlier parts' averages
        self._carry[p] = p.grad
        p.grad = None  # backward now puts the new part here
        self._sent.discard(p)
        self._allreduce_delay[p] = 1  # and its hook sends it

    def _add_carry(self, p):
        """Adds the averages of the earlier parts of ``p``'s gradient (see
        :meth:`_arrives_again`) to the one just received, in the gradient's first
        tensor."""
        earlier = self._carry.pop(p, None)
        if earlier is not None:
            p.grad = earlier.add_(p.grad)

    def _end_window(self):
        """Forgets which gradients of the window went to reductions."""
        self._sent.clear()
        self._carry.clear()

    def _start_all(self):
        """Starts the reductions not started yet: of gradients backward did not produce
        here (zeros), and of those held back by ``backward_passes_per_step``."""
        self._hook_unfrozen()
        completed = set(self._overlapped) | self._sent
        for key in self._handles:
            completed.update(key) if isinstance(key, tuple) else completed.add(key)
        for p in self._requires_update - completed:
            # A parameter frozen since its hook was registered keeps no gradient, as in
            # torch's own step (a zero gradient would still move it by momentum or decay).
            if p.requires_grad:
                self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, _) in list(self._handles.items()):
            if handle is None:
                self._handles[p] = self._allreduce_grad_async(p)

    def _receive(self, key, handle, ctx):
        """Waits for one reduction (of a parameter, or a tuple of them for a group) and
        writes the result into the gradients; returns the parameters it wrote."""
        if isinstance(key, tuple):
            outputs = synchronize(handle)
            for gp, output, gctx in zip(key, outputs, ctx):
                self._allreduce_delay[gp] = self._passes_per_update()
                self._restore(gp, output, gctx)
                self._add_carry(gp)
            if key in self._group_counts:
                self._group_counts[key] = 0
            return list(key)
        p = key
        output = synchronize(handle)
        self._allreduce_delay[p] = self._passes_per_update()
        group = self._p_to_group.get(p)
        if group is not None:
            self._group_counts[group] = 0
        if p.grad.is_sparse:
            reduced = self._compression.decompress(output, ctx)
            if not reduced.is_sparse:
                reduced = reduced.to_sparse()
            p.grad = reduced
        else:
            self._restore(p, output, ctx)
            self._add_carry(p)
        return [p]

    def synchronize(self):
        """Wait for every gradient reduction (starting those not started yet)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        self._start_all()
        try:
            for key, (handle, ctx) in self._handles.items():
                self._receive(key, handle, ctx)
        finally:
            self._handles.clear()
            self._end_window()
        self._updates += 1
        if self._nancheck:
            self._check_finite(self._requires_update)
        if self._amp:
            _amp.move_grads(self)
        self._synchronized = True


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap a ``torch.optim`` optimizer so that gradients are averaged over all ranks.

    Each parameter's gradient is allreduced asynchronously as soon as backward has
    accumulated it (``backward_passes_per_step`` times); ``step()`` waits for all of
    them, then updates. The returned object is an instance of a subclass of the
    optimizer's class sharing its parameter groups.

    Arguments:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``, to name the allreduces.
        compression: ``Compression.none`` or ``Compression.fp16`` for the wire.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each rank then steps on its
            own gradients and the weight changes combine by Adasum
            (:mod:`perseus.torch.horovod.adasum`; not with AMP O2's masters).
        gradient_predivide_factor: with ``Average``, divide gradients by this factor
            before the sum and by ``size / factor`` after it.
        num_groups: deprecated, use ``groups``.
        groups: an int (split the parameters into that many groups, each reduced as
            one) or a list of lists of parameters.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: the ranks that average gradients together.
    """
    check_optimizer_args(op, gradient_predivide_factor, num_groups)
    if num_groups != 0 and groups is None:
        groups = num_groups
    if groups is not None:
        if isinstance(groups, list):
            seen = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise TypeError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
        elif isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of lists of "
                             "torch.Tensor.")
        elif groups == 0:
            groups = None

    base = optimizer.__class__
    if op == Adasum:
        return _adasum_optimizer(optimizer, named_parameters, compression,
                                 backward_passes_per_step, process_set)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": __name__})
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set)
    wrapped.defaults = optimizer.defaults
    wrapped.state.update(optimizer.state)
    return wrapped


def _adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                      process_set):
    """``DistributedOptimizer(op=Adasum)``, after refusing what it cannot go with."""
    refused = None
    seed_000 = _dgc.Settings.from_env()
    if _amp.is_decorated(optimizer):
        refused = "an optimizer under aiak_amp_decorate (AMP O2): its masters are not the " \
                  "model's weights"
    elif seed_000.on:
        refused = "PERSEUS_DGC=1: DGC compresses gradients, Adasum combines weight changes"
    elif seed_000.overlap:
        refused = "PERSEUS_OVERLAP_BACKWARD_AND_STEP=1: the Adasum step reduces weight " \
                  "changes after the local step"
    if refused:
        raise ValueError(f"DistributedOptimizer(op=Adasum) does not go with {refused}")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedAdasumOptimizer, base), {"__module__": __name__})
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, process_set)
    wrapped.defaults = optimizer.defaults
    wrapped.state.update(optimizer.state)
    return wrapped

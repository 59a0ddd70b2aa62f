"""Deep gradient compression (seed 000's ``--dgc``) for ``hvd.DistributedOptimizer``
wrapping ``torch.optim.SGD``.

Each weight gradient (a parameter of two or more dimensions) is folded into this rank's
momentum ``u`` and velocity ``v`` (momentum correction: ``u = m u + g``, ``v += u``),
and only the ``k = ceil(ratio * numel)`` entries of ``v`` of largest magnitude leave the
rank, as (index, value) pairs gathered from every rank; every rank adds them up and the
step moves each weight by ``-lr`` times their average. The entries sent are cleared in
``v`` and, with momentum masking, in ``u``: the rest waits in ``v`` until it grows large
enough to go. Biases and other one-dimensional gradients are averaged whole and stepped
by SGD as usual. Lin, Han, Mao, Wang and Dally describe the method (ICLR 2018).

The threshold for the top ``k`` comes from a sample of the magnitudes (``sample_ratio``
of them, strided or random) and is adapted, at most ``max_adaptation_iters`` times,
until between ``compress_lower_bound * k`` and ``compress_upper_bound * k`` entries pass
it: multiplied by the upper bound while too many pass and by the lower bound while too
few do, then halving the gap between a threshold that passed too many and one that
passed too few. More than ``k`` that pass are cut to the top ``k`` of them with
``resample`` (at once, without adapting, when more than the upper bound pass), or to
the first ``k`` without it. Every rank sends exactly ``k`` pairs (padded with zeros), so
the gathered buffer has one known shape. On the CPU the fold and the first threshold
test are one pass of the core (``_core.dgc_fold_select``), with the threshold estimated
from the sample as the fold will leave it.

Settings come from ``PERSEUS_DGC*`` and ``PERSEUS_CLIP_GRAD_*`` (perseus.common.dgc;
``perseusrun --dgc --compress-ratio ...`` sets them; docs/dgc.md lists them all); a bad
value raises ``ValueError`` naming it on every rank.
"""

import math
import warnings

import torch
from torch.utils.dlpack import to_dlpack

from perseus import _core
from perseus.common.dgc import Settings, current_epoch, epoch_heard, set_epoch

__all__ = ["DGC", "Settings", "current_epoch", "select", "set_epoch"]

_sampler_patched = [False]


def _patch_sampler():
    """``DistributedSampler.set_epoch`` also tells DGC the epoch, so the usual
    Horovod script's ``train_sampler.set_epoch(epoch)`` drives the warm-up."""
    if _sampler_patched[0]:
        return
    from torch.utils.data.distributed import DistributedSampler

    original = DistributedSampler.set_epoch

    def set_epoch_too(self, epoch):
        original(self, epoch)
        if isinstance(epoch, int) and epoch >= 0:
            set_epoch(epoch)

    DistributedSampler.set_epoch = set_epoch_too
    _sampler_patched[0] = True


def _positions(n, samples, s, generator, device):
    """Where the sample of ``samples`` of ``n`` entries is taken: every stride-th from a
    random start, or at random."""
    if s.strided_sample:
        stride = n // samples
        start = int(torch.randint(0, stride, (1,), generator=generator))
        return slice(start, start + stride * samples, stride)
    return torch.randperm(n, generator=generator)[:samples].to(device)


def _estimate(sample, k, n):
    """The threshold that passes ``k`` of ``n`` if the magnitudes ``sample`` are typical."""
    samples = sample.numel()
    top = min(samples, max(1, math.ceil(samples * k / n)))
    return float(torch.topk(sample, top, sorted=False).values.min())


def _adapt(passing, magnitude, k, s, threshold, chosen):
    """The adaptation of the module's doc, from ``threshold`` and the indices ``chosen``
    that pass it: ``passing(t)`` gives the indices at or above ``t``, ``magnitude(i)``
    the magnitudes of indices ``i``."""
    low, high = None, None  # thresholds known to pass too many, too few
    for _ in range(s.max_adaptation_iters):
        count = chosen.numel()
        if count > s.compress_upper_bound * k:
            if s.resample:
                break
            low = threshold
        elif count < s.compress_lower_bound * k:
            high = threshold
        else:
            break
        if low is not None and high is not None:
            threshold = (low + high) / 2
        elif high is None:
            threshold = threshold * s.compress_upper_bound
        else:
            threshold = threshold * s.compress_lower_bound
        chosen = passing(threshold)
    if chosen.numel() > k:
        if not s.resample:
            return chosen[:k]
        chosen = chosen[torch.topk(magnitude(chosen), k, sorted=False).indices]
    return chosen


def select(importance, k, s, generator=None):
    """Indices (int64) of at most ``k`` entries of the 1-D ``importance`` (magnitudes),
    those of largest value as the settings ``s`` estimate them: exactly the top ``k``
    when the sample would be the whole tensor, else a threshold read from a sample
    and adapted (see the module's doc)."""
    n = importance.numel()
    if k >= n:
        return torch.arange(n, device=importance.device)
    samples = min(n, max(1, math.ceil(n * s.sample_ratio)))
    if samples >= n:
        return torch.topk(importance, k, sorted=False).indices
    sample = importance[_positions(n, samples, s, generator, importance.device)]
    threshold = _estimate(sample, k, n)

    def passing(t):
        return torch.nonzero(importance >= t).view(-1)

    return _adapt(passing, lambda i: importance[i], k, s, threshold, passing(threshold))


def _fold(g, u, v, fold):
    """The gradient ``g`` joins the momentum ``u`` and the velocity ``v`` in place, as
    SGD's (momentum, dampening, nesterov) ``fold`` says."""
    m, dampening, nesterov = fold
    if not m:
        v.add_(g)
        return
    if dampening:
        u.mul_(m).add_(g, alpha=1 - dampening)
    else:
        torch.add(g, u, alpha=m, out=u)  # u = m u + g in one pass
    if nesterov:
        v.add_(g).add_(u, alpha=m)
    else:
        v.add_(u)


class Sent:
    """What :meth:`DGC.receive` needs of one gradient's gathered pairs."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k


class DGC:
    """One optimizer's compression state: which parameters are compressed, and each
    one's momentum and velocity on this rank."""

    def __init__(self, settings, optimizer, rank):
        self.s = settings
        self.compressed = {}  # working parameter -> its parameter group
        self._u = {}
        self._v = {}
        self._generator = torch.Generator().manual_seed(0x5EED + rank)
        self._warned = False
        # How the pairs travel: the types of the indices and of the values.
        self._index_type = torch.int32 if settings.int32_indices else torch.int64
        self._value_type = torch.float16 if settings.fp16_values else torch.float32
        _patch_sampler()
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.consider(p, group)

    def consider(self, p, group):
        """Compresses ``p`` (of the parameter group ``group``) if it is a trainable
        floating-point weight of two or more dimensions: for the optimizer's parameters
        at the start, and for those that start training later (unfrozen, or added)."""
        if group.get("maximize"):
            raise ValueError("DGC (PERSEUS_DGC=1) does not support SGD(maximize=True)")
        if p.requires_grad and p.dim() > 1 and p.is_floating_point():
            self.compressed[p] = group

    def state(self, positions):
        """Momenta and velocities by the number of their parameter in ``positions``."""
        index = {p: i for i, p in enumerate(positions)}
        return {"momentum": {index[p]: u for p, u in self._u.items()},
                "velocity": {index[p]: v for p, v in self._v.items()}}

    def load(self, state, positions):
        """Takes momenta and velocities from :meth:`state`'s form (copies); what
        ``state`` lacks starts from zero."""
        self._u.clear()
        self._v.clear()
        for mine, key in ((self._u, "momentum"), (self._v, "velocity")):
            for i, t in state.get(key, {}).items():
                p = positions[int(i)]
                if p not in self.compressed or t.numel() != p.numel():
                    raise ValueError(f"DGC state: entry {i} of {key!r} does not fit "
                                     f"parameter {i} of this optimizer")
                mine[p] = t.detach().to(p.device, torch.float32).reshape(-1).clone()

    def takes(self, p, grad):
        """Whether ``p``'s gradient ``grad`` goes compressed."""
        return p in self.compressed and not grad.is_sparse

    def _clip(self, grad, size):
        s = self.s
        if s.clip_grad_func == "value":
            grad.clamp_(-s.clip_grad_param, s.clip_grad_param)
        elif s.clip_grad_func == "norm":
            # Local clipping: each of `size` ranks clips at max_norm / sqrt(size), so
            # their sum stays within about max_norm (the DGC paper's rule).
            limit = s.clip_grad_param / math.sqrt(size)
            norm = torch.linalg.vector_norm(grad)
            grad.mul_(torch.clamp(limit / (norm + 1e-6), max=1.0))

    def clip(self, grad, size):
        """Clips a gradient that goes uncompressed, as compressed ones are clipped."""
        if self.s.clip_grad_func:
            grad = grad.clone()
            self._clip(grad, size)
        return grad

    def pack(self, p, grad, size, scale=1.0):
        """Folds ``grad`` into ``p``'s velocity, takes its top entries out of it and
        returns them as one flat uint8 tensor (``k`` indices, then ``k`` values) with the
        :class:`Sent` context."""
        group = self.compressed[p]
        g = grad.detach().reshape(-1).to(torch.float32)
        wd = group.get("weight_decay", 0) or 0
        if scale != 1.0:
            g = g * scale
        elif wd or self.s.clip_grad_func:
            g = g.clone()  # changed below; the gradient itself stays as backward left it
        if wd:
            g.add_(p.detach().reshape(-1).to(torch.float32), alpha=wd)
        self._clip(g, size)
        fold = (float(group.get("momentum", 0) or 0), float(group.get("dampening", 0) or 0),
                bool(group.get("nesterov")))
        u = self._u.get(p)
        v = self._v.get(p)
        if v is None or v.shape != g.shape:
            v = self._v[p] = torch.zeros_like(g)
        if u is None or u.shape != g.shape:
            u = self._u[p] = torch.zeros_like(g)
        n = v.numel()
        if self.s.warmup_epochs and not epoch_heard() and not self._warned:
            self._warned = True
            warnings.warn(
                f"PERSEUS_DGC_WARMUP_EPOCHS={self.s.warmup_epochs}, but nothing has told DGC "
                "the epoch: call DistributedSampler.set_epoch(epoch) or "
                "optimizer.set_epoch(epoch) at the start of each epoch, or the warm-up "
                "never ends", stacklevel=2)
        k = min(n, max(1, math.ceil(n * self.s.ratio(current_epoch()))))
        if g.device.type == "cpu" and g.is_contiguous():
            chosen = self._fold_select_in_core(g, u, v, fold, k)
        else:
            _fold(g, u, v, fold)
            chosen = select(v.abs(), k, self.s, self._generator)
        m = fold[0]
        indices = torch.zeros(k, dtype=self._index_type, device=v.device)
        values = torch.zeros(k, dtype=self._value_type, device=v.device)
        taken = chosen.numel()
        indices[:taken] = chosen
        values[:taken] = v[chosen]
        v[chosen] = 0
        if self.s.momentum_masking and m:
            u[chosen] = 0
        packet = torch.cat([indices.view(torch.uint8), values.view(torch.uint8)])
        return packet, Sent(k)

    def _fold_select_in_core(self, g, u, v, fold, k):
        """The fold and the selection with the core's one-pass kernel
        (``_core.dgc_fold_select``): the threshold is estimated from a sample of the
        velocity as the fold will leave it, then one pass folds and finds what passes;
        torch's operations adapt the threshold only when too many or too few did."""
        n, s = v.numel(), self.s
        samples = min(n, max(1, math.ceil(n * s.sample_ratio)))

        def run(threshold, out):
            return _core.dgc_fold_select(to_dlpack(g), to_dlpack(u), to_dlpack(v), *fold,
                                         threshold, to_dlpack(out))

        none = torch.empty(0, dtype=torch.int64)
        if k >= n or samples >= n:
            run(math.inf, none)
            return select(v.abs(), k, s, self._generator)
        at = _positions(n, samples, s, self._generator, v.device)
        ahead = v[at].clone()
        _fold(g[at], u[at].clone(), ahead, fold)
        threshold = _estimate(ahead.abs(), k, n)
        out = torch.empty(math.ceil(s.compress_upper_bound * k) + 1, dtype=torch.int64)
        count = run(threshold, out)

        def passing(t):
            return torch.nonzero(v.abs() >= t).view(-1)

        chosen = out[:count] if count <= out.numel() else passing(threshold)
        return _adapt(passing, lambda i: v[i].abs(), k, s, threshold, chosen)

    def receive(self, p, gathered, sent, average):
        """Writes the sum (or with ``average`` the mean) of every rank's pairs from the
        gathered ``[size, bytes]`` buffer into ``p.grad``, densely."""
        cut = sent.k * torch.empty((), dtype=self._index_type).element_size()
        indices = gathered[:, :cut].contiguous().view(self._index_type).reshape(-1).long()
        values = gathered[:, cut:].contiguous().view(self._value_type).reshape(-1).float()
        if average:
            values.div_(gathered.shape[0])
        grad = p.grad
        if grad is None or not grad.is_contiguous() or grad.dtype != torch.float32:
            dense = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            dense.index_add_(0, indices.to(p.device), values.to(p.device))
            if grad is None:
                p.grad = dense.view_as(p).to(p.dtype)
            else:
                grad.copy_(dense.view_as(grad))
            return
        flat = grad.view(-1)
        flat.zero_()
        flat.index_add_(0, indices.to(p.device), values.to(p.device))

    def apply(self, params_with_grads):
        """The step of the compressed parameters: ``p -= lr * grad``, where the gradient
        already carries momentum and weight decay."""
        with torch.no_grad():
            for p in params_with_grads:
                p.add_(p.grad, alpha=-self.compressed[p]["lr"])

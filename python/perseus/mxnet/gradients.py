"""The reduction of gradients for ``DistributedTrainer`` and ``DistributedOptimizer``, with
the PERSEUS_* gradient switches (docs/environment.md) as the torch and TensorFlow
front-ends honour them:

- PERSEUS_ACCUMULATE_N_STEPS=N (:class:`Accumulator`): only every N-th step communicates
  and updates, with the average of the N local gradients;
- PERSEUS_ALLREDUCE_NANCHECK: a NaN or Inf in a reduced gradient raises
  ``FloatingPointError`` on every rank, naming the parameters and the ranks it came
  from, before the update;
- PERSEUS_DOWNSAMPLE_N_ELEMENTS / PERSEUS_GRADIENT_MOMENTUM: each gradient joins its
  residual and only every N-th element (rotating offset) is sent; the others wait;
- PERSEUS_PERF_CHECK_N_STEPS: every N reductions the ranks compare their compute time
  between reductions; a rank slower than 1.5x the median says so;
- PERSEUS_ALLREDUCE_FUSION: the fusion threshold follows the gradients' bytes.

Gradients are reduced as gradients (``PERSEUS_ALLREDUCE_DTYPE`` applies).
"""

import time

import mxnet as mx
import numpy as np

from perseus.common.basics import config as _config
from perseus.common.basics import set_fusion_threshold
from perseus.common.downsample import DownSampler
from perseus.common.gradients import Switches, perf_check, raise_nonfinite, warn_unapplied
from perseus.common.ops import Sum
from perseus.common.process_sets import process_set_size
from perseus.mxnet.compression import Compression
from perseus.mxnet.mpi_ops import grouped_allreduce_


def _floating(array):
    try:
        return np.issubdtype(np.dtype(array.dtype), np.floating)
    except TypeError:  # MXNet's own types (bfloat16)
        return False


def finite_flags(arrays):
    """Whether each NDArray holds only finite values (non-float arrays: True), read with
    one wait for all of them."""
    flags = [mx.nd.contrib.isfinite(a).min().as_in_context(mx.cpu()) if _floating(a) else None
             for a in arrays]
    present = [f for f in flags if f is not None]
    values = iter(mx.nd.concat(*present, dim=0).asnumpy().tolist() if present else [])
    return [True if f is None else bool(next(values)) for f in flags]


class Accumulator:
    """PERSEUS_ACCUMULATE_N_STEPS=N: each key's gradient is summed locally over N calls of
    :meth:`add`; the N-th call replaces the gradient with the average of the N."""

    def __init__(self, n):
        self.n = int(n)
        if self.n < 1:
            raise ValueError(f"PERSEUS_ACCUMULATE_N_STEPS must be >= 1, got {self.n}")
        self._count = {}
        self._sums = {}

    def add(self, key, grad):
        """True when this is the N-th call for ``key``: ``grad`` (written in place) then
        holds the average of the N calls' gradients. Otherwise ``grad`` joins the running
        sum and the call returns False: nothing is to be communicated or applied."""
        if self.n == 1:
            return True
        count = self._count.get(key, 0) + 1
        held = self._sums.get(key)
        if count < self.n:
            self._count[key] = count
            if held is None:
                self._sums[key] = grad.copy()
            else:
                held += grad
            return False
        self._count[key] = 0
        if held is not None:
            del self._sums[key]
            grad += held
        grad *= 1.0 / self.n
        return True

    def reset(self):
        """Forget the partial sums (a restored state starts a fresh cycle)."""
        self._count.clear()
        self._sums.clear()


class GradientReducer:
    """Sums lists of gradients in place across ``process_set`` (each divided by
    ``predivide`` first), applying the switches of the module documentation; ``name``
    starts the reductions' names and is the one that the NaN check reports."""

    def __init__(self, name, predivide=1.0, process_set=None, compression=Compression.none):
        from perseus.common.process_sets import global_process_set

        self.name = name
        self.predivide = float(predivide)
        self.process_set = process_set if process_set is not None else global_process_set
        self.compression = compression
        switches = Switches(_config())
        warn_unapplied("MXNet's DistributedTrainer and DistributedOptimizer")
        self._switches = switches
        self.accumulate = switches.accumulate
        self.nancheck = switches.nancheck
        self.downsample_n = switches.downsample_n
        self.momentum = switches.momentum
        self.perf_every = switches.perf_every
        self._fusion_set = switches.fusion is None
        self._sampler = DownSampler(self.downsample_n, self.momentum, np.copy,
                                    lambda n, like: np.zeros(n, dtype=like.dtype))
        self._updates = 0  # reductions done: the down-sampling offset rotates with it
        self._compute_times = []
        self._last_end = None

    def _needed(self):
        """Whether anything has to run: a reduction over several ranks, or a switch that
        acts on one rank too."""
        return (process_set_size(self.process_set) > 1 or self.nancheck
                or self.downsample_n > 1 or self.perf_every > 0)

    def reduce(self, names, grads, group=None, postscale=1.0):
        """Sum ``grads`` (NDArrays, written in place) across the set, then multiply the sums
        by ``postscale``; ``names`` (one per gradient, the same on every rank) name them in
        the NaN check's report; ``group`` names the reduction (default:
        ``<name>.grads``). Raises
        ``FloatingPointError`` on every rank when PERSEUS_ALLREDUCE_NANCHECK finds a
        reduced gradient that is not finite."""
        if not grads or not self._needed():
            return
        if self.perf_every > 0 and self._last_end is not None:
            self._compute_times.append(time.perf_counter() - self._last_end)
        if not self._fusion_set:
            total = sum(g.size * np.dtype(g.dtype).itemsize for g in grads)
            set_fusion_threshold(self._switches.fusion_threshold(total))
            self._fusion_set = True
        own_bad = []
        if self.nancheck:
            own_bad = [n for n, ok in zip(names, finite_flags(grads)) if not ok]
        sends, contexts = [], []
        for name, g in zip(names, grads):
            sent, sampled = self._downsample(name, g)
            compressed, ctx = self.compression.compress(sent)
            sends.append(compressed)
            contexts.append((ctx, sampled))
        try:
            grouped_allreduce_(sends, op=Sum, prescale_factor=1.0 / self.predivide,
                               postscale_factor=postscale, process_set=self.process_set,
                               gradient=True,
                               name=group or f"{self.name}.grads")
            for g, sent, (ctx, sampled) in zip(grads, sends, contexts):
                self._restore(g, sent, ctx, sampled)
            self._updates += 1
            if self.nancheck:
                bad = [n for n, ok in zip(names, finite_flags(grads)) if not ok]
                if bad:
                    raise_nonfinite(bad, own_bad, self.name, self.process_set)
        except BaseException:
            self._last_end = None
            raise

    def step_done(self):
        """The update that followed a reduction is done: the compute time of the next step
        counts from here, and every PERSEUS_PERF_CHECK_N_STEPS reductions the ranks
        compare theirs."""
        if self.perf_every <= 0:
            return
        if len(self._compute_times) >= self.perf_every:
            times, self._compute_times = self._compute_times, []
            perf_check(times, self.perf_every, self.name, self.process_set)
        self._last_end = time.perf_counter()

    def _downsample(self, name, g):
        """PERSEUS_DOWNSAMPLE_N_ELEMENTS=N (:mod:`perseus.common.downsample`): the slice to
        send at this update and its ``Sampled``; an integer gradient, or N of 1, goes as
        it is (None)."""
        if self.downsample_n <= 1 or not _floating(g):
            return g, None
        sent, sampled = self._sampler.send(name, g.asnumpy().reshape(-1), self._updates)
        return mx.nd.array(sent, ctx=g.context, dtype=g.dtype), sampled

    def _restore(self, g, sent, ctx, sampled):
        """Writes a reduced gradient back into ``g``; a down-sampled one lands on its
        elements and the others get zero (their share waits in the residual)."""
        reduced = self.compression.decompress(sent, ctx)
        if sampled is None:
            if reduced is not g:
                g[:] = reduced
            return
        full = np.empty(g.size, dtype=np.dtype(g.dtype))
        DownSampler.restore(full, reduced.asnumpy(), sampled)
        g[:] = full.reshape(g.shape)

    def reset(self):
        """Forget residuals and timings (a restored state)."""
        self._sampler.reset()
        self._updates = 0
        self._compute_times = []
        self._last_end = None

"""Gossip down-sampling (``PERSEUS_DOWNSAMPLE_N_ELEMENTS``, seed 003), for every
front-end's DistributedOptimizer: each gradient joins a residual kept for its parameter
(decayed by ``PERSEUS_GRADIENT_MOMENTUM``), and only every N-th element of the residual
goes to the wire, from an offset that rotates with each update (the same on every rank),
so every element goes once in N updates; the elements sent are cleared from the
residual, and the others wait in it. The slice is padded to a length that does not
depend on the offset, so the tensor's signature stays the same every update (the response
cache and offline negotiation see one tensor).

The arithmetic is written once, over 1-D arrays that slice as numpy's and torch's do
(a stride slice is a view; ``*=``, ``+=`` and slice assignment work in place); each
front-end gives how to copy one and make a zeroed one like it.
"""

from typing import NamedTuple

__all__ = ["DownSampler", "Sampled"]


class Sampled(NamedTuple):
    """How a down-sampled gradient was sent: every ``every``-th element from ``offset``,
    ``count`` of them."""

    offset: int
    every: int
    count: int


class DownSampler:
    """The residuals of one optimizer's gradients, by key. ``copy(x)`` is a copy of a
    1-D array ``x``; ``zeros(n, like)`` a zeroed 1-D array of ``n`` elements of
    ``like``'s type, where ``like`` lives (host or device)."""

    def __init__(self, every, momentum, copy, zeros):
        self.every, self.momentum = int(every), float(momentum)
        self._copy, self._zeros = copy, zeros
        self._residuals = {}

    def send(self, key, flat, update):
        """The array to send for gradient ``flat`` (1-D) of ``key`` at update number
        ``update``, and its :class:`Sampled`."""
        n = self.every
        acc = self._residuals.get(key)
        if acc is None or acc.shape != flat.shape or acc.dtype != flat.dtype:
            acc = self._copy(flat)
        else:
            acc *= self.momentum
            acc += flat
        self._residuals[key] = acc
        offset = update % n
        picked = acc[offset::n]
        count = picked.shape[0]
        sent = self._zeros(-(-flat.shape[0] // n), acc)
        sent[:count] = picked
        picked[...] = 0
        return sent, Sampled(offset, n, count)

    @staticmethod
    def restore(full, reduced, sampled):
        """Writes the reduced slice ``reduced`` (1-D) into ``full`` (1-D, the whole
        gradient): its elements get their sums, the others zero (their share waits in
        the residual)."""
        full[...] = 0
        full[sampled.offset::sampled.every] = reduced[:sampled.count]

    def reset(self):
        """Forgets every residual (a restored state)."""
        self._residuals.clear()

"""The statistics a SyncBatchNorm normalizes with, merged from every rank's own: one
routine for the torch, TensorFlow and MXNet layers.

Each rank gathers, per channel, its row count, its mean and its M2 (the sum of squared
deviations from its own mean) from every rank of the set, and :func:`merge` gives those
of the union: the parallel form of Welford's update (Chan, Golub and LeVeque), for all
ranks at once. Sums of x and of x² would be cheaper to combine, but E[x²] − E[x]² loses
every digit of the variance when the mean is large next to the spread.
"""


def merge(counts, means, m2s, sum0, divide):
    """The union's ``(count, mean, m2)`` from the ranks' rows.

    ``counts`` has shape ``(ranks, 1)``, ``means`` and ``m2s`` ``(ranks, channels)``;
    an empty rank's row is all zeros. ``sum0(t)`` sums ``t`` over its rows and
    ``divide(a, b)`` divides, giving 0 where ``b`` is 0 (no rows anywhere), in the
    caller's framework. Nothing else but ``+``, ``-`` and ``*`` is used, so torch,
    TensorFlow, MXNet and NumPy arrays serve alike, and gradients flow through.
    The variance is ``m2 / count``; the unbiased one ``m2 / (count - 1)``.
    """
    count = sum0(counts)
    mean = divide(sum0(counts * means), count)
    deviation = means - mean
    m2 = sum0(m2s + counts * deviation * deviation)
    return count, mean, m2


def merge_gradients(count, mean, total, total_mean, dmean, dvar):
    """The gradients of one rank's ``(mean, m2)`` from those of the union's mean and
    biased variance, for a framework that needs them written out (MXNet's custom
    operator). ``count`` and ``mean`` are this rank's, ``total`` and ``total_mean`` the
    union's; ``dmean`` and ``dvar`` are summed over the ranks (every rank's loss depends
    on the union's statistics).

    With N the union's count and c, m this rank's: d mean / d m = c / N,
    d var / d m = 2 c (m − mean) / N (the other ranks' terms cancel), and
    d var / d m2 = 1 / N.
    """
    if not total:
        return mean * 0, mean * 0
    share = count / total
    return share * (dmean + 2 * (mean - total_mean) * dvar), dvar / total

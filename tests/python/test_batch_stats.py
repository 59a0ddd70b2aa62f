"""perseus.common.batch_stats: the SyncBatchNorm statistics of torch, TensorFlow and
MXNet, merged from each rank's count, mean and M2."""

import numpy as np
from perseus.common import batch_stats


def divide(a, b):
    return np.divide(a, np.where(b == 0, 1, b)) * (b != 0)


def rows_of(parts):
    """Each part's (count, mean, m2) per channel, as the ranks send them."""
    counts = np.array([[float(len(p))] for p in parts])
    means = np.array([p.mean(0) if len(p) else np.zeros(p.shape[1]) for p in parts])
    m2s = np.array([((p - p.mean(0)) ** 2).sum(0) if len(p) else np.zeros(p.shape[1])
                    for p in parts])
    return counts, means, m2s


def merged(parts):
    return batch_stats.merge(*rows_of(parts), lambda t: t.sum(0), divide)


def test_uneven_and_empty_ranks_merge_to_the_whole_batchs_statistics():
    rng = np.random.default_rng(7)
    whole = rng.normal(3.0, 2.0, size=(23, 4))
    parts = [whole[:10], whole[10:10], whole[10:11], whole[11:]]  # one rank empty
    count, mean, m2 = merged(parts)
    assert count[0] == 23
    np.testing.assert_allclose(mean, whole.mean(0), rtol=1e-12)
    np.testing.assert_allclose(m2 / count, whole.var(0), rtol=1e-12)


def test_a_large_mean_keeps_the_variance_where_sums_of_squares_lose_it():
    # float32 rows, as the layers compute them: mean 1e4, spread 1e-2.
    rng = np.random.default_rng(3)
    whole = (1e4 + rng.normal(0.0, 1e-2, size=(4000, 2))).astype(np.float32)
    parts = [whole[:1500], whole[1500:]]
    want = whole.astype(np.float64).var(0)
    count, mean, m2 = batch_stats.merge(*(r.astype(np.float32) for r in rows_of(
        [p.astype(np.float64) for p in parts])), lambda t: t.sum(0), divide)
    np.testing.assert_allclose(m2 / count, want, rtol=1e-3)
    np.testing.assert_allclose(mean, whole.astype(np.float64).mean(0), rtol=1e-6)
    # What sums of x and x² give in float32 here: nothing of the variance survives.
    s1, s2 = whole.sum(0, dtype=np.float32), (whole * whole).sum(0, dtype=np.float32)
    naive = s2 / np.float32(len(whole)) - (s1 / np.float32(len(whole))) ** 2
    assert not np.allclose(naive, want, rtol=0.5), naive


def test_no_rows_anywhere_is_mean_and_variance_zero():
    count, mean, m2 = merged([np.zeros((0, 3)), np.zeros((0, 3))])
    assert count[0] == 0
    assert not mean.any() and not m2.any()


def test_the_written_out_gradients_match_finite_differences():
    rng = np.random.default_rng(11)
    parts = [rng.normal(size=(5, 3)), rng.normal(1.0, 3.0, size=(8, 3))]
    counts, means, m2s = rows_of(parts)
    dmean, dvar = rng.normal(size=3), rng.normal(size=3)

    def loss(means, m2s):
        count, mean, m2 = batch_stats.merge(counts, means, m2s, lambda t: t.sum(0), divide)
        return float((dmean * mean).sum() + (dvar * m2 / count).sum())

    count, mean, _ = batch_stats.merge(counts, means, m2s, lambda t: t.sum(0), divide)
    for r in range(2):
        dm, dm2 = batch_stats.merge_gradients(counts[r, 0], means[r], count[0], mean,
                                              dmean, dvar)
        for c in range(3):
            for grad, which in ((dm, "mean"), (dm2, "m2")):
                a, b = means.copy(), m2s.copy()
                bumped = a if which == "mean" else b
                bumped[r, c] += 1e-6
                numeric = (loss(a, b) - loss(means, m2s)) / 1e-6
                assert abs(grad[c] - numeric) < 1e-5, (r, c, which, grad[c], numeric)
    # An empty union has no gradient.
    dm, dm2 = batch_stats.merge_gradients(0.0, np.zeros(3), 0.0, np.zeros(3), dmean, dvar)
    assert not dm.any() and not dm2.any()

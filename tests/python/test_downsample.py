"""Gossip down-sampling's arithmetic (perseus.common.downsample), which every front-end's
DistributedOptimizer uses: on numpy arrays (TensorFlow, MXNet) and torch tensors alike."""

import numpy as np
import pytest
from perseus.common.downsample import DownSampler, Sampled


def numpy_sampler(n, momentum):
    return DownSampler(n, momentum, np.copy, lambda k, like: np.zeros(k, dtype=like.dtype))


def torch_sampler(n, momentum):
    torch = pytest.importorskip("torch")
    return DownSampler(n, momentum, torch.clone, lambda k, like: like.new_zeros(k))


def reference(grads, n, momentum):
    """What each update sends, computed element by element."""
    residual = np.zeros_like(grads[0])
    out = []
    for update, g in enumerate(grads):
        residual = g.copy() if update == 0 else residual * momentum + g
        offset = update % n
        picked = residual[offset::n].copy()
        residual[offset::n] = 0
        sent = np.zeros(-(-g.size // n), dtype=g.dtype)
        sent[:picked.size] = picked
        out.append((sent, Sampled(offset, n, picked.size)))
    return out


@pytest.mark.parametrize("make", [numpy_sampler, torch_sampler], ids=["numpy", "torch"])
@pytest.mark.parametrize("n, size", [(2, 7), (3, 7), (4, 4), (5, 3)])
def test_each_update_sends_the_residuals_next_slice_padded_to_one_length(make, n, size):
    rng = np.random.default_rng(n * 100 + size)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(2 * n + 1)]
    sampler = make(n, 0.5)
    as_input = (lambda a: a) if make is numpy_sampler else __import__("torch").from_numpy
    for update, (g, (want, want_sampled)) in enumerate(zip(grads, reference(grads, n, 0.5))):
        sent, sampled = sampler.send("w", as_input(g.copy()), update)
        got = np.asarray(sent)
        assert got.shape == (-(-size // n),), update
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"update {update}")
        assert sampled == want_sampled


def test_every_element_goes_once_in_n_updates_and_nothing_is_lost():
    n, size = 3, 10
    sampler = numpy_sampler(n, 1.0)
    total = np.zeros(size)
    g = np.arange(1, size + 1, dtype=np.float64)
    for update in range(n):
        sent, sampled = sampler.send("w", g, update)
        full = np.empty(size)
        DownSampler.restore(full, sent, sampled)
        total += full
    # Momentum 1: what was held back arrives later, summed: n updates of g in all but
    # the share still waiting in the residual.
    waiting = sampler._residuals["w"]
    np.testing.assert_allclose(total + waiting, n * g)
    assert sampled.offset == (n - 1) % n


def test_restore_writes_the_slice_and_zeroes_the_rest():
    full = np.full(7, 9.0)
    DownSampler.restore(full, np.array([1.0, 2.0, 3.0, 0.0]), Sampled(1, 2, 3))
    assert full.tolist() == [0, 1, 0, 2, 0, 3, 0]


def test_a_changed_shape_or_dtype_starts_the_residual_again_and_reset_forgets_all():
    sampler = numpy_sampler(2, 0.5)
    sampler.send("w", np.ones(4, dtype=np.float32), 0)
    sent, _ = sampler.send("w", np.ones(6, dtype=np.float32), 1)
    assert np.asarray(sent).tolist() == [1, 1, 1]
    sent, _ = sampler.send("w", np.ones(6, dtype=np.float64), 2)
    assert sent.dtype == np.float64 and sent.tolist() == [1, 1, 1]
    sampler.reset()
    assert sampler._residuals == {}

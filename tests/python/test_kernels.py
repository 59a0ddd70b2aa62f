"""The device kernels one at a time (perseus.torch.kernels) against torch's own
operations on the same CUDA tensors, bit for bit where both round once from float32;
without a GPU, the argument errors that come before any device is opened."""

import pytest
import torch
from perseus.torch import kernels

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

# Not a multiple of the block (256) nor of a warp, and more than one grid-stride round
# of the largest grid (8192 blocks of 256).
N = 8192 * 256 + 12_345


def test_host_tensors_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="scale: x is in host memory; the device kernels "
                                         "take CUDA tensors"):
        kernels.scale_(torch.ones(4), 2.0)
    with pytest.raises(ValueError, match="cast: src is in host memory"):
        kernels.cast(torch.ones(4), torch.float16)
    with pytest.raises(ValueError, match="nonfinite: x is in host memory"):
        kernels.nonfinite(torch.ones(4))


def test_bad_arguments_are_named_before_any_device_is_opened():
    with pytest.raises(ValueError, match='reduce: no op "mean"; there are sum, min, max '
                                         'and product'):
        kernels.reduce_(torch.ones(4), torch.ones(4), op="mean")
    with pytest.raises(ValueError, match="top_k_: k is 5; the residual has 4 elements"):
        kernels.top_k_(torch.ones(4), 5)
    with pytest.raises(ValueError, match="cast: float32 to float64"):
        kernels.cast(torch.ones(4), torch.float64)


def data(n, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    elif a.dtype == torch.float64:
        a, b = a.view(torch.int64), b.view(torch.int64)
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[0].item()}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_casts_with_the_gradient_scale_match_torch(half):
    x = data(N) * 100
    for scale in (1.0, 10.0, 0.125):
        down = kernels.cast(x, half, scale)
        same_bits(down, (x * scale).to(half))
        up = kernels.cast(down, torch.float32, 1 / scale)
        same_bits(up, down.float() * (1 / scale))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
def test_reductions_match_torch(dtype, op):
    a, b = data(N, dtype, 1), data(N, dtype, 2)
    want = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum,
            "product": torch.mul}[op](a, b)
    got = kernels.reduce_(a.clone(), b, op)
    same_bits(got, want)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_scale_matches_torch(dtype):
    x = data(N, dtype, 3)
    for factor in (0.5, 1 / 3, 7.0):
        same_bits(kernels.scale_(x.clone(), factor), x * factor)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_views_off_the_vector_alignment_give_the_same_bits(dtype):
    """The kernels load 16 bytes at a time where every pointer allows it; a view one
    element in (x[1:]), alone or beside an aligned one, goes one element at a time with
    the same results, and the element before it is left alone."""
    a, b = data(N + 1, dtype, 6), data(N + 1, dtype, 7)
    for dst_at, src_at in ((1, 1), (0, 1), (1, 0)):
        got = a.clone()
        kernels.reduce_(got[dst_at:dst_at + N], b[src_at:src_at + N], "sum")
        same_bits(got[dst_at:dst_at + N], a[dst_at:dst_at + N] + b[src_at:src_at + N])
        same_bits(got[:dst_at], a[:dst_at])
    got = a.clone()
    kernels.scale_(got[1:], 0.75)
    same_bits(got[1:], a[1:] * 0.75)
    same_bits(got[:1], a[:1])
    if dtype == torch.float32:
        for half in (torch.float16, torch.bfloat16):
            down = kernels.cast(a[1:], half, 10.0)
            same_bits(down, (a[1:] * 10.0).to(half))
            h = down.new_empty(N + 1)
            h[1:] = down
            same_bits(kernels.cast(h[1:], torch.float32, 0.1), down.float() * 0.1)
    if dtype in (torch.float32, torch.float16):
        y = a.clone()
        assert kernels.nonfinite(y[1:]) is False
        y[0] = float("nan")  # outside the view
        assert kernels.nonfinite(y[1:]) is False
        y[N] = float("inf")
        assert kernels.nonfinite(y[1:]) is True


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_nonfinite_check_finds_one_nan_or_inf_anywhere(dtype):
    x = data(N, dtype, 4)
    assert kernels.nonfinite(x) is False
    for at in (0, 255, N // 2, N - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[at] = bad
            assert kernels.nonfinite(y) is True, (at, bad)
    assert kernels.nonfinite(x[:0]) is False


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k", [1, 1000, N // 100, N])
def test_top_k_selects_what_torch_topk_selects_and_clears_it(k):
    # Distinct magnitudes (1 to N, exact in float32), random signs and places: no ties
    # at the threshold, so both must select the same set. (N random floats would have
    # ties: tens of thousands of pairs share a magnitude.)
    g = torch.Generator(device="cuda").manual_seed(5)
    mags = (torch.randperm(N, generator=g, device="cuda") + 1).float()
    signs = torch.randint(0, 2, (N,), generator=g, device="cuda").float() * 2 - 1
    x = mags * signs
    residual = x.clone()
    indices, values, threshold = kernels.top_k_(residual, k)
    want = torch.topk(x.abs(), k).indices
    assert indices.numel() == k
    assert torch.equal(torch.sort(indices.long()).values, torch.sort(want).values)
    assert torch.equal(values, x[indices.long()])
    assert threshold == N - k + 1 == x.abs()[want].min().item()
    kept = torch.ones(N, dtype=torch.bool, device="cuda")
    kept[want] = False
    assert torch.equal(residual[kept], x[kept])
    assert (residual[~kept] == 0).all()


@pytest.mark.gpu
@needs_gpu
def test_top_k_of_ties_fills_only_its_slots():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, 3.0, -3.0], device="cuda")
    indices, values, threshold = kernels.top_k_(x, 2)
    assert threshold == 3.0 and indices.numel() == 2
    assert set(indices.tolist()) <= {1, 2, 4, 5}
    assert (values.abs() == 3).all()
    # Exactly the two taken are cleared; the other two 3s stay for a later step.
    assert (x == 0).sum().item() == 2 and (x.abs() == 3).sum().item() == 2


@pytest.mark.gpu
@needs_gpu
def test_a_kernel_sees_the_work_queued_before_it_on_torchs_stream():
    x = torch.zeros(N, device="cuda")
    torch.cuda._sleep(100_000_000)  # the fill below runs well after this returns
    x.fill_(3.0)
    kernels.scale_(x, 2.0)
    x.add_(1.0)  # and torch's next work sees the kernel's
    assert (x == 7.0).all()

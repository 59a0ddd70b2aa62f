"""perseus.torch.optim: the fused optimizers against torch.optim (SGD, Adam, AdamW) and
against a plain torch rendering of LAMB, their state against torch's, their errors, and
PERSEUS_FUSED_OPTIMIZER through DistributedOptimizer on several ranks."""

import copy
import math

import pytest
import torch
from perseus.torch import optim


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))


def _train(model, opt, steps, seed=1):
    """``steps`` steps on fixed random data (the same for every call with ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 20, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


CASES = [
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.1}),
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True}),
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.05, "momentum": 0.5, "maximize": True}),
    (torch.optim.Adam, optim.FusedAdam, {"lr": 0.01}),
    (torch.optim.Adam, optim.FusedAdam, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1}),
    (torch.optim.Adam, optim.FusedAdam, {"lr": 0.01, "eps": 1e-3, "maximize": True}),
    (torch.optim.AdamW, optim.FusedAdamW, {"lr": 0.01}),
    (torch.optim.AdamW, optim.FusedAdamW, {"lr": 0.02, "weight_decay": 0.3}),
]


@pytest.mark.parametrize("ref_cls,fused_cls,kwargs", CASES,
                         ids=[f"{c[1].__name__}-{i}" for i, c in enumerate(CASES)])
def test_fused_step_matches_torch(ref_cls, fused_cls, kwargs):
    ref, ours = _model(), _model()
    _train(ref, ref_cls(ref.parameters(), **kwargs), 6)
    _train(ours, fused_cls(ours.parameters(), **kwargs), 6)
    assert _max_diff(ref, ours) < 2e-6, _max_diff(ref, ours)
    assert _max_diff(ours, _model()) > 1e-3, "the fused optimizer did not move the weights"


def test_a_large_parameter_is_shared_among_threads_and_still_matches_torch():
    # 600k elements: above the size at which the core splits a step across threads.
    w_ref = torch.nn.Parameter(torch.randn(600_000, generator=torch.Generator().manual_seed(3)))
    w_ours = torch.nn.Parameter(w_ref.detach().clone())
    ref = torch.optim.Adam([w_ref], lr=0.01, weight_decay=0.01)
    ours = optim.FusedAdam([w_ours], lr=0.01, weight_decay=0.01)
    for step in range(3):
        g = torch.randn(600_000, generator=torch.Generator().manual_seed(10 + step))
        w_ref.grad, w_ours.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(w_ours, w_ref, rtol=1e-5, atol=1e-6)
    assert ours.state[w_ours]["step"] == 3


def test_state_dicts_move_between_fused_and_torch_optimizers():
    a, b = _model(), _model()
    fused = optim.FusedAdam(a.parameters(), lr=0.01, weight_decay=0.05)
    plain = torch.optim.Adam(b.parameters(), lr=0.01, weight_decay=0.05)
    _train(a, fused, 3)
    _train(b, plain, 3)
    # Hand the fused state to torch's Adam, and torch's back to a fresh fused one: each
    # goes on as the original does (state dicts share tensors: copy them).
    b.load_state_dict(a.state_dict())
    plain.load_state_dict(copy.deepcopy(fused.state_dict()))
    c = copy.deepcopy(a)
    fused2 = optim.FusedAdam(c.parameters(), lr=0.01, weight_decay=0.05)
    fused2.load_state_dict(copy.deepcopy(plain.state_dict()))
    _train(a, fused, 2, seed=9)
    _train(b, plain, 2, seed=9)
    _train(c, fused2, 2, seed=9)
    assert _max_diff(a, b) < 2e-6 and _max_diff(a, c) < 2e-6
    state = next(iter(fused2.state.values()))
    assert int(state["step"]) == 5 and set(state) == {"step", "exp_avg", "exp_avg_sq"}


def test_sgd_momentum_buffer_is_torchs():
    a, b = _model(), _model()
    fused = optim.FusedSGD(a.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    _train(a, fused, 2)
    _train(b, plain, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(fused.state[p]["momentum_buffer"],
                                   plain.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-7)


def _lamb_reference(params, grads, state, step, lr, betas, eps, weight_decay, adam_w_mode,
                    grad_averaging, max_grad_norm, always_adapt):
    """LAMB as seed 001 describes it, one plain torch operation at a time, in float64."""
    b1, b2, wd = betas[0], betas[1], weight_decay
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    clip = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
    for p, g in zip(params, grads):
        m, v = state.setdefault(id(p), (torch.zeros_like(p, dtype=torch.float64),
                                         torch.zeros_like(p, dtype=torch.float64)))
        w = p.detach().double()
        g = g.double() / clip
        if not adam_w_mode:
            g = g + wd * w
        m.mul_(b1).add_(g, alpha=(1 - b1) if grad_averaging else 1.0)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        u = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
        if adam_w_mode:
            u = u + wd * w
        ratio = 1.0
        if always_adapt or wd != 0:
            wn, un = w.norm().item(), u.norm().item()
            ratio = wn / un if wn > 0 and un > 0 else 1.0
        p.data.copy_((w - lr * ratio * u).float())


@pytest.mark.parametrize("kwargs", [
    {},
    {"weight_decay": 0.01, "max_grad_norm": 0.05},
    {"weight_decay": 0.01, "adam_w_mode": False, "max_grad_norm": 0.0},
    {"weight_decay": 0.0, "always_adapt": False, "grad_averaging": False},
])
def test_lamb_matches_a_plain_rendering_of_the_rule(kwargs):
    model, ref = _model(), _model()
    args = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "adam_w_mode": True,
                "grad_averaging": True, "max_grad_norm": 1.0, "always_adapt": True}
    args.update(kwargs)
    opt = optim.LAMB(model.parameters(), **args)
    state = {}
    g = torch.Generator().manual_seed(4)
    for step in range(1, 5):
        x = torch.randn(64, 20, generator=g)
        for m in (model, ref):
            m.zero_grad()
            (m(x).pow(2).mean() * 10).backward()
        opt.step()
        params = list(ref.parameters())
        _lamb_reference(params, [p.grad for p in params], state, step, **args)
    assert _max_diff(model, ref) < 5e-6, _max_diff(model, ref)
    assert opt.state[next(model.parameters())]["step"] == 4


def test_lamb_defaults_are_seed_001s_and_zero_grad_sets_none():
    p = torch.nn.Parameter(torch.ones(3))
    opt = optim.LAMB([p])
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert d["adam_w_mode"] and d["grad_averaging"] and d["max_grad_norm"] == 1.0
    p.grad = torch.ones(3)
    opt.step()
    opt.zero_grad()
    assert p.grad is None
    kept = optim.LAMB([p], set_grad_none=False)
    p.grad = torch.ones(3)
    kept.zero_grad()
    assert p.grad is not None and p.grad.abs().sum() == 0


def test_parameters_without_gradients_are_left_alone_and_closure_returns_the_loss():
    used, unused = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = optim.FusedAdam([used, unused], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (used * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 8.0
    assert torch.equal(unused.detach(), torch.ones(4)) and unused not in opt.state
    torch.testing.assert_close(used.detach(), torch.full((4,), 0.9))


def test_bad_parameters_are_refused_with_the_cause():
    half = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    half.grad = torch.ones(4, dtype=torch.float16)
    with pytest.raises(TypeError, match="parameter 0 is torch.float16; fused optimizers update "
                                        "float32"):
        optim.FusedSGD([half], lr=0.1).step()
    strided = torch.nn.Parameter(torch.ones(4, 4).t())
    strided.grad = torch.ones(4, 4)
    with pytest.raises(ValueError, match="parameter 0 or its gradient is not contiguous"):
        optim.FusedAdam([strided]).step()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        optim.FusedAdam(emb.parameters()).step()
    with pytest.raises(ValueError, match="no amsgrad variant"):
        optim.FusedAdam([half], amsgrad=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.LAMB([half], lr=-1)
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        optim.FusedSGD([half], nesterov=True)


def test_the_core_refuses_mismatched_state_with_the_parameter_named():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = optim.FusedAdam([p])
    opt.state[p] = {"step": 0, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(4)}
    with pytest.raises(ValueError, match="Adam parameter 0 of group 0: exp_avg has 3 elements, "
                                         "the weight 4"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4)), "nothing is written when a tensor is bad"


def test_fused_optimizer_through_distributed_optimizer(run_workers):
    out = run_workers(2, "fused_optimizer.py", env={"PERSEUS_FUSED_OPTIMIZER": "1"})
    assert "torch's own step runs" in out, out  # the amsgrad case fell back, and said so


# --------------------------------------------------------------------------- on a GPU

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

GPU_CASES = CASES + [
    (None, optim.LAMB, {"lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.05}),
    (None, optim.LAMB, {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.01}),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ref_cls,fused_cls,kwargs", GPU_CASES,
                         ids=[f"{c[1].__name__}-{i}" for i, c in enumerate(GPU_CASES)])
def test_fused_kernels_on_the_gpu_match_the_cpu(ref_cls, fused_cls, kwargs):
    """The NVRTC kernels against torch's step (LAMB: the core's CPU step) on the CPU."""
    ref, ours = _model(), _model().cuda()
    make_ref = ref_cls or fused_cls
    _train(ref, make_ref(ref.parameters(), **kwargs), 6)
    g = torch.Generator().manual_seed(1)
    opt = fused_cls(ours.parameters(), **kwargs)
    for _ in range(6):
        x = torch.randn(64, 20, generator=g).cuda()
        opt.zero_grad()
        ours(x).pow(2).mean().backward()
        opt.step()
    assert _max_diff(ref, ours.cpu()) < 2e-5, _max_diff(ref, ours.cpu())


# Around the 4096-element chunk of a multi-tensor launch, and empty.
MANY = [1, 0, 3, 4095, 4096, 4097, 3 * 4096 + 5, 100_003, 17]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ref_cls,fused_cls,kwargs", [
    (torch.optim.SGD, optim.FusedSGD, {"lr": 0.05, "momentum": 0.8, "nesterov": True}),
    (torch.optim.AdamW, optim.FusedAdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (None, optim.LAMB, {"lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.05}),
], ids=["sgd", "adamw", "lamb"])
def test_one_launch_updates_many_parameters_of_every_size(ref_cls, fused_cls, kwargs):
    """A step on the GPU is one launch per kernel over every parameter, a block per
    4096-element chunk: each parameter, whatever its size, gets its own update, as the
    CPU step gives it; and the same step twice gives the same bits (LAMB's norms are
    summed in a fixed order, so ranks never drift apart)."""
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(n, generator=g) for n in MANY]
    grads = [[torch.randn(n, generator=g) for n in MANY] for _ in range(4)]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ours = [torch.nn.Parameter(t.cuda()) for t in init]
    again = [torch.nn.Parameter(t.cuda()) for t in init]
    opts = [(ref_cls or fused_cls)(ref, **kwargs), fused_cls(ours, **kwargs),
            fused_cls(again, **kwargs)]
    for step in grads:
        for p, q, r, grad in zip(ref, ours, again, step):
            p.grad, q.grad, r.grad = grad.clone(), grad.cuda(), grad.cuda()
        for opt in opts:
            opt.step()
    for n, p, q, r, before in zip(MANY, ref, ours, again, init):
        if n:
            diff = (p.detach() - q.detach().cpu()).abs().max().item()
            assert diff < 2e-5, (n, diff)
            assert not torch.equal(q.detach().cpu(), before), n
            assert torch.equal(q, r), n


@pytest.mark.gpu
@needs_gpu
def test_the_fused_step_on_the_gpu_is_ordered_with_torchs_stream():
    n = 1 << 22
    p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
    p.grad = torch.zeros(n, device="cuda")
    opt = optim.FusedSGD([p], lr=1.0)
    torch.cuda._sleep(100_000_000)  # the gradient is written late on torch's stream ...
    p.grad.fill_(1.0)
    opt.step()  # ... and the step must read it
    doubled = p.detach() * 2  # torch's stream must wait for the step
    assert torch.equal(doubled.cpu(), torch.full((n,), -2.0))


@pytest.mark.gpu
@needs_gpu
def test_fused_optimizer_through_distributed_optimizer_on_cuda_tensors(run_workers):
    run_workers(2, "fused_optimizer.py", "cuda",
                env={"PERSEUS_FUSED_OPTIMIZER": "1", "CUDA_VISIBLE_DEVICES": "0"})


@pytest.mark.parametrize("fused", [True, False])
def test_seed_001s_ddp_script_with_aiak_fused_optimizer(run_workers, fused):
    # seed 001 sets AIAK_FUSED_OPTIMIZER=1 for DDP jobs, with no hvd.DistributedOptimizer
    run_workers(2, "aiak_names.py", "fused" if fused else "torch",
                env={"AIAK_FUSED_OPTIMIZER": "1"} if fused else None)

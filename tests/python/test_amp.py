"""AMP O2 (perseus.torch.amp): the model in half precision, float32 masters in the
optimizer, the native GradScaler loop, and hvd.DistributedOptimizer over it."""

import copy

import perseus.torch.optim as fused
import pytest
import torch
import torch.nn.functional as F
from perseus.torch import amp
from torch import nn

HALF = (torch.float16, torch.bfloat16)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def batch(step, device="cpu"):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(12, 6, generator=g).to(device),
            torch.randn(12, 3, generator=g).to(device))


def reference(net, make_opt, dtype, steps, scale, max_norm, device="cpu"):
    """AMP O2 written out by hand: the model cast (batch norm kept), masters from the cast
    values, float32 gradients divided by the (power of two) scale, clipped, stepped,
    written back."""
    net = copy.deepcopy(net)
    pairs, params = [], []
    for module in net.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.BatchNorm1d):
                params.append(p)
            else:
                p.data = p.data.to(dtype)
                master = nn.Parameter(p.detach().float())
                pairs.append((p, master))
                params.append(master)
    opt = make_opt(params)
    for step in range(steps):
        x, y = batch(step, device)
        opt.zero_grad()
        out = net(x.to(dtype)).float()
        (F.mse_loss(out, y) * scale).backward()
        for p, master in pairs:
            master.grad = p.grad.float() * (1.0 / scale)
            p.grad = None
        for p in net[1].parameters():
            p.grad.mul_(1.0 / scale)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        with torch.no_grad():
            for p, master in pairs:
                p.copy_(master)
    return net, [m for _, m in pairs]


def train(net, opt, steps, scaler, max_norm, device="cpu"):
    for step in range(steps):
        x, y = batch(step, device)
        opt.zero_grad()
        out = net(x)
        assert out.dtype == torch.float32
        scaler.scale(F.mse_loss(out, y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(amp.amp_parameters(opt), max_norm)
        scaler.step(opt)
        scaler.update()


def masters_of(opt, net):
    """The optimizer's params that are not the model's (the masters), in order."""
    own = {id(p) for p in net.parameters()}
    return [p for g in opt.param_groups for p in g["params"] if id(p) not in own]


def test_decorate_casts_the_model_and_puts_float32_masters_in_the_optimizer():
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    got_net, got_opt = amp.amp_decorate(net, opt)
    assert got_net is net and got_opt is opt and amp.is_decorated(opt)
    dtypes = [p.dtype for p in net.parameters()]
    # Linear, BatchNorm (kept), Linear.
    assert dtypes == [torch.float16] * 2 + [torch.float32] * 2 + [torch.float16] * 2
    assert net[1].running_mean.dtype == torch.float32
    group = opt.param_groups[0]["params"]
    assert all(p.dtype == torch.float32 for p in group)
    model_params = list(net.parameters())
    for i in (0, 1, 4, 5):
        assert group[i] is not model_params[i]
        assert torch.equal(group[i], before[i].half().float()), i
    for i in (2, 3):
        assert group[i] is model_params[i]
    assert net(torch.randn(4, 6)).dtype == torch.float32

    net = model()
    amp.amp_decorate(net, torch.optim.SGD(net.parameters(), lr=0.1), keep_batchnorm_fp32=False,
                     dtype=torch.bfloat16)
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    assert net[1].running_var.dtype == torch.bfloat16
    assert net(torch.randn(4, 6)).dtype == torch.float32


@pytest.mark.parametrize("dtype,make_opt,exact", [
    (torch.float16, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), True),
    (torch.bfloat16, lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01), True),
    (torch.float16, lambda p: fused.FusedAdamW(p, lr=0.01), False),
], ids=["float16-SGD", "bfloat16-Adam", "float16-FusedAdamW"])
def test_training_is_the_o2_arithmetic(dtype, make_opt, exact):
    o2_against_reference(dtype, make_opt, exact, "cpu")


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("make_opt,exact", [
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), True),
    (lambda p: fused.FusedAdamW(p, lr=0.01), False),
], ids=["SGD", "FusedAdamW"])
def test_training_is_the_o2_arithmetic_on_the_gpu(make_opt, exact):
    o2_against_reference(torch.float16, make_opt, exact, "cuda")


def o2_against_reference(dtype, make_opt, exact, device):
    net = model().to(device)
    want_net, want_masters = reference(
        net, (lambda p: torch.optim.AdamW(p, lr=0.01)) if not exact else make_opt,
        dtype, 5, 256.0, 0.5, device)
    opt = make_opt(net.parameters())
    amp.amp_decorate(net, opt, dtype=dtype)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 10)
    scaler = torch.amp.GradScaler(device, init_scale=256.0, growth_interval=1000)
    train(net, opt, 5, scaler, 0.5, device)
    scheduler.step()
    assert scaler.get_scale() == 256.0, "no step overflowed"
    tol = {} if exact else {"rtol": 1e-5, "atol": 2e-6}
    for got, want in zip(masters_of(opt, net), want_masters):
        torch.testing.assert_close(got, want, **({"rtol": 0, "atol": 0} if exact else tol))
    for got, want in zip(net.parameters(), want_net.parameters()):
        assert got.dtype == want.dtype
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)


def test_gradients_accumulate_like_torch_and_zero_grad_clears_both():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.amp_decorate(net, opt)
    first = net[0].weight
    for step in range(2):
        x, y = batch(step)
        F.mse_loss(net(x), y).backward()
        if step == 0:
            once = first.grad.clone()
    summed = first.grad.clone()
    assert summed.dtype == torch.float16 and not torch.equal(once, summed)
    params = list(amp.amp_parameters(opt))
    assert torch.equal(params[0].grad, summed.float())
    assert first.grad is None, "moved off the model"
    # A second move adds nothing; a new backward adds to the master's gradient.
    list(amp.amp_parameters(opt))
    assert torch.equal(params[0].grad, summed.float())
    x, y = batch(0)
    F.mse_loss(net(x), y).backward()
    list(amp.amp_parameters(opt))
    torch.testing.assert_close(params[0].grad, summed.float() + once.float())
    F.mse_loss(net(x), y).backward()
    opt.zero_grad()
    assert first.grad is None and params[0].grad is None


def test_an_overflow_skips_the_step_and_leaves_no_stale_gradient():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.amp_decorate(net, opt)
    masters = [p.detach().clone() for p in masters_of(opt, net)]
    weights = [p.detach().clone() for p in net.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    x, y = batch(0)
    scaler.scale(F.mse_loss(net(x), y) * 1e4).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 23
    assert all(torch.equal(a, b) for a, b in zip(masters_of(opt, net), masters))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), weights))
    assert all(p.grad is None for p in net.parameters() if p.dtype == torch.float16)


@pytest.mark.parametrize("kwargs,init,overflow,want", [
    ({"max_loss_scale": 2.0 ** 10}, 2.0 ** 8, False, 2.0 ** 10),
    ({"min_loss_scale": 2.0 ** 22}, 2.0 ** 24, True, 2.0 ** 22),
    ({"loss_scale": 128.0}, 2.0 ** 8, False, 128.0),
    ({"loss_scale": 128.0}, 2.0 ** 8, True, 128.0),
])
def test_grad_scaler_keeps_the_scale_in_the_bounds(kwargs, init, overflow, want):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    amp.amp_decorate(net, opt, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=1)
    for step in range(5):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.mse_loss(net(x), y) * (1e30 if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == want


def test_a_scaler_of_an_undecorated_optimizer_is_left_alone():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    amp.amp_decorate(net, opt, max_loss_scale=2.0 ** 10)
    plain = model(1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1)
    x, y = batch(0)
    scaler.scale(F.mse_loss(plain(x), y)).backward()
    scaler.step(plain_opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 13
    assert amp.is_decorated(opt)


def test_weights_written_from_outside_refresh_the_masters():
    net, other = model(0), model(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.amp_decorate(net, opt)
    amp.amp_decorate(other, torch.optim.SGD(other.parameters(), lr=0.1))
    net.load_state_dict(other.state_dict())
    masters = list(amp.amp_parameters(opt))
    for got, p in zip(masters, net.parameters()):
        assert torch.equal(got, p.float())
    # Its own step's write-back is not taken for an outside write.
    x, y = batch(0)
    F.mse_loss(net(x), y).backward()
    opt.step()
    stepped = [p.detach().clone() for p in masters_of(opt, net)]
    list(amp.amp_parameters(opt))
    assert all(torch.equal(a, b) for a, b in zip(masters_of(opt, net), stepped))


def test_optimizer_state_moves_to_the_masters():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0)
    F.mse_loss(net(x), y).backward()
    opt.step()
    buf = opt.state[net[0].weight]["momentum_buffer"]
    amp.amp_decorate(net, opt)
    first = opt.param_groups[0]["params"][0]
    assert first is not net[0].weight and opt.state[first]["momentum_buffer"] is buf
    assert net[0].weight not in opt.state


def test_bad_arguments_are_refused_with_their_reason():
    def attempt(*args, **kwargs):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        args = args or (net, opt)
        with pytest.raises((TypeError, ValueError, RuntimeError)) as e:
            amp.amp_decorate(*args, **kwargs)
        return str(e.value)

    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert "must be a torch.nn.Module, not str" in attempt("net", opt)
    assert "must be a torch.optim.Optimizer, not list" in attempt(net, [])
    assert "torch.float16 or torch.bfloat16, not torch.float64" in attempt(dtype=torch.float64)
    assert "loss_scale must be None, 'dynamic' or a number > 0, not -1" in attempt(
        loss_scale=-1)
    assert "num_losses must be an integer >= 1, not 0" in attempt(num_losses=0)
    assert "min_loss_scale 8 is above max_loss_scale 4" in attempt(
        min_loss_scale=8, max_loss_scale=4)
    assert "max_loss_scale must be a number > 0 or None" in attempt(max_loss_scale="big")
    amp.amp_decorate(net, opt)
    assert "already decorated" in attempt(net, opt)


def test_distributed_optimizer_reduces_half_gradients_into_the_masters(run_workers):
    out = run_workers(2, "amp_o2.py")
    assert out.count("WORKER OK") == 2


def test_distributed_optimizer_with_amp_and_the_fused_step(run_workers):
    out = run_workers(2, "amp_o2.py", env={"PERSEUS_FUSED_OPTIMIZER": "1"})
    assert out.count("WORKER OK") == 2


def test_torch_amp_skips_a_step_that_overflowed_on_one_rank_on_every_rank(run_workers):
    """Without amp_decorate: GradScaler checks the reduced gradients, so one rank's
    overflow skips the step everywhere (it used to skip it there alone, and the ranks'
    weights and scales parted)."""
    out = run_workers(2, "amp_overflow.py")
    assert out.count("WORKER OK") == 2


def test_ddp_reduces_half_gradients_and_the_masters_follow_its_broadcast():
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(here, "workers"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(here, "workers", "ddp_amp.py"),
                          str(port)], check=False, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "DDP AMP OK" in out.stdout, out.stdout + out.stderr


def test_grad_scaler_under_accumulate_n_steps_holds_its_scale_and_unscales_once(run_workers):
    """PERSEUS_ACCUMULATE_N_STEPS with the AMP loop unchanged: the calls within a window
    leave the gradients scaled (and hidden from clipping) and the scale alone; the last
    call unscales the reduced sum once. An overflow within a window skips it on every
    rank. (Unscaling every call divided the earlier calls' share again and again, and
    under AMP O2 moved it onto the masters before it was reduced.)"""
    out = run_workers(2, "amp_accumulate.py", env={"PERSEUS_ACCUMULATE_N_STEPS": "2"})
    assert out.count("WORKER OK") == 2
    # One rank: the clipping in the window's last call sees the average, as on two.
    out = run_workers(1, "amp_accumulate.py", env={"PERSEUS_ACCUMULATE_N_STEPS": "3"})
    assert out.count("WORKER OK") == 1

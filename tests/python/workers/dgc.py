"""Deep gradient compression (PERSEUS_DGC=1) in hvd.DistributedOptimizer.

Usage: dgc.py exact      every rank's model after 6 steps equals an independent
                         simulation of every rank's DGC in this process (top-k exact:
                         PERSEUS_DGC_SAMPLE_RATIO=1), the options of the environment
                         (nesterov, fp16 values, int32 indices, masking, clipping)
                         included; a weight's reduced gradient has at most size*k
                         non-zeros, and the bias is averaged and stepped by SGD as usual
       dgc.py sampled    a 120x400 weight with the default sampled threshold: the
                         gradient holds between 0.8k and size*k non-zeros, ranks agree,
                         the loss falls
       dgc.py warmup     PERSEUS_DGC_WARMUP_EPOCHS=2 and COEFF "0.5 0.25": the
                         non-zeros of one rank's selection follow the epoch set through
                         DistributedSampler.set_epoch, then the final ratio
       dgc.py refused    an Adam optimizer and step(closure) are refused, naming DGC's limit
       dgc.py resume     the optimizer's state_dict carries what DGC holds back: 3 steps
                         after a restore (in place, and into a new model and optimizer)
                         equal the 3 steps taken without it; a torch SGD loads the same
                         state; a state without DGC's part starts it from zero
"""

import copy
import math
import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises

IN, OUT, STEPS, LR, WD = 20, 10, 6, 0.1, 1e-3


def env_flag(name, default):
    return os.environ.get(name, default).lower() in ("1", "true")


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)


def make_model():
    torch.manual_seed(7)
    return torch.nn.Linear(IN, OUT)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def simulate(n, k, momentum, nesterov):
    """Every rank's DGC for the weight, written from the method's description (not from
    perseus.torch.dgc), and plain momentum SGD on the averaged bias."""
    model = make_model()
    w, b = model.weight, model.bias
    bias_opt = torch.optim.SGD([b], lr=LR, momentum=momentum, weight_decay=WD,
                               nesterov=nesterov)
    u = [torch.zeros(w.numel()) for _ in range(n)]
    v = [torch.zeros(w.numel()) for _ in range(n)]
    fp16 = env_flag("PERSEUS_DGC_FP16_VALUES", "0")
    masking = env_flag("PERSEUS_DGC_MOMENTUM_MASKING", "1")
    clip = os.environ.get("PERSEUS_CLIP_GRAD_FUNC")
    limit = float(os.environ.get("PERSEUS_CLIP_GRAD_FUNC_PARAMS", "0"))
    for step in range(STEPS):
        sent = torch.zeros(w.numel())
        bias_grads = []
        for r in range(n):
            model.zero_grad()
            loss_of(model, *batch(r, step)).backward()
            g = w.grad.reshape(-1) + WD * w.detach().reshape(-1)
            b_grad = b.grad.clone()
            if clip == "norm":
                g = g * min(1.0, (limit / math.sqrt(n)) / (float(g.norm()) + 1e-6))
                b_grad = b_grad * min(1.0, (limit / math.sqrt(n)) / (float(b_grad.norm()) + 1e-6))
            elif clip == "value":
                g = g.clamp(-limit, limit)
                b_grad = b_grad.clamp(-limit, limit)
            bias_grads.append(b_grad)
            u[r] = momentum * u[r] + g
            v[r] = v[r] + (g + momentum * u[r] if nesterov else u[r])
            top = torch.topk(v[r].abs(), k).indices
            values = v[r][top]
            sent[top] += values.half().float() if fp16 else values
            v[r][top] = 0
            if masking:
                u[r][top] = 0
        with torch.no_grad():
            w -= LR * (sent / n).view_as(w)
        b.grad = torch.stack(bias_grads).mean(0)
        bias_opt.step()
    return model


def exact():
    n = hvd.size()
    momentum, nesterov = 0.9, env_flag("NESTEROV", "0")
    ratio = float(os.environ["PERSEUS_DGC_COMPRESS_RATIO"])
    k = math.ceil(ratio * IN * OUT)
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, weight_decay=WD,
                        nesterov=nesterov),
        named_parameters=model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, *batch(hvd.rank(), step)).backward()
        opt.synchronize()
        nonzero = int((model.weight.grad != 0).sum())
        assert k <= nonzero <= n * k, (step, nonzero, k)
        with opt.skip_synchronize():
            opt.step()
    want = simulate(n, k, momentum, nesterov)
    fp16 = env_flag("PERSEUS_DGC_FP16_VALUES", "0")
    rtol = 1e-3 if fp16 else 1e-5
    close(model.weight.detach(), want.weight.detach(), "weight", rtol=rtol, atol=rtol)
    close(model.bias.detach(), want.bias.detach(), "bias", rtol=1e-5, atol=1e-6)
    print(f"rank {hvd.rank()}: k={k} of {IN * OUT}, weights as simulated", flush=True)


def sampled():
    n = hvd.size()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(400, 120, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(120, 1, bias=False))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    k = math.ceil(0.001 * 400 * 120)
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(64, 400, generator=g)
    y = torch.sin(x[:, :1])
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.synchronize()
        nonzero = int((model[0].weight.grad != 0).sum())
        assert 0.8 * k <= nonzero <= n * k, (nonzero, k)
        with opt.skip_synchronize():
            opt.step()
        losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
    assert losses[-1] < 0.9 * losses[0], losses
    for name, p in model.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0), name=f"check.{name}")
        for r in range(n):
            close(gathered[r].reshape(p.shape), p.detach(), f"{name} on rank {r}",
                  rtol=0, atol=0)


def warmup():
    from torch.utils.data.distributed import DistributedSampler

    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sampler = DistributedSampler(list(range(16)), num_replicas=hvd.size(), rank=hvd.rank())
    numel = IN * OUT
    want = {0: math.ceil(0.5 * numel), 1: math.ceil(0.25 * numel), 2: math.ceil(0.01 * numel)}
    for epoch, k in want.items():
        sampler.set_epoch(epoch)
        opt.zero_grad()
        # Only rank 0 has a gradient: the reduced one holds exactly its k entries.
        scale = 1.0 if hvd.rank() == 0 else 0.0
        (scale * loss_of(model, *batch(0, epoch))).backward()
        opt.synchronize()
        nonzero = int((model.weight.grad != 0).sum())
        assert nonzero == k, (epoch, nonzero, k)
        with opt.skip_synchronize():
            opt.step()


def refused():
    model = make_model()
    with raises(ValueError, "PERSEUS_DGC=1", "only torch.optim.SGD", "Adam",
                what="DGC with Adam"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                 named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    with raises(ValueError, "PERSEUS_DGC=1: step(closure) is not supported",
                what="DGC with a closure"):
        opt.step(lambda: None)


def resume():
    def build():
        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WD),
            named_parameters=model.named_parameters())
        return model, opt

    def steps(model, opt, first):
        for step in range(first, first + 3):
            opt.zero_grad()
            loss_of(model, *batch(hvd.rank(), step)).backward()
            opt.step()

    model, opt = build()
    steps(model, opt, 0)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    held = saved[1]["perseus_dgc"]
    assert set(held) == {"momentum", "velocity"} and set(held["velocity"]) == {0}, held.keys()
    assert int((held["velocity"][0] != 0).sum()) > 0, "nothing held back after 3 steps"
    steps(model, opt, 3)
    want = model.weight.detach().clone()

    model.load_state_dict(saved[0])
    opt.load_state_dict(copy.deepcopy(saved[1]))
    steps(model, opt, 3)
    close(model.weight.detach(), want, "weight after an in-place restore", rtol=0, atol=0)

    model2, opt2 = build()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(copy.deepcopy(saved[1]))
    steps(model2, opt2, 3)
    close(model2.weight.detach(), want, "weight after a restore into a new optimizer",
          rtol=0, atol=0)

    plain = torch.optim.SGD(make_model().parameters(), lr=LR, momentum=0.9)
    plain.load_state_dict(copy.deepcopy(saved[1]))

    no_dgc = {k: v for k, v in copy.deepcopy(saved[1]).items() if k != "perseus_dgc"}
    model.load_state_dict(saved[0])
    opt.load_state_dict(no_dgc)
    steps(model, opt, 3)
    assert not torch.equal(model.weight.detach(), want), "DGC's held-back state was not reset"


def main():
    hvd.init()
    {"exact": exact, "sampled": sampled, "warmup": warmup, "refused": refused,
     "resume": resume}[sys.argv[1]]()
    r = hvd.rank()
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

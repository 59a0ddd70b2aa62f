"""Training helpers: broadcast_parameters / broadcast_optimizer_state, DistributedOptimizer
equivalence with one process training on the concatenated batch, sparse gradients and
SyncBatchNorm against BatchNorm on the concatenated batch."""

import warnings

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, done, raises
from torch import nn

STEPS, BATCH = 4, 3  # optimizer steps, rows per rank per backward pass


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def make_data(n, passes, dtype=torch.float64):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, passes, n * BATCH, 4, generator=g, dtype=dtype)
    y = torch.randn(STEPS, passes, n * BATCH, 2, generator=g, dtype=dtype)
    return x, y


def train(model, opt, x, y, rows):
    for step in range(STEPS):
        opt.zero_grad()
        for p in range(x.shape[1]):
            F.mse_loss(model(x[step, p, rows]), y[step, p, rows]).backward()
        opt.step()


def check_closure(r, n, opt_class, **hyper):
    """step(closure): the closure's gradients are averaged before the step uses them."""
    x, y = make_data(n, 1)
    ref = make_model()
    ref_opt = opt_class(ref.parameters(), **hyper)
    train(ref, ref_opt, x, y, slice(None))
    model = make_model()
    opt = hvd.DistributedOptimizer(opt_class(model.parameters(), **hyper),
                                   named_parameters=model.named_parameters())
    rows = slice(r * BATCH, (r + 1) * BATCH)
    losses = []
    for step in range(STEPS):
        def closure(step=step):
            opt.zero_grad()
            loss = F.mse_loss(model(x[step, 0, rows]), y[step, 0, rows])
            loss.backward()
            losses.append(loss)
            return loss
        assert opt.step(closure) is losses[-1], "step(closure) returns the closure's loss"
    what = f"step(closure) with {opt_class.__name__}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"{what}: {name}", rtol=1e-10, atol=1e-10)
    check_same_everywhere(model, what)


def check_same_everywhere(model, what):
    mine = [p.detach().clone() for p in model.parameters()]
    for params in hvd.allgather_object(mine, name="params"):
        for a, b in zip(params, mine):
            assert torch.equal(a, b), f"{what}: parameters differ between ranks"


def check_optimizer(r, n, what, passes=1, atol=1e-10, lr=0.1, **kwargs):
    """Train with DistributedOptimizer(**kwargs) and compare with one process (lr 0.1)."""
    x, y = make_data(n, passes)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train(ref, ref_opt, x, y, slice(None))

    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    assert isinstance(opt, torch.optim.SGD)
    train(model, opt, x, y, slice(r * BATCH, (r + 1) * BATCH))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"{what}: {name}", rtol=atol, atol=atol)
    check_same_everywhere(model, what)


def check_optimizer_api(r, n):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_data(n, 1)
    rows = slice(r * BATCH, (r + 1) * BATCH)
    F.mse_loss(model(x[0, 0, rows]), y[0, 0, rows]).backward()
    with raises(AssertionError, "zero_grad", what="zero_grad with reductions in flight"):
        opt.zero_grad()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    for g, p in zip(grads, model.parameters()):
        close(p.grad, g, "skip_synchronize leaves the averaged gradient")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
    # Sum with lr / n is the same as Average with lr.
    check_optimizer(r, n, "op=Sum", op=hvd.Sum, lr=0.1 / n)
    with raises(ValueError, what="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()])
    with raises(ValueError, what="predivide with Sum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def check_broadcast_state(r, n):
    model = make_model(seed=100 + r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for p, q in zip(model.parameters(), make_model(seed=100).parameters()):
        close(p.detach(), q.detach(), "broadcast_parameters(state_dict)")
    model = make_model(seed=200 + r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)
    for p, q in zip(model.parameters(), make_model(seed=200 + n - 1).parameters()):
        close(p.detach(), q.detach(), "broadcast_parameters(named_parameters)")

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.5 + 0.1 * r)
    if r == 0:  # only the root has momentum buffers
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25)
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.5
    for p in model.parameters():
        close(opt.state[p]["momentum_buffer"], torch.full_like(p, 0.25), "momentum buffer")

    adam_model = make_model()
    adam = torch.optim.Adam(adam_model.parameters(), lr=0.01 * (r + 1), betas=(0.8, 0.9))
    for p in adam_model.parameters():
        p.grad = torch.full_like(p, float(r + 1))
    adam.step()
    hvd.broadcast_optimizer_state(adam, root_rank=n - 1)
    states = hvd.allgather_object({k: v for k, v in adam.state_dict()["state"][0].items()})
    for s in states:
        for k in s:
            close(s[k], states[0][k], f"Adam state {k} after broadcast")
    assert adam.param_groups[0]["lr"] == 0.01 * n

    # An optimizer with no state yet: as in Horovod, a zero-gradient step creates it, and
    # every parameter that requires a gradient has a zero-filled .grad afterwards.
    model = make_model(seed=300 + r)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None, "a frozen parameter got a gradient"
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}.grad is None after broadcast_optimizer_state"
            close(p.grad, torch.zeros_like(p), f"{name}.grad after broadcast_optimizer_state")
            close(opt.state[p]["momentum_buffer"], torch.zeros_like(p), "momentum created")
            hvd.broadcast_(p.grad, root_rank=0)  # Horovod users' code reads it right away

    # A scheduler made on the torch optimizer before wrapping keeps steering the wrapper
    # after the broadcast: the group dicts stay the same objects on every rank.
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(a is b for a, b in zip(opt.param_groups, base.param_groups))
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4, dtype=torch.float64) * (r + 1)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3, opt.param_groups[0]["lr"]
    ws = hvd.allgather_object([p.detach() for p in model.parameters()])
    for w in ws:
        for a, b in zip(w, ws[0]):
            close(a, b, "weights under a scheduler made before wrapping")


def check_sparse(r, n):
    dense = torch.zeros(6, 2)
    dense[r] = float(r + 1)
    dense[5] = 1.0
    h = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Sum)
    exp = torch.zeros(6, 2)
    for i in range(n):
        exp[i] = float(i + 1)
    exp[5] = float(n)
    close(hvd.synchronize(h).to_dense(), exp, "sparse_allreduce_async sum")
    h = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.avg", op=hvd.Average)
    close(h().to_dense(), exp / n, "sparse_allreduce_async average (called)")

    # sparse embedding gradients: gathered, or reduced as dense
    for sparse_as_dense in (False, True):
        def make():
            torch.manual_seed(5)
            return nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(),
                                 nn.Linear(6, 1)).double()

        g = torch.Generator().manual_seed(7)
        idx = torch.randint(0, 10, (STEPS, n * BATCH, 2), generator=g)
        y = torch.randn(STEPS, n * BATCH, 1, generator=g, dtype=torch.float64)
        ref, model = make(), make()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        rows = slice(r * BATCH, (r + 1) * BATCH)
        for step in range(STEPS):
            ref_opt.zero_grad()
            F.mse_loss(ref(idx[step]), y[step]).backward()
            ref_opt.step()
            opt.zero_grad()
            F.mse_loss(model(idx[step, rows]), y[step, rows]).backward()
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            close(p.detach(), q.detach(), f"sparse embedding (sparse_as_dense={sparse_as_dense})")


def check_sync_batch_norm(r, n):
    sizes = [2 + i for i in range(n)]  # a different batch size on every rank
    start, rows = sum(sizes[:r]), sizes[r]
    for shape, ref_cls in (((5,), nn.BatchNorm1d), ((3, 4), nn.BatchNorm2d)):
        g = torch.Generator().manual_seed(99)
        x = torch.randn(sum(sizes), 3, *shape, generator=g, dtype=torch.float64) * 2 + 1
        grad_out = torch.randn(x.shape, generator=g, dtype=torch.float64)
        ref = ref_cls(3).double()
        sbn = hvd.SyncBatchNorm(3).double()
        with torch.no_grad():
            for m in (ref, sbn):
                m.weight.copy_(torch.tensor([0.5, 1.5, -1.0]))
                m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        for _ in range(2):  # twice, so that running statistics accumulate
            xr = x.clone().requires_grad_()
            out_ref = ref(xr)
            (out_ref * grad_out).sum().backward()
            xs = x[start:start + rows].clone().requires_grad_()
            sbn.weight.grad = sbn.bias.grad = None
            out = sbn(xs)
            (out * grad_out[start:start + rows]).sum().backward()
            what = f"SyncBatchNorm {ref_cls.__name__}"
            close(out, out_ref[start:start + rows], f"{what} output", rtol=1e-9, atol=1e-9)
            close(xs.grad, xr.grad[start:start + rows], f"{what} input grad", rtol=1e-9,
                  atol=1e-9)
            w_grad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
            b_grad = hvd.allreduce(sbn.bias.grad, op=hvd.Sum)
            close(w_grad, ref.weight.grad, f"{what} weight grad", rtol=1e-9, atol=1e-9)
            close(b_grad, ref.bias.grad, f"{what} bias grad", rtol=1e-9, atol=1e-9)
            ref.weight.grad = ref.bias.grad = None
        close(sbn.running_mean, ref.running_mean, "running_mean", rtol=1e-9, atol=1e-9)
        close(sbn.running_var, ref.running_var, "running_var", rtol=1e-9, atol=1e-9)
        assert int(sbn.num_batches_tracked) == 2
        sbn.eval()
        ref.eval()
        close(sbn(x[start:start + rows]), ref(x[start:start + rows]), "eval mode")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    check_broadcast_state(r, n)
    check_optimizer(r, n, "DistributedOptimizer")
    check_optimizer(r, n, "backward_passes_per_step=2", passes=2)
    check_optimizer(r, n, "Compression.fp16", atol=5e-3, compression=hvd.Compression.fp16)
    check_optimizer(r, n, "gradient_predivide_factor", gradient_predivide_factor=2.0, atol=1e-9)
    check_optimizer(r, n, "groups=2", groups=2)
    check_optimizer_api(r, n)
    check_closure(r, n, torch.optim.SGD, lr=0.1, momentum=0.9)
    check_closure(r, n, torch.optim.Adam, lr=0.01)
    check_sparse(r, n)
    check_sync_batch_norm(r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

"""The optimizer-side PERSEUS_* switches, checked on every rank.

Usage: accelerations.py accumulate   (run with PERSEUS_ACCUMULATE_N_STEPS=2)
       accelerations.py nancheck     (run with PERSEUS_ALLREDUCE_NANCHECK=1)
       accelerations.py fusion N     (run with PERSEUS_ALLREDUCE_FUSION=N)
       accelerations.py dtype        (any PERSEUS_ALLREDUCE_DTYPE, one host)
       accelerations.py hosts        (any PERSEUS_ALLREDUCE_DTYPE and _MODE, several "hosts")
       accelerations.py downsample   (PERSEUS_DOWNSAMPLE_N_ELEMENTS, _GRADIENT_MOMENTUM)
       accelerations.py perfcheck    (PERSEUS_PERF_CHECK_N_STEPS=3; the last rank is slow)
       accelerations.py streams      (PERSEUS_ALLREDUCE_STREAMS, TCP between every pair)
"""

import json
import os
import sys
import tempfile
import time

import perseus.torch.horovod as hvd
import torch
import torch.nn.functional as F
from _helpers import close, direct_reads, done, raises, timeline_rows
from perseus.common import basics
from perseus.common.timeline import timeline_file
from torch import nn

UPDATES, BATCH = 3, 3  # optimizer updates, rows per rank per step


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.float64)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def _clip(kind, params):
    """Clips ``params``' gradients as a training loop would; returns the norm if any."""
    params = list(params)
    if kind == "norm":
        return torch.nn.utils.clip_grad_norm_(params, 0.05)
    if kind == "value":
        torch.nn.utils.clip_grad_value_(params, 0.01)
        return None
    if kind == "total":
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, 0.05, norm)
        return norm
    return None


def check_accumulate(r, n):
    """N=2 steps of batch B each equal one step of 2B, with communication every 2nd step.
    Clipping on every call (norm, value, or total norm then clip) clips only the window's
    reduced sum, once, as one process clipping before its one step."""
    steps = int(basics.config()["PERSEUS_ACCUMULATE_N_STEPS"])
    assert steps == 2, f"run with PERSEUS_ACCUMULATE_N_STEPS=2, not {steps}"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(UPDATES, steps, n * BATCH, 4, generator=g, dtype=torch.float64)
    y = torch.randn(UPDATES, steps, n * BATCH, 2, generator=g, dtype=torch.float64)
    for kind in (None, "norm", "value", "total"):
        # One process: each update on every rank's rows of all `steps` steps, averaged.
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_norms = []
        for u in range(UPDATES):
            ref_opt.zero_grad()
            for s in range(steps):
                (F.mse_loss(ref(x[u, s]), y[u, s]) / steps).backward()
            ref_norms.append(_clip(kind, ref.parameters()))
            ref_opt.step()

        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters())
        rows = slice(r * BATCH, (r + 1) * BATCH)
        nparams = len(list(model.parameters()))
        for u in range(UPDATES):
            for s in range(steps):
                before = params_of(model)
                tensors = hvd.counters()["tensors"]
                opt.zero_grad()
                F.mse_loss(model(x[u, s, rows]), y[u, s, rows]).backward()
                grads = [p.grad.clone() for p in model.parameters()]
                norm = _clip(kind, model.parameters())
                opt.step()
                reduced = hvd.counters()["tensors"] - tensors
                if s < steps - 1:
                    assert reduced == 0, f"step {s} of update {u} communicated {reduced} tensors"
                    for a, b in zip(params_of(model), before):
                        assert torch.equal(a, b), "an accumulating step changed the parameters"
                    # The partial, local sum is left as backward wrote it.
                    for p, want in zip(model.parameters(), grads):
                        assert torch.equal(p.grad, want), f"{kind} clipped a partial sum"
                    if norm is not None:
                        assert norm.item() == 0.0, f"{kind} within a window: norm {norm}"
                else:
                    assert reduced == nparams, f"update {u} reduced {reduced}, not {nparams}"
                    if norm is not None:
                        close(norm.to(torch.float64), ref_norms[u].to(torch.float64),
                              f"{kind}: norm of update {u}", rtol=1e-10, atol=1e-10)
                        assert ref_norms[u].item() > 0.05, "the norm test does not clip"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            close(p.detach(), q.detach(), f"accumulate, clip {kind}: {name}",
                  rtol=1e-10, atol=1e-10)


def check_nancheck(r, n):
    """A NaN on the last rank stops the step on every rank and names tensor and rank."""
    assert basics.config()["PERSEUS_ALLREDUCE_NANCHECK"] == "1"
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    y = torch.randn(BATCH, 2, dtype=torch.float64)
    before = params_of(model)
    opt.zero_grad()
    out = model(x)
    if r == n - 1:
        out = out * torch.tensor(float("nan"), dtype=torch.float64)
    F.mse_loss(out, y).backward()
    with raises(FloatingPointError, "PERSEUS_ALLREDUCE_NANCHECK", "2.weight",
                f"rank {n - 1} (", "not applied", what="NaN on the last rank"):
        opt.step()
    for a, b in zip(params_of(model), before):
        assert torch.equal(a, b), "the step was applied despite the NaN"
    # Finite gradients whose sum overflows: no rank is to blame.
    # (Substituted by tensor hooks, which run before the optimizer's hooks launch the
    # reductions: writing p.grad after backward() would race them.)
    hooks = [p.register_hook(lambda g: torch.full_like(g, 1.7e308))
             for p in model.parameters()]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    for h in hooks:
        h.remove()
    with raises(FloatingPointError, "arose in the sum", what="overflow in the sum"):
        opt.step()
    # The job goes on: a clean step works and changes the parameters the same everywhere.
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(params_of(model), before))
    for params in hvd.allgather_object(params_of(model), name="after"):
        for a, b in zip(params, params_of(model)):
            assert torch.equal(a, b), "parameters differ between ranks"


def check_fusion(r, n):
    """PERSEUS_ALLREDUCE_FUSION=N caps fused buffers at 1/N of the gradient bytes."""
    fusion = int(sys.argv[2])
    assert basics.config()["PERSEUS_ALLREDUCE_FUSION"] == str(fusion)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters())
    total = 2 * 64 * 64 * 4  # the gradient bytes
    limit = 0 if fusion == 0 else -(-total // fusion)
    # A burst of 16 tensors of total/16 bytes each. The last rank submits late, so the
    # others' requests wait at the coordinator and its own become ready in batches.
    if r == n - 1:
        time.sleep(0.3)
    before = hvd.counters()
    ts = [torch.full((total // 16 // 4,), float(k)) for k in range(16)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"burst.{k}") for k, t in enumerate(ts)]
    for k, h in enumerate(handles):
        hvd.synchronize(h)
        close(ts[k], torch.full_like(ts[k], float(k * n)), f"burst tensor {k}")
    after = hvd.counters()
    fused = after["fused_buffers"] - before["fused_buffers"]
    biggest = after["fused_bytes_max"]
    if fusion == 0:
        assert fused == 0 and biggest == 0, f"fusion disabled, yet {fused} fused buffers"
        assert after["operations"] - before["operations"] == 16
    else:
        assert fused >= 1, "a burst of 16 small tensors was never fused"
        assert 0 < biggest <= limit, f"a fused buffer of {biggest} B exceeds {limit} B"


BIG = 1 << 18  # float32 elements of the "gradient": 1 MiB


def gradient_step(r, n, value_at=None, name="w"):
    """One DistributedOptimizer reduction of a 1 MiB float32 gradient whose rank-r value
    is known; returns the reduced gradient, the exact average, and the counter deltas."""
    w = nn.Parameter(torch.zeros(BIG))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[(name, w)])

    def local(k):
        g = torch.sin(torch.arange(BIG, dtype=torch.float64) * 0.001 + k) * (k + 1)
        if value_at is not None:
            g[value_at] = 7000.0 * (k + 1)  # times the scale 10: beyond float16's 65504
        return g.to(torch.float32)
    want = sum(local(k).to(torch.float64) for k in range(n)) / n
    before = hvd.counters()
    (w * local(r)).sum().backward()
    opt.synchronize()
    after = hvd.counters()
    with opt.skip_synchronize():
        opt.step()
    return w.grad.clone(), want, {k: after[k] - before[k] for k in after}


def sent(d):
    return d["bytes_intra_host"] + d["bytes_inter_host"]


def total(value):
    """Sum of one integer over all ranks (exact: int64)."""
    return int(hvd.allreduce(torch.tensor([value]), op=hvd.Sum)[0])


def same_everywhere(t, what):
    for k, other in enumerate(hvd.allgather_object(t, name=f"same.{what}")):
        assert torch.equal(other, t), f"{what}: rank {k} holds different values"


def check_dtype(r, n):
    """float16 gradients halve the bytes, stay within float16 rounding and are the same on
    every rank; an overflow is resent exactly, once warned; explicit allreduces stay exact."""
    dtype = basics.config()["PERSEUS_ALLREDUCE_DTYPE"]
    nbytes = BIG * 4
    # Explicit allreduce: exact whatever the switch (a ring sends 2(n-1)/n of it per rank).
    t = torch.arange(BIG, dtype=torch.float32)
    before = hvd.counters()
    hvd.allreduce_(t, op=hvd.Sum, name="explicit")
    d = {k: v - before[k] for k, v in hvd.counters().items()}
    assert torch.equal(t, torch.arange(BIG, dtype=torch.float32) * n), "explicit is not exact"
    assert total(sent(d)) == 2 * (n - 1) * nbytes, d

    path = os.path.join(tempfile.gettempdir(), f"perseus-dtype-{os.getpid()}.json")
    hvd.start_timeline(path)
    got, want, d = gradient_step(r, n)
    hvd.stop_timeline()
    path = timeline_file(path, r)
    with open(path) as f:
        phases = set(timeline_rows(json.load(f))["allreduce.w"])
    os.remove(path)
    # float16 everywhere casts before the transfer (1 MiB: float32 partial sums, float16
    # links, the inputs fused first, then copied out); exact runs in the output's memory.
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "PERSEUS_ALLREDUCE", "REDUCE"} <= phases, phases
    fused = {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}
    assert (fused <= phases) == (dtype == "0") and ("COMPLETE" in phases) == (dtype != "0"), \
        phases
    wire = nbytes // 2 if dtype == "0" else nbytes  # one host: 2 means exact
    assert total(sent(d)) == 2 * (n - 1) * wire, (dtype, d)
    assert d["compression_resends"] == 0, d
    if dtype == "0":
        err = (got.to(torch.float64) - want).abs().max().item()
        assert 0 < err <= 2e-3 * n, f"float16 error {err} out of bounds"
    else:
        close(got.to(torch.float64), want, "exact gradient", rtol=1e-6, atol=1e-6)
    same_everywhere(got, "gradient")

    # An element beyond float16 after scaling: the buffer goes again in float32.
    got, want, d = gradient_step(r, n, value_at=12345, name="layer.overflowing")
    assert d["compression_resends"] == (1 if dtype == "0" else 0), d
    assert torch.isfinite(got).all(), "an overflow came back as Inf"
    close(got.to(torch.float64), want, "resent gradient", rtol=1e-6, atol=1e-6)
    same_everywhere(got, "resent")


def check_hosts(r, n):
    """Two "hosts" of L ranks: exact results in either mode, bytes between hosts as the
    algorithm says, float16 between hosts halving exactly those."""
    cfg = basics.config()
    dtype, mode = cfg["PERSEUS_ALLREDUCE_DTYPE"], cfg["PERSEUS_ALLREDUCE_MODE"]
    hosts, local = hvd.cross_size(), hvd.local_size()
    assert hosts == 2 and n == hosts * local, (hosts, n)
    hier = mode != "0"
    nbytes = BIG * 4
    t = torch.arange(BIG, dtype=torch.float32) + r
    before = hvd.counters()
    hvd.allreduce_(t, op=hvd.Sum, name="explicit")
    d = {k: v - before[k] for k, v in hvd.counters().items()}
    want = torch.arange(BIG, dtype=torch.float32) * n + n * (n - 1) // 2
    assert torch.equal(t, want), "explicit allreduce across hosts is not exact"
    inter = total(d["bytes_inter_host"])
    if hier:
        # Every rank allreduces its 1/L shard with its peer on the other host.
        assert inter == n * 2 * (hosts - 1) * nbytes // hosts // local, inter
    else:
        # One ring: one rank per host sends 2(n-1)/n of the buffer to the next host.
        assert inter == hosts * 2 * (n - 1) * nbytes // n, inter
    exact_inter, exact_intra = d["bytes_inter_host"], d["bytes_intra_host"]

    got, want, d = gradient_step(r, n)
    if dtype == "2":
        assert d["bytes_inter_host"] * 2 == exact_inter, (d, exact_inter)
        assert d["bytes_intra_host"] == exact_intra, (d, exact_intra)
    elif dtype == "0":
        assert d["bytes_inter_host"] * 2 == exact_inter, (d, exact_inter)
        # Where the ranks of a host read the gathered chunks from one another's memory
        # (PERSEUS_SHM_DIRECT), they send only an offer (16 bytes) and an answer (1) to
        # each other instead: no payload to halve.
        gather = 17 * (local - 1) if hier and direct_reads() else 0
        assert (d["bytes_intra_host"] - gather) * 2 == exact_intra - gather, (d, exact_intra)
    if dtype == "1":
        close(got.to(torch.float64), want, "exact gradient", rtol=1e-6, atol=1e-6)
    else:
        err = (got.to(torch.float64) - want).abs().max().item()
        assert 0 < err <= 2e-3 * n, f"float16 error {err} out of bounds"
    same_everywhere(got, "gradient")


def check_downsample(r, n):
    """Every N-th element per step, rotating, the rest kept in a decayed residual: the
    parameters equal a float64 reference of that rule, and the bytes fall by N."""
    cfg = basics.config()
    every = int(cfg["PERSEUS_DOWNSAMPLE_N_ELEMENTS"])
    m = float(cfg["PERSEUS_GRADIENT_MOMENTUM"])
    assert every > 1, "run with PERSEUS_DOWNSAMPLE_N_ELEMENTS > 1"
    steps = 2 * every + 1
    g = torch.Generator().manual_seed(3)
    # grads[t, k]: rank k's gradient at step t, for a 10-element and a 4096-element weight
    # (10 is not a multiple of N: the sent slices are padded).
    small = torch.randn(steps, n, 10, generator=g, dtype=torch.float64)
    big = torch.randn(steps, n, 4096, generator=g, dtype=torch.float64)

    def reference(grads):
        w = torch.zeros(grads.shape[-1], dtype=torch.float64)
        acc = torch.zeros(n, grads.shape[-1], dtype=torch.float64)
        for t in range(steps):
            acc = m * acc + grads[t] if t else grads[t].clone()
            off = t % every
            applied = torch.zeros_like(w)
            applied[off::every] = acc[:, off::every].mean(0)
            acc[:, off::every] = 0
            w -= applied
        return w

    ws = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    wb = nn.Parameter(torch.zeros(4096, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([ws, wb], lr=1.0),
                                   named_parameters=[("small", ws), ("big", wb)])
    for t in range(steps):
        opt.zero_grad()
        before = hvd.counters()
        ((ws * small[t, r]).sum() + (wb * big[t, r]).sum()).backward()
        opt.step()
        after = hvd.counters()
        # Over shared memory every rank sends its whole (small) buffer to each other rank.
        padded = 8 * (-(-10 // every) + -(-4096 // every))
        assert after["bytes_intra_host"] - before["bytes_intra_host"] == (n - 1) * padded
    close(ws.detach(), reference(small), "down-sampled small weight", rtol=1e-12, atol=1e-12)
    close(wb.detach(), reference(big), "down-sampled big weight", rtol=1e-12, atol=1e-12)


def check_perfcheck(r, n):
    """The last rank computes 40 ms longer per step: the check names it, on its host."""
    assert basics.config()["PERSEUS_PERF_CHECK_N_STEPS"] == "3"
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(4, 4, dtype=torch.float64)
    for _ in range(7):
        opt.zero_grad()
        if r == n - 1:
            time.sleep(0.04)
        model(x).sum().backward()
        opt.step()


def check_streams(r, n):
    """With TCP between every pair, a 4 MiB allreduce is cut into one slice per stream
    (at most one per MiB): exact, and the extra streams carry their share of the bytes;
    a small allreduce stays on the first stream."""
    streams = int(basics.config()["PERSEUS_ALLREDUCE_STREAMS"])
    count = 1 << 20
    t = torch.arange(count, dtype=torch.float32) % 1000 + r
    before = hvd.counters()
    hvd.allreduce_(t, op=hvd.Sum, name="streams.big")
    d = {k: v - before[k] for k, v in hvd.counters().items()}
    want = torch.arange(count, dtype=torch.float32) % 1000 * n + n * (n - 1) // 2
    assert torch.equal(t, want), "striped allreduce is not exact"
    # Each rank sends 2(n-1)/n of the buffer; all but the first slice on the extra streams.
    ring = 2 * (n - 1) * count * 4 // n
    share = d["bytes_extra_streams"] / ring
    assert abs(share - (streams - 1) / streams) < 0.01, (streams, d)
    assert total(sent(d)) == 2 * (n - 1) * count * 4, d

    small = torch.full((1000,), float(r))
    before = hvd.counters()["bytes_extra_streams"]
    hvd.allreduce_(small, op=hvd.Sum, name="streams.small")
    assert torch.equal(small, torch.full((1000,), float(n * (n - 1) // 2)))
    assert hvd.counters()["bytes_extra_streams"] == before

    # Gradients (float16 between hosts by default) are striped the same way.
    w = nn.Parameter(torch.zeros(count))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)])
    g = torch.cos(torch.arange(count, dtype=torch.float32) * 1e-3 + r)
    (w * g).sum().backward()
    opt.synchronize()
    exact = sum(torch.cos(torch.arange(count, dtype=torch.float64) * 1e-3 + k)
                for k in range(n)) / n
    err = (w.grad.to(torch.float64) - exact).abs().max().item()
    assert err <= 2e-3, f"striped gradient off by {err}"
    same_everywhere(w.grad, "striped gradient")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    checks = {"accumulate": check_accumulate, "nancheck": check_nancheck,
              "fusion": check_fusion, "dtype": check_dtype, "hosts": check_hosts,
              "downsample": check_downsample, "perfcheck": check_perfcheck,
              "streams": check_streams}
    checks[sys.argv[1]](r, n)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

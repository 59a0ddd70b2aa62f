"""CUDA tensors on every rank against references computed on the CPU (docs/gpu.md):
through the host-staged path when ranks share a GPU, over NCCL when each has its own.
Argument ``half``: the job runs with PERSEUS_ALLREDUCE_DTYPE=0, so gradient allreduces
travel as float16 cast on the device. ``required``: ranks share a GPU under
PERSEUS_NCCL_ENABLE=1, so device collectives fail on every rank, saying why."""

import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises, tol
from perseus.torch.horovod import mpi_ops

MODE = sys.argv[1] if len(sys.argv) > 1 else "exact"

hvd.init()
r, n = hvd.rank(), hvd.size()
dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
assert hvd.cuda_built()


def base(k, count=1000, dtype=torch.float32):
    return ((torch.arange(count) % 13) * 0.5 + k).to(dtype)


def check_collectives():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32):
        x = base(r, dtype=dtype).to(dev)
        # Each rank's values as its dtype holds them (int32 truncates the halves), summed
        # in float64.
        total = sum(base(k, dtype=dtype).double() for k in range(n))
        for op, ref in ((hvd.Sum, total), (hvd.Average, total / n),
                        (hvd.Max, base(n - 1, dtype=dtype).double())):
            if dtype == torch.int32 and op == hvd.Average:
                continue
            y = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{op}")
            assert y.device == dev, y.device
            rt, at = tol(dtype)
            close(y.cpu().double(), ref.to(dtype).double(), f"allreduce {dtype} {op}",
                  rtol=rt, atol=at)
        close(x.cpu(), base(r, dtype=dtype), f"input untouched ({dtype})")

    # In place, fused with a CPU tensor, with prescale and postscale.
    a = base(r).to(dev)
    b = base(r, count=17).to(dev)
    c = base(r, count=5)
    hs = [hvd.allreduce_async_(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25,
                               name=f"fused.{i}") for i, t in enumerate((a, b, c))]
    for h in hs:
        hvd.synchronize(h)
    for t, count, what in ((a, 1000, "a"), (b, 17, "b"), (c, 5, "cpu")):
        ref = sum(base(k, count=count) for k in range(n)) * 0.5
        close(t.cpu(), ref, f"fused in place {what}")
    assert c.is_cpu and a.device == dev

    # Stream order: work queued on a side stream before the call is seen by Perseus.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        big = torch.ones(1 << 20, device=dev)
        torch.cuda._sleep(20_000_000)
        big.mul_(r + 1)
        hvd.allreduce_(big, op=hvd.Sum, name="stream.order")
        total = big.sum()
    s.synchronize()
    want = float(sum(k + 1 for k in range(n)) * (1 << 20))
    assert float(total) == want, (float(total), want)

    # Allgather of different lengths, broadcast, alltoall, reducescatter.
    g = torch.full((r + 1, 3), float(r), device=dev)
    out = hvd.allgather(g, name="ag")  # the job sets PERSEUS_CHANGE_HVD_ALLGATHER=1
    ref = torch.cat([torch.full((k + 1, 3), float(k)) for k in range(n)])
    assert out.device == dev
    close(out.cpu(), ref, "allgather")
    root = n - 1
    t = base(r).to(dev)
    hvd.broadcast_(t, root_rank=root, name="bc")
    close(t.cpu(), base(root), "broadcast")
    src = torch.arange(2 * n, dtype=torch.float32, device=dev) + 100 * r
    got = hvd.alltoall(src, name="a2a")
    close(got.cpu(), torch.tensor([100.0 * k + 2 * r + j for k in range(n) for j in range(2)]),
          "alltoall")
    rs = hvd.reducescatter(torch.ones(2 * n, 4, device=dev) * (r + 1), op=hvd.Sum, name="rs")
    assert rs.device == dev
    close(rs.cpu(), torch.full((2, 4), float(sum(k + 1 for k in range(n)))), "reducescatter")


def check_half():
    before = hvd.counters()["bytes_intra_host"]
    x = base(r, count=1 << 16).to(dev)
    hvd.allreduce_(x, op=hvd.Sum, name="exact.grad")
    exact_bytes = hvd.counters()["bytes_intra_host"] - before
    g = base(r, count=1 << 16).to(dev)
    before = hvd.counters()["bytes_intra_host"]
    hvd.synchronize(mpi_ops.gradient_allreduce_async_(g, "half.grad", hvd.Average, 1.0, 1.0,
                                                      hvd.global_process_set))
    half_bytes = hvd.counters()["bytes_intra_host"] - before
    ref = sum(base(k, count=1 << 16) for k in range(n)) / n
    close(g.cpu(), ref, "float16 average (values exact in float16)")
    assert half_bytes * 2 <= exact_bytes * 1.05, (half_bytes, exact_bytes)
    # A float16 overflow is resent exactly.
    big = torch.full((64,), 40000.0, device=dev)
    hvd.synchronize(mpi_ops.gradient_allreduce_async_(big, "half.big", hvd.Sum, 1.0, 1.0,
                                                      hvd.global_process_set))
    close(big.cpu(), torch.full((64,), 40000.0 * n), "overflow resent exactly")
    assert hvd.counters()["compression_resends"] >= 1

    # DistributedOptimizer on a CUDA model: ranks stay identical; the NaN check
    # (PERSEUS_ALLREDUCE_NANCHECK=1 in this job) names the rank a NaN came from.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        xb = torch.randn(16, 8, device=dev) + r
        model(xb).pow(2).mean().backward()
        opt.step()
    w = model.weight.detach()
    every = hvd.allgather(w.unsqueeze(0).contiguous(), name="weights")
    for k in range(n):
        close(every.reshape(n, 4, 8)[k].cpu(), w.cpu(), f"rank {k}'s weights")
    opt.zero_grad()
    xb = torch.randn(16, 8, device=dev)
    if r == n - 1:
        xb[0, 0] = float("nan")
    model(xb).pow(2).mean().backward()
    with raises(FloatingPointError, "PERSEUS_ALLREDUCE_NANCHECK", f"rank {n - 1}",
                what="NaN gradient"):
        opt.step()


def check_path():
    """NCCL carried the device collectives exactly when each rank has its own GPU."""
    own = torch.cuda.device_count() >= hvd.local_size()
    expect = own and hvd.nccl_built() and os.environ.get("PERSEUS_NCCL_ENABLE") != "0"
    used = hvd.counters()["nccl_operations"]
    assert (used > 0) == expect, (used, expect)


if MODE == "required":
    with raises(RuntimeError, "PERSEUS_NCCL_ENABLE=1", "share one GPU", what="shared GPU"):
        hvd.allreduce(base(r).to(dev), name="needs.nccl")
    close(hvd.allreduce(base(r), op=hvd.Sum, name="cpu.still"),
          sum(base(k) for k in range(n)), "CPU tensors go on")
    hvd.shutdown()
    done(r)
    sys.exit(0)
check_collectives()
if MODE == "half":
    check_half()
check_path()
with raises(ValueError, "CPU and CUDA", what="meta tensor"):
    hvd.allreduce(torch.zeros(2, device="meta"))
hvd.shutdown()
done(r)

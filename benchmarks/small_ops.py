"""The small-tensor path, parameter broadcast, variable allgather, and memory growth.

    python benchmarks/small_ops.py [--ranks 2] [--quick]

For hvd (perseus.torch.horovod), gloo and mpi (mpi4py), one job each:
  async100    100 asynchronous 4 KiB allreduces, first submit to last completion
  bcast_r50   broadcast of a ResNet-50-sized parameter set (161 tensors, 25.6 M floats)
  allgatherv  allgather of 1-64 KiB per rank, sizes differing by rank
and for hvd only: RSS after 100 and after 10,000 mixed allreduces.
Writes benchmarks/results/small_ops.json for report.py.
"""

import argparse

import harness

IMPLS = ("hvd", "gloo", "mpi")


def resnet50_shapes():
    """Parameter shapes of ResNet-50 (conv weights, batch-norm weights and biases, fc)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            shapes += [(width, cin, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, cin, 1, 1), (out,), (out,)]
            cin = out
    return shapes + [(1000, 2048), (1000,)]


def worker(impl, out, quick):
    import numpy as np
    import torch

    comm = harness.Comm(impl)
    r, n = comm.rank, comm.size
    res = {}

    small = [torch.ones(1024) for _ in range(100)]
    if impl == "hvd":
        hvd = comm.hvd

        def async100():
            hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"s{i}") for i, t in enumerate(small)]
            for h in hs:
                hvd.synchronize(h)
    elif impl == "gloo":
        def async100():
            for w in [comm.dist.all_reduce(t, async_op=True) for t in small]:
                w.wait()
    else:
        bufs = [t.numpy() for t in small]

        def async100():
            comm.mpi.Request.Waitall([comm.world.Iallreduce(comm.mpi.IN_PLACE, b)
                                      for b in bufs])
    res["async100"] = harness.timed(comm, async100, max_iters=100)

    params = [torch.randn(s) for s in resnet50_shapes()]
    if impl == "hvd":
        state = {f"p{i}": p for i, p in enumerate(params)}

        def bcast():
            hvd.broadcast_parameters(state, root_rank=0)
    elif impl == "gloo":
        def bcast():
            for p in params:
                comm.dist.broadcast(p, 0)
    else:
        arrays = [p.numpy() for p in params]

        def bcast():
            for a in arrays:
                comm.world.Bcast(a, root=0)
    res["bcast_r50"] = harness.timed(comm, bcast, min_iters=3, max_iters=10)

    counts = [256 * (1 + (k * 37) % 64) for k in range(n)]  # floats per rank
    mine = torch.full((counts[r],), float(r))
    if impl == "hvd":
        def gather():
            hvd.allgather(mine, name="gv")
    elif impl == "gloo":
        big = max(counts)
        padded = torch.zeros(big)
        padded[: counts[r]] = mine
        outs = [torch.zeros(big) for _ in range(n)]

        def gather():
            comm.dist.all_gather(outs, padded)
            torch.cat([o[:c] for o, c in zip(outs, counts)])
    else:
        recv = np.zeros(sum(counts), dtype=np.float32)
        send = mine.numpy()

        def gather():
            comm.world.Allgatherv(send, (recv, counts))
    res["allgatherv"] = harness.timed(comm, gather, max_iters=200)

    if impl == "hvd":
        tensors = [torch.ones(k) for k in (1, 100, 4096, 65536)]

        def mixed(steps):
            for s in range(steps):
                t = tensors[s % len(tensors)]
                hvd.allreduce(t, name=f"m{s % 7}", op=hvd.Average if s % 2 else hvd.Sum)
        mixed(100)
        after100 = harness.rss_mib()
        mixed(1000 if quick else 10_000)
        after10k = harness.rss_mib()
        res["rss_after_100_mib"] = comm.max_over_ranks(after100)
        res["rss_after_10000_mib"] = comm.max_over_ranks(after10k)
    harness.write_result(out, comm, res)
    comm.close()


def summary(n, results):
    """Text lines for one rank count."""
    lines = [f"{n} ranks"]
    for key in ("async100", "bcast_r50", "allgatherv"):
        cells = "  ".join(f"{i} {results[i][key] * 1e3:9.3f} ms" for i in IMPLS)
        lines.append(f"  {key:11s} {cells}")
    h = results["hvd"]
    lines.append(f"  hvd RSS after 100 allreduces {h['rss_after_100_mib']:.1f} MiB, "
                 f"after 10,000 {h['rss_after_10000_mib']:.1f} MiB")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=IMPLS)
    p.add_argument("--out")
    p.add_argument("--ranks", type=int, nargs="*", default=[2])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.out, a.quick)
    extra = ["--quick"] if a.quick else []
    env = {"PERSEUS_CHANGE_HVD_ALLGATHER": "1"}  # Horovod layout: sizes differ by rank
    harness.drive(__file__, IMPLS, a.ranks, extra, "small_ops", summary, env)


if __name__ == "__main__":
    main()

"""The small-tensor path, parameter broadcast and variable-size allgather, Perseus (hvd)
against torch gloo, Open MPI and MPICH.

    python benchmarks/small_ops.py [--ranks 2] [--json PATH] [--quick]

One job per implementation (hvd: perseus.torch.horovod with PERSEUS_CHANGE_HVD_ALLGATHER=1,
Horovod's concatenating allgather; gloo: torch.distributed; mpi and mpich: mpi4py over
Open MPI and over MPICH), each measuring:
  lone4k      one blocking 4 KiB float32 allreduce (hvd.allreduce_; all_reduce;
              Allreduce(IN_PLACE))
  async100    100 asynchronous 4 KiB float32 allreduces, first submit to last completion
              (hvd.allreduce_async_ + synchronize; all_reduce(async_op=True) + wait;
              Iallreduce + Waitall)
  bcast_r50   a ResNet-50-sized parameter set (161 tensors of ResNet-50's shapes, 25.6 M
              float32) from rank 0: hvd.broadcast_parameters; a broadcast per tensor
              (gloo); Bcast per tensor (mpi, mpich)
  allgatherv  rank r contributes (r+1) * BASE floats, BASE = 1 Ki (4 KiB) and 256 Ki
              (1 MiB): hvd.allgather; gloo all_gather of tensors padded to the largest,
              then unpadded; Allgatherv
Times are medians over iterations, each the slowest rank's time.
"""


import harness

IMPLS = ("hvd", "gloo", "mpi", "mpich")
GATHER_BASES = (1 << 10, 1 << 18)   # floats
TIMING = {"warmup": 3, "min_iters": 5, "max_iters": 200, "budget": 1.0}
QUICK_TIMING = {"warmup": 1, "min_iters": 3, "max_iters": 10, "budget": 0.05}


def resnet50_shapes():
    """Parameter shapes of torchvision's ResNet-50, in its order: convolutions (no bias),
    batch-norm weight and bias, the final fully connected layer. 161 tensors, 25,557,032
    values."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            cout = width * 4
            shapes += [(width, cin, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (cout, width, 1, 1), (cout,), (cout,)]
            if b == 0:  # the projection shortcut
                shapes += [(cout, cin, 1, 1), (cout,), (cout,)]
            cin = cout
    return shapes + [(1000, 2048), (1000,)]


def bench_lone(comm, timing):
    import torch

    t = torch.full((1024,), 1.0)
    if comm.impl == "hvd":
        hvd = comm.hvd

        def fn():
            hvd.allreduce_(t, op=hvd.Sum, name="lone4k")
    elif comm.impl == "gloo":
        dist = comm.dist

        def fn():
            dist.all_reduce(t)
    else:
        world, mpi, buf = comm.world, comm.mpi, t.numpy()

        def fn():
            world.Allreduce(mpi.IN_PLACE, buf)
    return harness.measure(comm, fn, **timing)


def bench_async100(comm, timing):
    import torch

    small = [torch.full((1024,), 0.0) for _ in range(100)]
    if comm.impl == "hvd":
        hvd = comm.hvd
        names = [f"async100.{i}" for i in range(len(small))]

        def fn():
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=nm)
                       for t, nm in zip(small, names)]
            for h in handles:
                hvd.synchronize(h)
    elif comm.impl == "gloo":
        dist = comm.dist

        def fn():
            works = [dist.all_reduce(t, async_op=True) for t in small]
            for w in works:
                w.wait()
    else:
        world, mpi = comm.world, comm.mpi
        bufs = [t.numpy() for t in small]

        def fn():
            mpi.Request.Waitall([world.Iallreduce(mpi.IN_PLACE, b) for b in bufs])
    return harness.measure(comm, fn, **timing)


def bench_bcast(comm, timing):
    import torch

    gen = torch.Generator().manual_seed(comm.rank)
    params = [torch.randn(s, generator=gen) for s in resnet50_shapes()]
    if comm.impl == "hvd":
        hvd = comm.hvd
        state = {f"layer{i:03d}": p for i, p in enumerate(params)}

        def fn():
            hvd.broadcast_parameters(state, root_rank=0)
    elif comm.impl == "gloo":
        dist = comm.dist

        def fn():
            for p in params:
                dist.broadcast(p, src=0)
    else:
        world = comm.world
        arrays = [p.numpy() for p in params]

        def fn():
            for a in arrays:
                world.Bcast(a, root=0)
    res = harness.measure(comm, fn, **timing)
    res["tensors"] = len(params)
    res["values"] = sum(p.numel() for p in params)
    return res


def bench_allgatherv(comm, base, timing):
    import numpy as np
    import torch

    n, r = comm.size, comm.rank
    counts = [(k + 1) * base for k in range(n)]
    mine = torch.full((counts[r],), float(r))
    if comm.impl == "hvd":
        hvd = comm.hvd
        name = f"allgatherv.{base}"

        def fn():
            hvd.allgather(mine, name=name)
    elif comm.impl == "gloo":
        dist = comm.dist
        padded = torch.zeros(max(counts))
        padded[: counts[r]] = mine
        outs = [torch.empty(max(counts)) for _ in range(n)]

        def fn():
            dist.all_gather(outs, padded)
            torch.cat([o[:c] for o, c in zip(outs, counts)])
    else:
        world = comm.world
        send = mine.numpy()
        recv = np.empty(sum(counts), dtype=np.float32)
        displs = [sum(counts[:k]) for k in range(n)]

        def fn():
            world.Allgatherv(send, [recv, counts, displs, comm.mpi.FLOAT])
    if comm.impl == "hvd":  # once, untimed: the layout really is Horovod's concatenation
        got = hvd.allgather(mine, name=f"{name}.check")
        assert got.shape == (sum(counts),), f"allgather gave {tuple(got.shape)}"
    res = harness.measure(comm, fn, **timing)
    res["base_floats"] = base
    res["bytes_total"] = 4 * sum(counts)
    return res


def body(comm, opts):
    timing = opts["timing"]
    res = {"lone4k": bench_lone(comm, timing),
           "async100": bench_async100(comm, timing),
           "bcast_r50": bench_bcast(comm, {**timing, "max_iters": min(timing["max_iters"], 20)})}
    for base in GATHER_BASES:
        res[f"allgatherv.{base}"] = bench_allgatherv(comm, base, timing)
    return res


def run(ranks=(2,), quick=False, timeout=600, echo=True):
    """Driver: one job per implementation and rank count; returns the results."""
    timing = QUICK_TIMING if quick else TIMING
    result = {"ranks": list(ranks), "impls": list(IMPLS), "timing": timing, "runs": {}}

    def env_for(impl):
        return {"PERSEUS_CHANGE_HVD_ALLGATHER": "1"} if impl == "hvd" else None

    return harness.run_into(result, __file__, IMPLS, ranks, {"timing": timing}, sections,
                            env_for=env_for, timeout=timeout, echo=echo)


def labels(n):
    out = {"lone4k": "a lone 4 KiB allreduce",
           "async100": "100 async 4 KiB allreduces",
           "bcast_r50": "broadcast ResNet-50 parameters (161 tensors, 25.6 M floats)"}
    for base in GATHER_BASES:
        lo, hi = harness.human(4 * base), harness.human(4 * base * n)
        out[f"allgatherv.{base}"] = f"allgather, {lo} to {hi} per rank"
    return out


def sections(result, only=None):
    out = []
    for n, runs in harness.runs_by_ranks(result, only):
        rows = []
        for key, label in labels(n).items():
            # A peer absent from an older run's JSON reads as not measured.
            ms = [None if i not in runs or harness.failed(runs[i])
                  else runs[i][0][key]["median"] * 1e3 for i in IMPLS]
            ratio = harness.peer_ratio(ms[0], ms[1:])
            rows.append([label, *(harness.fmt(m, ".3f") for m in ms),
                         harness.fmt(ratio, ".2f") + "×"])
        notes = harness.failure_notes(runs, IMPLS)
        out.append({"title": f"small tensors, broadcast, allgather: {n} ranks, median ms",
                    "headers": ["benchmark", *(f"{i} ms" for i in IMPLS), "hvd ÷ best peer"],
                    "rows": rows,
                    "notes": notes + [("hvd ÷ best peer: best peer time / hvd time (>1: "
                                      "Perseus faster).")]})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: few iterations")
    a = p.parse_args(argv)
    result = run(a.ranks, a.quick, a.timeout)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

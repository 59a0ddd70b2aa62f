"""torch.distributed's collectives on the perseus backend, beside gloo, Open MPI and MPICH.

    python benchmarks/torch_collectives.py [--ranks 2 3 4] [--sizes 4K 1M 64M ...]
                                           [--ops all_reduce ...] [--calls K]
                                           [--json PATH] [--quick]

One job per implementation and rank count: ``perseus`` (``init_process_group("perseus")``
after ``import perseus``), ``gloo`` (torch.distributed without Perseus), ``mpi`` and
``mpich`` (mpi4py over Open MPI and over MPICH: Allreduce, Allgather, Reduce_scatter_block, Bcast, Alltoall on the same
buffers). Float32; SIZE is each rank's buffer: all_reduce and broadcast of SIZE,
all_gather_into_tensor of SIZE per rank, reduce_scatter_tensor of SIZE into SIZE / n,
all_to_all_single of SIZE. Times are medians over iterations, each the slowest rank's;
the ratio is the best peer's time over perseus's (>1: perseus faster). ``--calls K``:
each iteration makes K calls back to back after its barrier and counts their mean (a
call in a loop of them, where the default times one call right after a barrier, which
also pays for waking every rank's threads).
"""

import harness

IMPLS = ("perseus", "gloo", "mpi", "mpich")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
TIMING = {"warmup": 3, "min_iters": 5, "max_iters": 200, "budget": 0.4}
QUICK_TIMING = {"warmup": 1, "min_iters": 3, "max_iters": 10, "budget": 0.05}


def op_fn(comm, op, nbytes):
    """A call of collective ``op`` on buffers of ``nbytes`` through ``comm.impl``."""
    import torch

    n = comm.size
    count = nbytes // 4 // n * n  # divisible by the ranks
    x = torch.full((count,), 0.0)
    if op == "all_gather":
        out = torch.empty(count * n)
    elif op == "reduce_scatter":
        out = torch.empty(count // n)
    else:
        out = torch.empty(count)
    if comm.impl in harness.MPI_IMPLS:
        world, mpi = comm.world, comm.mpi
        a, b = x.numpy(), out.numpy()
        calls = {"all_reduce": lambda: world.Allreduce(mpi.IN_PLACE, a),
                 "all_gather": lambda: world.Allgather(a, b),
                 "reduce_scatter": lambda: world.Reduce_scatter_block(a, b),
                 "broadcast": lambda: world.Bcast(a, root=0),
                 "all_to_all": lambda: world.Alltoall(a, b)}
        return calls[op]
    dist = comm.dist
    calls = {"all_reduce": lambda: dist.all_reduce(x),
             "all_gather": lambda: dist.all_gather_into_tensor(out, x),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x),
             "broadcast": lambda: dist.broadcast(x, src=0),
             "all_to_all": lambda: dist.all_to_all_single(out, x)}
    return calls[op]


def body(comm, opts):
    rows = {}
    for op in opts["ops"]:
        for nbytes in opts["sizes"]:
            fn = op_fn(comm, op, nbytes)
            rows[f"{op}.{nbytes}"] = harness.measure(comm, fn, calls=opts.get("calls", 1),
                                                     **opts["timing"])
            del fn
    return rows


def run(ranks=(2,), sizes=SIZES, ops=OPS, quick=False, timeout=900, echo=True, calls=1):
    timing = QUICK_TIMING if quick else TIMING
    opts = {"sizes": list(sizes), "ops": list(ops), "timing": timing, "calls": calls}
    result = {"ranks": list(ranks), "impls": list(IMPLS), "sizes": list(sizes),
              "ops": list(ops), "timing": timing, "calls": calls, "runs": {}}
    return harness.run_into(result, __file__, IMPLS, ranks, opts, sections,
                            timeout=timeout, echo=echo)


def sections(result, only=None):
    out = []
    for n, runs in harness.runs_by_ranks(result, only):
        rows = []
        for op in result["ops"]:
            for nbytes in result["sizes"]:
                key = f"{op}.{nbytes}"
                us = [None if harness.failed(runs[i]) else runs[i][0][key]["median"] * 1e6
                      for i in IMPLS]
                ratio = harness.peer_ratio(us[0], us[1:])
                rows.append([op, harness.human(nbytes), *(harness.fmt(u, ".1f") for u in us),
                             harness.fmt(ratio, ".2f") + "×"])
        notes = harness.failure_notes(runs, IMPLS)
        calls = result.get("calls", 1)
        how = f", {calls} calls back to back" if calls > 1 else ""
        out.append({"title": f"torch.distributed collectives: {n} ranks{how}, median µs",
                    "headers": ["op", "size", *(f"{i} µs" for i in IMPLS),
                                "perseus ÷ best peer"],
                    "rows": rows,
                    "notes": notes + [("perseus ÷ best peer: the best peer's time over "
                                       "perseus's (>1: perseus faster).")]})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: few iterations")
    p.add_argument("--sizes", nargs="+", type=harness.parse_size, default=None)
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--calls", type=int, default=1,
                   help="calls back to back in each timed iteration (default 1)")
    a = p.parse_args(argv)
    result = run(a.ranks, a.sizes or SIZES, a.ops, a.quick, a.timeout, calls=a.calls)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

"""Allreduce sweep: float32, 4 KiB to 256 MiB, Perseus against gloo and OpenMPI.

    python benchmarks/allreduce.py [--ranks 2 3 4] [--quick]

Runs every implementation (see harness.py) for every rank count, one job at a time,
prints a table per rank count (median time, algbw = bytes / time, busbw = algbw *
2(n-1)/n as nccl-tests define them, and Perseus / best peer), and writes
benchmarks/results/allreduce.json for report.py.
"""

import argparse

import harness

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK = [4 << 10, 1 << 20, 16 << 20]


def worker(impl, sizes, out):
    import torch

    comm = harness.Comm(impl)
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        if impl == "perseus":
            from perseus import _core

            cap = t.__dlpack__()

            def fn(cap=cap):
                h = _core.allreduce(cap, cap, "sweep", 1, 1.0, 1.0, 0)
                _core.wait(h)
                _core.release(h)
        elif impl == "hvd":
            def fn(t=t):
                comm.hvd.allreduce_(t, op=comm.hvd.Sum, name="sweep")
        elif impl == "gloo":
            def fn(t=t):
                comm.dist.all_reduce(t)
        else:
            buf = t.numpy()

            def fn(buf=buf):
                comm.world.Allreduce(comm.mpi.IN_PLACE, buf)
        seconds = harness.timed(comm, fn, max_iters=300 if nbytes < 1 << 20 else 50)
        rows.append({"bytes": nbytes, "seconds": seconds})
        del t
    peak = comm.max_over_ranks(harness.peak_rss_mib())
    harness.write_result(out, comm, {"rows": rows, "peak_rss_mib": peak})
    comm.close()


def table(n, results):
    """Text table for one rank count."""
    impls = [i for i in harness.IMPLS if i in results]
    peers = [i for i in impls if i in ("gloo", "mpi")]
    head = f"{'size':>10} " + " ".join(f"{i + ' us':>12} {i + ' GB/s':>10}" for i in impls)
    lines = [f"{n} ranks (busbw)", head + "  perseus/best-peer"]
    for k, row in enumerate(results[impls[0]]["rows"]):
        nbytes = row["bytes"]
        cells = []
        for i in impls:
            s = results[i]["rows"][k]["seconds"]
            cells.append(f"{s * 1e6:12.1f} {harness.busbw(nbytes, s, n):10.2f}")
        ratio = ""
        if "perseus" in results and peers:
            best = min(results[p]["rows"][k]["seconds"] for p in peers)
            ratio = f"{best / results['perseus']['rows'][k]['seconds']:17.2f}x"
        lines.append(f"{nbytes:>10} " + " ".join(cells) + "  " + ratio)
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=harness.IMPLS)
    p.add_argument("--out")
    p.add_argument("--sizes", type=int, nargs="*")
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 3, 4])
    p.add_argument("--impls", nargs="*", default=list(harness.IMPLS))
    p.add_argument("--quick", action="store_true", help="3 sizes, 2 ranks")
    a = p.parse_args()
    sizes = a.sizes or (QUICK if a.quick else SIZES)
    if a.worker:
        return worker(a.worker, sizes, a.out)
    ranks = [2] if a.quick else a.ranks
    args = ["--sizes", *map(str, sizes)]
    harness.drive(__file__, a.impls, ranks, args, "allreduce", table)


if __name__ == "__main__":
    main()

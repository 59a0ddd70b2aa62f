"""Allreduce sweep: float32, 4 KiB to 256 MiB, Perseus against torch gloo, Open MPI, MPICH
and DeepSpeed's shared-memory allreduce.

Implementations: ``core`` (perseus._core), ``hvd`` (perseus.torch.horovod), ``perseus``
(torch.distributed's all_reduce on the perseus backend), ``ddp`` (the same after
``import perseus`` asking for gloo), ``gloo``, ``mpi``, ``mpich`` and ``deepspeed`` (the
peers; harness.py).

    python benchmarks/allreduce_sweep.py [--ranks 2 3 4] [--short | --sizes 4K 1M ...]
                                         [--impls core hvd gloo mpi] [--json PATH] [--quick]
                                         [--device cpu|cuda] [--strict]
    python benchmarks/allreduce_sweep.py --page OUT.md SWEEP.json [SWEEP.json ...]

For every rank count, one job per implementation (harness.py: Perseus through
perseus._core and through perseus.torch.horovod, torch.distributed gloo, mpi4py over
Open MPI and over MPICH), one
after the other. Each size: warm-up calls, then iterations each started after a barrier
and timed as the slowest rank's; the median is reported with algbw = bytes / time and
busbw = algbw * 2(n-1)/n (nccl-tests), the ratio Perseus busbw / best peer busbw (>1:
Perseus faster), and the peak RSS of every rank over the job.

``--device cuda``: the tensors are on GPU 0, which every rank shares, so Perseus takes
its host-staged path (docs/gpu.md) and torch gloo its own copies through host memory;
each call ends with ``torch.cuda.synchronize()`` in both. Only hvd and gloo take CUDA
tensors here (core takes DLPack capsules without a stream, mpi4py host buffers).

The machine's own bound, from 16 MiB (where the sizes stop fitting in the caches):
each Perseus job also times a STREAM-like copy (``b = a``) and add (``a += b``) on every
rank at once, one thread each, at those sizes. Its memory traffic rate per rank is the
better of the two, counted as STREAM counts it (2 and 3 bytes of traffic per byte of
buffer). The ring moves at least ``5(n-1)/n`` bytes of memory traffic per byte of buffer
on each rank (the reduce-scatter reads the chunk it sends, then reads and writes the chunk
it reduces into, the segment between the ranks staying in cache; the allgather reads
what it sends and writes what it receives), so the fastest the algorithm can be is that
traffic at that rate: a busbw of 0.4 times the rate, whatever ``n``. The tables give each
Perseus implementation's busbw as a fraction of the bound its own job measured.

``--page``: a markdown page of saved sweeps, one after the other (scripts/gpu-session.sh
writes docs/benchmarks_staged_cuda.md so: the sweep on a shared GPU, then the same on
host tensors).
"""

import json
import sys

import harness

SIZES = [4 << 10 << 2 * k for k in range(9)]   # 4 KiB, 16 KiB, ... 256 MiB: powers of 4
SHORT = [4 << 10 << 4 * k for k in range(5)]   # 4 KiB, 64 KiB, 1 MiB, 16 MiB, 256 MiB
QUICK = [4 << 10, 256 << 10, 16 << 20]
TIMING = {"warmup": 3, "min_iters": 5, "max_iters": 300, "budget": 0.5}
QUICK_TIMING = {"warmup": 1, "min_iters": 3, "max_iters": 20, "budget": 0.05}

#: From this size on the buffers leave the caches: the memory bound is measured there.
BOUND_FROM = 16 << 20
#: Bytes of memory traffic per byte of buffer: a STREAM copy, a STREAM add, and the
#: ring allreduce on each rank times n/(n-1) (see the module's text).
COPY_TRAFFIC, ADD_TRAFFIC, RING_TRAFFIC = 2, 3, 5

CUDA_IMPLS = ("hvd", "gloo")


def allreduce_fn(comm, t, name):
    """A call that sums ``t`` in place across the ranks through ``comm.impl``; on a GPU,
    waits for the device too."""
    fn = _allreduce_fn(comm, t, name)
    if t.is_cuda:
        import torch

        def synced():
            fn()
            torch.cuda.synchronize()
        return synced
    return fn


def _allreduce_fn(comm, t, name):
    if comm.impl == "core":
        core, cap = comm.core, t.__dlpack__()

        def fn():
            comm.finish(core.allreduce(cap, cap, name, core.OP_SUM, 1.0, 1.0, 0))
    elif comm.impl == "hvd":
        hvd = comm.hvd

        def fn():
            hvd.allreduce_(t, op=hvd.Sum, name=name)
    elif comm.impl == "deepspeed":
        ds = comm.ds

        def fn():
            ds.inference_all_reduce(t)
    elif comm.impl in harness.TORCH_STARTED:  # gloo, or after import perseus: perseus
        dist = comm.dist

        def fn():
            dist.all_reduce(t)
    else:
        world, in_place, buf = comm.world, comm.mpi.IN_PLACE, t.numpy()

        def fn():
            world.Allreduce(in_place, buf)
    return fn


def body(comm, opts):
    """One rank: every size in turn, through ``comm.impl``."""
    import torch

    rss_init = harness.rss_mib()
    rows = []
    for nbytes in opts["sizes"]:
        # Zeros: repeated in-place sums stay finite (no inf, no denormals), and a float
        # add costs the same whatever the value. full() touches every page up front.
        t = torch.full((nbytes // 4,), 0.0, dtype=torch.float32, device=opts["device"])
        fn = allreduce_fn(comm, t, f"sweep.{nbytes}")
        rows.append({"bytes": nbytes, **harness.measure(comm, fn, **opts["timing"])})
        del fn, t
    result = {"rows": rows, "rss_after_init_mib": rss_init,
              "peak_rss_mib": harness.peak_rss_mib()}
    if comm.impl in harness.PERSEUS and opts["device"] == "cpu":
        result["memory"] = memory_rates(comm, opts["sizes"], opts["timing"])
    return result


def memory_rates(comm, sizes, timing):
    """STREAM-like copy and add timed on every rank at once, one thread each, at each size
    from BOUND_FROM: ``[{"bytes", "copy", "add"}]`` in seconds (medians, slowest rank)."""
    import functools

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for nbytes in sizes:
            if nbytes < BOUND_FROM:
                continue
            a = torch.full((nbytes // 4,), 0.0, dtype=torch.float32)
            b = torch.full((nbytes // 4,), 0.0, dtype=torch.float32)
            copy = harness.measure(comm, functools.partial(b.copy_, a), **timing)
            add = harness.measure(comm, functools.partial(a.add_, b), **timing)
            rows.append({"bytes": nbytes, "copy": copy["median"], "add": add["median"]})
            del a, b
    finally:
        torch.set_num_threads(threads)
    return rows


def bound_busbw(row, n):
    """The busbw (GB/s) at which the ring's memory traffic on ``n`` ranks runs at the rate
    that ``row`` of :func:`memory_rates` measured."""
    nbytes = row["bytes"]
    rate = max(COPY_TRAFFIC * nbytes / row["copy"], ADD_TRAFFIC * nbytes / row["add"])
    fastest = RING_TRAFFIC * (n - 1) / n * nbytes / rate
    return harness.busbw(nbytes, fastest, n)


def bounds(runs, impl, n):
    """``{bytes: (copy GB/s, add GB/s, bound busbw GB/s)}`` from ``impl``'s job."""
    res = runs.get(impl)
    if res is None or harness.failed(res) or not res[0].get("memory"):
        return {}
    return {r["bytes"]: (harness.algbw(r["bytes"], r["copy"]),
                         harness.algbw(r["bytes"], r["add"]), bound_busbw(r, n))
            for r in res[0]["memory"]}


def run(sizes=SIZES, ranks=(2, 3, 4), impls=harness.IMPLS, quick=False, timeout=600,
        echo=True, device="cpu"):
    """Driver: all jobs, one at a time; returns the results (JSON-able)."""
    if device == "cuda" and set(impls) - set(CUDA_IMPLS):
        raise SystemExit(f"--device cuda runs {' and '.join(CUDA_IMPLS)} only, not "
                         f"{' '.join(sorted(set(impls) - set(CUDA_IMPLS)))}")
    timing = QUICK_TIMING if quick else TIMING
    opts = {"sizes": list(sizes), "timing": timing, "device": device}
    result = {"sizes": list(sizes), "ranks": list(ranks), "impls": list(impls),
              "timing": timing, "device": device, "runs": {}}
    return harness.run_into(result, __file__, impls, ranks, opts, sections,
                            timeout=timeout, echo=echo)


def seconds(runs, impl, k):
    """Median seconds of size index ``k`` for ``impl``, None when the job failed."""
    res = runs.get(impl)
    if res is None or harness.failed(res):
        return None
    return res[0]["rows"][k]["median"]


def ratio(runs, impl, k):
    """Perseus ``impl`` busbw / best peer busbw at size index ``k``."""
    return harness.peer_ratio(seconds(runs, impl, k),
                              [seconds(runs, p, k) for p in harness.PEERS])


def sections(result, only=None):
    """Tables per rank count: time and busbw, ratios; algbw; peak RSS."""
    out = []
    impls = result["impls"]
    for n, runs in harness.runs_by_ranks(result, only):
        perseus = [i for i in (*harness.PERSEUS, "perseus", "ddp") if i in impls]
        headers = (["size"] + [f"{i} µs" for i in impls] + [f"{i} busbw" for i in impls]
                   + [f"{i} ÷ peer" for i in perseus])
        alg_headers = ["size"] + [f"{i} algbw" for i in impls]
        rows, alg_rows = [], []
        for k, nbytes in enumerate(result["sizes"]):
            secs = [seconds(runs, i, k) for i in impls]
            rows.append([harness.human(nbytes)]
                        + [harness.fmt(s and s * 1e6, ".1f") for s in secs]
                        + [harness.fmt(s and harness.busbw(nbytes, s, n), ".2f") for s in secs]
                        + [harness.fmt(ratio(runs, i, k), ".2f") + "×" for i in perseus])
            alg_rows.append([harness.human(nbytes)]
                            + [harness.fmt(s and harness.algbw(nbytes, s), ".2f")
                               for s in secs])
        notes = []
        for i in impls:
            res = runs.get(i)
            if res is None:
                continue
            if harness.failed(res):
                notes.append(f"{i}: failed: {res['error']}")
                continue
            peaks = "/".join(f"{r['peak_rss_mib']:.0f}" for r in res)
            inits = "/".join(f"{r['rss_after_init_mib']:.0f}" for r in res)
            notes.append(f"{i}: peak RSS per rank {peaks} MiB (after init {inits} MiB)")
        on = " on one shared GPU" if result.get("device") == "cuda" else ""
        out.append({"title": f"allreduce, float32{on}, {n} ranks: median time, busbw (GB/s), "
                             "Perseus busbw ÷ best peer busbw",
                    "headers": headers, "rows": rows, "notes": []})
        out.append({"title": f"allreduce, float32{on}, {n} ranks: algbw (GB/s)",
                    "headers": alg_headers, "rows": alg_rows,
                    "notes": ["Peak RSS over the sweep, rank 0/1/...:", *notes]})
        bound = bound_section(result, runs, n)
        if bound:
            out.append(bound)
    return out


def bound_section(result, runs, n):
    """Each Perseus implementation's busbw against the memory bound its job measured."""
    measured = {i: b for i in harness.PERSEUS if (b := bounds(runs, i, n))}
    if not measured:
        return None
    first = next(iter(measured.values()))
    rows = []
    for k, nbytes in enumerate(result["sizes"]):
        if nbytes not in first:
            continue
        copy, add, bound = first[nbytes]
        row = [harness.human(nbytes), f"{copy:.2f}", f"{add:.2f}", f"{bound:.2f}"]
        for i, own in measured.items():
            s = seconds(runs, i, k)
            row.append(harness.fmt(s and harness.busbw(nbytes, s, n) / own[nbytes][2] * 100,
                                   ".0f") + " %")
        rows.append(row)
    return {"title": f"allreduce, float32, {n} ranks: Perseus busbw against this machine's "
                     "memory bound",
            "headers": ["size", "copy GB/s", "add GB/s", "bound busbw"]
                       + [f"{i} ÷ bound" for i in measured],
            "rows": rows,
            "notes": [(f"copy, add: bytes of buffer a second per rank, all {n} ranks at "
                       f"once ({next(iter(measured))}'s job); bound: the ring's {RING_TRAFFIC}(n-1)/n "
                       "bytes of traffic per byte at the better of their traffic rates; "
                       "÷ bound: busbw over the bound its own job measured")]}


def page(results):
    """A markdown page of saved sweeps: each one's command, machine and tables."""
    lines = ["# Allreduce of CUDA tensors on a shared GPU: the host-staged path", "",
             ("Ranks sharing one GPU reduce its CUDA tensors through host memory "
              "([gpu.md](gpu.md)): each copies its tensor to page-locked memory, the CPU "
              "ring reduces it, and the result goes back. Below, that sweep against torch "
              "gloo on the same CUDA tensors, then the same sweep on host tensors: the "
              "difference is what the copies cost. Generated by `scripts/gpu-session.sh "
              "run`; see [benchmarks/allreduce_sweep.py](../benchmarks/allreduce_sweep.py) "
              "for the method."), ""]
    for r in results:
        m = r["machine"]
        where = "CUDA tensors" if r.get("device") == "cuda" else "host tensors"
        gpu = f", {m['gpu']}" if m.get("gpu") else ""
        lines += [f"## {where}", "",
                  (f"`{r['command']}` ({m['date']}{gpu}; {m['cpu']}, {m['nproc']} CPUs; "
                   f"torch {m['torch']}; Perseus {m['perseus_commit']})"), "",
                  harness.md_sections(sections(r))]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--page"]:
        results = []
        for path in args[2:]:
            with open(path) as f:
                results.append(json.load(f))
        with open(args[1], "w") as f:
            f.write(page(results))
        return None
    p = harness.driver_parser(__doc__, "smoke run: 3 sizes, 2 ranks, few iterations", ranks=None,
                              ranks_help="rank counts (default 2 3 4)")
    p.add_argument("--sizes", type=harness.parse_size, nargs="+", metavar="SIZE",
                   help="message sizes, e.g. 4K 1M 64M (default: 4 KiB to 256 MiB, "
                        "powers of 4)")
    p.add_argument("--short", action="store_true",
                   help="5 sizes, 4 KiB to 256 MiB, powers of 16")
    p.add_argument("--impls", nargs="+", choices=harness.IMPLS,
                   help="default: all four; with --device cuda, hvd and gloo")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors are (cuda: GPU 0, shared by every rank)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a job failed (by default it is reported and skipped)")
    a = p.parse_args(argv)
    sizes = a.sizes or (QUICK if a.quick else SHORT if a.short else SIZES)
    ranks = a.ranks or ([2] if a.quick else [2, 3, 4])
    impls = a.impls or list(CUDA_IMPLS if a.device == "cuda" else harness.IMPLS)
    result = run(sizes, ranks, impls, a.quick, a.timeout, device=a.device)
    harness.finish(result, a.json)
    bad = [f"{impl} on {n} ranks" for n, runs in harness.runs_by_ranks(result)
           for impl, res in runs.items() if harness.failed(res)]
    if a.strict and bad:
        raise SystemExit(f"allreduce_sweep: failed jobs: {', '.join(bad)}")


if __name__ == "__main__":
    main()

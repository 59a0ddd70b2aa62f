"""Memory growth: resident set size of every rank after 100 mixed allreduces and after
10,000, through perseus.torch.horovod.

    python benchmarks/memory.py [--ranks 2] [--count 10000] [--json PATH] [--quick]

The mix, the same on every rank, cycles through: bursts of 8 asynchronous in-place
allreduces under stable names; synchronous in-place allreduces with Sum, Average, Max and
Min; out-of-place allreduces without a name (auto-named, so every call is a new name for
the response cache); and allreduces under a name used once. Tensors are float32,
float64, float16 and int32 of 1 to 256 Ki elements. RSS is read from /proc/self/statm
after gc.collect(). (The peak RSS during the allreduce sweep is in allreduce_sweep.py.)
"""

import gc

import harness

IMPLS = ("hvd",)


def tensors():
    import torch

    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int32):
        for numel in (1, 1000, 16 << 10, 256 << 10):
            out.append(torch.zeros(numel, dtype=dtype))
    return out


def mixed(hvd, ts, start, stop):
    """Allreduces number ``start`` to ``stop`` of the mix (zeros stay zeros)."""
    k = start
    while k < stop:
        phase = k % 20
        t = ts[k % len(ts)]
        if phase < 8:       # a burst of async allreduces in flight together
            m = min(8 - phase, stop - k)
            handles = [hvd.allreduce_async_(ts[(k + j) % len(ts)], op=hvd.Sum,
                                            name=f"mix.async.{(k + j) % len(ts)}")
                       for j in range(m)]
            for h in handles:
                hvd.synchronize(h)
            k += m
            continue
        if phase < 16:      # synchronous, stable names, every op
            ops = (hvd.Sum, hvd.Max, hvd.Min) if not t.is_floating_point() else (
                hvd.Sum, hvd.Average, hvd.Max, hvd.Min)
            hvd.allreduce_(t, op=ops[k % len(ops)], name=f"mix.sync.{k % len(ts)}")
        elif phase < 19:    # out of place, auto-named: a new name every call
            hvd.allreduce(t, op=hvd.Sum)
        else:               # a name used once
            hvd.allreduce_(t, op=hvd.Sum, name=f"mix.once.{k}")
        k += 1


def body(comm, opts):
    hvd, ts = comm.hvd, tensors()
    first, count = opts["first"], opts["count"]
    mixed(hvd, ts, 0, first)
    gc.collect()
    rss_first = harness.rss_mib()
    mixed(hvd, ts, first, count)
    gc.collect()
    rss_last = harness.rss_mib()
    return {"first": first, "count": count, "rss_first_mib": rss_first,
            "rss_last_mib": rss_last, "peak_rss_mib": harness.peak_rss_mib(),
            "counters": hvd.counters()}


def run(ranks=(2,), first=100, count=10_000, timeout=600, echo=True):
    """Driver: one hvd job per rank count; returns the results."""
    result = {"ranks": list(ranks), "impls": list(IMPLS), "first": first, "count": count,
              "runs": {}}
    return harness.run_into(result, __file__, IMPLS, ranks, {"first": first, "count": count},
                            sections, timeout=timeout, echo=echo)


def growth(runs):
    """Largest RSS growth over the ranks, %; None when the job failed."""
    res = runs["hvd"]
    if harness.failed(res):
        return None
    return max((r["rss_last_mib"] / r["rss_first_mib"] - 1) * 100 for r in res)


def sections(result, only=None):
    out = []
    first, count = result["first"], result["count"]
    for n, runs in harness.runs_by_ranks(result, only):
        res = runs["hvd"]
        rows, notes = [], []
        if harness.failed(res):
            notes.append(f"hvd: failed: {res['error']}")
        else:
            for rank, r in enumerate(res):
                pct = (r["rss_last_mib"] / r["rss_first_mib"] - 1) * 100
                c = r["counters"]
                rows.append([str(rank), f"{r['rss_first_mib']:.1f}", f"{r['rss_last_mib']:.1f}",
                             f"{pct:+.2f}%", str(c.get("operations", "-")),
                             str(c.get("cache_hits", "-"))])
        out.append({"title": f"memory, {n} ranks: RSS after {first:,} and after {count:,} "
                             "mixed allreduces (hvd)",
                    "headers": ["rank", f"RSS after {first:,} MiB", f"RSS after {count:,} MiB",
                                "difference", "core operations", "cache hits"],
                    "rows": rows, "notes": notes})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: 1,000 allreduces")
    p.add_argument("--count", type=int, help="allreduces in all (default 10000, --quick 1000)")
    a = p.parse_args(argv)
    count = a.count or (1000 if a.quick else 10_000)
    result = run(a.ranks, 100, count, a.timeout)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

"""docs/benchmarks.md and its plot from the JSON that run_all.py writes.

    python benchmarks/report.py [JSON] [--out DIR]

JSON defaults to docs/benchmarks.json; the markdown (benchmarks.md) and the plot
(benchmarks_allreduce.png: busbw against size, one panel per rank count, one line per
implementation) go to DIR, by default the JSON's folder. run_all.py calls this itself.
"""

import argparse
import json
import os

import allreduce_sweep
import harness
import memory
import negotiation
import out_of_place
import resnet_scaling
import small_ops
import switches
import training
import under_load

PNG = "benchmarks_allreduce.png"
NOTES = os.path.join(harness.ROOT, "benchmarks", "NOTES.md")
MARKERS = {"core": "o", "hvd": "s", "gloo": "^", "mpi": "v", "mpich": "D", "deepspeed": "x"}
PEER_GOAL = 1.2  # issue 68: the hvd API over the best peer, every size and rank count
BOUND_GOAL = 0.8  # issue 68: 2 ranks' busbw over the memory bound, from 16 MiB


def plot(sweep, path):
    """busbw against size, log-x, one panel per rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sweep["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False,
                             sharey=True)
    sizes = sweep["sizes"]
    for ax, (n_str, res) in zip(axes[0], runs.items()):
        n = int(n_str)
        for impl in sweep["impls"]:
            secs = [allreduce_sweep.seconds(res, impl, k) for k in range(len(sizes))]
            pts = [(b, harness.busbw(b, s, n)) for b, s in zip(sizes, secs) if s is not None]
            if pts:
                ax.plot(*zip(*pts), marker=MARKERS.get(impl, "."), label=harness.LABELS[impl])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([harness.human(b).replace(" ", "") for b in sizes], rotation=45)
        ax.set_title(f"allreduce float32, {n} ranks")
        ax.set_xlabel("message size")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("busbw, GB/s (algbw × 2(n-1)/n)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _seconds(sweep, n, nbytes, impl):
    """Median seconds of ``impl`` at ``nbytes`` on ``n`` ranks, None if not measured."""
    runs = (sweep or {}).get("runs", {}).get(str(n))
    if not runs or nbytes not in sweep["sizes"]:
        return None
    return allreduce_sweep.seconds(runs, impl, sweep["sizes"].index(nbytes))


def _ratio(sweep, n, nbytes, impl):
    runs = (sweep or {}).get("runs", {}).get(str(n))
    if not runs or nbytes not in sweep["sizes"]:
        return None
    return allreduce_sweep.ratio(runs, impl, sweep["sizes"].index(nbytes))


def _job(section, key, n=2):
    """Rank 0's result of job ``key`` on ``n`` ranks in a section, None if absent/failed."""
    res = (section or {}).get("runs", {}).get(str(n), {}).get(key)
    return None if res is None or harness.failed(res) else res[0]


def at_most(limit, value):
    if value is None:
        return "not measured"
    return "met" if value <= limit else f"missed by {(value / limit - 1) * 100:.1f}%"


def at_least(goal, value):
    if value is None:
        return "not measured"
    return "met" if value >= goal else f"missed by {(1 - value / goal) * 100:.1f}%"


def bound_target(sweep, share=0.7, issue="issue 45"):
    """Issue 45's (70%) and 68's (80%): busbw from 16 MiB on at least ``share`` of the
    machine's memory bound (2 ranks, the hvd API), by its lowest size."""
    runs = (sweep or {}).get("runs", {}).get("2") or {}
    bound = allreduce_sweep.bounds(runs, "hvd", 2)
    shares = []
    for nbytes, (_copy, _add, best) in sorted(bound.items()):
        s = _seconds(sweep, 2, nbytes, "hvd")
        if s is not None:
            shares.append((harness.busbw(nbytes, s, 2) / best, nbytes))
    goal = f"busbw from 16 MiB ≥ {share:.0%} of the memory bound ({issue})"
    if not shares:
        return [goal, "-", "not measured"]
    low, at = min(shares)
    measured = ", ".join(f"{harness.human(b)} {f * 100:.0f}%" for f, b in
                         sorted(shares, key=lambda x: x[1]))
    return [goal, f"hvd {measured}",
            at_least(share, low) + f" (lowest at {harness.human(at)})"]


def small_message_targets(small):
    """Issue 45's: a lone 4 KiB allreduce and an allgather of 4-8 KiB a rank through the
    hvd API within 2× Open MPI's time in the same run (2 ranks)."""
    out = []
    for key, goal in (("lone4k", "a lone 4 KiB allreduce"),
                      (f"allgatherv.{small_ops.GATHER_BASES[0]}", "allgather of 4-8 KiB a rank")):
        us = {}
        for impl in ("hvd", "mpi"):
            res = _job(small, impl)
            us[impl] = None if res is None or key not in res else res[key]["median"] * 1e6
        ratio = None if None in us.values() else us["hvd"] / us["mpi"]
        out.append([f"{goal} through the hvd API ≤ 2× Open MPI's time (issue 45)",
                    (f"hvd {harness.fmt(us['hvd'], '.1f')} µs, Open MPI "
                     f"{harness.fmt(us['mpi'], '.1f')} µs: {harness.fmt(ratio, '.2f')}×"),
                    at_most(2.0, ratio)])
    return out


def scale_target(sweep):
    """Issue 45's: from 16 MiB on, 3 and 4 ranks at least 2× the best peer's busbw (the hvd
    API), by the lowest ratio measured."""
    goal = "3 and 4 ranks (oversubscribed) from 16 MiB ≥ 2× the best peer (issue 45)"
    found = []
    for n in (3, 4):
        for nbytes in (sweep or {}).get("sizes", []):
            r = _ratio(sweep, n, nbytes, "hvd") if nbytes >= 16 << 20 else None
            if r is not None:
                found.append((r, n, nbytes))
    if not found:
        return [goal, "-", "not measured"]
    measured = "; ".join(
        f"{n} ranks " + ", ".join(f"{harness.human(b)} {r:.2f}×" for r, m, b in found if m == n)
        for n in (3, 4) if any(m == n for _, m, _ in found))
    low, n, at = min(found)
    return [goal, f"hvd {measured}",
            at_least(2.0, low) + f" (lowest: {n} ranks, {harness.human(at)})"]


def peer_target(sweep):
    """Issue 68's: the hvd API at least 1.2× the best of every peer (gloo, Open MPI, MPICH,
    DeepSpeed's shared-memory allreduce) at every size from 4 KiB, 2 to 4 ranks, by the
    lowest ratio measured."""
    goal = "hvd ≥ 1.2× the best peer at every size from 4 KiB, 2-4 ranks (issue 68)"
    found = []
    for n in (2, 3, 4):
        for nbytes in (sweep or {}).get("sizes", []):
            r = _ratio(sweep, n, nbytes, "hvd") if nbytes >= 4 << 10 else None
            if r is not None:
                found.append((r, n, nbytes))
    if not found:
        return [goal, "-", "not measured"]
    below = sorted(f for f in found if f[0] < PEER_GOAL)
    measured = (f"{len(found) - len(below)} of {len(found)} (ranks, size) cells met; below: "
                + (", ".join(f"{n} ranks {harness.human(b)} {r:.2f}×" for r, n, b in below[:8])
                   or "none") + ("…" if len(below) > 8 else ""))
    low, n, at = min(found)
    return [goal, measured, at_least(PEER_GOAL, low) + f" (lowest: {n} ranks, {harness.human(at)})"]


def load_target(section):
    """Issue 68's: under load, a lone 4 KiB allreduce through the hvd API within 2× the best
    peer's time in every job (its worst round)."""
    goal = (f"under load, a lone 4 KiB allreduce ≤ {under_load.GOAL:g}× the best peer's time "
            "in every job (issue 68)")
    if not section or not section.get("rounds"):
        return [goal, "-", "not measured"]
    worst = under_load.worst_ratio(section)
    return [goal, (f"worst of {len(section['rounds'])} jobs: {harness.fmt(worst, '.2f')}× "
                   f"({section['busy_processes']} busy processes beside {section['ranks']} "
                   "ranks)"), at_most(under_load.GOAL, worst)]


def out_of_place_target(section):
    """Issue 45's: out-of-place allreduce and broadcast within 1.3× of in-place from
    16 MiB (2 ranks), by the largest ratio."""
    goal = "out-of-place allreduce and broadcast within 1.3× of in-place, 16-256 MiB (issue 45)"
    res = (section or {}).get("runs", {}).get("2", {}).get("hvd")
    if res is None or harness.failed(res):
        return [goal, "-", "not measured"]
    ratios = [(row[op] / row[op + "_"], op, row["bytes"]) for row in res[0]["rows"]
              for op in ("allreduce", "broadcast")]
    measured = "; ".join(
        f"{op} " + ", ".join(f"{r:.2f}×" for r, o, _ in ratios if o == op)
        for op in ("allreduce", "broadcast"))
    high, op, at = max(ratios)
    return [goal, measured,
            at_most(out_of_place.GOAL, high) + f" (largest: {op}, {harness.human(at)})"]


def efficiency_target(training_result):
    """Issue 45's: scaling efficiency of DistributedOptimizer at least 90% on 2 ranks for
    the communication-bound MLP."""
    goal = "scaling efficiency of hvd.DistributedOptimizer on 2 ranks ≥ 90%, the MLP (issue 45)"
    runs = (training_result or {}).get("runs", {}).get("2")
    e = training.efficiency(training_result, runs, "hvd", 2) if runs else None
    bound = training.machine_bound(training_result or {}, 2)
    return [goal, (f"{harness.fmt(e, '.0%')} of 2 × one rank alone (the machine's own bound, "
                   f"2 ranks computing apart: {harness.fmt(bound, '.0%')})"),
            at_least(resnet_scaling.GOAL, e)]


def resnet_target(data):
    """Issue 45's scaling efficiency on the examples' synthetic ResNet, 2 ranks, judged on
    DistributedOptimizer as the MLP's row is."""
    goal = ("scaling efficiency of the examples' synthetic ResNet on 2 ranks ≥ 90%, "
            "hvd.DistributedOptimizer (issue 45)")
    if not (data or {}).get("runs", {}).get("2"):
        return [goal, "-", "not measured"]
    eff = {job: resnet_scaling.efficiency(data, 2, job)
           for job in ("hvd", "ddp_perseus", "ddp_gloo", "apart")}
    return [goal, (f"hvd {harness.fmt(eff['hvd'], '.0%')}, DDP after `import perseus` "
                   f"{harness.fmt(eff['ddp_perseus'], '.0%')}, DDP on gloo "
                   f"{harness.fmt(eff['ddp_gloo'], '.0%')} (the machine's own bound, 2 "
                   f"processes apart: {harness.fmt(eff['apart'], '.0%')})"),
            at_least(resnet_scaling.GOAL, eff["hvd"])]


def negotiation_target(section):
    """Issue 45's: at 32 ranks, cached or offline negotiation sends at most 1/100 of the
    plain mode's bytes a step, judged on the better of the two."""
    goal = ("32 ranks: cached or offline negotiation ≤ 1/100 of plain's bytes a step "
            "(issue 45)")
    runs = (section or {}).get("runs", {}).get("32")
    if not runs or any(harness.failed(runs.get(m, {"error": ""})) for m in negotiation.MODES):
        return [goal, "-", "not measured"]

    def total(mode):
        _, nbytes, _, vbytes = negotiation.per_step(section, runs[mode])
        return nbytes + vbytes

    plain = total("plain")
    share = {m: total(m) / plain for m in ("cache", "offline")}
    best = min(share.values())
    return [goal, ", ".join(f"{m} 1/{1 / v:.0f}" if v else f"{m} 0" for m, v in share.items()),
            "met" if best <= 0.01 else f"missed (best 1/{1 / best:.0f})"]


def targets(data):
    """Issues 4's and 45's targets against this run: rows of [target, measured, status]."""
    sweep = data.get("sweep")
    out = []
    us = {i: _seconds(sweep, 2, 4 << 10, i) for i in harness.PERSEUS}
    us = {i: None if s is None else s * 1e6 for i, s in us.items()}
    out.append(["4 KiB allreduce through the hvd API ≤ 100 µs",
                (f"hvd {harness.fmt(us['hvd'], '.0f')} µs (core {harness.fmt(us['core'], '.0f')}"
                " µs)"), at_most(100, us["hvd"])])
    for nbytes, goal in ((1 << 20, 4.0), (16 << 20, 4.0), (64 << 20, 3.4)):
        bw = {}
        for i in harness.IMPLS:
            s = _seconds(sweep, 2, nbytes, i)
            bw[i] = None if s is None else harness.busbw(nbytes, s, 2)
        extra = ""
        if nbytes == 64 << 20 and bw["hvd"] and bw["mpi"] and bw["gloo"]:
            extra = f"; {bw['hvd'] / bw['mpi']:.2f}× Open MPI, {bw['hvd'] / bw['gloo']:.2f}× gloo"
        out.append([f"busbw ≥ {goal} GB/s at {harness.human(nbytes)}",
                    (f"hvd {harness.fmt(bw['hvd'], '.2f')}, core {harness.fmt(bw['core'], '.2f')}"
                    f" GB/s{extra}"), at_least(goal, bw["hvd"])])
    out.append(bound_target(sweep))
    r = {i: _ratio(sweep, 4, 64 << 20, i) for i in harness.PERSEUS}
    out.append(["4 ranks (oversubscribed) at 64 MiB ≥ 1.5× the best peer",
                f"hvd {harness.fmt(r['hvd'], '.2f')}×, core {harness.fmt(r['core'], '.2f')}×",
                at_least(1.5, r["hvd"])])
    out.append(scale_target(sweep))
    out += small_message_targets(data.get("small"))
    res = _job(data.get("small"), "hvd")
    ms = None if res is None else res["async100"]["median"] * 1e3
    out.append(["100 async 4 KiB allreduces ≤ 1 ms", f"{harness.fmt(ms, '.2f')} ms",
                at_most(1.0, ms)])
    runs = (data.get("training") or {}).get("runs", {}).get("2")
    sp = training.speedup(runs) if runs else None
    out.append(["training throughput ≥ 1.3× DDP gloo", f"{harness.fmt(sp, '.3f')}×",
                at_least(1.3, sp)])
    sp = training.speedup(runs, "ddp") if runs else None
    out.append(["DDP after `import perseus` faster than DDP on gloo (> 1×)",
                f"{harness.fmt(sp, '.3f')}×", "not measured" if sp is None
                else "met" if sp > 1.0 else "missed"])
    mem = data.get("memory") or {}
    runs = mem.get("runs", {}).get("2")
    g = memory.growth(runs) if runs else None
    out.append([f"RSS after {mem.get('count', 10_000):,} allreduces within 10% of after 100",
                f"{harness.fmt(g, '+.2f')}% (largest over the ranks)",
                "not measured" if g is None else "met" if g <= 10 else "missed"])
    out.append(efficiency_target(data.get("training")))
    out.append(resnet_target(data.get("resnet")))
    out.append(out_of_place_target(data.get("outofplace")))
    out.append(negotiation_target(data.get("negotiation")))
    out.append(peer_target(sweep))
    out.append(bound_target(sweep, BOUND_GOAL, "issue 68"))
    out.append(load_target(data.get("load")))
    return out


def machine_lines(m):
    env = ", ".join(f"`{k}={v}`" for k, v in m.get("env", {}).items()) or "none"
    return [f"- date: {m['date']}",
            (f"- CPU: {m['cpu']}, nproc {m['nproc']}, memory {m['memory_gib']} GiB, "
            f"Linux {m['kernel']}"),
            f"- Python {m['python']}, torch {m['torch']}, mpi4py {m['mpi4py']}, {m['mpirun']}",
            f"- Perseus commit {m['perseus_commit']}",
            f"- Perseus/gloo/Open MPI variables set: {env}"]


def describe(module):
    """A benchmark module's docstring after its usage line, as markdown."""
    parts = module.__doc__.strip().split("\n\n")[2:]
    out = []
    for part in parts:
        if any(line.startswith("  ") for line in part.splitlines()):
            out += ["```text", part, "```", ""]
        else:
            out += [" ".join(line.strip() for line in part.splitlines()), ""]
    return "\n".join(out)


def render(data, png=PNG, pages_dir=None):
    """The markdown page; ``pages_dir``: where the other benchmark pages are (the docs
    folder by default)."""
    pages_dir = pages_dir or os.path.join(harness.ROOT, "docs")
    m = data["machine"]
    lines = ["# Benchmarks", "",
             ("Perseus against torch.distributed (gloo) and Open MPI (mpi4py) on one host, "
             "all implementations in one run, one job at a time (never two at once). "
             "Times are medians over iterations, each iteration the slowest rank's time "
             "after a barrier. Generated by `benchmarks/run_all.py` (see "
             "[benchmarks/README.md](../benchmarks/README.md)); do not edit by hand, edit "
             "`benchmarks/NOTES.md` for the analysis."), "",
             f"Command: `{data['command']}`", "", *machine_lines(m), "",
             ("Numbers on a shared 2-core virtual machine move by tens of percent between "
             "runs: compare the columns of one run."), "",
             "## Targets (issues 4 and 45): 2 ranks on one host unless named, float32, median", "",
             harness.md_table(["target", "measured", "status"], targets(data)), "",
             ("Status is judged on the hvd API (what users call); the core column is the "
             "same engine without the Python front-end."), ""]
    if os.path.exists(NOTES):
        with open(NOTES) as f:
            lines += [f.read().strip(), ""]
    sweep = data.get("sweep")
    if sweep:
        lines += ["## Allreduce sweep", "",
                  (f"Sizes {harness.human(sweep['sizes'][0])} to "
                  f"{harness.human(sweep['sizes'][-1])}; per size "
                  f"{sweep['timing']['warmup']} warm-up calls, then "
                  f"{sweep['timing']['min_iters']} to {sweep['timing']['max_iters']} "
                  f"iterations within about {sweep['timing']['budget']} s. "
                  "algbw = bytes / time, busbw = algbw × 2(n-1)/n (nccl-tests' "
                  "definitions). *÷ peer* is Perseus busbw ÷ the best peer's (gloo or "
                  "Open MPI): above 1, Perseus is faster. core: `perseus._core.allreduce` "
                  "on DLPack capsules; hvd: `perseus.torch.horovod.allreduce_`; gloo: "
                  "`torch.distributed.all_reduce`; mpi: `MPI.COMM_WORLD.Allreduce(IN_PLACE)`."),
                  "", f"![busbw against message size]({png})", "",
                  harness.md_sections(allreduce_sweep.sections(sweep))]
    for key, title, module in (("small", "Small tensors, broadcast, allgather", small_ops),
                               ("training", "Training throughput", training),
                               ("memory", "Memory", memory),
                               ("outofplace", "Out-of-place collectives (issue 45)",
                                out_of_place),
                               ("negotiation", "Negotiation at scale, by counts (issue 45)",
                                negotiation),
                               ("switches", "The PERSEUS_* switches (issue 5)", switches),
                               ("resnet", "Scaling efficiency of the examples' ResNet (issue 45)",
                                resnet_scaling),
                               ("load", "Under load (issue 68)", under_load)):
        if data.get(key):
            lines += [f"## {title}", "", describe(module),
                      harness.md_sections(module.sections(data[key]))]
    lines += other_pages(pages_dir)
    return "\n".join(lines).rstrip() + "\n"


# The pages other benchmarks write beside this one: (file, what, the command).
PAGES = [
    ("benchmarks_optimizer_cpu.md", "the fused optimizer step against torch.optim, CPU",
     "python benchmarks/optimizer_step.py"),
    ("benchmarks_tensorflow.md", "TensorFlow scaling through perseus.tensorflow.horovod",
     "python benchmarks/tensorflow_scaling.py"),
    ("benchmarks_resnet_scaling.md",
     "scaling efficiency of the examples' synthetic ResNet benchmark",
     "python benchmarks/resnet_scaling.py"),
    ("benchmarks_optimizer_cuda.md", "the fused optimizer step against torch.optim, GPU",
     "python benchmarks/optimizer_step.py --device cuda"),
    ("benchmarks_kernels_cuda.md", "each device kernel against torch's own operation",
     "python benchmarks/kernels.py"),
    ("benchmarks_staged_cuda.md", "allreduce of CUDA tensors on a shared GPU (host-staged)",
     "python benchmarks/allreduce_sweep.py --device cuda --ranks 2 --short"),
]


def other_pages(pages_dir):
    """The section listing the other benchmark pages, and those not measured yet."""
    lines = ["## Other pages", ""]
    missing = []
    for name, what, command in PAGES:
        if os.path.exists(os.path.join(pages_dir, name)):
            lines.append(f"- [{what}]({name}) (`{command}`)")
        else:
            missing.append(f"{what} (`{command}`)")
    if missing:
        lines += ["", ("Not measured yet (the GPU pages need a machine with a GPU; "
                       "`scripts/gpu-session.sh` runs them there, docs/gpu.md): "
                       + "; ".join(missing) + ".")]
    return lines + [""]


def write(data, out_dir):
    """Writes benchmarks.md and the plot into ``out_dir``; returns the markdown's path."""
    os.makedirs(out_dir, exist_ok=True)
    if data.get("sweep", {}).get("runs"):
        plot(data["sweep"], os.path.join(out_dir, PNG))
    path = os.path.join(out_dir, "benchmarks.md")
    with open(path, "w") as f:
        f.write(render(data, pages_dir=out_dir))
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="?", default=os.path.join(harness.ROOT, "docs",
                                                           "benchmarks.json"))
    p.add_argument("--out", help="output folder (default: the JSON's folder)")
    a = p.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    print(write(data, a.out or os.path.dirname(os.path.abspath(a.json))))


if __name__ == "__main__":
    main()

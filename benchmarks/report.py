"""Writes docs/benchmarks.md and docs/benchmarks_allreduce.png from benchmarks/results/*.json.

    python benchmarks/report.py
"""

import json
import os

import harness

RESULTS = os.path.join(harness.ROOT, "benchmarks", "results")
DOCS = os.path.join(harness.ROOT, "docs")
PNG = "benchmarks_allreduce.png"
PEERS = ("gloo", "mpi")


def load(name):
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def human(nbytes):
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << k:
            return f"{nbytes >> k} {unit}"
    return f"{nbytes} B"


def allreduce_section(data):
    out = ["## Allreduce sweep (float32)", "",
           f"Command: `{data['command']}` on {data['machine']}.", "",
           ("busbw in GB/s (nccl-tests: algbw × 2(n-1)/n), median time in µs; the last column "
           "is Perseus (core) time over the best peer's, >1 meaning Perseus is faster."), ""]
    for n, runs in data["runs"].items():
        impls = [i for i in harness.IMPLS if i in runs]
        out.append(f"### {n} ranks")
        out.append("")
        out.append("| size | " + " | ".join(f"{i} µs | {i} GB/s" for i in impls)
                   + " | perseus ÷ best peer |")
        out.append("|---" * (2 * len(impls) + 2) + "|")
        for k, row in enumerate(runs[impls[0]]["rows"]):
            nb = row["bytes"]
            cells = []
            for i in impls:
                s = runs[i]["rows"][k]["seconds"]
                cells.append(f"{s * 1e6:.1f} | {harness.busbw(nb, s, int(n)):.2f}")
            best = min(runs[p]["rows"][k]["seconds"] for p in PEERS if p in runs)
            ratio = best / runs["perseus"]["rows"][k]["seconds"]
            out.append(f"| {human(nb)} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
        peaks = ", ".join(f"{i} {runs[i]['peak_rss_mib']:.0f} MiB" for i in impls)
        out += ["", f"Peak RSS per rank during the sweep: {peaks}.", ""]
    out += [f"![busbw against size]({PNG})", ""]
    return out


def plot(data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (n, res) in zip(axes[0], runs.items()):
        for impl in harness.IMPLS:
            if impl not in res:
                continue
            rows = res[impl]["rows"]
            ax.plot([r["bytes"] for r in rows],
                    [harness.busbw(r["bytes"], r["seconds"], int(n)) for r in rows],
                    marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"allreduce, {n} ranks")
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, PNG), dpi=90)


def small_section(data):
    out = ["## Small tensors, broadcast, allgather, memory", "",
           f"Command: `{data['command']}` on {data['machine']}.", ""]
    for n, runs in data["runs"].items():
        out += [f"### {n} ranks", "", "| benchmark | hvd ms | gloo ms | mpi ms |",
                "|---|---|---|---|"]
        names = {"async100": "100 async 4 KiB allreduces",
                 "bcast_r50": "broadcast of ResNet-50 parameters (25.6 M floats)",
                 "allgatherv": "allgather, 1-64 KiB per rank, sizes differ"}
        for key, label in names.items():
            out.append(f"| {label} | " + " | ".join(
                f"{runs[i][key] * 1e3:.3f}" for i in ("hvd", "gloo", "mpi")) + " |")
        h = runs["hvd"]
        growth = (h["rss_after_10000_mib"] / h["rss_after_100_mib"] - 1) * 100
        out += ["", (f"RSS per rank after 100 mixed allreduces: {h['rss_after_100_mib']:.1f} MiB; "
                f"after 10,000: {h['rss_after_10000_mib']:.1f} MiB ({growth:+.1f}%)."), ""]
    return out


def training_section(data):
    out = ["## Training throughput", "", f"Command: `{data['command']}` on {data['machine']}.",
           ""]
    for n, runs in data["runs"].items():
        h, g = runs["hvd"], runs["gloo"]
        out.append(f"{n} ranks, {h['params'] / 1e6:.1f} M parameters, batch {h['batch']} per "
                   f"rank, {h['steps']} steps: DistributedOptimizer "
                   f"{h['samples_per_s']:.1f} samples/s, DDP (gloo) {g['samples_per_s']:.1f} "
                   f"samples/s: **{h['samples_per_s'] / g['samples_per_s']:.2f}×**.")
    return out + [""]


def main():
    lines = ["# Benchmarks", "",
             ("Made by `bash benchmarks/run.sh` (see benchmarks/README.md); numbers from one run "
             "on this project's 2-core machine, all implementations one after the other. "
             "Timings on a shared 2-core virtual machine vary by ±30% between runs; compare "
             "columns of one run, not runs."), ""]
    notes = os.path.join(harness.ROOT, "benchmarks", "NOTES.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    for name, section in (("allreduce", allreduce_section), ("small_ops", small_section),
                          ("training", training_section)):
        data = load(name)
        if data:
            lines += section(data)
            if name == "allreduce":
                plot(data)
    with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(DOCS, 'benchmarks.md')}")


if __name__ == "__main__":
    main()

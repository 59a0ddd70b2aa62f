"""Every benchmark in one run, then the report: docs/benchmarks.json, docs/benchmarks.md and
docs/benchmarks_allreduce.png.

    python benchmarks/run_all.py [--quick]
                                 [--only sweep small training memory outofplace negotiation
                                        switches resnet load]
                                 [--timeout SECONDS]

Runs, one job at a time: the allreduce sweep (allreduce_sweep.py, 2, 3 and 4 ranks), the
small-tensor benchmarks (small_ops.py), training throughput (training.py), memory
growth (memory.py), out-of-place against in-place collectives (out_of_place.py),
control-plane traffic per step at 2-32 ranks (negotiation.py), each
Perseus implementation beside the peers, the effect of each PERSEUS_* switch
(switches.py), the scaling efficiency of the examples' synthetic ResNet
(resnet_scaling.py), and small and large allreduces beside busy processes, every peer in
each of 5 jobs (under_load.py). ``--quick`` is a smoke
run of a few minutes that writes benchmarks/results/quick/ and never replaces the
published numbers. ``--only`` reruns some parts and keeps the others from the existing
JSON. `bash benchmarks/run.sh` sets up the environment and calls this.
"""

import argparse
import json
import os
import sys
import time

import allreduce_sweep
import harness
import memory
import negotiation
import out_of_place
import report
import resnet_scaling
import small_ops
import switches
import training
import under_load

PARTS = ("sweep", "small", "training", "memory", "outofplace", "negotiation", "switches",
         "resnet", "load")


def run_part(part, quick, timeout):
    """One benchmark's driver with the published (or the quick) settings."""
    if part == "sweep":
        sizes = allreduce_sweep.QUICK if quick else allreduce_sweep.SIZES
        ranks = (2,) if quick else (2, 3, 4)
        return allreduce_sweep.run(sizes, ranks, quick=quick, timeout=timeout)
    if part == "small":
        return small_ops.run(quick=quick, timeout=timeout)
    if part == "training":
        return training.run(steps=5 if quick else 40, timeout=timeout)
    if part == "switches":
        return switches.run(steps=5 if quick else 40, size=(1 << 20) if quick else (64 << 20),
                            quick=quick, timeout=timeout)
    if part == "negotiation":
        return negotiation.run(ranks=(2, 8) if quick else (2, 8, 16, 32),
                               steps=3 if quick else 10, timeout=timeout)
    if part == "resnet":
        return resnet_scaling.run(iters=2 if quick else 5, rounds=1 if quick else 3,
                                  timeout=timeout)
    if part == "load":
        return under_load.run(ranks=2, jobs=2 if quick else 5, quick=quick, timeout=timeout)
    if part == "outofplace":
        sizes = [16 << 20] if quick else [16 << 20, 64 << 20, 256 << 20]
        return out_of_place.run(sizes=sizes, count=1000 if quick else 10_000, timeout=timeout)
    return memory.run(count=1000 if quick else 10_000, timeout=timeout)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run into benchmarks/results/")
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    p.add_argument("--timeout", type=int, default=900,
                   help="seconds each job may take before it is stopped (default 900)")
    a = p.parse_args(argv)
    if a.quick:
        out_dir = os.path.join(harness.ROOT, "benchmarks", "results", "quick")
    else:
        out_dir = os.path.join(harness.ROOT, "docs")
    path = os.path.join(out_dir, "benchmarks.json")
    data = {}
    if a.only and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    for part in a.only or PARTS:
        t0 = time.monotonic()
        data[part] = run_part(part, a.quick, a.timeout)
        print(f"[bench] {part}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    data["command"] = " ".join(["python", "benchmarks/run_all.py", *(argv or sys.argv[1:])])
    data["machine"] = harness.machine()
    harness.save_json(path, data)
    print(report.write(data, out_dir))


if __name__ == "__main__":
    main()

"""Two builds of Perseus side by side: does a change cost time?

    python benchmarks/ab.py --baseline DIR [--rounds 12] [--sizes 4K 64M]
                            [--impls hvd core] [--ranks 2] [--env-a VAR=VALUE ...]
                            [--env-b VAR=VALUE ...] [--json PATH]

``DIR`` is a directory holding a ``perseus`` package with its extension built: the
``python/`` directory of another checkout. To compare with commit ``C``::

    git worktree add /tmp/perseus-base C
    (cd /tmp/perseus-base && cargo build --release --features python &&
     cp "${CARGO_TARGET_DIR:-target}/release/libperseus.so" python/perseus/_core.abi3.so)
    python benchmarks/ab.py --baseline /tmp/perseus-base/python

Side A is the baseline, side B this tree's package (``maturin develop``). Without
``--baseline`` both sides run this tree, told apart by ``--env-a``/``--env-b`` (a knob
on against off). Each round runs one allreduce_sweep.py job per side and
implementation, the sides' order alternating from round to round, so that a machine
that slows down or speeds up over the run weighs on both. Each job reports the median
and the fastest of its timed iterations per size (each the slowest rank's time after
a barrier).

Reported per size and implementation, for the jobs' medians and for their fastest
iterations (the steadier figure where a fixed cost is in question): each side's median
over the rounds, and the median with the quartiles of the per-round ratio B ÷ A (a
ratio above 1: B is slower).
A 2-core virtual machine shifts single runs by tens of percent; the paired ratio over
a dozen rounds is what to read, and its quartiles say how far to trust it.
"""

import os
import statistics
import sys

import allreduce_sweep
import harness

TIMING = allreduce_sweep.TIMING


def parse_env(pairs):
    env = {}
    for pair in pairs or []:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise SystemExit(f"--env-a/--env-b take VAR=VALUE, not {pair!r}")
        env[name] = value
    return env


def quartiles(values):
    """(first quartile, median, third quartile) of ``values``."""
    if len(values) < 2:
        v = values[0]
        return v, v, v
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def run(baseline, rounds, sizes, impls, ranks, env_a, env_b, timeout=600, pin=False):
    """Driver: ``rounds`` rounds of one job per side and implementation. Returns the
    results (JSON-able): per side, implementation and round, the per-size medians."""
    opts = {"sizes": list(sizes), "timing": TIMING, "device": "cpu", "pin": pin}
    sides = {"A": (baseline, env_a), "B": (None, env_b)}
    times = {side: {impl: [] for impl in impls} for side in sides}
    script = allreduce_sweep.__file__
    for k in range(rounds):
        order = ["A", "B"] if k % 2 == 0 else ["B", "A"]
        for impl in impls:
            for side in order:
                package, env = sides[side]
                res = harness.launch(script, impl, ranks, opts, env=env, timeout=timeout,
                                     package=package)
                times[side][impl].append([(row["median"], row["min"]) for row in res[0]["rows"]])
        print(f"[ab] round {k + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {"baseline": baseline, "rounds": rounds, "sizes": list(sizes),
            "impls": list(impls), "ranks": ranks, "env_a": env_a, "env_b": env_b, "pin": pin,
            "timing": TIMING, "times": times}


def sections(result):
    rows = []
    for impl in result["impls"]:
        a_runs, b_runs = result["times"]["A"][impl], result["times"]["B"][impl]
        for k, nbytes in enumerate(result["sizes"]):
            row = [impl, harness.human(nbytes)]
            for stat in (0, 1):  # the jobs' medians, then their fastest iterations
                a = [r[k][stat] for r in a_runs]
                b = [r[k][stat] for r in b_runs]
                q1, q2, q3 = quartiles([y / x for x, y in zip(a, b)])
                row += [f"{statistics.median(a) * 1e6:.1f}", f"{statistics.median(b) * 1e6:.1f}",
                        f"{q2:.3f} ({q1:.2f} - {q3:.2f})"]
            rows.append(row)
    a_name = result["baseline"] or "this tree"
    notes = [f"A: {a_name} {result['env_a'] or ''}".rstrip(),
             f"B: this tree {result['env_b'] or ''}".rstrip(),
             f"{result['rounds']} rounds of one job per side, {result['ranks']} ranks"
             + (", each on a CPU of its own" if result.get("pin") else "")
             + ", sides alternating in order"]
    return [{"title": "allreduce, float32: each job's median and fastest iteration, the "
                      "median over rounds per side (µs), and B ÷ A per round: median "
                      "(quartiles)",
             "headers": ["impl", "size", "A median", "B median", "B ÷ A", "A fastest",
                         "B fastest", "B ÷ A"],
             "rows": rows, "notes": notes}]


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(allreduce_sweep.body, argv)
    p = harness.driver_parser(__doc__, "3 rounds instead of --rounds", ranks=None)
    p.add_argument("--baseline", metavar="DIR",
                   help="a directory holding the baseline's built perseus package")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--sizes", type=harness.parse_size, nargs="+", default=[4 << 10, 64 << 20],
                   metavar="SIZE")
    p.add_argument("--impls", nargs="+", choices=harness.PERSEUS, default=["hvd", "core"])
    p.add_argument("--env-a", nargs="*", metavar="VAR=VALUE")
    p.add_argument("--env-b", nargs="*", metavar="VAR=VALUE")
    p.add_argument("--pin", action="store_true",
                   help="each rank (and its engine thread) on one CPU of its own")
    a = p.parse_args(argv)
    if a.baseline and not os.path.isdir(os.path.join(a.baseline, "perseus")):
        raise SystemExit(f"--baseline {a.baseline}: no perseus package in it")
    env_a, env_b = parse_env(a.env_a), parse_env(a.env_b)
    if not a.baseline and env_a == env_b:
        raise SystemExit("nothing to compare: give --baseline, or --env-a/--env-b that differ")
    rounds = 3 if a.quick else a.rounds
    ranks = (a.ranks or [2])[0]
    result = run(a.baseline, rounds, a.sizes, a.impls, ranks, env_a, env_b,
                 timeout=a.timeout, pin=a.pin)
    print(harness.text_sections(sections(result)), flush=True)
    harness.finish(result, a.json)
    return None


if __name__ == "__main__":
    main()

"""Negotiation at scale, by counts: control-plane frames and bytes per training step with
ResNet-50's 161 gradient tensors, on 2 to 32 ranks (oversubscribed on a small machine),
in three modes: plain negotiation (HOROVOD_CACHE_CAPACITY=0), the response cache (the
default), and offline negotiation (PERSEUS_OFFLINE_NEG=1).

    python benchmarks/negotiation.py [--ranks 2 8 16 32] [--steps 10] [--json PATH]
                                     [--quick]

Each step submits the 161 allreduces under DistributedOptimizer's names
(``allreduce.layer1.0.conv1.weight`` and so on), in backward order, and waits for them.
The figures are what every rank sent, summed over the job, per step, after warm-up
steps that let the cache fill and the offline schedule start: frames and bytes (headers
included) on the negotiation streams to and from rank 0, plus the offline votes' messages
between ranks. A request's size depends on its name and its number of dimensions, not
on the values, so each tensor keeps ResNet-50's name and number of dimensions with at
most 2 elements along each: counts, not time, are measured here. The goal (issue 45): at
32 ranks, cached or offline negotiation sends at most 1/100 of the plain mode's bytes.
"""

import harness

MODES = {"plain": {"HOROVOD_CACHE_CAPACITY": "0"},
         "cache": {},
         "offline": {"PERSEUS_OFFLINE_NEG": "1"}}
KEYS = ("control_frames_sent", "control_bytes_sent", "vote_messages", "vote_bytes",
        "negotiations_skipped", "cache_hits")


def resnet50():
    """(name, shape) of ResNet-50's 161 parameters, in torchvision's order."""
    out = [("conv1.weight", [64, 3, 7, 7]), ("bn1.weight", [64]), ("bn1.bias", [64])]
    inplanes = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), 1):
        for b in range(blocks):
            p = f"layer{layer}.{b}."
            for i, shape in enumerate(([width, inplanes if b == 0 else width * 4, 1, 1],
                                       [width, width, 3, 3], [width * 4, width, 1, 1]), 1):
                out += [(f"{p}conv{i}.weight", shape), (f"{p}bn{i}.weight", [shape[0]]),
                        (f"{p}bn{i}.bias", [shape[0]])]
            if b == 0:
                out += [(f"{p}downsample.0.weight", [width * 4, inplanes, 1, 1]),
                        (f"{p}downsample.1.weight", [width * 4]),
                        (f"{p}downsample.1.bias", [width * 4])]
        inplanes = width * 4
    out += [("fc.weight", [1000, 2048]), ("fc.bias", [1000])]
    assert len(out) == 161
    return out


def body(comm, opts):
    import numpy as np

    core = comm.core
    grads = [(f"allreduce.{name}", np.zeros([min(d, 2) for d in shape], np.float32))
             for name, shape in reversed(resnet50())]

    def step():
        caps = [g.__dlpack__() for _, g in grads]
        handles = [core.allreduce(c, c, name, core.OP_AVERAGE, 1.0, 1.0, 0)
                   for (name, _), c in zip(grads, caps)]
        for h in handles:
            comm.finish(h)

    for _ in range(opts["warmup"]):
        step()
    before = dict(core.counters())
    for _ in range(opts["steps"]):
        step()
    after = dict(core.counters())
    return {k: after[k] - before[k] for k in KEYS}


def run(ranks=(2, 8, 16, 32), steps=10, warmup=12, timeout=900, echo=True):
    """Driver: one job per rank count and mode; returns the results."""
    result = {"ranks": list(ranks), "modes": list(MODES), "steps": steps, "runs": {}}
    for n in ranks:
        runs = {}
        for mode, env in MODES.items():
            try:
                runs[mode] = harness.launch(__file__, "core", n,
                                            {"steps": steps, "warmup": warmup},
                                            env=env, timeout=timeout)
            except harness.JobFailed as e:
                runs[mode] = {"error": str(e).splitlines()[0]}
        result["runs"][str(n)] = runs
        if echo:
            print(harness.text_sections(sections(result, only=n)), flush=True)
    return result


def per_step(result, res):
    """Frames and bytes the whole job sent per step: (control frames, control bytes,
    vote messages, vote bytes)."""
    s = result["steps"]
    return tuple(sum(r[k] for r in res) / s for k in KEYS[:4])


def sections(result, only=None):
    out = []
    for n, runs in harness.runs_by_ranks(result, only):
        rows, notes = [], []
        plain = None if harness.failed(runs["plain"]) else per_step(result, runs["plain"])
        for mode in MODES:
            res = runs[mode]
            if harness.failed(res):
                notes.append(f"{mode}: failed: {res['error']}")
                continue
            frames, nbytes, votes, vbytes = per_step(result, res)
            total = nbytes + vbytes
            share = "-" if not plain or mode == "plain" else \
                f"1/{(plain[1] + plain[3]) / total:.0f}" if total else "0"
            rows.append([mode, f"{frames:.1f}", f"{nbytes:,.0f}", f"{votes:.1f}",
                         f"{vbytes:,.0f}", f"{total:,.0f}", share])
        out.append({"title": f"negotiation per training step, {n} ranks, 161 tensors "
                             "(sent by all ranks together)",
                    "headers": ["mode", "control frames", "control bytes", "vote messages",
                                "vote bytes", "bytes in all", "of plain"],
                    "rows": rows, "notes": notes})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: 2 and 8 ranks, 3 steps",
                              ranks=(2, 8, 16, 32))
    p.add_argument("--steps", type=int, help="measured steps (default 10, --quick 3)")
    a = p.parse_args(argv)
    ranks = [2, 8] if a.quick and a.ranks == [2, 8, 16, 32] else a.ranks
    result = run(ranks, a.steps or (3 if a.quick else 10), timeout=a.timeout)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

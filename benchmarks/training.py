"""End to end: samples/s of a communication-bound MLP: hvd.DistributedOptimizer, torch
DistributedDataParallel after ``import perseus`` (its buckets reduced by Perseus's hook),
DDP on a ``perseus`` process group (its own reducer, each bucket through the backend's
all_reduce, PERSEUS_DDP=0), against DistributedDataParallel on gloo. ``--fsdp``: FSDP2
(``fully_shard`` on each layer and the model, on the CPU) on perseus against gloo.
Each run also times one rank alone, with no communication, and reports each job's
scaling efficiency: samples/s on N ranks ÷ (N × that rank's samples/s); and N ranks at
once, each computing alone, as the machine's own bound on that efficiency.

    python benchmarks/training.py [--ranks 2] [--steps 40] [--batch 16] [--fsdp]
                                  [--json PATH] [--quick]

The model: dense layers 4096 -> 2048 -> 2048 -> 2048 -> 2048 -> 2048 -> 10 with ReLU, 25.2 M
float32 parameters (100 MB of gradients a step), fed a small batch of random data, so a
step is mostly gradient communication. Both jobs use the same model, initial weights,
batch per rank, SGD with momentum (opts ``optimizer``: ``adam`` for Adam, as
switches.py --optimizer adam asks), one intra-op thread per rank and the same number of
steps after 3 warm-up steps (opts ``warmup``: more, as switches.py gives an autotuned run
for its tuning); samples/s = steps * batch * ranks / the slowest rank's time.
"""

import csv
import os
import tempfile
import time

import harness

IMPLS = ("hvd", "ddp", "perseus", "gloo")
FSDP_IMPLS = ("perseus", "gloo")
# Where switches.py's autotuned run logs its samples; rank 0 reports the settings kept.
AUTOTUNE_LOG = os.path.join(tempfile.gettempdir(), "perseus-bench-autotune.csv")
DIMS = (4096, 2048, 2048, 2048, 2048, 2048, 10)


def model():
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(DIMS, DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def body(comm, opts):
    import torch

    torch.set_num_threads(1)
    steps, batch = opts["steps"], opts["batch"]
    net = model()
    params = sum(p.numel() for p in net.parameters())
    solo = opts.get("solo", False)  # one rank alone, no communication
    if opts.get("fsdp") and not solo:
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    if opts.get("optimizer", "sgd") == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if comm.impl == "hvd" and not solo:
        hvd = comm.hvd
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    elif not (opts.get("fsdp") or solo):
        net = torch.nn.parallel.DistributedDataParallel(net)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(batch, DIMS[0], generator=gen)
    y = torch.randint(0, DIMS[-1], (batch,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(opts.get("warmup", 3)):
        step()
    comm.barrier()
    perseus = comm.hvd if comm.impl == "hvd" else None
    if comm.impl in ("ddp", "perseus") and not solo:
        from perseus.common import basics as perseus

        assert perseus.is_initialized(), f"{comm.impl}: Perseus did not start"
    counters = perseus.counters() if perseus else {}
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    elapsed = comm.max_over_ranks([time.perf_counter() - t0])[0]
    result = {"params": params, "batch": batch, "steps": steps, "seconds": elapsed,
              "samples_per_s": steps * batch * comm.size / elapsed,
              "final_loss": float(loss)}
    kept = after_tuning(comm)
    if kept:
        result["autotune"] = kept
    if counters:
        after = perseus.counters()
        result["bytes_per_step"] = sum(after[k] - counters[k] for k in
                                       ("bytes_intra_host", "bytes_inter_host")) / steps
    return result


def after_tuning(comm):
    """Rank 0 under HOROVOD_AUTOTUNE with a log: the settings it kept, from the log's
    last row (an error when tuning had not ended), else None."""
    path = os.environ.get("HOROVOD_AUTOTUNE_LOG")
    if comm.rank != 0 or os.environ.get("HOROVOD_AUTOTUNE") != "1" or not path:
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows or rows[-1]["phase"] != "best":
        raise RuntimeError(f"autotuning had not ended after the untimed steps: {rows}")
    samples = sum(r["phase"] == "sample" for r in rows)
    best = rows[-1]
    return (f"kept fusion threshold {int(best['fusion_threshold_bytes']) / 2**20:g} MiB, "
            f"cycle time {best['cycle_time_ms']} ms, after {samples} samples")


def run(ranks=(2,), steps=40, batch=16, timeout=600, echo=True, fsdp=False):
    """Driver: one job per implementation and rank count; returns the results."""
    impls = FSDP_IMPLS if fsdp else IMPLS
    result = {"ranks": list(ranks), "impls": list(impls), "steps": steps, "batch": batch,
              "fsdp": fsdp, "runs": {}}
    opts = {"steps": steps, "batch": batch, "fsdp": fsdp}
    try:  # the base of the scaling efficiency, before the jobs so that they print it
        result["solo"] = harness.launch(__file__, "gloo", 1, dict(opts, solo=True),
                                        timeout=timeout)[0]
    except harness.JobFailed as e:
        result["solo"] = {"error": str(e)}
    # The machine's own bound: N ranks at once, each computing alone (nothing exchanged).
    result["apart"] = {}
    for n in ranks:
        try:
            result["apart"][str(n)] = harness.launch(__file__, "gloo", n, dict(opts, solo=True),
                                                     timeout=timeout)[0]
        except harness.JobFailed as e:
            result["apart"][str(n)] = {"error": str(e)}
    return harness.run_into(result, __file__, impls, ranks, opts, sections, timeout=timeout,
                            echo=echo)


def _share(result, rank0, n):
    """``rank0``'s samples/s (a job's rank-0 result) ÷ (n × one rank's alone), or None
    when either is missing or failed."""
    solo = result.get("solo")
    if not solo or "error" in solo or not rank0 or "error" in rank0:
        return None
    return rank0["samples_per_s"] / (int(n) * solo["samples_per_s"])


def efficiency(result, runs, impl, n):
    """``impl``'s samples/s on ``n`` ranks ÷ (n × one rank's alone), or None."""
    res = runs.get(impl)
    return None if res is None or harness.failed(res) else _share(result, res[0], n)


def machine_bound(result, n):
    """The scaling efficiency of ``n`` ranks computing at once with nothing exchanged (the
    cores and memory they share), or None."""
    return _share(result, result.get("apart", {}).get(str(n)), n)


def speedup(runs, impl="hvd", base="gloo"):
    """``impl``'s samples/s ÷ ``base``'s (DDP on gloo), None when either job failed (or
    is absent)."""
    h, g = runs.get(impl), runs.get(base)
    if h is None or g is None or harness.failed(h) or harness.failed(g):
        return None
    return h[0]["samples_per_s"] / g[0]["samples_per_s"]


def sections(result, only=None):
    out = []
    fsdp = result.get("fsdp", False)
    labels = ((("perseus", "FSDP2 on perseus"), ("gloo", "FSDP2 on gloo")) if fsdp else
              (("hvd", "hvd.DistributedOptimizer"),
               ("ddp", "torch DDP after import perseus"),
               ("perseus", "torch DDP on a perseus group, its own reducer"),
               ("gloo", "torch DDP (gloo)")))
    for n, runs in harness.runs_by_ranks(result, only):
        rows, notes = [], []
        for impl, label in labels:
            res = runs.get(impl)
            if res is None:
                continue
            if harness.failed(res):
                rows.append([label, "failed", "-", "-"])
                notes.append(f"{impl}: failed: {res['error']}")
                continue
            r = res[0]
            rows.append([label, f"{r['samples_per_s']:.1f}",
                         f"{r['seconds'] / r['steps'] * 1e3:.1f}", f"{r['final_loss']:.4f}"])
        params = next((runs[i][0]["params"] for i in IMPLS
                       if i in runs and not harness.failed(runs[i])), 0)
        if fsdp:
            notes.append("FSDP2 on perseus ÷ on gloo: "
                         f"{harness.fmt(speedup(runs, 'perseus'), '.2f')}×")
        else:
            notes.append(f"hvd ÷ DDP on gloo: {harness.fmt(speedup(runs), '.2f')}×")
            notes.append("DDP on Perseus ÷ DDP on gloo: "
                         f"{harness.fmt(speedup(runs, 'ddp'), '.2f')}×")
            notes.append("DDP on a perseus group (reducer) ÷ DDP after import perseus "
                         f"(hook): {harness.fmt(speedup(runs, 'perseus', 'ddp'), '.2f')}×")
        solo = result.get("solo")
        if solo and "error" not in solo:
            shares = ", ".join(f"{label} {harness.fmt(efficiency(result, runs, impl, n), '.0%')}"
                               for impl, label in labels)
            notes.append(f"scaling efficiency, samples/s ÷ ({n} × one rank alone with no "
                         f"communication, {solo['samples_per_s']:.1f} samples/s): {shares}")
            notes.append(f"the machine's own bound: {n} ranks at once, each computing alone "
                         "with nothing exchanged, "
                         f"{harness.fmt(machine_bound(result, n), '.0%')}")
        elif solo:
            notes.append(f"one rank alone: failed: {solo['error']}")
        what = "FSDP2 training" if fsdp else "training"
        out.append({"title": f"{what}, {n} ranks: MLP of {params / 1e6:.1f} M parameters, "
                             f"batch {result['batch']} per rank, {result['steps']} steps",
                    "headers": ["implementation", "samples/s", "ms/step", "final loss"],
                    "rows": rows, "notes": notes})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: 5 steps")
    p.add_argument("--steps", type=int, help="timed steps (default 40, --quick 5)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 on perseus against gloo")
    a = p.parse_args(argv)
    steps = a.steps or (5 if a.quick else 40)
    result = run(a.ranks, steps, a.batch, a.timeout, fsdp=a.fsdp)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

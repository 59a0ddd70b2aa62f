"""The effect of each PERSEUS_* performance switch, measured.

    python benchmarks/switches.py [--quick] [--steps 40] [--size 64M] [--optimizer sgd|adam]
                                  [--json PATH]

Training: the communication-bound MLP of training.py on 2 ranks, once per switch
setting, each against PERSEUS_ALLREDUCE_DTYPE=1 (float32 gradients, nothing else set) as
the baseline: samples/s, its ratio to the baseline, and the payload bytes each rank sent
per step (the engine's counters). Across hosts: one gradient allreduce of SIZE float32 on
two loopback "hosts" of two ranks each (perseusrun -H 127.0.0.1:2,127.0.0.2:2: shared
memory within a host, TCP between), flat against hierarchical and float32 against float16
between hosts: time and the bytes each rank sent between and within hosts per call. The
two "hosts" share this machine's cores, so these times show the algorithms' cost here,
not a real network; the bytes are what a real network would carry. Streams: the same
allreduce between two loopback "hosts" of one rank each (TCP only) with
PERSEUS_ALLREDUCE_STREAMS=1, 2 and 4, and the share of the bytes the extra streams carried.
Negotiation: small_ops.py's 100 asynchronous 4 KiB allreduces through perseus.torch.horovod,
2 ranks, PERSEUS_OFFLINE_NEG=0 and 1, with the negotiation messages each rank sent and the
tensors it ran without asking over the whole run. --part runs some sections only;
--optimizer adam trains with Adam (a costlier step, which PERSEUS_OVERLAP_BACKWARD_AND_STEP
may hide behind communication) instead of SGD with momentum.
"""

import harness
import training

BASE = {"PERSEUS_ALLREDUCE_DTYPE": "1"}
TRAINING = [
    ("baseline: PERSEUS_ALLREDUCE_DTYPE=1", {}),
    ("PERSEUS_ALLREDUCE_DTYPE=0", {"PERSEUS_ALLREDUCE_DTYPE": "0"}),
    ("PERSEUS_ACCUMULATE_N_STEPS=2", {"PERSEUS_ACCUMULATE_N_STEPS": "2"}),
    ("PERSEUS_ALLREDUCE_FUSION=4", {"PERSEUS_ALLREDUCE_FUSION": "4"}),
    ("PERSEUS_ALLREDUCE_FUSION=0 (no fusion)", {"PERSEUS_ALLREDUCE_FUSION": "0"}),
    ("PERSEUS_OFFLINE_NEG=1", {"PERSEUS_OFFLINE_NEG": "1"}),
    ("PERSEUS_DOWNSAMPLE_N_ELEMENTS=4", {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4"}),
    ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1", {"PERSEUS_OVERLAP_BACKWARD_AND_STEP": "1"}),
    ("PERSEUS_DGC=1 (ratio 0.001, float16 values, int32 indices)",
     {"PERSEUS_DGC": "1", "PERSEUS_DGC_FP16_VALUES": "1", "PERSEUS_DGC_INT32_INDICES": "1"}),
    ("HOROVOD_AUTOTUNE=1 (after tuning: 1 warmup and 10 samples of 3 steps)",
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
      "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "10",
      "HOROVOD_AUTOTUNE_LOG": training.AUTOTUNE_LOG}),
]
# Untimed steps before an autotuned run is timed: enough for its tuning to end
# (1 + 11 samples of 3 steps, a step more after each change).
AUTOTUNE_WARMUP_STEPS = 50
HOSTS = "127.0.0.1:2,127.0.0.2:2"
ACROSS = [
    ("flat, float32", {"PERSEUS_ALLREDUCE_MODE": "0", "PERSEUS_ALLREDUCE_DTYPE": "1"}),
    ("hierarchical, float32", {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "1"}),
    ("flat, float16 between hosts",
     {"PERSEUS_ALLREDUCE_MODE": "0", "PERSEUS_ALLREDUCE_DTYPE": "2"}),
    ("hierarchical, float16 between hosts",
     {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "2"}),
    ("hierarchical, float16 everywhere",
     {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "0"}),
]

TWO_HOSTS = "127.0.0.1:1,127.0.0.2:1"
STREAMS = [(f"PERSEUS_ALLREDUCE_STREAMS={k}", {"PERSEUS_ALLREDUCE_STREAMS": str(k)})
           for k in (1, 2, 4)]
NEGOTIATION = [(f"PERSEUS_OFFLINE_NEG={k}", {"PERSEUS_OFFLINE_NEG": str(k)}) for k in (0, 1)]
PARTS = ("training", "across", "streams", "negotiation")
COUNTED = ("bytes_inter_host", "bytes_intra_host", "bytes_extra_streams")


def body(comm, opts):
    """One rank of the across-hosts and streams jobs: gradient allreduces of opts["size"]
    bytes; of the negotiation job: small_ops.py's async100."""
    import torch

    if comm.impl == "hvd":
        import small_ops

        keys = ("negotiation_messages", "negotiations_skipped")
        before = comm.hvd.counters()
        res = small_ops.bench_async100(comm, opts["timing"])
        after = comm.hvd.counters()
        return {**res, **{k: after[k] - before[k] for k in keys}}

    core = comm.core
    t = torch.full((opts["size"] // 4,), 0.5, dtype=torch.float32)
    cap = t.__dlpack__()

    def fn():
        comm.finish(core.allreduce(cap, cap, "grad", core.OP_SUM, 1.0, 1.0, 0, True))

    fn()
    before = core.counters()
    fn()
    after = core.counters()
    sent = {k: after[k] - before[k] for k in COUNTED}
    return {**harness.measure(comm, fn, **opts["timing"]), **sent}


def _run(label, script, impl, n, opts, env, timeout, hosts=None):
    try:
        return harness.launch(script, impl, n, opts, env=dict(BASE, **env), timeout=timeout,
                              hosts=hosts)
    except harness.JobFailed as e:
        print(f"[bench] {label}: {e}", flush=True)
        return {"error": str(e).splitlines()[0]}


def run(steps=40, size=64 << 20, quick=False, timeout=600, echo=True, parts=PARTS,
        optimizer="sgd"):
    """Driver: every training variant, every across-hosts variant, every stream count."""
    timing = {"warmup": 1, "min_iters": 3, "max_iters": 5 if quick else 30,
              "budget": 0.2 if quick else 3.0}
    result = {"steps": steps, "batch": 16, "size": size, "hosts": HOSTS, "training": {},
              "across": {}, "streams": {}, "optimizer": optimizer}
    for label, env in TRAINING if "training" in parts else []:
        if optimizer != "sgd" and "PERSEUS_DGC" in env:
            continue  # DGC takes SGD only
        opts = {"steps": steps, "batch": 16, "optimizer": optimizer}
        if "HOROVOD_AUTOTUNE" in env:
            opts["warmup"] = AUTOTUNE_WARMUP_STEPS
        result["training"][label] = _run(label, training.__file__, "hvd", 2, opts, env,
                                         timeout)
    for label, env in ACROSS if "across" in parts else []:
        result["across"][label] = _run(label, __file__, "core", 4,
                                       {"size": size, "timing": timing}, env, timeout, HOSTS)
    for label, env in STREAMS if "streams" in parts else []:
        result["streams"][label] = _run(label, __file__, "core", 2,
                                        {"size": size, "timing": timing}, env, timeout,
                                        TWO_HOSTS)
    small = {"warmup": 3, "min_iters": 5, "max_iters": 20 if quick else 200,
             "budget": 0.1 if quick else 1.0}
    for label, env in NEGOTIATION if "negotiation" in parts else []:
        result.setdefault("negotiation", {})[label] = _run(label, __file__, "hvd", 2,
                                                           {"timing": small}, env, timeout)
    if echo:
        print(harness.text_sections(sections(result)), flush=True)
    return result


def mib(nbytes):
    return f"{nbytes / 2**20:.2f} MiB"


def _against_first(runs, base_label, row_of):
    """Table rows for runs compared with the run named ``base_label``: ``row_of(res,
    speedup)`` gives a row's cells after its label; failed runs get dashes and a note."""
    rows, notes = [], []
    base = runs.get(base_label)
    base_ms = None if base is None or harness.failed(base) else base[0]["median"]
    for label, res in runs.items():
        if harness.failed(res):
            rows.append([label, "failed", "-", "-", "-"])
            notes.append(f"{label}: {res['error']}")
            continue
        speedup = harness.fmt(base_ms / res[0]["median"] if base_ms else None, ".2f") + "×"
        rows.append([label, *row_of(res, speedup)])
    return rows, notes


def sections(result):
    rows, notes = [], []
    runs = result["training"]
    base = runs.get(TRAINING[0][0])
    base_sps = None if base is None or harness.failed(base) else base[0]["samples_per_s"]
    for label, res in runs.items():
        if harness.failed(res):
            rows.append([label, "failed", "-", "-"])
            notes.append(f"{label}: {res['error']}")
            continue
        r = res[0]
        if "autotune" in r:
            notes.append(f"{label}: {r['autotune']}")
        ratio = r["samples_per_s"] / base_sps if base_sps else None
        rows.append([label, f"{r['samples_per_s']:.1f}", harness.fmt(ratio, ".2f") + "×",
                     mib(r.get("bytes_per_step", 0))])
    optimizer = {"sgd": "", "adam": ", Adam"}[result.get("optimizer", "sgd")]
    title = (f"training, 2 ranks, one host: the MLP of training.py, batch {result['batch']} "
             f"per rank, {result['steps']} steps{optimizer}, per switch")
    out = [] if not runs else [{"title": title,
            "headers": ["setting", "samples/s", "÷ baseline", "bytes sent per rank and step"],
            "rows": rows, "notes": notes}]
    rows, notes = [], []
    for label, res in result["across"].items():
        if harness.failed(res):
            rows.append([label, "failed", "-", "-"])
            notes.append(f"{label}: {res['error']}")
            continue
        inter = sum(r["bytes_inter_host"] for r in res) / len(res)
        intra = sum(r["bytes_intra_host"] for r in res) / len(res)
        rows.append([label, f"{res[0]['median'] * 1e3:.1f}", mib(inter), mib(intra)])
    if rows:
        out.append({"title": f"one gradient allreduce of {harness.human(result['size'])} "
                             f"float32 on two loopback hosts of two ranks ({result['hosts']})",
                    "headers": ["setting", "ms", "bytes between hosts per rank",
                                "bytes within a host per rank"],
                    "rows": rows, "notes": notes})
    def streams_row(res, speedup):
        ms, sent = res[0]["median"], res[0]["bytes_inter_host"]
        gbs = result["size"] / ms / 1e9  # busbw = algbw x 2(n-1)/n = algbw at 2 ranks
        return [f"{ms * 1e3:.1f}", f"{gbs:.2f}", speedup,
                f"{res[0]['bytes_extra_streams'] / sent:.0%}" if sent else "-"]

    rows, notes = _against_first(result.get("streams", {}), STREAMS[0][0], streams_row)
    if rows:
        out.append({"title": f"one allreduce of {harness.human(result['size'])} float32 "
                             f"between two loopback hosts of one rank ({TWO_HOSTS}), TCP",
                    "headers": ["setting", "ms", "busbw GB/s", "speed-up", "bytes on streams 2.."],
                    "rows": rows, "notes": notes})
    def negotiation_row(res, speedup):
        return [f"{res[0]['median'] * 1e3:.3f}", speedup,
                str(res[-1]["negotiation_messages"]), str(res[-1]["negotiations_skipped"])]

    rows, notes = _against_first(result.get("negotiation", {}), NEGOTIATION[0][0],
                                 negotiation_row)
    if rows:
        out.append({"title": "100 async 4 KiB allreduces (small_ops.py async100), 2 ranks, "
                             "one host, per PERSEUS_OFFLINE_NEG",
                    "headers": ["setting", "median ms", "speed-up",
                                "negotiation messages (rank 1, whole run)",
                                "tensors run without asking (rank 1)"],
                    "rows": rows, "notes": notes})
    return out


def main(argv=None):
    if harness.is_worker(argv):
        return harness.worker_main(body, argv)
    p = harness.driver_parser(__doc__, "smoke run: 5 steps, 1 MiB, few iterations",
                              ranks=None)
    p.add_argument("--steps", type=int, help="timed training steps (default 40, --quick 5)")
    p.add_argument("--size", type=harness.parse_size, help="allreduce bytes (default 64M)")
    p.add_argument("--part", choices=PARTS, action="append",
                   help="run this section only (repeatable; default all)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="the training section's optimizer (default sgd; DGC takes SGD only)")
    a = p.parse_args(argv)
    steps = a.steps or (5 if a.quick else 40)
    size = a.size or ((1 << 20) if a.quick else (64 << 20))
    result = run(steps, size, a.quick, a.timeout, parts=a.part or PARTS,
                 optimizer=a.optimizer)
    harness.finish(result, a.json)


if __name__ == "__main__":
    main()

"""Training across a slow link: the gradient switches where the network is the bottleneck.

    python benchmarks/slow_link.py [--rate 1gbit] [--steps 20] [--batch 16]
                                   [--optimizer sgd|adam] [--json PATH]

Two network namespaces on this machine, one rank in each, joined by a bridge whose port
into each namespace passes at most RATE (a tc token bucket): two hosts with a RATE link,
both directions at once. The job is training.py's communication-bound MLP (25.2 M
float32 parameters, SGD with momentum) under hvd.DistributedOptimizer, started by
perseusrun with ``--rsh 'ip netns exec {host}'``, once per setting: float32 gradients
between the hosts (PERSEUS_ALLREDUCE_DTYPE=1, the baseline), the default (float16
between hosts), the step overlapped with the reductions
(PERSEUS_OVERLAP_BACKWARD_AND_STEP=1, float32), and DGC (PERSEUS_DGC=1 at ratio 0.001
with float16 values and int32 indices); and the peer, torch DistributedDataParallel on
gloo with one process in each namespace. ``--optimizer adam`` trains with Adam instead
(a costlier step for the overlap to hide; DGC, which takes SGD only, is left out).
Reported: samples/s, the ratio to the baseline, the bytes a Perseus rank sent per step
(the engine's counters) and the final loss. Needs root, iproute2 and tc
(tests/python/_netns.py).
"""

import os
import sys

import harness
import training

sys.path.insert(0, os.path.join(harness.ROOT, "tests", "python"))
import _netns  # the namespace helper shared with the tests

SETTINGS = [
    ("float32 between hosts (PERSEUS_ALLREDUCE_DTYPE=1)", {"PERSEUS_ALLREDUCE_DTYPE": "1"}),
    ("default: float16 between hosts", {}),
    ("PERSEUS_OVERLAP_BACKWARD_AND_STEP=1 (float32 between hosts)",
     {"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_OVERLAP_BACKWARD_AND_STEP": "1"}),
    ("PERSEUS_DGC=1 (ratio 0.001, float16 values, int32 indices)",
     {"PERSEUS_DGC": "1", "PERSEUS_DGC_FP16_VALUES": "1", "PERSEUS_DGC_INT32_INDICES": "1"}),
]
PEER = ("torch DDP on gloo (the peer)", None)


def run(rate="1gbit", steps=20, batch=16, timeout=600, echo=True, optimizer="sgd"):
    result = {"rate": rate, "steps": steps, "batch": batch, "optimizer": optimizer,
              "runs": {}}
    net = _netns.NamespaceHosts(2)
    try:
        net.create()
        net.check_reachable()
        net.shape(rate)
        hosts = ",".join(f"{h}:1" for h in net.hosts)
        places = [([_netns.IP, "netns", "exec", h], h) for h in net.hosts]
        for label, env in SETTINGS + [PEER]:
            if optimizer != "sgd" and env is not None and "PERSEUS_DGC" in env:
                continue
            if env is None:  # the peer: DDP on gloo, one process in each namespace
                impl, env, where = "gloo", {"GLOO_SOCKET_IFNAME": "eth0"}, {"places": places}
            else:
                impl, where = "hvd", {"hosts": hosts}
                env = dict(env, PERSEUS_RSH=f"{_netns.IP} netns exec {{host}}")
            try:
                res = harness.launch(training.__file__, impl, 2,
                                     {"steps": steps, "batch": batch,
                                      "optimizer": optimizer}, env=env,
                                     timeout=timeout, **where)
            except harness.JobFailed as e:
                res = {"error": str(e).splitlines()[0]}
            result["runs"][label] = res
            if echo:
                print(f"[bench] slow_link {label}: "
                      f"{res['error'] if harness.failed(res) else res[0]['samples_per_s']}",
                      file=sys.stderr, flush=True)
    finally:
        net.destroy()
    return result


def sections(result):
    runs = result["runs"]
    base = runs.get(SETTINGS[0][0])
    rows, notes = [], []
    for label, _ in SETTINGS + [PEER]:
        res = runs.get(label)
        if res is None:
            continue
        if harness.failed(res):
            rows.append([label, "failed", "-", "-", "-"])
            notes.append(f"{label}: {res['error']}")
            continue
        r = res[0]
        ratio = (r["samples_per_s"] / base[0]["samples_per_s"]
                 if base is not None and not harness.failed(base) else None)
        sent = f"{r['bytes_per_step'] / 2**20:.2f} MiB" if "bytes_per_step" in r else "-"
        rows.append([label, f"{r['samples_per_s']:.1f}", f"{harness.fmt(ratio, '.2f')}×",
                     sent, f"{r['final_loss']:.4f}"])
    return [{"title": f"training across a {result['rate']} link, 2 hosts of one rank: the MLP "
                      f"of training.py, batch {result['batch']} per rank, "
                      f"{result['steps']} steps"
                      + {"sgd": "", "adam": ", Adam"}[result.get("optimizer", "sgd")],
             "headers": ["setting", "samples/s", "÷ float32", "bytes sent per rank and step",
                         "final loss"],
             "rows": rows, "notes": notes}]


def main(argv=None):
    p = harness.driver_parser(__doc__, "smoke run: 3 steps", ranks=None)
    p.add_argument("--rate", default="1gbit", help="the link's rate, as tc writes it")
    p.add_argument("--steps", type=int, help="timed steps (default 20, --quick 3)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="the optimizer (default sgd; adam leaves DGC out)")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("slow_link.py makes network namespaces, which needs root")
    result = run(a.rate, a.steps or (3 if a.quick else 20), a.batch, a.timeout,
                 optimizer=a.optimizer)
    print(harness.text_sections(sections(result)))
    harness.finish(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

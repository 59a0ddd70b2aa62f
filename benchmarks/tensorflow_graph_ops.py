"""What one collective costs in a tf.compat.v1 session: the path sessions take (the body
on a thread of its own, so no session can hang) beside a plain blocking
``tf.py_function`` (the path before it, which hangs once a step holds more independent
collectives than the session has inter-op threads, and which tf.functions called from
eager code still take), in the same run.

    bash scripts/setup-venv.sh tensorflow      # prints the venv; then, with it on PATH:
    python benchmarks/tensorflow_graph_ops.py [--ranks 2] [--ops 40] [--steps 30]

Each side runs in one ``perseusrun`` job: a tf.compat.v1 session with 64 inter-op threads
(enough for the plain path at this many collectives) runs steps of ``--ops`` independent
allreduces of 256 float32s, then steps of one allreduce, back to back. Prints the median
time per step over ``--steps`` steps (the slowest rank's) and per collective, and the
ratio threaded ÷ plain.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PATHS = ("plain", "threaded")


def worker(path, ops, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import perseus.tensorflow.horovod as hvd
    import tensorflow as tf
    from perseus.tensorflow.horovod import bridge

    if path == "plain":
        # The path before: the body blocks the inter-op thread that runs it.
        bridge._off_the_inter_op_threads = bridge._blocking_op
    hvd.init()

    def timed(run):
        """Each step's time on this rank, steps back to back as in training."""
        for _ in range(3):
            run()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return times

    result = {}
    for count in (ops, 1):
        with tf.Graph().as_default():
            outs = [hvd.allreduce(tf.fill([256], float(i))) for i in range(count)]
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=64)
            with tf.compat.v1.Session(config=config) as session:
                result[f"session, {count} per step"] = (timed(lambda o=outs: session.run(o)),
                                                        count)
    for case, (times, count) in result.items():
        # The median of the slowest rank's time of each step.
        slowest = hvd.allreduce(tf.constant(times, tf.float64), op=hvd.Max).numpy()
        result[case] = (float(statistics.median(slowest)), count)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def job(path, ranks, ops, steps):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", str(ranks), sys.executable,
           os.path.abspath(__file__), "--worker", path, "--ops", str(ops), "--steps",
           str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    sys.exit(f"the {path} job failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ops", type=int, default=40)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--worker", choices=PATHS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.ops, a.steps)
    results = {path: job(path, a.ranks, a.ops, a.steps) for path in PATHS}
    print(f"{a.ranks} ranks, {a.steps} steps, median step (the slowest rank's):")
    print("| graph | plain py_function: ms a step (µs a collective) | threaded | "
          "threaded ÷ plain |")
    print("|---|---|---|---|")
    for case, (plain, count) in results["plain"].items():
        threaded = results["threaded"][case][0]
        print(f"| {case} | {plain * 1e3:.2f} ({plain / count * 1e6:.0f}) | "
              f"{threaded * 1e3:.2f} ({threaded / count * 1e6:.0f}) | "
              f"{threaded / plain:.2f} |")


if __name__ == "__main__":
    main()

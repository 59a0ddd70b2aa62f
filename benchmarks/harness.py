"""Shared pieces of the benchmarks: starting a job under each implementation, timing.

Each benchmark script runs in two roles: the *driver* (no arguments but options) starts
one job per implementation and rank count, one after the other, and collects the JSON
that rank 0 of each job writes; the *worker* (``--worker IMPL``) is one rank of a job.

Implementations:
  perseus   perseus._core directly (capsules in, no Python front-end)
  hvd       perseus.torch.horovod, the API users call
  gloo      torch.distributed with the gloo backend
  mpi       OpenMPI through mpi4py
"""

import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

IMPLS = ("perseus", "hvd", "gloo", "mpi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, impl, n, args, env=None, timeout=900):
    """Runs ``script --worker impl ARGS`` on ``n`` ranks; returns rank 0's JSON result."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    worker = [sys.executable, script, "--worker", impl, "--out", out, *args]
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    if impl in ("perseus", "hvd"):
        cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", str(n), *worker]
        procs = [subprocess.Popen(cmd, env=env)]
    elif impl == "mpi":
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n), *worker]
        procs = [subprocess.Popen(cmd, env=env)]
    else:
        port = str(free_port())
        procs = [
            subprocess.Popen(worker, env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                               RANK=str(r), WORLD_SIZE=str(n)))
            for r in range(n)
        ]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{impl} on {n} ranks failed with exit codes {codes}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


class Comm:
    """The few collective calls the benchmarks need, for one implementation."""

    def __init__(self, impl):
        self.impl = impl
        if impl == "mpi":
            from mpi4py import MPI

            self.mpi = MPI
            self.world = MPI.COMM_WORLD
            self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        elif impl == "gloo":
            import torch.distributed as dist

            self.dist = dist
            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            import perseus.torch.horovod as hvd

            self.hvd = hvd
            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()

    def barrier(self):
        """Waits for every rank."""
        if self.impl == "mpi":
            self.world.Barrier()
        elif self.impl == "gloo":
            self.dist.barrier()
        else:
            self.hvd.barrier()

    def max_over_ranks(self, value):
        """The largest of one float per rank, known to every rank."""
        import torch

        if self.impl == "mpi":
            return self.world.allreduce(value, op=self.mpi.MAX)
        t = torch.tensor([float(value)])
        if self.impl == "gloo":
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            return float(t[0])
        return float(self.hvd.allreduce(t, op=self.hvd.Max, name="bench.max")[0])

    def close(self):
        """Leaves the job."""
        if self.impl == "gloo":
            self.dist.destroy_process_group()
        elif self.impl in ("perseus", "hvd"):
            self.hvd.shutdown()


def timed(comm, fn, min_iters=5, max_iters=200, budget=0.5, warmup=3):
    """Median seconds of ``fn()`` over iterations, each the slowest rank's time."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters
                                      or time.perf_counter() - start < budget):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times)


def busbw(nbytes, seconds, n):
    """Bus bandwidth in GB/s as nccl-tests defines it: algbw * 2(n-1)/n."""
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def drive(script, impls, ranks, args, name, report, env=None):
    """Runs ``script`` under each implementation for each rank count, prints
    ``report(n, results)`` per rank count, and saves everything as results/NAME.json."""
    if "--quick" in sys.argv:
        name += "-quick"  # a smoke run never replaces the numbers report.py publishes
    everything = {"machine": machine(), "command": " ".join(sys.argv), "runs": {}}
    for n in ranks:
        results = {i: launch(os.path.abspath(script), i, n, args, env) for i in impls}
        everything["runs"][str(n)] = results
        print(report(n, results), flush=True)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json"), "w") as f:
        json.dump(everything, f, indent=1)


def peak_rss_mib():
    """This process's peak resident set size, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib():
    """This process's current resident set size, MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_result(path, comm, result):
    """Rank 0 writes ``result`` as JSON."""
    if comm.rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)


def machine():
    """One line about the machine the numbers come from."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {model}, {time.strftime('%Y-%m-%d')}"

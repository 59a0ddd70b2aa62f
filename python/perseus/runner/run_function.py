"""``perseus.run``: Horovod's ``horovod.run``, a Python function run as a Perseus job.

    import perseus

    def train(lr):
        import perseus.torch.horovod as hvd
        hvd.init()
        ...
        return hvd.rank()

    results = perseus.run(train, args=(0.1,), np=2)   # [0, 1]: one per rank, by rank

perseusrun's own launcher starts ``np`` ranks, on the hosts given as perseusrun takes
them, each running perseus.runner.run_task: the function and its arguments travel
pickled through the job's rendezvous store, and so do the results. With cloudpickle
installed, functions of a notebook or of the main script go by value; without it they
go by reference, which works for functions of importable modules and of a main script
whose top level is guarded by ``if __name__ == "__main__":`` (multiprocessing's
rule).
"""

import pickle
import sys

from perseus.runner import hosts as _hosts
from perseus.runner import launch as _launch
from perseus.runner import run_task as _task
from perseus.runner.run_task import FUNC_KEY, by_value, dumps, get_blob, put_blob, result_key


def _script():
    """The driver's main script, when it is a file the ranks can run again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path if path and path.endswith(".py") else None


def _payload(func, args, kwargs):
    try:
        call = dumps((func, tuple(args), dict(kwargs or {})))
    except Exception as e:  # noqa: BLE001 - pickling errors come in many types
        raise ValueError(f"perseus.run cannot send {func!r} and its arguments to the ranks: "
                         f"{e}; install cloudpickle to send lambdas and nested functions, or "
                         "pass a function defined at the top level of a module") from None
    module = getattr(func, "__module__", None)
    script = _script()
    if module == "__main__" and not by_value() and script is None:
        raise ValueError(f"perseus.run cannot send {func.__qualname__}, defined in __main__ "
                         "without a script file (a notebook or an interactive session): "
                         "install cloudpickle, or define it in a module")
    return pickle.dumps({"call": call, "main": script, "sys_path": list(sys.path)})


def _argv(np, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file,
          output_filename, verbose, network_interface, executable, elastic_flags):
    argv = [] if np is None else ["-np", str(np)]
    for flag, value in (*elastic_flags.items(), ("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("--ssh-port", ssh_port),
                        ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            argv += [flag, *map(str, value if isinstance(value, tuple) else (value,))]
    if verbose:
        argv.append("--verbose")
    return argv + ["--", executable or sys.executable, "-m", "perseus.runner.run_task"]


def _elastic_flags(min_np, max_np, discovery, slots, reset_limit, cooldown, timeout):
    """perseusrun's elastic flags, ``{flag: value}``; empty for a fixed-size job."""
    flags = {"--min-np": min_np, "--max-np": max_np, "--host-discovery-script": discovery,
             "--slots": slots, "--reset-limit": reset_limit,
             "--elastic-timeout": timeout}
    flags = {k: v for k, v in flags.items() if v is not None}
    if cooldown is not None:
        try:
            low, high = cooldown
        except (TypeError, ValueError):
            raise ValueError(f"perseus.run: cooldown_range is (min, max) seconds, got "
                             f"{cooldown!r}") from None
        flags["--blacklist-cooldown-range"] = (low, high)
    return flags


def _plural(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _failure(status, failed, outcomes, size):
    """The RuntimeError of a job that did not return a result on every rank: the rank
    that failed first, the traceback of each rank whose function raised, and the ranks
    stopped before they reported."""
    first = f"exit status {status}"
    if failed is not None:
        rank, how = failed
        first += f"): rank {rank} failed first, with {how}"
        first += "" if rank in outcomes else ", before it reported"
    else:
        first += ")"
    lines = [f"perseus.run: the job failed ({first}"]
    for r in range(size):
        if outcomes.get(r, ("",))[0] == "error":
            lines.append(f"rank {r} raised:\n{outcomes[r][1].rstrip()}")
    stopped = [r for r in range(size) if r not in outcomes
               and (failed is None or r != failed[0])]
    if stopped:
        lines.append(f"{_plural(stopped)} returned nothing: stopped with the job before "
                     f"{'they' if len(stopped) > 1 else 'it'} finished")
    return RuntimeError("\n".join(lines))


def _loads(data):
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - unpickling fails in many ways
        return ("error", f"its result cannot be unpickled here: {e!r}")


def _worker_reports(server):
    """The elastic workers' reports: ``{worker id: (round, rank, outcome)}``."""
    reports, prefix = {}, _task.WORKER_PREFIX
    published = server.keys()  # the store's sorted keys (not a dict)
    for key in published:
        if key.startswith(prefix) and key.endswith("/parts"):
            wid = key[len(prefix):-len("/parts")]
            report = pickle.loads(get_blob(server.get, _task.worker_key(wid)))
            reports[wid] = (report["round"], report["rank"], _loads(report["outcome"]))
    return reports


def _elastic_results(status, why, reports):
    """What the ranks of the last round returned, by rank; RuntimeError when the job
    failed (``why``: the launcher's reason, if it stopped the job) or a rank of that
    round returned nothing."""
    done = {wid: r for wid, r in reports.items() if r[2][0] == "ok" and r[1] is not None}
    last = max((r[0] for r in done.values()), default=None)
    final = dict(sorted((rank, out[1]) for rnd, rank, out in done.values() if rnd == last))
    if status == 0 and final and list(final) == list(range(len(final))):
        return list(final.values())
    if status == 0:
        problem = ("no worker returned a result" if not final else
                   f"the ranks of its last round ({last}) that returned are "
                   f"{', '.join(map(str, final))}: not ranks 0 to {max(final)}")
        lines = [f"perseus.run: the elastic job ended, but {problem}"]
    else:
        lines = [f"perseus.run: the elastic job failed (exit status {status}): "
                 + (why or "a worker failed after another had ended with success")]
    for wid, (rnd, rank, out) in sorted(reports.items()):
        if out[0] == "error":
            where = "" if rank is None else f", rank {rank} of round {rnd}"
            lines.append(f"worker {wid}{where} raised:\n{out[1].rstrip()}")
    return RuntimeError("\n".join(lines))


def run(func, args=(), kwargs=None, num_proc=None, np=None, hosts=None, hostfile=None,
        start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None,
        output_filename=None, verbose=None, use_gloo=None, use_mpi=None,
        network_interface=None, executable=None, mpi_args=None, min_num_proc=None,
        min_np=None, max_num_proc=None, max_np=None, slots=None, reset_limit=None,
        cooldown_range=None, host_discovery_script=None, elastic_timeout=None):
    """Run ``func(*args, **kwargs)`` on every rank of a new job; returns the list of what
    it returned, indexed by rank (Horovod's ``horovod.run``).

    ``np`` (or ``num_proc``) ranks are placed on ``hosts`` ("host1:2,host2:2") or the
    hosts of ``hostfile`` as perseusrun places them (default: this machine).
    ``start_timeout``, ``ssh_port``, ``ssh_identity_file``, ``output_filename``,
    ``verbose``, ``network_interface`` are perseusrun's flags; ``executable`` is the
    Python the ranks run (default: this one). The function calls ``hvd.init()`` itself.

    Raises ``RuntimeError`` when a rank fails, with the traceback of each rank whose
    function raised; ``ValueError`` naming the cause for arguments perseusrun refuses or
    a job that cannot start (no mpirun for ``use_mpi=True``); never ``SystemExit``.
    ``use_mpi=True`` starts the ranks through mpirun, as ``perseusrun --mpi``, with
    ``mpi_args`` added to its command line. Otherwise (``use_gloo`` True, False or
    None, ``use_mpi`` unset or False) Perseus's own launcher starts them, as
    perseusrun's default: Horovod's choice when ``use_gloo=False`` is "MPI if built,
    else Gloo", and Perseus's traffic never needs MPI. ``use_gloo=True`` with
    ``use_mpi=True`` is a ``ValueError``, as in Horovod. ``disable_cache`` is accepted
    and has no effect.

    ``min_np`` (``min_num_proc``), ``max_np`` (``max_num_proc``) or
    ``host_discovery_script`` make the job elastic, and ``slots``, ``reset_limit``,
    ``cooldown_range`` (``(min, max)`` seconds) and ``elastic_timeout`` tune it, as
    perseusrun's flags of those names do: workers that fail are left behind and the
    others go on (the function uses ``hvd.elastic.run``). The result is then what the
    function returned on each rank of the job's last round, by rank.
    """
    del disable_cache
    if not callable(func):
        raise TypeError(f"perseus.run needs a function to run, got {type(func).__name__}")
    if use_mpi and use_gloo:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    mpi = bool(use_mpi)  # use_gloo=False alone: Horovod's "choose", here Perseus's launcher
    if mpi_args is not None and not mpi:
        raise ValueError("perseus.run: mpi_args go with use_mpi=True")
    np = np if np is not None else num_proc
    min_np = min_np if min_np is not None else min_num_proc
    max_np = max_np if max_np is not None else max_num_proc
    flags = _elastic_flags(min_np, max_np, host_discovery_script, slots, reset_limit,
                           cooldown_range, elastic_timeout)
    # As perseusrun: these three turn elastic mode on; the other flags only tune it.
    elastic = (min_np, max_np, host_discovery_script) != (None, None, None)
    if elastic and mpi:
        raise ValueError("perseus.run: elastic jobs run with Perseus's own launcher, not "
                         "mpirun (use_mpi)")
    if (np is not None or not elastic) and (
            isinstance(np, bool) or not isinstance(np, int) or np < 1):
        raise ValueError(f"perseus.run needs np, a number of ranks >= 1, got {np!r}")
    argv = _argv(np, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file,
                 output_filename, verbose, network_interface, executable, flags)
    if mpi:
        argv[:0] = ["--mpi"] + ([f"--mpi-args={mpi_args}"] if mpi_args else [])
    try:
        parsed = _launch.parse_args(argv, raise_errors=True)
    except _launch.UsageError as e:
        raise ValueError(f"perseus.run: perseusrun refuses these arguments: {e}") from None
    listed = None if elastic else _launch.host_list(parsed)
    placed = None if elastic else _hosts.place(listed, np)
    payload = _payload(func, args, kwargs)
    outcomes, failure = {}, []

    def exchange(server):
        put_blob(server.set, FUNC_KEY, payload)

        def collect(_status, failed):
            failure.append(failed)
            # Classes of the main script come back as the ranks named it.
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
            if elastic:
                outcomes.update(_worker_reports(server))
                return
            for r in range(np):
                data = get_blob(server.get, result_key(r))
                if data is not None:
                    outcomes[r] = _loads(data)
        return collect

    try:
        if elastic:
            status = _launch.run_elastic(parsed, _hosts.local_names(), exchange=exchange)
        elif mpi:
            status = _launch.run_mpi(parsed, listed, placed, exchange=exchange)
        else:
            status = _launch.run_gloo(parsed, placed, _hosts.local_names(), exchange=exchange)
    except _launch.LaunchError as e:
        how = " (use_mpi=True, which is perseusrun --mpi)" if mpi else ""
        raise ValueError(f"perseus.run{how}: the job cannot start: {e}") from None
    if elastic:
        result = _elastic_results(status, failure[0] if failure else None, outcomes)
        if isinstance(result, RuntimeError):
            raise result
        return result
    if status != 0 or len(outcomes) < np or any(o[0] != "ok" for o in outcomes.values()):
        raise _failure(status, failure[0] if failure else None, outcomes, np)
    return [outcomes[r][1] for r in range(np)]

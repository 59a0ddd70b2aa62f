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
          output_filename, verbose, network_interface, executable):
    argv = ["-np", str(np)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("--ssh-port", ssh_port),
                        ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            argv += [flag, str(value)]
    if verbose:
        argv.append("--verbose")
    return argv + ["--", executable or sys.executable, "-m", "perseus.runner.run_task"]


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


def run(func, args=(), kwargs=None, num_proc=None, np=None, hosts=None, hostfile=None,
        start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None,
        output_filename=None, verbose=None, use_gloo=None, use_mpi=None,
        network_interface=None, executable=None, mpi_args=None, min_num_proc=None,
        min_np=None, max_num_proc=None, max_np=None, slots=None, reset_limit=None,
        cooldown_range=None):
    """Run ``func(*args, **kwargs)`` on every rank of a new job; returns the list of what
    it returned, indexed by rank (Horovod's ``horovod.run``).

    ``np`` (or ``num_proc``) ranks are placed on ``hosts`` ("host1:2,host2:2") or the
    hosts of ``hostfile`` as perseusrun places them (default: this machine).
    ``start_timeout``, ``ssh_port``, ``ssh_identity_file``, ``output_filename``,
    ``verbose``, ``network_interface`` are perseusrun's flags; ``executable`` is the
    Python the ranks run (default: this one). The function calls ``hvd.init()`` itself.

    Raises ``RuntimeError`` when a rank fails, with the traceback of each rank whose
    function raised; ``ValueError`` for arguments perseusrun refuses. ``use_mpi=True``
    (or ``use_gloo=False``) starts the ranks through mpirun, as ``perseusrun --mpi``,
    with ``mpi_args`` added to its command line. Elastic jobs (``min_np``, ``max_np``,
    ``slots``, ``reset_limit``, ``cooldown_range``) start from a script with
    ``perseusrun --min-np ...``: refused here. ``disable_cache`` is accepted and has no
    effect.
    """
    del disable_cache
    if not callable(func):
        raise TypeError(f"perseus.run needs a function to run, got {type(func).__name__}")
    if use_mpi and use_gloo:
        raise ValueError("perseus.run takes use_gloo or use_mpi, not both")
    mpi = bool(use_mpi) or (use_gloo is False)
    if mpi_args is not None and not mpi:
        raise ValueError("perseus.run: mpi_args go with use_mpi=True")
    elastic = (min_num_proc, min_np, max_num_proc, max_np, slots, reset_limit, cooldown_range)
    if elastic != (None,) * len(elastic):
        raise ValueError("perseus.run starts fixed-size jobs; elastic jobs start from a "
                         "script with perseusrun --min-np/--max-np (docs/elastic.md)")
    np = np if np is not None else num_proc
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"perseus.run needs np, a number of ranks >= 1, got {np!r}")
    argv = _argv(np, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file,
                 output_filename, verbose, network_interface, executable)
    if mpi:
        argv[:0] = ["--mpi"] + ([f"--mpi-args={mpi_args}"] if mpi_args else [])
    try:
        parsed = _launch.parse_args(argv)
        listed = _launch.host_list(parsed)
        placed = _hosts.place(listed, np)
    except SystemExit:
        raise ValueError("perseus.run: perseusrun refused these arguments (its message is "
                         "above)") from None
    payload = _payload(func, args, kwargs)
    outcomes, failure = {}, []

    def exchange(server):
        put_blob(server.set, FUNC_KEY, payload)

        def collect(_status, failed):
            failure.append(failed)
            # Classes of the main script come back as the ranks named it.
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
            for r in range(np):
                data = get_blob(server.get, result_key(r))
                if data is None:
                    continue
                try:
                    outcomes[r] = pickle.loads(data)
                except Exception as e:  # noqa: BLE001 - unpickling fails in many ways
                    outcomes[r] = ("error", f"its result cannot be unpickled here: {e!r}")
        return collect

    if mpi:
        status = _launch.run_mpi(parsed, listed, placed, exchange=exchange)
    else:
        status = _launch.run_gloo(parsed, placed, _hosts.local_names(), exchange=exchange)
    if status != 0 or len(outcomes) < np or any(o[0] != "ok" for o in outcomes.values()):
        raise _failure(status, failure[0] if failure else None, outcomes, np)
    return [outcomes[r][1] for r in range(np)]

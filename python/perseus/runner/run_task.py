"""What each rank of a ``perseus.run`` job runs: ``python -m perseus.runner.run_task``.

The rank fetches the pickled function and its arguments from the job's rendezvous
store (perseusrun's, at ``PERSEUS_RENDEZVOUS_ADDR:PORT``), calls it, and publishes
what it returned, or the exception it raised with its traceback, under its rank.
A worker of an elastic job has no rank until it joins a round: it publishes under its
worker id, with the round and the rank it held when the function ended.
The driver (perseus.runner.run_function) reads them back when the job is done.
"""

import os
import pickle
import sys
import traceback
import types

from perseus.common import knobs
from perseus.runner.job import TASK_CHECKIN

# The store keeps entries up to 1 MiB: larger values travel in parts.
PART = 512 * 1024
FUNC_KEY = "perseus.run/func"
WORKER_PREFIX = "perseus.run/worker/"


def result_key(rank):
    """The key of rank ``rank``'s outcome."""
    return f"perseus.run/result/{rank}"


def worker_key(worker_id):
    """The key of an elastic worker's report: ``{"round", "rank", "outcome"}``, the
    outcome pickled as a rank's is."""
    return f"{WORKER_PREFIX}{worker_id}"


def put_blob(set_value, key, data):
    """Publishes ``data`` (bytes) under ``key`` in parts, through ``set_value(key, bytes)``;
    the count of parts goes last, so a reader that sees it finds every part."""
    parts = [data[i:i + PART] for i in range(0, len(data), PART)] or [b""]
    for i, part in enumerate(parts):
        set_value(f"{key}/{i}", part)
    set_value(f"{key}/parts", str(len(parts)).encode())


def get_blob(get_value, key):
    """The bytes :func:`put_blob` published under ``key``, through ``get_value(key)``;
    None when nothing was published."""
    count = get_value(f"{key}/parts")
    if count is None:
        return None
    return b"".join(get_value(f"{key}/{i}") for i in range(int(count)))


def by_value():
    """Whether functions travel by value: cloudpickle is installed."""
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        return False
    return True


def dumps(obj):
    """``obj`` pickled by value where cloudpickle is installed (functions of a notebook or
    of the main script), else by reference."""
    if by_value():
        import cloudpickle

        return cloudpickle.dumps(obj)
    return pickle.dumps(obj)


def _adopt_main(path):
    """Makes the driver's main script importable as ``__main__`` here, so functions it
    defines unpickle (multiprocessing's spawn does the same): the script runs as a module
    named ``__mp_main__``, its ``if __name__ == "__main__":`` part skipped."""
    if not path or not os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = module
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - the driver's own script, as multiprocessing
    sys.modules["__main__"] = module


def _publisher(store):
    """``publish(data)``: puts this rank's pickled outcome where the driver looks."""
    if knobs.text("PERSEUS_ELASTIC") != "1":
        rank = int(knobs.text("PERSEUS_RANK"))
        # Checked in: the launcher's start timeout does not wait for the function's
        # hvd.init() (an elastic worker checks in by joining a round).
        store.set(f"{TASK_CHECKIN}{rank}", b"")
        return lambda data: put_blob(store.set, result_key(rank), data)

    def publish(data):
        from perseus.common import elastic

        rank = knobs.text("PERSEUS_RANK")  # set by each round the worker joins
        report = {"round": elastic.current_round(),
                  "rank": None if rank is None else int(rank), "outcome": data}
        put_blob(store.set, worker_key(knobs.text("PERSEUS_ELASTIC_ID")),
                 pickle.dumps(report))
    return publish


def main():
    from perseus import _core

    store = _core.RendezvousClient(*knobs.rendezvous(), 60.0)

    def get_value(key):
        return store.get(key, 60.0)

    publish = _publisher(store)
    try:
        sent = pickle.loads(get_blob(get_value, FUNC_KEY))
        sys.path += [p for p in sent["sys_path"] if p not in sys.path]
        _adopt_main(sent["main"])
        func, args, kwargs = pickle.loads(sent["call"])
        outcome = ("ok", func(*args, **kwargs))
        data = dumps(outcome)
    except BaseException as e:  # reported to the driver, then raised again
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        publish(pickle.dumps(("error", text)))
        raise
    publish(data)


if __name__ == "__main__":
    main()

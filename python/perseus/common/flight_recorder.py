"""The flight recorder's files: what each rank was doing when the job stopped moving.

Each rank's core keeps its last operations (``_core.flight_record()``: a ring of
1,024, with their submitted, negotiated and finished times and stage). A rank writes
them, with the stack of every Python thread, to ``<dir>/rank.<R>.json``:

- when perseusrun asks (``SIGUSR1`` to perseusrun, or rank 0 gave a stall warning): it
  publishes ``flight/dump/<k>`` at its rendezvous, and a thread of every rank
  (:func:`watch`) waits for that key;
- when one of the rank's collectives fails (at most once every few seconds).

``<dir>`` is ``PERSEUS_FLIGHT_RECORDER_DIR``; perseusrun sets it for its ranks to
``perseus-flight-recorder/<job>`` under ``--output-filename``'s directory or the
working directory. perseusrun then reads every rank's file and prints
:func:`diagnose`'s lines: which rank has not submitted what every other rank waits for,
and where its main thread is.
"""

import json
import os
import socket
import sys
import threading
import time
import traceback

from perseus import _core

#: The directory of the files (perseusrun sets it for its ranks).
DIR_VAR = "PERSEUS_FLIGHT_RECORDER_DIR"
#: The rendezvous keys by which perseusrun asks every rank for its file:
#: ``flight/dump/0``, ``flight/dump/1``, ... (the value is the reason).
TRIGGER = "flight/dump/"
#: The rendezvous keys by which rank 0 tells perseusrun of its stall warnings
#: (``flight/stall/<count so far>``); perseusrun then asks every rank for its file.
STALLED = "flight/stall/"
#: The fields of one operation (``_core.flight_record()``'s tuples, in order).
FIELDS = ("name", "kind", "process_set", "bytes", "submitted", "started", "finished",
          "stage")
#: Stages of an operation that has not finished.
PENDING = ("submitted", "running")
#: The least time between two files written for failures.
FAILURE_INTERVAL = 5.0

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_last_failure_dump = -FAILURE_INTERVAL
_watching = False


def _rank():
    if _core.is_initialized():
        return _core.rank()
    return int(os.environ.get("PERSEUS_RANK") or os.environ.get("RANK") or 0)


def snapshot(reason):
    """This rank's record: its operations and every Python thread's stack."""
    ops = []
    if _core.is_initialized():
        ops = [dict(zip(FIELDS, row)) for row in _core.flight_record()]
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        stack = [{"file": f.filename, "line": f.lineno, "function": f.name}
                 for f in traceback.extract_stack(frame)]
        threads.append({"name": names.get(ident, str(ident)), "main": ident == main,
                        "stack": stack})
    return {"rank": _rank(), "host": socket.gethostname(), "pid": os.getpid(),
            "reason": reason, "time": time.time(), "ops": ops, "threads": threads}


def write(reason, directory=None):
    """Write this rank's record to ``<directory>/rank.<R>.json`` (the directory of
    ``PERSEUS_FLIGHT_RECORDER_DIR`` by default); returns the path, or None when no
    directory is set or it cannot be written."""
    directory = directory or os.environ.get(DIR_VAR)
    if not directory:
        return None
    record = snapshot(reason)
    path = os.path.join(directory, f"rank.{record['rank']}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(record, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError as e:
        print(f"perseus: flight recorder: cannot write {path}: {e}", file=sys.stderr)
        return None
    return path


def on_failure(error):
    """A collective of this rank failed with ``error``: write the record (at most once
    every :data:`FAILURE_INTERVAL` seconds, however many operations fail with it)."""
    global _last_failure_dump
    if not os.environ.get(DIR_VAR) or time.monotonic() - _last_failure_dump < FAILURE_INTERVAL:
        return
    _last_failure_dump = time.monotonic()
    write(f"a collective failed: {error}")


def watch():
    """Start, once per process, the thread that writes the record whenever perseusrun
    asks (``flight/dump/<k>`` at its rendezvous). Only in perseusrun's jobs (which set
    ``PERSEUS_FLIGHT_RECORDER_DIR`` and the rendezvous address)."""
    global _watching
    addr, port = os.environ.get("PERSEUS_RENDEZVOUS_ADDR"), os.environ.get(
        "PERSEUS_RENDEZVOUS_PORT")
    if _watching or not (os.environ.get(DIR_VAR) and addr and port):
        return
    _watching = True
    secret = os.environ.get("PERSEUS_SECRET", "")
    threading.Thread(target=_watch, args=(addr, int(port), secret), daemon=True,
                     name="perseus-flight-recorder").start()
    if _rank() == 0:
        threading.Thread(target=_report_stalls, args=(addr, int(port), secret), daemon=True,
                         name="perseus-stall-reporter").start()


def _watch(addr, port, secret):
    try:
        client = _core.RendezvousClient(addr, port, secret, 30.0)
    except Exception:  # noqa: BLE001 - no launcher to answer: nothing to watch
        return
    k = 0
    while True:
        try:
            reason = client.get(f"{TRIGGER}{k}", 3600.0).decode(errors="replace")
        except Exception:  # noqa: BLE001 - an hour without a request, or the launcher left
            time.sleep(1.0)
            continue
        write(reason)
        k += 1


def _report_stalls(addr, port, secret):
    """Rank 0: tell perseusrun (``flight/stall/<n>``) whenever the engine gave a stall
    warning, so that every rank writes its record while the job stands still."""
    client, told = None, 0
    while True:
        time.sleep(1.0)
        try:
            n = _core.counters().get("stall_warnings", 0) if _core.is_initialized() else 0
            if n > told:
                client = client or _core.RendezvousClient(addr, port, secret, 30.0)
                client.set(f"{STALLED}{n}", b"1")
                told = n
        except Exception:  # noqa: BLE001, S112 - shut down meanwhile, or the launcher left
            continue


def read(directory, since=0.0):
    """Every rank's record in ``directory`` written at or after ``since``, by rank."""
    records = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return records
    for name in names:
        if not (name.startswith("rank.") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("time", 0) >= since:
            records[record["rank"]] = record
    return records


def where(record):
    """``file:line function()`` of the main thread's innermost frame outside Perseus
    (the user's code: the line that called a collective, or where it is instead)."""
    for thread in record.get("threads", []):
        if thread.get("main"):
            frames = [f for f in thread["stack"] if not f["file"].startswith(_PACKAGE)]
            frames = frames or thread["stack"]
            if frames:
                f = frames[-1]
                return f"{f['file']}:{f['line']} {f['function']}()"
    return "an unknown place (no main thread recorded)"


def diagnose(records, now=None):
    """Lines that say why the job does not move, from every rank's record: each
    operation some ranks wait in and others have not submitted, naming those ranks and
    where their main threads are; else where each rank is."""
    now = time.time() if now is None else now
    pending = {}  # (process set, name) -> {rank: submitted}
    for rank, rec in records.items():
        for op in rec.get("ops", []):
            if op["stage"] in PENDING:
                pending.setdefault((op["process_set"], op["name"]), {})[rank] = op
    lines = []
    for (ps, name), by_rank in sorted(pending.items(),
                                      key=lambda kv: min(o["submitted"]
                                                         for o in kv[1].values())):
        missing = sorted(r for r in records if r not in by_rank)
        first = min(o["submitted"] for o in by_rank.values())
        kind = next(iter(by_rank.values()))["kind"]
        waiting = (f"rank{'s' if len(by_rank) > 1 else ''} "
                   f"{', '.join(map(str, sorted(by_rank)))} wait{'' if len(by_rank) > 1 else 's'}")
        set_text = f" of process set {ps}" if ps else ""
        if not missing:
            if all(o["stage"] == "running" for o in by_rank.values()):
                lines.append(f"{kind} '{name}'{set_text} has run for {now - first:.0f} s on "
                             f"every rank")
            continue
        for r in missing:
            lines.append(f"rank {r} has not submitted {kind} '{name}'{set_text} for "
                         f"{now - first:.0f} s ({waiting} for it); its main "
                         f"thread is in {where(records[r])}")
        if len(lines) >= 8:
            break
    if not lines:
        lines = [f"rank {r}: no collective pending; its main thread is in "
                 f"{where(records[r])}" for r in sorted(records)]
    return lines

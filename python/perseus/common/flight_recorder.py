"""The flight recorder's records: what each rank was doing when the job stopped moving.

Each rank's core keeps its last operations (``_core.flight_record()``: a ring of
1,024, with their submitted, negotiated and finished times and stage). A rank writes
them, with the stack of every Python thread, to ``<dir>/rank.<R>.json``:

- when perseusrun asks (``SIGUSR1`` to perseusrun, a stall warning of rank 0, or a
  rank that failed): it publishes ``flight/dump/<k>`` at its rendezvous, and a thread
  of every rank (:func:`watch`) waits for that key. That thread also publishes the
  record's :func:`summary` at ``flight/record/<k>/<rank>``: perseusrun reads those, so
  its diagnosis covers ranks on every host, whether or not the files can be written;
- when one of the rank's collectives fails (at most once every few seconds); its summary
  then goes to ``flight/failed/<rank>`` at once, since the rank may end with the error
  before perseusrun asks.

``<dir>`` is ``PERSEUS_FLIGHT_RECORDER_DIR``; perseusrun sets it for its ranks to
``perseus-flight-recorder/<job>`` under ``--output-filename``'s directory or the
working directory (on each rank's own host). perseusrun prints :func:`diagnose`'s lines:
which rank has not submitted what every other rank waits for, and where its main thread
is.
"""

import json
import os
import socket
import sys
import threading
import time
import traceback

from perseus import _core
from perseus.common import knobs

#: The directory of the files (perseusrun sets it for its ranks).
DIR_VAR = "PERSEUS_FLIGHT_RECORDER_DIR"
#: The rendezvous keys by which perseusrun asks every rank for its file:
#: ``flight/dump/0``, ``flight/dump/1``, ... (the value is the reason).
TRIGGER = "flight/dump/"
#: The rendezvous keys by which rank 0 tells perseusrun of its stall warnings
#: (``flight/stall/<host>.<pid>.<count so far>``: rank 0 may be another process after an
#: elastic reset); perseusrun then asks every rank for its file.
STALLED = "flight/stall/"
#: The rendezvous keys of the records' summaries: ``flight/record/<k>/<rank>`` answers
#: ``flight/dump/<k>``.
RECORDS = "flight/record/"
#: The rendezvous keys of the summaries a rank publishes when its collective fails
#: (``flight/failed/<rank>``, the newest), as it writes its file.
FAILED = "flight/failed/"
#: The rendezvous keys by which each rank's watching thread says it is there
#: (``flight/watching/<rank>``): a launcher whose rank failed waits for those only.
WATCHING = "flight/watching/"
#: What a summary keeps: the operations pending or failed, the last of them, and the
#: innermost frames of the main thread.
SUMMARY_OPS = 64
SUMMARY_FRAMES = 40
#: The fields of one operation (``_core.flight_record()``'s tuples, in order).
FIELDS = ("name", "kind", "process_set", "bytes", "submitted", "started", "finished",
          "stage")
#: Stages of an operation that has not finished.
PENDING = ("submitted", "running")
#: How long before a request an operation that failed still counts as what its rank
#: was waiting in (a collective fails soon after the peer it waits for is gone).
RECENT_FAILURE = 10.0
#: The least time between two files written for failures.
FAILURE_INTERVAL = 5.0

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_last_failure_dump = -FAILURE_INTERVAL
_watching = False


def _rank():
    if _core.is_initialized():
        return _core.rank()
    rank = knobs.text("PERSEUS_RANK") or knobs.text("RANK") or "0"
    return int(rank) if rank.isdigit() else 0


def _rendezvous():
    """The launcher's rendezvous, or None (none, or a bad port: the record stays a file)."""
    try:
        return knobs.rendezvous()
    except ValueError:
        return None


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
    size = _core.size() if _core.is_initialized() else None
    return {"rank": _rank(), "size": size, "host": socket.gethostname(), "pid": os.getpid(),
            "reason": reason, "time": time.time(), "ops": ops, "threads": threads}


def write(reason, directory=None, record=None):
    """Write this rank's record (``record``, or a new :func:`snapshot`) to
    ``<directory>/rank.<R>.json`` (the directory of ``PERSEUS_FLIGHT_RECORDER_DIR`` by
    default); returns the path, or None when no directory is set or it cannot be
    written."""
    directory = directory or knobs.text(DIR_VAR)
    if not directory:
        return None
    record = record or snapshot(reason)
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


def summary(record):
    """What perseusrun needs of a record for its diagnosis, small enough for the
    rendezvous store: the operations pending or failed (the last :data:`SUMMARY_OPS`)
    and the main thread's innermost :data:`SUMMARY_FRAMES` frames."""
    ops = [op for op in record["ops"] if op["stage"] in PENDING or op["stage"] == "failed"]
    threads = [dict(t, stack=t["stack"][-SUMMARY_FRAMES:])
               for t in record["threads"] if t["main"]]
    return dict(record, ops=ops[-SUMMARY_OPS:], threads=threads)


def on_failure(error):
    """A collective of this rank failed with ``error``: write the record (at most once
    every :data:`FAILURE_INTERVAL` seconds, however many operations fail with it)."""
    global _last_failure_dump
    if not knobs.text(DIR_VAR) or time.monotonic() - _last_failure_dump < FAILURE_INTERVAL:
        return
    _last_failure_dump = time.monotonic()
    record = snapshot(f"a collective failed: {error}")
    write(record["reason"], record=record)
    # Also to the launcher, at once: this rank may end with the error before it could
    # answer a request.
    where = _rendezvous()
    if where is not None:
        try:
            client = _core.RendezvousClient(*where, 2.0)
            client.set(f"{FAILED}{record['rank']}", json.dumps(summary(record)).encode())
        except Exception:  # noqa: BLE001, S110 - no launcher to tell: the file is there
            pass


def watch():
    """Start, once per process, the thread that writes the record whenever perseusrun
    asks (``flight/dump/<k>`` at its rendezvous). Only in perseusrun's jobs (which set
    ``PERSEUS_FLIGHT_RECORDER_DIR`` and the rendezvous address)."""
    global _watching
    where = _rendezvous()
    if _watching or not (knobs.text(DIR_VAR) and where):
        return
    _watching = True
    threading.Thread(target=_watch, args=where, daemon=True,
                     name="perseus-flight-recorder").start()
    # Stall warnings come from rank 0 only, but which process is rank 0 may change with
    # an elastic reset: every rank watches its own counter.
    threading.Thread(target=_report_stalls, args=where, daemon=True,
                     name="perseus-stall-reporter").start()


def _watch(addr, port, secret):
    try:
        client = _core.RendezvousClient(addr, port, secret, 30.0)
        client.set(f"{WATCHING}{_rank()}", b"1")
    except Exception:  # noqa: BLE001 - no launcher to answer: nothing to watch
        return
    k = 0
    while True:
        try:
            reason = client.get(f"{TRIGGER}{k}", 3600.0).decode(errors="replace")
        except Exception:  # noqa: BLE001 - an hour without a request, or the launcher left
            time.sleep(1.0)
            continue
        record = snapshot(reason)
        write(reason, record=record)
        try:
            client.set(f"{RECORDS}{k}/{record['rank']}", json.dumps(summary(record)).encode())
        except Exception:  # noqa: BLE001, S110 - the launcher left: the file is there
            pass
        k += 1


def _report_stalls(addr, port, secret):
    """Rank 0: tell perseusrun (``flight/stall/<n>``) whenever the engine gave a stall
    warning, so that every rank writes its record while the job stands still."""
    client, told, me = None, 0, f"{socket.gethostname()}.{os.getpid()}"
    while True:
        time.sleep(1.0)
        try:
            n = _core.counters().get("stall_warnings", 0) if _core.is_initialized() else 0
            if n > told:
                client = client or _core.RendezvousClient(addr, port, secret, 30.0)
                client.set(f"{STALLED}{me}.{n}", b"1")
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


def ranks_text(ranks):
    """``rank 3`` or ``ranks 1, 4`` (``ranks`` in order)."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def diagnose(records, now=None, gone=None, silent=()):
    """Lines that say why the job does not move, from the ranks' records (by rank):
    each operation some ranks wait in (or failed in, shortly before they were asked) and
    others have not submitted, naming those ranks and where their main threads are;
    else where each rank is. ``gone``: ``{rank: what became of it}`` of ranks without a
    record ("ended with exit code 3", "wrote no record"); ``silent``: ranks still
    running that sent no record when asked."""
    now = time.time() if now is None else now
    gone = gone or {}
    silent = set(silent) - set(records) - set(gone)
    waiting = {}  # (process set, name) -> {rank: op}
    for rank, rec in records.items():
        asked = rec.get("time", now)
        for op in rec.get("ops", []):
            recent = (op["stage"] == "failed" and op.get("finished") is not None
                      and asked - op["finished"] <= RECENT_FAILURE)
            if op["stage"] in PENDING or recent:
                waiting.setdefault((op["process_set"], op["name"]), {})[rank] = op
    everyone = set(records) | set(gone) | silent
    lines = []
    for (ps, name), by_rank in sorted(waiting.items(),
                                      key=lambda kv: min(o["submitted"]
                                                         for o in kv[1].values())):
        missing = sorted(r for r in everyone if r not in by_rank)
        first = min(o["submitted"] for o in by_rank.values())
        kind = next(iter(by_rank.values()))["kind"]
        what = f"{kind} '{name}'" + (f" of process set {ps}" if ps else "")
        ranks = ranks_text(sorted(by_rank))
        failed = all(o["stage"] == "failed" for o in by_rank.values())
        wait = "waited" if failed else f"wait{'' if len(by_rank) > 1 else 's'}"
        if not missing:
            if all(o["stage"] == "running" for o in by_rank.values()):
                lines.append(f"{what} has run for {now - first:.0f} s on every rank")
            elif failed:
                lines.append(f"{what} failed on every rank")
            continue
        for r in missing:
            if r in gone:
                lines.append(f"rank {r} {gone[r]} while {ranks} waited in {what}"
                             + ("; it failed there" if failed else ""))
            elif r in silent:
                lines.append(f"rank {r} sent no record while {ranks} {wait} in {what} "
                             f"for {now - first:.0f} s: its process may be stopped or "
                             "frozen, its host unreachable, or its Python stuck")
            else:
                lines.append(f"rank {r} has not submitted {what} for {now - first:.0f} s "
                             f"({ranks} {wait} for it); its main thread is in "
                             f"{where(records[r])}")
        if len(lines) >= 8:
            break
    if not lines:
        lines = [f"rank {r}: no collective pending; its main thread is in "
                 f"{where(records[r])}" for r in sorted(records)]
    return lines

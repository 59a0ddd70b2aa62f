"""Processes a rank starts that are not ranks: multiprocessing's workers.

A script that calls ``hvd.init()`` at its top level runs it again in every process
multiprocessing starts with ``spawn`` or ``forkserver`` (torch's DataLoader workers under
``multiprocessing_context="forkserver"``, which Horovod's examples recommend): such a
process imports the script as ``__mp_main__``. It inherits the rank's environment, so a
plain ``init()`` would try to join the job a second time as the same rank (and fail
after the start timeout, taking the DataLoader down with it).

Each rank therefore leaves a mark in its environment once ``init()`` succeeds: its
process id, its topology, and the values of the variables that made it this rank of
this job. ``init()`` in a process that inherited the mark of another process, still
running, with the same variables, cannot be that rank: it answers for the rank
(``rank()``, ``size()``, the local and cross ranks) without joining the job, and its
collectives fail with an error that says why. A process started with other values
(another job's rank) initializes as usual; so does one whose marking rank has ended. A
child forked after ``init()`` (the default DataLoader workers) answers the same way from
the memory it shares with the rank.

The mark in the environment is what the rank was when the process's environment was
copied from it; a forkserver keeps the environment it started with. So each rank also
writes its mark to a file named for its process id (in ``perseus-ranks-<uid>`` under the
temporary folder, with the rank's start time against process id reuse), rewritten at
every ``init()`` and removed at ``shutdown()`` and exit. A copy takes the topology from
that file when its rank has one, so a worker that a forkserver started after an elastic
reset answers for the rank as it is now, not as it was when the forkserver started. A
process without the mark (its forkserver started before the rank's ``init()``) looks for
the file of its parent, or the parent's parent, up a few generations.

A process can also reach ``init()`` while its rank is still in its own (a ``spawn`` pool
started before ``hvd.init()``, whose workers import the script while the rank waits for
the others to join). So a rank announces its ``init()`` before it connects: a variable in
its environment and a ``<pid>.pending`` file beside its mark's. A process that finds no
mark but such an announcement, from a running process with the same rank variables,
waits for that rank's mark and then answers for it; if that ``init()`` fails instead,
its own fails saying so.
"""

import atexit
import hashlib
import os
import tempfile
import time

from perseus.common import knobs

MARK = "PERSEUS_INITIALIZED_IN"
PENDING = "PERSEUS_INITIALIZING_IN"
# How long a process waits for the mark of a rank whose init() it found under way.
_WAIT_SECONDS = 600

# The variables that make a process one rank of one job: the launchers' rank and size,
# and where the job meets. A process started with other values is another job's rank.
_IDENTITY = (
    "PERSEUS_RANK", "PERSEUS_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE",
    "PERSEUS_MASTER_ADDR", "PERSEUS_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT",
    "PERSEUS_RENDEZVOUS_ADDR", "PERSEUS_RENDEZVOUS_PORT", "PERSEUS_RENDEZVOUS_SCOPE",
    "PERSEUS_ELASTIC_ID",
)


def _identity():
    text = "\n".join(f"{k}={knobs.text(k) or ''}" for k in _IDENTITY)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# How many generations above a process without the mark are searched for a rank's file
# (a DataLoader worker's parent is the forkserver, whose parent is the rank).
_GENERATIONS = 4
_cleanup_registered = False


def _folder():
    return os.path.join(tempfile.gettempdir(), f"perseus-ranks-{os.getuid()}")


def _stat(pid):
    """``(parent pid, start time in clock ticks since boot)`` of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # Fields after the command name (which may hold spaces) in parentheses:
        # state, ppid, ... starttime is the 20th of them (the 22nd field of the line).
        rest = stat[stat.rindex(b")") + 2:].split()
        return int(rest[1]), int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


def begin():
    """Announce this rank's ``init()``, before it connects: processes it starts from now
    on, and those started earlier that reach ``init()`` meanwhile, wait for its mark
    instead of joining the job as this rank."""
    if not any(knobs.text(k) for k in _IDENTITY):
        return
    identity = _identity()
    os.environ[PENDING] = f"{os.getpid()}:{identity}"
    _write_own(f"{os.getpid()}.pending", [identity])


def end_pending():
    """This rank's ``init()`` has ended, marked or failed: no more announcement."""
    if (knobs.text(PENDING) or "").split(":")[0] == str(os.getpid()):
        os.environ.pop(PENDING, None)
    try:
        os.unlink(os.path.join(_folder(), f"{os.getpid()}.pending"))
    except OSError:
        pass


def mark(topology):
    """Leave this rank's mark (``topology``: rank, size, local rank, local size, cross
    rank, cross size) for the processes it starts. A process that no launcher started
    (none of the variables is set) is a job of its own, and so is any process it starts:
    it leaves none."""
    if not any(knobs.text(k) for k in _IDENTITY):
        return
    identity = _identity()
    os.environ[MARK] = ":".join(str(f) for f in [os.getpid(), *topology, identity])
    _write_file(topology, identity)
    end_pending()


def _write_file(topology, identity):
    """This rank's mark in its file (best effort: without it, copies read the mark in
    their environment)."""
    global _cleanup_registered
    if not _write_own(str(os.getpid()), [*topology, identity]):
        return
    if not _cleanup_registered:
        _cleanup_registered = True
        atexit.register(_remove_file, os.getpid())
        _remove_stale()


def _write_own(name, fields):
    """Writes this process's start time and ``fields`` to the file ``name`` of the
    folder, whole (a reader never sees half of it); False when it could not."""
    me = _stat(os.getpid())
    if me is None:
        return False
    path = os.path.join(_folder(), name)
    try:
        os.makedirs(_folder(), mode=0o700, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(":".join(str(x) for x in [me[1], *fields]))
        os.replace(path + ".tmp", path)
    except OSError:
        return False
    return True


def _read_own(pid, name):
    """The fields after the start time in the file ``name`` of process ``pid``, when
    that process wrote it (its start time matches: not another process that reused the
    id); else None."""
    try:
        with open(os.path.join(_folder(), name)) as f:
            start, *fields = f.read().split(":")
    except (OSError, ValueError):
        return None
    st = _stat(pid)
    return fields if st is not None and str(st[1]) == start else None


def _remove_stale():
    """Removes the files of ranks that ended without removing theirs (killed)."""
    try:
        names = os.listdir(_folder())
    except OSError:
        return
    for name in names:
        pid = name.removesuffix(".pending")
        if not pid.isdigit():
            continue
        read = _read_file if name == pid else _read_pending
        if read(int(pid)) is None:
            try:
                os.unlink(os.path.join(_folder(), name))
            except OSError:
                pass


def _remove_file(pid):
    if pid == os.getpid():  # not in a forked child that exits
        try:
            os.unlink(os.path.join(_folder(), str(pid)))
        except OSError:
            pass


def _read_file(pid):
    """``(topology, identity)`` from the file of rank process ``pid``, when it is that
    process's (its start time matches) and well formed; else None."""
    fields = _read_own(pid, str(pid))
    if fields is None or len(fields) != 7:
        return None
    try:
        return [int(x) for x in fields[:6]], fields[6]
    except ValueError:
        return None


def unmark():
    """This process is no longer a rank (``shutdown()``)."""
    os.environ.pop(MARK, None)
    _remove_file(os.getpid())
    end_pending()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def _from_environment():
    """``(pid, topology)`` of the mark this process inherited, when that process still
    runs and made it with the same rank variables; else None. The topology is the one in
    that rank's file when it keeps one (the rank as it is now)."""
    fields = (knobs.text(MARK) or "").split(":")
    if len(fields) != 8:
        return None
    try:
        pid, *topology = (int(f) for f in fields[:7])
    except ValueError:
        return None
    if pid == os.getpid() or fields[7] != _identity() or not _alive(pid):
        return None
    now = _read_file(pid)
    return pid, topology if now is None else now[0]


def _ancestors():
    """This process's parent, its parent's parent..., up to ``_GENERATIONS`` of them,
    short of init (pid 1)."""
    pid = os.getpid()
    for _ in range(_GENERATIONS):
        st = _stat(pid)
        if st is None or st[0] <= 1:
            return
        pid = st[0]
        yield pid


def _from_ancestors():
    """``(pid, topology)`` from the file of the nearest ancestor that is a rank with the
    same rank variables as this process; else None."""
    for pid in _ancestors():
        found = _read_file(pid)
        if found is not None and found[1] == _identity():
            return pid, found[0]
    return None


def _read_pending(pid):
    """The identity in the announcement file of process ``pid``, when it is that
    process's (its start time matches); else None."""
    fields = _read_own(pid, f"{pid}.pending")
    return fields[0] if fields is not None and len(fields) == 1 else None


def _pending_rank():
    """The process id of the rank whose ``init()`` this process found under way: the
    announcement it inherited, or an ancestor's pending file, from a running process
    with the same rank variables; else None."""
    identity = _identity()
    fields = (knobs.text(PENDING) or "").split(":")
    if len(fields) == 2 and fields[1] == identity and fields[0].isdigit():
        pid = int(fields[0])
        if pid != os.getpid() and _alive(pid):
            return pid
    return next((pid for pid in _ancestors() if _read_pending(pid) == identity), None)


def _wait_for_mark(pid):
    """``(pid, topology)`` once rank process ``pid`` has marked; ``RuntimeError`` when its
    ``init()`` ended without a mark (it failed) or it ended."""
    deadline = time.monotonic() + _WAIT_SECONDS
    pending = os.path.join(_folder(), f"{pid}.pending")
    while time.monotonic() < deadline:
        found = _read_file(pid)
        if found is not None and found[1] == _identity():
            return pid, found[0]
        if not _alive(pid) or not os.path.exists(pending):
            # One more look: the mark is written before the announcement goes.
            found = _read_file(pid)
            if found is not None and found[1] == _identity():
                return pid, found[0]
            break
        time.sleep(0.02)
    raise RuntimeError(
        f"hvd.init(): this process was started by a rank (pid {pid}) whose own hvd.init() "
        f"was under way; that init() ended without success, so this process cannot answer "
        f"for the rank. Put hvd.init() under `if __name__ == \"__main__\":` to keep it out "
        f"of the processes multiprocessing starts")


def copy_of():
    """``(topology, why)`` when this process was started by a rank that is still running:
    it inherited the mark of another process, made with the same rank variables, or an
    ancestor's file holds one; else None. The topology is the rank's as it is now. When
    no rank has marked yet but one announced its ``init()`` (:func:`begin`), this waits
    for that rank's mark."""
    found = _from_environment() or _from_ancestors()
    if found is None:
        pending = _pending_rank()
        if pending is None:
            return None
        found = _wait_for_mark(pending)
    pid, topology = found
    rank = topology[0]
    why = (f"this process was started by rank {rank} (pid {pid}) after its hvd.init() and "
           f"ran hvd.init() too (a DataLoader worker under spawn or forkserver runs the "
           f"script's top level again, say); it is not a rank: rank(), size() and the local "
           f"and cross ranks answer for rank {rank}, but collectives run only in rank "
           f"{rank}'s own process. Put hvd.init() under `if __name__ == \"__main__\":` to "
           f"keep it out of such processes")
    return topology, why

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
(another job's rank) initializes as usual; so does one whose marking rank has ended. A child forked after ``init()``
(the default DataLoader workers) answers the same way from the memory it shares with
the rank.
"""

import hashlib
import os

MARK = "PERSEUS_INITIALIZED_IN"

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
    text = "\n".join(f"{k}={os.environ.get(k, '')}" for k in _IDENTITY)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mark(topology):
    """Leave this rank's mark (``topology``: rank, size, local rank, local size, cross
    rank, cross size) for the processes it starts. A process that no launcher started
    (none of the variables is set) is a job of its own, and so is any process it starts:
    it leaves none."""
    if not any(os.environ.get(k) for k in _IDENTITY):
        return
    fields = [os.getpid(), *topology, _identity()]
    os.environ[MARK] = ":".join(str(f) for f in fields)


def unmark():
    """This process is no longer a rank (``shutdown()``)."""
    os.environ.pop(MARK, None)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def copy_of():
    """``(topology, why)`` when this process inherited the mark of another process that
    is still running, made with the same rank variables (so that process is this rank);
    else None."""
    fields = os.environ.get(MARK, "").split(":")
    if len(fields) != 8:
        return None
    try:
        pid, *topology = (int(f) for f in fields[:7])
    except ValueError:
        return None
    if pid == os.getpid() or fields[7] != _identity() or not _alive(pid):
        return None
    rank = topology[0]
    why = (f"this process was started by rank {rank} (pid {pid}) after its hvd.init() and "
           f"ran hvd.init() too (a DataLoader worker under spawn or forkserver runs the "
           f"script's top level again, say); it is not a rank: rank(), size() and the local "
           f"and cross ranks answer for rank {rank}, but collectives run only in rank "
           f"{rank}'s own process. Put hvd.init() under `if __name__ == \"__main__\":` to "
           f"keep it out of such processes")
    return topology, why

"""OMP_NUM_THREADS for the ranks perseusrun starts.

Unset, every rank's intra-op thread pool (torch, MKL, OpenMP) takes all of its host's
cores, so L ranks on a host run L times as many threads as cores and slow each other
down (a plain DDP script on 2 ranks of a 2-core host: 30-32 ms a step, 11 ms with one
thread each). As torchrun does, perseusrun then sets it, to the host's cores divided by
the ranks it runs there (at least 1), and says so once; a value the user set is kept.
"""

import os
import sys

VAR = "OMP_NUM_THREADS"

_said = []


def per_rank(cores, local_ranks):
    """Threads for each of ``local_ranks`` ranks on a host of ``cores`` cores."""
    return max(1, int(cores) // max(1, int(local_ranks)))


def host_cores():
    """The cores this process may run on (its affinity), else the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wanted(environ):
    """Whether perseusrun sets the variable: the user left it unset (blank counts as
    unset)."""
    return not (environ.get(VAR) or "").strip()


def remote_prelude(local_ranks):
    """Shell that sets and exports the variable on a remote host, from that host's own
    core count (``nproc``, else ``getconf``), before the rank starts."""
    return (f"{VAR}=$(( $(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null "
            f"|| echo 1) / {max(1, int(local_ranks))} )); "
            f'[ "${VAR}" -ge 1 ] 2>/dev/null || {VAR}=1; export {VAR}; ')


def announce(local_ranks, remote, stream=None):
    """Says once per launcher that the variable was set, and how to choose another."""
    if _said:
        return
    _said.append(True)
    cores = host_cores()
    here = (f"here {cores} cores / {local_ranks} ranks = {per_rank(cores, local_ranks)}"
            if not remote else "computed on each host")
    print(f"perseusrun: {VAR} is unset: each rank gets its host's cores divided by its "
          f"ranks there, at least 1 ({here}), so the ranks' thread pools do not "
          f"oversubscribe the cores; set {VAR} to choose another value",
          file=stream or sys.stderr)

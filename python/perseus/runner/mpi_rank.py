"""Rank shim for ``perseusrun --mpi``: map mpirun's rank variables to Perseus's, then exec.

mpirun places ranks slot by slot (``--map-by slot``) over ``PERSEUS_MPI_PLACEMENT``
(``host:N,...``), the same order ``perseusrun`` uses, so the topology is recomputed here.
"""

import os
import sys

from perseus.runner import hosts as _hosts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m perseus.runner.mpi_rank COMMAND [ARG ...]")
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    slots = _hosts.place(_hosts.parse_hosts(os.environ["PERSEUS_MPI_PLACEMENT"]), size)
    os.environ.update(slots[rank].env())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()

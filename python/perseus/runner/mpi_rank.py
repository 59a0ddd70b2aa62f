"""Rank shim for ``perseusrun --mpi``: map mpirun's rank variables to Perseus's, then exec.

mpirun places ranks slot by slot (``--map-by slot``) over ``PERSEUS_MPI_PLACEMENT``
(``host:N,...``), the same order ``perseusrun`` uses, so the topology is recomputed here.
"""

import os
import sys

from perseus.common import knobs
from perseus.runner import hosts as _hosts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m perseus.runner.mpi_rank COMMAND [ARG ...]")
    given = [knobs.text(v) for v in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                     "PERSEUS_MPI_PLACEMENT")]
    if None in given:
        sys.exit("perseus.runner.mpi_rank runs under perseusrun --mpi only (it needs "
                 "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and PERSEUS_MPI_PLACEMENT)")
    rank, size, placement = int(given[0]), int(given[1]), given[2]
    slots = _hosts.place(_hosts.parse_hosts(placement), size)
    os.environ.update(slots[rank].env())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()

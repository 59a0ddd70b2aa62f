"""Rank 0's address for a job that mpirun (or another MPI launcher) spread over several
hosts without ``PERSEUS_MASTER_ADDR``: rank 0 tells the others through MPI, with mpi4py
where it is installed (seed 003's ``mpirun -np 32 -npernode 8 -hostfile hosts ...``).
Perseus's own traffic never goes through MPI."""

import socket

from perseus import _netif
from perseus.common import knobs

_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def own_address(environ=None):
    """The address the other hosts reach this machine at: ``PERSEUS_IFACE_ADDR``; else
    the IPv4 address of ``PERSEUS_GLOO_NETWORK_INTERFACE`` (the first listed that has
    one); else eth0's, when there is one; else this host's name."""
    if knobs.text("PERSEUS_IFACE_ADDR", environ):
        return knobs.text("PERSEUS_IFACE_ADDR", environ)
    names = knobs.get("PERSEUS_GLOO_NETWORK_INTERFACE", environ) or "eth0"
    address, _ = _netif.first_ipv4(names)
    return address or socket.gethostname()


def learn_rank0_address(environ=None):
    """Under an MPI launcher with mpi4py installed: broadcast rank 0's address (from
    rank 0, to every rank) and set ``PERSEUS_MASTER_ADDR`` to it. Every rank must call
    it (it is a collective). Returns the address, or None where there is no MPI
    launcher or no mpi4py (nothing is changed then)."""
    if not any(knobs.given(v, environ) for v in _MPI_VARIABLES):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    address = comm.bcast(own_address(environ) if comm.Get_rank() == 0 else None, root=0)
    knobs.environment(environ)["PERSEUS_MASTER_ADDR"] = address
    return address

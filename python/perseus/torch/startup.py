"""Perseus started from torch.distributed's ranks, and torch's from Perseus's.

:func:`start` starts Perseus as a rank of torch's job: under a launcher that gave
Perseus its ranks (perseusrun, mpirun, srun) it checks that torch agrees; otherwise the
ranks meet through torch's store and rank 0 hosts Perseus's rendezvous on a free port.
:func:`torch_env_from_perseus` goes the other way, for an ``init_process_group()`` under
perseusrun, mpirun or srun that finds none of torch's variables. Used by DDP's patch
(perseus.torch.ddp) and the ``perseus`` backend (perseus.torch.backend).
"""

import itertools
import os
import secrets
import socket

import torch.distributed as dist

from perseus import _netif
from perseus.common import knobs

# Variables by which Perseus's core finds its ranks without torch (config/topology.rs).
_LAUNCHER_RANKS = ("PERSEUS_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                   "SLURM_PROCID")


_server = None  # the rendezvous this rank hosts when torch's group gave the ranks
_store_rounds = itertools.count()

def core():
    from perseus import _core as core

    return core


def _launcher_gives_ranks():
    if any(knobs.given(v) for v in _LAUNCHER_RANKS):
        return True
    return (knobs.given("RANK") and knobs.given("WORLD_SIZE")
            and knobs.get("PERSEUS_USE_DDP_LAUNCHER"))


def default_store():
    return dist.distributed_c10d._get_default_store()


def _env_from_group(rank, size, store):
    """Perseus's topology and rendezvous from torch's ranks, through torch's ``store``."""
    global _server
    key = f"perseus/ddp/{next(_store_rounds)}"
    store.set(f"{key}/host/{rank}", socket.gethostname())
    hosts = [store.get(f"{key}/host/{r}").decode() for r in range(size)]
    secret = _shared_secret(store, key, rank)
    if rank == 0:
        one_host = len(set(hosts)) == 1
        addr = "127.0.0.1" if one_host else knobs.text("MASTER_ADDR") or hosts[0]
        _server = core().RendezvousServer("0.0.0.0:0", secret)
        store.set(f"{key}/rendezvous", f"{addr} {_server.port}")
    addr, port = store.get(f"{key}/rendezvous").decode().split(" ")
    seen, local_ranks = {}, []
    for host in hosts:
        local_ranks.append(seen.get(host, 0))
        seen[host] = local_ranks[-1] + 1
    local_rank = local_ranks[rank]
    # Horovod's cross rank: among the ranks with the same local rank, one per host.
    peers = [r for r in range(size) if local_ranks[r] == local_rank]
    os.environ.update({
        "PERSEUS_RANK": str(rank), "PERSEUS_SIZE": str(size),
        "PERSEUS_LOCAL_RANK": str(local_rank), "PERSEUS_LOCAL_SIZE": str(seen[hosts[rank]]),
        "PERSEUS_CROSS_RANK": str(peers.index(rank)), "PERSEUS_CROSS_SIZE": str(len(peers)),
        "PERSEUS_RENDEZVOUS_ADDR": addr, "PERSEUS_RENDEZVOUS_PORT": port,
    })


def _shared_secret(store, key, rank):
    """PERSEUS_SECRET, or one rank 0 makes and passes through torch's store: Perseus's
    rendezvous and connections are then closed to whoever cannot read that store."""
    secret = knobs.text("PERSEUS_SECRET")
    if not secret:
        if rank == 0:
            store.set(f"{key}/secret", secrets.token_hex(16))
        secret = os.environ["PERSEUS_SECRET"] = store.get(f"{key}/secret").decode()
    return secret



def start(rank, size, store):
    """Start Perseus as rank ``rank`` of torch's ``size`` (collective: every rank calls
    it; it does nothing once Perseus runs). Where no launcher gave Perseus its ranks,
    they meet through torch's ``store``. Raises ``ValueError`` when Perseus and torch
    disagree on the ranks."""
    from perseus.common import basics

    c = core()
    if not c.is_initialized():
        if size > 1 and not _launcher_gives_ranks():
            _env_from_group(rank, size, store)
        elif size > 1:
            _shared_secret(store, f"perseus/ddp/{next(_store_rounds)}", rank)
        basics.init()
    if (c.rank(), c.size()) != (rank, size):
        raise ValueError(
            f"Perseus is rank {c.rank()} of {c.size()} but torch.distributed is rank "
            f"{rank} of {size}: the launcher's variables and init_process_group() disagree; "
            "give init_process_group() the launcher's ranks, or set PERSEUS_DDP=0")


def torch_env_missing(args, kwargs):
    # init_process_group(backend, init_method, timeout, world_size, rank, store, ...)
    def arg(i, name, default):
        return kwargs.get(name, args[i] if len(args) > i else default)

    return (arg(1, "init_method", None) in (None, "env://") and arg(5, "store", None) is None
            and arg(4, "rank", -1) in (-1, None) and not knobs.given("RANK")
            and not knobs.given("MASTER_PORT")
            and any(knobs.given(v) for v in _LAUNCHER_RANKS))


def torch_env_from_perseus():
    """Under perseusrun, mpirun or srun: torch's env:// variables from Perseus's ranks;
    rank 0 names its host and a free port for torch's store."""
    from perseus.common import basics, objects

    basics.init()
    c = core()
    where = None
    if c.rank() == 0:
        host = ("127.0.0.1" if c.local_size() == c.size() else
                knobs.text("MASTER_ADDR") or knobs.text("PERSEUS_HOSTNAME")
                or socket.getfqdn())
        where = (host, _netif.free_port())
    host, port = objects.broadcast_object(where, 0, name="perseus.ddp.torch_store")
    os.environ.update({
        "RANK": str(c.rank()), "WORLD_SIZE": str(c.size()),
        "LOCAL_RANK": str(c.local_rank()), "LOCAL_WORLD_SIZE": str(c.local_size()),
        "MASTER_ADDR": host, "MASTER_PORT": str(port),
    })



def set_of_ranks(ranks):
    """The registered process set of ``ranks`` (sorted, holding this rank), or a new one
    that those ranks register alone. Perseus's registry is the only record: it forgets
    its sets at ``shutdown()``, so a restarted Perseus registers them again."""
    from perseus.common import process_sets

    for ps in process_sets.process_sets():
        if tuple(ps.ranks) == ranks:
            return ps
    return process_sets.add_process_set(list(ranks), members_only=True)

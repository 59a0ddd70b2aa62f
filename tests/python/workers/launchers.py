"""One worker for every way of starting a job (perseusrun, mpirun, perseusrun --mpi,
torchrun, srun, MPICH): init, topology, allreduce, allgather, broadcast, all asserted.

Prints one line ``LAUNCHERS-RESULT {json}`` per rank: the topology and the values the
collectives gave (the tests compare them across launchers), and a ``where`` entry
(network namespace, listening address) that tells on which "host" the rank ran.
"""

import json
import os
import socket

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done

MARK = "LAUNCHERS-RESULT"


def where():
    """The rank's network namespace and its address on the route to the rendezvous
    (the address the core listens on when PERSEUS_IFACE_ADDR is not set)."""
    info = {"pid": os.getpid()}
    try:
        info["netns"] = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        info["netns"] = None
    host = os.environ.get("PERSEUS_RENDEZVOUS_ADDR")
    if host:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            info["addr"] = s.getsockname()[0]
    return info


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    lr, ls, cr, cs = hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()
    assert 0 <= r < n and 0 <= lr < ls <= n and 0 <= cr < cs <= n, (r, n, lr, ls, cr, cs)

    # Every rank's topology, gathered (stacked or concatenated: reshape either way).
    rows = hvd.allgather(torch.tensor([[r, lr, ls, cr, cs]]), name="topology").reshape(n, 5)
    assert rows[:, 0].tolist() == list(range(n)), rows
    seen = {(c, lo) for _, lo, _, c, _ in rows.tolist()}
    assert len(seen) == n, f"two ranks claim the same (cross_rank, local_rank): {rows}"

    # Sums whose exact values depend on every rank (one larger tensor: several chunks).
    small = hvd.allreduce(torch.tensor([r + 1.0, 2.0 ** r, -float(r)]), op=hvd.Sum,
                          name="sum.small")
    close(small, torch.tensor([n * (n + 1) / 2, 2.0 ** n - 1, -n * (n - 1) / 2]), "sum")
    big = hvd.allreduce(torch.arange(100_000, dtype=torch.int64) * (r + 1), op=hvd.Sum,
                        name="sum.big")
    close(big, torch.arange(100_000, dtype=torch.int64) * (n * (n + 1) // 2), "big sum")
    avg = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Average, name="average")
    close(avg, torch.full((2,), (n - 1) / 2), "average")

    gathered = hvd.allgather(torch.tensor([[10 * r, 10 * r + 1]]), name="gather")
    gathered = gathered.reshape(n, 2)
    close(gathered, torch.tensor([[10 * i, 10 * i + 1] for i in range(n)]), "allgather")

    root = n - 1
    bcast = hvd.broadcast(torch.full((3,), float(100 + r)), root, name="bcast")
    close(bcast, torch.full((3,), float(100 + root)), "broadcast")

    result = {
        "rank": r, "size": n, "local_rank": lr, "local_size": ls,
        "cross_rank": cr, "cross_size": cs,
        "allreduce": small.tolist(), "big_sum_last": int(big[-1]),
        "average": avg.tolist(), "allgather": gathered.tolist(), "broadcast": bcast.tolist(),
        "where": where(),
    }
    print(f"{MARK} {json.dumps(result, sort_keys=True)}", flush=True)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

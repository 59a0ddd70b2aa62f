"""init()/shutdown() 50 times in one process: no thread, file descriptor or
shared-memory segment may be left behind.

Usage: init_loop.py ROUNDS
"""

import glob
import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import done


def resources(pids):
    """Threads and descriptors of this process, segment files of this job (their names
    end with the creating rank's pid)."""
    segments = [f for f in glob.glob("/dev/shm/perseus-*")
                if any(f.endswith(f"-{p}") for p in pids)]
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), len(segments)


def main():
    rounds = int(sys.argv[1])
    base = pids = None
    for k in range(rounds):
        hvd.init()
        r, n = hvd.rank(), hvd.size()
        if pids is None:
            pids = hvd.allgather_object(os.getpid())
        t = hvd.allreduce(torch.full((300_000,), float(r + k)), op=hvd.Sum, name="loop")
        assert t[0].item() == n * k + n * (n - 1) // 2, (k, t[0].item())
        hvd.shutdown()
        if k == 1:
            base = resources(pids)
    after = resources(pids)
    assert after == base, f"rank {r}: (threads, fds, shm segments) {base} after round 2, " \
                          f"{after} after round {rounds}"
    assert after[2] == 0, f"{after[2]} shared-memory segments left in /dev/shm"
    print(f"rank {r}: threads, fds, segments stable at {after}", flush=True)
    done(r)


if __name__ == "__main__":
    main()

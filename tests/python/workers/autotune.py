"""HOROVOD_AUTOTUNE: steps of named allreduces while rank 0 tries fusion thresholds
and cycle times; every step's sums must be exact on every rank under each setting.

    autotune.py STEPS

Prints the settings changes this rank was sent (``autotune_changes``)."""

import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done

# A step's gradients: small ones that fuse, and one of 1 MiB.
SIZES = {"w1": 3000, "b1": 10, "w2": 1 << 18, "b2": 7, "scale": 1}


def main():
    steps = int(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for i in range(steps):
        ts = {k: torch.full((s,), float(r + 1 + i * j)) for j, (k, s) in enumerate(SIZES.items())}
        hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=k) for k, t in ts.items()]
        for h in hs:
            hvd.synchronize(h)
        for j, (k, t) in enumerate(ts.items()):
            expect = float(sum(q + 1 + i * j for q in range(n)))
            close(t, torch.full_like(t, expect), f"step {i} tensor {k}")
    print(f"rank {r}: autotune_changes {hvd.counters()['autotune_changes']}", flush=True)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

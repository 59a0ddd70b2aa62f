"""Allgather with HOROVOD_HIERARCHICAL_ALLGATHER as the test sets it, on 4 ranks over
two loopback hosts: every rank gets every block (uneven lengths, an empty one, several
dtypes), and rank 0 prints the bytes sent between hosts for the test to compare.
Argument ``mismatch``: rank 0 alone sets it, and the allgather fails on every rank
naming the variable."""

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "check"
if MODE == "mismatch":
    os.environ["HOROVOD_HIERARCHICAL_ALLGATHER"] = str(int(os.environ["PERSEUS_RANK"] == "0"))

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises

hvd.init()
r, n = hvd.rank(), hvd.size()


def rows(k, round_):
    return (k * 7 + round_ * 3) % 11 if k != 1 else 0  # rank 1 sends nothing


if MODE == "mismatch":
    with raises(hvd.HorovodInternalError, "HOROVOD_HIERARCHICAL_ALLGATHER", "hierarchical",
                "flat", what="mixed allgather modes"):
        hvd.allgather(torch.ones(2, 3), name="mixed")
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after"), torch.full((2,), float(n)),
          "the job goes on")
    hvd.shutdown()
    done(r)
    sys.exit(0)

before = hvd.counters()["bytes_inter_host"]
blocks = 0  # bytes of every rank's blocks, over all the allgathers
for round_, dtype in enumerate((torch.float32, torch.int64, torch.float16, torch.uint8)):
    for width in (1, 1000):
        mine = (torch.arange(rows(r, round_) * width) % 97 + r).reshape(-1, width).to(dtype)
        got = hvd.allgather(mine, name=f"ag.{round_}.{width}")
        want = torch.cat([(torch.arange(rows(k, round_) * width) % 97 + k)
                          .reshape(-1, width).to(dtype) for k in range(n)])
        close(got, want, f"allgather {dtype} width {width}")
        blocks += want.numel() * want.element_size()
inter = hvd.counters()["bytes_inter_host"] - before
every = hvd.allgather_object(inter, name="inter")
if r == 0:
    print(f"INTER-HOST BYTES {sum(every)} BLOCKS {blocks}", flush=True)
hvd.shutdown()
done(r)

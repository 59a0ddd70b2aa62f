"""COUNT asynchronous allreduces whose names are LENGTH characters, submitted at once
on every rank (in a different order on each), then every result checked; then a name
one byte over the limit, refused at the call.

Usage: long_names.py COUNT LENGTH
"""

import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import done

count, length = int(sys.argv[1]), int(sys.argv[2])
hvd.init()
rank, size = hvd.rank(), hvd.size()
order = list(range(count))
if rank % 2:
    order.reverse()
handles = {}
for i in order:
    name = f"{i:08d}".rjust(length, "n")
    handles[i] = hvd.allreduce_async(torch.tensor([float(i + rank)]), name=name, op=hvd.Sum)
expected = size * (size - 1) / 2
for i, h in handles.items():
    got = hvd.synchronize(h).item()
    assert got == size * i + expected, (i, got)
print(f"rank {rank}: {count} allreduces of {length}-character names checked", flush=True)

limit = 16 << 10
try:
    hvd.allreduce(torch.ones(1), name="x" * (limit + 1))
except ValueError as e:
    assert f"{limit + 1} bytes long; names may have at most {limit} bytes" in str(e), e
else:
    raise AssertionError("a name over the limit was accepted")
assert hvd.allreduce(torch.ones(1), name="x" * limit, op=hvd.Sum).item() == size
hvd.shutdown()
done(rank)

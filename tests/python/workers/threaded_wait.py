"""A thread waits long on one allreduce while the main thread starts many others.

The waiter asks Python for Ctrl-C every 100 ms, which takes the GIL; the main thread
holds the GIL while it starts an operation. The waiter must not hold the engine's table
of handles meanwhile, or both stop for good (as DDP's bucket thread once did during
backward). Rank 0 starts "late", waits for it on a thread, and starts tiny allreduces
in a tight loop (1.5 s or 30,000 of them, several of the waiter's checks: before the fix
the first one stopped both threads); the others learn how many, start the same ones,
then "late".
"""

import threading
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done

hvd.init()
rank, n = hvd.rank(), hvd.size()
late = torch.full((4,), float(rank + 1))
expected_late = torch.full((4,), float(n * (n + 1) // 2))
busy = []
if rank == 0:
    handle = hvd.allreduce_async(late, name="late", op=hvd.Sum)
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(value=hvd.synchronize(handle)))
    waiter.start()
    end = time.monotonic() + 1.5
    while time.monotonic() < end and len(busy) < 30000:
        busy.append(hvd.allreduce_async(torch.ones(1), name=f"busy.{len(busy)}", op=hvd.Sum))
    count = hvd.broadcast_object(len(busy), root_rank=0, name="count")
else:
    count = hvd.broadcast_object(None, root_rank=0, name="count")
    busy = [hvd.allreduce_async(torch.ones(1), name=f"busy.{i}", op=hvd.Sum)
            for i in range(count)]
    handle = hvd.allreduce_async(late, name="late", op=hvd.Sum)
for i, h in enumerate(busy):
    close(hvd.synchronize(h), torch.full((1,), float(n)), f"rank {rank}: busy.{i}")
if rank == 0:
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "rank 0: the waiting thread never returned"
    result = waited["value"]
else:
    result = hvd.synchronize(handle)
close(result, expected_late, f"rank {rank}: late")
assert count > 100, f"rank {rank}: only {count} operations started in 1.5 s"
print(f"rank {rank}: {count} operations started while a thread waited", flush=True)
hvd.shutdown()
done(rank)

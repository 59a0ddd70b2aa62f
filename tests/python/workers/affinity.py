"""HOROVOD_THREAD_AFFINITY: each rank's engine thread runs on the core the list gives its
local rank; the rank's own threads keep the cores they had.

Imports no framework (the facade alone), so it starts fast."""

import os
import time

from _helpers import done
from perseus.common import basics


def threads():
    """{thread id: (name, the cores it may run on)} of this process."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        with open(f"/proc/self/task/{tid}/status") as f:
            cores = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("Cpus_allowed_list"))
        found[int(tid)] = (name, cores)
    return found


before = os.sched_getaffinity(0)
basics.init()
want = os.environ["HOROVOD_THREAD_AFFINITY"].split(",")[basics.local_rank()].strip()
# The engine thread names and pins itself as it starts, just after init() returns.
deadline = time.monotonic() + 10
while True:
    found = threads()
    engine = [cores for name, cores in found.values() if name == "perseus-engine"]
    if engine == [want] or time.monotonic() > deadline:
        break
    time.sleep(0.01)
assert engine == [want], f"local rank {basics.local_rank()}: {found}"
assert os.sched_getaffinity(0) == before, (before, found)
rank = basics.rank()
basics.shutdown()
done(rank)

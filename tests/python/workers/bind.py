"""PERSEUS_BIND_CORES under perseusrun: ``bound`` (unset, perseusrun's 1) or ``free`` (0).

Bound: after init this rank's thread runs on its local rank's run of the cores the process
had, the ranks' runs are disjoint and together the cores they had, and the engine thread
keeps them all. Free: nothing changes. Imports no framework (the facade alone), so it starts fast."""

import os
import sys
import time

from _helpers import done
from perseus.common import basics
from perseus.common.objects import allgather_object


def engine_cores():
    """The cores the engine thread may run on, once it has started (None: not found)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "perseus-engine":
                    continue
            return os.sched_getaffinity(int(tid))
        time.sleep(0.01)
    return None


before = sorted(os.sched_getaffinity(0))
basics.init()
mine = sorted(os.sched_getaffinity(0))
rank, local, size = basics.rank(), basics.local_rank(), basics.local_size()
every = allgather_object(mine)
assert sorted(engine_cores()) == before, (engine_cores(), before)
if sys.argv[1] == "free":
    assert mine == before, (before, mine)
else:
    each = len(before) // size
    want = before[local * each:(local + 1) * each if local + 1 < size else len(before)]
    assert mine == want, f"local rank {local} of {size}: {mine}, not {want} of {before}"
    assert os.environ.get("PERSEUS_BIND_CORES") == "1", "perseusrun sets it"
    # One host: the shares are disjoint and together every core the ranks had.
    assert sorted(c for share in every for c in share) == before, every
basics.shutdown()
done(rank)

"""Where a lone 4 KiB allreduce spends its time, from the timeline.

    python -m perseus.runner.launch -np 2 python benchmarks/profile_small.py

Each rank writes a timeline (PERSEUS_TIMELINE format) of 200 allreduces separated by
barriers, then reports the median NEGOTIATE_ALLREDUCE span (submission to the coordinator's
answer) and ALLREDUCE span (the data exchange), against the median wall time of the
call. Used for docs/benchmarks.md's account of the small-message targets.
"""

import json
import os
import statistics
import tempfile
import time

import perseus.torch.horovod as hvd
import torch
from perseus.common.timeline import timeline_file


def main():
    hvd.init()
    r = hvd.rank()
    path = os.path.join(tempfile.gettempdir(), f"perseus-profile-{os.getpid()}.json")
    t = torch.ones(1024)
    walls = []
    hvd.start_timeline(path)
    for i in range(200):
        hvd.barrier()
        t0 = time.perf_counter()
        hvd.allreduce_(t, op=hvd.Sum, name="p")
        walls.append(time.perf_counter() - t0)
    hvd.stop_timeline()
    path = timeline_file(path)  # rank r > 0 writes PATH.r
    with open(path) as f:
        events = json.load(f)
    os.unlink(path)
    # Horovod's layout: a pid per tensor, named by its process_name metadata.
    row = next(e["pid"] for e in events
               if e["name"] == "process_name" and e["args"].get("name") == "allreduce.p")
    spans = {k: [e["dur"] for e in events if e["name"] == k and e["pid"] == row]
             for k in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE")}
    print(f"rank {r}: call {statistics.median(walls) * 1e6:.0f} us, "
          f"negotiate {statistics.median(spans['NEGOTIATE_ALLREDUCE']):.0f} us, "
          f"allreduce {statistics.median(spans['ALLREDUCE']):.0f} us (medians of 200)",
          flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""A spawned process that reaches hvd.init() while its rank is still inside its own: rank
0 starts a ``spawn`` child before hvd.init(), and rank 1 holds the job's start for a few
seconds, so the child (which runs this top level again as ``__mp_main__``) reaches
init() while rank 0 waits for rank 1. The child must wait for rank 0's mark and answer
for rank 0, not join the job as a second rank 0 (perseus.common.rank_copy)."""

import multiprocessing
import os
import sys
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done

HOLD = 10  # seconds rank 1 holds the start


def report(queue):
    queue.put((hvd.is_initialized(), hvd.rank(), hvd.size(), hvd.local_rank(),
               os.environ.get("CHILD_REACHED_INIT_AT")))


if __name__ == "__mp_main__":
    # The spawned child: its rank is in init() (waiting for rank 1), unmarked so far.
    assert "PERSEUS_INITIALIZED_IN" not in os.environ
    os.environ["CHILD_REACHED_INIT_AT"] = str(time.time())
    hvd.init()
elif __name__ == "__main__":
    rank = int(os.environ["PERSEUS_RANK"])
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    if rank == 0:
        child = ctx.Process(target=report, args=(queue,))
        child.start()
    else:
        time.sleep(HOLD)
    started = time.time()
    hvd.init()
    inited = time.time()
    if rank == 0:
        ok, r, n, lr, reached = queue.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0, child.exitcode
        assert (ok, r, n, lr) == (True, 0, 2, 0), (ok, r, n, lr)
        # The child really came while rank 0 was still in init().
        assert started < float(reached) < inited, (started, reached, inited)
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after"), torch.full((2,), 2.0),
          "the job has its two ranks")
    hvd.shutdown()
    done(rank)
    sys.exit(0)

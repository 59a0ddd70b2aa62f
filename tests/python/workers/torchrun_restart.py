"""Fault tolerance under torchrun (``--max-restarts``): torchrun restarts every worker
after one fails, and the job goes on from rank 0's checkpoint.

``torchrun_restart.py CKPT``: a scalar trains STEPS steps of an allreduced gradient;
rank 0 checkpoints after each step. In torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT 0) rank 1 exits with status 3 before step FAIL_AT. The
restarted workers start Perseus afresh on the same ports, load rank 0's checkpoint
(broadcast from rank 0) and must end with the model of exactly STEPS steps.
"""

import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import done

STEPS, FAIL_AT, LR = 10, 4, 0.5


def main():
    ckpt = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    hvd.init()
    start, w = 0, torch.zeros(1)
    if hvd.rank() == 0 and os.path.exists(ckpt):
        start, w = torch.load(ckpt)
    start, w = hvd.broadcast_object((start, w), root_rank=0)
    print(f"attempt {attempt} rank {hvd.rank()} starts at step {start}", flush=True)
    for step in range(start, STEPS):
        if attempt == 0 and hvd.rank() == 1 and step == FAIL_AT:
            print(f"rank 1 fails at step {step}", flush=True)
            os._exit(3)
        w -= LR * hvd.allreduce(torch.ones(1), name="grad")  # the average: 1
        if hvd.rank() == 0:
            torch.save((step + 1, w), ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    assert attempt == 1 and start == FAIL_AT, (attempt, start)
    assert abs(w.item() + STEPS * LR) < 1e-6, f"rank {hvd.rank()}: w = {w.item()}"
    done(hvd.rank())


if __name__ == "__main__":
    main()

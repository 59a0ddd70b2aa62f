"""Rank 0 calls allreduce 'grad.layer4'; rank 1 evaluates instead (sleeps in
``evaluate()``), so the job stops moving. Each rank prints READY first; the test then
sends SIGUSR1 to perseusrun and reads its diagnosis. With the argument ``exit``, rank 1
ends with exit code 3 after a second in ``evaluate()`` instead; with ``finish`` its script
ends there without error (as a rank whose data ran out before the others' does); with
``stop`` it stops itself there (SIGSTOP: a frozen process).
"""

import os
import signal
import sys
import time

import perseus.torch.horovod as hvd
import torch


def evaluate():
    if sys.argv[1:] == ["exit"]:
        time.sleep(1.0)
        sys.exit(3)
    if sys.argv[1:] == ["finish"]:
        time.sleep(1.0)
        sys.exit(0)
    if sys.argv[1:] == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)  # the line the diagnosis names


hvd.init()
hvd.allreduce(torch.ones(2), name="warm.up")
print(f"READY rank {hvd.rank()} pid {os.getpid()}", flush=True)
if hvd.rank() == 1:
    evaluate()
else:
    hvd.allreduce(torch.ones(2), name="grad.layer4")

"""PERSEUS_TIMELINE given to every rank. While the job runs each rank reads its own file
with ``json.load`` (whole JSON, the allreduce's row already there); then the script ends,
without ``shutdown()`` unless argv[1] is ``shutdown``: each rank's file must still be
whole JSON (the test reads them)."""

import json
import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, read_timeline_while_running, timeline_rows
from perseus.common.timeline import timeline_file

hvd.init()
n, r = hvd.size(), hvd.rank()
for _ in range(3):
    close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="at.exit"), torch.full((3,), float(n)),
          "allreduce before exit")
path = timeline_file(os.environ["PERSEUS_TIMELINE"], r)
live = read_timeline_while_running(path, "allreduce.at.exit", "NEGOTIATE_ALLREDUCE")
assert "ALLREDUCE" in timeline_rows(live)["allreduce.at.exit"], live
if sys.argv[1:] == ["shutdown"]:
    hvd.shutdown()
    with open(path) as f:
        after = json.load(f)
    assert after[:len(live)] == live and "ALLREDUCE" in timeline_rows(after)["allreduce.at.exit"]
done(r)

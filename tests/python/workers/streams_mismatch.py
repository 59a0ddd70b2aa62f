"""Rank r sets PERSEUS_ALLREDUCE_STREAMS=2+r: init() must fail on both, naming the other.

Imports no framework (the facade alone), so it starts fast.
"""

import os

from perseus.common import basics

rank = int(os.environ["PERSEUS_RANK"])
os.environ["PERSEUS_ALLREDUCE_STREAMS"] = str(2 + rank)
try:
    basics.init()
except ValueError as e:
    msg = str(e)
    assert "PERSEUS_ALLREDUCE_STREAMS" in msg, msg
    assert f"rank {1 - rank} has {3 - rank}" in msg, msg
else:
    raise AssertionError("init() accepted different PERSEUS_ALLREDUCE_STREAMS on the ranks")
assert not basics.is_initialized()
print(f"WORKER OK rank {rank}", flush=True)

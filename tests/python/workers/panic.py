"""A panic in the Rust core becomes a Python exception, never an abort: on rank 0 the
engine thread panics while an operation is pending; it and later operations fail with
HorovodInternalError, and shutdown() returns. A panic inside a call raises there.

Usage: panic.py DIR (2 ranks; rank 0 leaves DIR/rank0-checked once it has seen the errors,
and rank 1 waits for it before shutting down, so that its shutdown cannot reach rank 0
first and fail the pending operation for another reason)
"""

import os
import sys
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import done, raises
from perseus import _core


def main():
    marker = os.path.join(sys.argv[1], "rank0-checked")
    hvd.init()
    r = hvd.rank()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [2.0, 2.0]
    if r == 0:
        try:
            _core._debug_panic("call")
        except BaseException as e:  # noqa: BLE001 (pyo3 PanicException is a BaseException)
            assert "asked this call to panic" in str(e), e
        else:
            raise AssertionError("no exception from a panicking call")
        # Pending when the engine dies: rank 1 never submits it.
        h = hvd.allreduce_async(torch.ones(2), name="pending")
        _core._debug_panic("engine")
        with raises(hvd.HorovodInternalError, "engine thread failed", "asked the engine",
                    what="the pending operation"):
            hvd.synchronize(h)
        with raises(hvd.HorovodInternalError, "engine thread failed", what="a later one"):
            hvd.allreduce(torch.ones(2), name="later")
        open(marker, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "rank 0 never reported its checks"
            time.sleep(0.05)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

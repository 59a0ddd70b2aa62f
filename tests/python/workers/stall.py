"""The last rank does not submit 'stuck' for a while.

Usage: stall.py warn   (PERSEUS_STALL_CHECK_TIME_SECONDS=1: it comes 3 s late; the others
                        wait, rank 0 warns, and the job goes on)
       stall.py fail DONE  (PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2: it never comes; every
                        rank fails with an error naming the tensor and the missing rank; the
                        others wait for the late rank to write the file DONE before they
                        shut down, so that what it checks is the stall's error and not
                        their departure racing it)
"""

import os
import sys
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import done, raises


def main():
    mode = sys.argv[1]
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    late = r == n - 1
    if mode == "warn":
        if late:
            time.sleep(3)
        t = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="stuck")
        assert t.tolist() == [float(n)] * 4
    else:
        missing = f"ranks [{n - 1}]"
        if late:
            time.sleep(5)
            with raises(hvd.HorovodInternalError, "stalled", "'stuck'", missing,
                        what="a later op on the stalled rank"):
                hvd.allreduce(torch.ones(4), name="later")
            open(sys.argv[2], "w").close()
        else:
            with raises(hvd.HorovodInternalError, "stalled", "'stuck'", missing,
                        "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2", what="the stalled op"):
                hvd.allreduce(torch.ones(4), name="stuck")
            deadline = time.monotonic() + 60
            while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
                time.sleep(0.05)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

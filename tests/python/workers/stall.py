"""The last rank does not submit 'stuck' for a while.

Usage: stall.py warn   (PERSEUS_STALL_CHECK_TIME_SECONDS=1: it comes 3 s late; the others
                        wait, rank 0 warns, and the job goes on)
       stall.py fail   (PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2: it never comes; every
                        rank fails with an error naming the tensor and the missing rank; the
                        others shut down and leave at once, and the late rank, which
                        may read the stop only after their streams closed, still reports
                        the stall)
"""

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
        else:
            with raises(hvd.HorovodInternalError, "stalled", "'stuck'", missing,
                        "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=2", what="the stalled op"):
                hvd.allreduce(torch.ones(4), name="stuck")
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

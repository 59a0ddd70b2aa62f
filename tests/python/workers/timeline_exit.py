"""PERSEUS_TIMELINE given to every rank, and the script ends without ``shutdown()``:
each rank's file must still be whole JSON (the test reads them)."""

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done

hvd.init()
n = hvd.size()
close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="at.exit"), torch.full((3,), float(n)),
      "allreduce before exit")
done(hvd.rank())

"""Under mpirun, posing as a job of one rank per host (OMPI_COMM_WORLD_LOCAL_SIZE=1) with
no PERSEUS_MASTER_ADDR, as seed 003's ``mpirun -np 32 -npernode 8 -hostfile ...`` starts
it. ``mpi_hosts.py with-mpi4py``: rank 0's address comes through MPI and the ranks
reduce; ``mpi_hosts.py without-mpi4py``: init() fails on every rank, naming the cures."""

import os
import sys

os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1"
os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = "0"
assert "PERSEUS_MASTER_ADDR" not in os.environ and "MASTER_ADDR" not in os.environ

import perseus.torch.horovod as hvd
import torch
from _helpers import done, raises

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
if sys.argv[1] == "without-mpi4py":
    with raises(ValueError, "needs the address of rank 0", "PERSEUS_MASTER_ADDR",
                "or install mpi4py"):
        hvd.init()
    done(rank)
    sys.exit(0)

hvd.init()
# (cross ranks come from the hosts the ranks really run on: one here)
got = (hvd.rank(), hvd.size(), hvd.local_size())
assert got == (rank, 2, 1), got
assert os.environ["PERSEUS_MASTER_ADDR"], "rank 0's address was not learnt"
total = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, name="sum")
assert total.item() == 3.0, total
names = hvd.allgather_object(os.environ["PERSEUS_MASTER_ADDR"])
assert names[0] == names[1], f"the ranks learnt different addresses: {names}"
hvd.shutdown()
done(rank)

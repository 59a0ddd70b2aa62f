"""A script that calls hvd.init() at its top level, with DataLoader workers started by
each multiprocessing context (fork, spawn, forkserver; forkserver is what Horovod's
examples pick). spawn and forkserver run this top level again in the workers, where
init() must not join the job a second time: every worker answers for its rank
(rank(), size(), local_rank(), is_initialized()), refuses collectives saying why, and the
training goes on, every rank ending with the same weights as one process would.

With EARLY_FORKSERVER=1 in the environment, the forkserver starts before hvd.init(),
as when the script used multiprocessing first: its workers inherit no mark, and find
their rank through the file it keeps (perseus.common.rank_copy).

Usage: loader_workers.py CONTEXT [CONTEXT ...]
"""

import multiprocessing.forkserver
import os
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if __name__ == "__main__" and os.environ.get("EARLY_FORKSERVER") == "1":
    multiprocessing.forkserver.ensure_running()
    assert "PERSEUS_INITIALIZED_IN" not in os.environ

hvd.init()  # at the top level, as many training scripts do

ROWS, BATCH, EPOCHS = 48, 4, 2


def _features(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(3, generator=g, dtype=torch.float64)


class Probe(Dataset):
    """Rows of a fixed regression problem; each item also carries what the worker
    that loaded it saw of Perseus."""

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        try:
            hvd.allreduce(torch.ones(1), name="in.worker")
            refused = "nothing raised"
        except ValueError as e:
            refused = str(e)
        seen = torch.tensor([hvd.is_initialized(), hvd.rank(), hvd.size(), hvd.local_rank(),
                             hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
                             os.getpid(), "not a rank" in refused and "answer for rank" in
                             refused], dtype=torch.int64)
        x = _features(i)
        return x, x.sum(0, keepdim=True), seen


def seed_worker(worker_id):
    # A common worker_init_fn: seed each worker from the rank and the worker's id.
    torch.manual_seed(1000 * hvd.rank() + worker_id)


def train(context):
    ds = Probe()
    sampler = DistributedSampler(ds, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2,
                        multiprocessing_context=context, worker_init_fn=seed_worker,
                        persistent_workers=True)
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    me = (1, hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
          hvd.cross_size())
    workers = set()
    for _ in range(EPOCHS):
        for x, y, seen in loader:
            for row in seen.tolist():
                assert tuple(row[:7]) == me, f"{context}: a worker saw {row[:7]}, not {me}"
                assert row[7] != os.getpid(), f"{context}: loaded in the rank's own process"
                assert row[8] == 1, f"{context}: a worker's collective was not refused clearly"
                workers.add(row[7])
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert len(workers) >= 2, f"{context}: rows came from {workers}"

    # One process on the whole batch: each step's rows of every rank together.
    ref = torch.nn.Linear(3, 1, dtype=torch.float64)
    torch.nn.init.zeros_(ref.weight)
    torch.nn.init.zeros_(ref.bias)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    n, per_rank = hvd.size(), ROWS // hvd.size()
    for _ in range(EPOCHS):
        for b in range(per_rank // BATCH):
            # DistributedSampler without shuffling gives rank r the rows r, r + n, ...
            rows = [r + n * (b * BATCH + k) for r in range(n) for k in range(BATCH)]
            x = torch.stack([_features(i) for i in rows])
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), x.sum(1, keepdim=True)).backward()
            ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), q.detach(), f"{context}: {name}", rtol=1e-10, atol=1e-10)
    # The rank's own collectives still work after its workers ran init().
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"after.{context}")
    close(got, torch.full((2,), float(hvd.size())), f"{context}: allreduce after the loader")


def main():
    for context in sys.argv[1:]:
        train(context)
    done(hvd.rank())


if __name__ == "__main__":
    main()

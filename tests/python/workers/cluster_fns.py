"""Functions the Ray and Spark tests run on their workers (imported there by name)."""

import os


def topology():
    import perseus.torch.horovod as hvd

    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "pid": os.getpid()}


def train(steps=5):
    """Two-rank training with DistributedOptimizer, checked against one process trained on
    the whole batch (computed here too); returns the rank and the largest difference."""
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    x, y = torch.randn(8 * hvd.size(), 5), torch.randn(8 * hvd.size(), 1)
    mine = slice(8 * hvd.rank(), 8 * (hvd.rank() + 1))

    def fit(model, opt, xs, ys):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
        return model

    torch.manual_seed(1)
    alone = torch.nn.Linear(5, 1)
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 1)
    if hvd.rank() == 1:
        with torch.no_grad():
            model.weight.add_(1.0)  # the broadcast must undo this
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    fit(alone, torch.optim.SGD(alone.parameters(), lr=0.1), x, y)
    fit(model, opt, x[mine], y[mine])
    diff = max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), alone.parameters()))
    return hvd.rank(), diff


def fail_on_rank_1():
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom from rank 1")
    hvd.allreduce(torch.ones(1), name="never.answered")
    return "unreachable"


class Counter:
    """An executable: state kept on each actor between execute() calls."""

    def __init__(self, start):
        self.value = start

    def bump(self):
        self.value += 1
        return self.value

"""Functions the Ray and Spark tests run on their workers (imported there by name)."""

import os


def topology():
    import perseus.torch.horovod as hvd

    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "pid": os.getpid(),
            "mark": os.environ.get("PERSEUS_TEST_MARK")}


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


def log_steps(steps=3):
    """Logs ``{"step": i, "rank": rank}`` through ray_logger on every rank (only rank 0's
    reach the driver) and returns the rank."""
    import perseus.torch.horovod as hvd
    from perseus.ray import ray_logger

    hvd.init()
    for i in range(steps):
        ray_logger.log({"step": i, "rank": hvd.rank()})
    return hvd.rank()


def _elastic_state():
    """After ``hvd.init()``: a linear model, its DistributedOptimizer, and their
    TorchState, with a batch counter and the lists ``done`` and ``sizes``."""
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, done=[], sizes=[])
    return model, opt, state


def elastic_train(batches=8, kill_at=3, log=False, kill_parent=False, pid_dir=None):
    """Elastic training with hvd.elastic.run and TorchState: in the first round the worker
    of rank 1 kills its own process at batch ``kill_at``, after rank 0 has already
    changed its state for that batch (uncommitted, so restore must undo it). Every batch
    appends itself to ``state.done`` and the job's size to ``state.sizes``; with ``log``,
    rank 0 logs each committed batch through perseus.ray's ray_logger. With
    ``kill_parent`` rank 1 kills its parent process instead (a Spark agent). With
    ``pid_dir`` each worker leaves its pid there (a file named by it). Returns ``(done, sizes, round, weights)``."""
    import signal

    import perseus.torch.horovod as hvd
    import torch
    from perseus.common import elastic

    if pid_dir:
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    model, opt, state = _elastic_state()

    @hvd.elastic.run
    def train(state):
        while state.batch < batches:
            b = state.batch
            state.done.append(b)
            if b == kill_at and hvd.rank() == 1 and elastic.current_round() == 0:
                os.kill(os.getppid() if kill_parent else os.getpid(), signal.SIGKILL)
            size = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"size.{b}").item())
            torch.manual_seed(100 * b + hvd.rank())
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.sizes.append(size)
            state.batch += 1
            state.commit()
            if log:
                from perseus.ray import ray_logger

                ray_logger.log({"batch": b})
        return (list(state.done), list(state.sizes), elastic.current_round(),
                [p.detach().flatten().tolist() for p in model.parameters()])

    return train(state)


def elastic_grow(marker, want=3, most=600):
    """Elastic training that goes on, a batch every 0.1 s, until the job has ``want``
    workers (or ``most`` batches): rank 0 leaves the file ``marker`` once the first batch
    is done, for the test to add a node then. Every batch commits and appends itself to
    ``state.done`` and the job's size to ``state.sizes``. Returns ``(done, sizes, round)``."""
    import time

    import perseus.torch.horovod as hvd
    import torch
    from perseus.common import elastic

    _, _, state = _elastic_state()

    @hvd.elastic.run
    def train(state):
        while True:
            b = state.batch
            size = int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"size.{b}").item())
            state.done.append(b)
            state.sizes.append(size)
            state.batch += 1
            state.commit()
            if hvd.rank() == 0 and not os.path.exists(marker):
                open(marker, "w").close()
            if size >= want or state.batch >= most:
                return list(state.done), list(state.sizes), elastic.current_round()
            time.sleep(0.1)

    return train(state)

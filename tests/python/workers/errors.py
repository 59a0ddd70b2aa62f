"""Error cases: use before init, bad arguments, and requests that disagree across ranks
(every rank must get HorovodInternalError naming the tensor, and the job must go on)."""

import os

import perseus.torch.horovod as hvd
import torch
from _helpers import close, done, raises
from perseus.common.exceptions import NameInFlightError

NOT_INIT = "not been initialized"


def before_init():
    assert not hvd.is_initialized()
    t = torch.ones(2)
    for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank,
               hvd.cross_size, hvd.barrier, hvd.join, hvd.stop_timeline):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn()
    for fn, args in ((hvd.allreduce, (t,)), (hvd.allreduce_, (t,)), (hvd.allreduce_async, (t,)),
                     (hvd.allgather, (t,)), (hvd.broadcast, (t, 0)), (hvd.broadcast_, (t, 0)),
                     (hvd.alltoall, (t,)), (hvd.reducescatter, (t,)),
                     (hvd.grouped_allreduce, ([t],)), (hvd.broadcast_object, (1,)),
                     (hvd.allgather_object, (1,)), (hvd.add_process_set, ([0],)),
                     (hvd.start_timeline, ("/tmp/x.json",))):
        with raises(ValueError, NOT_INIT, what=f"{fn.__name__} before init"):
            fn(*args)


def bad_arguments(r, n):
    # torch.int16 and uint16 are Horovod's (the dtype sweep covers them); uint32 is not.
    for bad in (torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.uint32)):
        for fn, args in ((hvd.allreduce, ()), (hvd.allreduce_async_, ()), (hvd.allgather, ()),
                         (hvd.broadcast, (0,)), (hvd.alltoall, ()), (hvd.reducescatter, ())):
            with raises(TypeError, str(bad.dtype).replace("torch.", ""),
                        what=f"{fn.__name__} of {bad.dtype}"):
                fn(bad, *args)
    with raises(TypeError, what="not a tensor"):
        hvd.allreduce([1.0, 2.0])
    with raises(ValueError, "Perseus handles CPU and CUDA tensors", what="tensor on another device"):
        hvd.allreduce(torch.zeros(2, device="meta"))
    with raises(TypeError, "Adasum reduces floating-point tensors only, not int32",
                what="Adasum of integers"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    # Horovod raises NotImplementedError (a RuntimeError); the class is a ValueError too.
    for base in (NotImplementedError, RuntimeError, ValueError):
        with raises(base, "Adasum is an allreduce op", what="Adasum reducescatter"):
            hvd.reducescatter(torch.ones(2 * n), op=hvd.Adasum)
    with raises(hvd.UnsupportedOperationError, what="Adasum grouped reducescatter"):
        hvd.grouped_reducescatter([torch.ones(2 * n)], op=hvd.Adasum)
    with raises(ValueError, what="unknown op"):
        hvd.allreduce(torch.ones(2), op=17)
    with raises(ValueError, what="broadcast root out of range"):
        hvd.synchronize(hvd.broadcast_async(torch.ones(2), n + 3))
    with raises(ValueError, what="alltoall splits of the wrong length"):
        hvd.synchronize(hvd.alltoall_async(torch.ones(4, 1), splits=[1] * (n + 1)))
    with raises(ValueError, what="alltoall splits not summing to dim 0"):
        hvd.synchronize(hvd.alltoall_async(torch.ones(4, 1), splits=[5] + [0] * (n - 1)))
    # Splits that are not integers are refused by type on every rank, whatever their values
    # (garbage floats on one rank once left the others waiting in the alltoall).
    garbage = 1e30 if r == 1 else 1.0
    for splits in (torch.full((n,), garbage), torch.ones(n, dtype=torch.float16),
                   torch.ones(n, dtype=torch.bool), [garbage] * n, [True] * n):
        with raises(TypeError, "alltoall splits must be integers",
                    what=f"alltoall splits {splits}"):
            hvd.alltoall(torch.ones(n, 1), splits=splits)
    got, received = hvd.alltoall(torch.ones(n, 1), splits=torch.ones(n, dtype=torch.int64))
    close(got, torch.ones(n, 1), "alltoall after refused splits")
    assert received.dtype == torch.int64 and received.tolist() == [1] * n, received


def mismatches(r, n):
    def expect_internal(name, submit):
        with raises(hvd.HorovodInternalError, name, what=f"mismatch {name}"):
            hvd.synchronize(submit())
        # the engine goes on
        close(hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"after.{name}"),
              torch.full((3,), float(n)), f"allreduce after {name}")

    expect_internal("mm.shape", lambda: hvd.allreduce_async(torch.ones(r + 1), name="mm.shape"))
    expect_internal("mm.dtype", lambda: hvd.allreduce_async(
        torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64), name="mm.dtype"))
    expect_internal("mm.op", lambda: hvd.allreduce_async(
        torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max, name="mm.op"))
    expect_internal("mm.root", lambda: hvd.broadcast_async(
        torch.ones(2), 0 if r == 0 else 1, name="mm.root"))
    expect_internal("mm.bcast.shape", lambda: hvd.broadcast_async_(
        torch.ones(2 + r), 0, name="mm.bcast.shape"))
    expect_internal("mm.gather.dtype", lambda: hvd.allgather_async(
        torch.ones(2, dtype=torch.int32 if r == 0 else torch.int64), name="mm.gather.dtype"))
    expect_internal("mm.rs.shape", lambda: hvd.reducescatter_async(
        torch.ones(n + r, 2), name="mm.rs.shape"))
    expect_internal("mm.kind", lambda: (
        hvd.allreduce_async(torch.ones(2), name="mm.kind") if r == 0
        else hvd.broadcast_async(torch.ones(2), 0, name="mm.kind")))


def duplicate_names(r, n):
    # An operation cannot complete before every rank submitted it; the "gate" allreduces
    # order the ranks so that each second submission meets a first one still in flight.
    msg = "already in flight"
    if r != 0:
        h1 = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="dup")
        with raises(NameInFlightError, "dup", msg, what="second op named dup"):
            hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="dup")
        hvd.allreduce(torch.ones(1), name="gate")
        hvd.allreduce(torch.ones(1), name="gate2")
        h2 = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="dup2")
    else:
        hvd.allreduce(torch.ones(1), name="gate")
        h2 = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="dup2")
        with raises(ValueError, "dup2", msg, what="second op named dup2"):
            hvd.broadcast_async_(torch.ones(2), 0, name="dup2")
        hvd.allreduce(torch.ones(1), name="gate2")
        h1 = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="dup")
    close(hvd.synchronize(h1), torch.full((2,), float(n)), "first dup still completes")
    close(hvd.synchronize(h2), torch.full((2,), float(n)), "first dup2 still completes")


def shared_optimizer_names(r, n):
    """Two DistributedOptimizers over models whose named_parameters() give the same names
    (a GAN's two nn.Sequential): a gradient reduction meeting its namesake in flight
    fails with the way to name them apart. The gate holds rank 1's first one in flight."""
    gen, disc = (torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(2))
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters())
            for m in (gen, disc)]
    for p in (*gen.parameters(), *disc.parameters()):
        p.grad = torch.ones_like(p)
    if r != 0:
        handle, _ = opts[0]._allreduce_grad_async(gen[0].weight)
        with raises(ValueError, "'0.weight'", "already in flight", "named_parameters=[('gen.'",
                    what="two optimizers' gradients of one name"):
            opts[1]._allreduce_grad_async(disc[0].weight)
        hvd.allreduce(torch.ones(1), name="gate3")
    else:
        hvd.allreduce(torch.ones(1), name="gate3")
        handle, _ = opts[0]._allreduce_grad_async(gen[0].weight)
    close(hvd.synchronize(handle), torch.ones(2, 2), "the first of the two names completes")


def forked_child(n):
    """A child forked after init (a DataLoader worker) answers for its rank, takes init()
    again as a no-op, is refused collectives and told why, and the parent's job goes on."""
    r = hvd.rank()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            hvd.init()
            if hvd.is_initialized() and (hvd.rank(), hvd.size()) == (r, n):
                try:
                    hvd.allreduce(torch.ones(2), name="in.child")
                    code = 3
                except ValueError as e:
                    code = 0 if f"a child forked from rank {r}" in str(e) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"forked child exited with {status}"
    close(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.fork"),
          torch.full((2,), float(n)), "allreduce after a fork")


def main():
    before_init()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad_arguments(r, n)
    hvd.barrier()
    mismatches(r, n)
    duplicate_names(r, n)
    shared_optimizer_names(r, n)
    forked_child(n)
    # synchronize twice returns the same result; poll after completion is True
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
    out = hvd.synchronize(h)
    assert hvd.poll(h) and hvd.synchronize(h) is out
    hvd.shutdown()
    with raises(ValueError, NOT_INIT, what="after shutdown"):
        hvd.allreduce(torch.ones(2))
    done(r)


if __name__ == "__main__":
    main()

"""The ``perseus`` backend of torch.distributed: ``torch_backend.py CHECK``.

Every rank makes its inputs from its rank alone, so each can compute what one process
holding every rank's inputs would get (the reference) and compare its own result.

- ``collectives``: every collective, across dtypes, uneven sizes, async works and their
  futures, on the default group and on a subgroup of the first and last ranks; torch's
  functional collectives, eager and under torch.compile;
- ``p2p``: a ring of isend/irecv, batch_isend_irecv, tagged blocking send/recv;
- ``mesh``: a 2 x 2 DeviceMesh (4 ranks), all_reduce along each dimension;
- ``training``: DDP (through DDP's own reducer with PERSEUS_DDP=0, else Perseus's hook)
  and FSDP2's fully_shard equal one process on the whole batch;
- ``gloo``: ``init_process_group("gloo")`` after ``import perseus`` is served by perseus
  (PERSEUS_DDP=0: by gloo itself);
- ``cuda``: CUDA tensors through ``cuda:perseus`` in a device map (a GPU machine), and
  torch's SyncBatchNorm (CUDA only) against BatchNorm on the whole batch;
- ``errors``: ranks that give all_reduce different shapes all raise MismatchError
  naming the shapes, and the next all_reduce works; a collective, a receive and a
  ``wait(timeout)`` that the other ranks reach late raise torch's
  DistBackendError on rank 0 after the group's timeout (3 s, from
  init_process_group) or the wait's, and the job goes on once they arrive.
"""

import os
import sys
import time
from datetime import timedelta

import perseus  # noqa: F401 - registers the backend
import torch
import torch.distributed as dist
from _helpers import close, done, raises, tol
from perseus.common.basics import counters

CHECK = sys.argv[1]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int8, torch.uint8]


def value(r, shape, dtype, salt=0):
    """Rank ``r``'s input: small integers, exact in every dtype."""
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n) * 3 + 7 * r + salt) % 11 + 1
    return base.reshape(shape).to(dtype)


def check_all_reduce(r, n, group, ranks):
    me = ranks.index(r)
    ops = [(dist.ReduceOp.SUM, lambda xs: sum(xs)), (dist.ReduceOp.MAX,
           lambda xs: torch.stack(xs).amax(0)), (dist.ReduceOp.MIN,
           lambda xs: torch.stack(xs).amin(0)), (dist.ReduceOp.PRODUCT,
           lambda xs: torch.stack(xs).prod(0))]
    for dtype in DTYPES:
        for op, ref in ops:
            if op == dist.ReduceOp.PRODUCT and dtype in (torch.int8, torch.uint8):
                continue  # wraps around differently per association
            xs = [value(q, (3, 5), dtype) for q in ranks]
            t = xs[me].clone()
            dist.all_reduce(t, op=op, group=group)
            want = ref([x.double() for x in xs]).to(dtype)
            close(t, want, f"all_reduce {op} {dtype} on {ranks}", *tol(dtype))
        if dtype.is_floating_point:
            t = value(r, (4,), dtype)
            dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
            want = (sum(value(q, (4,), torch.float64) for q in ranks) / len(ranks)).to(dtype)
            close(t, want, f"all_reduce AVG {dtype}", *tol(dtype))
        else:
            for op, fn in ((dist.ReduceOp.BAND, torch.bitwise_and),
                           (dist.ReduceOp.BOR, torch.bitwise_or),
                           (dist.ReduceOp.BXOR, torch.bitwise_xor)):
                xs = [value(q, (6,), dtype) for q in ranks]
                t = xs[me].clone()
                dist.all_reduce(t, op=op, group=group)
                want = xs[0]
                for x in xs[1:]:
                    want = fn(want, x)
                close(t, want, f"all_reduce {op} {dtype}")
    # PREMUL_SUM: each rank's input times the factor, summed (where torch gives the
    # factor to a backend in Python; else refused by name).
    t = value(r, (4,), torch.float32)
    try:
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
    except RuntimeError as e:
        assert "PREMUL_SUM" in str(e), e
    else:
        close(t, 0.5 * sum(value(q, (4,), torch.float32) for q in ranks), "PREMUL_SUM")
    # bool: a sum is an "or", a minimum an "and", as gloo reduces them.
    bits = [value(q, (6,), torch.int64) % 3 == 0 for q in ranks]
    for op, want in ((dist.ReduceOp.SUM, torch.stack(bits).any(0)),
                     (dist.ReduceOp.MIN, torch.stack(bits).all(0))):
        t = bits[me].clone()
        dist.all_reduce(t, op=op, group=group)
        close(t, want, f"all_reduce {op} of bool")
    # A non-contiguous tensor is reduced in place all the same.
    base = value(r, (4, 6), torch.float32)
    view = base.t()
    dist.all_reduce(view, group=group)
    close(base, sum(value(q, (4, 6), torch.float32) for q in ranks), "non-contiguous")
    # Coalesced.
    ts = [value(r, (k + 1,), torch.float32, salt=k) for k in range(3)]
    dist.all_reduce_coalesced(ts, group=group)
    for k, t in enumerate(ts):
        close(t, sum(value(q, (k + 1,), torch.float32, salt=k) for q in ranks), "coalesced")


def check_gathers(r, n, group, ranks):
    me, size = ranks.index(r), len(ranks)
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        # all_gather with a different size on each rank.
        mine = value(r, (me + 1, 2), dtype) if dtype != torch.bool else \
            value(r, (me + 1, 2), torch.int64) % 2 == 0
        outs = [torch.empty((k + 1, 2), dtype=dtype) for k in range(size)]
        dist.all_gather(outs, mine, group=group)
        for k, q in enumerate(ranks):
            want = value(q, (k + 1, 2), dtype) if dtype != torch.bool else \
                value(q, (k + 1, 2), torch.int64) % 2 == 0
            close(outs[k], want, f"all_gather {dtype} from rank {q}")
    x = value(r, (2, 3), torch.float32)
    out = torch.empty(size * 2, 3)
    dist.all_gather_into_tensor(out, x, group=group)
    close(out, torch.cat([value(q, (2, 3), torch.float32) for q in ranks]),
          "all_gather_into_tensor")
    stacked = torch.empty(size, 2, 3)
    dist.all_gather_into_tensor(stacked, x, group=group)
    close(stacked, torch.stack([value(q, (2, 3), torch.float32) for q in ranks]),
          "all_gather_into_tensor, stacked")
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": r, "text": "x" * r}, group=group)
    assert objs == [{"rank": q, "text": "x" * q} for q in ranks], objs
    # gather to the last rank of the group.
    root = ranks[-1]
    got = [torch.empty(3) for _ in ranks] if r == root else None
    dist.gather(value(r, (3,), torch.float32), got, dst=root, group=group)
    if r == root:
        for k, q in enumerate(ranks):
            close(got[k], value(q, (3,), torch.float32), f"gather from {q}")


def check_scatters(r, n, group, ranks):
    me, size = ranks.index(r), len(ranks)
    for root in (ranks[0], ranks[-1]):
        t = value(r, (5,), torch.float64)
        dist.broadcast(t, src=root, group=group)
        close(t, value(root, (5,), torch.float64), f"broadcast from {root}")
        t = value(r, (5,), torch.int32)
        dist.reduce(t, dst=root, group=group)
        want = sum(value(q, (5,), torch.int64) for q in ranks).to(torch.int32) if r == root \
            else value(r, (5,), torch.int32)
        close(t, want, f"reduce to {root}")
        out = torch.empty(2, 2)
        parts = [value(root, (2, 2), torch.float32, salt=k) for k in range(size)] \
            if r == root else None
        dist.scatter(out, parts, src=root, group=group)
        close(out, value(root, (2, 2), torch.float32, salt=me), f"scatter from {root}")
    objs = [{"from": r}] if r == ranks[0] else [None]
    dist.broadcast_object_list(objs, src=ranks[0], group=group)
    assert objs == [{"from": ranks[0]}], objs
    # reduce_scatter_tensor and the list form.
    for op, combine in ((dist.ReduceOp.SUM, sum), (dist.ReduceOp.AVG,
                        lambda xs: sum(xs) / len(xs)), (dist.ReduceOp.MAX,
                        lambda xs: torch.stack(xs).amax(0))):
        full = [value(q, (size * 3,), torch.float32) for q in ranks]
        out = torch.empty(3)
        dist.reduce_scatter_tensor(out, full[me].clone(), op=op, group=group)
        close(out, combine(full)[me * 3:(me + 1) * 3], f"reduce_scatter_tensor {op}")
        out = torch.empty(3)
        dist.reduce_scatter(out, list(full[me].clone().split(3)), op=op, group=group)
        close(out, combine(full)[me * 3:(me + 1) * 3], f"reduce_scatter {op}")


def check_all_to_all(r, n, group, ranks):
    me, size = ranks.index(r), len(ranks)
    # Rank k sends (k + j + 1) rows to rank j.
    sends = [me + j + 1 for j in range(size)]
    rows = sum(sends)
    x = value(r, (rows, 2), torch.float32)
    recvs = [k + me + 1 for k in range(size)]
    out = torch.empty(sum(recvs), 2)
    dist.all_to_all_single(out, x, output_split_sizes=recvs, input_split_sizes=sends,
                           group=group)
    want = []
    for k, q in enumerate(ranks):
        theirs = value(q, (sum(k + j + 1 for j in range(size)), 2), torch.float32)
        start = sum(k + j + 1 for j in range(me))
        want.append(theirs[start:start + k + me + 1])
    close(out, torch.cat(want), "all_to_all_single, uneven")
    even = value(r, (size * 2,), torch.int64)
    out = torch.empty(size * 2, dtype=torch.int64)
    dist.all_to_all_single(out, even, group=group)
    close(out, torch.cat([value(q, (size * 2,), torch.int64)[me * 2:me * 2 + 2]
                          for q in ranks]), "all_to_all_single, even")
    ins = [value(r, (j + 1,), torch.float32, salt=j) for j in range(size)]
    outs = [torch.empty(me + 1) for _ in range(size)]
    dist.all_to_all(outs, ins, group=group)
    for k, q in enumerate(ranks):
        close(outs[k], value(q, (me + 1,), torch.float32, salt=me), f"all_to_all from {q}")


def check_async(r, n, group, ranks):
    t = value(r, (4,), torch.float32)
    work = dist.all_reduce(t, async_op=True, group=group)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    want = sum(value(q, (4,), torch.float32) for q in ranks)
    close(fut.wait(), want * 2, "a future's callback")
    work.wait()
    close(t, want, "all_reduce, async")
    ts = [torch.full((2,), float(k)) for k in range(8)]
    works = [dist.all_reduce(t, async_op=True, group=group) for t in ts]
    for k, w in enumerate(works[::-1]):  # waited for in the other order
        w.wait()
    for k, t in enumerate(ts):
        close(t, torch.full((2,), float(k * len(ranks))), f"work {k}")
    if group is None and hasattr(dist.AllreduceOptions(), "asyncOp"):
        # async_op=True never waits for the others in the lane (DDP's buckets overlap the
        # backward pass); a caller that waits at once takes it (one try in five at least,
        # however loaded the host).
        lane = lambda: counters()["lane_operations"]
        before = lane()
        dist.all_reduce(torch.ones(3), async_op=True).wait()
        assert lane() == before, "an async_op=True all_reduce went through the lane"
        for _ in range(5):
            dist.all_reduce(torch.ones(3))
        assert lane() > before, "no async_op=False all_reduce went through the lane"
    dist.barrier(group=group)


def check_functional(r, n, group, ranks):
    """torch's functional collectives (what torch.compile traces), eager and compiled."""
    import torch.distributed._functional_collectives as fc

    group = group or dist.group.WORLD
    me = ranks.index(r)
    t = value(r, (len(ranks) * 2,), torch.float32)
    total = sum(value(q, (len(ranks) * 2,), torch.float32) for q in ranks)
    close(fc.wait_tensor(fc.all_reduce(t, "sum", group)), total, "functional all_reduce")

    def step(x):
        y = fc.all_reduce(x * 2, "sum", group)
        gathered = fc.all_gather_tensor(y, 0, group)
        return gathered + 1, fc.reduce_scatter_tensor(x, "sum", 0, group)

    gathered, scattered = torch.compile(step, backend="aot_eager")(t)
    close(gathered, torch.cat([total * 2] * len(ranks)) + 1, "compiled all_gather")
    close(scattered, total[me * 2:me * 2 + 2], "compiled reduce_scatter")


def collectives(r, n):
    assert dist.get_backend() == "perseus", dist.get_backend()
    everyone = list(range(n))
    for check in (check_all_reduce, check_gathers, check_scatters, check_all_to_all,
                  check_async, check_functional):
        check(r, n, None, everyone)
    pair = [0, n - 1]
    sub = dist.new_group(pair)
    if r in pair:
        assert dist.get_backend(sub) == "perseus"
        for check in (check_all_reduce, check_gathers, check_scatters, check_all_to_all,
                      check_async):
            check(r, n, sub, pair)
    dist.barrier()


def p2p(r, n):
    out = torch.zeros(4)
    sent = dist.isend(value(r, (4,), torch.float32), (r + 1) % n)
    got = dist.irecv(out, (r - 1) % n)
    sent.wait()
    got.wait()
    close(out, value((r - 1) % n, (4,), torch.float32), "a ring of isend and irecv")
    back = torch.zeros(2, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, value(r, (2,), torch.int64), (r - 1) % n),
           dist.P2POp(dist.irecv, back, (r + 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    close(back, value((r + 1) % n, (2,), torch.int64), "batch_isend_irecv")
    # Two tags between the same ranks, received in the other order.
    if r == 0:
        dist.send(torch.tensor([1.0]), n - 1, tag=1)
        dist.send(torch.tensor([2.0]), n - 1, tag=2)
    elif r == n - 1:
        two, one = torch.zeros(1), torch.zeros(1)
        w2 = dist.irecv(two, 0, tag=2)
        w1 = dist.irecv(one, 0, tag=1)
        w1.wait()
        w2.wait()
        assert (one.item(), two.item()) == (1.0, 2.0), (one, two)
    dist.barrier()


def mesh(r, n):
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = m.get_group(dim)
        ranks = dist.get_process_group_ranks(group)
        assert r in ranks and dist.get_backend(group) == "perseus"
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t, group=group)
        close(t, torch.full((3,), float(sum(q + 1 for q in ranks))), f"mesh {dim} {ranks}")
    dist.barrier()


def training(r, n):
    from torch import nn

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * n, 6, generator=g)
    y = x.sum(1, keepdim=True).cos()
    ref = net()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ropt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ropt.step()
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # FSDP2 is public from torch 2.6
        fully_shard = None
    for kind in ("ddp", "fsdp") if fully_shard is not None else ("ddp",):
        model = net()
        wrapped = nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
        if kind == "fsdp":
            wrapped = fully_shard(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        rows = slice(4 * r, 4 * r + 4)
        for _ in range(3):
            opt.zero_grad()
            ((wrapped(x[rows]) - y[rows]) ** 2).mean().backward()
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            got = p.full_tensor() if kind == "fsdp" else p
            close(got.detach(), q.detach(), f"{kind} after 3 steps", 1e-5, 1e-6)


def gloo(r, n):
    from perseus.torch import backend

    serves = backend.BACKEND_CLASS and os.environ.get("PERSEUS_DDP") != "0"
    want = "perseus" if serves else "gloo"
    assert dist.get_backend() == want, (dist.get_backend(), want)
    t = torch.full((2,), float(r))
    dist.all_reduce(t)
    close(t, torch.full((2,), float(sum(range(n)))), "all_reduce")


def check_sync_batch_norm(r, n, dev):
    """torch's SyncBatchNorm (CUDA only in torch) on the perseus group: each rank's output
    rows, the gradients and the running statistics equal BatchNorm's on the whole batch
    in one process."""
    from torch import nn

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * n, 3, 2, generator=g, dtype=torch.float64)
    ref = nn.BatchNorm1d(3).double()
    xr = x.clone().requires_grad_(True)
    want = ref(xr)
    want.square().sum().backward()  # the loss of every rank's rows, summed
    sync = nn.SyncBatchNorm(3).double().to(dev)
    rows = slice(4 * r, 4 * r + 4)
    xs = x[rows].to(dev).requires_grad_(True)
    out = sync(xs)
    out.square().sum().backward()
    close(out.detach().cpu(), want[rows].detach(), "SyncBatchNorm output", 1e-9, 1e-9)
    close(xs.grad.cpu(), xr.grad[rows], "SyncBatchNorm input gradient", 1e-9, 1e-9)
    for name in ("running_mean", "running_var"):
        close(getattr(sync, name).cpu(), getattr(ref, name), f"SyncBatchNorm {name}",
              1e-9, 1e-9)


def cuda(r, n):
    """CUDA tensors through the perseus backend (``cuda:perseus`` in a device map, gloo
    for the CPU): the core's NCCL or host-staged path, values as on the CPU."""
    dev = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else r)
    torch.cuda.set_device(dev)
    ranks = list(range(n))
    for dtype in (torch.float32, torch.float16, torch.int64):
        t = value(r, (1000,), dtype).to(dev)
        dist.all_reduce(t)
        close(t.cpu(), sum(value(q, (1000,), torch.float64) for q in ranks).to(dtype),
              f"cuda all_reduce {dtype}", *tol(dtype))
    x = value(r, (2, 3), torch.float32).to(dev)
    out = torch.empty(n * 2, 3, device=dev)
    dist.all_gather_into_tensor(out, x)
    close(out.cpu(), torch.cat([value(q, (2, 3), torch.float32) for q in ranks]),
          "cuda all_gather_into_tensor")
    b = value(r, (7,), torch.float32).to(dev)
    dist.broadcast(b, src=n - 1)
    close(b.cpu(), value(n - 1, (7,), torch.float32), "cuda broadcast")
    full = value(r, (n * 4,), torch.float32).to(dev)
    part = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(part, full)
    close(part.cpu(), sum(value(q, (n * 4,), torch.float32) for q in ranks)[r * 4:r * 4 + 4],
          "cuda reduce_scatter_tensor")
    check_sync_batch_norm(r, n, dev)
    # And the CPU half of the map is still gloo's.
    c = torch.full((2,), float(r))
    dist.all_reduce(c)
    close(c, torch.full((2,), float(sum(ranks))), "cpu all_reduce beside")
    torch.cuda.synchronize()


def mismatch(r, n):
    from perseus.common.exceptions import MismatchError

    # The message names the first two ranks that disagree.
    with raises(MismatchError, "Mismatched allreduce tensor shapes",
                "rank 0 sent [3], rank 1 sent [4]",
                what="all_reduce of different shapes"):
        dist.all_reduce(torch.ones(3 + r))
    # The job goes on.
    t = torch.ones(2)
    dist.all_reduce(t)
    close(t, torch.full((2,), float(n)), "all_reduce after the error")


GROUP_TIMEOUT = 3  # seconds: the errors check's init_process_group(timeout=)


def timeouts(r, n):
    """Rank 0 reaches each operation 1.5 s more than its timeout before the others: it
    fails after the group's 3 s (a collective, a receive) or after wait()'s 0.5 s,
    naming the group; once the others arrive the operation completes and the job goes
    on."""

    def on_time(what, call, seconds):
        late = seconds + 1.5
        if r != 0:
            time.sleep(late)
            call()
        else:
            started = time.monotonic()
            with raises(dist.DistBackendError, f"did not finish within {seconds:g} s",
                        f"the group of ranks {list(range(n))}", what=what):
                call()
            took = time.monotonic() - started
            assert seconds - 0.2 < took < late, f"{what}: failed after {took:.1f} s"
        dist.barrier()

    on_time("all_reduce", lambda: dist.all_reduce(torch.ones(3)), GROUP_TIMEOUT)
    on_time("wait(timeout)", lambda: dist.all_reduce(torch.ones(3), async_op=True).wait(
        timedelta(seconds=0.5)), 0.5)
    t = torch.full((2,), float(r))
    on_time("recv", lambda: dist.recv(t, 1) if r == 0 else dist.send(t, 0) if r == 1 else None,
            GROUP_TIMEOUT)
    # rank 0's receive is done now: it holds what rank 1 sent
    if r == 0:
        close(t, torch.ones(2), "the receive that timed out, once rank 1 sent")


def dead(r, n):
    """The last rank exits after one all_reduce: every other rank's next collective
    raises, naming it, and they leave."""
    t = torch.ones(2)
    dist.all_reduce(t)
    if r == n - 1:
        sys.stdout.flush()
        os._exit(3)
    with raises(RuntimeError, f"rank {n - 1}", what=f"rank {r}: all_reduce after a rank left"):
        dist.all_reduce(t)
    done(r)
    sys.stdout.flush()
    os._exit(0)  # the group cannot be torn down without the lost rank


def errors(r, n):
    mismatch(r, n)
    timeouts(r, n)


def main():
    backend = {"gloo": "gloo", "cuda": "cpu:gloo,cuda:perseus"}.get(CHECK, "perseus")
    timeout = {"errors": timedelta(seconds=GROUP_TIMEOUT)}.get(CHECK)
    dist.init_process_group(backend, **({"timeout": timeout} if timeout else {}))
    r, n = dist.get_rank(), dist.get_world_size()
    {"collectives": collectives, "p2p": p2p, "mesh": mesh, "training": training,
     "gloo": gloo, "errors": errors, "dead": dead, "cuda": cuda}[CHECK](r, n)
    done(r)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

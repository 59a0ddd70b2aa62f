"""End to end: samples/s of a communication-bound MLP, DistributedOptimizer vs DDP (gloo).

    python benchmarks/training.py [--ranks 2] [--steps 30] [--quick]

The model has about 25 M float32 parameters and a small batch, so most of a step is
gradient communication. hvd: perseus.torch.horovod.DistributedOptimizer; gloo: torch
DistributedDataParallel on the gloo backend. Same model, batch, steps and threads.
Writes benchmarks/results/training.json for report.py.
"""

import argparse
import time

import harness

IMPLS = ("hvd", "gloo")


def model():
    import torch

    torch.manual_seed(0)
    dims = [2048, 4096, 2048, 2048, 1024, 10]
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def worker(impl, out, steps, batch):
    import torch

    torch.set_num_threads(1)
    comm = harness.Comm(impl)
    net = model()
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if impl == "hvd":
        hvd = comm.hvd
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters())
    else:
        net = torch.nn.parallel.DistributedDataParallel(net)
    x = torch.randn(batch, 2048)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = comm.max_over_ranks(time.perf_counter() - t0)
    result = {"params": params, "batch": batch, "steps": steps,
              "samples_per_s": steps * batch * comm.size / elapsed}
    harness.write_result(out, comm, result)
    comm.close()


def summary(n, results):
    """One line for one rank count."""
    h, g = results["hvd"], results["gloo"]
    return (f"{n} ranks, {h['params'] / 1e6:.1f} M parameters, batch {h['batch']}/rank: "
            f"DistributedOptimizer {h['samples_per_s']:.1f} samples/s, DDP gloo "
            f"{g['samples_per_s']:.1f} samples/s, ratio "
            f"{h['samples_per_s'] / g['samples_per_s']:.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=IMPLS)
    p.add_argument("--out")
    p.add_argument("--ranks", type=int, nargs="*", default=[2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    steps = 5 if a.quick else a.steps
    if a.worker:
        return worker(a.worker, a.out, steps, a.batch)
    args = ["--steps", str(steps), "--batch", str(a.batch)]
    harness.drive(__file__, IMPLS, a.ranks, args, "training", summary)


if __name__ == "__main__":
    main()

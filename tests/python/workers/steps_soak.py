"""Training-like steps through every negotiation path, every result checked.

Each step reduces the same named "model" tensors (allreduce_async with Average, Sum,
pre- and postscale; a grouped allreduce), submitted in an order that differs on every
rank, with values that change every step. So the response cache answers them, and under
PERSEUS_OFFLINE_NEG=1 the ranks run them from the schedule. About one step in four is
irregular, which sends an offline job back to negotiation: an extra tensor, a tensor
left out, a changed shape, a barrier, a broadcast, an allgather, or allreduces on a
process set (alone or beside the step's). The values are small integers, so sums are
exact and every result is compared bit for bit (averages within one rounding).

Usage: steps_soak.py STEPS [--striped] [--seed N]; prints the engine's counters at the end.
"""

import json
import os
import random
import sys

import perseus.torch.horovod as hvd
import torch
from _helpers import done

# name -> (elements, dtype, op, prescale, postscale)
MODEL = {
    "w.bias": (1, torch.float32, "average", 1.0, 1.0),
    "w.small": (100, torch.float32, "average", 1.0, 1.0),
    "w.mid": (3000, torch.float32, "sum", 0.5, 1.0),
    "w.large": (70_000, torch.float32, "average", 1.0, 2.0),
    "w.double": (513, torch.float64, "sum", 1.0, 0.25),
    "w.steps": (7, torch.int32, "sum", 1.0, 1.0),
}
# With --striped: a tensor large enough (2.4 MB) for PERSEUS_ALLREDUCE_STREAMS to cut.
STRIPED = {"w.striped": (600_000, torch.float32, "sum", 1.0, 1.0)}
GROUP = [("g.0", 40), ("g.1", 4097), ("g.2", 9)]
EVENTS = ["extra", "missing", "reshape", "barrier", "broadcast", "allgather", "set",
          "set_only"]


def values(step, key, rank, count, dtype):
    """Small integers from -6 to 6, different for every step, tensor and rank."""
    base = (torch.arange(count, dtype=torch.int64) * 7 + step * 3 + key * 11 + rank * 5) % 13
    return (base - 6).to(dtype)


def reduce_ref(parts, op, pre, post, n):
    total = torch.stack([p.to(torch.float64) for p in parts]).sum(0) * pre * post
    return total / n if op == "average" else total


class Step:
    """What one step submits on this rank, and what each result must be."""

    def __init__(self, step, event, r, n, members):
        self.step, self.event, self.r, self.n = step, event, r, n
        self.members = members  # the ranks of the process set that irregular steps use
        self.jobs = []  # (what, submit(), expected)

    def allreduce(self, name, key, count, dtype, op, pre, post, ranks, process_set):
        if self.r not in ranks:
            return
        mine = values(self.step, key, self.r, count, dtype)
        want = reduce_ref([values(self.step, key, q, count, dtype) for q in ranks], op, pre,
                          post, len(ranks)).to(dtype)
        hop = hvd.Average if op == "average" else hvd.Sum
        self.jobs.append((name, lambda: hvd.allreduce_async(
            mine, op=hop, name=name, prescale_factor=pre, postscale_factor=post,
            process_set=process_set), want))

    def build(self, rng, process_set):
        everyone = list(range(self.n))
        left_out = rng.choice(list(MODEL)) if self.event == "missing" else None
        reshaped = rng.choice(list(MODEL)) if self.event == "reshape" else None
        if self.event != "set_only":
            for key, (name, (count, dtype, op, pre, post)) in enumerate(MODEL.items()):
                if name == left_out:
                    continue
                count = count + 3 if name == reshaped else count
                self.allreduce(name, key, count, dtype, op, pre, post, everyone, None)
            self.grouped()
        if self.event == "extra":
            self.allreduce(f"extra.{self.step}", 50, 33, torch.float32, "sum", 1.0, 1.0,
                           everyone, None)
        if self.event in ("set", "set_only"):
            for j in range(2):
                self.allreduce(f"set.{j}", 60 + j, 200 * (j + 1), torch.float32, "sum", 1.0,
                               1.0, self.members, process_set)
        if self.event == "broadcast":
            root = rng.randrange(self.n)
            t = values(self.step, 70, self.r, 21, torch.float32) if self.r == root else \
                torch.zeros(21)
            self.jobs.append(("broadcast", lambda: hvd.broadcast_async(t, root, name="bcast"),
                              values(self.step, 70, root, 21, torch.float32)))
        if self.event == "allgather":
            rows = [values(self.step, 80, q, 3 * (q + 1), torch.int64) for q in everyone]
            self.jobs.append(("allgather", lambda: hvd.allgather_async(
                rows[self.r], name="gather"), torch.cat(rows)))
        return self

    def grouped(self):
        mine = [values(self.step, 90 + j, self.r, c, torch.float32)
                for j, (_, c) in enumerate(GROUP)]
        want = [reduce_ref([values(self.step, 90 + j, q, c, torch.float32)
                            for q in range(self.n)], "average", 1.0, 1.0, self.n)
                for j, (_, c) in enumerate(GROUP)]
        self.jobs.append(("group", lambda: hvd.grouped_allreduce_async(
            mine, op=hvd.Average, name="group"), [w.float() for w in want]))


def check(what, got, want, step, r):
    pairs = list(zip(got, want)) if isinstance(want, list) else [(got, want)]
    for g, w in pairs:
        exact = not (what.startswith("group") or MODEL.get(what, ("", "", ""))[2] == "average")
        same = torch.equal(g, w) if exact else torch.allclose(g.double(), w.double(),
                                                              rtol=1e-6, atol=1e-6)
        assert g.dtype == w.dtype and g.shape == w.shape and same, \
            f"rank {r}, step {step}: {what} got {g.flatten()[:6].tolist()} " \
            f"want {w.flatten()[:6].tolist()} ({g.dtype}, {tuple(g.shape)})"


def main():
    steps = int(sys.argv[1])
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 3
    if "--striped" in sys.argv:
        MODEL.update(STRIPED)
    os.environ["PERSEUS_CHANGE_HVD_ALLGATHER"] = "1"  # the allgather's rows differ by rank
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    members = [0, n - 1]
    process_set = hvd.add_process_set(members)
    shared, mine = random.Random(seed), random.Random(seed * 1000 + r)
    events = {}
    for s in range(steps):
        event = shared.choice(EVENTS) if shared.random() < 0.25 else "regular"
        events[event] = events.get(event, 0) + 1
        plan = Step(s, event, r, n, members).build(shared, process_set)
        order = plan.jobs[:]
        mine.shuffle(order)
        if event == "barrier":
            cut = mine.randrange(len(order) + 1)
            handles = [(w, submit(), want) for w, submit, want in order[:cut]]
            hvd.barrier()
            handles += [(w, submit(), want) for w, submit, want in order[cut:]]
        else:
            handles = [(w, submit(), want) for w, submit, want in order]
        for what, h, want in handles:
            check(what, hvd.synchronize(h), want, s, r)
    counters = hvd.counters()
    print(f"rank {r}: {steps} steps checked; events {json.dumps(events, sort_keys=True)}; "
          f"counters {json.dumps(counters, sort_keys=True)}", flush=True)
    hvd.remove_process_set(process_set)
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

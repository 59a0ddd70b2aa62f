"""A driver that calls perseus.run (Horovod's horovod.run) with functions defined here,
in the main script, and prints what came back as one JSON line after RUN-RESULT.

Usage: run_function_driver.py MODE (results, pids, raises, exits, mpi, slow, text-output,
elastic, refusals,
or hosts HOSTS: where_am_i on one rank per host, reached through PERSEUS_RSH)

The driver sends functions by reference, as perseus.run does without cloudpickle, even
where cloudpickle is installed (test_run_function.py tests the by-value path).
"""

import io
import json
import os
import sys
import time

sys.modules["cloudpickle"] = None  # import cloudpickle: ImportError, here only

import perseus


class Summary:
    """A result of a class defined in the main script: it comes back as one."""

    def __init__(self, **fields):
        self.fields = fields


def train(scale, offset=0):
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    return Summary(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                   cross_rank=hvd.cross_rank(), value=float(total) * scale + offset,
                   pid=os.getpid())


def fails_on_rank_1():
    """Rank 1 raises at once; rank 0 is still working when the job stops."""
    if os.environ["PERSEUS_RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    time.sleep(60)


def rank_2_exits():
    """Rank 2 dies without a word; the others are still working when the job stops."""
    if os.environ["PERSEUS_RANK"] == "2":
        os._exit(3)
    time.sleep(60)


def where_am_i():
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    return {"rank": hvd.rank(), "netns": os.stat("/proc/self/ns/net").st_ino,
            "sum": float(total)}


def slow(seconds):
    """Never calls hvd.init(): the start timeout counts the task's own check-in."""
    time.sleep(seconds)
    return os.environ["PERSEUS_RANK"]


def speak():
    print(f"rank {os.environ['PERSEUS_RANK']} speaks", flush=True)
    print("to stderr", file=sys.stderr, flush=True)


def elastic_steps(fail_id, steps):
    """An elastic loop of ``steps`` committed steps, each summing 1 over the ranks; the
    worker ``fail_id`` raises at step 2, and the others go on from their last commit."""
    import perseus.torch.horovod as hvd
    import torch

    hvd.init()
    me = os.environ["PERSEUS_ELASTIC_ID"]

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            if me == fail_id and state.step == 2:
                raise ValueError(f"worker {me} cannot go on")
            state.sizes.append(int(hvd.allreduce(torch.ones(1), op=hvd.Sum)))
            state.step += 1
            state.commit()
        return {"worker": me, "rank": hvd.rank(), "size": hvd.size(), "sizes": state.sizes}

    return loop(hvd.elastic.TorchState(step=0, sizes=[]))


def error_of(call):
    try:
        call()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def main(mode):
    if mode == "results":
        got = perseus.run(train, args=(2.0,), kwargs={"offset": 1}, np=3,
                          hosts="127.0.0.1:1,127.0.0.2:2")
        out = [s.fields for s in got]
    elif mode == "pids":
        from perseus.runner import run  # Horovod's horovod.runner.run spelling

        out = [os.getpid()] + run(os.getpid, num_proc=2)
    elif mode == "raises":
        out = error_of(lambda: perseus.run(fails_on_rank_1, np=2))
    elif mode == "exits":
        out = error_of(lambda: perseus.run(rank_2_exits, np=3))
    elif mode == "mpi":  # through mpirun, as perseusrun --mpi
        got = perseus.run(train, args=(1.0,), np=2, use_mpi=True, mpi_args="-x PERSEUS_DEMO=1")
        out = {"results": [s.fields for s in got],
               "raised": error_of(lambda: perseus.run(fails_on_rank_1, np=2, use_mpi=True))}
    elif mode == "slow":
        out = perseus.run(slow, args=(4,), np=2, start_timeout=2)
    elif mode == "hosts":
        out = perseus.run(where_am_i, np=2, hosts=",".join(f"{h}:1" for h in sys.argv[2:]))
    elif mode == "elastic":  # three workers, one fails; then too few are left
        hosts = "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"
        out = {"results": perseus.run(elastic_steps, args=("127.0.0.1[0]", 6), np=3,
                                      min_np=2, hosts=hosts),
               "too_few": error_of(lambda: perseus.run(
                   elastic_steps, args=("127.0.0.1[0]", 6), np=2, min_np=2,
                   hosts="127.0.0.1:1,127.0.0.2:1", elastic_timeout=2))}
    elif mode == "text-output":  # as in a notebook: text streams without a byte buffer
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        try:
            perseus.run(speak, np=2)
        finally:
            (out, err), sys.stdout, sys.stderr = ((sys.stdout.getvalue(), sys.stderr.getvalue()),
                                                  sys.__stdout__, sys.__stderr__)
        out = {"stdout": sorted(out.splitlines()), "stderr": sorted(err.splitlines())}
    else:
        out = {
            "np": error_of(lambda: perseus.run(train, np=0)),
            "both": error_of(lambda: perseus.run(train, np=2, use_mpi=True, use_gloo=True)),
            "mpi_args": error_of(lambda: perseus.run(train, np=2, mpi_args="-x A")),
            "elastic_mpi": error_of(lambda: perseus.run(train, min_np=1, use_mpi=True)),
            "cooldown": error_of(lambda: perseus.run(train, min_np=1, cooldown_range=5)),
            "cooldown_fixed": error_of(lambda: perseus.run(train, np=1,
                                                           cooldown_range=(1, 2))),
            "not_callable": error_of(lambda: perseus.run(42, np=1)),
            "typo": error_of(lambda: perseus.run(train, np=1, hots="localhost:1")),
            "hosts": error_of(lambda: perseus.run(train, np=4, hosts="localhost:2")),
            "lambda": error_of(lambda: perseus.run(lambda: 1, np=1)),
        }
    print("RUN-RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

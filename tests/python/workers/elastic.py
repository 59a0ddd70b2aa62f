"""An elastic job (perseusrun --min-np/--max-np): a scalar model trains STEPS steps, one
commit per step, while workers fail or join; every rank must end with the model that
STEPS steps give, whatever the number of ranks on the way.

``elastic.py fail``: the worker with elastic id FAIL_ID (from the environment) exits
with status 3 before step FAIL_AT of its first round (with FAIL_HOW=stop it stops
itself there instead, SIGSTOP: a frozen worker); the others re-form and go on.
``elastic.py grow HOSTS_FILE``: rank 0 appends a host to the discovery script's file
after step GROW_AT (GROW_HOST, or 127.0.0.3:1); the job takes in the new worker at a
commit after the launcher discovers it (each step sleeps STEP_SLEEP seconds, to give it
the time). With WRAP=1 an ``hvd.DistributedOptimizer`` reduces the gradients.
With HANG_ID set, that worker hangs before ``hvd.init()`` (the launcher must leave it
behind after --start-timeout); with CRASH_ID, it exits with status 5 there.
With RESET_RAISES=1 the reset callback raises RuntimeError (the launcher must stop the
job at once). Each rank prints ``sizes <list>``: the number of ranks at each step.
"""

import os
import signal
import sys
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import done

STEPS, LR = 12, 0.5


def main():
    mode = sys.argv[1]
    me = os.environ["PERSEUS_ELASTIC_ID"]
    if os.environ.get("HANG_ID") == me:
        print(f"worker {me} hangs before init", flush=True)
        time.sleep(600)
    if os.environ.get("CRASH_ID") == me:
        print(f"worker {me} exits before init", flush=True)
        sys.exit(5)
    hvd.init()
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped = os.environ.get("WRAP") == "1"  # hvd.DistributedOptimizer reduces
    if wrapped:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[])
    first_round = [True]

    def on_reset():
        first_round[0] = False
        if os.environ.get("RESET_RAISES") == "1":
            raise RuntimeError(f"the reset callback of worker {me} broke")

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            if (mode == "fail" and first_round[0] and me == os.environ["FAIL_ID"]
                    and state.step == int(os.environ["FAIL_AT"])):
                print(f"worker {me} fails at step {state.step}", flush=True)
                if os.environ.get("FAIL_HOW") == "stop":  # frozen: alive, connected, silent
                    os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(3)
            opt.zero_grad()
            # every rank's gradient is 1 (d/dw of w * 1), and so is their average
            model(torch.ones(1, 1)).sum().backward()
            if not wrapped:
                grad = hvd.allreduce(model.weight.grad, name="grad")
                model.weight.grad.copy_(grad)
            opt.step()
            state.sizes.append(hvd.size())
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))  # time to discover hosts
            state.step += 1
            if mode == "grow" and hvd.rank() == 0 and state.step == int(os.environ["GROW_AT"]):
                with open(sys.argv[2], "a") as f:
                    f.write(os.environ.get("GROW_HOST", "127.0.0.3:1") + "\n")
            state.commit()

    train(state)
    w = model.weight.item()
    assert abs(w + STEPS * LR) < 1e-6, f"worker {me}: w = {w}, not {-STEPS * LR}"
    everyone = hvd.allgather_object((w, state.sizes))
    assert all(x == everyone[0] for x in everyone), everyone
    print(f"worker {me} rank {hvd.rank()} sizes {state.sizes}", flush=True)
    done(hvd.rank())


if __name__ == "__main__":
    main()

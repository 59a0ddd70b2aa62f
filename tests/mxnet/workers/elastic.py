"""Elastic MXNet jobs (perseusrun --min-np/--max-np): a scalar gluon model trains 12
steps with DistributedTrainer and SGD with momentum, under ``hvd.elastic.run`` with
MXNetState. Every rank must end with the weight and momentum of exactly 12 steps.

``elastic.py fail``: commits every 4 steps; the worker with elastic id FAIL_ID exits
with status 3 before step 6 of its first round. The others go back to step 4's commit
(weight, momentum and the optimizer's step counts) and go on.
``elastic.py grow HOSTS_FILE``: commits every step; rank 0 adds a host to the discovery
script's file after step 4. The new worker takes rank 0's weight and momentum.
"""

import os
import sys
import time

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import perseus.mxnet as hvd
from _mxhelpers import done

STEPS, LR, MOMENTUM = 12, 0.5, 0.9


def reference():
    """Weight and momentum after STEPS steps of gradient 1 (the average of every rank's)."""
    w = mom = 0.0
    for _ in range(STEPS):
        mom = MOMENTUM * mom - LR * 1.0
        w += mom
    return w, mom


def main():
    mode = sys.argv[1]
    hvd.init()
    me = os.environ["PERSEUS_ELASTIC_ID"]
    net = mx.gluon.nn.Dense(1, use_bias=False, in_units=1, weight_initializer="zeros")
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": LR, "momentum": MOMENTUM})
    state = hvd.elastic.MXNetState(net.collect_params(), trainer, step=0, sizes=[])
    first_round = [True]
    state.register_reset_callbacks([lambda: first_round.__setitem__(0, False)])
    every = 4 if mode == "fail" else 1

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            if (mode == "fail" and first_round[0] and me == os.environ["FAIL_ID"]
                    and state.step == 6):
                print(f"worker {me} fails at step 6", flush=True)
                os._exit(3)
            with mx.autograd.record():
                loss = net(mx.nd.ones((1, 1))).sum()  # d/dw: 1 on every rank
            loss.backward()
            trainer.step(1)
            state.sizes.append(hvd.size())
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
            state.step += 1
            if mode == "grow" and hvd.rank() == 0 and state.step == 4:
                with open(sys.argv[2], "a") as f:
                    f.write("127.0.0.3:1\n")
            if state.step % every == 0:
                state.commit()

    train(state)
    w = float(net.weight.data().asnumpy()[0, 0])
    mom = float(trainer._updaters[0].states[0].asnumpy()[0, 0])
    want_w, want_mom = reference()
    assert abs(w - want_w) < 1e-4 and abs(mom - want_mom) < 1e-4, \
        f"worker {me}: w {w}, momentum {mom}; want {want_w}, {want_mom}"
    everyone = hvd.allgather_object((w, mom, state.sizes))
    assert all(x == everyone[0] for x in everyone), everyone
    print(f"worker {me} rank {hvd.rank()} sizes {state.sizes} w {w:.4f}", flush=True)
    done(hvd.rank())


if __name__ == "__main__":
    main()

"""One cell of the compatibility matrix for MXNet (scripts/compat-matrix.sh), run as
``perseusrun -np 2 python job_mxnet.py`` in a fresh virtual environment that holds the
wheel and MXNet. Every rank checks values (checks.py) and exits non-zero on the first
that is wrong:

- allreduce (Sum, Average), allgather of unequal first dimensions, broadcast, alltoall
  with splits and reducescatter;
- broadcast_parameters gives every rank rank 0's weights;
- hvd.DistributedTrainer: 2 ranks on half the batch each give what one process gets on
  the whole batch.
"""

import sys

import mxnet as mx
import perseus.mxnet as hvd
from checks import STEPS, Collectives, data, rows, same, weights

OPT = {"learning_rate": 0.1, "momentum": 0.9}


def collectives(rank, n):
    c = Collectives(rank, n)
    t = mx.nd.array
    same(hvd.allreduce(t(c.reduce_in), op=hvd.Sum), c.reduce_sum, "allreduce Sum")
    same(hvd.allreduce(t(c.reduce_in)), c.reduce_average, "allreduce Average")
    same(hvd.allgather(t(c.gather_in)), c.gathered, "allgather of unequal first dimensions")
    same(hvd.broadcast(t(c.broadcast_in), root_rank=c.root), c.broadcast_out, "broadcast")
    received = hvd.alltoall(t(c.alltoall_in), splits=t(c.alltoall_splits, dtype="int32"))
    if isinstance(received, tuple):  # (tensor, received splits) where asked for
        received = received[0]
    same(received, c.alltoall_out, "alltoall")
    same(hvd.reducescatter(t(c.scatter_in), op=hvd.Sum), c.scattered, "reducescatter")


def net_for(seed):
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, activation="tanh", in_units=3),
            mx.gluon.nn.Dense(1, in_units=8))
    net.initialize()
    for p, w in zip(net.collect_params().values(), weights(seed)):
        p.set_data(mx.nd.array(w.T if w.ndim == 2 else w))
    return net


def train(net, trainer, x, y):
    for _ in range(STEPS):
        with mx.autograd.record():
            loss = ((net(mx.nd.array(x)) - mx.nd.array(y)) ** 2).sum()
        loss.backward()
        trainer.step(len(x))


def distributed_trainer(rank, n):
    net = net_for(100 + rank)
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    for got, want in zip(params.values(), net_for(100).collect_params().values()):
        same(got.data(), want.data().asnumpy(), "broadcast_parameters")
    x, y = data(n)
    train(net, hvd.DistributedTrainer(params, "sgd", OPT), x[rows(rank)], y[rows(rank)])
    ref = net_for(100)
    train(ref, mx.gluon.Trainer(ref.collect_params(), "sgd", OPT), x, y)
    for got, want in zip(params.values(), ref.collect_params().values()):
        same(got.data(), want.data().asnumpy(), "DistributedTrainer after training")


def main():
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    assert n >= 2, "run me under perseusrun -np 2"
    collectives(rank, n)
    distributed_trainer(rank, n)
    hvd.shutdown()
    print(f"compat ok: rank {rank} of {n}, mxnet {mx.__version__}, "
          f"Python {sys.version.split()[0]}", flush=True)


if __name__ == "__main__":
    main()

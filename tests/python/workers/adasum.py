"""hvd.allreduce(op=hvd.Adasum) on every rank: each tensor combines as Horovod's Adasum
(pairs of ranks in rank order, level by level), checked against a NumPy reference of
the rule (_adasum_rule.py), for float64, float32 and float16, fused (grouped), in place,
with the pre- and postscale, and identical bits on every rank."""

import numpy as np
import perseus.torch.horovod as hvd
import torch
from _adasum_rule import reference
from _helpers import close, done


def inputs(rank, shape, seed):
    return np.random.RandomState(seed * 100 + rank).randn(*shape)


hvd.init()
r, n = hvd.rank(), hvd.size()

# Orthogonal gradients add up, parallel ones average.
onehot = torch.zeros(n, dtype=torch.float64)
onehot[r] = 2.0
assert torch.equal(hvd.allreduce(onehot, op=hvd.Adasum, name="onehot"),
                   torch.full((n,), 2.0, dtype=torch.float64))
same = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
assert torch.equal(hvd.allreduce(same, op=hvd.Adasum, name="same"), same)

for dtype, rtol, atol in ((torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-6),
                          (torch.float16, 2e-2, 2e-2)):
    what = str(dtype)
    shape = (37, 5)
    mine = torch.tensor(inputs(r, shape, 1), dtype=dtype)
    want = reference([inputs(k, shape, 1).astype(np.float64) if dtype == torch.float64
                      else torch.tensor(inputs(k, shape, 1), dtype=dtype).double().numpy()
                      for k in range(n)]).reshape(shape)
    got = hvd.allreduce(mine, op=hvd.Adasum, name=f"plain.{what}")
    close(got.double(), torch.tensor(want), f"{what} Adasum", rtol=rtol, atol=atol)
    # the pre- and postscale: Adasum(c x) = c Adasum(x)
    scaled = hvd.allreduce(mine, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=3.0,
                           name=f"scaled.{what}")
    close(scaled.double(), torch.tensor(want) * 6, f"{what} scaled", rtol=rtol, atol=6 * atol)
    everyone = hvd.allgather_object(got, name=f"bits.{what}")
    assert all(torch.equal(everyone[0], g) for g in everyone), f"{what}: ranks differ"

# fused: each tensor of a group is combined on its own
a, b = torch.tensor(inputs(r, (100,), 2)), torch.tensor(inputs(r, (3, 7), 3))
ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Adasum, name="group")
close(ga, torch.tensor(reference([inputs(k, (100,), 2) for k in range(n)])), "group a",
      rtol=1e-12, atol=1e-12)
close(gb, torch.tensor(reference([inputs(k, (3, 7), 3) for k in range(n)]).reshape(3, 7)),
      "group b", rtol=1e-12, atol=1e-12)
# in place, asynchronously
c = torch.tensor(inputs(r, (50,), 4))
hvd.synchronize(hvd.allreduce_async_(c, op=hvd.Adasum, name="inplace"))
close(c, torch.tensor(reference([inputs(k, (50,), 4) for k in range(n)])), "in place",
      rtol=1e-12, atol=1e-12)
done(r)

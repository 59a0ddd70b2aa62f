"""Horovod 0.28's MXNet API beyond the collectives: alltoall's two return forms,
grouped_reducescatter, the timeline and the capability checks. argv[1]: a directory for
the timeline."""

import json
import os
import sys

import _mxhelpers  # noqa: F401 - environment first
import mxnet as mx
import numpy as np
import perseus.mxnet as hvd
from _mxhelpers import close, done, raises
from perseus import _core
from perseus.common import basics
from perseus.common.timeline import timeline_file


def alltoall_forms(r, n):
    # Without splits: the received rows alone, in equal blocks.
    sent = mx.nd.array(np.arange(3 * n) + 10 * r)
    out = hvd.alltoall(sent)
    assert isinstance(out, mx.nd.NDArray), f"alltoall without splits returned {type(out)}"
    close(out, np.concatenate([np.arange(3 * r, 3 * r + 3) + 10 * i for i in range(n)]),
          "alltoall without splits")
    # With splits (a list or an NDArray): the rows and how many came from each rank.
    # Rank i sends i + 1 + j rows to rank j, so rank r receives i + 1 + r from rank i.
    splits = [r + 1 + j for j in range(n)]
    rows = mx.nd.array(np.arange(sum(splits)) + 100 * r).reshape((-1, 1))
    for given in (splits, mx.nd.array(splits, dtype="int32")):
        result = hvd.alltoall(rows, splits=given)
        assert isinstance(result, tuple) and len(result) == 2, \
            f"alltoall with splits returned {type(result)}"
        out, received = result
        want = []
        for i in range(n):
            start = sum(i + 1 + j for j in range(r))
            want.append(np.arange(start, start + i + 1 + r) + 100 * i)
        close(out, np.concatenate(want).reshape(-1, 1), f"alltoall with {type(given)} splits")
        close(received, [i + 1 + r for i in range(n)], "alltoall received splits")
        assert received.dtype == np.int32, received.dtype


def grouped_reducescatter_values(r, n):
    a = mx.nd.array(np.arange(2 * n * 3).reshape(2 * n, 3) * (r + 1), dtype="float32")
    b = mx.nd.array(np.full((n + 1,), float(r)), dtype="float64")
    total = n * (n + 1) / 2  # the sum over the ranks of (r + 1)
    outs = hvd.grouped_reducescatter([a, b], op=hvd.Sum, name="grs")
    assert len(outs) == 2
    close(outs[0], np.arange(2 * n * 3).reshape(2 * n, 3)[2 * r:2 * r + 2] * total,
          "grouped_reducescatter Sum (float32)")
    # n + 1 rows: rank 0 gets two, the others one.
    rows = 2 if r == 0 else 1
    close(outs[1], np.full((rows,), n * (n - 1) / 2), "grouped_reducescatter Sum (float64)")
    assert outs[1].dtype == np.float64
    avg = hvd.grouped_reducescatter([a], name="grs.avg")  # Average by default
    close(avg[0], np.arange(2 * n * 3).reshape(2 * n, 3)[2 * r:2 * r + 2] * total / n,
          "grouped_reducescatter Average")
    scaled = hvd.grouped_reducescatter([a], op=hvd.Sum, prescale_factor=3.0,
                                       postscale_factor=0.5, name="grs.scaled")
    close(scaled[0], np.arange(2 * n * 3).reshape(2 * n, 3)[2 * r:2 * r + 2] * total * 1.5,
          "grouped_reducescatter scale factors")
    assert hvd.grouped_reducescatter([]) == []
    with raises(TypeError, "list of NDArrays", what="grouped_reducescatter of one array"):
        hvd.grouped_reducescatter(a)
    with raises(TypeError, "expected an mxnet NDArray", what="grouped_reducescatter numpy"):
        hvd.grouped_reducescatter([np.ones(2)])


def timeline(r, directory):
    path = os.path.join(directory, "mx_timeline.json")
    with raises(ValueError, "file path", what="start_timeline without a path"):
        hvd.start_timeline("")
    hvd.start_timeline(path)
    hvd.allreduce(mx.nd.ones(4), name="mx.timeline.probe")
    hvd.stop_timeline()
    hvd.allreduce(mx.nd.ones(4), name="mx.after.stop")
    mine = timeline_file(path, r)
    with open(mine) as f:
        text = f.read()
    events = json.loads(text)
    # Horovod's layout: a pid per tensor, named <op>.<name> by its process_name metadata.
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e["name"] == "process_name" and "name" in e["args"]}
    probe = [pid for pid, name in rows.items() if name == "allreduce.mx.timeline.probe"]
    assert probe and any(e["ph"] == "X" and e["name"] == "ALLREDUCE" and e["pid"] == probe[0]
                         for e in events), f"no event of the allreduce in {mine}: {text[:2000]}"
    assert "mx.after.stop" not in text, "the timeline went on after stop_timeline"


def capabilities():
    # Perseus has its own transport in Gloo's place, no MPI, DDL, oneCCL or ROCm; CUDA
    # and NCCL follow the build.
    want = {"mpi_threads_supported": False, "mpi_enabled": False, "mpi_built": False,
            "gloo_enabled": True, "gloo_built": True, "ddl_built": False, "ccl_built": False,
            "rocm_built": False, "cuda_built": bool(_core.GPU_BUILT)}
    for name, value in want.items():
        got = getattr(hvd, name)()
        assert got is value, f"{name}() = {got!r}, expected {value!r}"
    assert hvd.nccl_built is basics.nccl_built, "nccl_built is the common one, unchanged"
    assert type(hvd.nccl_built()) is int, "nccl_built() is NCCL's version code, as in Horovod"
    if not _core.GPU_BUILT:
        assert hvd.nccl_built() == 0, "NCCL without the GPU path"


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    alltoall_forms(r, n)
    grouped_reducescatter_values(r, n)
    timeline(r, sys.argv[1])
    capabilities()
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

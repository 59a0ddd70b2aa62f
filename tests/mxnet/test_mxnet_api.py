"""perseus.mxnet against Horovod 0.28's MXNet API (alltoall's return forms,
grouped_reducescatter, the timeline, the capability checks), the PERSEUS_* gradient
switches in DistributedTrainer and DistributedOptimizer, and the KVStore's gradient
pushes (compression, PERSEUS_ALLREDUCE_DTYPE), on 2 ranks (workers/)."""

import functools
import subprocess
import sys

import pytest

# One bfloat16 AMP step of a Dense layer, as workers/amp.py trains (its loss-scale check
# reads the gradients back).
_BF16_PROBE = """
import mxnet as mx
from mxnet.contrib import amp
amp.init(target_dtype="bfloat16")
net = mx.gluon.nn.Dense(1, in_units=3)
net.initialize()
trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
amp.init_trainer(trainer)
with mx.autograd.record():
    loss = net(mx.nd.ones((2, 3))).sum()
    with amp.scale_loss(loss, trainer) as scaled:
        scaled.backward()
trainer.step(2)
"""


def test_alltoall_forms_grouped_reducescatter_timeline_capabilities(run_framework, tmp_path):
    """alltoall returns the rows alone without splits and (rows, received splits) with
    them; grouped_reducescatter's values, scale factors and errors; start/stop_timeline
    write the collective run between them and nothing after; the capability checks."""
    run_framework(2, "api.py", str(tmp_path))


@pytest.mark.parametrize("mode, env", [
    ("nancheck", {"PERSEUS_ALLREDUCE_NANCHECK": "1"}),
    ("accumulate", {"PERSEUS_ACCUMULATE_N_STEPS": "2"}),
    ("downsample", {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2", "PERSEUS_GRADIENT_MOMENTUM": "0.5"}),
])
def test_gradient_switches(run_framework, mode, env):
    """NaN check: FloatingPointError on every rank naming the parameter and rank 1, weights
    unchanged (both parameters of the step, through MXNet's Updater), the next step
    ordinary; accumulation: odd calls leave the weights alone, even calls equal one step on
    both calls' rows; down-sampling: the weights of the rotating half-sends with the
    residual decayed by 0.5, computed here for every rank."""
    run_framework(2, "switches.py", mode, env=env)


def test_perf_check_names_the_slow_rank(run_framework):
    """PERSEUS_PERF_CHECK_N_STEPS=2 with DistributedTrainer: rank 1 computes 0.3 s longer
    each step and says so; rank 0 does not."""
    out = run_framework(2, "switches.py", "perfcheck", env={"PERSEUS_PERF_CHECK_N_STEPS": "2"})
    assert "PERSEUS_PERF_CHECK_N_STEPS: this rank" in out, out
    assert "local rank 1) computed" in out, out
    assert "local rank 0) computed" not in out, out


def test_kvstore_gradient_compression(run_framework):
    """set_gradient_compression: 2bit and 1bit sums equal a reference quantizer with a
    residual over three pushes, a list of device values is quantized once, param_only
    keys and Max stay exact, the packed codes send 1/16 of float32's bytes (2 ranks),
    'none' turns it off, bad parameters raise naming them, and gluon.Trainer's
    compression_params reach the store."""
    run_framework(2, "kvstore_gradients.py", "compression")


def test_kvstore_pushes_are_gradients(run_framework):
    """PERSEUS_ALLREDUCE_DTYPE=0: a Sum push to a weight key travels as float16; a
    param_only key and a Max push stay exact."""
    run_framework(2, "kvstore_gradients.py", "dtype", env={"PERSEUS_ALLREDUCE_DTYPE": "0"})


@functools.cache
def _bfloat16_amp_unavailable():
    """Why MXNet cannot train in bfloat16 on this CPU, else None: its oneDNN builds
    bfloat16 layers only with AVX-512 (an AVX2-only CPU fails in MXNet itself with
    "could not create a primitive descriptor iterator")."""
    probe = subprocess.run([sys.executable, "-c", _BF16_PROBE], capture_output=True,
                           text=True, timeout=120, check=False)
    if probe.returncode == 0:
        return None
    if "primitive descriptor" in probe.stderr:
        return ("MXNet's oneDNN has no bfloat16 layers on this CPU (it needs AVX-512): "
                "one process's bfloat16 AMP step fails in MXNet itself")
    raise AssertionError(f"the bfloat16 AMP probe failed in MXNet:\n{probe.stderr}")


def test_mxnet_amp_with_distributed_trainer(run_framework):
    """mxnet.contrib.amp (bfloat16) with DistributedTrainer, with and without
    amp.unscale: the weights move as one process's AMP training on the whole batch (the
    loss scale and the 1/size each come off once), alike on both ranks, and rank 0's
    overflow skips the step on both."""
    why = _bfloat16_amp_unavailable()
    if why:
        pytest.skip(why)
    run_framework(2, "amp.py")

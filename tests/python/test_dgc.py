"""Seed 000's switches for DistributedOptimizer: deep gradient compression (``--dgc``,
perseus.torch.dgc, docs/dgc.md): the selection and the settings in one process, then
training on 2 and 3 ranks against an independent simulation of every rank's DGC
(workers/dgc.py); the overlapped step (``--overlap-backward-and-step``,
workers/overlap.py) against torch's optimizer on averaged gradients; and perseusrun's
flags reaching the ranks."""

import math
import os
import re
import shlex
import sys

import pytest
import torch
from _launch_helpers import clean_env, run
from perseus.torch import dgc

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dgc.py")


def magnitudes(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).abs()


def test_selection_is_the_exact_top_k_when_the_sample_is_everything():
    x = magnitudes(5000)
    s = dgc.Settings(sample_ratio=1.0)
    got = dgc.select(x, 50, s)
    assert sorted(got.tolist()) == sorted(torch.topk(x, 50).indices.tolist())


@pytest.mark.parametrize("strided", [True, False])
def test_sampled_threshold_takes_between_the_bounds(strided):
    """Without resampling the threshold is adapted until 0.8k to 1.3k entries pass (from
    a sample whose top entry may be far off: one in 1000 here); at most k of them are
    sent, all from the top of the tensor."""
    x = magnitudes(100_000, seed=1)
    k = 100
    for seed in range(20):
        s = dgc.Settings(sample_ratio=0.01, strided_sample=strided, resample=False)
        got = dgc.select(x, k, s, torch.Generator().manual_seed(seed))
        assert 0.8 * k <= got.numel() <= k, got.numel()
        assert len(set(got.tolist())) == got.numel()
        # What was taken is from the top: its least value beats the median by far.
        assert float(x[got].min()) > float(x.median()) * 3


def test_resampling_cuts_to_the_exact_top_of_what_passed():
    x = magnitudes(100_000, seed=2)
    s = dgc.Settings(sample_ratio=0.001, resample=True)
    got = dgc.select(x, 100, s, torch.Generator().manual_seed(0))
    assert got.numel() <= 100
    passed = x >= x[got].min()
    assert int(passed.sum()) >= got.numel()


def test_all_zero_and_tiny_tensors():
    s = dgc.Settings()
    assert dgc.select(torch.zeros(10_000), 10, s).numel() == 10
    assert sorted(dgc.select(magnitudes(3), 5, s).tolist()) == [0, 1, 2]


def test_warmup_ratios():
    s = dgc.Settings(compress_ratio=0.001, warmup_epochs=3)
    got = [s.ratio(e) for e in range(5)]
    want = [0.001 ** (1 / 4), 0.001 ** (2 / 4), 0.001 ** (3 / 4), 0.001, 0.001]
    assert all(math.isclose(a, b) for a, b in zip(got, want)), got
    s = dgc.Settings(compress_ratio=0.001, warmup_epochs=3, warmup_coeff=[0.5, 0.6, 0.7])
    assert [s.ratio(e) for e in range(4)] == [0.5, 0.6, 0.7, 0.001]


@pytest.mark.parametrize("env,fragments", [
    ({"PERSEUS_DGC": "2"}, ["PERSEUS_DGC must be 0 or 1", "'2'"]),
    ({"PERSEUS_DGC_COMPRESS_RATIO": "0"}, ["PERSEUS_DGC_COMPRESS_RATIO", "greater than 0"]),
    ({"PERSEUS_DGC_SAMPLE_RATIO": "x"}, ["PERSEUS_DGC_SAMPLE_RATIO", "'x'"]),
    ({"PERSEUS_DGC_COMPRESS_UPPER_BOUND": "0.5"}, ["UPPER_BOUND", "from 1 to 100"]),
    ({"PERSEUS_DGC_MAX_ADAPTATION_ITERS": "-1"}, ["MAX_ADAPTATION_ITERS", "integer"]),
    ({"PERSEUS_DGC_WARMUP_EPOCHS": "2", "PERSEUS_DGC_WARMUP_COEFF": "0.5"},
     ["has 1 ratios", "PERSEUS_DGC_WARMUP_EPOCHS is 2"]),
    ({"PERSEUS_DGC_WARMUP_EPOCHS": "1", "PERSEUS_DGC_WARMUP_COEFF": "1.5"},
     ["PERSEUS_DGC_WARMUP_COEFF", "'1.5'"]),
    ({"PERSEUS_CLIP_GRAD_FUNC": "l2"}, ["PERSEUS_CLIP_GRAD_FUNC must be norm or value"]),
    ({"PERSEUS_CLIP_GRAD_FUNC": "norm"}, ["needs PERSEUS_CLIP_GRAD_FUNC_PARAMS"]),
])
def test_bad_settings_name_the_variable(monkeypatch, env, fragments):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:
        dgc.Settings.from_env()
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_settings_from_the_environment(monkeypatch):
    for k, v in {"PERSEUS_DGC": "true", "PERSEUS_DGC_COMPRESS_RATIO": "0.01",
                 "PERSEUS_DGC_FP16_VALUES": "1", "PERSEUS_DGC_INT32_INDICES": "1",
                 "PERSEUS_DGC_STRIDED_SAMPLE": "false", "PERSEUS_DGC_WARMUP_EPOCHS": "2",
                 "PERSEUS_DGC_WARMUP_COEFF": "0.5 0.25", "PERSEUS_CLIP_GRAD_FUNC": "Value",
                 "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.01"}.items():
        monkeypatch.setenv(k, v)
    s = dgc.Settings.from_env()
    assert (s.on, s.compress_ratio, s.fp16_values, s.int32_indices, s.strided_sample) == \
        (True, 0.01, True, True, False)
    assert (s.warmup_coeff, s.clip_grad_func, s.clip_grad_param) == ([0.5, 0.25], "value", 0.01)


def dgc_env(**extra):
    env = {"PERSEUS_DGC": "1", "PERSEUS_DGC_COMPRESS_RATIO": "0.05",
           "PERSEUS_DGC_SAMPLE_RATIO": "1"}
    env.update(extra)
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,extra", [
    (2, {}),
    (3, {"NESTEROV": "1", "PERSEUS_DGC_FP16_VALUES": "1", "PERSEUS_DGC_INT32_INDICES": "1"}),
    (2, {"PERSEUS_DGC_MOMENTUM_MASKING": "0", "PERSEUS_CLIP_GRAD_FUNC": "norm",
         "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.05"}),
    (2, {"PERSEUS_CLIP_GRAD_FUNC": "value", "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.01"}),
    (2, {"PERSEUS_OVERLAP_BACKWARD_AND_STEP": "1", "PERSEUS_CLIP_GRAD_FUNC": "value",
         "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.01"}),
], ids=["plain", "nesterov-fp16-int32", "unmasked-clip-norm", "clip-value", "overlapped"])
def test_dgc_training_matches_a_simulation_of_every_rank(run_workers, n, extra):
    run_workers(n, "dgc.py", "exact", env=dgc_env(**extra))


@pytest.mark.timeout(120)
def test_sampled_threshold_in_training(run_workers):
    run_workers(2, "dgc.py", "sampled",
                env={"PERSEUS_DGC": "1", "PERSEUS_DGC_COMPRESS_RATIO": "0.001"})


@pytest.mark.timeout(120)
def test_warmup_follows_the_sampler_epoch(run_workers):
    run_workers(2, "dgc.py", "warmup", env=dgc_env(
        PERSEUS_DGC_COMPRESS_RATIO="0.01", PERSEUS_DGC_WARMUP_EPOCHS="2",
        PERSEUS_DGC_WARMUP_COEFF="0.5 0.25"))


@pytest.mark.timeout(120)
def test_state_dict_carries_what_dgc_holds_back(run_workers):
    run_workers(2, "dgc.py", "resume", env=dgc_env())


@pytest.mark.timeout(120)
def test_only_sgd_is_compressed_and_a_closure_is_refused(run_workers):
    run_workers(2, "dgc.py", "refused", env={"PERSEUS_DGC": "1"})


@pytest.mark.timeout(120)
def test_perseusrun_flags_set_the_variables():
    """perseusrun --dgc and its options reach every rank as PERSEUS_DGC* variables, and
    the training they drive matches the simulation."""
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", "2", "--dgc",
           "--compress-ratio", "0.05", "--sample-ratio", "1", "--fp16-values", "true",
           "--clip-grad-func", "value", "--clip-grad-func-params", "0.01",
           sys.executable, WORKER, "exact"]
    rc, out = run(cmd, clean_env(OMP_NUM_THREADS=1), timeout=100)
    assert rc == 0 and out.count("WORKER OK") == 2, out
    assert out.count("k=10 of 200, weights as simulated") == 2, out


def perseusrun_error(capsys, argv):
    from perseus.runner import launch

    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_perseusrun_flags_map_to_variables():
    from perseus.runner import launch

    args = launch.parse_args(shlex.split(
        "-np 2 --dgc --warmup-epochs 3 --warmup-coeff 0.5 0.6 0.7 --fp16-values true "
        "--int32-indices 0 --nccl-hierarchical-allreduce --fuse-optimizer "
        "python train.py --warmup-coeff 1 2"))
    assert args.command == ["python", "train.py", "--warmup-coeff", "1", "2"]
    assert launch.acceleration_env(args) == {
        "PERSEUS_DGC": "1", "PERSEUS_DGC_WARMUP_EPOCHS": "3",
        "PERSEUS_DGC_WARMUP_COEFF": "0.5 0.6 0.7", "PERSEUS_DGC_FP16_VALUES": "1",
        "PERSEUS_DGC_INT32_INDICES": "0", "PERSEUS_ALLREDUCE_MODE": "1",
        "PERSEUS_FUSED_OPTIMIZER": "1"}
    plain = launch.parse_args(["-np", "2", "python", "train.py"])
    assert launch.acceleration_env(plain) == {}


@pytest.mark.parametrize("argv,fragments", [
    ("--compress-ratio 0.1 --sample-ratio 0.5", ["--compress-ratio, --sample-ratio",
                                                  "act only with --dgc"]),
    ("--clip-grad-func value --clip-grad-func-params 1",
     ["--clip-grad-func, --clip-grad-func-params",
      "act only with --dgc or --overlap-backward-and-step"]),
    ("--overlap-backward-and-step --clip-grad-func norm", ["needs PERSEUS_CLIP_GRAD_FUNC_PARAMS"]),
    ("--dgc --compress-ratio 2", ["PERSEUS_DGC_COMPRESS_RATIO", "'2'"]),
    ("--dgc --warmup-epochs 2 --warmup-coeff 0.5", ["has 1 ratios", "WARMUP_EPOCHS is 2"]),
    ("--dgc --fp16-values maybe", ["--fp16-values", "expected true or false"]),
    ("--dgc --clip-grad-func l1", ["--clip-grad-func", "invalid choice"]),
    ("--dgc --clip-grad-func norm", ["needs PERSEUS_CLIP_GRAD_FUNC_PARAMS"]),
])
def test_perseusrun_refuses_bad_flags(capsys, argv, fragments):
    err = perseusrun_error(capsys, ["-np", "2", *argv.split(), "python", "train.py"])
    for f in fragments:
        assert f in err, err


def test_epoch_must_be_a_count():
    with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
        dgc.set_epoch(-1)
    dgc.set_epoch(4)
    assert dgc.current_epoch() == 4
    dgc.set_epoch(0)


OVERLAP = {"PERSEUS_OVERLAP_BACKWARD_AND_STEP": "1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,n,extra", [
    ("sgd", 2, {}),
    ("adam", 3, {}),
    ("sgd", 2, {"PERSEUS_CLIP_GRAD_FUNC": "norm", "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.05"}),
    ("adam", 2, {"PERSEUS_CLIP_GRAD_FUNC": "value", "PERSEUS_CLIP_GRAD_FUNC_PARAMS": "0.02"}),
], ids=["sgd", "adam-3-ranks", "sgd-clip-norm", "adam-clip-value"])
def test_overlapped_step_matches_averaged_gradients(run_workers, kind, n, extra):
    """Seed 000's --overlap-backward-and-step: the last layer steps during backward, and
    the models end as torch's optimizer on the averaged (clipped) gradients leaves them."""
    out = run_workers(n, "overlap.py", kind, env=dict(OVERLAP, **extra))
    # every rank, and the step during backward at least once (overlap.py says why not
    # always)
    assert len(re.findall(r"stepped during backward [1-6] of 6", out)) == n, out


@pytest.mark.timeout(120)
def test_overlapped_step_after_explicit_synchronize(run_workers):
    """synchronize() then step() under skip_synchronize() steps no parameter twice; a
    clip after a backward that stepped parameters warns, once, that it cannot reach them."""
    run_workers(2, "overlap.py", "explicit", env=OVERLAP)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [{}, {"PERSEUS_ALLREDUCE_NANCHECK": "1"}],
                         ids=["closure", "nancheck"])
def test_overlap_refusals(run_workers, extra):
    run_workers(2, "overlap.py", "refused", env=dict(OVERLAP, **extra))


def test_core_fold_select_matches_torch():
    """_core.dgc_fold_select: one pass folds like torch's operations and finds what passes."""
    from perseus import _core
    from torch.utils.dlpack import to_dlpack as cap

    gen = torch.Generator().manual_seed(5)
    n = 200_003
    for m, d, nesterov in [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.2, True)]:
        g, u, v = (torch.randn(n, generator=gen) for _ in range(3))
        ru, rv = u.clone(), v.clone()
        dgc._fold(g, ru, rv, (m, d, nesterov))
        out = torch.full((50_000,), -1, dtype=torch.int64)
        count = _core.dgc_fold_select(cap(g), cap(u), cap(v), m, d, nesterov, 2.5, cap(out))
        torch.testing.assert_close(u, ru)
        torch.testing.assert_close(v, rv)
        want = torch.nonzero(rv.abs() >= 2.5).view(-1)
        assert count == want.numel() and count <= 50_000, (count, want.numel())
        assert torch.equal(out[:count], want)
    small = torch.empty(3, dtype=torch.int64)
    assert _core.dgc_fold_select(cap(g), cap(u), cap(v), 0.0, 0.0, False, 0.0,
                                 cap(small)) == n
    with pytest.raises(TypeError, match="u is .*F64, not F32"):
        _core.dgc_fold_select(cap(g), cap(u.double()), cap(v), 0.0, 0.0, False, 1.0, cap(out))
    with pytest.raises(ValueError, match="hold 200003, 5 and 200003 elements"):
        _core.dgc_fold_select(cap(g), cap(u[:5].clone()), cap(v), 0.0, 0.0, False, 1.0,
                              cap(out))

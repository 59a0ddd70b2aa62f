"""Gradient switches a front-end or an optimizer does not apply are named, once."""

import warnings

import pytest


def test_accelerations_a_front_end_does_not_apply_are_named_once():
    from perseus.common.gradients import warn_unapplied

    env = {"PERSEUS_DGC": "1", "PERSEUS_OVERLAP_BACKWARD_AND_STEP": "0",
           "AIAK_FUSED_OPTIMIZER": "1"}
    with pytest.warns(RuntimeWarning) as seen:
        assert warn_unapplied("the test's trainer", environ=env) == [
            "PERSEUS_DGC", "PERSEUS_FUSED_OPTIMIZER"]
    assert [str(w.message) for w in seen] == [
        ("PERSEUS_DGC=1 (--dgc) acts on torch's hvd.DistributedOptimizer only: the test's "
         "trainer trains without it"),
        ("PERSEUS_FUSED_OPTIMIZER=1 (--fuse-optimizer) acts on torch's "
         "hvd.DistributedOptimizer only: the test's trainer trains without it")]
    assert warn_unapplied("the test's trainer", environ=env) == []  # once per process
    # DDP takes the fused step (import perseus), so only DGC is named there
    with pytest.warns(RuntimeWarning, match="the test's DDP trains without it"):
        assert warn_unapplied("the test's DDP", fused_applies=True,
                              environ=dict(env, PERSEUS_FUSED_OPTIMIZER="1")) == ["PERSEUS_DGC"]
    assert warn_unapplied("a plain job", environ={}) == []


def test_adasum_optimizers_name_the_gradient_switches_they_do_not_apply():
    from perseus.common.gradients import warn_adasum_unapplied

    cfg = {"PERSEUS_ACCUMULATE_N_STEPS": "4", "PERSEUS_ALLREDUCE_NANCHECK": "1",
           "PERSEUS_DOWNSAMPLE_N_ELEMENTS": "1", "PERSEUS_PERF_CHECK_N_STEPS": "0"}
    with pytest.warns(RuntimeWarning) as seen:
        assert warn_adasum_unapplied(cfg=cfg) == ["PERSEUS_ACCUMULATE_N_STEPS",
                                                  "PERSEUS_ALLREDUCE_NANCHECK"]
    assert [str(w.message) for w in seen] == [
        ("PERSEUS_ACCUMULATE_N_STEPS, PERSEUS_ALLREDUCE_NANCHECK act on gradient allreduces: "
         "DistributedOptimizer(op=Adasum) reduces weight changes and trains without them")]
    with pytest.warns(RuntimeWarning, match="DOWNSAMPLE_N_ELEMENTS, PERSEUS_PERF_CHECK"):
        assert warn_adasum_unapplied(cfg={"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "2",
                                          "PERSEUS_PERF_CHECK_N_STEPS": "5"}) == [
            "PERSEUS_DOWNSAMPLE_N_ELEMENTS", "PERSEUS_PERF_CHECK_N_STEPS"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_adasum_unapplied(cfg={}) == []

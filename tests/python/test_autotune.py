"""HOROVOD_AUTOTUNE (perseusrun --autotune): rank 0 tries fusion thresholds and cycle
times on a training-like loop, logs each sample, keeps the best and tells every rank;
sums stay exact under every setting tried."""

import csv
import re

import pytest
from conftest import launch

pytest.importorskip("torch")

TUNE = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [3])
def test_autotune_samples_settings_keeps_the_best_and_every_rank_follows(run_workers,
                                                                          tmp_path, n):
    log = tmp_path / "autotune.csv"
    out = run_workers(n, "autotune.py", 80, env={**TUNE, "HOROVOD_AUTOTUNE_LOG": str(log)})
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["warmup"] + ["sample"] * 5 + ["best"], rows
    settings = [(r["fusion_threshold_bytes"], r["cycle_time_ms"]) for r in rows]
    # One host: the hierarchy does not apply, so the mode is not a knob.
    assert {r["hierarchical_allreduce"] for r in rows} == {"-"}, rows
    # Warmup and the first sample run the defaults; each later sample a new setting.
    assert settings[0] == settings[1] == (str(64 << 20), "1"), rows
    assert len(set(settings[1:6])) == 5, rows
    assert settings[6] in settings[1:6], rows
    for r in rows[:6]:
        # 2 steps of the worker's 5 tensors, float32.
        assert r["steps"] == "2" and int(r["bytes"]) == 2 * 4 * (3018 + (1 << 18)), r
        assert float(r["score_bytes_per_second"]) > 0, r
    fusion, cycle = settings[6]
    assert re.search(rf"autotune: after 5 samples, keeping HOROVOD_FUSION_THRESHOLD={fusion} "
                     rf"HOROVOD_CYCLE_TIME={re.escape(cycle)}\n", out), out
    # Every rank was sent each change: one per new sample, one more unless the best
    # was the last sample's setting.
    changes = sum(a != b for a, b in zip(settings[1:], settings[2:]))
    got = re.findall(r"rank (\d+): autotune_changes (\d+)", out)
    assert sorted(int(r) for r, _ in got) == list(range(n)), out
    assert {int(c) for _, c in got} == {changes}, (out, settings)


@pytest.mark.timeout(180)
def test_on_hosts_that_allow_a_hierarchy_the_flat_ring_is_tried_too(run_workers, tmp_path):
    log = tmp_path / "autotune.csv"
    out = run_workers(4, "autotune.py", 60, hosts="127.0.0.1:2,127.0.0.2:2",
                      env={**TUNE, "HOROVOD_AUTOTUNE_LOG": str(log)})
    with open(log) as f:
        rows = list(csv.DictReader(f))
    modes = [r["hierarchical_allreduce"] for r in rows]
    # The defaults (the hierarchy), then the setting farthest from them: the flat ring.
    assert modes[:3] == ["1", "1", "0"], rows
    kept = modes[-1]
    assert re.search(rf"autotune: after 5 samples, keeping .* PERSEUS_ALLREDUCE_MODE={kept}\n",
                     out), out
    got = re.findall(r"rank (\d+): autotune_changes (\d+)", out)
    assert len(got) == 4 and len({c for _, c in got}) == 1, out


@pytest.mark.timeout(120)
def test_settings_given_by_hand_are_held_and_an_unwritable_log_fails_clearly(run_workers,
                                                                             tmp_path):
    log = tmp_path / "fixed.csv"
    env = {**TUNE, "HOROVOD_AUTOTUNE_LOG": str(log), "HOROVOD_FUSION_THRESHOLD": "1048576"}
    run_workers(2, "autotune.py", 60, env=env)
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert {r["fusion_threshold_bytes"] for r in rows} == {"1048576"}, rows
    assert len({r["cycle_time_ms"] for r in rows if r["phase"] == "sample"}) == 5, rows

    bad = str(tmp_path / "no-such-dir" / "log.csv")
    rc, stdout, stderr = launch(2, "autotune.py", 5, env={**TUNE, "HOROVOD_AUTOTUNE_LOG": bad},
                                timeout=90)
    assert rc not in (0, "timeout"), (rc, stdout, stderr)
    assert f"HOROVOD_AUTOTUNE_LOG={bad}: cannot write the autotune log" in stderr, stderr

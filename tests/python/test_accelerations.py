"""The PERSEUS_* switches of issue 5, each through its effect on results and counters."""

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_accumulate_n_steps(run_workers, n):
    """N steps of batch B equal one step of N*B; only every N-th step communicates."""
    run_workers(n, "accelerations.py", "accumulate", env={"PERSEUS_ACCUMULATE_N_STEPS": "2"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_nancheck(run_workers, n):
    """A NaN or overflow fails the step on every rank, naming tensors and ranks."""
    run_workers(n, "accelerations.py", "nancheck", env={"PERSEUS_ALLREDUCE_NANCHECK": "1"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,fusion", [(2, "0"), (2, "4"), (3, "2")])
def test_allreduce_fusion(run_workers, n, fusion):
    """Fused buffers never exceed 1/N of the gradient bytes; 0 fuses nothing."""
    run_workers(n, "accelerations.py", "fusion", fusion,
                env={"PERSEUS_ALLREDUCE_FUSION": fusion})


@pytest.mark.timeout(120)
def test_perseus_variable_wins_and_init_says_so(run_workers):
    """Set with HOROVOD_FUSION_THRESHOLD, PERSEUS_ALLREDUCE_FUSION decides; rank 0 says so."""
    out = run_workers(2, "accelerations.py", "fusion", "4",
                      env={"PERSEUS_ALLREDUCE_FUSION": "4", "HOROVOD_FUSION_THRESHOLD": "0"})
    said = [line for line in out.splitlines()
            if "PERSEUS_ALLREDUCE_FUSION=4 takes precedence over HOROVOD_FUSION_THRESHOLD=0"
            in line]
    assert len(said) == 1, out

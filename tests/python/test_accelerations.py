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

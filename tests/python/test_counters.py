"""The engine's counters, as users and the PERSEUS_* switch tests read them."""

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0"])
def test_counters(run_workers, n, shm):
    """Exact ring byte counts over shared memory and TCP, tensors, cache hits."""
    run_workers(n, "counters.py", env={"PERSEUS_SHM": shm})

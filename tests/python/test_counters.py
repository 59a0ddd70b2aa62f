"""The engine's counters, as users and the PERSEUS_* switch tests read them."""

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("shm,direct", [("1", "1"), ("1", "0"), ("0", "1")])
def test_counters(run_workers, n, shm, direct):
    """Exact ring byte counts over shared memory and TCP, tensors, cache hits; a large
    broadcast read from the root's memory (PERSEUS_SHM_DIRECT) or sent down a chain."""
    run_workers(n, "counters.py", env={"PERSEUS_SHM": shm, "PERSEUS_SHM_DIRECT": direct})

"""PERSEUS_OFFLINE_NEG through perseusrun, 2 and 3 ranks, shared memory and TCP."""

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,shm", [(2, "1"), (3, "1"), (3, "0")])
def test_offline_negotiation(run_workers, n, shm):
    """Steps run offline once stable; every change falls back with correct results."""
    run_workers(n, "offline.py", env={"PERSEUS_OFFLINE_NEG": "1", "PERSEUS_SHM": shm})

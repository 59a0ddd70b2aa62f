"""Small blocking allreduces run by the callers through shared memory
(PERSEUS_LANE_BYTES, PERSEUS_LANE_PATIENCE_US; src/transport/lane.rs)."""

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_lane_values_on_every_rank(run_workers, n):
    """Every dtype and op, in place and out of place, with factors: the reference's
    values on every rank, the same bytes on all, and no negotiation. The patience is
    long so that every rank meets every operation in the lane, however loaded the host."""
    run_workers(n, "lane.py", "sweep", env={"PERSEUS_LANE_PATIENCE_US": "5000000"})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_lane_leaves_the_rest_to_the_engine(run_workers, n):
    """Asynchronous calls, other process sets, larger tensors and Adasum are the
    engine's; mismatched operations are given up by every rank and the engine raises its
    error; a rank that comes late finds the others gone to the engine."""
    run_workers(n, "lane.py", "engine")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_on_the_engine_ends_the_others_wait(run_workers, n):
    """An allgather (concatenating, as Horovod's) whose rows pass the limit on one rank
    only: that rank declines the attempt and the others follow it to the engine at once,
    with a patience of seconds (5 s here); the next operation meets in the lane. So does
    a rank waiting in a join: the others' operations do not wait for it."""
    run_workers(n, "lane.py", "decline", env={"PERSEUS_LANE_PATIENCE_US": "5000000",
                                              "PERSEUS_CHANGE_HVD_ALLGATHER": "1"})


@pytest.mark.timeout(150)
def test_lane_off(run_workers):
    """PERSEUS_LANE_BYTES=0: every operation through the engine, results unchanged."""
    run_workers(2, "lane.py", "engine", env={"PERSEUS_LANE_BYTES": "0"})

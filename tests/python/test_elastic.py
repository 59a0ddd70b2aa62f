"""Elastic jobs (seed 004): perseusrun --min-np/--max-np/--host-discovery-script with
``hvd.elastic`` workers (workers/elastic.py). A worker that fails is left behind and the
others go on from their last commit; a host that appears gets a worker, which takes
rank 0's state. Every rank must end with the model of all the steps, none lost or
repeated."""

import re
import sys
from pathlib import Path

import pytest
from _launch_helpers import OK_MARK, clean_env, run

pytest.importorskip("torch")

PY = sys.executable
WORKER = str(Path(__file__).parent / "workers" / "elastic.py")


def perseusrun(flags, *check, timeout=150, **env):
    cmd = [PY, "-m", "perseus.runner.launch", *flags, PY, WORKER, *check]
    return run(cmd, clean_env(OMP_NUM_THREADS=1, GLOO_TIMEOUT_SECONDS=20, **env),
               timeout=timeout)


def sizes(out):
    return {tuple(map(int, re.findall(r"\d+", m))) for m in re.findall(r"sizes \[(.*)\]", out)}


@pytest.mark.timeout(180)
def test_a_failed_worker_is_left_behind_and_the_others_go_on_from_their_last_commit():
    # Three hosts (all this machine); the worker of the first, rank 0, fails at step 5.
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.1[0]", FAIL_AT=5)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert "worker 127.0.0.1[0] failed with exit code 3; host 127.0.0.1 is blacklisted" in out
    assert "round 1: 2 workers (127.0.0.2[0], 127.0.0.3[0])" in out, out
    # five steps on 3 ranks, then the rest on 2; both survivors agree (the worker asserts)
    assert sizes(out) == {(3,) * 5 + (2,) * 7}, out


@pytest.mark.timeout(180)
def test_a_discovered_host_joins_at_the_next_commit_with_rank_0s_state(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    flags = ["-np", "2", "--min-np", "2", "--max-np", "3",
             "--host-discovery-script", f"cat {hosts}"]
    rc, out = perseusrun(flags, "grow", str(hosts), GROW_AT=4, STEP_SLEEP=0.4)
    assert rc == 0 and out.count(OK_MARK) == 3, f"exit {rc}\n{out}"
    assert "round 1: 3 workers (127.0.0.1[0], 127.0.0.2[0], 127.0.0.3[0])" in out, out
    (seen,) = sizes(out)  # one history on every rank, the new one's from rank 0's state
    assert seen[:4] == (2,) * 4 and seen[-1] == 3 and len(seen) == 12, out


@pytest.mark.timeout(120)
def test_too_few_workers_left_fails_the_job_naming_the_limit():
    flags = ["-np", "2", "--min-np", "2", "--elastic-timeout", "3",
             "-H", "127.0.0.1:1,127.0.0.2:1"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.2[0]", FAIL_AT=3)
    assert rc == 1, f"exit {rc}\n{out}"
    assert "fewer than --min-np 2 for 3 s (--elastic-timeout)" in out, out
    assert "blacklisted hosts: ['127.0.0.2']" in out, out


def test_round_places_count_local_and_cross_ranks_as_horovod_does():
    from perseus.common.elastic import parse_table
    from perseus.runner.elastic import places, table_text

    members = [("a[0]", "a"), ("b[0]", "b"), ("a[1]", "a"), ("c[0]", "c")]
    table = places(members)
    # rank, size, local rank, local size, cross rank, cross size
    assert table == {"a[0]": (0, 4, 0, 2, 0, 3), "b[0]": (1, 4, 0, 1, 1, 3),
                     "a[1]": (2, 4, 1, 2, 0, 1), "c[0]": (3, 4, 0, 1, 2, 3)}
    assert parse_table(table_text(table, 7)) == (table, 7)


def test_the_sampler_splits_what_is_left_of_the_epoch_among_the_ranks():
    from perseus.torch.horovod.elastic import ElasticSampler

    sampler = ElasticSampler(list(range(10)), shuffle=False)  # one rank: Perseus not started
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(1, 3)  # the second batch of 3: indices 3, 4, 5
    saved = sampler.state_dict()
    assert saved == {"epoch": 0, "processed_indices": {3, 4, 5}}
    again = ElasticSampler(list(range(10)), shuffle=False)
    again.load_state_dict(saved)
    assert list(again) == [0, 1, 2, 6, 7, 8, 9]
    again.set_epoch(1)
    assert sorted(again) == list(range(10))
    shuffled = ElasticSampler(list(range(10)), seed=3)
    assert sorted(shuffled) == list(range(10)) and list(shuffled) != list(range(10))


@pytest.mark.timeout(150)
def test_the_elastic_example_trains_in_an_elastic_job():
    example = Path(__file__).parents[2] / "examples" / "pytorch_elastic_mnist.py"
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2"]
    cmd = [PY, "-m", "perseus.runner.launch", *flags, PY, str(example), "--epochs", "2",
           "--train-size", "1200", "--test-size", "200"]
    rc, out = run(cmd, clean_env(OMP_NUM_THREADS=1), timeout=120)
    assert rc == 0 and "final loss" in out, f"exit {rc}\n{out}"
    assert "round 0: 2 workers (localhost[0], localhost[1])" in out, out
    assert "epoch 2: test loss" in out and "size 2" in out, out


def test_a_worker_that_cannot_start_stops_the_job_naming_it():
    cmd = [PY, "-m", "perseus.runner.launch", "-np", "1", "--min-np", "1", "/nonexistent/prog"]
    rc, out = run(cmd, clean_env(), timeout=30)
    assert rc == 127, f"exit {rc}\n{out}"
    assert "cannot start worker localhost[0] (/nonexistent/prog): No such file" in out, out

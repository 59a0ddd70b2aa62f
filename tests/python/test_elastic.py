"""Elastic jobs (seed 004): perseusrun --min-np/--max-np/--host-discovery-script with
``hvd.elastic`` workers (workers/elastic.py). A worker that fails is left behind and the
others go on from their last commit; a host that appears gets a worker, which takes
rank 0's state. Every rank must end with the model of all the steps, none lost or
repeated."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _launch_helpers import OK_MARK, clean_env, free_port, run, stop_session

pytest.importorskip("torch")

PY = sys.executable
WORKER = str(Path(__file__).parent / "workers" / "elastic.py")
EXAMPLES = Path(__file__).parents[2] / "examples"
EXAMPLE = str(EXAMPLES / "pytorch_elastic_mnist.py")


def perseusrun(flags, *check, timeout=150, **env):
    cmd = [PY, "-m", "perseus.runner.launch", *flags, PY, WORKER, *check]
    return run(cmd, clean_env(**{"OMP_NUM_THREADS": 1, "GLOO_TIMEOUT_SECONDS": 20, **env}),
               timeout=timeout)


def sizes(out):
    return {tuple(map(int, re.findall(r"\d+", m))) for m in re.findall(r"sizes \[(.*)\]", out)}


def assert_two_then_one_then_two(out):
    """One history on every rank: 2 ranks for 3 steps, then 1 while a failed worker's
    place cools down (at least one step), then 2 again to step 12."""
    (seen,) = sizes(out)
    ones = seen.count(1)
    assert len(seen) == 12 and ones >= 1, out
    assert seen == (2,) * 3 + (1,) * ones + (2,) * (9 - ones), out


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
@pytest.mark.parametrize("frozen", ["127.0.0.1[0]", "127.0.0.2[0]"])
def test_a_frozen_worker_is_killed_and_left_behind_and_the_others_go_on(frozen):
    # The worker stops itself (SIGSTOP) at step 5: alive and connected, it would never
    # leave round 0. The others' engines find it silent within GLOO_TIMEOUT_SECONDS and
    # say so as they leave the round; the launcher kills it and blacklists its host.
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"]
    rank = 0 if frozen == "127.0.0.1[0]" else 1
    rc, out = perseusrun(flags, "fail", FAIL_ID=frozen, FAIL_AT=5, FAIL_HOW="stop",
                         GLOO_TIMEOUT_SECONDS=5)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert re.search(rf"stopping worker {re.escape(frozen)}: worker {re.escape(frozen)} "
                     rf"\(rank {rank}\) answered nothing for GLOO_TIMEOUT_SECONDS, said worker "
                     r"127\.0\.0\.\d\[0\]: it is stopped or frozen", out), out
    host = frozen.split("[")[0]
    assert f"worker {frozen} answers nothing; host {host} is blacklisted" in out, out
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


@pytest.mark.timeout(180)
def test_a_job_started_on_one_worker_grows_with_a_distributed_optimizer(tmp_path):
    # At size 1 the optimizer must still hook its gradients: the job may grow, and the
    # new worker's reductions would otherwise wait for rank 0 forever.
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")
    flags = ["-np", "1", "--min-np", "1", "--max-np", "2",
             "--host-discovery-script", f"cat {hosts}"]
    rc, out = perseusrun(flags, "grow", str(hosts), GROW_AT=4, STEP_SLEEP=0.4, WRAP=1,
                         GROW_HOST="127.0.0.2:1", PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=20)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.2[0])" in out, out
    assert "round 2:" not in out, out  # no stall resets the job
    (seen,) = sizes(out)
    assert seen[:4] == (1,) * 4 and seen[-1] == 2 and len(seen) == 12, out


@pytest.mark.timeout(120)
def test_too_few_workers_left_fails_the_job_naming_the_limit():
    flags = ["-np", "2", "--min-np", "2", "--elastic-timeout", "3",
             "-H", "127.0.0.1:1,127.0.0.2:1"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.2[0]", FAIL_AT=3)
    assert rc == 1, f"exit {rc}\n{out}"
    assert "fewer than --min-np 2 for 3 s (--elastic-timeout)" in out, out
    assert "blacklisted hosts: ['127.0.0.2']" in out, out
    # While it waited, it said what for, at once (then every 30 s).
    assert re.search(r"waiting for workers: 1 slots usable and 1 workers left, fewer than "
                     r"--min-np 2; blacklisted hosts: \['127.0.0.2'\]; the job stops in "
                     r"[23] s \(--elastic-timeout\) unless hosts come", out), out


@pytest.mark.timeout(180)
def test_a_failed_host_comes_back_after_its_cooldown():
    flags = ["-np", "2", "--min-np", "1", "-H", "127.0.0.1:1,127.0.0.2:1",
             "--blacklist-cooldown-range", "1", "30"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.2[0]", FAIL_AT=3, STEP_SLEEP=0.5)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert ("worker 127.0.0.2[0] failed with exit code 3; host 127.0.0.2 is blacklisted "
            "for 1 s (--blacklist-cooldown-range)") in out, out
    assert "host 127.0.0.2 is back from the blacklist" in out, out
    assert "round 2: 2 workers (127.0.0.1[0], 127.0.0.2[0])" in out, out
    assert_two_then_one_then_two(out)


@pytest.mark.timeout(180)
def test_a_failed_worker_of_a_shared_host_costs_only_its_slot():
    # Both workers on one host: the second fails; the first goes on alone (min-np 1),
    # where Horovod blacklisted the host, stopped the survivor and waited for
    # --elastic-timeout.
    hosts = "127.0.0.1:2"
    flags = ["-np", "2", "--min-np", "1", "--host-discovery-script", f"echo {hosts}"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.1[1]", FAIL_AT=3)
    assert rc == 0 and out.count(OK_MARK) == 1, f"exit {rc}\n{out}"
    assert ("worker 127.0.0.1[1] failed with exit code 3; slot 127.0.0.1[1] is blacklisted, "
            "and the job goes on without it") in out, out
    assert "stopping worker 127.0.0.1[0]" not in out, out
    assert "round 1: 1 workers (127.0.0.1[0])" in out, out
    assert sizes(out) == {(2,) * 3 + (1,) * 9}, out


@pytest.mark.timeout(180)
def test_a_failed_slot_gets_a_new_worker_after_its_cooldown():
    flags = ["-np", "2", "--min-np", "1", "--host-discovery-script", "echo 127.0.0.1:2",
             "--blacklist-cooldown-range", "1", "30"]
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.1[1]", FAIL_AT=3, STEP_SLEEP=0.5)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert ("slot 127.0.0.1[1] is blacklisted for 1 s (--blacklist-cooldown-range)") in out
    assert "slot 127.0.0.1[1] is back from the blacklist" in out, out
    assert "round 2: 2 workers (127.0.0.1[0], 127.0.0.1[1])" in out, out
    assert_two_then_one_then_two(out)


@pytest.mark.timeout(120)
def test_an_error_in_a_reset_callback_stops_the_job_at_once_with_its_traceback():
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"]
    start = time.monotonic()
    rc, out = perseusrun(flags, "fail", FAIL_ID="127.0.0.3[0]", FAIL_AT=2, RESET_RAISES=1)
    assert time.monotonic() - start < 60, out  # not --elastic-timeout's 600 s
    assert rc == 1, f"exit {rc}\n{out}"
    said = re.search(r"worker (127\.0\.0\.[12]\[0\]) failed with exit code 1 in a reset "
                     r"callback, which every round would repeat; stopping the job\. Its "
                     r"traceback:\n(.*\n)*?.*RuntimeError: the reset callback of worker "
                     r"(127\.0\.0\.[12]\[0\]) broke", out)
    assert said and said[1] == said[3], out
    assert "round 2" not in out, out  # the survivors re-formed once, then it stopped


@pytest.mark.timeout(180)
def test_a_worker_that_never_checks_in_is_left_behind_after_the_start_timeout():
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
             "--start-timeout", "12"]
    # the launcher tells the others, waiting for it, long before their own timeout (60 s)
    rc, out = perseusrun(flags, "fail", HANG_ID="127.0.0.3[0]", FAIL_ID="none", FAIL_AT=0,
                         GLOO_TIMEOUT_SECONDS=60)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert ("worker 127.0.0.3[0] did not check in at the rendezvous within 12 s "
            "(--start-timeout); host 127.0.0.3 is blacklisted") in out, out
    assert out.count("could not form round 0 (rank 2 will not join: worker 127.0.0.3[0] "
                     "did not check in") == 2, out  # not their timeout's message
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.2[0])" in out, out
    assert sizes(out) == {(2,) * 12}, out


@pytest.mark.timeout(180)
def test_a_worker_that_ends_before_it_checks_in_is_not_waited_for():
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"]
    rc, out = perseusrun(flags, "fail", CRASH_ID="127.0.0.3[0]", FAIL_ID="none", FAIL_AT=0,
                         GLOO_TIMEOUT_SECONDS=60)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert "worker 127.0.0.3[0] failed with exit code 5; host 127.0.0.3 is blacklisted" in out
    assert out.count("could not form round 0 (rank 2 will not join: worker 127.0.0.3[0] "
                     "ended (exit code 5) before it checked in") == 2, out
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.2[0])" in out, out
    assert sizes(out) == {(2,) * 12}, out


def test_the_blacklist_cooldown_doubles_at_each_failure_up_to_its_maximum():
    from perseus.runner.elastic import Blacklist

    now = [100.0]
    forever, cooling = Blacklist(clock=lambda: now[0]), Blacklist((2, 5), lambda: now[0])
    assert forever.add("a") == float("inf") and "a" in forever
    assert [cooling.add("b") for _ in range(3)] == [2, 4, 5]
    assert cooling.hosts() == ["b"]
    now[0] += 4.9
    assert "b" in cooling and "c" not in cooling
    now[0] += 0.2
    assert "b" not in cooling and cooling.hosts() == [] and forever.hosts() == ["a"]


def test_check_ins_are_read_under_their_rounds_scope():
    from perseus.runner.job import mesh_rank

    assert mesh_rank("elastic/3/mesh/2", "elastic/3/") == 2
    assert mesh_rank("elastic/3/mesh/2/1", "elastic/3/") == 2  # a later generation
    assert mesh_rank("elastic/13/mesh/2", "elastic/3/") is None
    assert mesh_rank("elastic/3/mesh/x", "elastic/3/") is None


def test_a_worker_leaving_a_round_names_the_ranks_it_found_silent():
    from perseus import _core
    from perseus.common.elastic import ready_text, silent_in

    assert ready_text([]) == b"1" and silent_in(b"1") == []
    assert ready_text([0, 3]) == b"silent 0 3" and silent_in(b"silent 0 3") == [0, 3]
    assert silent_in(b"silent x 2") == [2] and silent_in(b"") == []
    # Without an engine, and before any ran: none.
    assert _core.silent_ranks() == []


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
    assert sampler.get_indices(1, 3) == [3, 4, 5]
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
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2"]
    cmd = [PY, "-m", "perseus.runner.launch", *flags, PY, EXAMPLE, "--epochs", "2",
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


def child_with_env(parent, name, value):
    """The pid of ``parent``'s child process whose environment has ``name=value``."""
    want = f"{name}={value}".encode()
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and want in Path(f"/proc/{entry}/environ").read_bytes().split(
                    b"\0"):
                return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    return None


@pytest.mark.timeout(240)
def test_the_example_goes_on_when_a_worker_is_killed_from_outside():
    # SIGKILL, from outside, to the second worker once the first epoch ended: no exit
    # handler runs, its sockets just close, in the middle of an allreduce or near one
    flags = ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"]
    cmd = [PY, "-m", "perseus.runner.launch", *flags, PY, EXAMPLE, "--epochs", "3",
           "--train-size", "2400", "--test-size", "200"]
    proc = subprocess.Popen(cmd, env=clean_env(OMP_NUM_THREADS=1, GLOO_TIMEOUT_SECONDS=20),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any("epoch 1: test loss" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        victim = child_with_env(proc.pid, "PERSEUS_ELASTIC_ID", "127.0.0.2[0]")
        assert victim is not None, "".join(lines)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=150)
    except BaseException:
        stop_session(proc)
        raise
    reader.join(10)
    out = "".join(lines)
    assert rc == 0, f"exit {rc}\n{out}"
    assert "worker 127.0.0.2[0] failed with signal SIGKILL; host 127.0.0.2 is blacklisted" \
        in out, out
    assert "round 1: 2 workers (127.0.0.1[0], 127.0.0.3[0])" in out, out
    assert re.search(r"epoch 1: .*size 3\)", out) and re.search(r"epoch 3: .*size 2\)", out), out
    assert "final loss" in out, out


@pytest.mark.timeout(180)
def test_seed_004s_command_runs_the_elastic_synthetic_benchmark(tmp_path):
    # seed 004's launcher line, its discovery script and its Horovod timeout variable
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:3\n")
    script.chmod(0o755)
    cmd = [PY, "-m", "perseus.runner.launch", "-np", "3", "--min-np=1", "--max-np=5",
           "--verbose", "--log-level=DEBUG", "--host-discovery-script", str(script),
           PY, str(EXAMPLES / "pytorch_synthetic_benchmark_elastic.py"), "--num-iters=3",
           "--num-batches-per-iter", "2", "--num-warmup-batches", "1", "--batch-size", "4",
           "--image-size", "32"]
    rc, out = run(cmd, clean_env(OMP_NUM_THREADS=1, HOROVOD_GLOO_TIMEOUT_SECONDS=300),
                  timeout=150)
    assert rc == 0, f"exit {rc}\n{out}"
    assert "perseusrun: elastic, 1 to 5 workers" in out, out
    assert "round 0: 3 workers (localhost[0], localhost[1], localhost[2])" in out, out
    assert re.search(r"Iter #2: [0-9.]+ img/sec per CPU \(3 workers\)", out), out
    assert re.search(r"Total img/sec on 3 CPU\(s\): [0-9.]+ \+-[0-9.]+", out), out


@pytest.mark.timeout(120)
def test_torchrun_restarts_the_workers_and_they_go_on_from_rank_0s_checkpoint(tmp_path):
    # torchrun's own fault tolerance: every worker restarts, and Perseus starts afresh
    worker = Path(__file__).parent / "workers" / "torchrun_restart.py"
    cmd = [PY, "-W", "ignore::FutureWarning", "-m", "torch.distributed.run",
           "--nproc_per_node", "2", "--max-restarts", "1", "--master_port", str(free_port()),
           # A second before torchrun stops the survivors: rank 0's error must come out
           # first on a loaded host too (torchrun's default looks every 0.1 s).
           "--monitor-interval", "1",
           str(worker), str(tmp_path / "ckpt")]
    rc, out = run(cmd, clean_env(PERSEUS_MASTER_PORT=free_port(), OMP_NUM_THREADS=1),
                  timeout=100)
    assert rc == 0 and out.count(OK_MARK) == 2, f"exit {rc}\n{out}"
    assert "rank 1 is gone" in out, out  # rank 0's error before torchrun stopped it
    assert "attempt 1 rank 0 starts at step 4" in out, out
    assert "attempt 1 rank 1 starts at step 4" in out, out

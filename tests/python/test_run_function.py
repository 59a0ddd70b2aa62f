"""perseus.run (Horovod's horovod.run): a Python function run on every rank of a job
that perseusrun's launcher starts, its results back by rank, failures named."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _launch_helpers import clean_env

pytest.importorskip("torch")

DRIVER = Path(__file__).parent / "workers" / "run_function_driver.py"


def drive(mode, timeout=120):
    """Runs the driver script in MODE; returns (what it printed after RUN-RESULT, all
    its output)."""
    proc = subprocess.run([sys.executable, str(DRIVER), mode], env=clean_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RUN-RESULT "))
    return json.loads(line[len("RUN-RESULT "):]), out


@pytest.mark.timeout(150)
def test_results_come_back_by_rank_from_functions_of_the_main_script():
    got, out = drive("results")
    # 3 ranks on two loopback hosts (1 + 2); each summed rank + 1 over the job: 6 * 2 + 1.
    # Cross ranks count the ranks of one local rank: rank 2 is the only local rank 1.
    assert [(g["rank"], g["size"], g["local_rank"], g["cross_rank"], g["value"])
            for g in got] == [(0, 3, 0, 0, 13.0), (1, 3, 0, 1, 13.0), (2, 3, 1, 0, 13.0)], out
    assert len({g["pid"] for g in got}) == 3, got


@pytest.mark.timeout(150)
def test_a_module_function_runs_in_processes_of_its_own():
    (driver, *ranks), out = drive("pids")
    assert len(ranks) == 2 and len({driver, *ranks}) == 3, out


@pytest.mark.timeout(150)
def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    message, _ = drive("raises")
    assert message.startswith("RuntimeError: perseus.run: the job failed (exit status 1): "
                              "rank 1 failed first, with exit code 1\nrank 1 raised:\n"
                              "Traceback"), message
    assert 'in fails_on_rank_1\n    raise ValueError("rank 1 cannot go on")\n' \
        'ValueError: rank 1 cannot go on\n' in message, message
    assert message.endswith("\nrank 0 returned nothing: stopped with the job before it "
                            "finished"), message


@pytest.mark.timeout(150)
def test_a_rank_that_dies_is_named():
    message, _ = drive("exits")
    assert message == ("RuntimeError: perseus.run: the job failed (exit status 3): rank 2 "
                       "failed first, with exit code 3, before it reported\nranks 0, 1 "
                       "returned nothing: stopped with the job before they finished"), message


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="needs Open MPI's mpirun (scripts/test.sh installs Debian's "
                           "openmpi-bin)")
def test_use_mpi_starts_the_ranks_through_mpirun():
    got, out = drive("mpi")
    assert [(g["rank"], g["size"], g["value"]) for g in got["results"]] == [
        (0, 2, 3.0), (1, 2, 3.0)], out
    raised = got["raised"]
    assert raised.startswith("RuntimeError: perseus.run: the job failed (exit status "), raised
    assert "rank 1 raised:\nTraceback" in raised and \
        raised.count("ValueError: rank 1 cannot go on") == 1, raised


@pytest.mark.timeout(150)
def test_the_start_timeout_ends_when_the_task_starts_not_at_hvd_init():
    """A function that runs past --start-timeout before hvd.init() (or never calls it)
    is not taken for a rank that never started."""
    got, out = drive("slow")
    assert got == ["0", "1"], out


@pytest.mark.timeout(150)
def test_an_elastic_run_returns_the_last_rounds_results_and_names_why_it_failed():
    """Three workers on three loopback hosts with min_np=2: the first raises at step 2,
    is left behind, and the others finish from their last commit as ranks 0 and 1 of
    the next round. Then two workers with min_np=2: one raises, too few are left."""
    got, out = drive("elastic")
    assert got["results"] == [
        {"worker": f"127.0.0.{h}[0]", "rank": r, "size": 2, "sizes": [3, 3, 2, 2, 2, 2]}
        for r, h in ((0, 2), (1, 3))], out
    message = got["too_few"]
    assert message.startswith(
        "RuntimeError: perseus.run: the elastic job failed (exit status 1): 1 slots usable "
        "and 1 workers left, fewer than --min-np 2 for 2 s (--elastic-timeout)"), message
    assert "\nworker 127.0.0.1[0], rank 0 of round 0 raised:\nTraceback" in message, message
    assert "ValueError: worker 127.0.0.1[0] cannot go on" in message, message


@pytest.mark.timeout(150)
def test_with_cloudpickle_functions_of_a_session_without_a_file_go_by_value():
    """As in a notebook: functions of a ``__main__`` without a file, a lambda and a
    closure over a global, reach the ranks by value."""
    pytest.importorskip("cloudpickle")
    code = textwrap.dedent("""
        import json
        import perseus

        scale = 3.0

        def total():
            import perseus.torch.horovod as hvd
            import torch

            hvd.init()
            return float(hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)) * scale

        print("RUN-RESULT " + json.dumps({
            "total": perseus.run(total, np=2),
            "lambda": perseus.run(lambda x: [x, __import__("os").environ["PERSEUS_RANK"]],
                                  args=(41,), np=2)}), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                          text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RUN-RESULT "))
    assert json.loads(line[len("RUN-RESULT "):]) == {
        "total": [9.0, 9.0], "lambda": [[41, "0"], [41, "1"]]}, out


@pytest.mark.timeout(150)
def test_rank_output_reaches_text_streams_without_a_byte_buffer():
    """Jupyter's sys.stdout has no .buffer: the ranks' lines still reach it."""
    got, _ = drive("text-output")
    # the launcher's own lines (it sets OMP_NUM_THREADS, saying so) aside
    got["stderr"] = [line for line in got["stderr"] if not line.startswith("perseusrun: ")]
    assert got == {"stdout": ["[0]<stdout>:rank 0 speaks", "[1]<stdout>:rank 1 speaks"],
                   "stderr": ["[0]<stderr>:to stderr", "[1]<stderr>:to stderr"]}, got


@pytest.mark.timeout(150)
def test_arguments_it_cannot_run_are_refused_naming_why():
    got, _ = drive("refusals")
    assert got["np"] == "ValueError: perseus.run needs np, a number of ranks >= 1, got 0", got
    assert got["both"] == "ValueError: Argument use_gloo and use_mpi only allow one set True.", got
    assert got["mpi_args"] == "ValueError: perseus.run: mpi_args go with use_mpi=True", got
    assert got["elastic_mpi"] == ("ValueError: perseus.run: elastic jobs run with Perseus's "
                                  "own launcher, not mpirun (use_mpi)"), got
    assert got["cooldown"] == ("ValueError: perseus.run: cooldown_range is (min, max) "
                               "seconds, got 5"), got
    # Tuning flags alone do not make a job elastic: perseusrun refuses a cooldown there.
    assert got["cooldown_fixed"] == ("ValueError: perseus.run: perseusrun refuses these "
                                     "arguments: --blacklist-cooldown-range is for elastic "
                                     "jobs (--min-np, --max-np or --host-discovery-script)"), got
    assert got["not_callable"] == "TypeError: perseus.run needs a function to run, got int", got
    assert got["typo"] == "TypeError: run() got an unexpected keyword argument 'hots'", got
    assert got["hosts"] == ("HostError: -np 4 is more than the 2 slots available "
                            "(localhost:2); add hosts or slots"), got
    # The driver blocks cloudpickle: functions go by reference, and a lambda cannot.
    assert got["lambda"].startswith(
        "ValueError: perseus.run cannot send <function main.<locals>.<lambda>.<locals>.<lambda> "), got
    assert "install cloudpickle to send lambdas and nested functions" in got["lambda"], got


def test_an_elastic_run_whose_last_round_lacks_a_rank_says_which_returned():
    from perseus.runner.run_function import _elastic_results

    ok = ("ok", "value")
    reports = {"a[0]": (1, 0, ok), "b[0]": (1, 2, ok), "c[0]": (0, 1, ok),
               "d[0]": (0, None, ("error", "Traceback ...\nValueError: d"))}
    error = _elastic_results(0, None, reports)
    assert isinstance(error, RuntimeError)
    assert str(error) == ("perseus.run: the elastic job ended, but the ranks of its last "
                          "round (1) that returned are 0, 2: not ranks 0 to 2\n"
                          "worker d[0] raised:\nTraceback ...\nValueError: d"), error
    # Results of earlier rounds do not count; the last round's come back by rank.
    reports["e[0]"] = (1, 1, ("ok", "middle"))
    assert _elastic_results(0, None, reports) == ["value", "middle", "value"]
    assert str(_elastic_results(0, None, {})) == (
        "perseus.run: the elastic job ended, but no worker returned a result")

"""perseusrun end to end: environment, output, failure handling and teardown.

The workers are plain Python: only the launcher needs the native core (for its
rendezvous server).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import perseus
import pytest

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

LAUNCH = [sys.executable, "-m", "perseus.runner.launch"]
# Ranks and the launcher import this perseus, wherever the tests run from.
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(perseus.__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (_PKG_ROOT, os.environ.get("PYTHONPATH")) if p))
ENV.pop("PERSEUS_RSH", None)

# Writes this rank's pid (and its child's, if any) to DIR/pid.RANK.
PIDS = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = int(os.environ["PERSEUS_RANK"])
    def write_pids(*extra):
        with open(os.path.join(sys.argv[1], f"pid.{rank}.tmp"), "w") as f:
            f.write(" ".join(str(p) for p in (os.getpid(), *extra)))
        os.replace(os.path.join(sys.argv[1], f"pid.{rank}.tmp"),
                   os.path.join(sys.argv[1], f"pid.{rank}"))
""")


def launch(args, timeout=60, env=None, **kw):
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout,
                          env=env or ENV, check=False, **kw)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for a reaper is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_in(directory):
    pids = []
    for name in os.listdir(directory):
        if name.startswith("pid.") and not name.endswith(".tmp"):
            with open(os.path.join(directory, name)) as f:
                pids += [int(p) for p in f.read().split()]
    return pids


def assert_all_gone(pids, within=3.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "processes outlived the job"


ENV_WORKER = textwrap.dedent("""
    import os, sys
    keys = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]
    print(" ".join(os.environ["PERSEUS_" + k] for k in keys), flush=True)
    assert all(os.environ["PERSEUS_" + k] == os.environ["HOROVOD_" + k] for k in keys)
    assert os.environ["PERSEUS_HOSTNAME"] == os.environ["HOROVOD_HOSTNAME"]
    assert os.environ["PERSEUS_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert int(os.environ["PERSEUS_RENDEZVOUS_PORT"]) > 0
    assert len(os.environ["PERSEUS_SECRET"]) == 32
    print("to stderr", file=sys.stderr)
""")


@pytest.mark.timeout(60)
def test_ranks_get_their_environment_and_prefixed_output():
    r = launch(["-np", "3", "-H", "localhost:2,127.0.0.1:2", sys.executable, "-c", ENV_WORKER])
    assert r.returncode == 0, r.stderr
    out = sorted(line for line in r.stdout.splitlines())
    assert out == ["[0]<stdout>:0 3 0 2 0 2", "[1]<stdout>:1 3 1 2 0 1",
                   "[2]<stdout>:2 3 0 1 1 2"]
    assert sorted(line for line in r.stderr.splitlines() if "<stderr>" in line) == [
        f"[{i}]<stderr>:to stderr" for i in range(3)]


@pytest.mark.timeout(60)
def test_output_filename_writes_each_ranks_stdout_and_stderr_and_still_prints(tmp_path):
    # horovodrun's layout: DIR/rank.<R>/stdout and DIR/rank.<R>/stderr, the lines
    # prefixed as on the terminal, which gets them too (test_launcher_output_filename.py).
    worker = ("import os, sys; print('hello', os.environ['PERSEUS_RANK']); "
              "print('oops', file=sys.stderr)")
    r = launch(["-np", "2", "--output-filename", str(tmp_path / "logs"), sys.executable, "-c",
                worker])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank.0", "rank.1"]
    for rank in range(2):
        out = (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text()
        err = (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text()
        assert out == f"[{rank}]<stdout>:hello {rank}\n", out
        assert err == f"[{rank}]<stderr>:oops\n", err
        assert f"[{rank}]<stdout>:hello {rank}\n" in r.stdout, r.stdout
        assert f"[{rank}]<stderr>:oops\n" in r.stderr, r.stderr


FAIL_WORKER = PIDS + textwrap.dedent("""
    if rank == 1:
        while len([n for n in os.listdir(sys.argv[1]) if not n.endswith(".tmp")]) < 1:
            time.sleep(0.02)
        write_pids()
        sys.exit(3)
    child = subprocess.Popen(["sleep", "60"])
    write_pids(child.pid)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_job(tmp_path):
    start = time.monotonic()
    r = launch(["-np", "2", sys.executable, "-c", FAIL_WORKER, str(tmp_path)])
    assert time.monotonic() - start < 10
    assert r.returncode == 3
    assert "rank 1" in r.stderr and "exit code 3" in r.stderr
    pids = pids_in(tmp_path)
    assert len(pids) == 3
    assert_all_gone(pids)


KILL_WORKER = PIDS + textwrap.dedent("""
    import signal
    if rank == 1:
        while not os.path.exists(os.path.join(sys.argv[1], "pid.0")):
            time.sleep(0.02)
        write_pids()
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL after the grace period
    write_pids()
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_and_stubborn_rank_gets_sigkill(tmp_path):
    start = time.monotonic()
    r = launch(["-np", "2", sys.executable, "-c", KILL_WORKER, str(tmp_path)])
    assert time.monotonic() - start < 15
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 1" in r.stderr and "signal SIGKILL" in r.stderr
    assert_all_gone(pids_in(tmp_path))


SLEEP_WORKER = PIDS + "write_pids()\ntime.sleep(60)\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_launcher_stops_the_job(tmp_path, sig):
    p = subprocess.Popen(LAUNCH + ["-np", "2", sys.executable, "-c", SLEEP_WORKER,
                                   str(tmp_path)],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 128 + sig
    assert f"received {signal.Signals(sig).name}" in err
    assert_all_gone(pids_in(tmp_path))


REMOTE_WORKER = PIDS + textwrap.dedent("""
    print(os.environ["PERSEUS_HOSTNAME"], os.environ.get("FAKE_HOST"), os.getcwd(),
          len(os.environ["PERSEUS_SECRET"]), os.environ.get("MXNET_USE_OPERATOR_TUNING"),
          os.environ.get("SSH_CONNECTION"), flush=True)
    write_pids()
    if rank == 2:  # fail once the others are up
        while not all(os.path.exists(os.path.join(sys.argv[1], f"pid.{r}")) for r in (0, 1)):
            time.sleep(0.02)
        sys.exit(4)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_remote_hosts_through_rsh_prefix(tmp_path):
    # The fake remote shell starts from an empty environment, as ssh would: what the
    # remote ranks have, the launcher sent (all but what describes its own shell).
    r = launch(["-np", "3", "-H", "localhost:1,nodeA:2", "--network-interface", "lo",
                "--rsh", "env -i FAKE_HOST={host}", sys.executable, "-c", REMOTE_WORKER,
                str(tmp_path)], cwd=str(tmp_path),
               env=dict(ENV, MXNET_USE_OPERATOR_TUNING="0", SSH_CONNECTION="10.0.0.9 1 10.0.0.1 22"))
    assert r.returncode == 4 and "rank 2 (host nodeA)" in r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == [f"[0]<stdout>:localhost None {tmp_path} 32 0 10.0.0.9 1 10.0.0.1 22",
                     f"[1]<stdout>:nodeA nodeA {tmp_path} 32 0 None",
                     f"[2]<stdout>:nodeA nodeA {tmp_path} 32 0 None"]
    assert_all_gone(pids_in(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_local_ranks_go_when_the_launcher_dies(tmp_path):
    p = subprocess.Popen(LAUNCH + ["-np", "2", sys.executable, "-c", SLEEP_WORKER,
                                   str(tmp_path)],
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids_in(tmp_path)) == 2
    p.kill()
    p.wait()
    assert_all_gone(pids_in(tmp_path))


# A rank behind a shell that starts a child of its own, which ignores SIGTERM: the
# shell's pid, the rank's and the child's are written.
FAMILY_WORKER = PIDS + textwrap.dedent("""
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(60)"])
    write_pids(os.getppid(), child.pid)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_killed_launcher_leaves_no_shell_rank_or_child_behind(tmp_path, where):
    # kill -9 perseusrun: each local rank's guard stops its whole process group, the
    # shell the rank runs under and the child it started (SIGKILL after the grace for
    # that one); a remote rank's script does the same when its stdin closes.
    if where == "remote" and shutil.which("setsid") is None:
        pytest.skip("needs setsid (util-linux)")
    script = tmp_path / "family.py"
    script.write_text(FAMILY_WORKER)
    command = (f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} "
               f"{shlex.quote(str(tmp_path))}; true")
    env, hosts = ENV, []
    if where == "remote":  # a fake ssh, detached from the launcher's groups (see below)
        fake = tmp_path / "bin" / "ssh"
        fake.parent.mkdir()
        fake.write_text('#!/bin/sh\nfor a; do last=$a; done\nexec setsid -w sh -c "$last"\n')
        fake.chmod(0o755)
        env = dict(ENV, PATH=f"{fake.parent}:{os.environ['PATH']}")
        hosts = ["-H", "nodeB:2", "--network-interface", "lo"]
    p = subprocess.Popen(LAUNCH + ["-np", "2", *hosts, "sh", "-c", command],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = pids_in(tmp_path)
    assert len(pids) == 6 and all(alive(pid) for pid in pids), pids
    p.kill()
    p.wait()
    assert_all_gone(pids, within=12.0)


@pytest.mark.timeout(60)
def test_the_guard_gives_the_launcher_the_ranks_own_exit_status(tmp_path):
    r = launch(["-np", "1", "sh", "-c", "exit 7"])
    assert r.returncode == 7, r.stderr
    assert "exit code 7" in r.stderr
    r = launch(["-np", "1", "sh", "-c", "kill -SEGV $$"])
    assert r.returncode == 128 + signal.SIGSEGV, r.stderr
    assert "signal SIGSEGV" in r.stderr
    r = launch(["-np", "1", "no-such-command-perseus"])
    assert r.returncode == 127, r.stderr
    assert ("cannot start rank 0 (no-such-command-perseus): No such file or directory"
            in r.stderr), r.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")
def test_remote_ranks_go_when_the_launcher_dies(tmp_path):
    # A fake ssh that detaches the "remote" command from the launcher's process groups,
    # as a real remote host would be: only the closed stdin can stop it.
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a; do last=$a; done\nexec setsid -w sh -c "$last"\n')
    fake.chmod(0o755)
    env = dict(ENV, PATH=f"{fake.parent}:{os.environ['PATH']}")
    p = subprocess.Popen(LAUNCH + ["-np", "2", "-H", "nodeB:2", "--network-interface", "lo",
                                   sys.executable, "-c", SLEEP_WORKER, str(tmp_path)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = pids_in(tmp_path)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    p.kill()
    p.wait()
    assert_all_gone(pids, within=5.0)


# What each rank does is given by argv[2] ("init,exit,sleep"): "init" checks in (its
# init() publishes mesh/<rank>, then waits for the others), "exit" ends without calling
# init(), "sleep" never gets there.
START_WORKER = PIDS + textwrap.dedent("""
    write_pids()
    role = sys.argv[2].split(",")[rank]
    if role == "init":
        from perseus import _core
        open(os.path.join(sys.argv[1], f"init.{rank}"), "w").close()
        _core.init()
    elif role == "sleep":
        time.sleep(60)
    elif role == "exit-last":  # exits once every "init" rank is about to call init()
        roles = sys.argv[2].split(",")
        others = [r for r, role in enumerate(roles) if role == "init"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(sys.argv[1], f"init.{r}")) for r in others):
            time.sleep(0.05)
        time.sleep(1.0)
""")


@pytest.mark.timeout(60)
def test_ranks_that_do_not_check_in_within_start_timeout_are_named(tmp_path):
    # rank 3's host never answers: its remote shell hangs.
    hang = f"sh -c 'echo $$ > {tmp_path}/pid.rsh.$$; exec sleep 60'"
    start = time.monotonic()
    r = launch(["-np", "4", "-H", "localhost:3,deadhost:1", "--network-interface", "lo",
                "--rsh", hang, "--start-timeout", "2",
                sys.executable, "-c", START_WORKER, str(tmp_path), "init,init,sleep,init"])
    assert time.monotonic() - start < 12
    assert r.returncode == 1, r.stderr
    assert ("rank 2 (host localhost), rank 3 (host deadhost) did not check in at the "
            "rendezvous within 2 s") in r.stderr, r.stderr
    pids = pids_in(tmp_path)
    assert len(pids) == 4
    assert_all_gone(pids)


@pytest.mark.timeout(60)
def test_a_rank_that_exits_before_init_is_named_at_once_not_the_one_waiting(tmp_path):
    # rank 1 ends (exit code 0) without calling init(), once ranks 0 and 2 are about to
    # wait in init() for it. perseusrun names rank 1 as soon as a rank is waiting, long
    # before any timeout, and names the ranks that wait at that moment: both, unless a
    # loaded machine kept rank 2 from publishing its key within rank 1's second.
    start = time.monotonic()
    r = launch(["-np", "3", "--start-timeout", "30", sys.executable, "-c", START_WORKER,
                str(tmp_path), "init,exit-last,init"],
               env=dict(ENV, GLOO_TIMEOUT_SECONDS="30"))
    assert time.monotonic() - start < 20, r.stderr
    assert r.returncode == 1, r.stderr
    said = re.search(r"rank 1 \(host localhost\) exited without error before reaching "
                     r"hvd\.init\(\), while (rank 0|ranks 0, 2) \(host localhost\) waits? "
                     r"there for it; stopping the job", r.stderr)
    assert said, r.stderr
    assert "rank 0" not in r.stderr.replace(said[0], ""), r.stderr
    assert_all_gone(pids_in(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_start_timeout_under_mpi(tmp_path):
    start = time.monotonic()
    r = launch(["--mpi", "-np", "2", "--start-timeout", "2",
                sys.executable, "-c", START_WORKER, str(tmp_path), "init,sleep"])
    assert time.monotonic() - start < 15
    assert r.returncode == 1, r.stderr
    assert "rank 1 (host localhost) did not check in" in r.stderr, r.stderr
    pids = pids_in(tmp_path)
    assert len(pids) == 2
    assert_all_gone(pids)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_ctrl_c_stops_an_mpi_job(tmp_path):
    p = subprocess.Popen(LAUNCH + ["--mpi", "-np", "2", sys.executable, "-c", SLEEP_WORKER,
                                   str(tmp_path)],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT" in err
    assert_all_gone(pids_in(tmp_path))


FLIGHT_WORKER = Path(__file__).parent / "workers" / "flight_stall.py"


class FlightJob:
    """perseusrun -np 2 of workers/flight_stall.py, its output read as it comes."""

    def __init__(self, env, *args, flags=()):
        self.p = subprocess.Popen(LAUNCH + ["-np", "2", *flags, sys.executable,
                                            str(FLIGHT_WORKER), *args],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        self.lines, self.errors = [], []
        self.readers = [
            threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True),
            threading.Thread(target=lambda: self.errors.extend(self.p.stderr), daemon=True)]
        for t in self.readers:
            t.start()
        self.deadline = time.monotonic() + 60

    def wait_for(self, want, in_errors=True, count=1):
        """Until ``count`` lines of stderr (else stdout) hold ``want``; the first one."""
        where = self.errors if in_errors else self.lines
        while sum(want in line for line in where) < count:
            assert time.monotonic() < self.deadline, "".join(self.lines + self.errors)
            if self.p.poll() is not None:
                for t in self.readers:
                    t.join(5)
                assert sum(want in line for line in where) >= count, "".join(
                    self.lines + self.errors)
            time.sleep(0.05)
        return next(line for line in where if want in line)

    def ask_by_sigusr1(self):
        """Once both ranks are READY (rank 0 then in its allreduce), SIGUSR1 to
        perseusrun; the diagnosis line of rank 1, which must name ``evaluate()``."""
        self.wait_for("READY", in_errors=False, count=2)
        time.sleep(1.0)
        os.kill(self.p.pid, signal.SIGUSR1)
        said = self.wait_for("flight recorder: rank 1 has not submitted allreduce "
                             "'grad.layer4'")
        assert said.rstrip().endswith(" evaluate()"), said
        return said

    def ended(self):
        """Once both ranks are READY, waits for perseusrun to exit; its stderr."""
        self.wait_for("READY", in_errors=False, count=2)
        self.p.wait(timeout=60)
        for t in self.readers:
            t.join(5)
        return "".join(self.errors)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        self.p.wait(timeout=30)
        for t in self.readers:
            t.join(5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trigger", ["SIGUSR1 to perseusrun", "a stall warning on rank 0"])
def test_the_flight_recorder_names_the_rank_that_does_not_submit_and_its_line(
        tmp_path, trigger):
    # Rank 1 sleeps in evaluate() while rank 0 waits in allreduce 'grad.layer4'; SIGUSR1 to
    # perseusrun, or rank 0's stall warning, asks every rank for its record, and perseusrun
    # prints the diagnosis.
    sleep_line = FLIGHT_WORKER.read_text().splitlines().index(
        "    time.sleep(120)  # the line the diagnosis names") + 1
    records = tmp_path / "records"
    env = dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(records))
    if trigger.startswith("a stall"):
        env["PERSEUS_STALL_CHECK_TIME_SECONDS"] = "2"
    job = FlightJob(env)
    try:
        job.wait_for("READY", in_errors=False, count=2)
        if trigger.startswith("SIGUSR1"):
            time.sleep(1.0)  # rank 0 is in its allreduce by now
            os.kill(job.p.pid, signal.SIGUSR1)
        said = job.wait_for("flight recorder: rank 1 has not submitted allreduce "
                            "'grad.layer4' for")
        assert "(rank 0 waits for it); its main thread is in " in said, said
        assert said.rstrip().endswith(f"{FLIGHT_WORKER}:{sleep_line} evaluate()"), said
        assert (f"flight recorder ({trigger}): records of 2 of 2 ranks; each rank's whole "
                f"record is in {records} on its host") in "".join(job.errors)
        # Each rank's file: rank 0's allreduce pending, rank 1's warm-up done.
        r0 = json.loads((records / "rank.0.json").read_text())
        r1 = json.loads((records / "rank.1.json").read_text())
        assert [(o["name"], o["stage"]) for o in r0["ops"]][-2:] == [
            ("warm.up", "done"), ("grad.layer4", "submitted")], r0["ops"]
        assert [(o["name"], o["stage"]) for o in r1["ops"]] == [("warm.up", "done")]
        assert r1["reason"] == trigger
        assert any(t["main"] and t["stack"][-1]["function"] == "evaluate"
                   for t in r1["threads"]), r1["threads"]
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_an_elastic_job_answers_sigusr1_with_the_diagnosis_of_its_round(tmp_path):
    job = FlightJob(dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(tmp_path)), flags=["--min-np", "2"])
    try:
        job.ask_by_sigusr1()
        assert "flight recorder (SIGUSR1 to perseusrun): records of 2 of 2 ranks" in "".join(
            job.errors)
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_records_reach_perseusrun_through_the_rendezvous_when_no_file_can_be_written(
        tmp_path):
    # The records travel through the rendezvous, not through files: a rank on another
    # host, or one that cannot write its directory (here a path below a regular file),
    # still gets into the diagnosis.
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    job = FlightJob(dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(blocker / "records")))
    try:
        job.ask_by_sigusr1()
        assert "records of 2 of 2 ranks" in "".join(job.errors)
        assert "perseus: flight recorder: cannot write" in "".join(job.errors)
        assert not (blocker / "records").exists()
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_a_failed_rank_is_followed_by_a_diagnosis_before_the_others_are_stopped(tmp_path):
    # Rank 1 ends with exit code 3 in evaluate() while rank 0 waits in allreduce
    # 'grad.layer4': perseusrun asks rank 0 for its record (or takes the one it published
    # as its collective failed) before it stops it, and says what rank 0 was waiting in.
    records = tmp_path / "records"
    job = FlightJob(dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(records)), "exit")
    try:
        err = job.ended()
        assert job.p.returncode == 3, err
        failed = err.index("rank 1 (host ")
        asked = err.index("flight recorder (rank 1 failed with exit code 3): records of 1 "
                          "of 1 ranks")
        said = err.index("flight recorder: rank 1 ended with exit code 3 while rank 0 waited "
                         "in allreduce 'grad.layer4'")
        assert failed < asked < said, err
        assert (records / "rank.0.json").exists()
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_a_rank_whose_script_finished_first_is_named_where_the_others_wait(tmp_path):
    # Rank 1's script ends without error in evaluate() (its data ran out first) while
    # rank 0 waits in allreduce 'grad.layer4'. Rank 0's allreduce fails saying that rank 1's
    # process ended without shutting Perseus down, its script exits with code 1, and
    # perseusrun's diagnosis, from the record rank 0 published as it failed, names rank 1.
    records = tmp_path / "records"
    job = FlightJob(dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(records)), "finish")
    try:
        err = job.ended()
        assert job.p.returncode == 1, err
        assert "rank 1 is gone (I/O error: " in err, err
        assert ("its process ended without shutting Perseus down (its script finished, "
                "crashed or was killed) or its host dropped off") in err, err
        failed = err.index("perseusrun: rank 0 (host ")
        said = err.index("flight recorder: rank 1 finished its script (exit code 0) while "
                         "rank 0 waited in allreduce 'grad.layer4'; it failed there")
        assert failed < said, err
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_a_frozen_rank_is_named_by_the_diagnosis_then_fails_the_job_and_is_stopped(tmp_path):
    # Rank 1 stops itself (SIGSTOP) in evaluate() while rank 0 waits in allreduce
    # 'grad.layer4'. SIGUSR1 to perseusrun: rank 1 cannot answer, and the diagnosis says
    # so. Then rank 0's engine, its pings unanswered for GLOO_TIMEOUT_SECONDS, fails the
    # allreduce naming rank 1, and perseusrun ends the job, the stopped rank included.
    records = tmp_path / "records"
    job = FlightJob(dict(ENV, PERSEUS_FLIGHT_RECORDER_DIR=str(records),
                         GLOO_TIMEOUT_SECONDS="15"), "stop")
    try:
        ready = job.wait_for("READY rank 1", in_errors=False)
        frozen = int(ready.split("pid ")[1])
        time.sleep(1.0)
        os.kill(job.p.pid, signal.SIGUSR1)
        said = job.wait_for("flight recorder: rank 1 sent no record")
        assert "while rank 0 waits in allreduce 'grad.layer4' for " in said, said
        assert "its process may be stopped or frozen" in said, said
        assert "records of 1 of 2 ranks (none from rank 1)" in "".join(job.errors)
        job.p.wait(timeout=60)
        for t in job.readers:
            t.join(5)
        out = "".join(job.lines + job.errors)
        assert job.p.returncode != 0, out
        assert "rank 1 is gone (it has answered nothing for " in out, out
        assert "its process is stopped or frozen" in out, out
        assert not os.path.exists(f"/proc/{frozen}"), out
    finally:
        job.stop()


OMP_WORKER = textwrap.dedent("""
    import os
    print(os.environ["PERSEUS_HOSTNAME"], os.environ.get("OMP_NUM_THREADS"), flush=True)
""")


@pytest.mark.timeout(60)
def test_omp_num_threads_unset_becomes_cores_over_local_ranks_and_a_set_one_is_kept():
    from perseus.runner import threads

    unset = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    hosts = ["-H", "localhost:2,nodeA:2,nodeB:1", "--network-interface", "lo",
             "--rsh", "env -i FAKE_HOST={host}"]  # "remote" hosts: here, an empty env
    r = launch(["-np", "5", *hosts, sys.executable, "-c", OMP_WORKER], env=unset)
    assert r.returncode == 0, r.stderr
    each = threads.per_rank(threads.host_cores(), 2)
    assert sorted(r.stdout.splitlines()) == [
        f"[0]<stdout>:localhost {each}", f"[1]<stdout>:localhost {each}",
        # computed on the host itself; a host of one rank keeps the variable unset
        f"[2]<stdout>:nodeA {each}", f"[3]<stdout>:nodeA {each}", "[4]<stdout>:nodeB None"]
    said = [line for line in r.stderr.splitlines() if "OMP_NUM_THREADS is unset" in line]
    assert len(said) == 1 and "set OMP_NUM_THREADS to choose" in said[0], r.stderr
    r = launch(["-np", "5", *hosts, sys.executable, "-c", OMP_WORKER],
               env=dict(unset, OMP_NUM_THREADS="3"))
    assert r.returncode == 0, r.stderr
    assert [line.split()[-1] for line in r.stdout.splitlines()] == ["3"] * 5, r.stdout
    assert "OMP_NUM_THREADS is unset" not in r.stderr

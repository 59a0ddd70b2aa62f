"""Rank copies: a process started by a rank (a DataLoader worker, a fork) that runs
init() again answers for that rank instead of joining the job twice."""

import subprocess
import sys

import pytest
from _launch_helpers import clean_env


def test_a_rank_copy_is_a_process_under_the_mark_of_another_live_one_of_that_job(
        monkeypatch):
    """rank_copy.copy_of(): only a process that inherited another running process's
    mark, made with the same rank variables, answers for that rank."""
    import os

    from perseus.common import rank_copy

    # Through monkeypatch first, so that the test ends with the variable as it found it
    # (mark() below sets it behind monkeypatch's back).
    monkeypatch.setenv(rank_copy.MARK, "")
    for k in ("PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_MASTER_PORT"):
        monkeypatch.setenv(k, {"PERSEUS_RANK": "1", "PERSEUS_SIZE": "4"}.get(k, "7000"))
    rank_copy.mark([1, 4, 1, 2, 0, 2])
    mark = os.environ[rank_copy.MARK]
    assert mark.startswith(f"{os.getpid()}:1:4:1:2:0:2:"), mark
    assert rank_copy.copy_of() is None  # the rank itself
    parent = os.getppid()  # as a child of the rank sees the mark
    monkeypatch.setenv(rank_copy.MARK, mark.replace(f"{os.getpid()}:", f"{parent}:", 1))
    topology, why = rank_copy.copy_of()
    assert topology == [1, 4, 1, 2, 0, 2]
    assert f"started by rank 1 (pid {parent})" in why and "__name__" in why, why
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7001")  # another job's rank
    assert rank_copy.copy_of() is None
    monkeypatch.setenv("PERSEUS_MASTER_PORT", "7000")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv(rank_copy.MARK, mark.replace(f"{os.getpid()}:", f"{dead}:", 1))
    assert rank_copy.copy_of() is None  # a mark left by a rank that has ended
    monkeypatch.setenv(rank_copy.MARK, "1:garbage")
    assert rank_copy.copy_of() is None
    rank_copy.unmark()
    assert rank_copy.MARK not in os.environ
    # A process no launcher started is a job of its own (a script run from a notebook
    # that called hvd.init() alone): it leaves no mark for the processes it starts.
    for k in rank_copy._IDENTITY:
        monkeypatch.delenv(k, raising=False)
    rank_copy.mark([0, 1, 0, 1, 0, 1])
    assert rank_copy.MARK not in os.environ


@pytest.mark.timeout(60)
def test_a_process_that_finds_its_ranks_init_under_way_and_failed_says_so(monkeypatch):
    """A process that finds no mark but a rank's announcement of its init() waits for
    that rank's mark; an announcement with no init() behind it any more (the rank's
    failed) is an error saying so, and another job's announcement is not waited for."""
    from perseus.common import rank_copy

    monkeypatch.setenv("PERSEUS_RANK", "3")
    monkeypatch.setenv("PERSEUS_SIZE", "4")
    monkeypatch.delenv(rank_copy.MARK, raising=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv(rank_copy.PENDING, f"{sleeper.pid}:{rank_copy._identity()}")
        with pytest.raises(RuntimeError, match=rf"started by a rank \(pid {sleeper.pid}\) "
                                               r"whose own hvd.init\(\) was under way; that "
                                               r"init\(\) ended without success"):
            rank_copy.copy_of()
        monkeypatch.setenv(rank_copy.PENDING, f"{sleeper.pid}:0123456789abcdef")
        assert rank_copy.copy_of() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_copy_answers_for_its_rank_as_it_is_now_and_finds_it_without_the_mark(
        monkeypatch, tmp_path):
    """A forkserver keeps the environment it started with: a worker it starts after an
    elastic reset inherits the mark of the old round, and one whose forkserver started
    before the rank's init() inherits none. Both find the rank's file and answer for
    the rank as it is now."""
    import os

    from perseus.common import rank_copy

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the files' folder, for this test only
    monkeypatch.setattr(rank_copy.tempfile, "tempdir", None)
    monkeypatch.setenv(rank_copy.MARK, "")
    for k in ("PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_MASTER_PORT"):
        monkeypatch.setenv(k, {"PERSEUS_RANK": "1", "PERSEUS_SIZE": "4"}.get(k, "7000"))
    probe = ("from perseus.common import rank_copy; c = rank_copy.copy_of(); "
             "print(c and c[0], c and c[1].split(')')[0])")

    def child(env):
        # This process is the rank; a child (as a forkserver's worker, a generation
        # nearer) runs what init() runs first.
        env = {**env, "TMPDIR": str(tmp_path)}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        return out.stdout.strip()

    # A file left by a rank that was killed is removed by the next rank's first mark.
    folder = tmp_path / f"perseus-ranks-{os.getuid()}"
    folder.mkdir(mode=0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (folder / dead).write_text("1:0:2:0:2:0:1:digest")
    monkeypatch.setattr(rank_copy, "_cleanup_registered", False)
    rank_copy.mark([1, 4, 1, 2, 0, 2])  # the first round
    assert sorted(p.name for p in folder.iterdir()) == [str(os.getpid())]
    first_round = clean_env(**{k: os.environ[k] for k in
                               (rank_copy.MARK, "PERSEUS_RANK", "PERSEUS_SIZE",
                                "PERSEUS_MASTER_PORT")})
    me = f"started by rank {{}} (pid {os.getpid()}"
    assert child(first_round) == f"[1, 4, 1, 2, 0, 2] this process was {me.format(1)}"
    # An elastic reset: shutdown(), then init() as rank 2 of 3.
    rank_copy.unmark()
    assert not (tmp_path / f"perseus-ranks-{os.getuid()}" / str(os.getpid())).exists()
    rank_copy.mark([2, 3, 0, 1, 1, 3])
    assert child(first_round) == f"[2, 3, 0, 1, 1, 3] this process was {me.format(2)}"
    # No mark in the environment (the forkserver started before init()).
    no_mark = {k: v for k, v in first_round.items() if k != rank_copy.MARK}
    assert child(no_mark) == f"[2, 3, 0, 1, 1, 3] this process was {me.format(2)}"
    # Not a copy: another job's rank, or a file the rank did not write (a process id
    # reused after a rank was killed before it could remove its file).
    assert child({**no_mark, "PERSEUS_MASTER_PORT": "7001"}) == "None None"
    path = tmp_path / f"perseus-ranks-{os.getuid()}" / str(os.getpid())
    start, rest = path.read_text().split(":", 1)
    path.write_text(f"{int(start) + 1}:{rest}")
    assert child(no_mark) == "None None"
    # Gone at shutdown: a worker with the old mark answers from it; one without, not at all.
    rank_copy.mark([2, 3, 0, 1, 1, 3])
    rank_copy.unmark()
    assert not path.exists()
    assert child(first_round) == f"[1, 4, 1, 2, 0, 2] this process was {me.format(1)}"
    assert child(no_mark) == "None None"

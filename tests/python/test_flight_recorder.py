"""The flight recorder's diagnosis, from records made here (the end-to-end test, with a
real job and SIGUSR1, is in test_launcher_job.py)."""

from perseus.common import flight_recorder as fr


def op(name, stage, submitted, kind="allreduce", ps=0):
    return {"name": name, "kind": kind, "process_set": ps, "bytes": 16,
            "submitted": submitted, "started": None, "finished": None, "stage": stage}


def record(rank, ops, function="train", line=10, extra_frames=()):
    stack = [{"file": "/job/train.py", "line": 1, "function": "<module>"},
             {"file": "/job/train.py", "line": line, "function": function}, *extra_frames]
    return {"rank": rank, "ops": ops, "time": 100.0,
            "threads": [{"name": "worker", "main": False, "stack": []},
                        {"name": "MainThread", "main": True, "stack": stack}]}


def test_names_each_rank_that_has_not_submitted_what_others_wait_in():
    records = {
        0: record(0, [op("warm", "done", 1.0), op("grad.b", "submitted", 40.0)]),
        1: record(1, [op("warm", "done", 1.0)], function="evaluate", line=118),
        2: record(2, [op("grad.b", "submitted", 41.0)]),
    }
    assert fr.diagnose(records, now=102.0) == [
        ("rank 1 has not submitted allreduce 'grad.b' for 62 s (ranks 0, 2 wait for it); "
        "its main thread is in /job/train.py:118 evaluate()")]


def test_the_callers_line_is_named_not_perseus_own_frames():
    inside = {"file": fr._PACKAGE + "/common/ops.py", "line": 80, "function": "wait"}
    records = {0: record(0, [op("x", "submitted", 0.0, kind="broadcast", ps=3)]),
               1: record(1, [op("y", "submitted", 5.0)], line=7, extra_frames=[inside])}
    lines = fr.diagnose(records, now=10.0)
    assert lines == [
        ("rank 1 has not submitted broadcast 'x' of process set 3 for 10 s (rank 0 waits "
        "for it); its main thread is in /job/train.py:7 train()"),
        ("rank 0 has not submitted allreduce 'y' for 5 s (rank 1 waits for it); its main "
        "thread is in /job/train.py:10 train()")], lines


def test_with_nothing_pending_it_says_where_each_rank_is():
    records = {0: record(0, [op("a", "done", 0.0)]), 1: record(1, [], line=3)}
    assert fr.diagnose(records, now=1.0) == [
        "rank 0: no collective pending; its main thread is in /job/train.py:10 train()",
        "rank 1: no collective pending; its main thread is in /job/train.py:3 train()"]


def test_a_collective_every_rank_runs_is_reported_with_its_time():
    records = {r: record(r, [dict(op("big", "running", 0.0), started=1.0)]) for r in (0, 1)}
    assert fr.diagnose(records, now=30.0) == ["allreduce 'big' has run for 30 s on every rank"]


def test_records_are_read_back_newer_than_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(fr.DIR_VAR, str(tmp_path))
    path = fr.write("asked by a test")
    assert path == str(tmp_path / "rank.0.json")
    got = fr.read(tmp_path)
    assert got[0]["reason"] == "asked by a test" and got[0]["ops"] == []
    assert any(t["main"] for t in got[0]["threads"])
    assert fr.read(tmp_path, since=got[0]["time"] + 1) == {}

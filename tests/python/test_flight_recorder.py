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


def test_a_rank_that_sent_no_record_is_named_beside_the_ranks_that_wait():
    # Rank 1 is stopped (SIGSTOP, a frozen host): it answers no request for its record,
    # and the two others wait in the same allreduce. Before, nobody was missing from it
    # and the diagnosis said "no collective pending".
    records = {r: record(r, [op("g1", "submitted", 90.0)]) for r in (0, 2)}
    assert fr.diagnose(records, now=105.0, silent=[1]) == [
        ("rank 1 sent no record while ranks 0, 2 wait in allreduce 'g1' for 15 s: its "
         "process may be stopped or frozen, its host unreachable, or its Python stuck")]
    # A rank whose record came is judged by it, whatever else is said of it.
    records[1] = record(1, [], function="evaluate", line=7)
    assert fr.diagnose(records, now=105.0, silent=[1]) == [
        ("rank 1 has not submitted allreduce 'g1' for 15 s (ranks 0, 2 wait for it); its "
         "main thread is in /job/train.py:7 evaluate()")]


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


def test_a_rank_gone_and_a_collective_that_failed_since_are_named():
    # Rank 2 ended; rank 0's allreduce failed 3 s before it was asked (still news), rank
    # 1's older failure is not, and rank 1 has not submitted 'grad.c'.
    failed = dict(op("grad.c", "failed", 90.0), finished=97.0)
    old = dict(op("grad.a", "failed", 10.0), finished=20.0)
    records = {0: record(0, [failed]), 1: record(1, [old], function="evaluate", line=5)}
    assert fr.diagnose(records, now=100.0, gone={2: "ended with exit code 3"}) == [
        ("rank 1 has not submitted allreduce 'grad.c' for 10 s (rank 0 waited for it); its "
        "main thread is in /job/train.py:5 evaluate()"),
        ("rank 2 ended with exit code 3 while rank 0 waited in allreduce 'grad.c'; it failed "
        "there")]
    both = {r: record(r, [failed]) for r in (0, 1)}
    assert fr.diagnose(both, now=100.0) == ["allreduce 'grad.c' failed on every rank"]


def test_a_summary_keeps_what_the_diagnosis_needs_and_little_else():
    ops = ([op(f"d{i}", "done", i) for i in range(500)]
           + [op(f"p{i}", "submitted", 600 + i) for i in range(100)]
           + [dict(op("f", "failed", 700), finished=701)])
    deep = [{"file": "/job/train.py", "line": i, "function": f"f{i}"} for i in range(100)]
    rec = record(0, ops, extra_frames=deep)
    small = fr.summary(rec)
    assert [o["name"] for o in small["ops"]] == (
        [f"p{i}" for i in range(100 - fr.SUMMARY_OPS + 1, 100)] + ["f"])
    assert [t["main"] for t in small["threads"]] == [True]
    assert small["threads"][0]["stack"] == rec["threads"][1]["stack"][-fr.SUMMARY_FRAMES:]
    assert fr.where(small) == fr.where(rec) == "/job/train.py:99 f99()"
    assert (small["rank"], small["time"]) == (0, 100.0)


def test_the_report_from_files_names_ranks_without_one(tmp_path, capsys):
    import json

    from perseus.runner import flight_report

    for r in (0, 2):
        rec = dict(record(r, [op("grad", "submitted", 95.0)]), size=3)
        (tmp_path / f"rank.{r}.json").write_text(json.dumps(rec))
    assert flight_report.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "records of ranks 0, 2 (none of 1)",
        "rank 1 wrote no record while ranks 0, 2 waited in allreduce 'grad'"]
    assert flight_report.main([str(tmp_path / "none")]) == 1
    assert "no rank.<R>.json in" in capsys.readouterr().err

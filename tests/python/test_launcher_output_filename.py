"""perseusrun --output-filename DIR as horovodrun's (Gloo mode): DIR is created (mkdir -p),
each rank's lines go to DIR/rank.<R>/stdout and DIR/rank.<R>/stderr, R zero-padded to
the width of NP - 1, and still to the terminal, with the same prefix in both places."""

import os
import re
import subprocess
import sys

import pytest
from _launch_helpers import clean_env
from perseus.runner import job as J

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

WORKER = ("import os, sys; r = os.environ['PERSEUS_RANK']; print('hello', r); "
          "print('oops', r, file=sys.stderr); print('bye', r)")
STAMP = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"


def launch(np, out_dir, *flags, cwd):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", str(np),
           "--output-filename", str(out_dir), *flags, sys.executable, "-c", WORKER]
    return subprocess.run(cmd, env=clean_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=100, check=False)


def rank_lines(text, rank, tag):
    return [line for line in text.splitlines() if f"[{rank}]<{tag}>:" in line]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np,names", [
    (1, ["rank.0"]),
    (2, ["rank.0", "rank.1"]),
    (11, [f"rank.{r:02d}" for r in range(11)]),
])
def test_each_rank_gets_a_directory_of_its_stdout_and_stderr_and_still_prints(tmp_path, np,
                                                                               names):
    out_dir = tmp_path / "not" / "yet" / "there"
    r = launch(np, out_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out_dir)) == names
    for rank, name in enumerate(names):
        where = out_dir / name
        assert sorted(os.listdir(where)) == ["stderr", "stdout"]
        assert (where / "stdout").read_text() == (f"[{rank}]<stdout>:hello {rank}\n"
                                                  f"[{rank}]<stdout>:bye {rank}\n")
        assert (where / "stderr").read_text() == f"[{rank}]<stderr>:oops {rank}\n"
        # The terminal gets the same lines.
        assert rank_lines(r.stdout, rank, "stdout") == [f"[{rank}]<stdout>:hello {rank}",
                                                        f"[{rank}]<stdout>:bye {rank}"]
        assert rank_lines(r.stderr, rank, "stderr") == [f"[{rank}]<stderr>:oops {rank}"]


@pytest.mark.timeout(120)
def test_the_files_carry_the_timestamps_the_terminal_gets(tmp_path):
    r = launch(2, tmp_path / "logs", "--prefix-output-with-timestamp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        for tag, console, words in (("stdout", r.stdout, ["hello", "bye"]),
                                    ("stderr", r.stderr, ["oops"])):
            lines = (tmp_path / "logs" / f"rank.{rank}" / tag).read_text().splitlines()
            assert len(lines) == len(words), lines
            for line, word in zip(lines, words):
                assert re.fullmatch(rf"{STAMP}\[{rank}\]<{tag}>:{word} {rank}", line), line
            assert rank_lines(console, rank, tag) == lines


def test_rank_directories_are_padded_to_the_width_of_the_last_rank():
    assert [J.output_dir_name(r, 1) for r in range(1)] == ["rank.0"]
    assert [J.output_dir_name(r, 10) for r in (0, 9)] == ["rank.0", "rank.9"]
    assert [J.output_dir_name(r, 11) for r in (0, 10)] == ["rank.00", "rank.10"]
    assert [J.output_dir_name(r, 100) for r in (7, 99)] == ["rank.07", "rank.99"]
    assert [J.output_dir_name(r, 101) for r in (7, 100)] == ["rank.007", "rank.100"]

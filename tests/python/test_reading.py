"""PERSEUS_SHM_DIRECT unset: each rank times reading its own memory at init and is read
only where a read costs less than three copies (the rings copy twice, across cores); the
collectives follow that choice."""

import re

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_the_pace_check_decides_and_the_collectives_follow(run_workers, n):
    out = run_workers(n, "reading.py",
                      env={"PERSEUS_SHM_DIRECT": "", "PERSEUS_LOG_LEVEL": "debug"})
    paths = set(re.findall(r"rank \d+ path (\w+)", out))
    assert len(re.findall(r"rank \d+ path", out)) == n and len(paths) == 1, out
    refused = re.findall(r"rank (\d+): no rank reads this rank's memory \((.*)\)", out)
    timed = out.count("of this process's memory through process_vm_readv(2)")
    # Every rank timed reading, unless the kernel refused it outright.
    kernel = [why for _, why in refused if "copies of the same bytes" not in why]
    assert timed == n - len(kernel), out
    # One rank not read is enough for the allreduce to take the ring on every rank.
    assert paths == ({"ring"} if refused else {"read"}), (paths, refused)


@pytest.mark.timeout(60)
def test_reading_forced_on_and_off(run_workers):
    for value, path in (("1", "read"), ("0", "ring")):
        out = run_workers(2, "reading.py",
                          env={"PERSEUS_SHM_DIRECT": value, "PERSEUS_LOG_LEVEL": "debug"})
        assert "through process_vm_readv(2)" not in out, out
        if value == "1" and "no rank reads this rank's memory" in out:
            pytest.skip("this host's kernel forbids reading another process's memory")
        assert f"rank 0 path {path}" in out and f"rank 1 path {path}" in out, out

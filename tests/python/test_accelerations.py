"""The PERSEUS_* switches of issue 5, each through its effect on results and counters."""

import re

import pytest

pytest.importorskip("torch")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_accumulate_n_steps(run_workers, n):
    """N steps of batch B equal one step of N*B; only every N-th step communicates;
    clipping on every call clips the reduced sum once, at the window's end."""
    run_workers(n, "accelerations.py", "accumulate", env={"PERSEUS_ACCUMULATE_N_STEPS": "2"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_nancheck(run_workers, n):
    """A NaN or overflow fails the step on every rank, naming tensors and ranks."""
    run_workers(n, "accelerations.py", "nancheck", env={"PERSEUS_ALLREDUCE_NANCHECK": "1"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,fusion", [(2, "0"), (2, "4"), (3, "2")])
def test_allreduce_fusion(run_workers, n, fusion):
    """Fused buffers never exceed 1/N of the gradient bytes; 0 fuses nothing."""
    run_workers(n, "accelerations.py", "fusion", fusion,
                env={"PERSEUS_ALLREDUCE_FUSION": fusion})


@pytest.mark.timeout(120)
def test_perseus_variable_wins_and_init_says_so(run_workers):
    """Set with HOROVOD_FUSION_THRESHOLD, PERSEUS_ALLREDUCE_FUSION decides; rank 0 says so."""
    out = run_workers(2, "accelerations.py", "fusion", "4",
                      env={"PERSEUS_ALLREDUCE_FUSION": "4", "HOROVOD_FUSION_THRESHOLD": "0"})
    said = [line for line in out.splitlines()
            if "PERSEUS_ALLREDUCE_FUSION=4 takes precedence over HOROVOD_FUSION_THRESHOLD=0"
            in line]
    assert len(said) == 1, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,dtype", [(2, "0"), (3, "0"), (2, "1"), (2, "2"), (2, "")])
def test_allreduce_dtype(run_workers, n, dtype):
    """float16 halves the gradient bytes within float16 tolerance; 1, 2 and unset (one
    host) are exact; an overflow is resent exactly and warned about once, naming the tensor."""
    out = run_workers(n, "accelerations.py", "dtype", env={"PERSEUS_ALLREDUCE_DTYPE": dtype})
    warned = [line for line in out.splitlines() if "overflowed" in line]
    if dtype == "0":
        assert len(warned) == 1, out
        assert "layer.overflowing" in warned[0] and "GRADIENT_SCALE=10" in warned[0], warned
    else:
        assert not warned, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype,mode", [("1", ""), ("1", "0"), ("2", "0"), ("0", "1"),
                                        ("", "")])
def test_allreduce_across_hosts(run_workers, dtype, mode):
    """Two loopback "hosts" of two ranks: hierarchical (automatic or 1) and flat modes,
    exact or float16 between hosts (2, the default) or everywhere (0). (Horovod's
    HOROVOD_HIERARCHICAL_ALLREDUCE reads as the mode: test_settings.py.)"""
    run_workers(4, "accelerations.py", "hosts", hosts="127.0.0.1:2,127.0.0.2:2",
                env={"PERSEUS_ALLREDUCE_DTYPE": dtype, "PERSEUS_ALLREDUCE_MODE": mode})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,every,momentum", [(2, "4", "1"), (3, "3", "0.9")])
def test_downsample_n_elements(run_workers, n, every, momentum):
    """1/N of each gradient per step, rotating; the rest kept (decayed) and sent later."""
    run_workers(n, "accelerations.py", "downsample",
                env={"PERSEUS_DOWNSAMPLE_N_ELEMENTS": every,
                     "PERSEUS_GRADIENT_MOMENTUM": momentum})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3])  # 2 ranks: test_ddp.py's switches test
def test_perf_check_names_the_slow_rank(run_workers, n):
    """Every 3 steps; only the slow rank reports, with its host, local rank and figures."""
    out = run_workers(n, "accelerations.py", "perfcheck",
                      env={"PERSEUS_PERF_CHECK_N_STEPS": "3"})
    reports = [line for line in out.splitlines() if "PERSEUS_PERF_CHECK_N_STEPS:" in line]
    assert len(reports) == 2, out
    for line in reports:
        assert line.startswith(f"[{n - 1}]<stderr>:"), out
        assert f"(host localhost, local rank {n - 1})" in line and "ms per step" in line, line
        assert "the median rank's" in line, line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,streams,hosts", [
    (2, "4", "127.0.0.1:1,127.0.0.2:1"),  # two "hosts": TCP between them
    (3, "3", None),                       # one host with PERSEUS_SHM=0
    (2, "1", "127.0.0.1:1,127.0.0.2:1"),  # one stream: nothing striped
])
def test_allreduce_streams(run_workers, n, streams, hosts):
    """Large allreduces between TCP peers are split across the streams, exactly."""
    env = {"PERSEUS_ALLREDUCE_STREAMS": streams}
    if hosts is None:
        env["PERSEUS_SHM"] = "0"
    run_workers(n, "accelerations.py", "streams", env=env, hosts=hosts)


@pytest.mark.timeout(60)
def test_allreduce_streams_must_agree(run_workers):
    """Ranks that disagree on PERSEUS_ALLREDUCE_STREAMS all fail init, naming the other."""
    run_workers(2, "streams_mismatch.py", timeout=45)


@pytest.mark.timeout(150)
def test_hierarchical_allgather_is_exact_and_sends_less_between_hosts(run_workers):
    """HOROVOD_HIERARCHICAL_ALLGATHER=1 on 2 hosts of 2 ranks: the same blocks on every
    rank as the flat ring, with each block crossing to the other host once (the ring
    sends most of them over both of its links between the hosts)."""
    sent = {}
    for mode in ("0", "1"):
        out = run_workers(4, "hier_allgather.py", hosts="127.0.0.1:2,127.0.0.2:2",
                          env={"HOROVOD_HIERARCHICAL_ALLGATHER": mode,
                               "PERSEUS_CHANGE_HVD_ALLGATHER": "1"},  # Horovod's concat
                          timeout=120)
        found = re.search(r"INTER-HOST BYTES (\d+) BLOCKS (\d+)", out)
        sent[mode], blocks = int(found.group(1)), int(found.group(2))
    assert sent["1"] == blocks, (sent, blocks)  # each block to the other host, once
    assert sent["0"] > blocks, (sent, blocks)


@pytest.mark.timeout(90)
def test_allgather_modes_that_differ_fail_on_every_rank_naming_the_variable(run_workers):
    run_workers(4, "hier_allgather.py", "mismatch", hosts="127.0.0.1:2,127.0.0.2:2",
                timeout=60)

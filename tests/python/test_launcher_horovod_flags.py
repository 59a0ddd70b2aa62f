"""horovodrun's own flags on perseusrun: what each sets, the errors, Horovod's config
file, and a job whose ranks' core reads the settings the flags gave."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from _launch_helpers import clean_env
from perseus.runner import horovod_flags as F
from perseus.runner import launch as L


def parse(text):
    return L.parse_args(text.split())


def test_tuning_flags_become_the_variables_the_core_reads():
    args = parse("-np 2 --fusion-threshold-mb 32 --cycle-time-ms 2.5 --cache-capacity 64 "
                 "--timeline-filename t.json --stall-check-warning-time-seconds 20 "
                 "--stall-check-shutdown-time-seconds 90 --num-nccl-streams 2 "
                 "--gloo-timeout-seconds 45 --hierarchical-allreduce python train.py")
    assert F.horovod_env(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 << 20), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "64", "HOROVOD_TIMELINE": "t.json",
        "PERSEUS_STALL_CHECK_TIME_SECONDS": "20", "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "HOROVOD_NUM_NCCL_STREAMS": "2", "GLOO_TIMEOUT_SECONDS": "45",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    assert args.command == ["python", "train.py"]
    assert F.horovod_env(parse("-np 2 --no-hierarchical-allreduce --no-stall-check x")) == {
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_STALL_CHECK_DISABLE": "1"}
    assert F.horovod_env(parse("-np 2 x")) == {}
    assert F.horovod_env(parse("-np 2 --timeline-mark-cycles --log-with-timestamp x")) == {
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_LOG_HIDE_TIME": "0"}
    assert F.horovod_env(parse("-np 2 --log-hide-timestamp x")) == {
        "HOROVOD_LOG_HIDE_TIME": "1"}
    # the job's variables carry them, with seed 000's beside them
    env = L.job_env(parse("-np 2 --fusion-threshold-mb 0 --fuse-optimizer x"), "a", 1)
    assert env["HOROVOD_FUSION_THRESHOLD"] == "0" and env["PERSEUS_FUSED_OPTIMIZER"] == "1"


def test_horovodrun_short_and_other_names():
    args = parse("-np 2 -p 2222 -i /k -hostfile hosts.txt --network-interfaces eth1 "
                 "--tcp --disable-cache x")
    assert (args.ssh_port, args.ssh_identity_file, args.hostfile) == (2222, "/k", "hosts.txt")
    assert args.network_interface == "eth1"
    assert L.rsh_prefix(argparse_without_rsh(args)) == L.DEFAULT_SSH + " -p 2222 -i /k"
    assert parse("--min-np 1 --slots-per-host 4 x").slots == 4
    assert parse("-cb").check_build


def argparse_without_rsh(args):
    args.rsh = None
    return args


def test_version(capsys):
    import perseus

    with pytest.raises(SystemExit) as e:
        L.parse_args(["-v"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"Perseus {perseus.__version__}"


def test_horovodrun_is_installed_and_starts_a_job():
    # Job files of AIAK-Training and elastic Horovod call horovodrun by name.
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    assert os.access(exe, os.X_OK), f"{exe} is not installed"
    code = ("from perseus.common import basics; basics.init(); "
            "print('rank', basics.rank(), 'of', basics.size())")
    out = subprocess.run([exe, "-np", "2", sys.executable, "-c", code], env=clean_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    for r in range(2):
        assert f"[{r}]<stdout>:rank {r} of 2" in out.stdout, out.stdout


def test_mpi_flags_shape_the_mpirun_command(monkeypatch, tmp_path):
    # a fake mpirun that records its command line
    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    rc = L.main(["-np", "1", "--mpi", "--start-timeout", "5", "--binding-args",
                 "--bind-to core --map-by core", "--mpi-args", "--mca btl ^openib -v",
                 "--prefix-output-with-timestamp", "true"])
    argv = (tmp_path / "argv").read_text().split()
    assert rc == 0, argv
    assert "--timestamp-output" in argv and "--tag-output" in argv, argv
    at = argv.index("-H")
    assert argv[at + 2:at + 6] == ["--bind-to", "core", "--map-by", "core"]
    assert "none" not in argv
    tail = argv[argv.index("--mca"):]
    assert tail[:4] == ["--mca", "btl", "^openib", "-v"] and tail[4] == sys.executable


@pytest.mark.parametrize("argv,message", [
    ("--fusion-threshold-mb -1", "--fusion-threshold-mb -1: must be from 0 to"),
    ("--num-nccl-streams 13", "--num-nccl-streams 13: must be from 1 to 12"),
    ("--gloo-timeout-seconds 0", "--gloo-timeout-seconds 0: must be from 1 to 86400"),
    ("--cycle-time-ms x", "--cycle-time-ms: invalid float value: 'x'"),
    ("--nccl-hierarchical-allreduce --no-hierarchical-allreduce",
     "--no-hierarchical-allreduce contradicts --nccl-hierarchical-allreduce"),
    ("--hierarchical-allreduce --no-hierarchical-allreduce", "not allowed with"),
    ("--no-stall-check --stall-check-warning-time-seconds 5",
     "--no-stall-check contradicts --stall-check-warning-time-seconds"),
    ("--mpi-args -v", "--mpi-args act only with --mpi"),
    ("--jsrun", "--jsrun: Perseus does not start jobs through IBM's jsrun"),
])
def test_bad_horovodrun_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        L.parse_args(["-np", "2", *argv.split(), "x"] if "mpi-args" not in argv
                     else ["-np", "2", "--mpi-args=-v", "x"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


CONFIG = """\
# Horovod's configuration file
params:
  fusion_threshold_mb: 16
  cycle_time_ms: 3
  cache_capacity: 512
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: true
  warmup_samples: 5
timeline:
  filename: "tl.json"
  mark_cycles: true
stall_check:
  enabled: false
library_options:
  gloo_timeout_seconds: 120
logging:
  level: debug
"""


def test_config_file_fills_what_flags_do_not_give(tmp_path):
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    args = parse(f"-np 2 --config-file {path} --cycle-time-ms 7 python t.py")
    assert F.horovod_env(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(16 << 20), "HOROVOD_CYCLE_TIME": "7",
        "HOROVOD_CACHE_CAPACITY": "512", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_TIMELINE": "tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "GLOO_TIMEOUT_SECONDS": "120", "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5"}
    assert args.log_level == "DEBUG"
    assert F.without_effect(args) == []


def test_autotune_flags_become_horovods_variables_and_need_autotune(capsys):
    args = parse("-np 2 --autotune --autotune-log-file at.csv --autotune-warmup-samples 0 "
                 "--autotune-steps-per-sample 4 --autotune-bayes-opt-max-samples 9 "
                 "--autotune-gaussian-process-noise 0.25 python t.py")
    assert F.horovod_env(args) == {
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.25"}
    assert F.without_effect(args) == []
    args = parse("-np 2 --autotune-log-file at.csv python t.py")
    assert F.without_effect(args) == ["--autotune-log-file (read only with --autotune)"]
    with pytest.raises(SystemExit) as e:
        parse("-np 2 --autotune --autotune-steps-per-sample 0 python t.py")
    assert e.value.code == 2
    assert "--autotune-steps-per-sample 0: must be from 1 to 100000" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ("params:\n  fusion_mb: 3\n", "unknown key params.fusion_mb (known: fusion_threshold_mb"),
    ("tuning:\n  x: 1\n", "unknown section 'tuning' (known: params, autotune"),
    ("params: 3\n", "line 1: a section (params:) has its keys on the lines below"),
    ("  cycle_time_ms: 3\n", "line 1: a key outside a section"),
    ("params:\n  cycle_time_ms 3\n", "line 2: expected 'key: value'"),
    ("logging:\n  level: loud\n", "logging.level 'LOUD' is none of TRACE, DEBUG"),
    ("params:\n  fusion_threshold_mb: -4\n", "--fusion-threshold-mb -4: must be from 0"),
])
def test_bad_config_files(capsys, tmp_path, text, message):
    path = tmp_path / "horovod.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse(f"-np 2 --config-file {path} x")
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse(f"-np 2 --config-file {tmp_path}/none.yaml x")
    assert f"--config-file {tmp_path}/none.yaml: No such file or directory" in \
        capsys.readouterr().err


WORKER = textwrap.dedent("""
    import json
    from perseus.common import basics as c
    c.init()
    keys = ["HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
            "GLOO_TIMEOUT_SECONDS", "PERSEUS_STALL_CHECK_TIME_SECONDS",
            "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", "PERSEUS_ALLREDUCE_MODE",
            "HOROVOD_NUM_NCCL_STREAMS", "PERSEUS_TIMELINE", "HOROVOD_TIMELINE_MARK_CYCLES",
            "HOROVOD_HIERARCHICAL_ALLGATHER"]
    cfg = c.config()
    print("CONFIG", c.rank(), json.dumps({k: cfg[k] for k in keys}), flush=True)
    c.shutdown()
""")


@pytest.mark.timeout(120)
def test_ranks_run_with_the_settings_of_horovodrun_flags(tmp_path):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", "2",
           "--fusion-threshold-mb", "8", "--cycle-time-ms", "2", "--cache-capacity", "16",
           "--gloo-timeout-seconds", "45", "--no-stall-check",
           "--stall-check-shutdown-time-seconds", "600", "--hierarchical-allreduce",
           "--num-nccl-streams", "3", "--timeline-filename", "tl.json", "--timeline-mark-cycles",
           "--autotune", "--hierarchical-allgather", "--mpi-threads-disable", sys.executable,
           "-c", WORKER]
    out = subprocess.run(cmd, env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=100, check=False)
    assert out.returncode == 0, out.stderr
    want = {"HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_CYCLE_TIME": "2",
            "HOROVOD_CACHE_CAPACITY": "16", "GLOO_TIMEOUT_SECONDS": "45",
            "PERSEUS_STALL_CHECK_TIME_SECONDS": "0",
            "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS": "600", "PERSEUS_ALLREDUCE_MODE": "1",
            "HOROVOD_NUM_NCCL_STREAMS": "3", "PERSEUS_TIMELINE": "tl.json",
            "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    seen = sorted(line.split(" ", 2)[1:] for line in out.stdout.splitlines()
                  if "CONFIG" in line)
    assert [rank for rank, _ in seen] == ["0", "1"], out.stdout
    for _, text in seen:
        assert json.loads(text) == want, text
    assert (tmp_path / "tl.json").exists()
    assert ("perseusrun: warning: no effect in Perseus: --mpi-threads-disable (Perseus's "
            "traffic does not go through MPI)\n") in out.stderr, out.stderr
    # All three knobs autotuning moves were given, so it has nothing to tune; rank 0 says so.
    assert out.stderr.count("HOROVOD_AUTOTUNE=1 has nothing to tune") == 1, out.stderr


@pytest.mark.timeout(120)
def test_prefix_output_with_timestamp_starts_every_line_with_the_time(tmp_path):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", "2",
           "--prefix-output-with-timestamp", sys.executable, "-c",
           "import sys; print('out line'); print('err line', file=sys.stderr)"]
    out = subprocess.run(cmd, env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=100, check=False)
    assert out.returncode == 0, out.stderr
    stamp = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    for text, tag in ((out.stdout, "stdout"), (out.stderr, "stderr")):
        lines = [line for line in text.splitlines() if "line" in line]
        assert len(lines) == 2, text
        for line in lines:
            assert re.fullmatch(rf"{stamp}\[[01]\]<{tag}>:{tag[3:]} line", line), line
    assert "no effect" not in out.stderr, out.stderr

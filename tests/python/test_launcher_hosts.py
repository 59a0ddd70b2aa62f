"""perseusrun's host parsing, placement and command line (no native core needed)."""

import pytest
from perseus.runner import hosts as H
from perseus.runner import job as J
from perseus.runner import launch as L


def test_parse_hosts():
    assert H.parse_hosts("a:2,b:4") == [H.Host("a", 2), H.Host("b", 4)]
    assert H.parse_hosts(" a , b:3") == [H.Host("a", 1), H.Host("b", 3)]
    assert H.parse_hosts("10.0.0.1:8") == [H.Host("10.0.0.1", 8)]


@pytest.mark.parametrize("spec, message", [
    ("a:0", "bad slots '0' for host 'a'"),
    ("a:-1", "bad slots '-1' for host 'a'"),
    ("a:x", "bad slots 'x' for host 'a'"),
    ("a:", "bad slots '' for host 'a'"),
    ("a:2,,b:1", "empty host entry"),
    (":2", "bad host name ''"),
    ("a:1,a:2", "host 'a' is listed more than once"),
])
def test_parse_hosts_errors(spec, message):
    with pytest.raises(H.HostError, match=message):
        H.parse_hosts(spec)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=4\n\nnode2:2   # two GPUs\nnode3\n")
    assert H.parse_hostfile(str(path)) == [
        H.Host("node1", 4), H.Host("node2", 2), H.Host("node3", 1)]


@pytest.mark.parametrize("text, message", [
    ("node1 slots=0\n", r"hosts:1: bad slots '0' for host 'node1'"),
    ("node1 slots=4\nnode2 cpus=2\n", r"hosts:2: expected 'host slots=N'"),
    ("node1 slots=2 extra\n", "hosts:1: expected"),
    ("# nothing\n", "no hosts given"),
    ("a:1\na slots=2\n", "listed more than once"),
])
def test_parse_hostfile_errors(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(H.HostError, match=message):
        H.parse_hostfile(str(path))


def test_missing_hostfile(tmp_path):
    with pytest.raises(H.HostError, match="cannot read host file"):
        H.parse_hostfile(str(tmp_path / "absent"))


def _table(slots):
    return [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots]


def test_place_host_by_host():
    slots = H.place([H.Host("a", 2), H.Host("b", 2)], 4)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 2, 1, 2), ("b", 3, 1, 2, 1, 2)]
    assert all(s.size == 4 for s in slots)


def test_place_uneven_and_unused_hosts():
    # 3 ranks over a:2,b:4,c:1: b takes one, c none; cross sets follow Horovod.
    slots = H.place([H.Host("a", 2), H.Host("b", 4), H.Host("c", 1)], 3)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 2), ("a", 1, 1, 2, 0, 1), ("b", 2, 0, 1, 1, 2)]


def test_place_errors():
    with pytest.raises(H.HostError, match=r"-np 5 is more than the 4 slots available "
                                          r"\(a:2,b:2\)"):
        H.place([H.Host("a", 2), H.Host("b", 2)], 5)
    with pytest.raises(H.HostError, match="at least 1"):
        H.place([H.Host("a", 2)], 0)


def test_slot_env_has_horovod_aliases():
    env = H.place([H.Host("a", 1), H.Host("b", 1)], 2)[1].env()
    for key, value in [("RANK", "1"), ("SIZE", "2"), ("LOCAL_RANK", "0"),
                       ("LOCAL_SIZE", "1"), ("CROSS_RANK", "1"), ("CROSS_SIZE", "2"),
                       ("HOSTNAME", "b")]:
        assert env["PERSEUS_" + key] == env["HOROVOD_" + key] == value


def test_is_local():
    names = {"localhost", "127.0.0.1", "box"}
    assert H.is_local("localhost", names) and H.is_local("box", names)
    assert H.is_local("127.0.1.1", names)
    assert not H.is_local("node7", names)
    assert H.is_local("localhost")


def test_parse_args_command_and_defaults():
    args = L.parse_args(["-np", "2", "python", "train.py", "-np", "3", "--verbose"])
    assert args.num_proc == 2 and args.command == ["python", "train.py", "-np", "3",
                                                   "--verbose"]
    assert not args.verbose and args.start_timeout == 30
    assert L.host_list(args) == [H.Host("localhost", 2)]
    args = L.parse_args(["-np", "2", "-H", "a:1,b:1", "--", "python", "-c", "pass"])
    assert args.command == ["python", "-c", "pass"]
    assert L.host_list(args) == [H.Host("a", 1), H.Host("b", 1)]
    args = L.parse_args(["--min-np", "2", "--blacklist-cooldown-range", "10", "100", "python"])
    assert args.elastic and (args.min_np, args.num_proc, args.max_np) == (2, 2, 2)
    assert args.cooldown == [10, 100] and args.command == ["python"]


@pytest.mark.parametrize("argv, message", [
    (["python", "x.py"], "-np NP is required"),
    (["-np", "2"], "no command given"),
    (["-np", "2", "-H", "a:2", "--hostfile", "f", "true"], "not allowed with"),
    (["-np", "2", "--gloo", "--mpi", "true"], "not allowed with"),
    (["-np", "3", "--min-np", "4", "true"], "needs 1 <= --min-np (4) <= -np (3)"),
    (["--min-np", "1", "--mpi", "true"], "not --mpi"),
    (["--min-np", "1", "--elastic-timeout", "0", "true"], "--elastic-timeout must be"),
    (["--min-np", "1", "--blacklist-cooldown-range", "5", "2", "true"],
     "--blacklist-cooldown-range 5 2: needs 0 < MIN <= MAX seconds"),
    (["-np", "1", "--blacklist-cooldown-range", "1", "2", "true"],
     "--blacklist-cooldown-range is for elastic jobs"),
])
def test_parse_args_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        L.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_main_reports_bad_hosts(capsys):
    assert L.main(["-np", "3", "-H", "a:2", "true"]) == 2
    assert "-np 3 is more than the 2 slots available" in capsys.readouterr().err


def test_mpi_without_mpirun(monkeypatch, capsys):
    monkeypatch.setattr(L.shutil, "which", lambda _name: None)
    with pytest.raises(SystemExit, match="--mpi needs mpirun"):
        L.main(["-np", "1", "--mpi", "true"])


def test_rsh_argv():
    assert J.rsh_argv("ip netns exec {host}", "ns1", "S") == [
        "ip", "netns", "exec", "ns1", "sh", "-c", "S"]
    assert J.rsh_argv("ssh -p 22 {host}", "n1", "S") == ["ssh", "-p", "22", "n1", "S"]
    assert J.rsh_argv("/usr/bin/ssh -p 2222", "n1", "S") == [
        "/usr/bin/ssh", "-p", "2222", "n1", "S"]


def test_default_rsh_uses_ssh_options():
    args = L.parse_args(["-np", "1", "--ssh-port", "2222", "--ssh-identity-file", "/k",
                         "true"])
    args.rsh = None
    assert L.rsh_prefix(args) == L.DEFAULT_SSH + " -p 2222 -i /k"


def test_remote_script_keeps_secret_off_the_command_line():
    script = J.remote_script(["python", "a b.py"], {"PERSEUS_RANK": "1"}, "/w d")
    assert "cd '/w d'" in script and "PERSEUS_RANK=1 python 'a b.py'" in script
    assert "read -r PERSEUS_SECRET" in script
    launcher = {"PERSEUS_SECRET": "x", "HOROVOD_A": "1", "PATH": "/venv/bin:/bin",
                "MXNET_USE_OPERATOR_TUNING": "0", "HOSTNAME": "launcher", "PWD": "/w",
                "OLDPWD": "/", "SHLVL": "2", "_": "/bin/perseusrun",
                "SSH_CONNECTION": "a b c d", "BASH_FUNC_f%%": "() { :; }"}
    assert J.forwarded_env(launcher) == {"HOROVOD_A": "1", "PATH": "/venv/bin:/bin",
                                         "MXNET_USE_OPERATOR_TUNING": "0"}


def test_describe_status():
    assert J.describe_status(3) == "exit code 3" and J.exit_status(3) == 3
    assert J.describe_status(-9) == "signal SIGKILL" and J.exit_status(-9) == 137


def test_help_works_without_core(capsys):
    with pytest.raises(SystemExit) as e:
        L.main(["-h"])
    assert e.value.code == 0
    assert "perseusrun -np NP" in capsys.readouterr().out


def test_mpi_rank_shim_maps_mpirun_ranks(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="3",
               PERSEUS_MPI_PLACEMENT="a:2,b:2")
    show = "import os; print(*(os.environ[k] for k in sorted(os.environ) if 'RANK' in k))"
    out = subprocess.run([sys.executable, "-m", "perseus.runner.mpi_rank", sys.executable,
                          "-c", show], env=env, capture_output=True, text=True, check=True)
    # HOROVOD_CROSS_RANK HOROVOD_LOCAL_RANK HOROVOD_RANK OMPI_... PERSEUS_CROSS_RANK ...
    assert out.stdout.split() == ["1", "0", "2", "2", "1", "0", "2"]


def test_describe_ranks_and_checked_in_ranks():
    slots = H.place([H.Host("a", 2), H.Host("b", 2)], 4)
    assert J.describe_ranks([slots[3], slots[0]]) == "rank 0 (host a), rank 3 (host b)"
    assert J.describe_ranks(slots[2:]) == "ranks 2, 3 (host b)"
    assert J.checked_in_ranks(["mesh/0", "mesh/12", "other", "mesh/x"]) == {0, 12}
    # a perseus.run task checks in when it starts, before its function's hvd.init()
    assert J.checked_in_ranks(["perseus.run/started/3", "perseus.run/started/x",
                               "perseus.run/func/parts", "mesh/0"]) == {0, 3}


def test_start_watch():
    slots = H.place([H.Host("a", 1), H.Host("b", 2)], 3)
    now, seen = [0.0], set()

    def watch():
        return J.StartWatch(slots, lambda: seen, 5, clock=lambda: now[0])

    w = watch()
    assert w.check() is None  # before the deadline
    now[0], seen = 5.0, {0}
    assert w.check().startswith("ranks 1, 2 (host b) did not check in at the rendezvous "
                                "within 5 s (--start-timeout)")
    # rank 2 ended without error and nobody waits for it: it is not missing
    seen = set()
    assert w.check(finished={2}).startswith("rank 0 (host a), rank 1 (host b) did not "
                                            "check in")
    # rank 0 waits in init() for rank 2, which ended without it: named at once
    now[0], seen = 0.0, {0}
    assert watch().check(finished={2}) == (
        "rank 2 (host b) exited without error before reaching hvd.init(), while rank 0 "
        "(host a) waits there for it; stopping the job")
    seen = {0, 1, 2}  # rank 2 checked in before it ended
    w = watch()
    assert w.check(finished={2}) is None and w.done
    seen = set()
    assert w.check() is None  # once everyone checked in, the watch is over


def test_rendezvous_address(monkeypatch):
    names = {"localhost", "box"}
    args = L.parse_args(["-np", "1", "true"])
    assert L.rendezvous_address(args, ["localhost", "box"], names) == "127.0.0.1"
    args.network_interface = "lo"
    assert L.rendezvous_address(args, ["node1"], names) == "127.0.0.1"
    args.network_interface = None
    with pytest.raises(H.HostError, match="'no-such-host.invalid'.*pass --network-interface"):
        L.rendezvous_address(args, ["no-such-host.invalid"], names)
    args.network_interface = "no-such-if0"
    with pytest.raises(H.HostError, match="--network-interface no-such-if0: no IPv4"):
        L.rendezvous_address(args, ["node1"], names)


def test_processes_already_running_get_consecutive_ranks_by_host():
    # Ray actors or Spark tasks, by the host each landed on: b, a, b, c, a.
    order, slots = H.place_by_host(["b", "a", "b", "c", "a"])
    assert order == [0, 2, 1, 4, 3]
    assert [s.hostname for s in slots] == ["b", "b", "a", "a", "c"]
    assert [(s.rank, s.local_rank, s.local_size) for s in slots] == [
        (0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2), (4, 0, 1)]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [
        (0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    assert all(s.size == 5 for s in slots)

"""Several hosts on one machine: network namespaces plugged into a bridge of the
tests' own, reached by perseusrun through ``--rsh 'ip netns exec {host}'``.

Each namespace is named after its address (10.231.K.2, 10.231.K.3 on a bridge at
10.231.K.1/24 made here; traffic stays on this machine), so the host names need no
lookup: perseusrun finds its own address on the route to the first host (the bridge
address) and gives it to the ranks as the rendezvous; each rank listens on its
namespace's address, the source of its route back. Needs root and iproute2; skipped,
with the reason, only where namespaces cannot be made.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from _launch_helpers import WORKER, check_results, clean_env, run
from _netns import IP, PY, NamespaceHosts, Unavailable
from perseus.runner.hosts import Host, place

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")


@pytest.fixture(scope="module")
def netns():
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("making network namespaces needs iproute2's ip")
    net = NamespaceHosts()
    try:
        try:
            net.create()
        except (Unavailable, OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot make network namespaces here: {e}")
        net.check_reachable()
        yield net
    finally:
        net.destroy()


def perseusrun(net, *args, timeout=60):
    cmd = [PY, "-m", "perseus.runner.launch", "--rsh", f"{IP} netns exec {{host}}",
           "--verbose", *map(str, args)]
    return run(cmd, clean_env(GLOO_TIMEOUT_SECONDS=20), timeout=timeout)


def assert_no_process_left(net, within=5.0):
    deadline = time.monotonic() + within
    while net.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not net.pids(), "processes outlived the job in the namespaces"


def check_hosts(results, slots, net):
    """Each rank ran in the namespace of its host and listened on its address."""
    root_ns = os.stat("/proc/self/ns/net").st_ino
    netns_of = {}
    for s in slots:
        where = results[s.rank]["where"]
        assert where["addr"] == s.hostname, (s, where)
        assert where["netns"] != root_ns, (s, where)
        assert netns_of.setdefault(s.hostname, where["netns"]) == where["netns"], (s, where)
    assert len(set(netns_of.values())) == len(net.hosts)


@pytest.mark.timeout(90)
def test_four_ranks_on_two_hosts(netns):
    a, b = netns.hosts
    slots = place([Host(a, 2), Host(b, 2)], 4)
    rc, out = perseusrun(netns, "-np", 4, "-H", f"{a}:2,{b}:2", PY, WORKER)
    results = check_results(rc, out, slots, "perseusrun on two namespaces")
    assert f"rendezvous at {netns.gateway}:" in out, out
    check_hosts(results, slots, netns)
    assert_no_process_left(netns)


@pytest.mark.timeout(90)
def test_hostfile_and_network_interface(netns, tmp_path):
    # Uneven: one rank on the first host, two on the second (odd size, cross sets differ).
    a, b = netns.hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two namespaces\n{a} slots=1\n{b} slots=2\n")
    slots = place([Host(a, 1), Host(b, 2)], 3)
    # The launcher's machine has the bridge, the namespaces eth0: each uses the first of
    # the list it has.
    rc, out = perseusrun(netns, "-np", 3, "--hostfile", hostfile, "--network-interface",
                         f"{netns.bridge},eth0", PY, WORKER)
    results = check_results(rc, out, slots, "perseusrun --hostfile --network-interface")
    assert f"rendezvous at {netns.gateway}:" in out, out
    check_hosts(results, slots, netns)
    assert_no_process_left(netns)


FAIL_WORKER = textwrap.dedent("""
    import os, sys, time
    if os.environ["PERSEUS_RANK"] == "3":
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_failing_rank_on_a_remote_host_stops_every_host(netns):
    a, b = netns.hosts
    start = time.monotonic()
    rc, out = perseusrun(netns, "-np", 4, "-H", f"{a}:2,{b}:2", PY, "-c", FAIL_WORKER)
    assert time.monotonic() - start < 10, out
    assert rc == 3, out
    assert f"rank 3 (host {b}) failed with exit code 3" in out, out
    assert_no_process_left(netns)



@pytest.mark.timeout(90)
def test_perseus_run_reaches_ranks_on_remote_hosts(netns):
    """perseus.run (horovod.run) with a rank on each namespace host: the function, its
    result and the secret cross the remote shell; PERSEUS_RSH names it."""
    a, b = netns.hosts
    driver = os.path.join(os.path.dirname(WORKER), "run_function_driver.py")
    env = clean_env(GLOO_TIMEOUT_SECONDS=20, PERSEUS_RSH=f"{IP} netns exec {{host}}")
    rc, out = run([PY, driver, "hosts", a, b], env, timeout=80)
    assert rc == 0, out
    got = json.loads(next(x for x in out.splitlines()
                          if x.startswith("RUN-RESULT "))[len("RUN-RESULT "):])
    root_ns = os.stat("/proc/self/ns/net").st_ino
    assert [(g["rank"], g["sum"]) for g in got] == [(0, 3.0), (1, 3.0)], out
    assert len({g["netns"] for g in got} | {root_ns}) == 3, got
    assert_no_process_left(netns)


PARTITION_WORKER = textwrap.dedent("""
    import time
    import torch
    import perseus.torch.horovod as hvd
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warm.up")
    print(f"READY {hvd.rank()}", flush=True)
    time.sleep(3)  # the test cuts the second host off meanwhile
    t0 = time.time()
    try:
        hvd.allreduce(torch.ones(4), name="after.cut")
    except hvd.HorovodInternalError as e:
        print(f"rank {hvd.rank()} error after {time.time() - t0:.0f} s: {e}", flush=True)
        raise SystemExit(3)
    print(f"rank {hvd.rank()}: no error", flush=True)
""")


@pytest.mark.timeout(90)
def test_a_host_cut_off_the_network_fails_the_job_on_both_sides(netns):
    # Two ranks on each host; after the warm-up the second host's link to the bridge goes
    # down: no end of file reaches anyone (the packets are dropped), and no transfer has
    # started. Each side's engine pings the ranks it waits for, gets no answer for
    # GLOO_TIMEOUT_SECONDS, and fails naming them; perseusrun then stops the job.
    a, b = netns.hosts
    cmd = [PY, "-m", "perseus.runner.launch", "--rsh", f"{IP} netns exec {{host}}",
           "-np", "4", "-H", f"{a}:2,{b}:2", PY, "-c", PARTITION_WORKER]
    proc = subprocess.Popen(cmd, env=clean_env(GLOO_TIMEOUT_SECONDS=5),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if sum("READY" in x for x in lines) == 4:
                break
        netns.cut(1)
        start = time.monotonic()
        lines.extend(proc.stdout)
        proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        netns.restore(1)  # for the tests after this one
    out = "".join(lines)
    assert proc.returncode != 0, out
    assert "no error" not in out, out
    # The ranks of the first host name a rank of the second, unreachable (those of the
    # second name rank 0 the same way, unless perseusrun stopped them first).
    for r in (0, 1):
        said = next(x for x in lines if x.startswith(f"[{r}]<stdout>:rank {r} error after"))
        assert "is gone (it has answered nothing for " in said, out
        assert f"its host cannot be reached (GLOO_TIMEOUT_SECONDS); it ran on host {b}" in said
    # perseusrun's diagnosis: the second host's ranks sent no record (whichever rank of
    # the first host failed first, the other waited).
    assert re.search(r"rank [23] sent no record while rank [01] waited in allreduce "
                     r"'after\.cut'", out), out
    assert took < 40, out
    assert_no_process_left(netns)

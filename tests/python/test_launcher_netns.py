"""Several hosts on one machine: network namespaces plugged into a bridge of the
tests' own, reached by perseusrun through ``--rsh 'ip netns exec {host}'``.

Each namespace is named after its address (10.231.K.2, 10.231.K.3 on a bridge at
10.231.K.1/24 made here; traffic stays on this machine), so the host names need no
lookup: perseusrun finds its own address on the route to the first host (the bridge
address) and gives it to the ranks as the rendezvous; each rank listens on its
namespace's address, the source of its route back. Needs root and iproute2; skipped,
with the reason, only where namespaces cannot be made.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _launch_helpers import WORKER, check_results, clean_env, run
from perseus.runner.hosts import Host, place

pytest.importorskip("perseus._core", reason="the Perseus core (perseus._core) is not built")

PY = sys.executable
IP = shutil.which("ip") or "ip"


class Unavailable(Exception):
    """A namespace, bridge or veth pair could not be made here."""


def ip(*args, check=True):
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=False)
    if check and r.returncode != 0:
        raise Unavailable(f"'ip {' '.join(args)}' failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


class NamespaceHosts:
    """A bridge with an address on this machine and ``count`` namespaces, each joined to
    it by a veth pair and named after its own address."""

    def __init__(self, count=2):
        self.count = count
        self.bridge, self.veths, self.hosts, self.gateway = None, [], [], None

    def _free_names(self):
        """A bridge name and veth names no interface has (another run may hold some)."""
        links = ip("-o", "link", "show")
        for offset in range(1000):
            tag = (os.getpid() + offset) % 10000
            names = [f"pbr{tag}", *(f"pv{tag}x{i}" for i in range(self.count))]
            if not any(f" {n}:" in links or f" {n}@" in links for n in names):
                return names[0], names[1:]
        raise Unavailable("no free interface names")

    def _free_subnet(self):
        used = ip("-4", "-o", "addr", "show") + ip("netns", "list")
        for offset in range(250):
            k = (os.getpid() + offset) % 250 + 1
            if f"10.231.{k}." not in used:
                return k
        raise Unavailable("no free 10.231.K.0/24 subnet")

    def create(self):
        k = self._free_subnet()
        self.gateway = f"10.231.{k}.1"
        bridge, veths = self._free_names()
        ip("link", "add", bridge, "type", "bridge")
        self.bridge = bridge
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, veth in enumerate(veths):
            name = f"10.231.{k}.{i + 2}"
            ip("netns", "add", name)
            self.hosts.append(name)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            self.veths.append(veth)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", name, "addr", "add", f"{name}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("netns", "exec", name, "true")

    def check_reachable(self):
        """Every namespace reaches the bridge address over TCP (the rendezvous path)."""
        with socket.socket() as server:
            server.bind((self.gateway, 0))
            server.listen(8)
            port = server.getsockname()[1]
            accepted = threading.Thread(target=lambda: [server.accept()[0].close()
                                                        for _ in self.hosts], daemon=True)
            accepted.start()
            probe = f"import socket; socket.create_connection(('{self.gateway}', {port}), 5)"
            for name in self.hosts:
                r = subprocess.run([IP, "netns", "exec", name, PY, "-c", probe],
                                   capture_output=True, text=True, timeout=30, check=False)
                assert r.returncode == 0, (
                    f"namespace {name} cannot reach {self.gateway} over the bridge "
                    f"{self.bridge} (a firewall on bridged traffic?): {r.stderr}")
            accepted.join(10)

    def pids(self):
        """Processes still running in the namespaces."""
        return [int(p) for name in self.hosts
                for p in ip("netns", "pids", name, check=False).split()]

    def destroy(self):
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in self.hosts:
            ip("netns", "del", name, check=False)
        for link in (*self.veths, self.bridge):
            if link and ip("link", "show", link, check=False):
                ip("link", "del", link, check=False)


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


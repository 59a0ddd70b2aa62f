"""Several hosts on one machine: network namespaces joined by a bridge of their own,
for the namespace tests (test_launcher_netns.py) and the slow-link benchmark
(benchmarks/slow_link.py). Needs root and iproute2 (and tc for :meth:`shape`)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

PY = sys.executable
IP = shutil.which("ip") or "ip"
TC = shutil.which("tc") or "tc"


def ip(*args, check=True):
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=False)
    if check and r.returncode != 0:
        raise Unavailable(f"'ip {' '.join(args)}' failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


class Unavailable(Exception):
    """A namespace, bridge or veth pair could not be made here."""


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

    def shape(self, rate):
        """Limits what each namespace receives to ``rate`` (tc's syntax: ``1gbit``), a
        token bucket on the bridge's side of its veth: a link of that speed into every
        host, both directions at once."""
        for veth in self.veths:
            r = subprocess.run([TC, "qdisc", "replace", "dev", veth, "root", "tbf", "rate",
                                rate, "burst", "1mb", "latency", "100ms"],
                               capture_output=True, text=True, timeout=20, check=False)
            if r.returncode != 0:
                raise Unavailable(f"tc cannot shape {veth}: {r.stderr.strip()}")

    def cut(self, i):
        """Takes host ``i``'s link to the bridge down: its packets are dropped, and no
        connection to it ends (a host that drops off the network)."""
        ip("link", "set", self.veths[i], "down")

    def restore(self, i, within=30.0):
        """Brings host ``i``'s link back, forgets the addresses that failed to resolve
        meanwhile, and waits until every host reaches the bridge again."""
        ip("link", "set", self.veths[i], "up")
        deadline = time.monotonic() + within
        while True:
            ip("neigh", "flush", "dev", self.bridge, check=False)
            ip("-n", self.hosts[i], "neigh", "flush", "dev", "eth0", check=False)
            try:
                self.check_reachable()
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

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

"""Host lists (``-H``, ``--hostfile``) and the placement of ranks on hosts."""

import re
import socket
from dataclasses import dataclass

from perseus._topology import NAMES, variables


class HostError(ValueError):
    """A host list, host file or placement request that cannot be used."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and the topology it reports."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def env(self):
        """The rank's topology variables, under PERSEUS_* and HOROVOD_* names."""
        numbers = (self.rank, self.size, self.local_rank, self.local_size,
                   self.cross_rank, self.cross_size)
        return variables(**dict(zip(NAMES, numbers)), HOSTNAME=self.hostname)


_HOST_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _slots(text, host, where):
    slots = int(text) if text.strip().isdigit() else 0
    if slots < 1:
        raise HostError(f"{where}: bad slots {text!r} for host {host!r}: "
                        "slots must be a positive integer")
    return slots


def _host(name, slots_text, where):
    if not name or not _HOST_NAME.match(name):
        raise HostError(f"{where}: bad host name {name!r}")
    return Host(name, 1 if slots_text is None else _slots(slots_text, name, where))


def _check_unique(hosts, where):
    seen = set()
    for h in hosts:
        if h.name in seen:
            raise HostError(f"{where}: host {h.name!r} is listed more than once")
        seen.add(h.name)
    if not hosts:
        raise HostError(f"{where}: no hosts given")
    return hosts


def parse_hosts(spec):
    """``"h1:2,h2:4"`` -> hosts; a host without ``:N`` has one slot."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise HostError(f"-H {spec!r}: empty host entry")
        name, sep, slots = item.rpartition(":")
        where = f"-H {spec!r}"
        hosts.append(_host(name, slots, where) if sep else _host(item, None, where))
    return _check_unique(hosts, f"-H {spec!r}")


def parse_hostfile_text(text, path="hostfile"):
    """Lines ``host slots=N``, ``host:N`` or ``host``; ``#`` starts a comment."""
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        words = line.split()
        if len(words) == 1:
            name, sep, slots = words[0].rpartition(":")
            hosts.append(_host(name, slots, where) if sep else _host(words[0], None, where))
        elif len(words) == 2 and words[1].startswith("slots="):
            hosts.append(_host(words[0], words[1][len("slots="):], where))
        else:
            raise HostError(f"{where}: expected 'host slots=N' or 'host:N', got {line!r}")
    return _check_unique(hosts, path)


def parse_hostfile(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise HostError(f"cannot read host file {path!r}: {e.strerror}") from None
    return parse_hostfile_text(text, path)


def place(hosts, num_proc):
    """Place ``num_proc`` ranks host by host, filling each host's slots in order.

    ``cross_rank``/``cross_size`` follow Horovod: the index of this rank's host among
    the hosts that have a rank with the same ``local_rank``, and how many such hosts.
    """
    total = sum(h.slots for h in hosts)
    if num_proc < 1:
        raise HostError(f"-np must be at least 1, got {num_proc}")
    if num_proc > total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise HostError(f"-np {num_proc} is more than the {total} slots available "
                        f"({listed}); add hosts or slots")
    counts, left = [], num_proc
    for h in hosts:
        n = min(h.slots, left)
        if n:
            counts.append((h.name, n))
        left -= n
    slots = []
    for host_index, (name, n) in enumerate(counts):
        for local_rank in range(n):
            peers = [i for i, (_, m) in enumerate(counts) if m > local_rank]
            slots.append(Slot(name, len(slots), num_proc, local_rank, n,
                              peers.index(host_index), len(peers)))
    return slots


def place_by_host(hosts):
    """Ranks for processes already running, ``hosts[i]`` being process ``i``'s host (a Ray
    actor's node, a Spark task's executor): the processes of one host get consecutive
    ranks, hosts in the order their first process came. Returns ``order`` (``order[r]``:
    the process of rank ``r``) and the slots of :func:`place`, by rank."""
    order = sorted(range(len(hosts)), key=lambda i: (hosts.index(hosts[i]), i))
    counts = []
    for i in order:
        if counts and counts[-1].name == hosts[i]:
            counts[-1] = Host(hosts[i], counts[-1].slots + 1)
        else:
            counts.append(Host(hosts[i], 1))
    return order, place(counts, len(hosts))


def local_names():
    names = {"localhost", "127.0.0.1", "::1"}
    for fn in (socket.gethostname, socket.getfqdn):
        try:
            name = fn()
        except OSError:
            continue
        names.update({name, name.split(".")[0]})
    return names


def is_local(name, _names=None):
    """Whether ``name`` is this machine (spawned directly, not through the rsh prefix)."""
    return name in (_names or local_names()) or name.startswith("127.")

"""Network facts of this machine (Linux): the IPv4 address of an interface, a free port;
for the launcher and the ranks alike. Imports nothing of Perseus."""

import socket

_SIOCGIFADDR = 0x8915


def ipv4_of(name):
    """``(address, None)`` with interface ``name``'s IPv4 address, or ``(None, reason)``
    when it has none (or does not exist)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            return None, e.strerror
    return socket.inet_ntoa(packed[20:24]), None


def first_ipv4(names):
    """The address of the first of the comma-separated interfaces ``names`` that has one,
    as ``(address, None)``; ``(None, "name: why; ...")`` when none has."""
    why = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        address, reason = ipv4_of(name)
        if address is not None:
            return address, None
        why.append(f"{name}: {reason}")
    return None, "; ".join(why)


def free_port():
    """A TCP port free on every address of this machine now (the kernel's pick): for a
    server the caller starts at once, such as rank 0's or torch's store."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

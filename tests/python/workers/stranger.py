"""Rank 0 plays a stranger against the job's own rendezvous while the job runs: garbage,
a truncated frame, an absurd length, a handshake without the secret, silence. Each
connection must be closed by the server; then every rank checks collectives still work.

Usage: stranger.py (through perseusrun, which hosts the rendezvous and holds the secret)
"""

import os
import socket
import struct
import time

import perseus.torch.horovod as hvd
import torch
from _helpers import done

MAGIC, VERSION = 0x5052_5353, 1
HELLO, CHALLENGE, PROOF, REFUSED = 0x300, 0x301, 0x302, 0x303


def frame(kind, payload, claimed=None):
    n = len(payload) if claimed is None else claimed
    return struct.pack("<IHHQ", MAGIC, VERSION, kind, n) + payload


def connect():
    addr = os.environ["PERSEUS_RENDEZVOUS_ADDR"]
    port = int(os.environ["PERSEUS_RENDEZVOUS_PORT"])
    s = socket.create_connection((addr, port), timeout=20)
    s.settimeout(20)
    return s


def read_frame(s):
    head = b""
    while len(head) < 16:
        chunk = s.recv(16 - len(head))
        if not chunk:
            return None
        head += chunk
    _, _, kind, n = struct.unpack("<IHHQ", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return kind, body


def closed_by_server(s, what):
    """The server hangs up (EOF or reset), never answers with data, within 20 s."""
    t0 = time.time()
    try:
        got = s.recv(1 << 16)
    except ConnectionResetError:
        got = b""
    assert got == b"", f"{what}: the server answered {got[:40]!r} instead of closing"
    s.close()
    return time.time() - t0


def stranger():
    s = connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    closed_by_server(s, "HTTP request")

    s = connect()
    s.sendall(frame(HELLO, b"0123456789", claimed=100))
    s.shutdown(socket.SHUT_WR)
    closed_by_server(s, "truncated hello")

    s = connect()
    s.sendall(frame(HELLO, b"", claimed=1 << 40))
    closed_by_server(s, "absurd length")

    # A well-formed handshake by someone who does not know the secret.
    s = connect()
    s.sendall(frame(HELLO, os.urandom(16) + b"rendezvous"))
    kind, body = read_frame(s)
    assert kind == CHALLENGE and len(body) == 48, (hex(kind), len(body))
    s.sendall(frame(PROOF, os.urandom(32)))
    kind, body = read_frame(s)
    assert kind == REFUSED and body == b"wrong job secret", (hex(kind), body)
    closed_by_server(s, "wrong proof")

    # Silence: dropped after the handshake time (5 s), not held forever.
    s = connect()
    waited = closed_by_server(s, "silent connection")
    assert waited < 15, f"a silent connection was held {waited:.1f} s"


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        stranger()
    for step in range(5):
        t = hvd.allreduce(torch.full((1000,), float(r + step)), op=hvd.Sum,
                          name=f"after.{step}")
        assert torch.equal(t, torch.full((1000,), float(n * (n - 1) // 2 + n * step)))
    hvd.shutdown()
    done(r)


if __name__ == "__main__":
    main()

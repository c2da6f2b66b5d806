"""Unauthenticated connections for flood tests: what an attacker without a certificate can open."""

from __future__ import annotations

import socket
import time


def open_strangers(addr, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """``n`` plain TCP connections, never TLS: half silent, half stopped inside a ClientHello,
    all from ``source`` (Linux routes all of 127/8 to lo)."""
    out = []
    for i in range(n):
        if i % 50 == 49:
            # when the server shares this interpreter's GIL, let its accept loop drain the kernel's
            # accept queue, or a full queue drops SYNs and connect() stalls for 1 s
            time.sleep(0.01)
        try:
            s = socket.create_connection(addr, timeout=5, source_address=(source, 0))
        except OSError:
            continue  # a full accept queue: the attack is no weaker for it
        if i % 2:
            s.sendall(b"\x16\x03\x01\x02\x00\x01")
        out.append(s)
    return out

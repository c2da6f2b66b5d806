"""Who an engine relay (``mpc.metered_relay``) forwards: the peer's address, a few at a time.

Why (issue 25, finding 7): the inbound relay listens where the peer can reach it, so anyone
else can too, and it started threads for every connection (300 strangers: 297-693 threads in
the engine process). A gate admits a connection only from the peer's address (the one the
session's channel came from: the peer's relay dials ours over the same route) and only while
fewer than ``max_connections`` are being forwarded; any other is closed at accept, before a
thread is started, and counted in one log line per ``LOG_EVERY`` seconds.

What it cannot do: see a certificate. The library's own TLS behind the relay checks the peer's
session certificate; a process on the peer's host gets as far as that handshake and no
further, and holds at most the cap's slots while it tries. Refusing over the cap, rather than
dropping the oldest as the handshake pool does, keeps a link that is up from being cut by
such a process.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from typing import Callable

__all__ = ["MAX_LINK_CONNECTIONS", "Countdown", "RelayGate"]

#: connections a relay forwards at once. The library opens one per link (measured through the
#: inbound relay, also with the 32-bit runtime's sub-link); a failed dial is closed before it
#: retries. The margin covers a library version that opens a few more.
MAX_LINK_CONNECTIONS = 8
LOG_EVERY = 10.0   # seconds between summaries of refused connections

log = logging.getLogger("starfish.relay")


def _address(host: str) -> str:
    """``host`` in one spelling (an IPv4-mapped IPv6 address as IPv4), to compare addresses."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


class RelayGate:
    """Admission of one relay's connections; thread-safe. ``peer_host`` ``None``: any address
    (a relay on loopback that only our own library dials)."""

    def __init__(self, peer_host: str | None, max_connections: int = MAX_LINK_CONNECTIONS,
                 name: str = "engine link relay") -> None:
        if max_connections < 1:
            raise ValueError("a relay must forward at least one connection")
        self.name = name
        self.max_connections = max_connections
        self._peer = _address(peer_host) if peer_host is not None else None
        self._lock = threading.Lock()
        self.live = 0          # connections being forwarded
        self.refused = 0       # closed at accept, in all
        self._unlogged = 0
        self._logged_at: float | None = None

    def admit(self, host: str, now: float | None = None) -> bool:
        """May a connection from ``host`` be forwarded? If so it holds a slot until ``release``."""
        stranger = self._peer is not None and _address(host) != self._peer
        with self._lock:
            ok = not stranger and self.live < self.max_connections
            if ok:
                self.live += 1
                return True
            self.refused += 1
            self._unlogged += 1
            now = time.monotonic() if now is None else now
            if self._logged_at is not None and now - self._logged_at < LOG_EVERY:
                return False
            n, since = self._unlogged, self._logged_at
            self._unlogged, self._logged_at = 0, now
        why = "not the peer's address" if stranger else f"{self.max_connections} connections already forwarded"
        if n == 1:
            log.warning("%s: closed a connection from %s at accept (%s)", self.name, host, why)
        else:
            log.warning("%s: closed %d connections at accept in the last %.0f s (the last from %s: %s)",
                        self.name, n, now - (since or now), host, why)
        return False

    def release(self) -> None:
        """A forwarded connection is over."""
        with self._lock:
            self.live -= 1


class Countdown:
    """Calls ``then`` once ``tick`` has been called ``n`` times, from any threads: a forwarded
    connection's slot is free once both of its directions are done."""

    def __init__(self, n: int, then: Callable[[], None]):
        self._n = n
        self._then = then
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._then()

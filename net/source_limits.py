"""Per-source bookkeeping of a port's handshake pool (issue 25, finding 7: connection churn).

Before TLS finishes, the only thing known about a connection is the address it came from. The
pool of ``net.admission`` used to drop its oldest pending handshake whenever it was full, so
one address churning connections pushed real clients' handshakes out (the issue measured 4 of
30 real connects failing at 1,000 connections a second). These tables let the pool treat addresses, not
sockets, as the parties that compete:

* ``PendingBySource``: the pending handshakes grouped by source, and who loses when the pool
  is full: the oldest handshake of the source that holds the most (so a flooding address
  pushes out only its own), taken from sources that never authenticated before any other.
* ``KnownSources``: addresses an authenticated connection came from recently; their pending
  handshakes are the last to be dropped and they are exempt from the rate below.
* ``SourceRates``: a token bucket per unknown address; a socket over it gets no thread until a
  token comes (``Admission`` parks it): the flood's threads were what slowed everyone's
  handshakes (server 0 spent 1.1-2.5 s of CPU in a 3 s flood of 2,000 a second before,
  0.7-1.1 s with the rate).

Every table is bounded (least recently used entries go first), so an attacker with many
addresses cannot grow memory; with more addresses than a table holds it only gets fresh
buckets, never more than the pool's fixed number of pending handshakes.

Where the address is not the client (NAT, a proxy): every client behind one address shares
that address's part. A returning client makes the address known, which exempts it from the
rate; a stranger behind the same address shares that exemption. ``[limits]
handshake_rate_per_source`` raises (or, at 0, turns off) the rate.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections import OrderedDict

__all__ = ["KnownSources", "PendingBySource", "SourceRates", "source_key"]


def source_key(sock: socket.socket) -> str:
    """The address ``sock`` came from, as the unit of fairness: an IPv4 address, or an IPv6
    address's /64 (one host is usually handed a whole /64, so counting single IPv6 addresses
    would let it be 2^64 sources). A socket with no IP peer (a socketpair) is ``""``."""
    try:
        peer = sock.getpeername()
    except OSError:
        return ""      # reset before we looked: it fails its handshake at once anyway
    if not isinstance(peer, tuple):
        return ""
    try:
        addr = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except ValueError:
        return str(peer[0])
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class KnownSources:
    """Addresses that completed an authenticated connection, most recent last; at most
    ``capacity`` (only certificate holders add entries, so it fills slowly if ever)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def __contains__(self, key: str) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)


class SourceRates:
    """A token bucket per source: ``rate`` sockets a second, ``burst`` at once. ``rate`` 0:
    no limit. Holds at most ``capacity`` buckets; a source evicted from the table starts again
    with a full bucket, which costs at most one burst per eviction."""

    def __init__(self, rate: float, burst: int, capacity: int) -> None:
        self.rate = rate
        self.burst = burst
        self.capacity = capacity
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def allow(self, key: str, now: float | None = None) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.capacity:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


class _Tier:
    """Pending handshakes per source of one tier, and the source holding the most, in O(1).

    Counts move by one at a time, so the largest count drops by at most one per removal;
    ``_with[c]`` keeps the sources holding ``c`` in the order they reached ``c``, so a tie
    goes to the source that has held that many longest."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._with: dict[int, dict[str, None]] = {}
        self.top = 0

    def _move(self, key: str, old: int, new: int) -> None:
        if old:
            bucket = self._with[old]
            del bucket[key]
            if not bucket:
                del self._with[old]
        if new:
            self._count[key] = new
            self._with.setdefault(new, {})[key] = None
        else:
            del self._count[key]
        if new > self.top:
            self.top = new
        elif self.top not in self._with:
            self.top -= 1     # the old top emptied: ``key`` just moved to top - 1 (or none is left)

    def add(self, key: str, n: int = 1) -> None:
        for _ in range(n):
            c = self._count.get(key, 0)
            self._move(key, c, c + 1)

    def remove(self, key: str, n: int = 1) -> None:
        for _ in range(n):
            c = self._count[key]
            self._move(key, c, c - 1)

    def count(self, key: str) -> int:
        return self._count.get(key, 0)

    def fattest(self) -> str | None:
        return next(iter(self._with[self.top])) if self.top else None


class PendingBySource:
    """The pending handshakes: each socket's deadline and source, grouped per source, oldest
    first. Not thread-safe: ``Admission`` holds its lock around every call."""

    def __init__(self) -> None:
        self.deadlines: dict[socket.socket, float] = {}
        self._key: dict[socket.socket, str] = {}
        self._by_source: dict[str, OrderedDict[socket.socket, None]] = {}
        self._unknown = _Tier()
        self._known = _Tier()
        self._known_keys: set[str] = set()   # sources of the known tier that have pending sockets

    def __len__(self) -> int:
        return len(self.deadlines)

    def __contains__(self, sock: object) -> bool:
        return sock in self.deadlines

    def source(self, sock: socket.socket) -> str | None:
        return self._key.get(sock)

    def add(self, sock: socket.socket, key: str, deadline: float, known: bool) -> None:
        self.deadlines[sock] = deadline
        self._key[sock] = key
        self._by_source.setdefault(key, OrderedDict())[sock] = None
        if key in self._known_keys or (known and self._unknown.count(key) == 0):
            self._known_keys.add(key)
            self._known.add(key)
        else:
            self._unknown.add(key)

    def remove(self, sock: socket.socket) -> bool:
        if sock not in self.deadlines:
            return False
        del self.deadlines[sock]
        key = self._key.pop(sock)
        mine = self._by_source[key]
        del mine[sock]
        if not mine:
            del self._by_source[key]
        if key in self._known_keys:
            self._known.remove(key)
            if not mine:
                self._known_keys.discard(key)
        else:
            self._unknown.remove(key)
        return True

    def promote(self, key: str) -> None:
        """``key`` has just become known: its pending handshakes move to the known tier."""
        n = self._unknown.count(key)
        if n:
            self._unknown.remove(key, n)
            self._known.add(key, n)
            self._known_keys.add(key)

    def victim(self) -> socket.socket | None:
        """Whom to drop for a newcomer: the oldest pending handshake of the source holding the
        most, from unknown sources while any is pending. Why the most, not the oldest overall: a
        flooding address then competes only with itself, and the oldest overall was usually a
        real client's handshake, slowed by the flood's CPU."""
        key = self._unknown.fattest()
        if key is None:             # ("" is a key: a socket without an IP peer)
            key = self._known.fattest()
        if key is None:
            return None
        return next(iter(self._by_source[key]))

    def per_source(self) -> dict[str, int]:
        return {k: len(v) for k, v in self._by_source.items()}

    def clear(self) -> list[socket.socket]:
        socks = list(self.deadlines)
        self.__init__()
        return socks

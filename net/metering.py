"""Exact per-step metering of communication: bytes, rounds and time.

Why our own: CrypTen's communicator estimates bytes from element counts and
``sys.getsizeof`` and counts every call as a round. We count the framed bytes our
transport actually hands to TLS (payload plus the 9-byte frame header) and the TLS
bytes on the socket, per named step and separately for the two kinds of traffic the
paper reports: ``online`` (server<->server) and ``offline`` (dealer<->server).

A round is counted each time a party sends after having received (or sends first):
in an exchange both parties send, then both receive, which is one round of latency.
Steps nest; a byte counts for every step open when it moved (``UE`` includes ``UE/inv``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Iterator

KINDS = ("online", "offline")
_FIELDS = ("bytes_sent", "bytes_received", "rounds")


def _empty() -> dict:
    row = {f"{k}_{f}": 0 for k in KINDS for f in _FIELDS}
    row["seconds"] = 0.0
    row["calls"] = 0
    return row


class Meter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = _empty()
        self._steps: dict[str, dict] = defaultdict(_empty)
        self._stack: list[str] = []
        self._wire = {k: {"sent": 0, "received": 0} for k in KINDS}
        self._started = time.perf_counter()
        # bumped whenever a step opens or closes, so the first send inside a step is
        # counted as a new round even if the previous send had no reply in between
        self.epoch = 0

    # -- recording (called by the transport) ---------------------------------------
    def _add(self, field: str, amount: int) -> None:
        with self._lock:
            self._total[field] += amount
            for name in self._stack:
                self._steps[name][field] += amount

    def sent(self, kind: str, nbytes: int) -> None:
        self._add(f"{kind}_bytes_sent", nbytes)

    def received(self, kind: str, nbytes: int) -> None:
        self._add(f"{kind}_bytes_received", nbytes)

    def round(self, kind: str) -> None:
        self._add(f"{kind}_rounds", 1)

    def wire(self, kind: str, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._wire[kind]["sent"] += sent
            self._wire[kind]["received"] += received

    # -- steps ----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Attribute everything inside the block to ``name`` (nested as ``outer/name``)."""
        full = f"{self._stack[-1]}/{name}" if self._stack else name
        with self._lock:
            self._stack.append(full)
            self._steps[full]["calls"] += 1
            self.epoch += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._stack.remove(full)
                self._steps[full]["seconds"] += dt
                self.epoch += 1

    def open_steps(self) -> tuple[str, ...]:
        """The steps open now, outermost first (``("UE", "UE/inv")``)."""
        with self._lock:
            return tuple(self._stack)

    def as_dict(self) -> dict:
        """Totals, per-step rows and TLS wire bytes; plain ints/floats (JSON-ready)."""
        with self._lock:
            total = dict(self._total)
            total["seconds"] = time.perf_counter() - self._started
            return {
                "total": total,
                "steps": {k: dict(v) for k, v in self._steps.items()},
                "wire": {k: dict(v) for k, v in self._wire.items()},
            }


_current: Meter | None = None


def set_current(m: Meter | None) -> None:
    global _current
    _current = m


def current() -> Meter:
    if _current is None:
        raise RuntimeError("no two-party session is active in this process")
    return _current


def meter(name: str):
    """``with meter("round_selection"): ...`` on the active session's meter."""
    return current().step(name)

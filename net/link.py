"""Link emulation: latency and bandwidth applied by the receiver (no ``tc netem`` here).

The receiver delivers frames as a FIFO link would, so the real transfer overlaps the emulated
one: a frame whose first bytes arrived at ``t`` is handed over at
``max(t, link free) + bytes * 8 / bandwidth + latency``, and never before it really arrived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["LinkProfile", "NO_LINK", "LinkClock"]


@dataclass(frozen=True)
class LinkProfile:
    """Emulated link: one-way latency in seconds, bandwidth in bits per second (0 = unlimited)."""

    latency: float = 0.0
    bandwidth_bps: float = 0.0

    def transfer_time(self, nbytes: int) -> float:
        return nbytes * 8.0 / self.bandwidth_bps if self.bandwidth_bps > 0 else 0.0

    @property
    def emulated(self) -> bool:
        return self.latency > 0 or self.bandwidth_bps > 0


NO_LINK = LinkProfile()


class LinkClock:
    """One receiving direction of an emulated link: when is the link free again."""

    def __init__(self) -> None:
        self._free = 0.0

    def deliver(self, link: LinkProfile, nbytes: int, first_byte_at: float, arrived: float) -> None:
        """Sleep until a frame of ``nbytes`` (header included) would have been delivered."""
        if not link.emulated:
            return
        done = max(first_byte_at, self._free) + link.transfer_time(nbytes)
        self._free = done
        wait = max(done, arrived) + link.latency - time.monotonic()
        if wait > 0:
            time.sleep(wait)

"""Per-identity request rate limit of the client API: a token bucket.

Why: one authenticated client could otherwise keep a server busy for everyone (issue 14: 50
unlearning requests in 0.3 s). Each identity gets ``burst`` requests at once and
``rate`` per second sustained; a request beyond that is refused with ``rate_limited`` and
costs the server one dictionary lookup.
"""

from __future__ import annotations

import threading
import time

__all__ = ["TokenBucket"]


class TokenBucket:
    """``take()`` is True while the identity is within ``rate`` per second and ``burst``."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

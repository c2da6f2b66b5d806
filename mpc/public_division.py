"""Division of a shared ring element by a public integer that is not a power of two, wrap-free.

Why: CrypTen divides each party's share locally (``share // N``), which is off by about
2**64 / N whenever the two shares wrap around the ring (probability about |x| / 2**64 per
element). Powers of two have a wrap-free truncation (``mpc.truncation``, in both modes; in two-party
mode the servers make its pairs with the engine); CrypTen also divides by other integers (``mean``, ``var``, ``avg_pool2d`` by 9,
``log`` by 120), so this builds x / N out of three such truncations ``T(v, d)`` (floor(v / 2**d)
or one more, for |v| < 2**62) and local ring arithmetic only:

1. split: h = T(x, s), l = x - h 2**s, so x = h 2**s + l exactly with |l| <= 2**s. With the
   public 2**s = a N + b (0 <= b < N): x = N (h a) + y, y = h b + l, and y is small
   (|y| <= 2**(62 - s) b + 2**s; s about (62 + log2 N) / 2 makes it about 2**(32 + log2(N) / 2)).
2. reciprocal: q1 = T(y m1, k1) with m1 = round(2**k1 / N), the largest k1 keeping |y m1| < 2**62;
   q1 is y / N to within a few units.
3. remainder: r = y - N q1 (exact, |r| a few N), q2 = T(r m2, k2) likewise.

x / N = h a + q1 + r / N, and q2 is r / N to within one unit plus the reciprocal's rounding
(``error_bound``: below 1 + 2**-20 units for every divisor up to 2**32 and every |x| < 2**62).
Cost: three truncations one after the other (dealer mode: 3 rounds, 3 x 8 bytes each way per
element online, 3 truncation pairs offline, made by the engine in two-party mode). What is opened is
what the truncation opens (uniformly masked values): nothing.

Every step is linear in the shares or a truncation, so :func:`divide_share` runs unchanged on
a plaintext "share" with a plaintext ``T`` (the tests' exact oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["DivisionPlan", "plan", "divide_share", "error_bound", "RANGE_BITS", "MAX_DIVISOR"]

#: |x| < 2**RANGE_BITS is required (the truncations' own domain)
RANGE_BITS = 62
#: divisors up to this keep the error bound below 1 + 2**-20 units (checked in ``plan``)
MAX_DIVISOR = 1 << 32

Truncate = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class DivisionPlan:
    """The public constants of x / n (n > 1): every figure depends on n only."""

    n: int
    s: int        # split exponent
    a: int        # floor(2**s / n)
    b: int        # 2**s mod n
    k1: int
    m1: int       # round(2**k1 / n)
    k2: int
    m2: int       # round(2**k2 / n)
    bound: float  # |q - x / n| < bound units, for every |x| < 2**62


def _reciprocal(n: int, magnitude: int) -> tuple[int, int]:
    """(k, round(2**k / n)) with the largest k <= 62 such that magnitude * m < 2**62."""
    for k in range(RANGE_BITS, 0, -1):
        m = ((1 << k) + n // 2) // n
        if m >= 1 and magnitude * m < 1 << RANGE_BITS:
            return k, m
    raise ValueError(f"division by {n}: no reciprocal fits the ring for values up to {magnitude}")


def plan(n: int) -> DivisionPlan:
    """The constants for dividing by the public integer ``n`` (2 <= n <= MAX_DIVISOR)."""
    n = int(n)
    if not 2 <= n <= MAX_DIVISOR:
        raise ValueError(f"division by a public integer needs 2 <= n <= 2**32, got {n}")
    # split where the two halves of y's bound balance: 2**(62 - s) n ~ 2**s
    s = max(1, min(RANGE_BITS - 1, (RANGE_BITS + (n - 1).bit_length() + 1) // 2))
    a, b = divmod(1 << s, n)
    y_max = (1 << (RANGE_BITS - s)) * b + (1 << s)
    k1, m1 = _reciprocal(n, y_max)
    # |q1 - y/n| <= 1 + y_max |m1 n - 2**k1| / (n 2**k1), so |r| <= n + that excess times n
    excess1 = -(-(y_max * abs(m1 * n - (1 << k1))) // (1 << k1))
    r_max = n + excess1
    k2, m2 = _reciprocal(n, r_max)
    bound = 1.0 + r_max * abs(m2 * n - (1 << k2)) / (n * float(1 << k2))
    return DivisionPlan(n, s, a, b, k1, m1, k2, m2, bound)


def error_bound(n: int) -> float:
    """|x / n - result| <= this many units of the ring (2**-16 at CrypTen's precision)."""
    n = abs(int(n))
    return 0.0 if n == 1 else plan(n).bound


def divide_share(share: torch.Tensor, n: int, truncate: Truncate) -> torch.Tensor:
    """This party's share of x / n (within ``error_bound(n)`` units) from its share of x.

    ``truncate(share, d)`` must be a two-party truncation by 2**d (floor or one more, for
    |value| < 2**62), run by both parties at the same point; ``n`` a public int, |n| >= 1.
    Ring arithmetic is int64 with wraparound (torch's), as the shares need.
    """
    n = int(n)
    if n == 0:
        raise ZeroDivisionError("division of a shared value by zero")
    if n < 0:
        return -divide_share(share, -n, truncate)
    if n == 1 or share.numel() == 0:
        return share.clone()
    p = plan(n)
    x = share.reshape(-1)   # flat: a truncation may hand a 0-d share back with shape (1,)
    h = truncate(x, p.s)
    y = h * p.b + (x - h * (1 << p.s))
    q1 = truncate(y * p.m1, p.k1)
    r = y - q1 * n
    q2 = truncate(r * p.m2, p.k2)
    return (h * p.a + q1 + q2).reshape(share.shape)

"""Shared pieces of the cost benchmarks: the paper's numbers, FedRecover's threshold in 2PC,
sort-size formulas, extrapolation, formatting.

FedRecover's threshold determination (the paper's TD^1). FedRecover fixes one global
threshold tau: the value that a fraction alpha of *all* coordinates of all remaining clients'
stored updates exceed (m (n-1) T values). The paper (Sec. IV-C2, V "Alternative thresholds")
describes its straightforward 2PC conversion as a secure sort (SecSrt) over all m n T entries.
Our closest faithful version with ``protocols/`` primitives:

1. ``|g| = select(g >= 0, g, -g)``: one SecGE and one multiplication per entry;
2. ``bitonic_sort(|g|, descending=True, stable=False)``: L(N) layers of N/2-ish comparators
   (SecGE + one multiplication each), padding sentinels omitted;
3. tau = the entry at the public position floor(alpha N) (the (k+1)-th largest, the convention
   of ``clients.training.tolerance_threshold``): picking a public position of a shared
   array is local, tau stays shared and nothing is opened.

At the MNIST shapes N = 19 x 40 x 582,026 = 442,339,760 entries, a sort that cannot run on this
machine (about 1e11 secure comparisons). ``starfish bench steps`` therefore runs the very same
protocol on samples of the history (the first ``c`` coordinates of every stored update, so
N = c (n-1) T) at two sample sizes, fits ``q = a (N + C(N)) + b (L(N) + 1)`` for every byte
and time quantity (``C(N)`` comparators, ``L(N)`` layers: exact counts of our network,
:func:`sort_comparators`), rounds as ``r0 + r1 L(N)``, and extrapolates to the full N. The row
is marked *extrapolated*. (A cheaper exact alternative would be an oblivious bitwise search for
tau: one batched comparison of all N entries against a shared candidate per bit, about 32 x N
comparisons instead of N log2(N)^2 / 4; still ~6 TB online here.)
"""

from __future__ import annotations

import math
from typing import Any, Callable

from protocols.compare import ge, select
from protocols.sort import bitonic_sort

__all__ = ["PAPER_TABLE1", "PAPER_TABLE2", "sort_layers", "sort_comparators", "fedrecover_threshold",
           "extrapolate", "gb", "fmt", "ratio"]

#: Table I (MNIST, one unlearning round): offline s, online s, offline GB, online GB.
PAPER_TABLE1: dict[str, tuple[float, float, float, float]] = {
    "TD1": (0.04, 0.04, 4.20, 0.12),
    "TD2": (0.01, 0.02, 0.11, 0.01),
    "RS1": (145.1, 21.80, 29.80, 0.56),
    "RS2": (87.15, 13.14, 17.88, 0.34),
    "UE": (3.59, 1.68, 2.14, 0.04),
    "TC": (689.44, 103.76, 141.55, 2.66),
}
#: Table II (MNIST, whole Stage II): offline s, online s, offline GB, online GB.
PAPER_TABLE2: dict[str, tuple[float, float, float, float]] = {
    "lan": (18826.21, 3623.81, 3530.85, 66.27),
    "wan": (25801.17, 3735.61, 3562.54, 66.93),
}


def sort_layers(n: int) -> int:
    """Layers of the bitonic network on n entries: log2(N)(log2(N)+1)/2, N = 2^ceil(log2 n)."""
    if n <= 1:
        return 0
    k = math.ceil(math.log2(n))
    return k * (k + 1) // 2


def _count_even_blocks(x: int, d: int) -> int:
    """#{i in [0, x): (i // d) is even}."""
    if x <= 0:
        return 0
    full, rem = divmod(x, 2 * d)
    return full * d + min(rem, d)


def sort_comparators(n: int) -> int:
    """Comparators of ``protocols.sort.network(n)`` (sentinel pairs omitted), in O(log^2 n)."""
    if n <= 1:
        return 0
    size_n = 1 << math.ceil(math.log2(n))
    total = 0
    size = 2
    while size <= size_n:
        h = size // 2
        # flip stage: pairs (s + off, s + size - 1 - off), kept when the upper index < n
        full_blocks = n // size
        total += full_blocks * h
        s = full_blocks * size
        if s < n:
            total += max(0, h - (s + size - n))
        stride = size // 4
        while stride >= 1:
            # half-cleaner: pairs (i, i + stride) with (i // stride) even and i + stride < n
            total += _count_even_blocks(n - stride, stride)
            stride //= 2
        size *= 2
    return total


def fedrecover_threshold(values: Any, alpha: float, meter: Callable[[str], Any]) -> Any:
    """tau = the (floor(alpha N)+1)-th largest |value| of a flat shared (or plain) vector."""
    n = int(values.shape[-1])
    k = min(n - 1, math.floor(alpha * n))
    with meter("abs"):
        absval = select(ge(values, 0.0), values, -values)
    with meter("sort"):
        ordered, _ = bitonic_sort(absval, None, descending=True, stable=False)
    return ordered[..., k]


def _solve2(x1: tuple[float, float], y1: float, x2: tuple[float, float], y2: float) -> tuple[float, float] | None:
    det = x1[0] * x2[1] - x1[1] * x2[0]
    if det == 0:
        return None
    a = (y1 * x2[1] - y2 * x1[1]) / det
    b = (x1[0] * y2 - x2[0] * y1) / det
    return a, b


def extrapolate(points: list[tuple[int, float]], target: int, kind: str = "work") -> float:
    """Value at ``target`` entries from measurements at (N, value) points.

    kind "work": q = a (N + C(N)) + b (L(N) + 1) (bytes, seconds); "rounds": q = r0 + r1 L(N).
    Fitted on the two largest points; when the exact fit has a negative coefficient (timing
    noise), that coefficient is set to 0 and the other one fitted to the largest point
    (the closest non-negative model). One point: the largest term alone.
    """
    pts = sorted(points)

    def basis(n: int) -> tuple[float, float]:
        if kind == "rounds":
            return 1.0, float(sort_layers(n))
        return float(n + sort_comparators(n)), float(sort_layers(n) + 1)

    bt = basis(target)
    n2, y2 = pts[-1]
    b2 = basis(n2)
    if len(pts) >= 2:
        n1, y1 = pts[-2]
        coef = _solve2(basis(n1), y1, b2, y2)
        if coef is not None:
            a, b = coef
            if a >= 0 and b >= 0:
                return a * bt[0] + b * bt[1]
            if a < 0 <= y2:
                return y2 / b2[1] * bt[1] if b2[1] else y2
            if b < 0 <= y2:
                return y2 / b2[0] * bt[0] if b2[0] else y2
    idx = 1 if kind == "rounds" else 0
    return y2 * bt[idx] / b2[idx] if b2[idx] else y2


def gb(nbytes: float) -> float:
    return nbytes / 1e9


def fmt(x: Any, digits: int = 4) -> str:
    """Compact numbers for tables: 4 significant digits, thousands separators for big ones."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e5:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def ratio(ours: float | None, paper: float | None) -> float | None:
    if ours is None or not paper:
        return None
    return ours / paper

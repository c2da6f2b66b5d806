"""Coordinate shards: which worker pair owns which model coordinates.

Why contiguous and balanced: worker k of server 0 and worker k of server 1 hold the same
coordinates of every share, so the plan must be a pure function of (D, K) that both servers
compute alike; contiguous ranges keep a shard of a flat update one slice (no gather), and
balanced sizes (they differ by at most one) make the slowest pair set the pace as little as
possible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["shard_bounds", "split", "join"]


def shard_bounds(d: int, k: int) -> list[tuple[int, int]]:
    """[start, stop) of each of ``k`` shards of ``d`` coordinates: contiguous, in order, sizes
    ceil(d / k) for the first d mod k shards and floor(d / k) for the rest."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"a model has at least one coordinate, not {d!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise ValueError(f"the number of shards is 1..{d} (one coordinate each at most), not {k!r}")
    base, extra = divmod(d, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split(values: np.ndarray, bounds: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """The shards of ``values`` along its last axis (copies: each goes to its own worker)."""
    arr = np.asarray(values)
    if not bounds or bounds[-1][1] != arr.shape[-1] or bounds[0][0] != 0:
        raise ValueError(f"the shards {list(bounds)} do not cover the last axis of length {arr.shape[-1]}")
    return [np.ascontiguousarray(arr[..., a:b]) for a, b in bounds]


def join(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The inverse of ``split``: the shards side by side along the last axis."""
    return np.concatenate([np.asarray(p) for p in parts], axis=-1)

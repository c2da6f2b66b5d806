"""FedAvg's weights, defined once: the daemon's exact aggregation, the lab and Stage II's twin
all weigh a round's clients by this rule."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["fedavg_weights"]


def fedavg_weights(sizes: Mapping[int, int]) -> dict[int, float]:
    """w_j = |D_j| / N, computed identically on both servers (sorted client order)."""
    total = sum(int(sizes[j]) for j in sorted(sizes))
    if total <= 0:
        raise ValueError("participants hold no data")
    return {j: int(sizes[j]) / total for j in sorted(sizes)}

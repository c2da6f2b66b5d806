"""FedAvg's weights, defined once: the daemon's exact aggregation, the lab and Stage II's twin
all weigh a round's clients by this rule. The counts are checked here (``common.sample_count``):
this is where the lab's clients' counts enter, and the last stop before any weight exists."""

from __future__ import annotations

from collections.abc import Mapping

from common.sample_count import SampleCount, check_sample_count

__all__ = ["fedavg_weights"]


def fedavg_weights(sizes: Mapping[int, SampleCount]) -> dict[int, float]:
    """w_j = |D_j| / N, computed identically on both servers (sorted client order)."""
    n = {j: check_sample_count(sizes[j], f"|D_{j}|") for j in sorted(sizes)}
    total = sum(n.values())
    if total <= 0:
        raise ValueError("participants hold no data")
    return {j: n[j] / total for j in n}

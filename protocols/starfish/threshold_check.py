"""Threshold checking (SecTC, Starfish Alg. 3): which clients must send exact updates.

Client j is flagged when some coordinate k of its estimated update satisfies
g_hat^j(k)^2 >= (delta^j)^2. Comparing squares avoids a secure absolute value or square
root; both sides are non-negative, so the test equals |g_hat^j(k)| >= delta^j. Only the
one flag bit per client is revealed (the paper reveals f_{t_i}), never which coordinate.
"""

from __future__ import annotations

from typing import Any

import torch

from protocols import backend as B
from protocols.threshold import any_exceeds

__all__ = ["check_thresholds"]


def check_thresholds(estimates: Any, thresholds: Any) -> torch.Tensor:
    """Public 0/1 flags, one per row of ``estimates`` (clients x m); ``thresholds`` is (clients,).

    Delegates to ``protocols.threshold.any_exceeds``, which compares x^2 with d^2
    coordinate-wise and reveals only the per-row OR.
    """
    if len(estimates.shape) != 2 or len(thresholds.shape) != 1:
        raise ValueError("estimates must be (clients, m) and thresholds (clients,)")
    flags = any_exceeds(B.rescale(estimates), thresholds)  # estimates may carry raw bits (SecUE)
    return torch.as_tensor(flags).reshape(-1).to(torch.int64)

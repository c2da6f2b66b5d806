"""FedSECA's lambda_k as a client computes it for its upload (numpy only).

Why on the client: a quantile of D shared values would cost the servers an oblivious sort
of every update per round, so under ``[fl] aggregator = "fedseca"`` each client uploads a
share of its own sparsification threshold beside its update, norm and delta, and the servers
check it on shares (``protocols.robust_aggregation.check_thresholds``: one bit per client;
a wrong one leaves the client out of the round).

The rule is ``common.robust_rules.fedseca_threshold`` (the lower order statistic v_(f),
f = floor(gamma (D - 1)), of |g|), taken here on the *encoded* update: the servers compare
ring values, so lambda_k must be exactly one of the client's encoded |g^j| (then it lies on
the fixed-point grid and encodes without error).
"""

from __future__ import annotations

import numpy as np

from common.encoding import decode, encode
from common.robust_rules import fedseca_threshold

__all__ = ["upload_threshold"]


def upload_threshold(update: np.ndarray, gamma: float, precision: int) -> np.ndarray:
    """lambda_k of ``update`` as the client uploads it: a float64 scalar on the 2**-precision grid."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    ring = encode(np.asarray(update, dtype=np.float64).reshape(-1), precision)
    if ring.size == 0:
        return np.array(0.0)
    return decode(fedseca_threshold(ring, gamma), precision)

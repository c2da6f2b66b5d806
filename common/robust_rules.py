"""The robust aggregation rules' constants, step formulas and FedSECA's quantile rule: defined
once, used by the daemon, the 2PC rules (``protocols.robust_aggregation``), the clients (the
lambda_k they upload, ``clients.fedseca_threshold``) and the plaintext lab.

FedSECA Sec. 5: sparsification factor gamma and server momentum beta_ra, the same on all its
datasets. BRACE Sec. 5.1: lambda = 5 with n = 100 clients; K clients keep that share,
lambda = 5 K / 100 (K = 20: 1, so with no zero updates "+1 iff at least 11 of 20 clients
vote +1").

BRACE's step is eta * sign-vote, magnitude eta in every coordinate. In the step
M_i = M_{i-1} - server_lr * direction the direction is scale_t * vote, so every coordinate
moves server_lr * scale_t in round t. The paper's fixed eta belongs to its CNNs and 300-500
rounds. On the digits (logreg, server_lr 0.3, 40 rounds, no attack) a fixed scale cannot match
FedAvg's 5.8% test error: 0.01 has not converged (20%), 0.03 gives 11%, 0.07-0.15 plateau at
7.3-8.2% (the sign step keeps jumping around the optimum by server_lr * scale), 0.3 gives 14%.
The usual remedy for sign descent is a step that shrinks like 1/sqrt(t) (the O(1/sqrt T) rates
of signSGD and BRACE's bound (10), which trades 1/(eta T) against L eta / 2):
scale_t = 0.5 / sqrt(t) reaches 5.8% (0.3 / sqrt(t): 6.9%, 1 / sqrt(t): 8.7%). ``decay = 0``
is the paper's fixed step.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["AGGREGATORS", "FEDSECA_GAMMA", "FEDSECA_BETA", "BRACE_LAMBDA", "BRACE_CLIENTS",
           "BRACE_SCALE", "BRACE_DECAY", "brace_lambda", "brace_step_scale", "quantile_rank",
           "fedseca_threshold"]

#: the aggregation rules a deployment or the lab may choose (``[fl] aggregator``, ``--aggregator``)
AGGREGATORS = ("fedavg", "fedseca", "brace-sign")

FEDSECA_GAMMA = 0.9
FEDSECA_BETA = 0.5
BRACE_LAMBDA = 5.0
#: BRACE's lambda is given for this many clients (its Sec. 5.1 runs n = 100)
BRACE_CLIENTS = 100
BRACE_SCALE = 0.5
BRACE_DECAY = 0.5


def brace_lambda(lam_per_100: float, voters: int) -> float:
    """BRACE's vote threshold for ``voters`` clients: lambda for 100 clients, scaled to K."""
    return lam_per_100 * voters / BRACE_CLIENTS


def brace_step_scale(t: int, scale: float = BRACE_SCALE, decay: float = BRACE_DECAY) -> float:
    """The factor of the sign vote in FL round ``t`` (1-based): scale / t**decay."""
    return scale / t ** decay


def quantile_rank(D: int, gamma: float) -> int:
    """f = floor(gamma (D - 1)): FedSECA's lambda_k is the f-th smallest |g_k^j| (0-based)."""
    return int(math.floor(gamma * (D - 1)))


def fedseca_threshold(values: np.ndarray, gamma: float) -> np.generic:
    """FedSECA's lambda_k of one non-empty update: v_(f) of |values|, the lower order statistic
    (f = :func:`quantile_rank`), in the values' own dtype (a client takes it on ring integers,
    so that it is exactly one of them). The 2PC rules compute the same order statistic on
    shares (``protocols.robust_aggregation.quantile_thresholds`` is its plaintext twin)."""
    if not (isinstance(gamma, (int, float)) and 0.0 <= float(gamma) <= 1.0):
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
    flat = np.abs(np.asarray(values).reshape(-1))
    if flat.size == 0:
        raise ValueError("FedSECA's threshold of an empty update is undefined")
    f = quantile_rank(flat.size, gamma)
    return np.partition(flat, f)[f]

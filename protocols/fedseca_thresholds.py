"""FedSECA's lambda_k, the clients' sparsification thresholds: computed (plaintext) and verified
on shares.

Why a module of its own: a threshold is a client's claim about its own update, and verifying
claims is a job apart from aggregating (``protocols.robust_aggregation`` runs the rule; it
shares this module's sign tests in :func:`protocols.robust_aggregation.fedseca_checked`, so a
round pays for the check's two extra tests per entry only).

Where lambda_k comes from
-------------------------
A gamma-quantile of D = 582,026 shared values would need an oblivious sort (or selection) of
every row, far beyond a round's budget, so on shares the rule needs ``thresholds``. In a
deployment each client computes lambda_k on its own *encoded* update (an order statistic of
the fixed-point values, so it lies on the grid and is exact) and uploads it as a share with
the update, as Starfish's clients already upload their delta (DESIGN.md 3.2). A Byzantine
client could lie (lambda = 0 keeps everything, a huge one drops everything), so the servers
check it with :func:`check_thresholds`, which opens one bit per client and nothing else; a
client that fails is left out of the round. The check also pins lambda_k to [0, 2**14) (the
bounded sign tests' range). (A Stage II estimate has no client to claim its threshold:
``protocols.secure_quantile`` finds it on shares.)

We use the *lower* order statistic lambda_k = v_(f), f = floor(gamma (D - 1)), of the sorted
|g_k| (torch.quantile(..., interpolation="lower")). The sparsification set {|g| > lambda} is
then exactly the one of the linearly interpolated quantile of the authors' code
(torch.quantile's default): that lambda lies in [v_(f), v_(f+1)] and no value lies strictly
between the two order statistics. The check pins lambda_k = v_(f) exactly (also with ties):
n_gt = #{|g| > lambda} <= D - 1 - f and n_ge = #{|g| >= lambda} >= D - f hold together iff
lambda = v_(f). They are counted from the bounded tests [g > lambda], [g < -lambda] (n_gt, the
two are disjoint for lambda >= 0) and [g < lambda], [g > -lambda] (n_ge = 2D - their sum, exact
for lambda > 0; for lambda = 0 it reads D + #{g = 0} >= D - f, which passes as the true n_ge = D
does), and 0 <= lambda < 2**14 is tested in the 64-bit ring on the K values (outside, the
32-bit counts may be wrong; the range bit fails the client whatever they say). The first two
tests are also FedSECA's kept-positive and kept-negative bits.

Cost (2PC, dealer mode): 4 K D bounded sign tests, 4 K 64-bit tests, three product rounds on K
values, one opening of K bits; inside ``fedseca_checked`` 2 K D bounded tests beyond the rule's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch

from common.robust_rules import FEDSECA_GAMMA, quantile_rank

from . import backend as B
from .backend import Tensor
from .comparator_networks import ge as _ge, negative as _neg

__all__ = ["quantile_thresholds", "check_thresholds", "claim_operands", "claim_verdict", "claim_counts", "verdict_from_counts",
           "LAMBDA_LIMIT", "Meter"]

Meter = Callable[[str], ContextManager[Any]]

#: thresholds must lie in [0, 2**14), i.e. ring integers below 2**30, for the bounded sign tests
LAMBDA_LIMIT = 1 << 30


def no_meter(_name: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


def as_float64(x: Any) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.float64)


def check_matrix(G: Any) -> None:
    if len(tuple(G.shape)) != 2:
        raise ValueError(f"G must be a K x D matrix (one row per client), got shape {tuple(G.shape)}")
    if int(G.shape[0]) < 1:
        raise ValueError("G needs at least one client (row)")


def check_gamma(gamma: float) -> None:
    if not (isinstance(gamma, (int, float)) and 0.0 <= float(gamma) <= 1.0):
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")


def prepare(G: Tensor) -> Tensor:
    check_matrix(G)
    return G if B.is_shared(G) else as_float64(G)


def quantile_thresholds(G: torch.Tensor, gamma: float = FEDSECA_GAMMA) -> torch.Tensor:
    """Plaintext lambda_k = v_(f) of the sorted |g_k| (torch.quantile, interpolation "lower").

    What an honest client computes on its own encoded update before uploading it.
    """
    G = as_float64(G)
    check_matrix(G)
    check_gamma(gamma)
    K, D = G.shape
    if D == 0:
        return torch.zeros(K, dtype=torch.float64)
    f = quantile_rank(D, gamma)
    return torch.kthvalue(G.abs(), f + 1, dim=1).values


def claim_operands(G: Tensor, col: Tensor) -> list:
    """What the check sign-tests, as four K x D blocks: [v < 0] of each is [g > lambda],
    [g < -lambda], [g < lambda], [g > -lambda] (``col``: lambda as a K x 1 column)."""
    return [(-G) + col, G + col, G - col, (-G) - col]


def claim_verdict(bits: Tensor, lam: Tensor, D: int, gamma: float) -> torch.Tensor:
    """Public bool per client from the four blocks of :func:`claim_operands`' sign bits (4K x D,
    shared) and the shared lambda (K,): the counts, the range, one opening of K bits."""
    return verdict_from_counts(*claim_counts(bits), lam, D, gamma)


def claim_counts(bits: Tensor) -> tuple[Tensor, Tensor]:
    """(n_gt, n_ge) per client from :func:`claim_operands`' four blocks of sign bits (4K x m): sums
    over the m coordinates, so a coordinate shard's counts add to the whole's."""
    K, m = int(bits.shape[0]) // 4, int(bits.shape[1])
    n_gt = (bits[:K] + bits[K:2 * K]).sum(1)            # the two events are disjoint for lam >= 0
    # #{-lam < g < lam} = sum ([g < lam] + [g > -lam] - 1) for lam > 0; for lam = 0 it reads
    # -#{g = 0} instead of 0, so n_ge reads D + #{g = 0} >= D - f: it passes as it should
    n_ge = 2 * m - (bits[2 * K:3 * K] + bits[3 * K:]).sum(1)
    return n_gt, n_ge


def verdict_from_counts(n_gt: Tensor, n_ge: Tensor, lam: Tensor, D: int, gamma: float) -> torch.Tensor:
    """Public bool per client from the counts over all D coordinates (:func:`claim_counts`) and the
    shared lambda: the ranges, one opening of K bits."""
    K = int(lam.shape[0])
    f = quantile_rank(D, gamma)
    raw = B.relabel(lam, 0)
    tests = _ge(B.cat([(D - 1 - f) - n_gt, n_ge - (D - f), raw, (LAMBDA_LIMIT - 1) - raw]), 0)
    ok = tests[:K] * tests[K:2 * K] * tests[2 * K:3 * K] * tests[3 * K:]
    return B.reveal(ok).to(torch.bool)


def check_thresholds(G: Tensor, thresholds: Tensor, gamma: float = FEDSECA_GAMMA,
                     meter: Optional[Meter] = None) -> torch.Tensor:
    """Public bool per client: is lambda_k exactly the order statistic v_(f) of |g_k|?

    f = floor(gamma (D - 1)) (:func:`common.robust_rules.quantile_rank`). True iff
    lambda_k >= 0, #{j: |g_k^j| > lambda_k} <= D - 1 - f and #{j: |g_k^j| >= lambda_k} >= D - f.
    2PC also requires lambda_k < 2**14 (an honest one is some |g| < 2**14): one call of 4 K D
    bounded sign tests (module docstring), one of the 4 K per-client 64-bit tests, three product
    rounds, one opening of K bits, nothing else. D = 0: every claim passes (nothing to
    sparsify). ``meter``: the whole check is the step "check".
    """
    with (meter or no_meter)("check"):
        check_gamma(gamma)
        G = prepare(G)
        K, D = int(G.shape[0]), int(G.shape[1])
        if tuple(thresholds.shape) != (K,):
            raise ValueError(f"thresholds must have shape ({K},), got {tuple(thresholds.shape)}")
        if D == 0:
            return torch.ones(K, dtype=torch.bool)
        if not B.any_shared(G, thresholds):
            f = quantile_rank(D, gamma)
            lam = as_float64(thresholds)
            a = G.abs()
            n_gt = (a > lam.unsqueeze(1)).sum(1)
            n_ge = (a >= lam.unsqueeze(1)).sum(1)
            return (lam >= 0) & (n_gt <= D - 1 - f) & (n_ge >= D - f)
        lam = B.to_shared_like(thresholds if B.is_shared(thresholds) else as_float64(thresholds))
        G = B.to_shared_like(G)
        # bounded sign tests, exact while |g| < 2**14 and 0 <= lam < 2**14 (the range test in the
        # verdict; outside it the counts may be wrong, but the range bit fails the client)
        bits = _neg(B.cat(claim_operands(G, lam.unsqueeze(1))))
        return claim_verdict(bits, lam, D, gamma)

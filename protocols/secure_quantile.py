"""FedSECA's lambda_k computed on shares where no client reported it: a secure order statistic.

A Stage II estimate is a K x D matrix that no client's upload accompanies, so the threshold
FedSECA's sparsification needs (lambda_k, the gamma-quantile of |g_k|) is found by the servers
themselves, exactly and without opening anything (docs/unlearning.md, "A robust history").
The rule it serves lives in ``protocols.robust_aggregation``; the plaintext twin of this search
is that module's ``quantile_thresholds``.
"""

from __future__ import annotations

from typing import Optional

import torch

from common.robust_rules import FEDSECA_GAMMA, quantile_rank

from . import backend as B
from .backend import Tensor
from .comparator_networks import negative as _neg
from .fedseca_thresholds import (Meter, check_gamma as _check_gamma, no_meter as _no_meter,
                                 prepare as _prepare, quantile_thresholds)

__all__ = ["secure_quantile_thresholds", "quantile_step_bits", "quantile_digits", "quantile_magnitudes",
           "quantile_below", "quantile_digit", "QUANTILE_STEP_BITS", "QUANTILE_LARGE_ENTRIES"]


#: bits of the secure quantile's search: an admissible |g| is below 2**14, a ring integer below 2**30
_QUANTILE_BITS = 30
#: bits decided per step of the search (2**r - 1 candidates a step) below
#: ``QUANTILE_LARGE_ENTRIES`` entries: 2 halves the rounds of 1 (15 steps, not 30) for 1.5 times
#: its bytes, and the rounds dominate on the small models the service tests run
QUANTILE_STEP_BITS = 2
#: from this many entries (K x D) on, one bit a step: a step's call then moves at least ~12 MB
#: (11.75 bytes a test), more than its 18 rounds cost on LAN (1.5 ms) or WAN (0.65 s at
#: 100 Mbit/s and 36 ms one way), so a third fewer tests beat half the rounds
QUANTILE_LARGE_ENTRIES = 1 << 20


def quantile_step_bits(K: int, D: int) -> int:
    """The search's bits per step for a K x D matrix (see the two constants above)."""
    return 1 if K * D >= QUANTILE_LARGE_ENTRIES else QUANTILE_STEP_BITS


def secure_quantile_thresholds(G: Tensor, gamma: float = FEDSECA_GAMMA,
                               meter: Optional[Meter] = None, step_bits: Optional[int] = None) -> Tensor:
    """lambda_k = v_(f) of the sorted |g_k| on either backend; nothing is opened.

    Plaintext: :func:`quantile_thresholds`. Shares: for a K x D matrix that no client's upload
    accompanies (a Stage II estimate, module docstring "Where lambda_k comes from"), the order
    statistic is found digit by digit, for all K rows at once: v_(f) is the largest c with
    #{j: |g_k^j| >= c} >= D - f (counts fall as c grows), so from the top of the 30-bit ring
    range down, ``step_bits`` = r bits at a time, the candidates lambda + i 2**b (i = 1..2**r - 1)
    are counted and the digit is the number of candidates whose count reaches D - f (the
    counts are monotone in i, so that number is the largest such i). Each of the 30 / r steps
    is one bounded sign-test call on the (2**r - 1) K D values |g| - c (ring integers in
    (-2**31, 2**30): exact) and one on the (2**r - 1) K counts; plus one call for [g < 0] and
    one product for |g| before. The result is exactly the twin's order statistic of the same
    encoded values, a share on the 2**-16 grid in [0, 2**14) (what :func:`fedseca` needs).
    Cost (r = 2, the default below 2**20 entries): 46 K D + 45 K bounded tests, K D products,
    32 comparison calls (about 290 rounds); (r = 1, the default from 2**20 entries on, e.g.
    MNIST's 19 x 582,026): 31 K D + 30 K bounded tests, 62 calls (about 560 rounds). Inputs with |g| >= 2**14 give a wrong lambda, never a revealed one (only
    one-time-padded values are opened). ``meter``: the whole search is the step "quantile".
    """
    _check_gamma(gamma)
    G = _prepare(G)
    if not B.is_shared(G):
        return quantile_thresholds(G, gamma)
    K, D = int(G.shape[0]), int(G.shape[1])
    r = quantile_step_bits(K, D) if step_bits is None else int(step_bits)
    if not 1 <= r <= 4:
        raise ValueError(f"step_bits must be in 1..4, got {step_bits!r}")
    with (meter or _no_meter)("quantile"):
        if D == 0:
            return B.share_public(torch.zeros(K, dtype=torch.float64))
        need = D - quantile_rank(D, gamma)                     # #{|g| >= lambda} >= need
        absg = quantile_magnitudes(G)
        lam = None                                             # ring integers, scale 1
        for b, n in quantile_digits(r):
            step = quantile_digit(quantile_below(absg, lam, b, n), D, need, b)
            lam = step if lam is None else lam + step
        return B.relabel(lam, B.bits_of(G))


# The search split where it sums over coordinates (issue 30: on coordinate shards each worker pair
# runs ``quantile_magnitudes`` and ``quantile_below`` on its coordinates, the coordinators add the
# shards' shares of the counts and run ``quantile_digit``); the lines are those of the whole search.

def quantile_digits(step_bits: int) -> list[tuple[int, int]]:
    """The search's digits, from the top: (b, n) decides bits b .. b + r - 1 with n = 2**r - 1
    candidates (the last digit may be narrower)."""
    out, top = [], _QUANTILE_BITS
    while top > 0:
        b = max(0, top - step_bits)
        out.append((b, (1 << (top - b)) - 1))
        top = b
    return out


def quantile_magnitudes(G: Tensor) -> Tensor:
    """|g| of the shared (K, D) rows as ring integers (scale 1, below 2**30 for admissible rows):
    one call for [g < 0], one product."""
    ring = B.relabel(G, 0)
    return (1 - _neg(ring) * 2) * ring


def quantile_below(absg: Tensor, lam: Tensor | None, b: int, n: int) -> Tensor:
    """Per candidate lambda + i 2**b (i = 1..n) and row: #{j: |g^j| < candidate} over the
    coordinates at hand, (n, K) shared: one bounded sign-test call on n K D values."""
    K = int(absg.shape[0])
    offs = torch.arange(1, n + 1, dtype=torch.long) << b
    base = absg.unsqueeze(0) - offs.reshape(n, 1, 1)        # |g| - i 2**b, (n, K, D)
    if lam is not None:
        base = base - lam.reshape(1, K, 1)
    return _neg(base).sum(2)


def quantile_digit(below: Tensor, D: int, need: int, b: int) -> Tensor:
    """This digit's step of lambda (K, ring integers) from the counts below the candidates over
    all D coordinates: the number of candidates with #{|g| >= candidate} >= need, times 2**b
    (one bounded sign-test call on n K values)."""
    at_least = D - below                                    # #{|g| >= cand_i}, (n, K) in 0..D
    digit = (1 - _neg(at_least - need)).sum(0)              # candidates that reach the count
    return digit * (1 << b)

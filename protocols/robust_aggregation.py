"""Byzantine-robust aggregation on shares: FedSECA (CRISE + RoCA) and BRACE's sign vote.

Both rules are written once over the project's two backends: a K x D matrix ``G`` of the
round's client updates (one row per client) as a torch tensor runs the plaintext twin (float64),
as a CrypTen MPCTensor the two-party protocol on the servers' shares. Both papers count every
client once (unweighted votes and means); the FedAvg weights |D_j| play no part here.

FedSECA (``papers/fedseca.txt`` Sec. 4; the equations are authoritative where the appendix
pseudocode differs: it clamps the unclipped g and keeps |g| >= lambda where eq. 10 says >)
------------------------------------------------------------------------------------------
* CRISE. s_k = sgn(g_k) per coordinate (sgn(0) = 0), omega_kl = <s_k, s_l> / D (eq. 4),
  rho_k = max(0, mean_l sgn(omega_kl)) (eq. 5, l runs over all K clients, k included), elected
  sign s^j = sgn(sum_k rho_k sgn(g_k^j)) (eq. 6). We use the integer weights
  w_k = K rho_k = max(0, sum_l sgn(omega_kl)): a positive factor does not change a sign, and
  integers keep ties exact (a vote that balances to 0 elects 0) in both backends.
* VRS gradients. clip (eq. 8): g_hat_k = g_k min(1, tau / ||g_k||), tau = median_k ||g_k||;
  clamp (eq. 9): g_bar = sgn(g_hat) min(mu^j, |g_hat|), mu^j = median_k |g_hat_k^j|;
  sparsify (eq. 10): g_ddot_k^j = g_bar_k^j [|g_k^j| > lambda_k] with lambda_k the
  gamma-quantile of the *raw* |g_k| (default gamma = 0.9, Sec. 5). Medians of an even count
  are the lower middle (sorted index (K-1)//2, what torch.median returns and the authors' code
  uses).
* RoCA (eq. 7). delta_k^j = [s^j g_ddot_k^j > 0] and g_tilde^j = sum_k delta g_ddot /
  sum_k delta; a coordinate where no client agrees gives 0 (the authors' safe_divide).
* Server momentum (eq. 11, beta_ra = 0.5) applies to the *opened* aggregate:
  :func:`momentum`, plaintext.

How it is computed (the same steps on both backends; bits are 0/1 values, exact integers in
2PC):

Every comparison on a value that scales with D is a *bounded* sign test [v < 0]
(``mpc.table_compare.negative_bounded``: 32-bit ring, dealer-made tables, 11.75 bytes online),
exact for ring integers in [-2**31, 2**31); the ranges below keep every tested value there.

1. one bounded sign-test call for all K x D entries: [g < 0], [-g < 0], [lambda_k - g < 0],
   [g + lambda_k < 0]. Hence sgn(g) = [-g < 0] - [g < 0] (no zero test), keep+ = [g > lambda_k]
   and keep- = [g < -lambda_k] (for lambda_k >= 0 their sum is the sparsification bit of eq. 10,
   split by the sign of g).
2. CRISE: omega~ = S S^T (S = sgn(G), integers, |omega~| <= D), its signs, w, t = w^T S
   (|t| <= K^2), s = sgn(t), each sign two bounded tests.
3. agreement: delta+ = [s = +1] keep+, delta- = [s = -1] keep-; delta = delta+ + delta-. This
   is eq. 7's I(s g_ddot > 0): g_ddot has the sign of g (clipping scales by a positive
   factor, clamping keeps the sign) and is non-zero exactly where g is kept and mu^j > 0. Where
   mu^j = 0 every g_ddot^j is 0 and g_tilde^j = 0 with either bit, so the aggregate is the
   paper's; :func:`fedseca_parts` reports delta as computed here (it may be 1 there).
4. clipping factors c_k (K values), x_k^j = c_k |g_k^j| = |g_hat_k^j|.
5. clamped sum without clamp comparisons: a data-independent *partition network* (Batcher's
   odd-even merge sort, pruned: ``comparator_networks.partition_network``) moves, per coordinate, the K values x^j with their payloads
   delta s so that position m = (K-1)//2 holds mu^j, the positions below hold values <= mu^j
   and those above values >= mu^j. Then sum_k delta_k min(mu, x_k) s =
   sum_{i<m} (delta s)_(i) x_(i) + mu sum_{i>=m} (delta s)_(i): one multiplication.
6. division by the count n^j = sum_k delta_k in {0..K}: K bounded tests [n^j >= i], i = 1..K;
   1/n^j = sum_i [n^j >= i] (w_i - w_{i-1}) with w_i = round(2**32 / i), w_0 = 0, a public
   combination of the bits (exact up to 2**-33 relative), 0 for n^j = 0.

Where lambda_k comes from
-------------------------
On shares the rule needs ``thresholds``: each client uploads its lambda_k with its update and
the servers verify the claim (``protocols.fedseca_thresholds``, which has the reasoning).
:func:`fedseca_checked` verifies and aggregates in one pass: the check's tests [g > lambda],
[g < -lambda] are the rule's keep bits, so one call of 6 K D bounded tests serves both, and
the rows of the clients whose claim fails are dropped before CRISE.

BRACE (``papers/brace.txt`` eq. 1)
----------------------------------
GAR[k] = +1 if sum_i sign(g_i[k]) > lambda else -1 (sign(0) = 0); Sec. 5.1 sets lambda = 5 with
n = 100 clients. Its ring all-reduce does not apply to two servers; only the rule is computed.

What is opened
--------------
``fedseca``, ``fedseca_elected_signs``, ``brace_sign`` open nothing: they return shares, and the
caller opens the aggregate (one opening of D values, e.g. :func:`protocols.backend.reveal`).
Opening the FedSECA aggregate reveals, besides g_tilde, which coordinates are 0 (no agreeing
client, or mu = 0); opening BRACE's vote reveals the vote. Every intermediate (signs,
weights rho, tau, mu, the bits, the counts) stays shared. ``check_thresholds`` opens one bit per
client (its threshold is right or not).

Cost per call (2PC, dealer mode), measured per coordinate where it scales with D
----------------------------------------------------------------------------------
A bounded test is ``mpc.table_compare.negative_bounded`` (9 rounds, 11.75 bytes online both
directions, about 25 bytes of dealer material, 41 before the tables were halved); a comparison the 64-bit sign test of
``mpc.nonnegative`` (8 rounds, 75.25 bytes), only on K-sized values here; a zero test
``mpc.nonnegative.below_power_of_two`` on 2x (8 rounds, 47.75 bytes), only in the clip factors; a
multiplication opens 2 x 8 bytes per party (32 bytes both directions; products by bits and
integer products need no truncation, fixed-point ones one truncation round of 16 bytes).
C(K) = comparators of the pruned partition network (3 for K=3, 24 for K=10, 71 for K=20);
C'(K) those of the median-only network (3, 27, 84).

============================  ==================  ===============  ============================
step                          bounded tests       64-bit tests     multiplications
============================  ==================  ===============  ============================
signs, keep+/-  (fedseca)     4 K D               --               --
CRISE                         2 K^2 + K + 2 D     --               S S^T, w^T S (3 K D
                                                                   openings), K
agreement bits                --                  --               2 K D
norms, clip factors           --                  ~31 K + C'(K),   K D (squares) + ~40 K
                                                  31 K zero tests
x = c |g|                     --                  --               2 K D (+ K D trunc.)
partition network             C(K) D              --               C(K) D (2 values)
clamped sum                   --                  --               ((K-1)//2 + 1) D
division by the count         K D                 --               D (+ D trunc.)
brace_sign                    2 K D + D           --               --
check_thresholds              4 K D               4 K              3 K
fedseca_checked: check        +2 K D (one call)   4 K              3 K
============================  ==================  ===============  ============================

Measured (K = 20, D = 582,026, ``python -m bench.robust_aggregation --clients 20 --dim 582026
--aggregator fedseca --check-thresholds --profile lan``; online bytes both directions per
coordinate, 64-bit comparisons before -> bounded tests now): signs 5.5 -> 0.94 KB, crise 1.1 ->
0.98 KB, agree 0.67 KB, clip 1.6 KB, clamp (the network) 10.7 -> 5.3 KB (of which the exchange
products 4.0 KB), divide 1.0 -> 0.28 KB: 20.5 -> 10.8 KB for ``fedseca``; ``check_thresholds``
3.3 -> 0.94 KB; ``brace_sign`` 2.5 -> 0.50 KB. Dealer material rose (the tables: 32 bytes per
test): 13.4 KB per coordinate for ``fedseca`` + check (9.4 KB before). Rounds do not depend on D
while a call stays below ``comparator_networks.MAX_BATCH`` elements; larger calls are split, 9 rounds per extra
piece (668 rounds for ``fedseca`` + check + opening at D = 582,026, 434 at D = 100,000).
Since then (``fedseca_checked``, 71 comparators): docs/protocols.md has the tables and the seconds.

Why not ``protocols.division``. The count n^j is an integer in 0..K: its K bounded tests cost
235 bytes at K = 20 and give 1/n^j exactly, where ``divide`` costs 34 comparisons and 9
multiplications per element (about 2.9 KB) for 2**-15 relative accuracy. The clip factor needs
tau / ||g_k||, i.e. square roots, which ``protocols`` has no primitive for; from the exact ring
value of ||g_k||^2 the normalised inverse square root below keeps ~14 significant bits for every
norm, where a 16-bit encoding of a norm of 0.01 keeps 9.

Fixed-point error (2PC against the twin, inputs on the 2**-16 grid)
-------------------------------------------------------------------
Exact (bit for bit): the signs s, the weights w, keep+/-, delta and the counts (all are
comparisons and integer arithmetic on the encodings), and BRACE's vote. The clip factor c_k is
computed from the exact ring value of ||g_k||^2 (32 fractional bits): a secret power of four
brings it into [1, 4) (30 comparisons, one exact product, one truncation), three Newton steps
give 1/sqrt of it (initial error 8.7%, then 1.2e-2, 2.0e-4, 6e-8), and
c_k = sqrt(x_med) / sqrt(x_k) 2**(e_med - e_k) is formed at 32 fractional bits; c_k = 1 exactly
for an unclipped client. Its relative error is below 2**-12 (the truncations of the 16-bit
Newton iterates and products, about 2**-12.3 in the worst case; measured at most 2**-13.95
over 122 clipped clients). Then x = c |g| (one truncation, one unit), the network and the
clamped sum are exact on those x, and the division adds one unit. So
|g_tilde_2pc - g_tilde_twin| <= 2**-12 max_k |g_hat_k^j| + 2 2**-16 per coordinate (the
median and min are 1-Lipschitz, so each clamped value is off by at most the largest error of
an x; so is their mean); the tests allow twice that, 2 (2**-12 max_k |g_k^j| + 2**-16) + 2**-16. mu^j is exact when no client is clipped (c_k = 1: x = |g| exactly).

Ranges (2PC): |g| < 2**14 (x = c |g| is formed as a 48-bit product; every bounded test then
sees |v| < 2**15, ring integers inside [-2**31, 2**31)), ||g||^2 < 2**30 (its raw ring value must
stay below 2**62), 0 <= lambda < 2**14 (lambda -+ g is tested with 32 bits; an honest lambda is
some |g|, below 2**14; :func:`check_thresholds` fails any other). The upload range check
(``protocols.upload_range``: |g| < 2**10, ||g|| < 2**14 with the norm consistency test, delta in
a window, by default) gives the first two; lambda_k should travel in that check's delta slot.
Outside the range results are wrong, never revealing (only one-time-padded values are opened):
an unchecked lambda outside [0, 2**14) can only make wrong keep bits in its own client's row,
i.e. change which of that client's coordinates count and with which sign, each still clamped
by mu (what a Byzantine client can do with its update anyway).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from common.robust_rules import BRACE_LAMBDA, FEDSECA_BETA, FEDSECA_GAMMA, quantile_rank
from mpc.nonnegative import below_power_of_two
from mpc.table_compare import BOUND

from . import backend as B
from .backend import Tensor
from .compare import select
from .comparator_networks import (batcher_layers as _batcher_layers, batched as _batched,  # noqa: F401
                                  ge as _ge, median_network, negative as _neg, partition_network,
                                  run_network as _run_network)
from .fedseca_thresholds import (LAMBDA_LIMIT, Meter, as_float64 as _f64, check_gamma as _check_gamma,
                                 check_thresholds, claim_operands, claim_verdict,
                                 no_meter as _no_meter, prepare as _prepare, quantile_thresholds)

__all__ = [
    "fedseca",
    "fedseca_parts",
    "fedseca_checked",
    "CheckedAggregate",
    "fedseca_elected_signs",
    "FedsecaParts",
    "brace_sign",
    "check_thresholds",
    "quantile_thresholds",
    "quantile_rank",
    "momentum",
    "fedseca_error_bound",
    "partition_network",
    "median_network",
    "FEDSECA_GAMMA",
    "FEDSECA_BETA",
    "BRACE_LAMBDA",
]

# the paper constants are defined once, in ``common.robust_rules``, and re-exported here

# Normalisation of ||g||^2 (ring integer N = sum g_enc^2 < 2**62): bits [N >= 4**j], j = 1..30.
_POW4 = 30
# 1/sqrt on [1, 4): minimax linear start (max relative error 8.7%), then Newton steps.
_RSQRT_A, _RSQRT_B, _RSQRT_STEPS = 1.066, 0.152, 3
# Fractional bits of the clip factors and of 1/count.
_HI = 32


# ------------------------------------------------------------------------------ small pieces
def _is_zero(x: Tensor) -> Tensor:
    """[x == 0] as a bit. 2PC: 2x < 2 read unsigned, i.e. 2x = 0 in the ring, i.e. x = 0 (or
    x = 2**63, outside every range): one ``below_power_of_two`` test (63 AND gates)."""
    if not B.is_shared(x):
        return (_f64(x) == 0).to(torch.float64)
    return _batched(lambda v: below_power_of_two(v, 1), B.relabel(x, 0) * 2)


def _sign(x: Tensor) -> Tensor:
    """sgn(x) in {-1, 0, 1} (sgn(0) = 0) = [-x < 0] - [x < 0]: two bounded sign tests in one call,
    so the ring integer of x must lie in (-2**31, 2**31)."""
    n = int(x.shape[0])
    bits = _neg(B.cat([-x, x]))
    return bits[:n] - bits[n:]


def _rows(x: Tensor) -> list:
    return [x[i] for i in range(int(x.shape[0]))]


def _thresholds_column(G: Tensor, thresholds: Optional[Tensor], gamma: float) -> Tensor:
    K = int(G.shape[0])
    if thresholds is None:
        if B.is_shared(G):
            raise ValueError("on shares FedSECA needs thresholds (lambda_k, one per client): a "
                             "quantile of D shared values is too costly; clients upload theirs "
                             "and the servers verify them with check_thresholds")
        return quantile_thresholds(G, gamma).unsqueeze(1)
    if tuple(thresholds.shape) != (K,):
        raise ValueError(f"thresholds must have shape ({K},), got {tuple(thresholds.shape)}")
    if B.is_shared(thresholds):
        # lambda >= 0 is assumed (keep+ = [g > lambda] must imply g > 0); a shared negative one
        # is what check_thresholds rejects
        return thresholds.unsqueeze(1)
    lam = _f64(thresholds)
    if bool((lam < 0).any()) or not bool(torch.isfinite(lam).all()):
        raise ValueError("thresholds must be finite and non-negative (lambda_k is a quantile of |g_k|)")
    if B.is_shared(G) and bool((lam >= 2.0 ** 14).any()):
        raise ValueError("on shares thresholds must be below 2**14 (the bounded sign tests' range)")
    return lam.unsqueeze(1)


# --------------------------------------------------------------------------------- clipping
def _rsqrt_unit(x: Tensor) -> Tensor:
    """1/sqrt(x) for x in [1, 4) (16 fractional bits): linear start, three Newton steps."""
    y = x * (-_RSQRT_B) + _RSQRT_A
    half = x * 0.5
    for _ in range(_RSQRT_STEPS):
        y = y * (1.5 - half * y.square())
    return y


def clip_norms(G: Tensor) -> Tensor:
    """The rows' squared norms N_k, a sum over coordinates (so shards' parts add): twin float64;
    2PC sum_j g_enc^2, the exact ring value of ||g_k||^2 at 32 fractional bits (read as integers)."""
    if not B.is_shared(G):
        return G.pow(2).sum(1)
    return B.relabel(B.raw_square(G).sum(1), 0)


def _clip_factors(G: Tensor) -> Tensor:
    return clip_factors(clip_norms(G))


def clip_factors(N: Tensor) -> Tensor:
    """c_k = min(1, tau / ||g_k||), tau the lower median of the norms (c_k = 1 for g_k = 0), from
    the squared norms ``N`` (:func:`clip_norms`).

    Twin: float64. 2PC: a sharing at 32 fractional bits (module docstring, "Fixed-point error").
    """
    K = int(N.shape[0])
    m = (K - 1) // 2
    if not B.is_shared(N):
        n = N.sqrt()
        tau = torch.sort(n).values[m]
        return torch.where(n > tau, tau / torch.where(n > 0, n, torch.ones_like(n)),
                           torch.ones_like(n))
    bits = _ge(N.unsqueeze(1), torch.pow(4.0, torch.arange(1, _POW4 + 1, dtype=torch.float64)))
    e = bits.sum(1)  # 4**e <= N < 4**(e+1)
    # 4**(30-e) = 4**30 - sum_j [N >= 4**j] 3 4**(30-j): a public integer combination (telescoping)
    steps = torch.tensor([3 * 4 ** (_POW4 - j) for j in range(1, _POW4 + 1)], dtype=torch.long)
    shift = (bits * steps).sum(1) * -1 + (4 ** _POW4)
    # N 4**(30-e) in [2**60, 2**62): exact ring product; read at 60 bits it is x = N 4**-e in [1, 4)
    x = B.rescale(B.relabel(N * shift, 2 * _POW4), B.frac_bits())
    y = _rsqrt_unit(x)                     # 1 / sqrt(x)
    root = x * y                           # sqrt(x) in [1, 2): ||g|| = sqrt(x) 2**(e - 16)
    keys, (roots, exps) = _run_network(median_network(K), _rows(N.unsqueeze(1)),
                                       [_rows(root.unsqueeze(1)), _rows(e.unsqueeze(1))])
    n_med, root_med, e_med = keys[m], roots[m], exps[m]
    clipped = 1 - _ge(n_med, N)             # [||g_k|| > tau], exact on the ring values
    # 2**(e_med - e_k) for the clipped (e_med - e_k in -30..0): one-hot by zero tests, 32 bits
    d = (e_med - e).unsqueeze(1) + torch.arange(0, _POW4 + 1, dtype=torch.long)
    pow2 = (_is_zero(d) * torch.tensor([1 << (_HI - i) for i in range(_POW4 + 1)],
                                       dtype=torch.long)).sum(1)
    ratio = root_med * y                   # sqrt(x_med) / sqrt(x_k), 16 bits
    c = B.rescale(B.relabel(B.relabel(ratio, 0) * pow2, B.frac_bits() + _HI), _HI)
    return select(clipped, c, 1.0)


def _scale_rows(c: Tensor, absg: Tensor) -> Tensor:
    """x_k^j = c_k |g_k^j| (2PC: a 48-bit product truncated once to 16 bits)."""
    if not B.is_shared(absg) and not B.is_shared(c):
        return c.unsqueeze(1) * absg
    raw = B.relabel(c, 0).unsqueeze(1) * B.relabel(absg, 0)
    return B.rescale(B.relabel(raw, B.bits_of(c) + B.bits_of(absg)), B.frac_bits())


def _clamped_sum(x: Tensor, signed: Tensor) -> tuple[Tensor, Tensor]:
    """(sum_k signed_k min(mu, x_k), mu) per column, mu the lower median of the column of x.

    2PC: the partition network carries ``signed`` with its key; below position m the value
    itself counts, from m up mu. The twin sorts (any arrangement of ties gives the same sum).
    """
    K = int(x.shape[0])
    m = (K - 1) // 2
    if not B.any_shared(x, signed):
        xs, order = torch.sort(x, dim=0, stable=True)
        ds = signed.gather(0, order)
        return (ds[:m] * xs[:m]).sum(0) + xs[m] * ds[m:].sum(0), xs[m]
    # keys x = c |g| in [0, 2**14 (1 + 2**-12)): their differences are 32-bit ring integers
    xs, (ds,) = _run_network(partition_network(K), _rows(x), [_rows(signed)], bounded=True)
    upper = ds[m]
    for i in range(m + 1, K):
        upper = upper + ds[i]
    num = (B.stack(ds[:m] + [upper]) * B.stack(xs[:m + 1])).sum(0)
    return num, xs[m]


def _divide_by_count(num: Tensor, count: Tensor, K: int) -> Tensor:
    """num / count for integer counts in 0..K (0 where count = 0)."""
    if not B.is_shared(num) and not B.is_shared(count):
        safe = torch.where(count > 0, count, torch.ones_like(count))
        return torch.where(count > 0, num / safe, torch.zeros_like(num))
    js = torch.arange(1, K + 1, dtype=torch.long).unsqueeze(1)
    at_least = 1 - _neg(count.unsqueeze(0) - js)             # [count >= j], (K, D), |.| <= K
    # 1/count = sum_j [count >= j] (w_j - w_{j-1}), w_j = round(2**32 / j), w_0 = 0: the
    # telescoping sum leaves w_count (0 for count = 0), the ring integer a one-hot would pick
    w = [0] + [round(2.0 ** _HI / j) for j in range(1, K + 1)]
    steps = torch.tensor([w[j] - w[j - 1] for j in range(1, K + 1)], dtype=torch.long).unsqueeze(1)
    inv = (at_least * steps).sum(0)                          # 1/count at 32 bits (ring integers)
    raw = B.relabel(num, 0) * inv
    return B.rescale(B.relabel(raw, B.bits_of(num) + _HI), B.frac_bits())


# ---------------------------------------------------------------------------------- FedSECA
class FedsecaParts(NamedTuple):
    """Every intermediate of one FedSECA aggregation (shares on the 2PC backend).

    aggregate: g_tilde (D,); signs: s (D,) in {-1,0,1}; weights: K rho_k (K,) integers;
    keep: [|g_k^j| > lambda_k] (K, D); agree: delta (K, D) (see the module docstring, step 3);
    count: sum_k delta (D,); clip: c_k (K,); clamp: mu^j (D,); thresholds: lambda_k (K,).
    """

    aggregate: Tensor
    signs: Tensor
    weights: Tensor
    keep: Tensor
    agree: Tensor
    count: Tensor
    clip: Tensor
    clamp: Tensor
    thresholds: Tensor


def sign_blocks(G: Tensor, lam: Tensor, claims: bool = False) -> list:
    """The blocks one bounded sign-test call takes: [g < 0], [-g < 0], [lambda - g < 0],
    [g + lambda < 0], with ``claims`` also the check's [g - lambda < 0], [-g - lambda < 0].

    |g| < 2**14 and 0 <= lambda < 2**14 keep every tested value inside |.| < 2**15, i.e. ring
    integers inside the 32-bit test's domain; the third and fourth blocks are keep+ and keep-."""
    blocks = [G, -G]
    ops = claim_operands(G, lam)
    return blocks + (ops if claims else ops[:2])


def check_crise(K: int, D: int) -> None:
    if D >= BOUND or K * K >= BOUND:
        raise ValueError(f"CRISE's bounded sign tests need D < 2**31 and K**2 < 2**31, got K={K}, D={D}")


def crise_omega(S: Tensor) -> Tensor:
    """omega~ = S S^T (K x K integers, |omega~| <= D): a sum over coordinates, so shards' parts add."""
    return S.matmul(S.t()) if B.is_shared(S) else S @ S.T


def crise_weights(omega: Tensor) -> Tensor:
    """w = K rho = max(0, sum_l sgn(omega~_kl)) per client (|sum| <= K)."""
    v = _sign(omega).sum(1)
    return (1 - _neg(v)) * v


def crise_signs(w: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """([s = +1], [s = -1]) per coordinate, s = sgn(w^T S) (|w^T S| <= K**2): coordinate-wise."""
    D = int(S.shape[1])
    t = w.unsqueeze(0).matmul(S).squeeze(0) if B.is_shared(S) or B.is_shared(w) else w @ S
    bits = _neg(B.cat([-t, t]))
    return bits[:D], bits[D:]


def _crise(S: Tensor):
    """(weights w = K rho, [s = +1], [s = -1]) from the sign matrix S (K x D integers)."""
    check_crise(int(S.shape[0]), int(S.shape[1]))
    w = crise_weights(crise_omega(S))
    return (w, *crise_signs(w, S))


def fedseca_parts(G: Tensor, *, gamma: float = FEDSECA_GAMMA, thresholds: Optional[Tensor] = None,
                  meter: Optional[Meter] = None) -> FedsecaParts:
    """FedSECA on the K x D update matrix ``G``, with every intermediate (for tests and
    inspection; opening them in 2PC would leak, :func:`fedseca` returns the aggregate only).

    ``meter``: e.g. ``party.meter``; the steps signs, crise, agree, clip, clamp and divide are
    metered under those names.
    """
    meter = meter or _no_meter
    _check_gamma(gamma)
    G = _prepare(G)
    K, D = int(G.shape[0]), int(G.shape[1])
    lam = _thresholds_column(G, thresholds, gamma)
    if D == 0:
        empty = torch.zeros(0, dtype=torch.float64)
        z2 = torch.zeros(K, 0, dtype=torch.float64)
        ones = torch.ones(K, dtype=torch.float64)
        return FedsecaParts(empty, empty, torch.zeros(K, dtype=torch.float64), z2, z2, empty,
                            ones, empty, lam.reshape(K))
    with meter("signs"):
        bits = _neg(B.cat(sign_blocks(G, lam)))
    return _parts_from_signs(G, lam, bits, meter)


def _parts_from_signs(G: Tensor, lam: Tensor, bits: Tensor, meter: Meter) -> FedsecaParts:
    """FedSECA from CRISE on, given the sign call's first four blocks (4 K x D bits)."""
    K = int(G.shape[0])
    S = bits[K:2 * K] - bits[:K]
    with meter("crise"):
        w, s_pos, s_neg = _crise(S)
    agg, agree, count, c, mu = vrs_aggregate(G, bits, s_pos, s_neg, lambda: _clip_factors(G), meter)
    return FedsecaParts(agg, s_pos - s_neg, w, bits[2 * K:3 * K] + bits[3 * K:4 * K], agree, count, c, mu,
                        lam.reshape(K))


def vrs_aggregate(G: Tensor, bits: Tensor, s_pos: Tensor, s_neg: Tensor, clip: Callable[[], Tensor],
                  meter: Meter) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """RoCA over the VRS gradients, coordinate-wise (a shard computes its own coordinates): the
    agreement bits, x = c |g|, the clamped sum and the division, from the sign call's first four
    blocks ``bits`` and the elected signs; ``clip()`` gives the clip factors c (computed here, or
    the coordinators' from the shards' norms). (aggregate, agree, count, c, mu)."""
    K = int(G.shape[0])
    neg, keep_pos, keep_neg = bits[:K], bits[2 * K:3 * K], bits[3 * K:4 * K]
    with meter("agree"):
        agree_pm = B.stack([keep_pos, keep_neg]) * B.stack([s_pos, s_neg]).unsqueeze(1)
        agree = agree_pm[0] + agree_pm[1]
        signed = agree_pm[0] - agree_pm[1]          # delta s
        count = agree.sum(0)
    with meter("clip"):
        absg = (1 - neg * 2) * G
        c = clip()
        x = _scale_rows(c, absg)
    with meter("clamp"):
        num, mu = _clamped_sum(x, signed)
    with meter("divide"):
        agg = _divide_by_count(num, count, K)
    return agg, agree, count, c, mu


class CheckedAggregate(NamedTuple):
    """:func:`fedseca_checked`'s result: ``accepted`` (public bool per client: its lambda_k was
    right) and the aggregate over the accepted rows (shares in 2PC; None if none was)."""

    accepted: torch.Tensor
    aggregate: Optional[Tensor]


def fedseca_checked(G: Tensor, thresholds: Tensor, *, gamma: float = FEDSECA_GAMMA,
                    meter: Optional[Meter] = None) -> CheckedAggregate:
    """The servers' round: check each client's claimed lambda_k, then FedSECA on the clients
    whose claim holds, with their thresholds.

    The same as ``check_thresholds`` followed by :func:`fedseca` on the accepted rows (opens the
    same K bits, nothing more), for 6 K D bounded tests in one call instead of 4 K D + 4 K D:
    the check's [g > lambda], [g < -lambda] are the rule's keep bits, and a bit matrix's rows
    are dropped by public index. Plaintext: exactly that composition (the twin). ``meter``:
    signs (the shared call), check (the verdict), then fedseca's steps.
    """
    meter = meter or _no_meter
    _check_gamma(gamma)
    G = _prepare(G)
    K, D = int(G.shape[0]), int(G.shape[1])
    if tuple(thresholds.shape) != (K,):
        raise ValueError(f"thresholds must have shape ({K},), got {tuple(thresholds.shape)}")
    if not B.any_shared(G, thresholds) or D == 0:
        ok = check_thresholds(G, thresholds, gamma, meter=meter)
        kept = [k for k in range(K) if bool(ok[k])]
        if not kept:
            return CheckedAggregate(ok, None)
        return CheckedAggregate(ok, fedseca(_pick(G, kept), gamma=gamma,
                                            thresholds=_pick(thresholds, kept), meter=meter))
    lam = B.to_shared_like(thresholds if B.is_shared(thresholds) else _f64(thresholds))
    G = B.to_shared_like(G)
    with meter("signs"):
        bits = _neg(B.cat(sign_blocks(G, lam.unsqueeze(1), claims=True)))
    with meter("check"):
        ok = claim_verdict(bits[2 * K:], lam, D, gamma)
    kept = [k for k in range(K) if bool(ok[k])]
    if not kept:
        return CheckedAggregate(ok, None)
    if len(kept) == K:
        mine = bits[:4 * K]          # a view: no copy of the K x D blocks in the common case
    else:
        mine = _pick(bits, [b * K + k for b in range(4) for k in kept])
    del bits
    parts = _parts_from_signs(_pick(G, kept), _pick(lam, kept).unsqueeze(1), mine, meter)
    return CheckedAggregate(ok, parts.aggregate)


def _pick(x: Tensor, rows: list) -> Tensor:
    """The rows of ``x`` at public indices (all of them: ``x`` itself)."""
    if len(rows) == int(x.shape[0]) and rows == list(range(len(rows))):
        return x
    return B.stack([x[i] for i in rows])


def fedseca(G: Tensor, *, gamma: float = FEDSECA_GAMMA, thresholds: Optional[Tensor] = None,
            meter: Optional[Meter] = None) -> Tensor:
    """FedSECA's aggregate g_tilde (eq. 7 on the VRS gradients), a D-vector.

    ``G``: K x D updates (torch tensor: plaintext twin in float64; MPCTensor: shares, result
    shared, nothing opened). ``gamma``: sparsification factor (default 0.9). ``thresholds``:
    lambda_k >= 0 per client (shared or public; a shared one is verified by
    :func:`check_thresholds`); None computes them in the clear (plaintext only).
    Unweighted, as in the paper. Server momentum is not applied (see :func:`momentum`).
    """
    return fedseca_parts(G, gamma=gamma, thresholds=thresholds, meter=meter).aggregate


def fedseca_elected_signs(G: Tensor) -> Tensor:
    """CRISE's elected signs s (eq. 6), a D-vector in {-1, 0, 1} (shared on shares)."""
    G = _prepare(G)
    if int(G.shape[1]) == 0:
        return torch.zeros(0, dtype=torch.float64)
    _, s_pos, s_neg = _crise(_sign(G))
    return s_pos - s_neg


def fedseca_error_bound(G: torch.Tensor, frac_bits: int = 16) -> torch.Tensor:
    """Per coordinate, how far 2PC's ``fedseca`` may lie from the twin's on the same rows ``G``
    (K x D, values on the 2**-frac_bits grid): 2 (2**-12 max_k |g_k^j| + u) + u, u = 2**-frac_bits
    (the module docstring's "Fixed-point error": the clip factors' 2**-12, one unit for x = c |g|,
    one for the division, doubled)."""
    u = 2.0 ** -frac_bits
    return 2 * (2.0 ** -12 * _f64(G).abs().amax(dim=0) + u) + u


def momentum(prev: Optional[torch.Tensor], agg: torch.Tensor,
             beta: float = FEDSECA_BETA) -> torch.Tensor:
    """Server momentum (eq. 11): beta prev + (1 - beta) agg, on the opened aggregate.

    ``prev`` None means the first round (a zero buffer, as in the authors' code).
    """
    if not (isinstance(beta, (int, float)) and 0.0 <= float(beta) <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    agg = _f64(agg)
    if prev is None:
        return (1.0 - beta) * agg
    prev = _f64(prev)
    if prev.shape != agg.shape:
        raise ValueError(f"momentum buffer shape {tuple(prev.shape)} != aggregate shape {tuple(agg.shape)}")
    return beta * prev + (1.0 - beta) * agg


# ------------------------------------------------------------------------------------ BRACE
def brace_sign(G: Tensor, *, lam: float = BRACE_LAMBDA, meter: Optional[Meter] = None) -> Tensor:
    """BRACE's GAR (eq. 1): +1 where sum_k sgn(g_k^j) > lam, else -1 (a D-vector).

    Shares in, shares out (integers at scale 1; open with :func:`protocols.backend.reveal`).
    The vote sum is an integer, so it is compared with floor(lam) exactly. ``meter``: steps
    signs and vote.
    """
    meter = meter or _no_meter
    if not (isinstance(lam, (int, float)) and math.isfinite(float(lam))):
        raise ValueError(f"lam must be a finite number, got {lam!r}")
    G = _prepare(G)
    if int(G.shape[1]) == 0:
        return torch.zeros(0, dtype=torch.float64)
    K = int(G.shape[0])
    with meter("signs"):
        total = _sign(G).sum(0)
    with meter("vote"):
        # total is in -K..K: a threshold outside [-K-1, K] decides alike once clamped there,
        # which keeps floor(lam) - total inside the bounded test's domain
        L = min(max(math.floor(float(lam)), -K - 1), K)
        up = _neg((-total) + L)                   # [total > L]
    return up * 2 - 1

"""Update estimation (SecUE): FedRecover's estimate with the compact L-BFGS product.

For a remaining client j whose stored update g^j was computed on the historical model M,
the update it would send on the recovered model M_hat is estimated by the Cauchy mean
value theorem as

    g_hat^j = g^j + H^j (M_hat - M),

where H^j approximates client j's (integrated) Hessian from the last B pairs
s_k = M_hat_k - M_k (public) and y_k^j = gbar_k^j - g_k^j (shared: gbar is the exact
update client j recomputed on M_hat_k). With S = [s_1..s_B] (m x B) and Y = [y_1..y_B]
the compact representation of Byrd, Nocedal and Schnabel (1994, Thm 2.3) gives

    H v = sigma v - [sigma S, Y] W^{-1} [sigma S^T v ; Y^T v],
    W   = [[sigma S^T S, L], [L^T, -D]],
    L   = strictly lower triangle of S^T Y,  D = diag(S^T Y),
    sigma = (y_B^T s_B) / (s_B^T s_B).

Why compact: the paper's Alg. 2 forms and inverts m x m matrices; here the only inverse
is of the 2B x 2B matrix W (SecMI on 4x4 for B = 2) and never an m x m matrix is formed.
S^T S, S^T v and products of S with anything are public-times-shared, i.e. local; the
shared-times-shared products are S^T Y-free: sigma * (m-vector) and Y z (m x B by B).

All functions are batched over leading dimensions (one row per client), so the 2PC run
does each step for all n-1 clients in the same communication rounds. A replayed round whose
estimates only enter its aggregate (no threshold check) can form sum_j w_j g_hat^j directly
(:func:`estimate_aggregate`): one m-long shared x shared product for the round, not one per
client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpc import reused_masks
from mpc.crypten_compat import crypten
from protocols import backend as B
from protocols.inverse import inverse_masked

from protocols.backend import is_shared, lmatmul, mul_mask, transpose
from protocols.sharded import is_sharded

__all__ = ["compact_hvp", "estimate_updates", "estimate_aggregate", "default_inverse", "HvpSums", "HvpCoefficients",
           "hvp_sums", "hvp_solve", "hvp_apply", "aggregate_apply", "pair_scales", "unit_scales", "PAIR_SCALE_EXPONENTS"]

Inverse = Callable[[Any], Any]


def default_inverse() -> Inverse:
    """``protocols.inverse.inverse_masked`` (plaintext: an ordinary inverse)."""
    return inverse_masked


def _placements(b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """E1 = [I; 0], E2 = [0; I] (2B x B): place B-blocks into 2B-space with matmuls only."""
    eye = torch.eye(b, dtype=dtype)
    zero = torch.zeros(b, b, dtype=dtype)
    return torch.cat([eye, zero]), torch.cat([zero, eye])


@dataclass(frozen=True)
class HvpSums:
    """The sums over coordinates that H v needs (phase 1 of :func:`compact_hvp`).

    Sums over disjoint coordinate ranges add up to the sums over their union (shares add
    locally), so a coordinate shard's sums are its part of the whole (issue 30: each worker
    pair computes its shard's, each coordinator adds its shares of them). ``sts``, ``stv``
    public; ``sty`` = S^T Y (..., B, B) and ``ytv`` = Y^T v (..., B, 1) shared or plain.
    """

    sts: torch.Tensor
    stv: torch.Tensor
    sty: Any
    ytv: Any

    def __add__(self, other: HvpSums) -> HvpSums:
        return HvpSums(self.sts + other.sts, self.stv + other.stv, self.sty + other.sty, self.ytv + other.ytv)


@dataclass(frozen=True)
class HvpCoefficients:
    """What the coordinates' products need of the small solve (phase 2 of :func:`compact_hvp`):
    sigma (..., 1, 1), sigma z1 (..., B, 1) and z2 (..., B, 1); shared or plain."""

    sigma: Any
    sigma_z1: Any
    z2: Any


def _operands(S: torch.Tensor, Y: Any, v: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """S and v in the working dtype (float32 beside shares: CrypTen encodes from it) and v as
    a column broadcast over S's leading dimensions."""
    dtype = torch.float64 if not is_shared(Y) else torch.float32
    S = S.to(dtype)
    if not is_shared(Y):
        Y = torch.as_tensor(Y).to(dtype)
    lead = tuple(S.shape[:-2])
    vcol = v.to(dtype).reshape(*(v.shape[:-1] or ()), -1, 1).expand(*lead, S.shape[-2], 1)
    return S, Y, vcol


def hvp_sums(S: torch.Tensor, Y: Any, v: torch.Tensor) -> HvpSums:
    """Phase 1: S^T S, S^T v (public), S^T Y and Y^T v (local: public x shared)."""
    S, Y, vcol = _operands(S, Y, v)
    return HvpSums(transpose(S) @ S, transpose(S) @ vcol, transpose(transpose(Y).matmul(S)),
                   transpose(Y).matmul(vcol))


#: exponents of the public pair scales 2**-e (``pair_scales``): down to 2**-16 keeps every product
#: of two scales at or above 2**-32, which ``backend.mul_public`` represents exactly; up to 2**8
#: keeps a scaled-up share's ring value small (it is truncated once, by ``mul_public``)
PAIR_SCALE_EXPONENTS = (-8, 16)


def pair_scales(sts: torch.Tensor) -> torch.Tensor:
    """Public powers of two c_k near 1 / ||s_k|| (..., B) from S^T S's diagonal (0-length pairs: 1).

    Why: a BFGS matrix is unchanged when a pair (s_k, y_k) is replaced by (c s_k, c y_k), and so
    is sigma; but W's entries are about sigma ||s||^2 and W^{-1}'s about 1 / (sigma ||s||^2), and
    under a robust rule (BRACE moves every coordinate by its full step) ||s||^2 reaches 1e5 on the
    MNIST shapes: W^{-1} then falls below the 2**-16 grid, and so does the public 1 / s_B^T s_B
    that sigma multiplies by (measured on a BRACE history: sigma off by 5%, the coefficients by up
    to 70%). With unit-length pairs every entry of the small system is of sigma's order whatever
    ||s|| is. Powers of two make the scaling of public values exact and of shares one truncation.
    """
    return unit_scales(torch.diagonal(sts.to(torch.float64), dim1=-2, dim2=-1))


def unit_scales(sq_norms: torch.Tensor) -> torch.Tensor:
    """Powers of two 2**-e near 1 / sqrt(sq_norms), e in ``PAIR_SCALE_EXPONENTS`` (0: 1)."""
    d = torch.sqrt(torch.as_tensor(sq_norms, dtype=torch.float64))
    safe = torch.where(d > 0, d, torch.ones_like(d))
    lo, hi = PAIR_SCALE_EXPONENTS
    return torch.pow(2.0, -torch.round(torch.log2(safe)).clamp(lo, hi))


def hvp_solve(sums: HvpSums, inverse: Inverse | None = None) -> HvpCoefficients:
    """Phase 2: sigma, W^{-1} and z = W^{-1} q on the 2B x 2B system (module docstring);
    independent of m, so with coordinate shards it runs once, at the coordinators.

    The system is solved for the unit-length pairs (S C, Y C), C = diag(``pair_scales``): the
    scaled W is P W P and the scaled q is P q with P = diag(C, C), so the scaled solution is
    P^{-1} z, and the coefficients of the given S and Y are C times its halves."""
    c = pair_scales(sums.sts)
    cc, cv = c.unsqueeze(-1) * c.unsqueeze(-2), c.unsqueeze(-1)
    dtype = sums.sts.dtype
    unit = HvpSums((sums.sts.to(torch.float64) * cc).to(dtype), (sums.stv.to(torch.float64) * cv).to(dtype),
                   B.mul_public(sums.sty, cc), B.mul_public(sums.ytv, cv))
    co = _solve_unit(unit, inverse)
    return HvpCoefficients(co.sigma, B.mul_public(co.sigma_z1, cv), B.mul_public(co.z2, cv))


def _solve_unit(sums: HvpSums, inverse: Inverse | None) -> HvpCoefficients:
    inverse = inverse or default_inverse()
    sts, sty = sums.sts, sums.sty
    dtype = sts.dtype
    b = sts.shape[-1]
    e1, e2 = _placements(b, dtype)
    strict_lower = torch.tril(torch.ones(b, b, dtype=dtype), diagonal=-1)
    L = mul_mask(sty, strict_lower)
    D = mul_mask(sty, torch.eye(b, dtype=dtype))
    last = torch.zeros(b, b, dtype=dtype)
    last[b - 1, b - 1] = 1.0
    # sigma = y_B^T s_B / s_B^T s_B : shared numerator over a public denominator
    ys_last = mul_mask(sty, last).sum(-1).sum(-1)            # (...,)
    ss_last = sts[..., b - 1, b - 1]
    sigma = (ys_last * (1.0 / ss_last)).unsqueeze(-1).unsqueeze(-1)   # (..., 1, 1)

    W = (lmatmul(e1, (sigma * sts).matmul(e1.T))
         + lmatmul(e1, L.matmul(e2.T))
         + lmatmul(e2, transpose(L).matmul(e1.T))
         - lmatmul(e2, D.matmul(e2.T)))                      # (..., 2B, 2B)
    w_inv = inverse(W)
    q = lmatmul(e1, sigma * sums.stv) + lmatmul(e2, sums.ytv)   # (..., 2B, 1)
    z = w_inv.matmul(q)
    # sigma z1 is B values per client: formed here, so that the m-long products below never
    # multiply two shared m-vectors (sigma (S z1) would: 16 more bytes per coordinate)
    return HvpCoefficients(sigma, sigma * lmatmul(e1.T, z), lmatmul(e2.T, z))


def hvp_apply(S: torch.Tensor, Y: Any, v: torch.Tensor, c: HvpCoefficients,
              y_masks: Sequence[Sequence[Any]] | None = None) -> Any:
    """Phase 3: H v = sigma v - S (sigma z1) - Y z2 on the coordinates at hand (a shard's)."""
    S, Y, vcol = _operands(S, Y, v)
    # Shared operands stay on the left of every operator (torch tensors do not know how to
    # combine with CrypTen tensors).
    if not is_shared(Y):
        hv = c.sigma * vcol - lmatmul(S, c.sigma_z1) - Y.matmul(c.z2)
        return hv.squeeze(-1)
    # In 2PC the three m-long products stay raw (2F fractional bits, no truncation): a
    # truncation of n x m values would cost a wrap-free protocol round and 16 bytes each, and
    # the estimate is only ever opened inside an aggregate (divided in the clear) or rescaled
    # once for the threshold check.
    b = S.shape[-1]
    two_f = 2 * B.frac_bits()
    sz1 = transpose(c.sigma_z1)                              # (..., 1, B) shared, F bits
    t1 = B.relabel(B.raw_mul(c.sigma, vcol), two_f)
    t2 = B.relabel(transpose(B.relabel(sz1, 0).matmul(B.encode_public(transpose(S)))), two_f)
    if y_masks is not None:
        rows, m = S.shape[0], S.shape[-2]
        prod = reused_masks.matvec(y_masks, B.relabel(c.z2, 0).share.reshape(rows, b))
        t3 = B.relabel(crypten.mpc.MPCTensor.from_shares(prod.reshape(rows, m, 1), precision=0), two_f)
    else:
        t3 = B.relabel(B.raw_matmul(Y, c.z2), two_f)
    hv = t1 - t2 - t3
    return hv.squeeze(-1)


def compact_hvp(S: torch.Tensor, Y: Any, v: torch.Tensor, inverse: Inverse | None = None,
                y_masks: Sequence[Sequence[Any]] | None = None) -> Any:
    """H v for the BFGS matrix defined by the pairs (S, Y); see the module docstring.

    Shapes: ``S`` (..., m, B) public, ``Y`` (..., m, B) shared or plain, ``v`` (..., m)
    or (m,) public. Returns (..., m), shared iff Y is. Columns are oldest first, so the
    last column is the most recent pair (the one sigma is taken from). ``y_masks`` (2PC,
    dealer mode; ``PairBuffers.masked_columns``): Y's columns with their Beaver masks already
    opened, one row per client (S of shape (rows, m, B)), so that Y z opens only z's mask.

    Three phases: sums over the coordinates (:func:`hvp_sums`), the small solve
    (:func:`hvp_solve`), products over the coordinates (:func:`hvp_apply`); on coordinate
    shards the first and last run per shard and the sums are added in between.
    """
    return hvp_apply(S, Y, v, hvp_solve(hvp_sums(S, Y, v), inverse), y_masks)


def estimate_updates(stored: Any, model_diff: torch.Tensor, S: torch.Tensor, Y: Any,
                     inverse: Inverse | None = None, y_masks: Sequence[Sequence[Any]] | None = None) -> Any:
    """g_hat = g + H (M_hat - M) for every client row.

    ``stored``: (n, m) the stored updates g^j of the round being replayed;
    ``model_diff``: (m,) public M_hat - M_{t-1}; ``S``, ``Y``: (n, m, B) per-client pairs;
    ``y_masks``: see ``compact_hvp``.
    """
    if is_sharded(stored):     # on coordinate shards: the three phases split (``on_shards``)
        return stored.estimate(model_diff, S, Y, inverse)
    hv = compact_hvp(S, Y, model_diff, inverse, y_masks)
    if is_shared(hv):
        return hv + B.lift(B.to_shared_like(stored), B.bits_of(hv))
    if is_shared(stored):
        return stored + hv
    return torch.as_tensor(stored).to(hv.dtype) + hv


def estimate_aggregate(stored: Any, weights: Sequence[float], model_diff: torch.Tensor, S: torch.Tensor,
                       Y: Any, inverse: Inverse | None = None) -> Any:
    """sum_j w_j g_hat^j (shared, untruncated) for a replayed round whose estimates enter only
    its aggregate (no threshold check reads them): :func:`hvp_solve`, then :func:`aggregate_apply`
    instead of :func:`hvp_apply`. Shared ``Y`` on one machine only."""
    return aggregate_apply(S, Y, model_diff, hvp_solve(hvp_sums(S, Y, model_diff), inverse), stored, weights)


def aggregate_apply(S: torch.Tensor, Y: Any, v: torch.Tensor, c: HvpCoefficients, stored: Any,
                    weights: Sequence[float]) -> Any:
    """Phase 3 folded into the round's aggregate: sum_j w_j (g^j + H^j v), shared, at 2F + e
    fractional bits (``backend.weight_integers``), without any client's m-long product.

    Why: Y z is the one shared x shared product, and per client its output is m long; the
    engine's matrix product (two-party mode) moves bytes in proportion to its output (about 65
    per coordinate and client at the MNIST shapes). The weighted sum of the n products is one
    (m x nB) @ (nB x 1) product of every client's columns with its weighted z: one m-long
    output for the round. Everything else is public x shared (local). Each term is an integer
    combination of the ring integers :func:`hvp_apply` forms, so the opened value equals
    ``reveal(weighted_sum(rows, weights))`` of its rows exactly (the same ``c``).
    """
    if not is_shared(Y) or is_sharded(Y):
        raise ValueError("aggregate_apply folds shared rows on one machine; use hvp_apply")
    S, Y, vcol = _operands(S, Y, v)
    n, m, b = (int(d) for d in Y.shape)
    f = B.frac_bits()
    ints, e = B.weight_integers(weights)
    w = torch.tensor(ints, dtype=torch.long).reshape(n, 1, 1)

    def weighted(x: Any) -> Any:    # W_j x_j per client: integers times shares, local
        return B.relabel(x, 0) * w

    sigma = B.relabel(weighted(c.sigma).sum(0), f)                          # (1, 1)
    t1 = B.raw_mul(sigma, vcol[0])                                          # (m, 1)
    sz1 = weighted(transpose(c.sigma_z1)).reshape(1, n * b)
    t2 = sz1.matmul(B.encode_public(transpose(S)).reshape(n * b, m))        # (1, m): public right
    z2 = weighted(c.z2).reshape(n * b, 1)
    t3 = B.raw_matmul(Y.permute(1, 0, 2).reshape(m, n * b), z2)             # (m, 1)
    hv = B.relabel(t1, 0) - B.relabel(transpose(t2), 0) - B.relabel(t3, 0)
    g = B.relabel(B.lift(B.to_shared_like(stored), 2 * f), 0) * w.reshape(n, 1)
    return B.relabel(hv.reshape(m) + g.sum(0), 2 * f + e)

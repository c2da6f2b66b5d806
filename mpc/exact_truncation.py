"""Exact two-party truncation: floor(x / 2**d) of a shared ring element, never wrong.

Why: CrypTen's two-party truncation divides each party's share locally. That is off by at most
one unit, but wrong by about 2**(64 - d) (e.g. 2**48 for d = 16) with probability about
|x| / 2**63 per element, because the two shares wrap around the ring. Where ring values are
large (products of wide values, long iterations) or a run does millions of truncations, that
probability is not negligible. This truncation uses the edabit machinery of the sign test
(:mod:`mpc.nonnegative`) instead and is exact for every ``|x| < 2**62``:

1. bias: x' = x + 2**62 is in [0, 2**63);
2. mask: r = r_hi 2**d + r_lo from two edabits (widths 64 - d and d), so r is uniform in the
   ring and its bits are XOR-shared in the bit-plane layout; open c = x' + r (uniform);
3. x' = c - r + w 2**64 with w = [c < r] (unsigned), so
   floor(x' / 2**d) = (c >> d) - r_hi - [c mod 2**d < r_lo] + w 2**(64 - d);
   both bits come from one prefix comparison of public c with shared r (the low one is the
   lowest segment of that circuit when d is a power of two; otherwise a second circuit);
4. the two bits become ring shares (1-bit edabits), the rest is local; subtract 2**(62 - d).

Opens c (uniform), the AND openings and the bit-conversion openings (one-time pads): nothing.
Cost per element, both directions: 16 bytes (c) + the 64-bit comparison of the sign test
(118 AND gates of 1 bit) + 2 x 2 bits (conversion). Rounds: 8 when d is a power of two (open c,
6 AND levels, one conversion round for both bits; e.g. d = 16); otherwise the comparison of the
d low bits runs after the full one, ceil(log2 d) more rounds and its AND gates (10 for d = 3,
14 for d > 32). An empty input exchanges nothing.
"""

from __future__ import annotations

import torch

from mpc import bitplanes
from mpc.crypten_compat import crypten
from mpc.nonnegative import plane_to_arith, public_less_than_shared

__all__ = ["truncate_exact", "RANGE_BITS"]

#: |x| < 2**RANGE_BITS is required (the bias must keep x' non-negative and below 2**63).
RANGE_BITS = 62


def _floor_shares(share: torch.Tensor, d: int) -> torch.Tensor:
    """This party's ring share of floor(x / 2**d) from its ring share of x (flat int64)."""
    comm = crypten.communicator.get()
    rank = comm.get_rank()
    provider = crypten.mpc.get_default_provider()
    n = share.numel()
    if n == 0:
        return share.clone()
    if hasattr(provider, "floor_share"):   # two-party mode: the engine truncates exactly
        return provider.floor_share(share, d)
    r_lo, lo_planes = provider.edabits((n,), d)
    r_hi, hi_planes = provider.edabits((n,), 64 - d)
    r = r_hi * (1 << d) + r_lo  # wraps as the ring does
    r_planes = torch.cat([lo_planes, hi_planes])
    biased = share + (1 << RANGE_BITS) if rank == 0 else share
    c = comm.all_reduce(biased + r)
    c_planes = bitplanes.to_planes(c)
    width = min(n, 64)
    level = d.bit_length() - 1
    if d == 1 << level:
        wrap, below = public_less_than_shared(c_planes, r_planes, rank, width, low_level=level)
    else:
        wrap = public_less_than_shared(c_planes, r_planes, rank, width)
        below = public_less_than_shared(c_planes[:d], r_planes[:d], rank, width)
    # both planes converted in one round, side by side (each padded to whole words)
    per = bitplanes.words(n) * 64
    bits = plane_to_arith(torch.cat([wrap, below]), 2 * per, width)
    w_arith, b_arith = bits[:n], bits[per: per + n]
    out = -r_hi - b_arith + w_arith * (1 << (64 - d))
    if rank == 0:
        c_hi = (c >> d) & ((1 << (64 - d)) - 1)  # logical shift of the unsigned c
        out = out + c_hi - (1 << (RANGE_BITS - d))
    return out


def truncate_exact(x, d: int):
    """floor(x_ring / 2**d) for a shared CrypTen tensor, exactly; the result keeps x's encoder.

    ``x`` must hold ring values with ``|x_ring| < 2**62``; ``1 <= d <= 62``.
    """
    if not 1 <= d <= RANGE_BITS:
        raise ValueError(f"truncation by d bits needs 1 <= d <= {RANGE_BITS}, got {d}")
    share = x.share
    out = _floor_shares(share.reshape(-1), d).reshape(share.shape)
    res = crypten.mpc.MPCTensor.from_shares(out, precision=0)
    res.encoder = x.encoder
    return res

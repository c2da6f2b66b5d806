"""Two-party truncation that never wraps: x / 2**d to within one unit, in one round.

Why: CrypTen divides each party's share locally. With x = s0 + s1 and s0 uniform the shares
cross the ring boundary with probability (|x| + 1) / 2**64, and the result is then wrong by
about 2**(64 - d); ``starfish bench truncation`` counts how often a Stage II risks that (far
above 2**-40 per run). Here the dealer supplies a *truncation pair*: shares of a uniform r, of
r >> d (logical) and of msb(r). With the bias x' = x + 2**62 (in [0, 2**63) for |x| < 2**62):

1. open c = x' + r (uniform: it reveals nothing);
2. x' = c - r + w 2**64 where the wrap is w = msb(r) AND NOT msb(c): since x' < 2**63, the sum
   can only overflow when r's top bit is set, and then exactly when c's top bit is clear. c is
   public, so w's share is msb(r)'s share times a public 0/1: local;
3. x' >> d = (c >> d) - (r >> d) + w 2**(64 - d) - [c mod 2**d < r mod 2**d]; the last term is
   dropped, so the result is floor(x / 2**d) or one more (probabilistic rounding, like CrypTen's
   local truncation's error of one unit, but never the 2**(64 - d) error).

Cost per element: 8 bytes each way online, one round; offline 16 bytes to party 1 (party 0
derives its shares from its seed). In two-party mode the servers make the pairs themselves
(``mpc.two_party_provider``: three sign tests a pair in the engine, in batches); truncations by
per-element exponents run in the engine there. Requires |x_ring| < 2**62 and 1 <= d <= 62. Opens c only.
``mpc.session.open_party(truncation="wrapfree")`` (the default) makes every two-party truncation
of CrypTen (``div`` by a power of two, which every fixed-point multiplication ends with) use it;
other integer divisors take three of them (``mpc.public_division``).
"""

from __future__ import annotations

from typing import Any

import torch

from .crypten_compat import crypten

__all__ = ["truncate", "truncate_share", "RANGE_BITS"]

RANGE_BITS = 62


#: per-element divisors (a public tensor of exponents) get pairs for every d in this range, so
#: the dealer request does not depend on the data (plans recorded in one run fit the next)
FULL_RANGE = (1, RANGE_BITS)


def truncate_share(share: torch.Tensor, d: Any) -> torch.Tensor:
    """This party's share of x / 2**d (within one unit) from its share of x (any shape).

    ``d``: an int in 1..62, or a public int64 tensor of exponents (broadcast to the share) with
    values in 0..62 (0: unchanged).
    """
    if share.numel() == 0:
        return share.clone()
    if share.dim() == 0:   # the dealer's pairs come as shape (1,): keep a 0-d share 0-d
        return truncate_share(share.reshape(1), d).reshape(())
    per_element = torch.is_tensor(d) and d.dim() > 0
    if per_element:
        exps = d.expand(share.shape).to(torch.long)
        lo, hi = FULL_RANGE
        if bool((exps < 0).any()) or bool((exps > hi).any()):
            raise ValueError(f"truncation exponents must be in 0..{hi}")
    else:
        d = int(d)
        if not 1 <= d <= RANGE_BITS:
            raise ValueError(f"truncation by d bits needs 1 <= d <= {RANGE_BITS}, got {d}")
        lo = hi = d
    provider = crypten.mpc.get_default_provider()
    if per_element and hasattr(provider, "floor_share"):   # two-party mode: the engine truncates
        return provider.truncate_share(share, exps)
    comm = crypten.communicator.get()
    rank = comm.get_rank()
    r, top, highs = provider.trunc_pairs(tuple(share.shape), lo, hi)
    biased = share + (1 << RANGE_BITS) if rank == 0 else share
    c = comm.all_reduce(biased + r)
    c_top_clear = 1 - ((c >> 63) & 1)
    if not per_element:
        high = highs[0]
        out = -high + (top * c_top_clear) * (1 << (64 - d))
        if rank == 0:
            out = out + ((c >> d) & ((1 << (64 - d)) - 1)) - (1 << (RANGE_BITS - d))
        return out
    keep = exps == 0
    idx = (exps - lo).clamp(min=0)
    high = torch.gather(highs, 0, idx.unsqueeze(0)).squeeze(0)
    safe = torch.where(keep, torch.ones_like(exps), exps)
    wrap_unit = torch.bitwise_left_shift(torch.ones_like(exps), 64 - safe)
    out = -high + (top * c_top_clear) * wrap_unit
    if rank == 0:
        mask = torch.bitwise_left_shift(torch.ones_like(exps), 64 - safe) - 1
        bias = torch.bitwise_left_shift(torch.ones_like(exps), RANGE_BITS - safe)
        out = out + (torch.bitwise_right_shift(c, safe) & mask) - bias
    return torch.where(keep, share, out)


def truncate(x, d: int):
    """x / 2**d (ring integers, within one unit) for a shared CrypTen tensor; keeps x's encoder."""
    res = crypten.mpc.MPCTensor.from_shares(truncate_share(x.share, d), precision=0)
    res.encoder = x.encoder
    return res

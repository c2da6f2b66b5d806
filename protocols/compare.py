"""Secure comparison (SecGE), division-free ratio comparison (SecGE2), selection (SecSel).

All functions accept plaintext torch tensors (the plaintext twin) or CrypTen MPCTensors, and
broadcast over leading dimensions. Costs are for the 2PC path with CrypTen's protocols:

* ``ge``: one sign test of ``x - y`` per element (:mod:`mpc.nonnegative`): open the
  difference masked by a dealer edabit, compare the public mask-sum with the shared mask bit
  by bit (6 AND rounds on bit planes), one-bit binary-to-arithmetic conversion: 8 rounds and
  75.25 bytes per element, all elements of a call sharing the rounds. Reveals nothing; the
  result is a shared bit.
* ``ge_ratio``: one Beaver multiplication round (both cross products batched, untruncated)
  plus one ``ge``. Reveals nothing.
* ``select``: one Beaver multiplication round when the condition is shared; local otherwise.
* ``compare_exchange``: one Beaver multiplication round for any number of tensors.

Range (2PC): ``ge`` compares ``x - y`` by its sign in the 64-bit ring, so ``|x - y|`` must be
below ``2**(63-F) = 2**47`` (F = 16 fractional bits). ``ge_ratio`` compares the untruncated
cross products ``u1_enc * v2_enc`` (ring scale ``2**(2F)``), so ``|u1 * v2|`` and ``|u2 * v1|``
must stay below ``2**30`` (and below ``2**30 / N`` inside a tie-broken sort of N padded
entries, see :mod:`protocols.sort`). Because nothing is truncated, ties are exact: two pairs
whose fixed-point encodings have equal ratios compare equal in 2PC and in the plaintext twin.
Precision is the encoding's: values closer than ``2**-16`` are indistinguishable in 2PC, and
tiny ``v`` (a few units of ``2**-16``) make ratio comparisons coarse; rescale inputs by a public
factor (ratios are invariant when all ``u`` and all ``v`` are scaled) to use the range.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import backend as B
from .backend import Tensor
from mpc.nonnegative import nonnegative

__all__ = [
    "ge",
    "ge_ratio",
    "select",
    "compare_exchange",
    "lex_ge",
    "lex_ge_ratio",
]


def ge(x: Tensor, y: Tensor) -> Tensor:
    """SecGE: 1 where ``x >= y`` else 0 (shared bit if any input is shared).

    2PC: the sign test of ``x - y`` (:mod:`mpc.nonnegative`: 75.25 bytes and 8 rounds
    per element, against 432 bytes for CrypTen's ``>=``). The shared bit is encoded at
    scale 1 like CrypTen's own comparison results, so it
    multiplies shared fixed-point values exactly; use :func:`select` (or
    :func:`protocols.backend.bit_to_fixed`) to combine it with public reals.
    Plaintext twin: a tensor of 0./1. in the promoted floating dtype of the inputs.
    """
    if B.is_shared(x):
        return nonnegative(x - y)
    if B.is_shared(y):
        return nonnegative(-y + x)
    x = torch.as_tensor(x)
    y = torch.as_tensor(y)
    return (x >= y).to(B.float_dtype(x, y))


def _times_public_bit(x: Tensor, bit: Tensor) -> Tensor:
    """Shared ``x`` times a public 0/1 (any nonzero read as 1), exactly and locally.

    The ring integers are multiplied by the integer bit at scale 1: CrypTen's ``x * float``
    would encode the bit at scale ``2**F`` and truncate the product (a round with wrap-free
    truncation, and wrong once ``|x| * 2**F`` leaves the truncation's range, i.e. from
    ``|x| >= 2**30`` on).
    """
    b = (torch.as_tensor(bit) != 0).to(torch.long)
    return B.relabel(B.relabel(x, 0) * b, B.bits_of(x))


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Veltkamp split of float64 ``a`` into 26-bit halves, ``hi + lo == a`` exactly."""
    c = 134217729.0 * a  # 2**27 + 1
    hi = c - (c - a)
    return hi, a - hi


def _two_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dekker's product: ``p = fl(a * b)`` and its rounding error ``e``, ``p + e == a * b``
    exactly (float64, barring overflow above ~2**996 and underflow below ~2**-969)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = al * bl - (((p - ah * bh) - al * bh) - ah * bl)
    return p, e


def _twin_cross_order(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plaintext twin: ``(u1*v2 > u2*v1, u1*v2 == u2*v1)`` decided on the exact products.

    A float64 product keeps 53 bits, fixed-point cross products up to 62 (``|u v| < 2**30`` at
    32 fractional bits): near-ties would round into ties. With the exact ``p + e``
    representation, ``fl`` is monotone (``p1 > p2`` implies ``u1 v2 > u2 v1``) and equal ``p``
    leave the exact errors to decide.
    """
    f = [torch.as_tensor(t, dtype=torch.float64) for t in (u1, v1, u2, v2)]
    p, e = _two_product(f[0], f[3])
    q, g = _two_product(f[2], f[1])
    return (p > q) | ((p == q) & (e > g)), (p == q) & (e == g)


def _public_raw(x: Tensor, y: Tensor) -> Tensor:
    """A public sharing (no communication) of the raw ring product ``x_enc * y_enc`` of two
    public factors (round-to-nearest encodings, as for a public factor in :func:`B.raw_mul`)."""
    ring = B.encode_public(x) * B.encode_public(y)  # exact in int64 inside the documented range
    zero = B.relabel(B.share_public(torch.zeros(ring.shape, dtype=torch.float64)), 0)
    return B.relabel(zero + ring, B.frac_bits())


def _rank_ring(t: Tensor) -> Tensor:
    """Tie ranks as ring integers at scale 1: a sharing (its ring integers are the ranks, as
    :mod:`protocols.sort` makes them), public integers as they are, public floats as their
    fixed-point encodings (``rank * 2**-F`` encodes to ``rank``)."""
    if B.is_shared(t):
        return B.relabel(t, 0)
    t = torch.as_tensor(t)
    return B.encode_public(t) if t.is_floating_point() else t.to(torch.long)


def _lex_key(x: Tensor, t: Tensor, n_tie: int) -> Tensor:
    """Ring integers ``x_ring * n_tie + rank`` at scale 1, exact and local (a python int
    multiplies CrypTen shares without encoding or truncation)."""
    return B.relabel(x, 0) * int(n_tie) + _rank_ring(t)


def _cross_products(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
    """Untruncated sharings of ``u1*v2`` and ``u2*v1`` (ring ``x_enc * y_enc``), for at least one
    shared factor; batched into one Beaver round when both products are shared x shared.

    Public factors are encoded round-to-nearest (:func:`B.raw_mul`). A product of two public
    factors next to shared ones becomes a public sharing of its exact ring product (no
    communication), so that the comparison never mixes a raw ring product with a real one.
    """
    shape = torch.broadcast_shapes(*(tuple(t.shape) for t in (u1, v1, u2, v2)))
    lhs = [u1, u2]
    rhs = [v2, v1]
    if all(B.is_shared(t) for t in lhs + rhs):
        a = B.stack([t.expand(shape) if tuple(t.shape) != shape else t for t in lhs])
        b = B.stack([t.expand(shape) if tuple(t.shape) != shape else t for t in rhs])
        p = B.raw_mul(a, b)
        return p[0], p[1]
    # Some factor is public: those products are local, so separate calls cost no extra round
    # unless both are shared x shared, which only happens in the branch above.
    p = B.raw_mul(u1, v2) if B.any_shared(u1, v2) else _public_raw(u1, v2)
    q = B.raw_mul(u2, v1) if B.any_shared(u2, v1) else _public_raw(u2, v1)
    return p, q


def ge_ratio(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor) -> Tensor:
    """SecGE2 (method 1 of the paper): 1 iff ``u1/v1 >= u2/v2``, for ``v1, v2 > 0``.

    Computed division-free as ``ge(u1*v2, u2*v1)`` on untruncated products (exact on the
    fixed-point encodings). Rounds: one multiplication + one comparison. Reveals nothing.
    Valid range: ``|u1 v2|, |u2 v1| < 2**30``; the sign of ``v`` is not checked (``v <= 0``
    flips or voids the order, as in the paper).
    """
    if not B.any_shared(u1, v1, u2, v2):
        greater, equal = _twin_cross_order(u1, v1, u2, v2)
        return (greater | equal).to(B.float_dtype(u1, v1, u2, v2))
    p, q = _cross_products(u1, v1, u2, v2)
    return ge(p, q)


def lex_ge(a: Tensor, b: Tensor, ta: Tensor, tb: Tensor, n_tie: int) -> Tensor:
    """Tie-broken ``a >= b``: equal keys are ordered by their tie rank ``t`` (larger wins).

    Ranks are integers in ``[0, n_tie)``: shared tensors whose *ring integers* are the ranks
    (as :mod:`protocols.sort` makes them), public integer tensors, or public floats
    ``rank * 2**-F`` (whose encodings are the ranks; the twin compares them as they are).
    Plaintext: exact comparison of (a, ta) vs (b, tb). 2PC: one comparison of
    ``a_enc*n_tie + ta`` vs ``b_enc*n_tie + tb``, formed exactly on the ring integers
    (requires ``|a|, |b| < 2**46 / n_tie``); no round besides the comparison.
    """
    if not B.any_shared(a, b, ta, tb):
        a = torch.as_tensor(a)
        b = torch.as_tensor(b)
        ta = torch.as_tensor(ta)
        tb = torch.as_tensor(tb)
        return ((a > b) | ((a == b) & (ta >= tb))).to(B.float_dtype(a, b))
    a = B.to_shared_like(a)
    b = B.to_shared_like(b)
    return ge(_lex_key(a, ta, n_tie), _lex_key(b, tb, n_tie))


def lex_ge_ratio(a: Sequence[Tensor], b: Sequence[Tensor], ta: Tensor, tb: Tensor,
                 n_tie: int) -> Tensor:
    """Tie-broken SecGE2 on ``(u, v)`` pairs: ``(u1 v2, ta) >= (u2 v1, tb)`` lexicographically.

    Ranks as in :func:`lex_ge`. Plaintext: exact on the float inputs. 2PC: one comparison of
    ``u1_enc*v2_enc*n_tie + ta`` vs ``u2_enc*v1_enc*n_tie + tb`` (the ranks sit below the
    lowest unit of the untruncated products, so no extra round); range
    ``|u1 v2|, |u2 v1| < 2**30 / n_tie``, ``v > 0``. Same cost as :func:`ge_ratio`.
    """
    u1, v1, u2, v2 = a[0], a[1], b[0], b[1]
    if not B.any_shared(u1, v1, u2, v2):
        if not B.any_shared(ta, tb):
            greater, equal = _twin_cross_order(u1, v1, u2, v2)
            rank_wins = torch.as_tensor(ta) >= torch.as_tensor(tb)
            return (greater | (equal & rank_wins)).to(torch.float64)
        p, q = _public_raw(u1, v2), _public_raw(u2, v1)  # public keys, shared ranks
    else:
        p, q = _cross_products(u1, v1, u2, v2)
    return ge(_lex_key(p, ta, n_tie), _lex_key(q, tb, n_tie))


def select(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """SecSel: ``cond * a + (1 - cond) * b`` for a 0/1 ``cond``.

    Computed as ``b + cond * (a - b)``: one Beaver multiplication if ``cond`` and ``a - b`` are
    both shared, local otherwise. Reveals nothing. Plaintext twin:
    ``torch.where(cond != 0, a, b)``.

    Exact (the result is the selected input's encoding, nothing truncated) for ``|a|, |b|,
    |a - b| < 2**47`` when ``cond`` is public (any nonzero counts as 1, as in the twin) or a
    shared bit at scale 1 (what :func:`ge` returns). Public ``a`` and ``b`` are encoded
    round-to-nearest then (shared ones carry CrypTen's truncated encoding). A shared
    *fixed-point* 0/1 (scale ``2**F``) is multiplied and truncated once: exact only while
    ``|a - b| < 2**30``; turn it into a bit first for the full range.
    """
    if not B.any_shared(cond, a, b):
        cond = torch.as_tensor(cond)
        a = torch.as_tensor(a)
        b = torch.as_tensor(b)
        return torch.where(cond != 0, a, b)
    if B.is_shared(cond) and cond.encoder.scale == 1 and not B.any_shared(a, b):
        # bit times the integer encodings: exact and local (a float64 difference a - b would
        # round once |a - b| >= 2**37)
        ea, eb = B.encode_public(a), B.encode_public(b)
        return B.relabel(cond * (ea - eb) + eb, B.frac_bits())
    # Keep the shared operand on the left: CrypTen overloads only its own operators.
    diff = a - b if B.is_shared(a) else (-b) + a
    if B.is_shared(cond):
        if not B.is_shared(diff):
            prod = cond * torch.as_tensor(diff, dtype=torch.float64)  # fixed-point cond: truncates
        else:
            prod = diff * cond
    else:
        prod = _times_public_bit(diff, cond)
    return prod + b


def compare_exchange(swap: Tensor, a: Sequence[Tensor], b: Sequence[Tensor]
                     ) -> tuple[list, list]:
    """Conditionally swap the tensors of ``a`` with those of ``b`` where ``swap`` is 1.

    ``a[c]`` and ``b[c]`` have the shape of ``swap``. Returns ``(new_a, new_b)`` with
    ``new_a = a + swap*(b - a)`` and ``new_b = b - swap*(b - a)``. With a shared ``swap`` all
    differences are stacked into a single Beaver multiplication (one round, however many
    tensors follow the keys). With a public ``swap`` (plaintext keys) it is local. Components
    that are public while ``swap`` is shared become shared. Reveals nothing.

    Exact for ``|a|, |b|, |a - b| < 2**47`` when ``swap`` is public (nonzero counts as 1) or a
    shared bit at scale 1 (what :func:`ge` returns); a shared fixed-point 0/1 is truncated once
    (exact only while ``|a - b| < 2**30``), as in :func:`select`.
    """
    if not B.is_shared(swap):
        sw = torch.as_tensor(swap) != 0
        new_a, new_b = [], []
        for x, y in zip(a, b):
            if B.any_shared(x, y):
                x = B.to_shared_like(x)
                y = B.to_shared_like(y)
                d = _times_public_bit(y - x, sw)
                new_a.append(x + d)
                new_b.append(y - d)
            else:
                new_a.append(torch.where(sw, y, x))
                new_b.append(torch.where(sw, x, y))
        return new_a, new_b
    xs = [B.to_shared_like(x) for x in a]
    ys = [B.to_shared_like(y) for y in b]
    diffs = B.stack([y - x for x, y in zip(xs, ys)])
    # Broadcasting the bit over the stacked components: its masked opening is sent once.
    d = diffs * swap
    new_a = [x + d[i] for i, x in enumerate(xs)]
    new_b = [y - d[i] for i, y in enumerate(ys)]
    return new_a, new_b

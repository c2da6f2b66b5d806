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


def _cross_products(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
    """Untruncated ``u1*v2`` and ``u2*v1``, batched into one Beaver round when possible.

    Both come back in the same representation: plain float64 products when every factor is
    public, otherwise two raw sharings (ring ``x_enc * y_enc``). A product of two public
    factors next to a shared one is made a sharing too (a public sharing of the first factor,
    no communication), so that the comparison never mixes a raw ring product with a real one.
    """
    if not B.any_shared(u1, v1, u2, v2):
        return B.raw_mul(u1, v2), B.raw_mul(u2, v1)
    if not B.any_shared(u1, v2):
        u1 = B.share_public(u1)
    if not B.any_shared(u2, v1):
        u2 = B.share_public(u2)
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
    return B.raw_mul(u1, v2), B.raw_mul(u2, v1)


def ge_ratio(u1: Tensor, v1: Tensor, u2: Tensor, v2: Tensor) -> Tensor:
    """SecGE2 (method 1 of the paper): 1 iff ``u1/v1 >= u2/v2``, for ``v1, v2 > 0``.

    Computed division-free as ``ge(u1*v2, u2*v1)`` on untruncated products (exact on the
    fixed-point encodings). Rounds: one multiplication + one comparison. Reveals nothing.
    Valid range: ``|u1 v2|, |u2 v1| < 2**30``; the sign of ``v`` is not checked (``v <= 0``
    flips or voids the order, as in the paper).
    """
    p, q = _cross_products(u1, v1, u2, v2)
    if not B.any_shared(p, q):
        return (p >= q).to(B.float_dtype(u1, v1, u2, v2))
    return ge(p, q)


def _lex_from_raw(p: Tensor, q: Tensor, ta: Tensor, tb: Tensor, n_tie: int) -> Tensor:
    """``(p, ta) >= (q, tb)`` lexicographically; p, q raw ring integers, t in [0, n_tie).

    2PC: one comparison of ``p*n_tie + ta`` against ``q*n_tie + tb``; the tie ranks sit
    below the lowest unit of p, so the comparison is exact and needs no extra round.
    ``ta``/``tb`` are shared tensors whose *ring integers* are the ranks (see sort.py).
    """
    if not B.any_shared(p, q, ta, tb):
        ta = torch.as_tensor(ta)
        tb = torch.as_tensor(tb)
        res = (p > q) | ((p == q) & (ta >= tb))
        return res.to(torch.float64)
    # Public products with shared ranks (public keys, shared payload path): the plaintext
    # twin holds the real product, whose raw ring integer is product * 2**(2F).
    if not B.is_shared(p):
        p = B.share_public(p * B.scale())
    if not B.is_shared(q):
        q = B.share_public(q * B.scale())
    return ge(p * n_tie + ta, q * n_tie + tb)


def lex_ge(a: Tensor, b: Tensor, ta: Tensor, tb: Tensor, n_tie: int) -> Tensor:
    """Tie-broken ``a >= b``: equal keys are ordered by their tie rank ``t`` (larger wins).

    Plaintext: exact comparison of (a, ta) vs (b, tb). 2PC: one comparison of
    ``a_enc*n_tie + ta`` vs ``b_enc*n_tie + tb`` (requires ``|a|, |b| < 2**46 / n_tie``).
    """
    if not B.any_shared(a, b, ta, tb):
        a = torch.as_tensor(a)
        b = torch.as_tensor(b)
        ta = torch.as_tensor(ta)
        tb = torch.as_tensor(tb)
        return ((a > b) | ((a == b) & (ta >= tb))).to(B.float_dtype(a, b))
    a = B.to_shared_like(a)
    b = B.to_shared_like(b)
    return ge(a * n_tie + ta, b * n_tie + tb)


def lex_ge_ratio(a: Sequence[Tensor], b: Sequence[Tensor], ta: Tensor, tb: Tensor,
                 n_tie: int) -> Tensor:
    """Tie-broken SecGE2 on ``(u, v)`` pairs; same cost as :func:`ge_ratio`."""
    p, q = _cross_products(a[0], a[1], b[0], b[1])
    return _lex_from_raw(p, q, ta, tb, n_tie)


def select(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """SecSel: ``cond * a + (1 - cond) * b`` for a 0/1 ``cond``.

    Computed as ``b + cond * (a - b)``: one Beaver multiplication if ``cond`` and ``a - b`` are
    both shared, local otherwise. A shared bit is exact (scale 1), so no truncation error.
    Reveals nothing. Plaintext twin: ``torch.where(cond != 0, a, b)``.
    """
    if not B.any_shared(cond, a, b):
        cond = torch.as_tensor(cond)
        a = torch.as_tensor(a)
        b = torch.as_tensor(b)
        return torch.where(cond != 0, a, b)
    # Keep the shared operand on the left: CrypTen overloads only its own operators.
    diff = a - b if B.is_shared(a) else (-b) + a
    if B.is_shared(cond):
        if not B.is_shared(diff):
            if cond.encoder.scale == 1:
                # bit times the integer encoding of diff: exact, no truncation
                prod = B.relabel(cond * B.encode_public(diff), B.frac_bits())
            else:
                prod = cond * torch.as_tensor(diff, dtype=torch.float64)
        else:
            prod = diff * cond
    else:
        prod = diff * torch.as_tensor(cond, dtype=torch.float64)
    return prod + b


def compare_exchange(swap: Tensor, a: Sequence[Tensor], b: Sequence[Tensor]
                     ) -> tuple[list, list]:
    """Conditionally swap the tensors of ``a`` with those of ``b`` where ``swap`` is 1.

    ``a[c]`` and ``b[c]`` have the shape of ``swap``. Returns ``(new_a, new_b)`` with
    ``new_a = a + swap*(b - a)`` and ``new_b = b - swap*(b - a)``. With a shared ``swap`` all
    differences are stacked into a single Beaver multiplication (one round, however many
    tensors follow the keys). With a public ``swap`` (plaintext keys) it is local. Components
    that are public while ``swap`` is shared become shared. Reveals nothing.
    """
    if not B.is_shared(swap):
        sw = torch.as_tensor(swap) != 0
        new_a, new_b = [], []
        for x, y in zip(a, b):
            if B.any_shared(x, y):
                x = B.to_shared_like(x)
                y = B.to_shared_like(y)
                d = (y - x) * sw.to(torch.float64)
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

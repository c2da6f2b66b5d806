"""Bit-plane layout of int64 vectors: bit ``i`` of 64 consecutive elements in one word.

Binary (XOR) sharings of many bits are cheapest to compute on and to send when they are
*packed across elements*: plane ``i`` holds bit ``i`` of every element, 64 elements per
int64 word, so a Beaver AND on a word does 64 useful gates (CrypTen's binary circuits keep
one element per word and use 1 bit of many of their words). ``to_planes``/``from_planes``
convert between the element layout ``(n,)`` and the plane layout ``(bits, words(n))``.

Both directions are the same 64 x 64 bit-matrix transpose per block of 64 elements, done
by the recursive block swap (six masked shift/XOR passes, Hacker's Delight 7-3) on all
blocks at once. XOR-linear, so applying it to each party's share of a binary sharing
transposes the shared value without communication. Used by the dealer (``correlations``)
and by ``mpc.nonnegative``.
"""

from __future__ import annotations

import torch

__all__ = ["words", "to_planes", "from_planes", "transpose_blocks"]

_BLOCK = 64
# For a swap distance j: 1-bits at the low j positions of every 2j-bit group. The top j
# bits are always 0, so an arithmetic (sign-extending) right shift followed by the mask
# behaves like a logical one.
_MASKS = {
    32: 0x00000000FFFFFFFF,
    16: 0x0000FFFF0000FFFF,
    8: 0x00FF00FF00FF00FF,
    4: 0x0F0F0F0F0F0F0F0F,
    2: 0x3333333333333333,
    1: 0x5555555555555555,
}


def words(n: int) -> int:
    """Words per plane for ``n`` elements."""
    return (int(n) + _BLOCK - 1) // _BLOCK


def transpose_blocks(a: torch.Tensor) -> torch.Tensor:
    """Transpose every 64 x 64 bit matrix of ``a`` (shape (blocks, 64), int64), in place.

    Row ``r`` bit ``b`` becomes row ``b`` bit ``r``. Returns ``a``.
    """
    if a.dtype != torch.int64 or a.dim() != 2 or a.shape[1] != _BLOCK:
        raise ValueError("transpose_blocks needs an int64 tensor of shape (blocks, 64)")
    blocks = a.shape[0]
    for j in (32, 16, 8, 4, 2, 1):
        v = a.view(blocks, _BLOCK // (2 * j), 2, j)
        top, bottom = v[:, :, 0, :], v[:, :, 1, :]
        # swap the high j bits of row k with the low j bits of row k + j (every 2j-bit group)
        t = (top >> j).bitwise_xor_(bottom).bitwise_and_(_MASKS[j])
        bottom.bitwise_xor_(t)
        top.bitwise_xor_(t << j)
    return a


def to_planes(x: torch.Tensor, bits: int = 64) -> torch.Tensor:
    """``(bits, words(n))`` int64: word ``w`` of plane ``i`` has bit ``i`` of element
    ``64 w + j`` at bit ``j``. ``x`` is flattened; padding elements are 0."""
    if not 1 <= bits <= _BLOCK:
        raise ValueError("bits must be in 1..64")
    flat = x.reshape(-1).to(torch.int64)
    n = flat.numel()
    w = words(n)
    a = torch.zeros(w * _BLOCK, dtype=torch.int64)
    a[:n] = flat
    a = transpose_blocks(a.view(w, _BLOCK))
    return a.t()[:bits].contiguous()


def from_planes(planes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``to_planes``: ``(n,)`` int64 whose bit ``i`` comes from plane ``i``
    (bits above ``planes.shape[0]`` are 0)."""
    bits, w = planes.shape
    if not 1 <= bits <= _BLOCK or w != words(n):
        raise ValueError(f"planes of shape {tuple(planes.shape)} do not hold {n} elements")
    a = torch.zeros(w, _BLOCK, dtype=torch.int64)
    a[:, :bits] = planes.t()
    return transpose_blocks(a).reshape(-1)[:n].clone()

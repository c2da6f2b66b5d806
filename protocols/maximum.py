"""SecMax: maximum along a dimension by pairwise tree reduction.

Rounds (2PC): ``ceil(log2 n)`` levels, each one CrypTen comparison (all pairs of all rows in one
call) plus one Beaver multiplication for the selection; ``n - 1`` comparisons per row in total.
An odd element at a level is carried up unchanged, so any ``n >= 1`` works. Reveals nothing;
the result is a sharing of the maximum (exact: the selection bits are not truncated). Range:
any two values must differ by less than ``2**47`` (see :func:`protocols.compare.ge`).

The plaintext twin is ``torch.amax`` (the maximum is exact in both; no ties issue arises
because equal values are the same value).
"""

from __future__ import annotations

import torch

from . import backend as B
from .backend import Tensor
from .compare import ge, select

__all__ = ["max"]


def max(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:  # noqa: A001 (API name)
    """Maximum of ``x`` along ``dim`` (SecMax), batched over all other dimensions."""
    if not B.is_shared(x):
        return torch.amax(torch.as_tensor(x), dim=dim, keepdim=keepdim)
    n = x.shape[dim]
    if n == 0:
        raise ValueError("max of an empty dimension")
    d = dim if dim >= 0 else x.dim() + dim
    if d != x.dim() - 1:
        cur = x.permute(*[i for i in range(x.dim()) if i != d], d)
    else:
        cur = x
    while cur.shape[-1] > 1:
        m = cur.shape[-1]
        half = m // 2
        left = cur[..., 0:2 * half:2]
        right = cur[..., 1:2 * half:2]
        best = select(ge(left, right), left, right)
        cur = B.cat([best, cur[..., m - 1:m]], dim=-1) if m % 2 else best
    out = cur.squeeze(-1)
    if keepdim:
        out = out.unsqueeze(d)
    return out

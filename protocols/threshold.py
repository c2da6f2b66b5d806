"""Core of SecTC: does any coordinate of a row reach its threshold?

For each row ``r`` (last dimension = coordinates) ``any_exceeds`` answers
``exists k: x[r, k]**2 >= d[r]**2``, i.e. ``|x| >= |d|`` without square roots, and opens only
that one bit per row.

2PC steps: one square-tuple round squaring ``x`` and ``d`` together (untruncated, so the test
is exact on the fixed-point encodings: ``x_enc**2 >= d_enc**2``), one comparison round for all
coordinate flags, a local sum of the flags per row, one comparison ``sum >= 1`` per row, and one
opening of those per-row bits. Two comparison rounds, as the paper's SecTC. Reveals exactly the
per-row OR (the correction flag of Algorithm 3); never the coordinate flags, their count, or
the magnitudes. Range: ``|x|, |d| < 2**15`` (the squares and their difference must fit the
ring untruncated) and fewer than ``2**62`` coordinates per row.
"""

from __future__ import annotations

import torch

from . import backend as B
from .backend import Tensor
from .compare import ge

__all__ = ["any_exceeds", "exceed_counts", "exceed_counts_blocked", "flags_from_counts"]


def any_exceeds(x: Tensor, d: Tensor) -> torch.Tensor:
    """Public bool tensor of shape ``x.shape[:-1]``: whether any ``x[..., k]**2 >= d**2``.

    ``d`` has shape ``x.shape[:-1]`` (one threshold per row) or broadcasts to it.
    """
    if not B.any_shared(x, d):
        x = torch.as_tensor(x, dtype=torch.float64)
        d = torch.as_tensor(d, dtype=torch.float64)
        return (x * x >= (d * d).unsqueeze(-1)).any(dim=-1)
    return flags_from_counts(exceed_counts(x, d))


def exceed_counts(x: Tensor, d: Tensor) -> Tensor:
    """Shares of the number of coordinates of each row with ``x**2 >= d**2`` (2PC; nothing
    opened): the part of :func:`any_exceeds` that adds over coordinate shards (issue 30: each
    worker pair counts its shard's, each coordinator adds its shares of the counts).
    ``d``: one shared or public threshold per row, the shape of ``x.shape[:-1]``. Plaintext:
    the counts themselves."""
    if not B.any_shared(x, d):
        x = torch.as_tensor(x, dtype=torch.float64)
        d = torch.as_tensor(d, dtype=torch.float64)
        return (x * x >= (d * d).unsqueeze(-1)).sum(dim=-1)
    if not B.is_shared(d):
        d = torch.as_tensor(d, dtype=torch.float64)
    rows = tuple(x.shape[:-1])
    if tuple(d.shape) != rows:
        d = d.expand(rows) if B.is_shared(d) else torch.as_tensor(d).expand(rows)
    # A public side is shared for free (no communication) so that x and d are squared in
    # the same round: d rides along as an extra coordinate of each row.
    sq = B.raw_square(B.cat([B.to_shared_like(x), B.to_shared_like(d).unsqueeze(-1)], dim=-1))
    x2 = sq[..., :-1]
    d2 = sq[..., -1:]
    return ge(x2, d2).sum(-1)


def exceed_counts_blocked(x: Tensor, d: Tensor, elements: int) -> Tensor:
    """:func:`exceed_counts` over blocks of columns of at most ``elements`` values in all (the
    counts add): a comparison's temporaries are tens of ring elements per value, so a worker's
    peak memory follows the block, not its whole shard. One block: :func:`exceed_counts`."""
    rows = max(1, int(x.shape[0])) if len(x.shape) > 1 else 1
    cols = int(x.shape[-1])
    step = max(1, elements // rows)
    if step >= cols:
        return exceed_counts(x, d)
    total = None
    for lo in range(0, cols, step):
        part = exceed_counts(x[..., lo:lo + step], d)
        total = part if total is None else total + part
    return total


def flags_from_counts(count: Tensor) -> torch.Tensor:
    """The per-row OR from (summed) :func:`exceed_counts`: one comparison, one opened bit per row."""
    if not B.is_shared(count):
        return torch.as_tensor(count) >= 1
    return B.reveal(ge(count, 1)).to(torch.bool)

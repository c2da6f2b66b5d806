"""Small helpers for the Starfish sub-protocols on top of :mod:`protocols.backend`.

Why: a few spellings differ between torch tensors and CrypTen tensors. Stacking,
revealing and the "is it shared?" test come from ``protocols.backend``; this module
adds the two linear-algebra idioms the sub-protocols need (a public matrix on the
*left* of a shared one, and float64 for plaintext arithmetic).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from protocols import backend as _B

__all__ = ["is_secret", "stack", "reveal", "to_compute", "lmatmul", "mul_mask", "transpose", "weighted_sum"]

is_secret = _B.is_shared
stack = _B.stack
reveal = _B.reveal


def to_compute(x: Any, dtype: torch.dtype = torch.float64) -> Any:
    """Plaintext values are computed in float64; shared values keep their encoding."""
    return x if is_secret(x) else torch.as_tensor(x).to(dtype)


def transpose(x: Any) -> Any:
    """Swap the last two dimensions (torch and CrypTen spell it the same)."""
    return x.transpose(-1, -2)


def lmatmul(public: torch.Tensor, x: Any) -> Any:
    """``public @ x`` for a public left factor and a possibly-shared right factor.

    CrypTen tensors implement matmul with themselves on the left only, so the product is
    formed as (x^T public^T)^T, which is local (no communication) for shared x. An
    integer-valued public factor (the 0/1 placement matrices of SecUE) multiplies the ring
    integers as they are: exact, and no truncation round.
    """
    if not is_secret(x):
        return torch.matmul(public.to(x.dtype), x)
    if _is_integral(public):
        ring = transpose(_B.relabel(transpose(x), 0).matmul(transpose(public).to(torch.long)))
        return _B.relabel(ring, _B.bits_of(x))
    return transpose(transpose(x).matmul(transpose(public)))


def mul_mask(x: Any, public: torch.Tensor) -> Any:
    """``x * public`` elementwise; exact (no truncation) for an integer-valued public factor."""
    if not is_secret(x) or not _is_integral(public):
        return x * public
    return _B.relabel(_B.relabel(x, 0) * public.to(torch.long), _B.bits_of(x))


def _is_integral(t: torch.Tensor) -> bool:
    t = torch.as_tensor(t)
    return bool(torch.all(t == torch.round(t))) and bool(t.abs().max() < 2**31) if t.numel() else True


def weighted_sum(values: Sequence[Any], weights: Sequence[float]) -> Any:
    """sum_k w_k x_k with public weights (local for shared x).

    Shared values: no truncation at all (``protocols.backend.raw_weighted_sum``): the result
    carries the bits of the values plus those of the weights, which an opening divides away in
    the clear; ``protocols.backend.rescale`` brings it back to F bits where a protocol needs it.
    """
    if len(values) != len(weights) or not values:
        raise ValueError("need one weight per value")
    if any(is_secret(v) for v in values):
        return _B.raw_weighted_sum([_B.to_shared_like(v) for v in values], weights)
    out = values[0] * float(weights[0])
    for x, w in zip(values[1:], weights[1:]):
        out = out + x * float(w)
    return out

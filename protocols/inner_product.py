"""SecSP: inner products along a dimension, batched over the others.

* shared x shared: one Beaver multiplication round for all elements, then a local sum;
* shared x public: a local product and sum, then one truncation (e.g. ``<[g_i], M_i - M_{i-1}>``
  in round selection): one round with the default wrap-free truncation (``mpc/truncation.py``),
  none with CrypTen's local one;
* plaintext x plaintext: the plaintext twin ``(x * y).sum(dim)``.

Precision. The elementwise products are kept untruncated (ring scale ``2**32``), summed, and
truncated once, so a length-m inner product carries one unit-in-the-last-place truncation
error instead of m of them (CrypTen's ``(x * y).sum()`` would truncate every product). A public
factor is encoded with round-to-nearest and ``e = clamp(16 - ceil(log2 max|y|), 16, 32)``
fractional bits, i.e. ~16 significant bits even when it is small (model differences of order
1e-4 would keep only ~6 bits on CrypTen's ``2**-16`` grid). The result is the exact raw sum
truncated once: ``floor(S / 2**e)`` or one unit more (``S`` the ring sum, ``e = 16`` for shared
x shared), i.e. within one unit of ``2**-16`` of the inner product of the encodings.
Range: the *sum* must satisfy ``|<x, y>| < 2**(46 - e)`` (``2**30`` for shared x shared): the
raw sum, at ``16 + e`` fractional bits, must stay below ``2**62`` for the wrap-free truncation
(from ``2**30`` to ``2**31`` it is wrong with a probability growing to about 1/2; with
CrypTen's local truncation the bound is ``2**(47 - e)`` but any sum wraps with probability
about ``|S| / 2**64``). Partial sums may wrap harmlessly in the ring. Reveals nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backend as B
from .backend import Tensor
from .sharded import is_sharded

__all__ = ["inner", "inner_rows", "inner_raw", "inner_finish", "public_bits"]


def inner(x: Tensor, y: Tensor, dim: int = -1) -> Tensor:
    """``sum(x * y, dim)`` with broadcasting; shared if either input is shared."""
    if not B.any_shared(x, y):
        x = torch.as_tensor(x)
        y = torch.as_tensor(y)
        return (x * y).sum(dim)
    if B.is_shared(y) and not B.is_shared(x):
        x, y = y, x
    if is_sharded(x):
        return x.inner(y)
    e = None if B.is_shared(y) else public_bits(y)
    return inner_finish(inner_raw(x, y, dim, e), e)


def inner_rows(x: Tensor, row: Callable[[int], torch.Tensor]) -> Tensor:
    """``inner(x, Y)`` for a (T, m) ``x`` and the public (T, m) ``Y`` whose row k is ``row(k)``,
    holding one row of Y at a time (round selection's T model steps: 40 MB a round each for a
    5,000,000-parameter model). Shared ``x``: the rows are read twice, once for the exponent
    of the whole Y and once for the products, so the result is the batched one's, bit for bit
    (the same encoding, the same raw sums, one truncation of all T)."""
    T = int(x.shape[0])
    if not B.is_shared(x):
        x = torch.as_tensor(x)
        return torch.stack([(x[k] * torch.as_tensor(row(k)).to(x.dtype)).sum() for k in range(T)]) if T \
            else x.sum(-1)
    if T == 0:
        return inner(x, torch.zeros(tuple(x.shape), dtype=torch.float64))
    top = max(_abs_max(row(k)) for k in range(T))
    e = int(B.public_exponent(top))
    raws = [inner_raw(x[k], row(k), -1, e) for k in range(T)]
    return inner_finish(B.stack(raws), e)


def _abs_max(y: torch.Tensor) -> torch.Tensor:
    """The largest |y| without a temporary the size of y (a public factor may be m long)."""
    y = torch.as_tensor(y, dtype=torch.float64)
    return torch.maximum(y.max(), -y.min()) if y.numel() else torch.zeros((), dtype=torch.float64)


def public_bits(y: Tensor) -> int:
    """The fractional bits a public factor is encoded with: one exponent for all of it (the
    products are summed before truncating), so coordinate shards must use the whole's."""
    y = torch.as_tensor(y, dtype=torch.float64)
    return int(B.public_exponent(_abs_max(y))) if y.numel() else B.frac_bits()


def inner_raw(x: Tensor, y: Tensor, dim: int = -1, e: int | None = None) -> Tensor:
    """The untruncated sum of the products (shared ``x``; ``y`` shared, or public encoded with
    ``e`` bits): what adds over coordinate shards before :func:`inner_finish` truncates once."""
    if is_sharded(x):
        return x.inner_raw(y, e)
    if e is None:
        if tuple(x.shape) == tuple(y.shape) and len(x.shape) >= 1 and dim in (-1, len(x.shape) - 1) \
                and x.shape[-1] > 0:
            # as a batch of (1 x m) @ (m x 1) products: the same openings as m products, but the
            # correlation is one value per row (the dealer sends 8 bytes, not 8 m; two-party mode's
            # HE product returns one value instead of m)
            return B.raw_matmul(x.unsqueeze(-2), y.unsqueeze(-1)).reshape(tuple(x.shape[:-1]))
        return B.raw_mul(x, y).sum(dim)
    raw = B.relabel(x, 0) * B.encode_public(torch.as_tensor(y, dtype=torch.float64), bits=e)
    return B.relabel(raw.sum(dim), B.frac_bits())


def inner_finish(raw: Tensor, e: int | None = None) -> Tensor:
    """The inner product from :func:`inner_raw`'s (summed) raw value: one truncation."""
    if e is None:
        return _same_shape(B.truncate_raw(raw), raw)
    # e depends on public data: a divisor tensor (not an int) keeps the truncation's dealer
    # request independent of it (``mpc.truncation``: pairs for every exponent)
    return _same_shape(raw.div(torch.full(tuple(raw.shape), 1 << e, dtype=torch.long)), raw)


def _same_shape(out: Tensor, like: Tensor) -> Tensor:
    """``out`` with ``like``'s shape: the two-party truncation returns a 0-d sharing (the inner
    product of two vectors) with shape (1,), unlike the plaintext twin's 0-d result."""
    shape = tuple(like.shape)
    return out if tuple(out.shape) == shape else out.reshape(shape)

"""Dispatch between the plaintext twin (torch tensors) and the 2PC path (CrypTen MPCTensors).

Every primitive in :mod:`protocols` takes either kind of tensor through one signature, so that
the Starfish sub-protocols are written once and run on either backend (docs/design.md 4.1). This
module holds the few helpers that need to know which backend a value lives on.

Fixed-point conventions (CrypTen defaults, 64-bit ring, ``F = 16`` fractional bits):

* a shared real ``x`` is stored as the ring integer ``x_enc = trunc(x * 2**F)``; its
  ``encoder.scale`` is ``2**F``;
* CrypTen comparison results are 0/1 ring integers with ``encoder.scale == 1`` ("bits"), which
  multiply a shared fixed-point value *exactly* (no truncation). Multiplying such a bit by a
  *public* non-integer tensor would encode that tensor at scale 1 and truncate it, so
  :func:`protocols.compare.select` multiplies a bit by the public value's *integer encoding*
  instead (exact), and :func:`bit_to_fixed` re-encodes a bit for other uses;
* :func:`raw_mul` multiplies without the truncation step: the ring result is
  ``x_enc * y_enc`` (scale ``2**(2F)``). Comparisons of such raw products are exact on the encoded
  inputs (equal ratios compare equal, in 2PC and in the plaintext twin alike), which is what the
  division-free ratio comparison and the threshold check rely on. A raw product must stay below
  ``2**63`` in the ring, i.e. ``|x * y| < 2**(63 - 2F) = 2**31`` over the reals.

Only the public ``encoder`` property of MPCTensor is used to relabel scales; no CrypTen internals
are touched (those live in :mod:`mpc.crypten_compat`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import numpy as np
import torch

from mpc.crypten_compat import crypten
from mpc.truncation import truncate
from crypten.encoder import FixedPointEncoder

from .sharded import ShardedValue, is_sharded

Tensor = Union[torch.Tensor, Any]  # torch.Tensor or crypten MPCTensor

__all__ = [
    "Tensor",
    "from_share",
    "share_of",
    "is_shared",
    "any_shared",
    "frac_bits",
    "scale",
    "share_public",
    "to_shared_like",
    "reveal",
    "stack",
    "cat",
    "bit_to_fixed",
    "raw_mul",
    "raw_square",
    "raw_matmul",
    "truncate_raw",
    "relabel",
    "encode_public",
    "public_exponent",
    "mul_public",
    "float_dtype",
    "bits_of",
    "lift",
    "rescale",
    "raw_weighted_sum",
    "weight_integers",
    "to_compute",
    "transpose",
    "lmatmul",
    "mul_mask",
    "weighted_sum",
]


def is_shared(x: Any) -> bool:
    """True for secret-shared values (CrypTen tensors, or values on coordinate shards:
    ``protocols.sharded``), False for plaintext torch tensors / numbers."""
    return isinstance(x, (crypten.CrypTensor, ShardedValue))


def any_shared(*xs: Any) -> bool:
    return any(is_shared(x) for x in xs)


def frac_bits() -> int:
    """Fractional bits of CrypTen's fixed-point encoding currently configured (default 16)."""
    return int(crypten.cfg.encoder.precision_bits)


def scale() -> int:
    return 1 << frac_bits()


def float_dtype(*xs: Any) -> torch.dtype:
    """Result dtype of the plaintext twin: the promoted floating dtype of the inputs."""
    dtypes = [x.dtype for x in xs if isinstance(x, torch.Tensor)]
    if not dtypes:
        return torch.float64
    dt = dtypes[0]
    for d in dtypes[1:]:
        dt = torch.promote_types(dt, d)
    return dt if dt.is_floating_point else torch.float64


def share_public(x: torch.Tensor | float) -> Any:
    """Turn a public value into a sharing (no communication: pseudo-random zero sharing).

    Used when a public value must travel through an oblivious computation together with
    shared ones (e.g. an index payload in a sort). Hides nothing by itself: it is public.
    """
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(x, dtype=torch.float64)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    return crypten.cryptensor(x, src=0)


def to_shared_like(x: Any) -> Any:
    return x if is_shared(x) else share_public(x)


def reveal(x: Any) -> torch.Tensor:
    """Open a shared value to both parties (one round), decoded in float64.

    CrypTen's ``get_plain_text`` decodes to float32, which drops fractional bits above
    magnitude 2**8 (e.g. ``30000 - 2**-16`` opens as ``30000``); we decode the opened ring
    integers ourselves. Identity on plaintext tensors.
    """
    if is_sharded(x):
        return x.reveal()
    if is_shared(x):
        return x.reveal().to(torch.float64) / float(x.encoder.scale)
    return x


def _unify_scales(xs: Sequence[Any]) -> list:
    """Bring shared tensors to one encoder scale so stack/cat keep their meaning.

    CrypTen's stack/cat silently take the first tensor's encoder; a comparison bit (scale 1)
    stacked with a fixed-point value would otherwise be misread by a factor of 2**F.
    """
    shared = [to_shared_like(x) for x in xs]
    top = max(t.encoder.scale for t in shared)
    out = []
    for t in shared:
        if t.encoder.scale != top:
            t = t * (top // t.encoder.scale)  # python int: exact local share multiply
            t.encoder = FixedPointEncoder(precision_bits=int(math.log2(top)))
        out.append(t)
    return out


def stack(xs: Sequence[Any], dim: int = 0) -> Any:
    if xs and is_sharded(xs[0]):
        return xs[0].stack_with(list(xs), dim)
    if any_shared(*xs):
        return crypten.stack(_unify_scales(xs), dim=dim)
    return torch.stack(list(xs), dim=dim)


def cat(xs: Sequence[Any], dim: int = 0) -> Any:
    if any_shared(*xs):
        xs = _unify_scales(xs)
        if len(xs) == 1:
            return xs[0]
        return crypten.cat(xs, dim=dim)
    return torch.cat(list(xs), dim=dim)


def bit_to_fixed(bit: Any) -> Any:
    """Re-encode a shared 0/1 bit (scale 1) at the default fixed-point scale (local, exact)."""
    if not is_shared(bit) or bit.encoder.scale == scale():
        return bit
    out = bit * (scale() // bit.encoder.scale)
    out.encoder = FixedPointEncoder()
    return out


def relabel(x: Any, precision_bits: int) -> Any:
    """Copy of a sharing with the same ring integers read at scale ``2**precision_bits``."""
    out = x.clone()
    out.encoder = FixedPointEncoder(precision_bits=precision_bits)
    return out


def encode_public(y: torch.Tensor | float, bits: int | None = None) -> torch.Tensor:
    """Round-to-nearest fixed-point encoding of a public value (CrypTen's own truncates)."""
    bits = frac_bits() if bits is None else bits
    if not isinstance(y, torch.Tensor):
        y = torch.tensor(y, dtype=torch.float64)
    return torch.round(y.to(torch.float64) * 2.0**bits).to(torch.long)


def public_exponent(p: torch.Tensor, lo: int | None = None, hi: int = 32) -> torch.Tensor:
    """Fractional bits for encoding public ``p`` with ~16 significant bits (elementwise).

    ``16 - ceil(log2 |p|)`` clamped to ``[F, hi]``: never coarser than CrypTen's ``2**-F``
    grid, finer for small public factors (e.g. model differences of order 1e-4, which the
    plain grid would keep to ~6 significant bits). The cap bounds the ring magnitude.
    """
    lo = frac_bits() if lo is None else lo
    mag = torch.as_tensor(p, dtype=torch.float64).abs()
    safe = torch.where(mag > 0, mag, torch.ones_like(mag))
    e = 16 - torch.ceil(torch.log2(safe))
    return e.clamp(lo, hi).to(torch.long)


def mul_public(x: Any, p: torch.Tensor) -> Any:
    """Shared ``x`` times public real ``p`` (local), keeping ~16 significant bits of ``p``.

    CrypTen's ``x * p`` encodes ``p`` on the ``2**-16`` grid, so ``x * (1/300)`` is off by
    ~0.1%; here ``p`` is encoded with per-element exponents and the product truncated by them.
    A plain ``x`` (the twin) is multiplied as it is.
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    if not is_shared(x):
        x = torch.as_tensor(x)
        return x * p.to(x.dtype)
    e = public_exponent(p)
    out = relabel(relabel(x, 0) * torch.round(p * torch.pow(2.0, e)).to(torch.long), frac_bits())
    return out.div(torch.pow(2, e).to(torch.long).expand(tuple(out.shape)).contiguous())


def raw_mul(x: Any, y: Any) -> Any:
    """Product without the fixed-point truncation (ring value ``x_enc * y_enc``).

    Shared x shared costs one Beaver multiplication; shared x public is local. The result is a
    sharing labelled with scale ``2**F`` whose ring integer is ``x_enc * y_enc``, i.e. its
    "value" is ``x * y * 2**F``; use it for comparisons or sums followed by
    :func:`truncate_raw`. Plaintext inputs return the float64 product ``x * y`` (the twin of
    the real value; comparisons on it agree with the 2PC ones on fixed-point-exact inputs).
    """
    if not any_shared(x, y):
        return torch.as_tensor(x, dtype=torch.float64) * torch.as_tensor(y, dtype=torch.float64)
    if not is_shared(x):
        x, y = y, x
    if is_shared(y):
        out = x * relabel(y, 0)
    else:
        # scale-1 view of x times an integer tensor: CrypTen encodes it at scale 1 (as is) and
        # skips truncation, so the ring holds x_enc * y_enc.
        out = relabel(x, 0) * encode_public(y)
    out.encoder = FixedPointEncoder()
    return out


def raw_matmul(x: Any, y: Any) -> Any:
    """Shared ``x @ y`` without truncation (one Beaver matrix round); ring ``x_enc @ y_enc``."""
    out = x.matmul(relabel(y, 0))
    out.encoder = FixedPointEncoder()
    return out


def raw_square(x: Any) -> Any:
    """``x_enc ** 2`` without truncation (one square-tuple round); plaintext: float64 x*x."""
    if not is_shared(x):
        x = torch.as_tensor(x, dtype=torch.float64)
        return x * x
    out = relabel(x, 0).square()
    out.encoder = FixedPointEncoder()
    return out


def truncate_raw(x: Any) -> Any:
    """Bring a raw product (or a sum of raw products) back to scale ``2**F`` (local).

    Two-party truncation is CrypTen's local share division: off by at most one unit in the
    last place, and wrong with probability about ``|value| * 2**(2F) / 2**63`` (negligible for
    values well inside the range). Plaintext: the float64 value is already the real product.
    """
    if not is_shared(x):
        return x
    return x.div(scale())


# ------------------------------------------------------------------ sharings at other precisions
# A raw product keeps the fractional bits of both factors (32 for two 16-bit encodings). Long
# vectors stay raw until a value is opened (the opening is divided in the clear: no truncation
# at all) or compared (one wrap-free truncation, ``mpc.truncation``). The encoder of a sharing
# records its precision, so ``reveal`` decodes any of them.

def bits_of(x: Any) -> int:
    """Fractional bits of a sharing (its encoder's precision)."""
    return int(round(math.log2(x.encoder.scale)))


def from_share(arr: Any, bits: int) -> Any:
    """This side's int64 share (an array) as a sharing read at ``bits`` fractional bits: a share that
    crossed from another session of the same pair of servers (a coordinator's to its worker's)."""
    return crypten.mpc.MPCTensor.from_shares(torch.from_numpy(np.array(arr, dtype=np.int64, copy=True)),
                                             precision=bits)


def share_of(x: Any) -> tuple[Any, int]:
    """A sharing as (this side's int64 share as a numpy array, its fractional bits): what crosses
    to or from a worker (:func:`from_share` reads it back)."""
    return x.share.numpy().copy(), bits_of(x)


def lift(x: Any, bits: int) -> Any:
    """The same value at ``bits >= bits_of(x)`` fractional bits: local, exact (ring times 2**k)."""
    k = bits - bits_of(x)
    if k < 0:
        raise ValueError(f"lift to {bits} bits from {bits_of(x)}: use rescale to drop bits")
    out = relabel(x, 0) * (1 << k) if k else x.clone()
    return relabel(out, bits)


def rescale(x: Any, bits: int | None = None) -> Any:
    """A sharing at ``bits`` fractional bits (default F): lift, or one wrap-free truncation."""
    if not is_shared(x):
        return x
    bits = frac_bits() if bits is None else bits
    if is_sharded(x):
        return x.rescale(bits)
    k = bits_of(x) - bits
    if k <= 0:
        return lift(x, bits)
    return relabel(truncate(relabel(x, 0), k), bits)


def weight_integers(weights: Sequence[float]) -> tuple[list[int], int]:
    """Public weights as the integers ``round(w * 2**e)`` and their ``e`` (one exponent for all,
    ``public_exponent`` of the largest): how :func:`raw_weighted_sum` multiplies shares, so that a
    sum formed another way (``estimate_aggregate``) holds the same ring integers."""
    w = torch.as_tensor([float(v) for v in weights], dtype=torch.float64)
    e = int(public_exponent(w.abs().max()))
    return [int(round(float(wk) * 2.0 ** e)) for wk in w], e


def raw_weighted_sum(values: Sequence[Any], weights: Sequence[float]) -> Any:
    """sum_k w_k x_k for sharings at any precision and public weights, without truncation.

    Each weight is encoded with ``public_exponent`` fractional bits; each product keeps its
    bits; terms are lifted to the largest precision. The result's precision is that sum of bits
    (up to about 52 for raw 32-bit rows), so |result| must stay below 2**(62 - bits).
    """
    ints, e = weight_integers(weights)
    terms = [relabel(relabel(x, 0) * wk, bits_of(x) + e) for x, wk in zip(values, ints)]
    top = max(bits_of(t) for t in terms)
    out = lift(terms[0], top)
    for t in terms[1:]:
        out = out + lift(t, top)
    return out


# ---- linear-algebra idioms of the Starfish sub-protocols: a public matrix on the left of a
# shared one, float64 for plaintext arithmetic, public weighted sums without truncation
def to_compute(x: Any, dtype: torch.dtype = torch.float64) -> Any:
    """Plaintext values are computed in float64; shared values keep their encoding."""
    return x if is_shared(x) else torch.as_tensor(x).to(dtype)


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
    if not is_shared(x):
        return torch.matmul(public.to(x.dtype), x)
    if _is_integral(public):
        ring = transpose(relabel(transpose(x), 0).matmul(transpose(public).to(torch.long)))
        return relabel(ring, bits_of(x))
    return transpose(transpose(x).matmul(transpose(public)))


def mul_mask(x: Any, public: torch.Tensor) -> Any:
    """``x * public`` elementwise; exact (no truncation) for an integer-valued public factor."""
    if not is_shared(x) or not _is_integral(public):
        return x * public
    return relabel(relabel(x, 0) * public.to(torch.long), bits_of(x))


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
    if any(is_sharded(v) for v in values):
        return next(v for v in values if is_sharded(v)).weighted_with(list(values), list(weights))
    if any(is_shared(v) for v in values):
        return raw_weighted_sum([to_shared_like(v) for v in values], weights)
    out = values[0] * float(weights[0])
    for x, w in zip(values[1:], weights[1:]):
        out = out + x * float(w)
    return out

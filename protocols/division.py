"""SecDiv: reciprocal and division. Plaintext twins ``1 / x`` and ``x / y``.

Two 2PC methods, neither reveals anything:

``method="normalized"`` (default). CrypTen's reciprocal (below) is accurate only on a narrow
domain, so by default we first bring ``|x|`` into ``[1/2, 1)`` with a secret power of two:

1. one batched comparison of ``x`` and ``-x`` against the public constants ``2**j``,
   ``j = -16..16``, and of ``x`` against 0 (67 comparisons per element, 34 with
   ``positive=True``, all in one comparison round);
2. ``c = sign(x) * 2**-(floor(log2|x|) + 1)`` is a public *integer* combination of those bits
   in the ring (telescoping sum), so it costs nothing and is exact;
3. ``x' = x c`` in ``[1/2, 1)`` (one multiplication), three Newton-Raphson steps
   ``y <- y (2 - x' y)`` from ``y0 = 48/17 - 32/17 x'`` (error ``(1/17)**8``; six
   multiplications), and ``1/x = c y`` (one multiplication).
4. ``divide(x, y)`` splits ``c = c2 c1`` with ``m = floor(log2|y|) + 1``,
   ``c2 = 2**max(-m, 0)`` (an integer, ``>= 1``) and ``c1 = 2**-max(m, 0)`` (``<= 1``), both
   integer combinations of the same bits. ``x sign(y) c2`` is exact (a ring product by an
   integer, in the same Beaver round as ``y' = y c``), and ``x / y = ((x sign(y) c2) y') c1``
   (two multiplications): the unit lost in the product with ``y'`` is never multiplied by a
   factor above 1. Neither ``x (c y')`` (``c y'`` keeps few bits of ``1/y`` for large ``y``)
   nor ``(x y') c`` (its lost unit times ``c``, up to ``2**15`` units for ``|y|`` near
   ``2**-16``: ``divide(3, 5)`` in units of ``2**-16`` gave 0.625) has that property.

Rounds: 1 comparison + 8 multiplications (``divide``: 1 + 9). Valid for every representable
``x != 0``: ``2**-16 <= |x| < 2**16``; for ``|x| >= 2**16`` the result is 0 (the true value is
below the resolution ``2**-16``, but ``divide`` then also returns 0 whatever the numerator);
``x = 0`` gives a large positive garbage value (about ``1.5e6``). Accuracy: about one unit in
the last place of the result (``divide``: two) plus a relative ``2**-15`` from rounding ``x'``
and up to about as much again from rounding ``y'`` (measured beyond the units: 0.9 ``2**-15``
for ``reciprocal``, 1.3 ``2**-15`` for ``divide``). ``divide`` needs ``|x| < 2**29`` and
``|x / y| < 2**29`` (its ring products stay below ``2**62``); a public ``x`` over a shared
``y`` costs what a shared one does (``x sign(y) c2`` is then local, but its product with
``y'`` is a Beaver multiplication).

``method="crypten"``. CrypTen's ``reciprocal``/``div``: the sign by one comparison (skipped
with ``positive=True``), then 10 Newton-Raphson iterations from ``3 exp(1 - 2x) + 0.003``
(the exponential costs 8 squarings): one comparison + 30 multiplication rounds (38 in all,
about 1.1 KB online per element against 29 KB for the normalised method). Its
useful domain is narrow at 16 fractional bits (the iteration squares ``y ~ 1/x``, which has
few significant bits for large ``x``; the initial guess is too far off for tiny ``x``; and
beyond ``|x|`` of about 200 the exponential's ``(1 + t/256)**256`` approximation no longer
decays, so the guess exceeds ``2/x`` and the iteration diverges): usable roughly on
``[1e-3, 30]``, see the measured errors in docs/protocols.md. ``max_abs`` (a public bound on ``|x|``) lets us divide ``x`` by a
public power of two first.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mpc.crypten_compat import crypten

from . import backend as B
from .backend import Tensor
from .compare import ge

__all__ = ["reciprocal", "divide"]

_EXPONENTS = torch.arange(-16, 17, dtype=torch.float64)  # thresholds 2**j, j = -16..16
_NR_STEPS = 3
_CRYPTEN_SAFE_MAX = 64.0


def _ring_weights() -> torch.Tensor:
    """Ring weights turning the bits ``[|x| >= 2**j]`` into ``c``'s telescoping sum.

    ``c = 2**16 - sum_{j<16} [|x| >= 2**j] 2**-(j+1) - [|x| >= 2**16] 2**-16``; in the ring
    (scale ``2**16``) the weights are the integers ``2**(15-j)`` and, for ``j = 16``, 1.
    """
    w = torch.pow(2.0, 15 - _EXPONENTS)
    w[-1] = 1.0
    return w.to(torch.long)


def _scale_bits(x: Tensor, positive: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One comparison round: ``(d, b, s)`` as scale-1 ring integers of shape (..., J).

    ``b_j = [|x| >= 2**j]``, ``d_j = sign(x) b_j`` and ``s = [x >= 0]`` (``None`` when the
    caller guarantees ``x > 0``: then ``d = b``).
    """
    th = torch.pow(2.0, _EXPONENTS)
    j = th.numel()
    xe = x.unsqueeze(-1)
    if positive:
        bits = ge(xe, th)  # (..., J)
        return bits, bits, None
    shape = tuple(x.shape) + (j,)
    vals = B.cat([xe.expand(shape), (-xe).expand(shape), xe], dim=-1)
    thr = torch.cat([th, th, torch.zeros(1, dtype=torch.float64)])
    bits = ge(vals, thr)  # (..., 2J+1): [x >= 2**j], [-x >= 2**j], [x >= 0]
    pos, neg = bits[..., :j], bits[..., j:2 * j]
    return pos - neg, pos + neg, bits[..., 2 * j]


def _telescoped(bits: Tensor, s: Optional[Tensor], weights: torch.Tensor, top: int) -> Tensor:
    """``(2s - 1) top - sum_j bits_j weights_j`` (``top - ...`` without a sign), scale 1, local."""
    ring = -(bits * weights).sum(-1)
    if s is None:
        return ring + top
    return ring + s * (2 * top) - top


def _signed_scale(x: Tensor, positive: bool) -> Tensor:
    """Shared ``sign(x) * 2**-(floor(log2|x|)+1)`` (scale ``2**16``), one comparison round."""
    d, _, s = _scale_bits(x, positive)
    # sign * c = (2s - 1) 2**16 - sum_j ([x >= 2**j] - [-x >= 2**j]) w_j
    return B.relabel(_telescoped(d, s, _ring_weights(), 1 << 32), B.frac_bits())


def _newton(xn: Tensor) -> Tensor:
    """``1 / xn`` for ``xn`` in ``[1/2, 1)``: three Newton steps from ``48/17 - 32/17 xn``."""
    y = xn * (-32.0 / 17.0) + 48.0 / 17.0
    for _ in range(_NR_STEPS):
        y = y * ((xn * y).neg() + 2.0)
    return y


def _normalized_parts(x: Tensor, positive: bool) -> tuple[Tensor, Tensor]:
    """``(c, y)`` with ``1/x = c * y``, ``y`` in ``(1, 2]``."""
    c = _signed_scale(x, positive)
    return c, _newton(x * c)


def _split_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of ``c2 = 2**max(-m, 0)`` (an integer) and ``c1 = 2**-max(m, 0)`` (at scale
    ``2**16``), ``m = floor(log2|y|) + 1``, over the bits ``[|y| >= 2**j]``, j = -16..16:

    ``c2 = 2**15 - sum_{j=-15}^{-1} [|y| >= 2**j] 2**(-j-1)`` and
    ``c1 2**16 = 2**16 - sum_{j=0}^{15} [|y| >= 2**j] 2**(15-j) - [|y| >= 2**16]``; c2 c1 = c.
    """
    j = _EXPONENTS.to(torch.long)
    w2 = torch.where((j >= -15) & (j <= -1), torch.pow(2, (-j - 1).clamp(min=0)), 0)
    w1 = torch.where(j >= 0, _ring_weights(), 0)
    return w2.to(torch.long), w1.to(torch.long)


def _divide_normalized(x: Tensor, y: Tensor, positive: bool) -> Tensor:
    """``x / y`` for shared ``y``: ``((x sign(y) c2) y') c1`` (module docstring)."""
    F = B.frac_bits()
    if B.is_shared(x) and tuple(x.shape) != tuple(y.shape):
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(y.shape))
        x, y = x.expand(shape), y.expand(shape)
    d, b, s = _scale_bits(y, positive)
    w2, w1 = _split_weights()
    sc = _telescoped(d, s, _ring_weights(), 1 << 32)     # sign(y) c at 2**F, as a ring integer
    sc2 = _telescoped(d, s, w2, 1 << 15)                 # sign(y) c2: an integer, 1 .. 2**15
    c1 = B.relabel(_telescoped(b, None, w1, 1 << 16), F)  # c1 <= 1 at 2**F
    if B.is_shared(x):
        # one Beaver round for both ring products: y_enc (sign c)_enc (scale 2**2F, truncated
        # below) and x_enc sign c2 (exact: x sign(y) c2 at 2**F)
        prod = B.stack([B.relabel(y, 0), B.relabel(x, 0)]) * B.stack([sc, sc2])
        xn = B.relabel(B.relabel(prod[0], F).div(1 << F), F)
        xc2 = B.relabel(prod[1], F)
    else:
        xn = y * B.relabel(sc, F)
        xc2 = B.relabel(sc2 * B.encode_public(torch.as_tensor(x, dtype=torch.float64)), F)
    return (xc2 * _newton(xn)) * c1


def _crypten_reciprocal(x: Tensor, positive: bool, max_abs: Optional[float]) -> Tensor:
    shift = 0
    if max_abs is not None and max_abs > _CRYPTEN_SAFE_MAX:
        shift = math.ceil(math.log2(max_abs / _CRYPTEN_SAFE_MAX))
    xs = x.div(1 << shift) if shift else x
    with crypten.cfg.temp_override({"functions.reciprocal_all_pos": bool(positive)}):
        r = xs.reciprocal()
    return r.div(1 << shift) if shift else r


def reciprocal(x: Tensor, positive: bool = False, method: str = "normalized",
               max_abs: Optional[float] = None) -> Tensor:
    """``1 / x`` (shared if ``x`` is shared). ``positive``: caller guarantees ``x > 0``.

    ``max_abs`` is used by ``method="crypten"`` only (public bound on ``|x|``).
    """
    if not B.is_shared(x):
        return 1.0 / torch.as_tensor(x)
    if method == "crypten":
        return _crypten_reciprocal(x, positive, max_abs)
    if method != "normalized":
        raise ValueError(f"unknown reciprocal method {method!r}")
    c, y = _normalized_parts(x, positive)
    return y * c


def divide(x: Tensor, y: Tensor, positive: bool = False, method: str = "normalized",
           max_abs: Optional[float] = None) -> Tensor:
    """``x / y``. Public ``y``: local multiplication by ``1/y``. Shared ``y``: see the module
    docstring; ``positive``/``max_abs`` refer to ``y``."""
    if not B.any_shared(x, y):
        return torch.as_tensor(x) / torch.as_tensor(y)
    if not B.is_shared(y):
        return B.mul_public(x, 1.0 / torch.as_tensor(y, dtype=torch.float64))
    if method == "crypten":
        return _crypten_reciprocal(y, positive, max_abs) * x
    if method != "normalized":
        raise ValueError(f"unknown reciprocal method {method!r}")
    return _divide_normalized(x, y, positive)

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
   multiplications), and ``1/x = c y`` (one multiplication); ``divide`` computes
   ``(x y) c`` instead of ``x (c y)`` so that a large divisor does not throw away the bits of
   ``1/y`` (two multiplications).

Rounds: 1 comparison + 8 multiplications (``divide``: 1 + 9). Valid for every representable
``x != 0``: ``2**-16 <= |x| < 2**16``; for ``|x| >= 2**16`` the result is 0 (the true value is
below the resolution ``2**-16``, but ``divide`` then also returns 0 whatever the numerator);
``x = 0`` gives a large positive garbage value (about ``1.5e6``). Accuracy: about one unit in
the last place of the result plus a relative ``2**-15`` from rounding ``x'``.

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


def _signed_scale(x: Tensor, positive: bool) -> Tensor:
    """Shared ``sign(x) * 2**-(floor(log2|x|)+1)`` (scale ``2**16``), one comparison round."""
    th = torch.pow(2.0, _EXPONENTS)
    w = _ring_weights()
    j = th.numel()
    xe = x.unsqueeze(-1)
    if positive:
        bits = ge(xe, th)  # (..., J)
        ring = -(bits * w).sum(-1) + (1 << 32)
    else:
        shape = tuple(x.shape) + (j,)
        vals = B.cat([xe.expand(shape), (-xe).expand(shape), xe], dim=-1)
        thr = torch.cat([th, th, torch.zeros(1, dtype=torch.float64)])
        bits = ge(vals, thr)  # (..., 2J+1): [x >= 2**j], [-x >= 2**j], [x >= 0]
        # sign * c = (2s - 1) 2**16 - sum_j ([x >= 2**j] - [-x >= 2**j]) w_j
        wall = torch.cat([-w, w, torch.tensor([1 << 33], dtype=torch.long)])
        ring = (bits * wall).sum(-1) + (-(1 << 32))
    return B.relabel(ring, B.frac_bits())


def _normalized_parts(x: Tensor, positive: bool) -> tuple[Tensor, Tensor]:
    """``(c, y)`` with ``1/x = c * y``, ``y`` in ``(1, 2]``."""
    c = _signed_scale(x, positive)
    xn = x * c
    y = xn * (-32.0 / 17.0) + 48.0 / 17.0
    for _ in range(_NR_STEPS):
        y = y * ((xn * y).neg() + 2.0)
    return c, y


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
    c, yn = _normalized_parts(y, positive)
    t = yn * x
    return t * c

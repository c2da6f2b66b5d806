"""Fixed-point encoding into the ring Z_2^64, bit-exact with CrypTen's FixedPointEncoder.

Why numpy and not CrypTen: clients must be able to encode and share an update with
numpy and this package alone (docs/design.md 4: ``clients`` never needs the 2PC engine).
CrypTen encodes a float tensor as ``(scale * x).long()``: the product is taken in the
tensor's own float dtype and then truncated toward zero. We do the same, so a value a
client encodes here and a value a server encodes with CrypTen are the same ring element.
"""

from __future__ import annotations

import numpy as np

DEFAULT_PRECISION = 16  # CrypTen's default cfg.encoder.precision_bits

# Largest magnitude we accept: the encoded value must leave head-room in the signed
# 64-bit ring for one multiplication before truncation (2 * (16 + 15) bits < 63).
_MAX_ABS = float(2**30)


class EncodingError(ValueError):
    """The input cannot be represented in the fixed-point ring."""


def encode(x, precision: int = DEFAULT_PRECISION, max_abs: float = _MAX_ABS) -> np.ndarray:
    """Encode real values as int64 ring elements: trunc(x * 2**precision).

    Raises EncodingError for NaN/inf or |x| > max_abs, instead of silently wrapping.
    """
    arr = np.asarray(x)
    if arr.dtype.kind in "iub":
        arr64 = arr.astype(np.int64)
        if arr.size and np.abs(arr64).max() > max_abs:
            raise EncodingError(f"integer input exceeds the fixed-point range |x| <= {max_abs:g}")
        return arr64 * np.int64(1 << precision)
    if arr.dtype.kind != "f":
        raise EncodingError(f"cannot encode dtype {arr.dtype}")
    if arr.size:
        if not np.all(np.isfinite(arr)):
            raise EncodingError("input contains NaN or infinity")
        if np.abs(arr).max() > max_abs:
            raise EncodingError(f"input exceeds the fixed-point range |x| <= {max_abs:g}")
    # Multiply in the input's own float dtype, as torch does for `scale * tensor`.
    scaled = arr * arr.dtype.type(1 << precision)
    return scaled.astype(np.int64)  # astype truncates toward zero, like torch's .long()


def decode(ring: np.ndarray, precision: int = DEFAULT_PRECISION) -> np.ndarray:
    """Decode int64 ring elements to float64 values."""
    ring = np.asarray(ring, dtype=np.int64)
    # Split into integer and fractional parts so large values keep full precision.
    scale = 1 << precision
    integer = np.floor_divide(ring, scale)
    frac = ring - integer * scale
    return integer.astype(np.float64) + frac.astype(np.float64) / scale

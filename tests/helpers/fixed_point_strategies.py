"""Hypothesis strategies for inputs on (and just off) the 16-bit fixed-point grid.

The secure primitives hold a real ``x`` as the ring integer ``enc(x) = trunc(x * 2**16)``
(CrypTen's encoder truncates toward zero). The strategies below draw ring integers first --
log-uniform magnitudes from one unit (``2**-16``) up to a bound given in ring units, zeros,
ties from a small pool, one-unit gaps -- and turn them into float64 values, optionally moved
off the grid by a fraction of a unit. Oracles compare against :func:`enc` of what was drawn, so
off-grid inputs are checked against the encoding the protocol really holds.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

F = 16
SCALE = 1 << F
LSB = 2.0 ** -F
#: floats at or above this magnitude are all multiples of 2**-16 (no off-grid value exists)
GRID_ONLY = 2.0 ** 36


def enc(a) -> np.ndarray:
    """The ring integers CrypTen's encoder makes of float64 values: ``trunc(x * 2**16)``."""
    return np.trunc(np.asarray(a, dtype=np.float64) * SCALE).astype(np.int64)


def dec(e) -> np.ndarray:
    """Float64 values of ring integers at 16 fractional bits (exact below 2**53 units)."""
    return np.asarray(e, dtype=np.int64).astype(np.float64) / SCALE


def on_grid(a) -> bool:
    a = np.asarray(a, dtype=np.float64)
    return bool(np.array_equal(dec(enc(a)), a))


def _grid_value(k: int, max_enc: int) -> float:
    """``k * 2**-16`` as a float64 whose encoding stays within ``max_enc`` (float(k) rounds)."""
    x = float(k) * LSB
    while abs(int(enc(x))) > max_enc:
        x = float(np.nextafter(x, 0.0))
    return x


@st.composite
def enc_ints(draw, max_enc: int, positive: bool = False) -> int:
    """A ring integer in ``[-max_enc, max_enc]`` (``[1, max_enc]`` if positive), log-uniform."""
    lo_bits = 1 if positive else 0
    b = draw(st.integers(lo_bits, max(lo_bits, int(max_enc).bit_length())))
    if b == 0:
        return 0
    m = draw(st.integers(1 << (b - 1), min((1 << b) - 1, max_enc)))
    if positive or draw(st.booleans()):
        return m
    return -m


@st.composite
def enc_vectors(draw, size: int, max_enc: int, positive: bool = False,
                modes=("wide", "ties", "gaps", "small")) -> list:
    """``size`` ring integers in one of several shapes of data (see the module docstring)."""
    if size == 0:
        return []
    mode = draw(st.sampled_from(modes))
    lo = 1 if positive else -max_enc
    if mode == "wide":
        return [draw(enc_ints(max_enc, positive)) for _ in range(size)]
    if mode == "ties":
        pool = draw(st.lists(enc_ints(max_enc, positive), min_size=1, max_size=3))
        if not positive and draw(st.booleans()):
            pool.append(0)
        return draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size))
    if mode == "gaps":  # one-unit gaps around a base value (and exact ties)
        base = draw(enc_ints(max_enc, positive))
        offs = draw(st.lists(st.integers(-2, 2), min_size=size, max_size=size))
        return [min(max(base + o, lo), max_enc) for o in offs]
    # small: a few integers and a few units around zero
    unit = draw(st.sampled_from([1, SCALE]))
    vals = draw(st.lists(st.integers(1 if positive else -3, 3), min_size=size, max_size=size))
    return [min(max(v * unit, lo), max_enc) for v in vals]


@st.composite
def fixed_arrays(draw, shape: tuple, max_enc: int, positive: bool = False,
                 off_grid: bool = True, modes=("wide", "ties", "gaps", "small")) -> np.ndarray:
    """Float64 array of ``shape`` whose encodings satisfy ``|enc| <= max_enc`` (``>= 1`` if
    positive); with ``off_grid`` some examples add a fraction of a unit to every entry."""
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    ks = draw(enc_vectors(size, max_enc, positive, modes))
    xs = [_grid_value(k, max_enc) for k in ks]
    if off_grid and size and draw(st.booleans()):
        fr = draw(st.lists(st.floats(0.0, 1.0, exclude_max=True, allow_subnormal=False),
                           min_size=size, max_size=size))
        moved = []
        for x, f in zip(xs, fr):
            y = x + f * LSB if abs(x) < GRID_ONLY else x
            if abs(int(enc(y))) > max_enc or (positive and int(enc(y)) < 1):
                y = x
            moved.append(y)
        xs = moved
    return np.array(xs, dtype=np.float64).reshape(shape)


def ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 0 else 0

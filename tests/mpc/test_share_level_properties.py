"""Property: the ring-level primitives are exact on their whole documented domain.

* ``mpc.nonnegative.nonnegative(x)``: ``[x >= 0]`` for *every* int64 ring element (edges 0,
  +-1, +-2**62, 2**63 - 1, -2**63, powers of two and their neighbours, log-uniform magnitudes
  and uniform ring elements), any shape (1-D, 2-D, length 0 and 1, below, at and above the
  64-element plane word), any split into shares. Oracles: numpy's ``x >= 0``, the top bit of
  the two's-complement word, and CrypTen's own comparison on the same sharing.
* ``mpc.exact_truncation.truncate_exact(x, d)``: ``floor(x / 2**d)`` for ``|x| < 2**62`` and
  every ``1 <= d <= 62`` (powers of two and not), keeping the encoder; other ``d`` refused.
  Oracles: Python's ``x >> d`` on integers and ``floor(Fraction(x, 2**d))``, and numpy's
  arithmetic shift.

One two-party session per module (fixture ``pair``); each example evaluates whole vectors.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import share_level_programs as slp
from tests.helpers.ring_shares import HI, LO, MASKS, split

TRUNC_MAX = 2**62 - 1          # |x| < 2**62
RING_EDGES = [0, 1, -1, 2, -2, 2**62, -(2**62), 2**62 - 1, -(2**62) + 1, 2**62 + 1, -(2**62) - 1,
              HI, LO, HI - 1, LO + 1, 2**31, -(2**31), 2**32 - 1, -(2**32), 2**47, -(2**47)]
# lengths around the bit-plane word (64 elements): squeezed planes below, whole words above
LENGTHS = [0, 1, 2, 3, 7, 31, 63, 64, 65, 100, 127, 128, 129, 191, 200]


def ring_element(lo: int = LO, hi: int = HI):
    """int64 ring elements in [lo, hi]: edges, log-uniform magnitudes and uniform ones."""
    top = max(abs(lo), abs(hi)).bit_length()
    edges = st.sampled_from([e for e in RING_EDGES if lo <= e <= hi])
    spread = st.tuples(st.sampled_from(range(1, top + 1)), st.booleans(),
                       st.randoms(use_true_random=False)).map(
        lambda t: (-1 if t[1] else 1) * t[2].randrange(2 ** (t[0] - 1), 2 ** t[0]))
    near_power = st.tuples(st.sampled_from(range(0, top)), st.sampled_from([-1, 0, 1]),
                           st.booleans()).map(lambda t: (-1 if t[2] else 1) * (2 ** t[0] + t[1]))
    return st.one_of(edges, spread, spread, near_power, st.integers(lo, hi)).filter(
        lambda v: lo <= v <= hi)


def ring_vector(lo: int = LO, hi: int = HI, lengths=LENGTHS):
    return st.sampled_from(lengths).flatmap(
        lambda n: st.lists(ring_element(lo, hi), min_size=n, max_size=n))


def shapes(n: int) -> list[tuple[int, ...]]:
    """1-D, and a 2-D batch when n factors (also (0, 3) for n = 0)."""
    out = [(n,)]
    if n == 0:
        out.append((0, 3))
    else:
        k = next((k for k in (5, 3, 2) if n % k == 0 and n > k), None)
        if k:
            out.append((k, n // k))
    return out


def pair_agrees(r0, r1) -> None:
    assert len(r0) == len(r1)
    for a, b in zip(r0, r1):
        if isinstance(a, str) or isinstance(b, str):
            assert a == b
            continue
        for u, v in zip(a, b):
            assert (u is None and v is None) or np.array_equal(u, v)


# ----------------------------------------------------------------------------- sign test
@given(xs=ring_vector(), how=MASKS, seed=st.integers(0, 2**32 - 1))
@example(xs=RING_EDGES, how="uniform", seed=0)
@example(xs=RING_EDGES * 4, how="all", seed=1)   # 84 elements: two plane words
def test_nonnegative_is_exact_on_the_whole_ring(pair, xs, how, seed):
    x = np.array(xs, dtype=np.int64)
    rng = np.random.default_rng(seed)
    expected = (x >= 0).astype(np.int64)
    # independent: the sign bit of the two's-complement word (bit 63 of the uint64 view)
    assert np.array_equal(expected, 1 - (x.view(np.uint64) >> np.uint64(63)).astype(np.int64))
    assert expected.tolist() == [int(v >= 0) for v in xs]
    cases, wants = [], []
    for shape in shapes(len(xs)):
        cases.append(split(x.reshape(shape), how, rng))
        wants.append(expected.reshape(shape))
    r0, r1 = pair.call(slp.sign_tests, cases)
    pair_agrees(r0, r1)
    for (bits, scale, rounds, own), want in zip(r0, wants):
        assert bits.shape == want.shape
        bad = np.nonzero(bits != want)
        assert not bad[0].size, f"wrong at {bad}: x = {x.reshape(want.shape)[bad]}, got {bits[bad]}"
        assert scale == 1                                # a bit at scale 1, like CrypTen's own
        assert rounds == (8 if want.size else 0)         # empty: no material, no exchange
        if want.size:
            assert np.array_equal(own, want)             # CrypTen's comparison agrees


# ----------------------------------------------------------------------------- truncation
D_ALL = list(range(1, 63))
D_DRAW = st.one_of(st.sampled_from([1, 2, 16, 32, 62]), st.sampled_from(D_ALL))


def trunc_rounds(d: int, n: int) -> int:
    """Online rounds of truncate_exact: open c, a 6-level prefix comparison, the bit conversion;
    when d is not a power of two the low comparison (ceil(log2 d) levels) runs after the full
    one. Nothing is exchanged for an empty input."""
    if n == 0:
        return 0
    return 8 if d & (d - 1) == 0 else 8 + (d - 1).bit_length()


def floor_oracle(xs: list[int], d: int) -> np.ndarray:
    py = [v >> d for v in xs]
    assert py == [math.floor(Fraction(v, 2**d)) for v in xs]
    return np.array(py, dtype=np.int64)


@given(xs=ring_vector(-TRUNC_MAX, TRUNC_MAX), ds=st.lists(D_DRAW, min_size=1, max_size=4),
       precision=st.sampled_from([0, 16, 32]), how=MASKS, seed=st.integers(0, 2**32 - 1))
@example(xs=[e for e in RING_EDGES if abs(e) <= TRUNC_MAX], ds=[1, 3, 16, 61, 62], precision=16,
         how="uniform", seed=0)
def test_truncate_exact_is_floor_on_its_whole_range(pair, xs, ds, precision, how, seed):
    x = np.array(xs, dtype=np.int64)
    rng = np.random.default_rng(seed)
    cases, wants = [], []
    for i, d in enumerate(ds):
        shape = shapes(len(xs))[i % len(shapes(len(xs)))]
        want = floor_oracle(xs, d)
        assert np.array_equal(want, np.right_shift(x, d))      # numpy's arithmetic shift
        s0, s1 = split(x.reshape(shape), how, rng)
        cases.append((s0, s1, precision, d))
        wants.append(want.reshape(shape))
    r0, r1 = pair.call(slp.truncations, cases)
    pair_agrees(r0, r1)
    for (ring, scale, rounds), want, d in zip(r0, wants, ds):
        assert ring.shape == want.shape
        bad = np.nonzero(ring != want)
        assert not bad[0].size, f"d={d}: wrong at {bad}: x = {x.reshape(want.shape)[bad]}, " \
                                f"got {ring[bad]}, expected {want[bad]}"
        assert scale == 2**precision                      # the result keeps x's encoder
        assert rounds == trunc_rounds(d, want.size)


def test_truncate_exact_every_d_on_edges(pair):
    """All d in 1..62 (powers of two and not) on the edges of the range and of each d."""
    rng = np.random.default_rng(3)
    cases, wants = [], []
    for d in D_ALL:
        xs = sorted({v for e in (0, 1, 2**d, 2**(d - 1), 2**61, TRUNC_MAX) for v in (e, e - 1, e + 1, -e)
                     if abs(v) <= TRUNC_MAX})
        s0, s1 = split(np.array(xs, dtype=np.int64), "uniform", rng)
        cases.append((s0, s1, 16, d))
        wants.append(floor_oracle(xs, d))
    r0, r1 = pair.call(slp.truncations, cases)
    pair_agrees(r0, r1)
    for (ring, scale, rounds), want, d in zip(r0, wants, D_ALL):
        assert np.array_equal(ring, want), d
        assert scale == 2**16
        assert rounds == trunc_rounds(d, len(want)), (d, rounds)


def test_truncate_exact_refuses_d_outside_1_to_62(pair):
    x = np.array([5, -5], dtype=np.int64)
    cases = [(x, np.zeros_like(x), 0, d) for d in (0, 63, 64, -1)]
    r0, r1 = pair.call(slp.truncations, cases)
    assert r0 == r1 == ["ValueError"] * 4

"""Property: every primitive of :mod:`protocols.compare` equals its plaintext twin and an exact
integer/Fraction oracle on its whole documented domain, for every shared/public mix.

One two-party session per module (fixture ``pair``); each hypothesis example evaluates whole
vectors, and every shared/public mix of the arguments, in a single call
(``tests.helpers.compare_programs.evaluate``). Inputs are fixed-point values ``k * 2**-16`` drawn
as ring integers ``k`` with log-uniform magnitudes from one unit to the documented maximum
(zeros, exact ties, neighbours one unit apart, negatives, the largest values), so that CrypTen's
encoding ``trunc(x * 2**16)`` and the twin see the same numbers; the off-grid tests check the
documented promise on arbitrary floats. Lengths 0 (empty), 1, odd and even; broadcasting where
the docstrings allow it. Shared arguments alternate between CrypTen's own sharing of a party's
input (``crypten.cryptensor(x, src)``) and raw random ring shares.

Domains (docs/protocols.md "Conventions and ranges" and the docstrings):

* ``ge(x, y)``: ``|x|, |y| < 2**47`` and ``|x - y| < 2**47``; result = ``[enc x >= enc y]``.
* ``ge_ratio(u1, v1, u2, v2)``: ``v > 0``, ``|u1 v2|, |u2 v1| < 2**30``; exact on the encodings.
* ``lex_ge(a, b, ta, tb, n)``: ``|a|, |b| < 2**46 / n``, ranks in ``[0, n)`` given (public or
  shared) as values whose encodings are the ranks (``rank * 2**-16``, as ``protocols.sort``).
* ``lex_ge_ratio``: ``|u1 v2|, |u2 v1| < 2**30 / n``, ``v > 0``, ranks as for ``lex_ge``.
* ``select(cond, a, b)`` / ``compare_exchange(swap, a, b)``: 0/1 condition, public or a shared
  bit (scale 1, what ``ge`` returns), ``|a|, |b|, |a - b| < 2**47``; exact (the result is the
  selected encoding). A shared *fixed-point* 0/1 condition (scale 2**16) is truncated once:
  exact for ``|a - b| < 2**30`` (see ``select``'s docstring).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocols.compare import compare_exchange, ge, ge_ratio, lex_ge, lex_ge_ratio, select
from tests.helpers import compare_programs as cp

F = 16
U = 2.0**-F
TOP = 2.0**47 - 2.0**-6          # the largest float64 below 2**47 (on the grid)
RING = 2**63


# ----------------------------------------------------------------------------- fixed point
def enc(x: float) -> int:
    """CrypTen's encoding trunc(x * 2**16) of a float64, exactly (power-of-two scaling)."""
    return int(float(x) * 65536.0)


def grid(k: int) -> float:
    """The grid value k * 2**-16 as a float64 (k rounded to 53 bits), clamped below 2**47."""
    x = math.ldexp(float(k), -F)
    return math.copysign(TOP, x) if abs(x) >= 2.0**47 else x


def encs(xs) -> list[int]:
    return [enc(x) for x in np.asarray(xs, dtype=np.float64).reshape(-1)]


def arr(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.float64)


def ring_split(ks, rng: np.random.Generator):
    """Random additive ring shares (share0, share1) of the int64 ring elements ``ks``."""
    ks = np.asarray(ks, dtype=np.int64)
    mask = rng.integers(-(2**63), 2**63 - 1, size=ks.shape, dtype=np.int64, endpoint=True)
    with np.errstate(over="ignore"):
        return ks - mask, mask


class Specs:
    """Builds input specs for ``compare_programs``; shared inputs alternate between a party's
    CrypTen sharing (src 0 / 1) and raw random ring shares."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.turn = 0

    def shared(self, xs, how: str | None = None):
        xs = arr(xs)
        how = how or ("fix0", "ring", "fix1")[self.turn % 3]
        self.turn += 1
        if how == "ring":
            ks = np.array(encs(xs), dtype=np.int64).reshape(xs.shape)
            s0, s1 = ring_split(ks, self.rng)
            return ("ring", s0, s1, F)
        return ("fix", xs, 0 if how == "fix0" else 1)

    def bit(self, bits):
        """A shared 0/1 at scale 1 (what ``ge`` returns), from random ring shares."""
        s0, s1 = ring_split(np.asarray(bits, dtype=np.int64), self.rng)
        return ("ring", s0, s1, 0)

    def rank(self, ranks):
        """Shared tie ranks: ring integer = rank at the default label (as ``protocols.sort``)."""
        s0, s1 = ring_split(np.asarray(ranks, dtype=np.int64), self.rng)
        return ("ring", s0, s1, F)

    def arg(self, xs, is_shared: bool):
        return self.shared(xs) if is_shared else ("pub", arr(xs))


def run(pair, cases) -> list:
    """Evaluate the cases in both parties; both must open the same values."""
    r0, r1 = pair.call(cp.evaluate, cases)
    assert len(r0) == len(r1) == len(cases)
    for c0, c1 in zip(r0, r1):
        for (s0, v0, b0), (s1, v1, b1) in zip(*((c0, c1) if isinstance(c0, list) else ([c0], [c1]))):
            assert (s0, b0) == (s1, b1) and np.array_equal(v0, v1)
    return r0


def check_bits(res, expected, label) -> None:
    shared, vals, bits = res
    expected = np.asarray(expected, dtype=np.int64)
    assert shared and bits == 0, (label, shared, bits)   # a shared bit at scale 1
    assert vals.shape == expected.shape, (label, vals.shape, expected.shape)
    bad = np.nonzero(vals != expected)
    assert not bad[0].size, f"{label}: wrong at {bad}: got {vals[bad]}, expected {expected[bad]}"


def check_twin_bits(twin, expected, label) -> None:
    twin = twin.numpy()
    assert twin.dtype == np.float64 and twin.shape == np.shape(expected), label
    bad = np.nonzero(twin != np.asarray(expected, dtype=np.float64))
    assert not bad[0].size, f"twin {label}: wrong at {bad}"


def mixes(names):
    """Every shared/public assignment of ``names`` with at least one shared (the 2PC path)."""
    for flags in itertools.product((False, True), repeat=len(names)):
        if any(flags):
            yield dict(zip(names, flags))


def mix_label(m: dict) -> str:
    return "".join(("S" if s else "P") for s in m.values())


# ----------------------------------------------------------------------------- strategies
def bit_length(lo: int, hi: int):
    """A bit length in [lo, hi], uniform (``st.integers`` would favour the small ones)."""
    return st.sampled_from(range(lo, hi + 1))


def ring_int(bits: int):
    """Integers with |k| < 2**bits: edge values, and log-uniform magnitudes (bit length 0..bits)."""
    if bits <= 0:
        return st.just(0)
    top = 2**bits - 1
    edges = st.sampled_from([0, 1, -1, 2, -2, top, -top, 2 ** (bits - 1), -(2 ** (bits - 1))])
    spread = st.tuples(bit_length(1, bits), st.booleans(), st.randoms(use_true_random=False)).map(
        lambda t: (-1 if t[1] else 1) * t[2].randrange(2 ** (t[0] - 1), 2 ** t[0]))
    return st.one_of(edges, spread, spread, spread)


def positive_int(bits: int):
    """Integers in [1, 2**bits) with log-uniform magnitudes (and the edges)."""
    bits = max(bits, 1)
    edges = st.sampled_from(sorted({1, 2, 2**bits - 1}))
    spread = st.tuples(bit_length(1, bits), st.randoms(use_true_random=False)).map(
        lambda t: t[1].randrange(2 ** (t[0] - 1), 2 ** t[0]))
    return st.one_of(edges, spread, spread, spread)


def vectors(elem, lo: int = 0, hi: int = 33):
    """Lists of ``elem`` of a length drawn uniformly from lo..hi (0, 1, odd and even)."""
    return bit_length(lo, hi).flatmap(lambda n: st.lists(elem, min_size=n, max_size=n))


@st.composite
def ge_pair(draw, bits: int = 63):
    """(x, y) on the grid with |x|, |y| < 2**47 and |x - y| < 2**47 (ge's domain)."""
    x = grid(draw(ring_int(bits)))
    kind = draw(st.sampled_from(["indep", "tie", "near", "mirror", "zero"]))
    if kind == "tie":
        y = x
    elif kind == "near":
        y = grid(enc(x) + draw(st.integers(-3, 3)))
    elif kind == "mirror":
        y = -x
    elif kind == "zero":
        y = 0.0
    else:
        y = grid(draw(ring_int(bits)))
    while abs(enc(x) - enc(y)) >= RING:   # |x - y| < 2**47: halve y's ring integer
        y = grid(enc(y) // 2)
    return (y, x) if draw(st.booleans()) else (x, y)


def _fit_product(a: float, b: float, budget: int) -> tuple[float, float]:
    """Halve the larger factor until |enc a * enc b| < 2**budget (float rounding of k > 2**53
    can push a product just over; such a factor is even, so halving stays on the grid)."""
    while abs(enc(a) * enc(b)) >= 2**budget:
        if abs(enc(a)) >= abs(enc(b)):
            assert enc(a) % 2 == 0
            a = a / 2
        else:
            assert enc(b) % 2 == 0
            b = b / 2
    return a, b


@st.composite
def ratio_quad(draw, budget: int = 62):
    """(u1, v1, u2, v2) on the grid with v > 0 and |enc u1 * enc v2|, |enc u2 * enc v1| < 2**budget,
    i.e. |u1 v2|, |u2 v1| < 2**(budget - 32): independent, exact ties, near ties (cross products
    one unit of 2**-32 apart) and zero numerators."""
    kind = draw(st.sampled_from(["indep", "indep", "tie", "near", "zero"]))
    if kind in ("indep", "zero"):
        bv1, bv2 = draw(bit_length(1, budget)), draw(bit_length(1, budget))
        v1, v2 = draw(positive_int(bv1)), draw(positive_int(bv2))
        u2 = draw(ring_int(budget - bv1))
        u1 = draw(ring_int(budget - bv2))
        if kind == "zero":
            u1, u2 = draw(st.sampled_from([(0, u2), (u1, 0), (0, 0)]))
    elif kind == "tie":   # u1 = a c, v1 = b c, u2 = a d, v2 = b d: u1 v2 = u2 v1 = a b c d
        total = draw(bit_length(0, budget))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=3, max_size=3)))
        ba, bb, bc, bd = cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], total - cuts[2]
        a = draw(ring_int(ba)) if ba else 0
        b, c, d = (draw(positive_int(t)) if t else 1 for t in (bb, bc, bd))
        u1, v1, u2, v2 = a * c, b * c, a * d, b * d
    else:                 # a b' - a' b = 1 (neighbours in a Farey sequence)
        bb = draw(bit_length(1, budget))
        b = draw(positive_int(bb)) + 1
        ba = max(budget - bb, 1)
        # often the largest numerator: cross products near 2**budget, beyond float64's 53 bits
        a = draw(st.one_of(ring_int(ba), st.sampled_from([2**ba - 1, -(2**ba) + 1, 2 ** (ba - 1) + 1])))
        if math.gcd(a, b) != 1:
            a = 1
        bp = pow(a, -1, b) if b > 1 else 1
        ap = (a * bp - 1) // b
        u1, v1, u2, v2 = a, b, ap, bp
    u1, v1, u2, v2 = (grid(k) for k in (u1, v1, u2, v2))
    u1, v2 = _fit_product(u1, v2, budget)
    u2, v1 = _fit_product(u2, v1, budget)
    assert v1 > 0 and v2 > 0
    quad = (u1, v1, u2, v2)
    return quad[2:] + quad[:2] if draw(st.booleans()) else quad


def ratio_oracle(u1, v1, u2, v2) -> np.ndarray:
    """[u1/v1 >= u2/v2] for v > 0, exactly: Fractions of the float64 inputs."""
    return np.array([Fraction(a) * Fraction(d) >= Fraction(c) * Fraction(b)
                     for a, b, c, d in zip(u1, v1, u2, v2)], dtype=np.int64)


def ratio_oracle_ring(u1, v1, u2, v2) -> np.ndarray:
    """The same from the ring encodings (python integers): enc u1 enc v2 >= enc u2 enc v1."""
    return np.array([p * s >= r * q for p, q, r, s in zip(encs(u1), encs(v1), encs(u2), encs(v2))],
                    dtype=np.int64)


def tie_bits(n_tie: int) -> int:
    return max(n_tie - 1, 0).bit_length()   # ceil(log2 n_tie)


SEEDS = st.integers(0, 2**32 - 1)


def examples(fraction: float) -> settings:
    """A fraction of the active profile's examples, for tests that evaluate many mixes per
    example (about 20 ms per comparison): default 20, thorough 400. The fractions below keep
    the suite inside its 10-minute budget on 2 cores; ``thorough`` scales them up."""
    return settings(max_examples=max(1, int(settings.default.max_examples * fraction)))


# ----------------------------------------------------------------------------- ge
@given(pairs=vectors(ge_pair()), w=vectors(ring_int(62).map(grid), 0, 7),
       seed=SEEDS)
def test_ge_equals_twin_and_integer_oracle(pair, pairs, w, seed):
    x = arr([p[0] for p in pairs])
    y = arr([p[1] for p in pairs])
    kx, ky = encs(x), encs(y)
    expected = np.array([a >= b for a, b in zip(kx, ky)], dtype=np.int64)
    assert expected.tolist() == [int(Fraction(a) >= Fraction(b)) for a, b in zip(x, y)]
    check_twin_bits(ge(torch.from_numpy(x), torch.from_numpy(y)), expected, "ge")

    # broadcasting: every pair of w (|w| < 2**46, so any difference is in range), and a python
    # float on the right (the docs' ``ge(x, 1.0)``)
    wv = arr(w)
    wc = wv.reshape(-1, 1)
    c = wv[0] if len(w) else 0.5
    outer = np.array([[enc(a) >= enc(b) for b in wv] for a in wv], dtype=np.int64).reshape(len(w), len(w))
    versus_c = np.array([enc(a) >= enc(c) for a in wv], dtype=np.int64)
    check_twin_bits(ge(torch.from_numpy(wc), torch.from_numpy(wv)), outer, "ge outer")

    sp = Specs(seed)
    cases, want = [], []
    for m in mixes(("x", "y")):
        for _ in range(2 if all(m.values()) else 1):
            cases.append(("ge", [sp.arg(x, m["x"]), sp.arg(y, m["y"])], {}))
            want.append((expected, f"ge {mix_label(m)}"))
        cases.append(("ge", [sp.arg(wc, m["x"]), sp.arg(wv, m["y"])], {}))
        want.append((outer, f"ge outer {mix_label(m)}"))
    cases.append(("ge", [sp.shared(wv), ("scalar", c)], {}))
    want.append((versus_c, "ge vs python float"))
    for res, (exp, label) in zip(run(pair, cases), want):
        check_bits(res, exp, label)


@given(xs=vectors(st.tuples(st.floats(-2.0**30, 2.0**30, allow_nan=False),
                           st.one_of(st.floats(-3.0, 3.0), st.floats(-2.0**30, 2.0**30)))),
       seed=SEEDS)
@example(xs=[(-0.6 * U, 1.2 * U), (0.5 * U, 0.9 * U), (0.9 * U, 1.1 * U), (-1e-300, 1e-300)], seed=0)
def test_ge_off_grid_compares_the_encodings(pair, xs, seed):
    """Off the grid 2PC compares trunc(x 2**16) with trunc(y 2**16): it agrees with the twin
    unless both encode to the same integer (then it says 1), in particular whenever
    |x - y| >= 2**-15 (one unit is not enough across zero: trunc rounds toward zero)."""
    x = arr([a for a, _ in xs])
    y = arr([a + d * U if abs(d) <= 3 else d for a, d in xs])
    expected = np.array([enc(a) >= enc(b) for a, b in zip(x, y)], dtype=np.int64)
    twin = ge(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    same_enc = np.array([enc(a) == enc(b) for a, b in zip(x, y)], dtype=bool)
    assert np.array_equal(expected[~same_enc], twin[~same_enc])
    assert np.all(twin[np.abs(x - y) >= 2 * U] == expected[np.abs(x - y) >= 2 * U])
    sp = Specs(seed)
    cases = [("ge", [sp.shared(x, "fix0") if m["x"] else ("pub", x),
                     sp.shared(y, "fix1") if m["y"] else ("pub", y)], {}) for m in mixes(("x", "y"))]
    for res, m in zip(run(pair, cases), mixes(("x", "y"))):
        check_bits(res, expected, f"ge off-grid {mix_label(m)}")


# ----------------------------------------------------------------------------- ge_ratio
RATIO_ARGS = ("u1", "v1", "u2", "v2")


@st.composite
def ratio_broadcast(draw):
    """u1, u2 vectors against one common (1,)-shaped v1, v2 (ratios to common denominators)."""
    bv1, bv2 = draw(bit_length(1, 61)), draw(bit_length(1, 61))
    v1, v2 = grid(draw(positive_int(bv1))), grid(draw(positive_int(bv2)))
    n = draw(bit_length(1, 9))
    u1 = [grid(draw(ring_int(62 - bv2))) for _ in range(n)]
    u2 = [grid(draw(ring_int(62 - bv1))) for _ in range(n)]
    # float rounding moves at most one factor of a product (the other has < 53 bits), and to
    # at most 2**bits: the products stay below 2**62
    assert all(abs(enc(a) * enc(v2)) < 2**62 for a in u1)
    assert all(abs(enc(a) * enc(v1)) < 2**62 for a in u2)
    return arr(u1), arr([v1]), arr(u2), arr([v2])


@given(quads=vectors(ratio_quad(), 1), bc=ratio_broadcast(), seed=SEEDS)
@examples(1 / 4)
# a near tie beyond float64: enc u1 * enc v2 - enc u2 * enc v1 = 1 at about 2**62
@example(quads=[tuple(grid(k) for k in (2147483643, 2147483647, 1610612732, 1610612735)),
                tuple(grid(k) for k in (1610612732, 1610612735, 2147483643, 2147483647))],
         bc=(arr([1.0]), arr([1.0]), arr([-1.0]), arr([1.0])), seed=1)
def test_ge_ratio_equals_twin_and_fraction_oracle_for_all_16_mixes(pair, quads, bc, seed):
    cols = [arr([q[i] for q in quads]) for i in range(4)]
    expected = ratio_oracle(*cols)
    assert np.array_equal(expected, ratio_oracle_ring(*cols))
    check_twin_bits(ge_ratio(*map(torch.from_numpy, cols)), expected, "ge_ratio PPPP")
    b_exp = ratio_oracle(bc[0], np.broadcast_to(bc[1], bc[0].shape), bc[2],
                         np.broadcast_to(bc[3], bc[2].shape))
    check_twin_bits(ge_ratio(*map(torch.from_numpy, bc)), b_exp, "ge_ratio broadcast PPPP")
    sp = Specs(seed)
    cases, want = [], []
    for m in mixes(RATIO_ARGS):
        cases.append(("ge_ratio", [sp.arg(c, m[k]) for c, k in zip(cols, RATIO_ARGS)], {}))
        want.append((expected, f"ge_ratio {mix_label(m)}"))
        cases.append(("ge_ratio", [sp.arg(c, m[k]) for c, k in zip(bc, RATIO_ARGS)], {}))
        want.append((b_exp, f"ge_ratio broadcast {mix_label(m)}"))
    for res, (exp, label) in zip(run(pair, cases), want):
        check_bits(res, exp, label)


def test_ge_ratio_regression_u1_v2_shared_v1_u2_public(pair):
    """Fixed defect: with u1, v2 shared and v1, u2 public the cross product u2*v1 was a real
    number next to a raw ring product. 1/1 >= 2/1 is false; -1/3 >= -2/6 is a tie (true)."""
    sp = Specs(5)
    u1, v1, u2, v2 = arr([1.0, -1.0]), arr([1.0, 3.0]), arr([2.0, -2.0]), arr([1.0, 6.0])
    cases = [("ge_ratio", [sp.shared(u1, how), ("pub", v1), ("pub", u2), sp.shared(v2, how)], {})
             for how in ("fix0", "fix1", "ring")]
    for res in run(pair, cases):
        check_bits(res, [0, 1], "ge_ratio SPPS")
    check_twin_bits(ge_ratio(*map(torch.from_numpy, (u1, v1, u2, v2))), [0, 1], "ge_ratio PPPP")


@given(quads=vectors(st.tuples(st.floats(-2.0**10, 2.0**10), st.floats(2.0**-10, 2.0**10),
                              st.floats(-2.0**10, 2.0**10), st.floats(2.0**-10, 2.0**10)), 1),
       seed=SEEDS)
@examples(1 / 6)
def test_ge_ratio_off_grid_agrees_outside_the_encoding_error(pair, quads, seed):
    """Off the grid each factor is encoded within one unit U (trunc when shared, round when a
    public factor multiplies a shared one), so the cross-product difference moves by less than
    (|u1| + |v2| + |u2| + |v1|) U + 2 U**2: beyond that margin 2PC must equal the twin."""
    cols = [arr([q[i] for q in quads]) for i in range(4)]
    u1, v1, u2, v2 = cols
    diff = np.array([float(Fraction(a) * Fraction(d) - Fraction(c) * Fraction(b))
                     for a, b, c, d in zip(u1, v1, u2, v2)])
    margin = (np.abs(u1) + np.abs(v2) + np.abs(u2) + np.abs(v1)) * U + 2 * U * U
    decided = np.abs(diff) > margin
    twin = ge_ratio(*map(torch.from_numpy, cols)).numpy().astype(np.int64)
    assert np.array_equal(twin, ratio_oracle(*cols))
    sp = Specs(seed)
    ms = list(mixes(RATIO_ARGS))
    cases = [("ge_ratio", [sp.shared(c, "fix0" if i % 2 else "fix1") if m[k] else ("pub", c)
                           for i, (c, k) in enumerate(zip(cols, RATIO_ARGS))], {}) for m in ms]
    for res, m in zip(run(pair, cases), ms):
        shared, vals, bits = res
        assert shared and bits == 0 and set(np.unique(vals)) <= {0, 1}
        assert np.array_equal(vals[decided], twin[decided]), mix_label(m)


# ----------------------------------------------------------------------------- lex_ge
LEX_ARGS = ("a", "b", "ta", "tb")
N_TIE = st.one_of(st.sampled_from([1, 2, 3, 64, 1023, 1024, 1025, 2**20]), bit_length(1, 70),
                  positive_int(20))


@st.composite
def lex_case(draw):
    n_tie = draw(N_TIE)
    bits = 62 - tie_bits(n_tie)     # |enc a| * n_tie < 2**62, i.e. |a| < 2**46 / n_tie
    kmax = (2**62 - 1) // n_tie
    key = st.one_of(ring_int(bits), st.sampled_from([kmax, -kmax, kmax - 1, -kmax + 1]))
    rank = st.one_of(st.integers(0, n_tie - 1), st.sampled_from([0, n_tie - 1]))

    def fit(x: float) -> float:     # clamp to |enc| <= kmax, staying on the grid
        x = grid(max(-kmax, min(kmax, enc(x))))
        while abs(enc(x)) > kmax:   # rounded above 2**53 units: float steps are whole units
            x = math.nextafter(x, 0.0)
        return x

    @st.composite
    def element(draw2):
        a = fit(grid(draw2(key)))
        kind = draw2(st.sampled_from(["indep", "tie", "tie", "near"]))
        if kind == "tie":
            b = a
        elif kind == "near":
            b = fit(grid(enc(a) + draw2(st.integers(-2, 2))))
        else:
            b = fit(grid(draw2(key)))
        ra = draw2(rank)
        rb = ra if draw2(st.booleans()) else draw2(rank)
        return a, b, ra, rb

    return n_tie, draw(vectors(element()))


@given(case=lex_case(), seed=SEEDS)
@examples(1 / 4)
@example(case=(1, [(2.0**31, 2.0**31 - U, 0, 0), (2.0**31 - U, 2.0**31, 0, 0)]), seed=2)
@example(case=(4, [(2.0**20 + U, 2.0**20, 0, 3), (-(2.0**43) + U, -(2.0**43) + U, 2, 1)]), seed=3)
def test_lex_ge_equals_twin_and_oracle_for_all_mixes(pair, case, seed):
    n_tie, elems = case
    a, b = arr([e[0] for e in elems]), arr([e[1] for e in elems])
    ra, rb = [e[2] for e in elems], [e[3] for e in elems]
    ta, tb = arr(ra) * U, arr(rb) * U     # values whose encodings are the ranks
    expected = np.array([(p > q) or (p == q and s >= t)
                         for p, q, s, t in zip(encs(a), encs(b), ra, rb)], dtype=np.int64)
    check_twin_bits(lex_ge(*map(torch.from_numpy, (a, b, ta, tb)), n_tie), expected, "lex_ge PPPP")
    # the twin also takes the ranks as integers
    check_twin_bits(lex_ge(torch.from_numpy(a), torch.from_numpy(b), torch.tensor(ra, dtype=torch.long),
                           torch.tensor(rb, dtype=torch.long), n_tie), expected, "lex_ge int ranks")
    sp = Specs(seed)
    cases = []
    for m in mixes(LEX_ARGS):
        cases.append(("lex_ge", [sp.arg(a, m["a"]), sp.arg(b, m["b"]),
                                 sp.rank(ra) if m["ta"] else ("pub", ta),
                                 sp.rank(rb) if m["tb"] else ("pub", tb)], {"n_tie": n_tie}))
    labels = [f"lex_ge n_tie={n_tie} {mix_label(m)}" for m in mixes(LEX_ARGS)]
    # public ranks may also be integer tensors (the ring integers themselves)
    int_ranks = [("pub", np.array(ra, dtype=np.int64)), ("pub", np.array(rb, dtype=np.int64))]
    cases.append(("lex_ge", [sp.shared(a), ("pub", b)] + int_ranks, {"n_tie": n_tie}))
    labels.append(f"lex_ge n_tie={n_tie} SP, integer ranks")
    for res, label in zip(run(pair, cases), labels):
        check_bits(res, expected, label)


LEXR_ARGS = RATIO_ARGS + ("ta", "tb")


@st.composite
def lex_ratio_case(draw):
    n_tie = draw(N_TIE)
    budget = 62 - tie_bits(n_tie)    # |u1 v2|, |u2 v1| < 2**30 / n_tie
    rank = st.one_of(st.integers(0, n_tie - 1), st.sampled_from([0, n_tie - 1]))
    elems = draw(vectors(st.tuples(ratio_quad(budget), rank, rank), 1, 17))
    return n_tie, elems


@given(case=lex_ratio_case(), seed=SEEDS)
@examples(1 / 5)
# near ties beyond float64 (cross products 2**-32 apart at about 2**30) with equal ranks
@example(case=(1, [(tuple(grid(k) for k in (2147483643, 2147483647, 1610612732, 1610612735)), 0, 0),
                   (tuple(grid(k) for k in (1610612732, 1610612735, 2147483643, 2147483647)), 0, 0)]),
         seed=4)
def test_lex_ge_ratio_equals_twin_and_oracle_for_all_64_mixes(pair, case, seed):
    n_tie, elems = case
    cols = [arr([e[0][i] for e in elems]) for i in range(4)]
    ra, rb = [e[1] for e in elems], [e[2] for e in elems]
    ta, tb = arr(ra) * U, arr(rb) * U
    p = [Fraction(x) * Fraction(y) for x, y in zip(cols[0], cols[3])]
    q = [Fraction(x) * Fraction(y) for x, y in zip(cols[2], cols[1])]
    expected = np.array([(s > t) or (s == t and c >= d) for s, t, c, d in zip(p, q, ra, rb)],
                        dtype=np.int64)
    twin = lex_ge_ratio(tuple(map(torch.from_numpy, cols[:2])), tuple(map(torch.from_numpy, cols[2:])),
                        torch.from_numpy(ta), torch.from_numpy(tb), n_tie)
    check_twin_bits(twin, expected, "lex_ge_ratio all public")
    sp = Specs(seed)
    cases = []
    for m in mixes(LEXR_ARGS):
        args = [sp.arg(c, m[k]) for c, k in zip(cols, RATIO_ARGS)]
        args += [sp.rank(ra) if m["ta"] else ("pub", ta), sp.rank(rb) if m["tb"] else ("pub", tb)]
        cases.append(("lex_ge_ratio", args, {"n_tie": n_tie}))
    labels = [f"lex_ge_ratio n_tie={n_tie} {mix_label(m)}" for m in mixes(LEXR_ARGS)]
    int_ranks = [("pub", np.array(ra, dtype=np.int64)), ("pub", np.array(rb, dtype=np.int64))]
    cases.append(("lex_ge_ratio", [sp.shared(cols[0]), ("pub", cols[1]), ("pub", cols[2]),
                                   sp.shared(cols[3])] + int_ranks, {"n_tie": n_tie}))
    labels.append(f"lex_ge_ratio n_tie={n_tie} SPPS, integer ranks")
    for res, label in zip(run(pair, cases), labels):
        check_bits(res, expected, label)


# ----------------------------------------------------------------------------- select
@given(elems=vectors(st.tuples(st.integers(0, 1), ge_pair())), seed=SEEDS)
@example(elems=[(1, (2.0**40 + 1.0, -(2.0**40))), (1, (-TOP, 0.0)), (0, (3.0, 2.0))], seed=6)
def test_select_is_exact_for_every_condition_kind_and_mix(pair, elems, seed):
    cond = np.array([e[0] for e in elems], dtype=np.int64)
    a, b = arr([e[1][0] for e in elems]), arr([e[1][1] for e in elems])
    want = np.where(cond != 0, encs(a), encs(b)) if len(elems) else np.zeros(0, dtype=np.int64)
    twin = select(torch.from_numpy(cond.astype(np.float64)), torch.from_numpy(a), torch.from_numpy(b))
    assert np.array_equal(twin.numpy(), np.where(cond != 0, a, b))
    # broadcasting: b a single value (shape (1,)), within range of every a
    small = np.abs(a) < 2.0**46
    a_b, c_b = a[small], cond[small]
    b0 = arr([grid(-(2**61) + 3)])
    want_b = np.where(c_b != 0, encs(a_b), enc(b0[0])).astype(np.int64)
    sp = Specs(seed)
    conds = {
        "public float": lambda c: ("pub", c.astype(np.float64)),
        "public int": lambda c: ("pub", c.astype(np.int64)),
        "shared bit": sp.bit,
    }
    cases, labels, wants = [], [], []
    for cname, mk in conds.items():
        for m in mixes(("a", "b")) if cname.startswith("public") else ({"a": s, "b": t}
                                                                       for s in (0, 1) for t in (0, 1)):
            cases.append(("select", [mk(cond), sp.arg(a, m["a"]), sp.arg(b, m["b"])], {}))
            labels.append(f"select {cname} {mix_label(m)}")
            wants.append(want)
            cases.append(("select", [mk(c_b), sp.arg(a_b, m["a"]), sp.arg(b0, m["b"])], {}))
            labels.append(f"select broadcast {cname} {mix_label(m)}")
            wants.append(want_b)
    for res, label, exp in zip(run(pair, cases), labels, wants):
        shared, vals, bits = res
        assert shared and bits == F, (label, shared, bits)
        assert vals.shape == exp.shape, (label, vals.shape, exp.shape)
        bad = np.nonzero(vals != exp)
        assert not bad[0].size, f"{label}: wrong at {bad}: got {vals[bad]}, expected {exp[bad]}"


@given(elems=vectors(st.tuples(st.integers(0, 1), ge_pair(bits=45)), 0, 17), seed=SEEDS)
@examples(1 / 6)
def test_select_with_a_fixed_point_condition_within_its_range(pair, elems, seed):
    """A shared 0/1 at scale 2**16 (not a comparison bit) is multiplied and truncated once:
    exact while |a - b| < 2**30 (ring products below 2**62)."""
    cond = arr([e[0] for e in elems])
    a, b = arr([e[1][0] for e in elems]), arr([e[1][1] for e in elems])
    want = np.where(cond != 0, encs(a), encs(b)) if len(elems) else np.zeros(0, dtype=np.int64)
    sp = Specs(seed)
    ms = [{"a": s, "b": t} for s in (0, 1) for t in (0, 1)]
    cases = [("select", [sp.shared(cond), sp.arg(a, m["a"]), sp.arg(b, m["b"])], {}) for m in ms]
    for res, m in zip(run(pair, cases), ms):
        shared, vals, bits = res
        assert shared and bits == F and np.array_equal(vals, want), mix_label(m)


# ----------------------------------------------------------------------------- compare_exchange
@given(swap=vectors(st.integers(0, 1), 1), comps=st.integers(1, 3), data=st.data(),
       seed=SEEDS)
def test_compare_exchange_is_exact_for_every_mix(pair, swap, comps, data, seed):
    n = len(swap)
    sw = np.array(swap, dtype=np.int64)
    pairs = [data.draw(st.lists(ge_pair(), min_size=n, max_size=n)) for _ in range(comps)]
    xs = [arr([p[0] for p in ps]) for ps in pairs]
    ys = [arr([p[1] for p in ps]) for ps in pairs]
    new_a, new_b = compare_exchange(torch.from_numpy(sw.astype(np.float64)),
                                    [torch.from_numpy(x) for x in xs], [torch.from_numpy(y) for y in ys])
    for i in range(comps):
        assert np.array_equal(new_a[i].numpy(), np.where(sw != 0, ys[i], xs[i]))
        assert np.array_equal(new_b[i].numpy(), np.where(sw != 0, xs[i], ys[i]))
    all_mixes = list(itertools.product((False, True), repeat=2 * comps))
    if comps == 3:   # 64 mixes per swap kind: a drawn handful (every mix is covered at comps <= 2)
        all_mixes = data.draw(st.lists(st.sampled_from(all_mixes), min_size=1, max_size=6))
    sp = Specs(seed)
    cases, meta = [], []
    for swap_shared in (False, True):
        for flags in all_mixes:
            if not swap_shared and not any(flags):
                continue
            sspec = sp.bit(sw) if swap_shared else ("pub", sw.astype(np.float64))
            a_specs = [sp.arg(xs[i], flags[2 * i]) for i in range(comps)]
            b_specs = [sp.arg(ys[i], flags[2 * i + 1]) for i in range(comps)]
            cases.append(("compare_exchange", [sspec, a_specs, b_specs], {}))
            meta.append((swap_shared, flags))
    for res, (swap_shared, flags) in zip(run(pair, cases), meta):
        label = f"compare_exchange swap {'S' if swap_shared else 'P'} " + \
                "".join("S" if f else "P" for f in flags)
        outs = [(np.where(sw != 0, ys[i], xs[i]), i, 2 * i) for i in range(comps)] + \
               [(np.where(sw != 0, xs[i], ys[i]), i, 2 * i) for i in range(comps)]
        assert len(res) == 2 * comps
        for (shared, vals, bits), (exp, i, _) in zip(res, outs):
            if swap_shared or flags[2 * i] or flags[2 * i + 1]:
                assert shared and bits == F, label
                assert np.array_equal(vals, np.array(encs(exp), dtype=np.int64).reshape(exp.shape)), \
                    (label, i, vals, encs(exp))
            else:   # public pair under a public swap stays public: the twin's torch.where
                assert not shared and np.array_equal(vals, exp), label


# ----------------------------------------------------------------------------- costs
def test_online_rounds_match_the_documented_costs(pair):
    """Rounds of one call (docs/protocols.md): nothing is truncated, so no extra rounds."""
    sp = Specs(9)
    x, y = arr([1.5, -2.0, 3.0]), arr([1.5, 2.0, -4.0])
    ranks = arr([0, 1, 2]) * U
    cases = [
        ("ge", [sp.shared(x), sp.shared(y)], {}),
        ("ge", [sp.shared(x), ("pub", y)], {}),
        ("ge_ratio", [sp.shared(x), sp.shared(y * y + 1), sp.shared(y), sp.shared(x * x + 1)], {}),
        ("ge_ratio", [sp.shared(x), ("pub", y * y + 1), ("pub", y), sp.shared(x * x + 1)], {}),
        ("ge_ratio", [sp.shared(x), ("pub", y * y + 1), sp.shared(y), ("pub", x * x + 1)], {}),
        ("lex_ge", [sp.shared(x), sp.shared(y), ("pub", ranks), sp.rank([2, 1, 0])], {"n_tie": 3}),
        ("lex_ge_ratio", [sp.shared(x), sp.shared(y * y + 1), sp.shared(y), sp.shared(x * x + 1),
                          sp.rank([0, 1, 2]), ("pub", ranks)], {"n_tie": 3}),
        ("select", [sp.bit([1, 0, 1]), ("pub", x), ("pub", y)], {}),
        ("select", [sp.bit([1, 0, 1]), sp.shared(x), sp.shared(y)], {}),
        ("select", [("pub", arr([1, 0, 1])), sp.shared(x), ("pub", y)], {}),
        ("compare_exchange", [sp.bit([1, 0, 1]), [sp.shared(x), ("pub", y)], [sp.shared(y), sp.shared(x)]], {}),
        ("compare_exchange", [("pub", arr([1, 0, 1])), [sp.shared(x)], [sp.shared(y)]], {}),
    ]
    expected = [8, 8, 9, 9, 8, 8, 9, 0, 1, 0, 1, 0]
    r0, r1 = pair.call(cp.online_rounds, cases)
    assert r0 == r1 == expected


# ----------------------------------------------------------------------------- empty inputs
def _empty_cases(sp: Specs, stacked: bool) -> list:
    """Length-0 inputs (and (0, 3) batches) for every primitive; ``stacked``: the mixes whose
    Beaver multiplication stacks tensors (ge_ratio / lex_ge_ratio with u1, v1, u2, v2 shared,
    compare_exchange with a shared swap)."""
    e, e2, row = arr([]), np.zeros((0, 1)), arr([1.0, -2.0, 0.5])
    if stacked:
        return [("ge_ratio", [sp.shared(e) for _ in range(4)], {}),
                ("lex_ge_ratio", [sp.shared(e) for _ in range(4)] + [("pub", e), sp.rank([])], {"n_tie": 2}),
                ("compare_exchange", [sp.bit([]), [sp.shared(e)], [("pub", e)]], {})]
    cases = []
    for m in mixes(("x", "y")):
        cases.append(("ge", [sp.arg(e, m["x"]), sp.arg(e, m["y"])], {}))
        cases.append(("ge", [sp.arg(e2, m["x"]), sp.arg(row, m["y"])], {}))   # (0, 3)
    for m in mixes(RATIO_ARGS):
        if not all(m.values()):
            cases.append(("ge_ratio", [sp.arg(e, m[k]) for k in RATIO_ARGS], {}))
    for m in mixes(LEX_ARGS):
        cases.append(("lex_ge", [sp.arg(e, m["a"]), sp.arg(e, m["b"]),
                                 sp.rank([]) if m["ta"] else ("pub", e),
                                 sp.rank([]) if m["tb"] else ("pub", e)], {"n_tie": 2}))
    cases.append(("lex_ge_ratio", [sp.shared(e), ("pub", e), sp.shared(e), ("pub", e),
                                   sp.rank([]), ("pub", e)], {"n_tie": 2}))
    for m in mixes(("a", "b")):
        cases.append(("select", [("pub", e), sp.arg(e, m["a"]), sp.arg(e, m["b"])], {}))
        cases.append(("select", [("pub", np.zeros((0, 3))), sp.arg(row, m["a"]), sp.arg(row, m["b"])], {}))
    for s_a in (False, True):
        for s_b in (False, True):
            cases.append(("select", [sp.bit([]), sp.arg(e, s_a), sp.arg(e, s_b)], {}))
    cases.append(("compare_exchange", [("pub", e), [sp.shared(e)], [("pub", e)]], {}))
    return cases


def _check_empty(results, cases) -> None:
    for res, (name, specs, _) in zip(results, cases):
        outs = res if isinstance(res, list) else [res]
        assert all(shared and vals.size == 0 for shared, vals, _ in outs), name
        if name in ("ge", "select"):   # broadcast shape, e.g. (0, 1) against (3,) -> (0, 3)
            want = np.broadcast_shapes(*(np.shape(sp[1]) for sp in specs))
            assert res[1].shape == want, (name, res[1].shape, want)


def test_empty_inputs(pair):
    cases = _empty_cases(Specs(11), stacked=False)
    _check_empty(run(pair, cases), cases)


def test_empty_inputs_of_stacked_products(pair):
    cases = _empty_cases(Specs(12), stacked=True)
    _check_empty(run(pair, cases), cases)

"""Division of a sharing by a public integer (``mpc.public_division``, CrypTen's ``div`` by an int).

Checked against exact rational arithmetic (``fractions.Fraction``):

1. the algorithm alone, on plaintext values with an adversarial truncation (each call chooses
   floor or floor + 1, as the dealer mode's truncation may): |q - x / n| <= ``error_bound(n)``
   for |x| < 2**62 and n up to 2**32, and the bound itself is below 1 + 2**-20 units;
2. in 2PC, both offline modes, through CrypTen's own ``div`` on uniformly split shares: divisors
   1 .. 2**16 (edges and log-uniform), ring values across the whole fixed-point range
   (|x| < 2**62, log-uniform magnitudes), negative divisors, per-element divisor tensors, and
   the cost: three truncation rounds per divisor in dealer mode (one for a power of two).

One long-lived session per mode (``PartyPair``); each hypothesis example is one call.
"""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mpc.public_division import MAX_DIVISOR, RANGE_BITS, divide_share, error_bound, plan
from tests.helpers.crypten_conformance_programs import divide_ring
from tests.helpers.ring_shares import split

pytestmark = pytest.mark.timeout(600)

X_MAX = 2**RANGE_BITS - 1


@st.composite
def ring_value(draw, bits: int = RANGE_BITS) -> int:
    """|x| < 2**bits: log-uniform magnitudes from 0, the extremes, and multiples of small n."""
    kind = draw(st.sampled_from(["log", "log", "edge", "uniform"]))
    if kind == "edge":
        return draw(st.sampled_from([0, 1, -1, 2**bits - 1, -(2**bits) + 1, 2**31, -(2**31), 3 * 2**40]))
    if kind == "uniform":
        return draw(st.integers(-(2**bits) + 1, 2**bits - 1))
    b = draw(st.integers(1, bits))
    return draw(st.integers(2 ** (b - 1), 2**b - 1)) * (-1 if draw(st.booleans()) else 1)


@st.composite
def divisor(draw, top: int = 2**16) -> int:
    kind = draw(st.sampled_from(["edge", "log", "log"]))
    if kind == "edge":
        return draw(st.sampled_from([d for d in (1, 2, 3, 5, 7, 9, 10, 120, 255, 1000, 2**12, 2**16 - 1, 2**16,
                                                 2**16 + 1, 2**31 - 1, 2**32) if d <= top]))
    b = draw(st.integers(1, top.bit_length() - 1))
    return draw(st.integers(2 ** (b - 1) + 1, 2**b))


def _off_by(q: int, x: int, n: int) -> Fraction:
    return abs(Fraction(q) - Fraction(x, n))


# ============================================================================ 1. the algorithm alone
@given(n=divisor(top=MAX_DIVISOR), xs=st.lists(ring_value(), min_size=1, max_size=20), seed=st.integers(0, 2**32))
@example(n=3, xs=[X_MAX, -X_MAX, 0, 1, -1], seed=0)
@example(n=2**16 - 1, xs=[X_MAX, -X_MAX, 2**62 - 2**16], seed=1)
@example(n=MAX_DIVISOR, xs=[X_MAX, -X_MAX, 1], seed=2)
def test_plaintext_division_with_any_truncation_rounding_is_within_bound(n, xs, seed):
    rng = random.Random(seed)

    def truncate(v: torch.Tensor, d: int) -> torch.Tensor:
        assert 1 <= d <= RANGE_BITS and bool((v.abs() < 2**RANGE_BITS).all()), "outside the truncation's domain"
        # floor, or one more, chosen per element as an adversary would
        return torch.div(v, 2**d, rounding_mode="floor") + torch.tensor([rng.randint(0, 1) for _ in range(v.numel())])

    for sign in (1, -1):
        q = divide_share(torch.tensor(xs, dtype=torch.int64), sign * n, truncate).tolist()
        for qi, xi in zip(q, xs):
            assert _off_by(qi, xi, sign * n) <= Fraction(error_bound(n)), (xi, sign * n, qi)


@pytest.mark.parametrize("n", [2, 3, 7, 9, 120, 1000, 2**16 - 1, 2**16 + 1, 2**31 - 1, 2**32])
def test_plan_keeps_every_truncation_in_its_domain_and_bound_near_one_unit(n):
    p = plan(n)
    assert p.a * n + p.b == 2**p.s and 0 <= p.b < n
    y_max = 2 ** (RANGE_BITS - p.s) * p.b + 2**p.s
    assert y_max * p.m1 < 2**RANGE_BITS and 1 <= p.k1 <= RANGE_BITS and 1 <= p.s <= RANGE_BITS
    assert 1 <= p.k2 <= RANGE_BITS
    assert 1.0 <= p.bound < 1 + 2**-20


def test_division_by_zero_and_out_of_range_divisors_are_refused():
    with pytest.raises(ZeroDivisionError):
        divide_share(torch.tensor([5]), 0, lambda v, d: v)
    with pytest.raises(ValueError):
        plan(MAX_DIVISOR + 1)


# ============================================================================ 2. in 2PC, both modes
@pytest.fixture(scope="module", params=["dealer", "two-party"])
def session(request, session_of):
    return request.param, session_of(request.param)


def _shares(xs, seed):
    return split(np.array(xs, dtype=np.int64), "uniform", np.random.default_rng(seed))


@given(n=divisor(), xs=st.lists(ring_value(), min_size=1, max_size=24), negate=st.booleans(),
       seed=st.integers(0, 2**32))
@example(n=9, xs=[X_MAX, -X_MAX, 0, 9 * 2**16, -1], negate=False, seed=0)
@example(n=2**16 - 1, xs=[X_MAX, -X_MAX, 1, -1], negate=True, seed=1)
def test_division_in_2pc_matches_exact_quotient(session, n, xs, negate, seed):
    offline, pair = session
    d = -n if negate else n
    s0, s1 = _shares(xs, seed)
    (q0, step0), (q1, _) = pair.call(divide_ring, s0, s1, d)
    assert np.array_equal(q0, q1)
    for qi, xi in zip(q0.tolist(), xs):
        assert _off_by(qi, xi, d) <= Fraction(error_bound(n)), (offline, xi, d, qi)
    if offline == "dealer":   # one truncation round for a power of two, else three
        power = n & (n - 1) == 0 and not negate
        assert step0["online_rounds"] == (0 if n == 1 else 1 if power else 3), step0


def test_per_element_divisors_and_fixed_point_values(session):
    """A public divisor tensor (broadcast), at CrypTen's 16 fractional bits, opened as reals."""
    offline, pair = session
    rng = np.random.default_rng(5)
    reals = rng.uniform(-2.0**30, 2.0**30, size=(3, 8)) * rng.choice([1e-9, 1e-4, 1.0], size=(3, 8))
    ring = np.trunc(reals * 2**16).astype(np.int64)
    divisors = np.array([1, 3, 4, 9, 120, 65535, 7, 1000], dtype=np.int64)
    s0, s1 = _shares(ring, 6)
    (q0, _), _ = pair.call(divide_ring, s0, s1, divisors, 16)
    for qi, xi, n in zip(q0.ravel().tolist(), ring.ravel().tolist(), np.broadcast_to(divisors, ring.shape).ravel().tolist()):
        assert _off_by(qi, xi, n) <= Fraction(error_bound(n)), (offline, xi, n, qi)

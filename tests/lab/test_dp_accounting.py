"""The Gaussian accountant against independent oracles: scipy's normal CDF, numerical
integration of the privacy-loss definition, and known properties of the Gaussian mechanism."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, optimize, special, stats

from lab.dp_accounting import (
    composed_mu,
    delta_for_epsilon,
    epsilon_for_delta,
    epsilon_spent,
    log_ndtr,
    rdp_epsilon,
)

SETTINGS = settings(max_examples=40, deadline=None)


def bw_delta(eps: float, mu: float) -> float:
    """Balle & Wang 2018, Thm. 8, written with scipy (the oracle for the closed form)."""
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def integral_delta(eps: float, mus: list[float]) -> float:
    """delta(eps) = integral of max(0, p - e^eps q) for P = N(mus, I), Q = N(0, I): the
    definition of the tightest delta, integrated numerically (no closed form, no composition rule)."""
    norm_const = (2 * math.pi) ** (-len(mus) / 2)
    e_eps = math.exp(eps)

    def gap(*x: float) -> float:
        p = norm_const * math.exp(-0.5 * sum((xi - m) ** 2 for xi, m in zip(x, mus)))
        q = norm_const * math.exp(-0.5 * sum(xi * xi for xi in x))
        return max(0.0, p - e_eps * q)

    if len(mus) == 1:
        return integrate.quad(gap, -12.0, 12.0 + mus[0], limit=200, epsabs=1e-11)[0]
    lo = [-9.0, -9.0]
    hi = [9.0 + mus[0], 9.0 + mus[1]]
    return integrate.dblquad(lambda y, x: gap(x, y), lo[0], hi[0], lo[1], hi[1],
                             epsabs=1e-9, epsrel=1e-7)[0]


@SETTINGS
@given(st.floats(-1000.0, 8.0))
def test_log_ndtr_matches_scipy_including_far_tail(x):
    assert log_ndtr(x) == pytest.approx(float(special.log_ndtr(x)), rel=1e-10, abs=1e-13)


@SETTINGS
@given(st.floats(0.05, 8.0), st.floats(0.0, 20.0))
def test_delta_matches_balle_wang_closed_form(mu, eps):
    want = bw_delta(eps, mu)
    assert delta_for_epsilon(eps, mu) == pytest.approx(want, rel=1e-7, abs=1e-15)


@pytest.mark.parametrize("mu,eps", [(0.5, 0.0), (1.0, 0.5), (1.0, 2.0), (3.0, 4.0)])
def test_single_mechanism_matches_numerical_integral(mu, eps):
    assert delta_for_epsilon(eps, mu) == pytest.approx(integral_delta(eps, [mu]), rel=1e-6, abs=1e-10)


def test_heterogeneous_composition_matches_two_dimensional_integral():
    # two Gaussian releases with ratios 0.8 and 1.5; the 2-D integral knows nothing of
    # sqrt-sum composition
    mus, eps = [0.8, 1.5], 1.0
    want = integral_delta(eps, mus)
    got = delta_for_epsilon(eps, composed_mu([1 / 0.8, 1 / 1.5]))
    assert got == pytest.approx(want, rel=1e-5)


@SETTINGS
@given(st.floats(0.02, 0.98), st.floats(0.05, 6.0))
def test_epsilon_inverts_delta_like_a_root_finder(delta, mu):
    eps = epsilon_for_delta(delta, mu)
    if bw_delta(0.0, mu) <= delta:
        assert eps == 0.0
    else:
        root = optimize.brentq(lambda e: bw_delta(e, mu) - delta, 0.0, 200.0, xtol=1e-13)
        assert eps == pytest.approx(root, rel=1e-8, abs=1e-10)


@SETTINGS
@given(st.floats(0.3, 20.0), st.integers(1, 200), st.sampled_from([1e-3, 1e-5, 1e-7]))
def test_k_identical_mechanisms_equal_one_with_sigma_over_sqrt_k(z, k, delta):
    assert epsilon_spent([z] * k, delta) == pytest.approx(
        epsilon_spent([z / math.sqrt(k)], delta), rel=1e-9, abs=1e-12)


@SETTINGS
@given(st.floats(0.3, 10.0), st.floats(1.01, 3.0), st.integers(1, 50),
       st.sampled_from([1e-3, 1e-5, 1e-8]))
def test_epsilon_decreases_with_noise_and_grows_with_releases(z, factor, steps, delta):
    base = epsilon_spent([z] * steps, delta)
    assert epsilon_spent([z * factor] * steps, delta) <= base
    assert epsilon_spent([z] * (steps + 1), delta) >= base
    assert epsilon_spent([z] * steps, delta * 10) <= base
    # a sensitivity of 2S is the same mechanism as sensitivity S with half the noise
    assert epsilon_spent([z] * steps, delta, 2.0) == pytest.approx(
        epsilon_spent([z / 2] * steps, delta), rel=1e-9)


@SETTINGS
@given(st.floats(0.01, 0.999), st.sampled_from([1e-2, 1e-5, 1e-9]))
def test_classical_calibration_is_valid_below_one(eps, delta):
    # Dwork & Roth, Thm. A.1: z = sqrt(2 ln(1.25/delta)) / eps gives (eps, delta)-DP for eps < 1;
    # the exact accountant must never report more
    z = math.sqrt(2 * math.log(1.25 / delta)) / eps
    assert epsilon_spent([z], delta) <= eps


@SETTINGS
@given(st.floats(0.05, 30.0), st.sampled_from([1e-3, 1e-5, 1e-9]))
def test_rdp_bound_is_never_below_the_exact_value(mu, delta):
    exact = epsilon_for_delta(delta, mu)
    rdp = rdp_epsilon(delta, mu)
    assert rdp >= exact - 1e-9
    # and not absurdly loose: standard conversion at its optimal order is an upper bound on it
    assert rdp <= mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)) + 1e-9


def test_edge_cases_and_errors():
    assert composed_mu([]) == 0.0 and epsilon_spent([], 1e-5) == 0.0
    assert epsilon_spent([math.inf, math.inf], 1e-5) == 0.0
    assert epsilon_spent([1.0, 0.0], 1e-5) == math.inf
    assert delta_for_epsilon(math.inf, 2.0) == 0.0
    for bad in (lambda: composed_mu([-1.0]), lambda: composed_mu([1.0], 0.0),
                lambda: epsilon_for_delta(0.0, 1.0), lambda: epsilon_for_delta(1.0, 1.0),
                lambda: delta_for_epsilon(-0.1, 1.0), lambda: delta_for_epsilon(1.0, -1.0),
                lambda: rdp_epsilon(1e-5, 1.0, orders=[1.0])):
        with pytest.raises(ValueError):
            bad()

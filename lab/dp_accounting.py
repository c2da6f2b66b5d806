"""(epsilon, delta) spent by a composition of Gaussian mechanisms.

A Gaussian mechanism releases f(D) + N(0, s^2 I) where f has L2 sensitivity Delta. Its privacy
loss depends on the ratio mu = Delta / s only, and composing k of them (adaptively or not) is
exactly one Gaussian mechanism with mu = sqrt(sum_i mu_i^2): the privacy-loss random variable
of each is N(mu_i^2 / 2, mu_i^2) and the sum of independent Gaussians is Gaussian (Dong, Roth and
Su 2019, "Gaussian Differential Privacy", Cor. 3.3; Smith and Thakurta 2022 for noise levels
chosen from earlier outputs). Its exact (epsilon, delta) curve is the one of Balle and Wang 2018
("Improving the Gaussian Mechanism for Differential Privacy", Thm. 8):

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).

Why exact rather than RDP: without subsampling this curve is the tightest statement there is;
the RDP bound (:func:`rdp_epsilon`, alpha mu^2 / 2 converted with Canonne, Kamath and Steinke
2020, Prop. 12) is kept as the figure Opacus-style accountants would report, and the tests check
that it never undercuts the exact value.

Units: a noise multiplier z is the noise std divided by the clipping norm S, and
``sensitivity`` is Delta / S (1 when a neighbour can only zero a clipped vector, 2 when it can
replace it with any other one of norm <= S).

Only the standard library: Phi in the far tail comes from an asymptotic series, because
0.5 * erfc(x) underflows below x ~ -38 while e^eps Phi(...) must stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["composed_mu", "delta_for_epsilon", "epsilon_for_delta", "epsilon_spent",
           "log_ndtr", "rdp_epsilon"]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def log_ndtr(x: float) -> float:
    """log Phi(x) for the standard normal CDF, accurate in the far left tail."""
    if x > -20.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    # Phi(x) = phi(x)/|x| * (1 - 1/x^2 + 3/x^4 - 15/x^6 + 105/x^8 - ...); at x <= -20 the
    # first omitted term is below 1e-11 relative.
    x2 = x * x
    series = 1.0 - 1.0 / x2 + 3.0 / x2**2 - 15.0 / x2**3 + 105.0 / x2**4 - 945.0 / x2**5
    return -0.5 * x2 - _LOG_SQRT_2PI - math.log(-x) + math.log(series)


def composed_mu(noise_multipliers: Iterable[float], sensitivity: float = 1.0) -> float:
    """mu = sqrt(sum_i (sensitivity / z_i)^2): the one Gaussian mechanism the composition is.

    z_i = inf (no release) contributes nothing; z_i = 0 (no noise) makes mu infinite.
    """
    if not sensitivity > 0.0 or math.isinf(sensitivity):
        raise ValueError(f"sensitivity must be positive and finite, got {sensitivity}")
    total = 0.0
    for z in noise_multipliers:
        z = float(z)
        if math.isnan(z) or z < 0.0:
            raise ValueError(f"noise multipliers must be >= 0, got {z}")
        if z == 0.0:
            return math.inf
        total += (sensitivity / z) ** 2
    return math.sqrt(total)


def _check_mu(mu: float) -> None:
    if math.isnan(mu) or mu < 0.0:
        raise ValueError(f"mu must be >= 0, got {mu}")


def delta_for_epsilon(epsilon: float, mu: float) -> float:
    """The smallest delta for which a Gaussian mechanism with ratio ``mu`` is (epsilon, delta)-DP."""
    _check_mu(mu)
    if math.isnan(epsilon) or epsilon < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    if math.isinf(epsilon):
        return 0.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_first = log_ndtr(a)
    # Phi(a) - e^eps Phi(b) = Phi(a) * (1 - exp(eps + log Phi(b) - log Phi(a))); the bracket
    # is in (0, 1], written with expm1 so that a tiny delta keeps its relative precision.
    ratio = epsilon + log_ndtr(b) - log_first
    return max(0.0, math.exp(log_first) * -math.expm1(min(ratio, 0.0)))


def epsilon_for_delta(delta: float, mu: float, rel_tol: float = 1e-12) -> float:
    """The smallest epsilon >= 0 for which a Gaussian mechanism with ratio ``mu`` is (epsilon, delta)-DP.

    delta(eps) is continuous and strictly decreasing in eps, so bisection finds it.
    """
    _check_mu(mu)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if delta_for_epsilon(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while delta_for_epsilon(hi, mu) > delta:
        lo, hi = hi, 2.0 * hi
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if delta_for_epsilon(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def rdp_epsilon(delta: float, mu: float, orders: Sequence[float] | None = None) -> float:
    """The RDP bound on epsilon: min over alpha of alpha mu^2/2 + log((alpha-1)/alpha)
    - (log delta + log alpha)/(alpha - 1) (an upper bound on :func:`epsilon_for_delta`)."""
    _check_mu(mu)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if orders is None:
        orders = [1.0 + x / 100.0 for x in range(1, 100)] + [2.0 + x / 10.0 for x in range(0, 980)]
        orders += [100.0 * 1.05**k for k in range(0, 140)]
    best = math.inf
    for a in orders:
        if a <= 1.0:
            raise ValueError(f"RDP orders must exceed 1, got {a}")
        eps = a * mu * mu / 2.0 + math.log((a - 1.0) / a) - (math.log(delta) + math.log(a)) / (a - 1.0)
        best = min(best, eps)
    return max(0.0, best)


def epsilon_spent(noise_multipliers: Iterable[float], delta: float,
                  sensitivity: float = 1.0) -> float:
    """epsilon at ``delta`` of the composition of Gaussian mechanisms with these multipliers."""
    return epsilon_for_delta(delta, composed_mu(noise_multipliers, sensitivity))

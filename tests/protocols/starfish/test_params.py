"""StarfishParams: the paper's defaults in one place (``common.starfish_params``) and the two formulas."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.starfish.params import PAPER, StarfishParams


def _ceil_exact(rate: float, T: int) -> int:
    # the rate as the user wrote it (shortest decimal), times T, rounded up exactly
    q = Fraction(repr(rate)) * T
    return -(-q.numerator // q.denominator)


def test_paper_defaults():
    assert (PAPER.sigma, PAPER.alpha, PAPER.beta, PAPER.buffer, PAPER.method) == (0.6, 0.4, 0.1, 2, "auto")
    assert PAPER.num_selected(40) == 24 and PAPER.correction_interval(40) == 4


@given(st.integers(1, 5000), st.integers(1, 1000), st.integers(1, 1000))
def test_formulas_are_exact_ceilings(T, s_milli, b_milli):
    sigma, beta = s_milli / 1000, b_milli / 1000
    p = StarfishParams(sigma=sigma, beta=beta)
    assert p.num_selected(T) == max(1, min(T, _ceil_exact(sigma, T)))
    assert p.correction_interval(T) == max(1, _ceil_exact(beta, T))


@pytest.mark.parametrize("bad", [dict(sigma=0.0), dict(sigma=1.5), dict(alpha=-0.1), dict(beta=0.0),
                                 dict(buffer=0), dict(method="sort"), dict(t_delta=-1)])
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        StarfishParams(**bad)

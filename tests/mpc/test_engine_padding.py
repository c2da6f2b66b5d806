"""The two-party engine pads small elementwise calls to a few sizes per octave so that its
compiled programs are reused (``mpc.spu_engine._padded_size``, ``_pad``); checked here over the
whole domain, against the rule's own bounds. That padded calls still equal numpy is checked by
the engine's own tests (``tests/mpc/test_two_party_mode.py``: comparisons, windows, products,
truncation pairs)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from mpc.spu_engine import _PAD_UP_TO, _pad, _padded_size


@given(st.integers(0, 4 * _PAD_UP_TO), st.sampled_from([1, 16]))
def test_a_padded_size_covers_n_by_at_most_a_quarter_and_is_n_above_the_limit(n, least):
    size = _padded_size(n, least)
    if n > _PAD_UP_TO:
        assert size == n
    else:
        assert size >= max(n, least)
        assert size == least or size - n < max(1, n // 4)


@given(st.integers(0, 15))
def test_each_octave_has_at_most_four_padded_sizes_and_they_rise_with_n(b):
    lo, hi = 1 << b, min(1 << (b + 1), _PAD_UP_TO)
    sizes = [_padded_size(n, 1) for n in range(lo + 1, hi + 1)]
    assert len(set(sizes)) <= 4
    assert sizes == sorted(sizes) and sizes[-1] == hi


@given(st.integers(0, 40), st.integers(0, 10))
def test_pad_appends_zeros_and_keeps_the_values(n, extra):
    x = np.arange(1, n + 1, dtype=np.int64)
    y = _pad(x, n + extra)
    assert y.dtype == x.dtype and y.size == n + extra
    assert np.array_equal(y[:n], x) and not y[n:].any()

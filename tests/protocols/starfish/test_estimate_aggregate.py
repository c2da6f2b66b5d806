"""Property: a replayed round's aggregate formed without per-client products (``aggregate_apply``,
issue 26) opens the same ring integers as the weighted sum of the per-client estimates.

Why exact: the folded form is an integer recombination of the products ``hvp_apply`` forms (one
(m x nB) @ (nB x 1) engine product instead of n (m x B) @ (B x 1) ones), so with the same small
solve ``c`` both open the same value to the last bit; a wrong weight, a permuted column or a
dropped term is off by the size of the values. Second oracle: the dense BFGS matrix in float64.
Both offline modes (``pair_in_each_mode``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpc.crypten_compat import crypten
from protocols.backend import bits_of, lift, reveal, to_shared_like, weighted_sum
from protocols.starfish.update_estimation import aggregate_apply, estimate_aggregate, hvp_apply, hvp_solve, hvp_sums
from tests.protocols.starfish.test_update_estimation import dense_bfgs, random_pairs


def folded_program(party, case):
    share = lambda x: crypten.cryptensor(torch.as_tensor(x, dtype=torch.float64), src=0)  # noqa: E731
    S, v, w = case["S"], case["v"], case["weights"]
    Y, stored = share(case["Y"]), share(case["stored"])
    c = hvp_solve(hvp_sums(S, Y, v))
    hv = hvp_apply(S, Y, v, c)
    rows = hv + lift(to_shared_like(stored), bits_of(hv))
    per_row = reveal(weighted_sum([rows[j] for j in range(rows.shape[0])], w)).numpy()
    folded = reveal(aggregate_apply(S, Y, v, c, stored, w)).numpy()
    whole = reveal(estimate_aggregate(stored, w, v, S, Y)).numpy()   # its own solve
    return {"per_row": per_row, "folded": folded, "whole": whole}


@st.composite
def cases(draw):
    n, b = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    m = draw(st.integers(b + 1, 20))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pairs = [random_pairs(gen, m, b) for _ in range(n)]
    scale = draw(st.sampled_from([0.05, 0.2, 1.0]))
    raw = draw(st.lists(st.floats(1e-3, 1.0), min_size=n, max_size=n))
    return {"S": torch.stack([p[0] for p in pairs]) * scale, "Y": torch.stack([p[1] for p in pairs]) * scale,
            "v": torch.randn(m, generator=gen, dtype=torch.float64) * scale,
            "stored": torch.randn(n, m, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.01, 0.1, 2.0])),
            "weights": [x / sum(raw) for x in raw]}


@settings(max_examples=max(1, settings.default.max_examples // 3))   # default 20 -> 6 2PC runs
@given(case=cases())
def test_folded_aggregate_opens_the_per_row_sum_exactly(pair_in_each_mode, case):
    S, Y, v, stored, w = case["S"], case["Y"], case["v"], case["stored"], case["weights"]
    dense = sum(w[j] * (stored[j] + dense_bfgs(S[j], Y[j]) @ v) for j in range(S.shape[0])).numpy()
    out0, out1 = pair_in_each_mode.call(folded_program, case)
    tol = 2e-2 * (1.0 + float(np.abs(dense).max()))   # fixed point through the 2B x 2B inverse
    for out in (out0, out1):
        assert np.array_equal(out["folded"], out["per_row"])
        assert np.abs(out["whole"] - dense).max() < tol
    assert np.array_equal(out0["folded"], out1["folded"])


def test_plaintext_rows_are_refused():
    S = torch.zeros(1, 3, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="shared rows"):
        estimate_aggregate(torch.zeros(1, 3), [1.0], torch.zeros(3), S, torch.zeros(1, 3, 1))

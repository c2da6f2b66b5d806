"""The dealer material fetched ahead of use (``DealerProvider.fetch_ahead``) and the per-request
keying that makes a wrong plan harmless (``correlations.request_prg``).

Oracle: numpy on the clear inputs (products, signs); the counts say the background fetch did
serve (a no-op fetch would pass the value checks alone).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpc import correlations
from mpc.launcher import run_parties
from tests.helpers import dealer_ahead_programs as dap

LSB = 2.0 ** -16


def _inputs(seed: int, n: int):
    rng = np.random.default_rng(seed)
    x = np.round(rng.uniform(-4, 4, n) / LSB) * LSB
    y = np.round(rng.uniform(-4, 4, n) / LSB) * LSB
    return x, y


def _assert_right(out: dict, x: np.ndarray, y: np.ndarray) -> None:
    np.testing.assert_allclose(out["prod"], x * y, atol=4 * LSB)
    np.testing.assert_array_equal(out["bits"], (x - y < 0).astype(np.float64))
    np.testing.assert_allclose(out["picked"], np.where(x < y, x * y, 0.0), atol=8 * LSB)


def test_a_recorded_plan_is_served_ahead_and_a_wrong_one_only_costs_its_fetch(pair):
    x, y = _inputs(1, 3000)
    (out0, plan, served0), (out1, _, _) = pair.call(dap.mixed, x, y)
    assert served0 == 0 and len(plan) >= 4
    _assert_right(out0, x, y)
    np.testing.assert_array_equal(out0["bits"], out1["bits"])

    # the same program with its plan, a budget far below its material: served piece by piece
    x2, y2 = _inputs(2, 3000)
    (out0, again, _), (_, _, served1) = pair.call(dap.mixed, x2, y2, plan, 4096)
    _assert_right(out0, x2, y2)
    assert again == plan and served1 == len(plan)

    # a plan wrong at request k: served up to k, the rest made on demand, results still right
    k = len(plan) // 2
    wrong = list(plan)
    wrong[k] = correlations.make_request("square", (7,))
    x3, y3 = _inputs(3, 3000)
    (out0, _, _), (_, _, served2) = pair.call(dap.mixed, x3, y3, wrong)
    _assert_right(out0, x3, y3)
    assert served2 == k

    # a plan longer than the program: its tail is never used, and the next call (no plan) is right
    x4, y4 = _inputs(4, 500)
    pair.call(dap.mixed, x4[:100], y4[:100], plan + plan)
    (out0, _, _), (_, _, served3) = pair.call(dap.mixed, x4, y4)
    _assert_right(out0, x4, y4)
    assert served3 == 0


def test_a_session_closes_cleanly_while_material_is_still_fetched_ahead():
    """The session ends with most of a long plan unfetched, the thread busy on the dealer link:
    party 1's close waits for its piece in flight, says bye, and the results are right."""
    x, y = _inputs(5, 2000)
    rec = run_parties(dap.mixed, x, y, timeout=120).values[1][1]     # the requests of one run
    tail = [correlations.make_request("cmp_tables", (1 << 21,))] * 16     # 512 MB, never asked for
    res = run_parties(dap.close_while_fetching, x, y, rec + tail, timeout=120)
    out, served = res.values[0][0], res.values[1][1]
    _assert_right(out, x, y)
    assert served == len(rec)


_requests = st.one_of(
    st.builds(lambda n: correlations.make_request("square", (n,)), st.integers(1, 50)),
    st.builds(lambda n: correlations.make_request("cmp_tables", (n,)), st.integers(1, 50)),
    st.builds(lambda n, m: correlations.make_request("triple", (n, m), (n, m), "mul"),
              st.integers(1, 8), st.integers(1, 8)),
    st.builds(lambda n: correlations.make_request("mask", (n,)), st.integers(1, 50)),
)


@given(a=_requests, b=_requests, index=st.integers(0, 2**64 - 1))
@settings(max_examples=60)
def test_a_request_number_draws_unrelated_randomness_for_another_request(a, b, index):
    """Same number, same request: the same stream (both parties and the dealer agree); same
    number, another request: another stream, so no share of a mask serves two correlations."""
    seed = bytes(range(16))
    first = correlations.request_prg(seed, index, a).ring((4,))
    assert np.array_equal(first, correlations.request_prg(seed, index, a).ring((4,)))
    other = correlations.request_prg(seed, index, b).ring((4,))
    assert np.array_equal(first, other) == (a == b)


def test_a_mask_is_the_sum_of_its_request_shares():
    """``mask_value`` (how the dealer rebuilds a mask a product names) keys like the request."""
    s0, s1 = bytes(16), bytes(range(16))
    req = correlations.make_request("mask", (5,))
    a0 = correlations.party0_shares(req, s0, 9)[0]
    a1 = correlations.party1_free_shares(req, s1, 9)[0]
    assert np.array_equal(correlations.mask_value((5,), s0, s1, 9).numpy(), (a0 + a1).numpy())

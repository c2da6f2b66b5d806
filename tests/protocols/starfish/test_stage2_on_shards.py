"""Property: Stage II with its secret values on K coordinate shards (issue 30) is Stage II.

The same histories as ``test_partial_participation_2pc`` (partial participation, an unlearning
round, a round of targets only, an erased client), run by ``run_stage2`` unchanged on
``protocols.starfish.on_shards``'s values: every update, secant and estimate on K slices
(``tests.helpers.shard_slices``: K worker pairs in one session), only sums of shares and the
small solves at the "coordinators". Oracle: the plaintext twin (same rounds, flags, exact
requests and warm-up; model within ``MODEL_TOLERANCE``), and nothing left on any slice after
the job releases its values. Each worker's UE and SecTC run over all client rows at once, or a
few at a time (``shard_steps.BLOCK``, drawn small). In both offline modes (``pair_in_each_mode``).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.prg import new_seed

from . import partial_programs as pp
from .test_partial_participation_2pc import cases, plaintext_or_discard
from .test_stage2_properties import MODEL_TOLERANCE

torch.set_num_threads(1)


@st.composite
def sharded_cases(draw) -> dict:
    case = draw(cases())
    case["k"] = draw(st.integers(1, min(case["d"], 4)))
    # values per 2PC batch at a worker: one or a few client rows at a time, or all of them
    case["block"] = draw(st.sampled_from([None, case["d"], 3 * case["d"]]))
    return case


@settings(max_examples=max(1, settings.default.max_examples // 5))   # default 20 -> 4
@given(case=sharded_cases())
def test_stage2_on_shards_equals_plaintext(pair_in_each_mode, case):
    clients, hist, hidden, targets, params, plain = plaintext_or_discard(case)
    v0, v1 = pair_in_each_mode.call(pp.stage2_on_shares, hist.model(0).numpy(), hist.server_lr,
                       pp.split_rounds(hist, case["seed"]), targets, params, clients, new_seed(), hidden,
                       case["k"], case["block"])
    assert np.array_equal(v0["model"], v1["model"])
    assert v0["selected_rounds"] == v1["selected_rounds"] == plain.selected_rounds
    assert v0["flags"] == plain.flags
    assert v0["exact_requests"] == plain.exact_requests
    assert v0["warmup_steps"] == plain.warmup_steps
    assert v0["estimated_updates"] == plain.estimated_updates
    gap = float(np.abs(v0["model"] - plain.model.double().numpy()).max())
    assert gap < MODEL_TOLERANCE, gap
    assert v0["held_after"] == v1["held_after"] == 0


@settings(max_examples=8)
@given(rows=st.integers(0, 4), m=st.integers(1, 40), k=st.integers(1, 4), block=st.integers(1, 64),
       seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1 << 4, 1 << 16, 1 << 28]))
def test_threshold_counts_on_shards_add_to_the_rows_hits(pair_in_each_mode, rows, m, k, block, seed, scale):
    """SecTC's per-row counts, summed over K coordinate slices, are what the coordinator compares
    with 1: at least 1 exactly where numpy finds some x**2 >= d**2 in the row (ties included:
    some coordinates equal their row's threshold, |x| up to 2**13.6), and never more than
    numpy's number of such coordinates (both modes count the batches with one: two-party mode in
    the engine's 32-bit ring, ``SpuEngine.rows_hits``, dealer mode by the table-driven test); no
    rows gives no counts."""
    from tests.helpers.ring_shares import split

    k = min(k, m)
    rng = np.random.default_rng(seed)
    x = rng.integers(-3 * scale, 3 * scale, size=(rows, m), dtype=np.int64, endpoint=True)
    d = rng.integers(0, 2 * scale, size=rows, dtype=np.int64, endpoint=True)
    if rows and m > 1:
        x[0, 0], x[0, 1] = d[0], -d[0]          # exactly at the threshold: counted
    (out0, engine0), (out1, engine1) = pair_in_each_mode.call(pp.shard_exceed_counts, split(x, "uniform", rng),
                                                              split(d, "uniform", rng), k, block)
    assert engine0 == engine1 == (pair_in_each_mode.options["offline"] == "two-party")
    want = ((x.astype(object) ** 2) >= (d.astype(object) ** 2)[:, None]).sum(axis=1).astype(np.int64)
    for out in (np.asarray(out0).reshape(-1), np.asarray(out1).reshape(-1)):
        assert out.shape == want.shape
        np.testing.assert_array_equal(out >= 1, want >= 1)
        assert np.all(out <= want) and np.all(out >= 0)


@settings(max_examples=6)
@given(n=st.integers(1, 3), m=st.integers(2, 30), b=st.integers(1, 3), k=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_estimates_on_shards_reuse_each_columns_mask_in_dealer_mode(pair, n, m, b, k, seed):
    """Dealer mode: a worker opens each L-BFGS column's Beaver mask once and keeps it beside the
    column (``shard_steps._masked``), so an estimate's Y z opens only z's mask. Oracles: the
    sharded estimates are the unsharded ``hvp_apply``'s ring values exactly (an ordinary Beaver
    product: every product is exact, nothing is truncated), and within the fixed-point grid of
    numpy's float64 estimate; the second call moves at most 16 bytes per client and column per
    slice (z - b each way) and one round's framing (measured: 9 bytes each way), where one
    ordinary product opens 16 m b per client; a column's mask goes with its name."""
    k = min(k, m)
    rng = np.random.default_rng(seed)
    Y, S = rng.normal(size=(n, m, b)) * 0.5, rng.normal(size=(n, m, b))
    v, stored = rng.normal(size=m), rng.normal(size=(n, m)) * 0.1
    coef = (rng.normal(size=(n, 1, 1)), rng.normal(size=(n, b, 1)), rng.normal(size=(n, b, 1)))
    got = pair.call(pp.estimates_on_slices, Y, S, v, stored, coef, k)[0]
    for est in got["sharded"]:
        np.testing.assert_array_equal(est, got["whole"])
    want = (coef[0] * v[None, :, None] - S @ coef[1] - Y @ coef[2])[..., 0] + stored
    assert np.abs(got["whole"] / 2.0 ** 32 - want).max() < 1e-3 * (1 + np.abs(want).max())
    assert got["bytes"][1] <= k * (16 * n * b + 64), got["bytes"]
    assert got["bytes"][0] - got["bytes"][1] >= 16 * n * b * m, got["bytes"]   # only the first opened Y's masks
    assert got["masks_kept"] == 3 * n * b
    assert got["y_left"] == 0

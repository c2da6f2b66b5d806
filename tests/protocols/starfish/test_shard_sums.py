"""Property: Stage II's coordinate-wide steps computed shard by shard (issue 30) equal the whole.

UE's H v in three phases (``hvp_sums`` per shard, added; ``hvp_solve`` once; ``hvp_apply`` per
shard), SecTC's per-row OR from per-shard counts (``exceed_counts`` per shard, added;
``flags_from_counts``), and the curvature test from per-shard sums (``curvature_sums`` per shard,
added; ``curvature_decide``). The K slices of one 2PC session stand for the K worker pairs: each
slice's shares are added as the coordinators add their workers' shares. Each property runs in
both offline modes (the dealer's correlations and the two-party engine's: ``pair_in_each_mode``).

Oracles: the dense BFGS matrix in float64 (and the unsharded 2PC estimate), the comparison of the
fixed-point encodings in Python integers, and the plaintext curvature rule on pairs drawn with a
margin to its threshold.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpc.crypten_compat import crypten
from protocols.backend import bits_of, cat, lift, reveal, to_shared_like
from protocols.starfish.pair_buffers import curvature_decide, curvature_ok, curvature_sums
from protocols.starfish.shard_steps import row_chunks
from protocols.starfish.update_estimation import estimate_updates, hvp_apply, hvp_solve, hvp_sums
from protocols.threshold import exceed_counts, exceed_counts_blocked, flags_from_counts
from servers.workers.shards import shard_bounds
from tests.protocols.starfish.test_update_estimation import dense_bfgs, random_pairs


def _sharded_estimate(stored, v, S, Y, bounds):
    sums = None
    for lo, hi in bounds:
        part = hvp_sums(S[..., lo:hi, :], Y[..., lo:hi, :], v[lo:hi])
        sums = part if sums is None else sums + part
    coef = hvp_solve(sums)
    hv = cat([hvp_apply(S[..., lo:hi, :], Y[..., lo:hi, :], v[lo:hi], coef) for lo, hi in bounds], dim=-1)
    if isinstance(hv, torch.Tensor):
        return stored + hv
    return hv + lift(to_shared_like(stored), bits_of(hv))


def _sharded_flags(x, d, bounds, block=None):
    counts = None
    for lo, hi in bounds:
        c = exceed_counts(x[:, lo:hi], d) if block is None else exceed_counts_blocked(x[:, lo:hi], d, block)
        counts = c if counts is None else counts + c
    return flags_from_counts(counts)


def _sharded_curvature(s, ys, bounds):
    ss, u, yy = 0.0, None, None
    for lo, hi in bounds:
        a, b, c = curvature_sums(s[lo:hi], [y[lo:hi] for y in ys])
        ss, u, yy = ss + a, b if u is None else u + b, c if yy is None else yy + c
    return curvature_decide(ss, u, yy)


def shards_program(party, case):
    share = lambda x: crypten.cryptensor(torch.as_tensor(x, dtype=torch.float64), src=0)  # noqa: E731
    S, v, bounds = case["S"], case["v"], case["bounds"]
    Y, stored = share(case["Y"]), share(case["stored"])
    whole = reveal(estimate_updates(stored, v, S, Y)).numpy()
    sharded = reveal(_sharded_estimate(stored, v, S, Y, bounds)).numpy()
    flags = _sharded_flags(share(case["x"]), share(case["d"]), bounds, case["block"]).numpy()
    ys = [share(y) for y in case["ys"]]
    accepted = _sharded_curvature(case["s"], ys, bounds)
    return {"whole": whole, "sharded": sharded, "flags": flags, "accepted": accepted}


@st.composite
def cases(draw):
    n, b = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    m = draw(st.integers(b + 1, 24))
    k = draw(st.integers(1, min(m, 5)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pairs = [random_pairs(gen, m, b) for _ in range(n)]
    scale = draw(st.sampled_from([0.05, 0.2, 1.0]))
    S = torch.stack([p[0] for p in pairs]) * scale
    Y = torch.stack([p[1] for p in pairs]) * scale
    v = torch.randn(m, generator=gen, dtype=torch.float64) * scale
    stored = torch.randn(n, m, generator=gen, dtype=torch.float64) * 0.1
    # SecTC: encodings drawn as integers (the oracle compares them exactly), ties included
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    d_enc = rng.integers(0, 2**14, size=n)
    x_enc = rng.integers(-(2**14), 2**14, size=(n, m))
    for r in range(n):
        if draw(st.booleans()):       # some rows stay strictly inside, others hit the edge
            x_enc[r] = np.clip(x_enc[r], -max(d_enc[r] - 1, 0), max(d_enc[r] - 1, 0))
        if draw(st.booleans()):
            x_enc[r, rng.integers(0, m)] = d_enc[r] * (1 if rng.integers(0, 2) else -1)
    s = torch.randn(m, generator=gen, dtype=torch.float64)
    ys = []
    for kind in draw(st.lists(st.sampled_from(["aligned", "opposite", "orthogonal"]), min_size=1, max_size=4)):
        noise = torch.randn(m, generator=gen, dtype=torch.float64)
        if kind == "aligned":
            ys.append(0.5 * s + 0.05 * noise)
        elif kind == "opposite":
            ys.append(-0.5 * s + 0.05 * noise)
        else:
            ys.append(noise - (noise @ s) / (s @ s) * s)
    return {"S": S, "Y": Y, "v": v, "stored": stored, "bounds": shard_bounds(m, k),
            "x": torch.from_numpy(x_enc / 2**16), "d": torch.from_numpy(d_enc / 2**16),
            "x_enc": x_enc, "d_enc": d_enc, "s": s, "ys": ys,
            "block": draw(st.sampled_from([None, 1, n, 2 * n + 1, 10**6]))}   # SecTC's batches of values


@settings(max_examples=max(1, settings.default.max_examples // 2))   # default 20 -> 10 2PC runs
@given(case=cases())
def test_shard_sums_equal_the_whole_in_2pc_and_plaintext(pair_in_each_mode, case):
    S, Y, v, stored, bounds = case["S"], case["Y"], case["v"], case["stored"], case["bounds"]
    dense = torch.stack([stored[j] + dense_bfgs(S[j], Y[j]) @ v for j in range(S.shape[0])]).numpy()
    plain = _sharded_estimate(stored, v, S, Y, bounds).numpy()
    assert np.allclose(plain, dense, rtol=1e-6, atol=1e-6)
    want_flags = [bool((row.astype(object) ** 2 >= int(d) ** 2).any()) for row, d in zip(case["x_enc"], case["d_enc"])]
    assert _sharded_flags(case["x"], case["d"], bounds, case["block"]).tolist() == want_flags
    want_curv = curvature_ok(case["s"], case["ys"])
    assert _sharded_curvature(case["s"], case["ys"], bounds) == want_curv
    out0, out1 = pair_in_each_mode.call(shards_program, case)
    # fixed point through the 2B x 2B inverse: measured up to 5.5e-3 of the largest value; a wrong
    # sum or phase is off by the size of the values themselves
    tol = 2e-2 * (1.0 + float(np.abs(dense).max()))
    for out in (out0, out1):
        assert np.abs(out["sharded"] - out["whole"]).max() < tol
        assert np.abs(out["sharded"] - dense).max() < tol
        assert out["flags"].tolist() == want_flags
        assert out["accepted"] == want_curv


@given(rows=st.integers(0, 200), per_row=st.integers(0, 10**7), block=st.integers(1, 1 << 22))
def test_row_chunks_cover_every_row_once_within_the_block(rows, per_row, block):
    chunks = row_chunks(rows, per_row, block)
    assert [r for lo, hi in chunks for r in range(lo, hi)] == list(range(rows))
    for lo, hi in chunks:
        assert hi > lo
        # at most `block` values a chunk, except a single row larger than the block
        assert (hi - lo) * per_row <= block or hi - lo == 1
    # as few chunks as the block allows
    assert len(chunks) == (0 if rows == 0 else -(-rows // max(1, block // max(1, per_row))))


@given(block=st.integers(1, 1 << 23), mode=st.sampled_from(["dealer", "two-party", None]))
def test_batch_values_caps_the_two_party_batch_only(block, mode):
    """Two-party mode batches at most ``TWO_PARTY_BLOCK`` values (its engine's memory follows the
    batch); the dealer mode, or a plaintext caller without a session, keeps ``block``."""
    from types import SimpleNamespace

    from common.offline_mode import OfflineMode
    from protocols.starfish.shard_steps import TWO_PARTY_BLOCK, batch_values, block_for

    party = None if mode is None else SimpleNamespace(offline=OfflineMode.of(mode))
    want = min(block, TWO_PARTY_BLOCK) if mode == "two-party" else block
    assert batch_values(party, block) == want
    # the scale model's form of the same rule: a mode as written in a benchmark's JSON
    assert block_for(mode, block) == want

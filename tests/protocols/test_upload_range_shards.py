"""Property: the range check computed shard by shard (``protocols.upload_range.shard_partials`` on
each coordinate shard, ``verdict_from_partials`` on the summed parts; issue 30) opens the right
bit per client on every ring input, in 2PC and in its twin, for any split into K shards.

Oracle: Python integers, as in ``test_upload_range`` (same attacker kinds of inputs, same
windows), with the norm plan counted over every shard's chunks: S_t = the sum over shards and
their chunks of floor(chunk sum / 2**t), 2**t >= the total number of chunks C. The K shards of
one session stand for the K worker pairs (the parts are added as the coordinators add them).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from protocols.upload_range import shard_chunks, shard_partials, verdict_from_partials
from servers.workers.shards import shard_bounds
from tests.protocols.test_upload_range import _mine, batches, build


def sharded_oracle(xs, norms, deltas, b, norm_bits, delta_bits, bounds, e=10, slack=16) -> list[bool]:
    length = 2 ** (61 - 2 * b)
    chunks = [[(lo + j, min(lo + j + length, hi)) for j in range(0, hi - lo, length)] for lo, hi in bounds]
    total = sum(len(c) for c in chunks)
    t = (total - 1).bit_length() if total > 1 else 0
    out = []
    for i, row in enumerate(xs):
        ok = all(-(2**b) <= v < 2**b for v in row) and 0 <= deltas[i] < 2**delta_bits and 0 <= norms[i] < 2**norm_bits
        if ok:
            s_t = sum(sum(v * v for v in row[a:z]) >> t for shard in chunks for a, z in shard)
            m = norms[i] + (norms[i] >> e) + slack
            ok = s_t <= (m * m) >> t
        out.append(ok)
    return out


def _sharded(party, updates, norms, deltas, bounds, kw):
    """Every shard's parts (one shard at a time, as K worker pairs would), added, then the verdict."""
    _, t = shard_chunks([hi - lo for lo, hi in bounds], kw["bound_bits"])
    counts = squares = 0
    for lo, hi in bounds:
        c, s = shard_partials(updates[:, lo:hi], t, bound_bits=kw["bound_bits"], method=kw["method"])
        counts, squares = counts + c, squares + s
    return verdict_from_partials(party, counts, squares, t, norms, deltas, **kw)


def shard_program(party, updates, norms, deltas, bounds, kw):
    return _sharded(party, *(_mine(party, s) for s in (updates, norms, deltas)), bounds, kw)


@st.composite
def sharded_batches(draw):
    spec = draw(batches().filter(lambda s: s["consistency"]))
    spec["k"] = draw(st.integers(1, min(spec["d"], 5)))
    return spec


@given(spec=sharded_batches())
def test_sharded_bits_equal_twin_and_oracle(pair, spec):
    x, nv, dv, shares, _ = build(spec)
    bounds = shard_bounds(spec["d"], spec["k"])
    kw = dict(bound_bits=spec["b"], norm_bits=spec["norm_bits"], delta_bits=spec["delta_bits"], method=spec["method"])
    want = sharded_oracle(x.tolist(), nv.tolist(), dv.tolist(), spec["b"], spec["norm_bits"], spec["delta_bits"], bounds)
    twin = _sharded(None, torch.from_numpy(x), torch.from_numpy(nv), torch.from_numpy(dv), bounds, kw)
    assert twin == want
    bits0, bits1 = pair.call(shard_program, *shares, bounds, kw)
    assert bits0 == bits1 == want


def test_one_shard_is_the_unsharded_check():
    """K = 1 is today's plan: the same C and t as ``norm_plan`` for every width and bound."""
    from protocols.upload_range import norm_plan
    for b in (0, 5, 16, 26, 30):
        for d in (1, 2, 63, 64, 65, 1100, 582_026):
            assert shard_chunks([d], b) == (norm_plan(d, b)[1], norm_plan(d, b)[2])


def test_honest_clients_pass_and_liars_fail_on_real_values():
    """Float updates as clients send them (the twin): honest norms pass for every K; a norm that
    understates ||g|| by half, and one coordinate out of its window, fail."""
    rng = np.random.default_rng(5)
    g = torch.from_numpy(rng.normal(size=(3, 1000)))
    norms = g.norm(dim=1)
    deltas = g.abs().quantile(0.9, dim=1)
    g[2, 17] = 2000.0                       # |g| < 1024 is the window at the defaults
    norms = torch.stack([norms[0], norms[1] / 2, norms[2]])
    for k in (1, 2, 7, 1000):
        bounds = shard_bounds(1000, k)
        bits = _sharded(None, g, norms, deltas, bounds, dict(bound_bits=26, method="top-bits"))
        assert bits == [True, False, False], (k, bits)

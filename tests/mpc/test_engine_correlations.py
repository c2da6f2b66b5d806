"""What the two-party engine makes between the servers, against numpy's ring arithmetic:
* matrix products on both of its paths: small matmuls as one elementwise multiplication
  (``_ELEMENTWISE_PRODUCTS`` scalar products or fewer), larger ones through the library's matrix
  product; batched, broadcast and plain shapes;
* truncation pairs (``SpuEngine.truncation_pairs``): msb(r) and r >> d for r over the whole ring
  and every d, and the provider's stock of them (both parties' pairs add up to one pair)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpc.spu_engine import _ELEMENTWISE_PRODUCTS, _scalar_products
from tests.helpers.engine_correlation_programs import engine_matmuls, engine_truncation_pairs, provider_pairs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tp(two_party_pair):
    return two_party_pair


def _ring_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact a @ b mod 2**64 (Python integers), as int64 bits."""
    prod = np.matmul(a.astype(object), b.astype(object))
    return np.vectorize(lambda v: ((int(v) + 2**63) % 2**64) - 2**63, otypes=[object])(prod).astype(np.int64)


def _shares(rng, shape):
    x = rng.integers(-(2**63), 2**63 - 1, size=shape, dtype=np.int64, endpoint=True)
    s0 = rng.integers(-(2**63), 2**63 - 1, size=shape, dtype=np.int64, endpoint=True)
    s1 = (x.view(np.uint64) - s0.view(np.uint64)).view(np.int64)
    return x, s0, s1


# (batch of a, batch of b, i, k, j); an empty batch is a plain 2-D product
shape = st.tuples(st.sampled_from([(), (1,), (5,), (3, 2)]), st.sampled_from(["same", "a-only", "b-one"]),
                  st.integers(1, 9), st.integers(1, 9), st.integers(1, 9))


def _case(rng, spec):
    lead, how, i, k, j = spec
    lead_b = lead if how == "same" or not lead else ((1,) * len(lead) if how == "b-one" else ())
    a, a0, a1 = _shares(rng, (*lead, i, k))
    b, b0, b1 = _shares(rng, (*lead_b, k, j))
    return a, b, (a0, a1, b0, b1)


def _check(tp, specs, seed):
    rng = np.random.default_rng(seed)
    cases = [_case(rng, s) for s in specs]
    r0, r1 = tp.call(engine_matmuls, [c[2] for c in cases])
    for (a, b, _), got0, got1 in zip(cases, r0, r1):
        got = (got0.view(np.uint64) + got1.view(np.uint64)).view(np.int64)
        assert got.shape == np.matmul(a, b).shape
        assert np.array_equal(got, _ring_matmul(a, b)), (a.shape, b.shape)


@settings(max_examples=5, deadline=None)
@given(specs=st.lists(shape, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_small_matmuls_equal_the_ring_product(tp, specs, seed):
    assert all(_scalar_products((*s[0], s[2], s[3]), (*s[0], s[3], s[4])) <= _ELEMENTWISE_PRODUCTS for s in specs)
    _check(tp, specs, seed)


@pytest.mark.parametrize("lead,i,k,j", [
    ((19,), 431, 2, 2),     # 32,756 products: the largest elementwise call of this family
    ((19,), 432, 2, 2),     # 32,832: the library's matrix product
    ((), 64, 64, 8),        # exactly 2**15: elementwise
    ((), 64, 64, 9),        # one column more: the matrix product
])
def test_both_sides_of_the_threshold_equal_the_ring_product(tp, lead, i, k, j):
    assert (_scalar_products((*lead, i, k), (*lead, k, j)) <= _ELEMENTWISE_PRODUCTS) == (j != 9 and i != 432)
    _check(tp, [(lead, "same", i, k, j)], seed=i * k * j)


# ---------------------------------------------------------------------------- truncation pairs
EDGES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**62, 2**63 + 2**62, 2**32 - 1, 2**32]   # r read unsigned


def _unsigned_shares(rng, values, edge_splits):
    r = np.array(values, dtype=object)
    if edge_splits:   # shares at the ends of the ring too: r0 in {0, 1, 2**63 - 1, 2**63, 2**64 - 1}
        s0 = np.array([EDGES[i % 5] if i % 2 else int(rng.integers(0, 2**64, dtype=np.uint64))
                       for i in range(len(values))], dtype=object)
    else:
        s0 = np.array([int(rng.integers(0, 2**64, dtype=np.uint64)) for _ in values], dtype=object)
    s1 = (r - s0) % 2**64
    as_int = lambda a: np.array([int(v) for v in a], dtype=np.uint64).view(np.int64)   # noqa: E731
    return as_int(s0), as_int(s1)


def _check_pairs(r, top, high, d):
    assert np.array_equal(top.view(np.uint64), (r >> np.uint64(63)))
    assert np.array_equal(high.view(np.uint64), (r >> np.uint64(d)))


@settings(max_examples=6, deadline=None)
@given(values=st.lists(st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1)), min_size=1, max_size=40),
       ds=st.lists(st.integers(1, 62), min_size=1, max_size=3), edge_splits=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
@example(values=EDGES, ds=[1, 16, 62], edge_splits=True, seed=0)
def test_truncation_pairs_are_msb_and_logical_shift_over_the_whole_ring(tp, values, ds, edge_splits, seed):
    rng = np.random.default_rng(seed)
    cases = [(*_unsigned_shares(rng, values, edge_splits), d) for d in ds]
    r0s, r1s = tp.call(engine_truncation_pairs, cases)
    r = np.array(values, dtype=np.uint64)
    for (top0, high0), (top1, high1), d in zip(r0s, r1s, ds):
        _check_pairs(r, (top0.view(np.uint64) + top1.view(np.uint64)).view(np.int64),
                     (high0.view(np.uint64) + high1.view(np.uint64)).view(np.int64), d)


def test_the_providers_stock_hands_out_whole_pairs_in_step(tp):
    """Requests smaller and larger than a batch, for two exponents: each pair that the two parties
    take adds up to (r, msb(r), r >> d), and no r is handed out twice."""
    requests = [(3, 16), (1, 16), (1500, 16), (5, 40), (5000, 16), (2, 16)]
    out0, out1 = tp.call(provider_pairs, requests)
    seen = []
    for (n, d), (r0, t0, h0), (r1, t1, h1) in zip(requests, out0, out1):
        r = r0.view(np.uint64) + r1.view(np.uint64)
        assert r.shape == (n,) and h0.shape == h1.shape == (1, n)
        _check_pairs(r, (t0.view(np.uint64) + t1.view(np.uint64)).view(np.int64),
                     (h0[0].view(np.uint64) + h1[0].view(np.uint64)).view(np.int64), d)
        seen.append(r)
    allr = np.concatenate(seen)
    assert np.unique(allr).size == allr.size

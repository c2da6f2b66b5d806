"""``mpc.table_compare.rows_exceed``: SecTC's per-row test in a 32-bit ring with table-driven sign
tests (dealer mode), against numpy.

Domain (module docstring): |x / 2**drop| and |d| below 2**30 encoded, 0 <= drop <= 30. Oracle: the
truncated value is floor(x / 2**drop) or one less (the local truncation leaves its carry out), so a
row's flag must lie between the flag of the smaller and of the larger choice per coordinate; with
drop = 0 there is no choice and the flag must be exactly numpy's ``any(|x| >= |d|)``. Covered:
ties at the threshold (both signs), zeros, d = 0, negative d, public and shared d, every mask split,
rows of 0/1/63/64/65/130 coordinates, 0 rows, values at the domain's edge.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.helpers import table_compare_programs as tcp
from tests.helpers.ring_shares import MASKS, split

LIMIT = 2**30 - 1            # |y| and |d| below 2**30 encoded
LENGTHS = [0, 1, 63, 64, 65, 130]


def oracle(x: np.ndarray, drop: int, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lowest, highest) possible flags per row when y is floor(x / 2**drop) or one less."""
    fl = x >> drop
    choices = np.abs(fl) if drop == 0 else np.minimum(np.abs(fl), np.abs(fl - 1))
    top = np.abs(fl) if drop == 0 else np.maximum(np.abs(fl), np.abs(fl - 1))
    big_d = np.abs(d)[:, None]
    return (choices >= big_d).any(axis=1), (top >= big_d).any(axis=1)


@st.composite
def case(draw):
    rows = draw(st.sampled_from([0, 1, 2, 5]))
    m = draw(st.sampled_from(LENGTHS))
    drop = draw(st.sampled_from([0, 0, 1, 16, 30]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mag = draw(st.sampled_from([1, 2**8, 2**16, 2**29, LIMIT]))
    d = rng.integers(-mag, mag, size=rows, endpoint=True).astype(np.int64)
    y = rng.integers(-mag, mag, size=(rows, m), endpoint=True).astype(np.int64)
    if rows and m:
        # ties at +-d, zeros, the domain's edges, d = 0
        kinds = draw(st.lists(st.sampled_from(["tie+", "tie-", "zero", "edge", "d0", "below"]), max_size=4))
        for k, kind in enumerate(kinds):
            r, c = k % rows, (7 * k) % m
            if kind == "tie+":
                y[r, c] = abs(d[r])
            elif kind == "tie-":
                y[r, c] = -abs(d[r])
            elif kind == "zero":
                y[r] = 0
            elif kind == "edge":
                y[r, c] = LIMIT * (1 if k % 2 else -1) - 1
            elif kind == "d0":
                d[r] = 0
            else:   # every coordinate strictly inside
                y[r] = np.clip(y[r], -abs(d[r]) + 1, abs(d[r]) - 1) if abs(d[r]) > 1 else 0
    low = rng.integers(0, 2**drop, size=y.shape, dtype=np.int64) if drop else np.zeros_like(y)
    x = (y << drop) + low                       # x / 2**drop has the integer part y
    return x, drop, d, draw(st.booleans()), draw(MASKS), seed


@pytest.mark.timeout(600)
@given(batch=st.lists(case(), min_size=1, max_size=5))
@example(batch=[(np.array([[0, 5, -5, 4], [3, 2, 1, 0]], dtype=np.int64), 0, np.array([5, -4], dtype=np.int64),
                 True, "uniform", 0)])
def test_rows_exceed_matches_numpy(pair, batch):
    cases, wants = [], []
    for x, drop, d, shared, how, seed in batch:
        rng = np.random.default_rng(seed)
        dd = split(d, "uniform", rng) if shared else d
        cases.append((split(x, how, rng), drop, dd, shared))
        wants.append(oracle(x, drop, d))
    r0, r1 = pair.call(tcp.flags, cases)
    for (g0, bytes0, _), (g1, bytes1, _), (lo, hi), (x, drop, d, *_) in zip(r0, r1, wants, batch):
        assert np.array_equal(g0, g1)                       # both learn the same flags
        assert g0.dtype == bool and g0.shape == (x.shape[0],)
        assert np.all(lo <= g0) and np.all(g0 <= hi), (x, drop, d, g0, lo, hi)
        if drop == 0:
            assert np.array_equal(g0, lo)
        n = x.size
        if n >= 64 * 64:   # per coordinate: two 32-bit openings (16 B) + ripple and tree gates
            assert bytes0 <= 30 * n


def test_exact_ties_and_signs_with_no_truncation(pair):
    x = np.array([[7, -7, 0], [6, -6, 0], [0, 0, 0], [-8, 1, 1]], dtype=np.int64)
    d = np.array([7, 7, 0, -8], dtype=np.int64)
    rng = np.random.default_rng(3)
    cases = [(split(x, "uniform", rng), 0, split(d, "uniform", rng), True), (split(x, "all", rng), 0, d, False)]
    r0, _ = pair.call(tcp.flags, cases)
    for got, _, _ in r0:
        assert got.tolist() == [True, False, True, True]    # |7| >= 7; 6 < 7; 0 >= 0; |-8| >= |-8|


def test_bytes_per_coordinate_on_a_large_row(pair):
    rng = np.random.default_rng(9)
    x = rng.integers(-2**20, 2**20, size=(3, 20000)).astype(np.int64) << 16
    d = np.array([2**19, 2**21, 2**25], dtype=np.int64)
    r0, r1 = pair.call(tcp.flags, [(split(x, "uniform", rng), 16, split(d, "uniform", rng), True)])
    got, nbytes, rounds = r0[0]
    assert got.tolist() == [True, False, False]
    per = nbytes / x.size
    assert 16 <= per <= 26, per          # 2 x 8 (openings) + 2 x 3.5 (ripple) + about 1 (tree)
    assert rounds <= 45


def test_supported_in_dealer_mode(pair):
    assert list(pair.call(tcp.supported)) == [True, True]


@given(r=st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 15, 16, 2**31 - 1, 2**31, 2**32 - 1])),
                  min_size=1, max_size=40))
def test_the_dealer_tables_describe_every_chunk(r):
    """Each chunk's table is [v < r_j] for every v (16 bytes an element as they travel); the
    parties read [c == r_j] as [c - 1 < r_j] XOR [c < r_j] with [-1 < r_j] = 1, checked here
    against the chunk itself for every c."""
    from mpc.correlations import TABLE_WORDS, comparison_tables, tables_as_words, words_as_tables

    arr = np.array(r, dtype=np.uint32)
    words = tables_as_words(comparison_tables(arr))
    assert words.shape == (TABLE_WORDS, len(r)) == (2, len(r))
    tables = words_as_tables(words)   # as they travel
    assert tables.shape == (8, len(r))
    for i, value in enumerate(r):
        for j in range(8):
            width = 3 if j == 7 else 4
            chunk = (value >> (4 * j)) & ((1 << width) - 1)
            word = int(tables[j, i])
            for v in range(1 << width):
                assert (word >> v) & 1 == (v < chunk)
                before = 1 if v == 0 else (word >> (v - 1)) & 1
                assert before ^ ((word >> v) & 1) == (v == chunk)
        assert int(tables[7, i]) >> 15 == value >> 31


# ------------------------------------------------------------------ negative_bounded
BOUND = 2**31                 # exact for ring values in [-2**31, 2**31)
EDGES = [-BOUND, -BOUND + 1, -1, 0, 1, BOUND - 2, BOUND - 1]


@st.composite
def bounded_case(draw):
    shape = draw(st.sampled_from([(0,), (1,), (7,), (64,), (65,), (3, 43), (2, 2, 33)]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(-BOUND, BOUND, size=shape, dtype=np.int64)
    flat = x.reshape(-1)
    if flat.size:
        # the domain's edges, zero and ties (equal values, as a difference of equal keys gives 0)
        picks = draw(st.lists(st.sampled_from(EDGES + ["small"]), max_size=8))
        for k, p in enumerate(picks):
            flat[(5 * k) % flat.size] = rng.integers(-4, 5) if p == "small" else p
    return x, draw(MASKS), seed


@pytest.mark.timeout(600)
@given(batch=st.lists(bounded_case(), min_size=1, max_size=8))
@example(batch=[(np.array(EDGES, dtype=np.int64), "uniform", 1), (np.array(EDGES, dtype=np.int64), "min", 2),
                (np.array(EDGES, dtype=np.int64), "all", 3), (np.array(EDGES, dtype=np.int64), "zero", 4)])
def test_negative_bounded_matches_numpy_on_its_whole_domain(pair, batch):
    cases = [split(x, how, np.random.default_rng(seed)) for x, how, seed in batch]
    r0, r1 = pair.call(tcp.negatives, cases)
    for (g0, shape0, nbytes, _), (g1, _, _, _), (x, _, _) in zip(r0, r1, batch):
        np.testing.assert_array_equal(g0, g1)
        assert shape0 == x.shape
        np.testing.assert_array_equal(g0, (x < 0).astype(np.int64))    # 0/1 ring integers


def test_negative_bounded_cost_per_element(pair):
    rng = np.random.default_rng(5)
    x = rng.integers(-BOUND, BOUND, size=64 * 300, dtype=np.int64)
    r0, _ = pair.call(tcp.negatives, [split(x, "uniform", rng)])
    got, _, nbytes, rounds = r0[0]
    np.testing.assert_array_equal(got, (x < 0).astype(np.int64))
    # 2 x 4 bytes (c) + 7 AND gates x 4 bits + 2 bits (conversion) = 11.75 bytes
    assert nbytes / x.size <= 12.5, nbytes / x.size
    assert rounds == 9


def test_negative_bounded_falls_back_in_two_party_mode(two_party_pair):
    """Without a dealer there are no tables: the 64-bit sign test gives the same bits."""
    tp = two_party_pair
    rng = np.random.default_rng(8)
    x = np.concatenate([np.array(EDGES, dtype=np.int64), rng.integers(-BOUND, BOUND, size=70, dtype=np.int64)])
    assert list(tp.call(tcp.supported)) == [False, False]
    r0, r1 = tp.call(tcp.negatives, [split(x, "uniform", rng), split(x, "min", rng)])
    for (got, shape, _, _), (got1, _, _, _) in zip(r0, r1):
        np.testing.assert_array_equal(got, got1)
        assert shape == x.shape
        np.testing.assert_array_equal(got, (x < 0).astype(np.int64))

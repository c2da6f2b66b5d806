"""Property: ``max``, ``any_exceeds`` and ``inner`` in 2PC equal exact integer / numpy oracles and
their plaintext twin on the whole documented domain.

Domains (docs/protocols.md "Conventions and ranges" and the module docstrings); a shared real is
held as ``enc(x) = trunc(x * 2**16)``, public factors as stated per primitive:

* ``max(x, dim, keepdim)`` (no indices are offered): exact, the maximum of the encodings
  (``np.max``); ``|x| < 2**46`` (pairwise differences below ``2**47``); any dim, any ``n >= 1``
  (``n = 0`` raises); ``ceil(log2 n)`` x (comparison + 1) rounds.
* ``any_exceeds(x, d)``: exact on the encodings, ``any(x_enc**2 >= d_enc**2)`` per row (int64
  arithmetic), ``|x|, |d| < 2**15``; ``d`` shared or public, per row, broadcast or a python
  float, ``x`` shared or public; ties ``|x| = |d|`` and one-unit gaps; one opened bit per row;
  2 comparisons + 2 rounds.
* ``inner(x, y, dim)``: the raw sum ``S`` of the encodings' products truncated once, i.e.
  ``floor(S / 2**e)`` or one more (``e = 16`` shared x shared; shared x public: ``y`` encoded
  round-to-nearest with ``e = clamp(16 - ceil(log2 max|y|), 16, 32)`` fractional bits), so
  within one unit of ``2**-16`` of the encodings' inner product and, for grid inputs, of the
  real one up to ``sum |x_i| 2**-(e+1)`` for the public factor's rounding. Range
  ``|<x, y>| < 2**(46 - e)`` (``2**30`` shared x shared: the wrap-free truncation needs the
  raw sum below ``2**62``; docs/protocols.md still says ``2**(47 - e)`` / ``2**31``, see
  ``test_inner_is_exact_up_to_2_pow_30``); partial sums may wrap (large cancelling products
  are drawn); public vectors of magnitude ~1e-7 .. 1e-2 (model differences) and general ones.

Inputs: magnitudes from ``2**-16`` to the bound, zeros, negatives, ties, one-unit gaps, grid
values and off-grid ones (the oracle is then the encoding; the twin is run on the encodings of
shared inputs and on public inputs as they are, so it is compared where those agree).

Batches with zero rows or rows of length zero (``max`` of ``(0, 5)``, ``inner`` of ``(3, 0)``
shared x shared) run too (``test_empty_batch``; the transport once crashed on them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

from protocols.inner_product import inner
from tests.helpers import max_threshold_inner_programs as mp
from tests.helpers import sort_programs as sp
from tests.helpers.fixed_point_strategies import (LSB, SCALE, enc, enc_ints, enc_vectors,
                                                  fixed_arrays, on_grid)

MAX_KEYS = (1 << 62) - 1            # |x| < 2**46
THRESHOLD = (1 << 31) - 1           # |x|, |d| < 2**15
RAW_SUM = 1 << 62                   # |S| < 2**62 (wrap-free truncation)


@pytest.fixture(scope="module")
def ge_rounds(pair) -> int:
    return pair.call(sp.comparison_rounds)[0]


def ring(out) -> np.ndarray:
    kind, arr = out[0], out[1]
    if kind == "sh":
        assert out[2] == 16
        return arr.astype(np.int64)
    return enc(arr)


def spec(arr, how: str):
    return ("pub", arr) if how == "pub" else ("sh", arr, int(how[-1]))


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


# ----------------------------------------------------------------------------- max
@st.composite
def max_cases(draw) -> dict:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9 if ndim == 1 else 5), min_size=ndim,
                                max_size=ndim)))
    if ndim > 1 and draw(st.integers(0, 5)) == 0:
        shape = (0,) + shape[1:]                         # an empty batch
    if ndim <= 2 and draw(st.integers(0, 2)) == 0:  # long rows: more levels, odd carries
        shape = shape[:-1] + (draw(st.sampled_from([16, 17, 31, 33])),)
    dim = draw(st.integers(-ndim, ndim - 1))
    if shape[dim % ndim] == 0:                           # reduce over a non-empty dimension
        dim = (dim + 1) % ndim
    x = draw(fixed_arrays(shape, MAX_KEYS))
    return {"op": "max", "x": ("sh", x, draw(st.integers(0, 1))), "dim": dim,
            "keepdim": draw(st.booleans())}


@given(cases=st.lists(max_cases(), min_size=1, max_size=3))
def test_max_matches_numpy_and_twin(pair, ge_rounds, cases):
    got0, got1 = pair.call(mp.evaluate, cases)
    _same(got0, got1)
    twin = mp.evaluate_plain(cases)
    for case, res, tw in zip(cases, got0, twin):
        note(f"case: {case}")
        x = case["x"][1]
        event("max on grid" if on_grid(x) else "max off grid")
        want = np.max(enc(x), axis=case["dim"], keepdims=case["keepdim"])
        assert res["value"][0] == "sh"
        assert np.array_equal(ring(res["value"]), want)              # exact, as numpy
        assert np.array_equal(ring(res["value"]), ring(tw["value"]))  # = the twin
        if on_grid(x):
            plain = torch.amax(torch.from_numpy(x), dim=case["dim"], keepdim=case["keepdim"])
            assert np.array_equal(ring(res["value"]), enc(plain.numpy()))
        n = x.shape[case["dim"]]
        want = math.ceil(math.log2(n)) * (ge_rounds + 1)
        if x.size:  # (an empty batch skips its comparisons)
            assert res["cost"]["online_rounds"] == want
        else:
            assert res["cost"]["online_rounds"] <= want


def test_max_of_an_empty_dimension_raises(pair):
    cases = [{"op": "max_error", "x": ("sh", np.zeros((3, 0)), 0), "dim": -1},
             {"op": "max_error", "x": ("sh", np.zeros((0,)), 1), "dim": 0}]
    got = pair.call(mp.evaluate, cases)[0]
    assert [r["error"] for r in got] == ["ValueError", "ValueError"]
    assert all(r["error"] is not None for r in mp.evaluate_plain(cases))  # torch.amax too


# ----------------------------------------------------------------------------- any_exceeds
@st.composite
def threshold_cases(draw) -> dict:
    rows = draw(st.sampled_from([(), (0,), (1,), (4,), (2, 3)]))
    m = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13]))
    d_enc = np.array(draw(enc_vectors(int(np.prod(rows, dtype=np.int64)), THRESHOLD)),
                     dtype=np.int64).reshape(rows)
    # coordinates: around the row's threshold (ties |x| = |d|, one-unit gaps), or anything
    size = int(np.prod(rows, dtype=np.int64)) * m
    xs = draw(st.lists(st.one_of(
        st.tuples(st.just("near"), st.integers(-2, 2), st.booleans()),
        st.tuples(st.just("free"), enc_ints(THRESHOLD), st.booleans())),
        min_size=size, max_size=size))
    x_enc = np.zeros(rows + (m,), dtype=np.int64)
    flat, dflat = x_enc.reshape(-1, m) if m else x_enc, np.broadcast_to(d_enc, rows).reshape(-1)
    for i, (kind, val, neg) in enumerate(xs):
        r, c = divmod(i, m)
        k = min(abs(int(dflat[r])) + val, THRESHOLD) if kind == "near" else abs(val)
        flat[r, c] = -max(k, 0) if neg else max(k, 0)
    x = x_enc.astype(np.float64) / SCALE
    d = d_enc.astype(np.float64) / SCALE
    if draw(st.booleans()):  # off the grid: trunc keeps the encodings, the reals move
        x = x + np.sign(x) * np.array(draw(st.lists(
            st.floats(0, 1, exclude_max=True), min_size=x.size, max_size=x.size))).reshape(
            x.shape) * LSB * (np.abs(x) < 2.0 ** 14)
    how_x, how_d = draw(st.sampled_from([("sh0", "sh1"), ("sh1", "sh0"), ("sh0", "sh0"),
                                         ("sh0", "pub"), ("pub", "sh1")]))
    d_form = draw(st.sampled_from(["rows", "rows", "scalar", "float", "broadcast"]))
    if d_form == "scalar" or (d_form == "float" and how_d != "pub"):
        d = np.array(d.reshape(-1)[0] if d.size else 0.5)
    elif d_form == "float":
        return {"op": "any_exceeds", "x": spec(x, how_x),
                "d": ("float", float(d.reshape(-1)[0]) if d.size else 0.5)}
    elif d_form == "broadcast" and len(rows) == 2:
        d = d[:1, :]                                     # (1, 3) against rows (2, 3)
    return {"op": "any_exceeds", "x": spec(x, how_x), "d": spec(d, how_d)}


def _threshold_oracle(case: dict) -> np.ndarray:
    x_enc = enc(case["x"][1])
    d_enc = np.asarray(enc(case["d"][1]))
    rows = x_enc.shape[:-1]
    d2 = np.broadcast_to(d_enc, rows)[..., None].astype(np.int64) ** 2
    return (x_enc.astype(np.int64) ** 2 >= d2).any(axis=-1)


@given(cases=st.lists(threshold_cases(), min_size=1, max_size=3))
def test_any_exceeds_is_exact_on_encodings(pair, ge_rounds, cases):
    got0, got1 = pair.call(mp.evaluate, cases)
    _same(got0, got1)
    twin = mp.evaluate_plain(cases)
    for case, res, tw in zip(cases, got0, twin):
        note(f"case: {case}")
        kind, val, dtype = res["value"]
        want = _threshold_oracle(case)
        assert kind == "pub" and dtype == "torch.bool" and val.shape == want.shape
        assert np.array_equal(val, want)
        event(f"rows exceeding: {'all' if want.all() else 'none' if not want.any() else 'some'}")
        # the twin sees shared inputs as their encodings and public ones as they are
        public = [s[1] for s in (case["x"], case["d"]) if s[0] in ("pub", "float")]
        if all(on_grid(p) for p in public):
            assert np.array_equal(val, tw["value"][1]) and tw["value"][2] == "torch.bool"
        m = np.shape(case["x"][1])[-1]   # m = 0: no coordinate flags to compare
        want = (2 if m else 1) * ge_rounds + 2
        if int(np.prod(np.shape(case["x"][1])[:-1], dtype=np.int64)):
            assert res["cost"]["online_rounds"] == want
        else:                            # no rows: the comparisons are skipped
            assert res["cost"]["online_rounds"] <= want


# ----------------------------------------------------------------------------- inner
def public_exponent(y: np.ndarray) -> int:
    top = float(np.max(np.abs(y))) if y.size else 0.0
    if top == 0.0:
        return 16
    return int(min(max(16 - math.ceil(math.log2(top)), 16), 32))


@st.composite
def inner_cases(draw) -> dict:
    kind = draw(st.sampled_from(["ss", "ss", "sp", "sp", "ps"]))
    m = draw(st.sampled_from([0, 1, 2, 3, 7, 16, 33]))
    batch = draw(st.sampled_from([(), (0,), (1,), (3,)]))
    layout = draw(st.sampled_from(["last", "first", "broadcast"])) if batch else "last"
    xs = draw(enc_vectors(int(np.prod(batch + (m,), dtype=np.int64)), MAX_KEYS))
    x_enc = [int(v) for v in xs]
    pub = kind != "ss"
    ny = m if layout == "broadcast" else len(x_enc)  # broadcast: one y for every row of x
    if pub and draw(st.booleans()):   # a model difference: tiny public entries
        mag = 10.0 ** draw(st.floats(-7, -2))
        y = np.array(draw(st.lists(st.floats(-1, 1), min_size=ny, max_size=ny))) * mag
        y_grid = False
    else:
        y = np.array([float(v) / SCALE for v in draw(enc_vectors(ny, MAX_KEYS))])
        y_grid = True
    if draw(st.integers(0, 3)) == 0 and m >= 2:  # cancelling pairs: huge partial sums
        x_arr = np.array(x_enc, dtype=object).reshape(batch + (m,))
        x_arr[..., 1] = x_arr[..., 0]
        y = np.array(y).reshape((m,) if layout == "broadcast" else batch + (m,))
        y[..., 1] = -y[..., 0]
        x_enc = list(x_arr.reshape(-1))
    x = np.array([float(v) / SCALE for v in x_enc]).reshape(batch + (m,))
    y = np.asarray(y, dtype=np.float64).reshape((m,) if layout == "broadcast" else x.shape)
    # keep the raw sum inside the range: shift x (stays on the grid) until it fits
    e = 16 if kind == "ss" else public_exponent(y)
    for _ in range(200):
        s = raw_sums(x, y, kind, e, -1)
        if all(abs(v) < RAW_SUM for v in np.asarray(s, dtype=object).reshape(-1)):
            break
        x = np.trunc(x / 2.0 * SCALE) / SCALE
    else:
        x = np.zeros_like(x)
    if draw(st.booleans()):           # off the grid (encodings truncate; oracle uses them)
        x = x + np.sign(x) * LSB * np.array(draw(st.lists(
            st.floats(0, 1, exclude_max=True), min_size=x.size, max_size=x.size))).reshape(
            x.shape) * (np.abs(x) < 2.0 ** 30)
        s = raw_sums(x, y, kind, e, -1)
        if not all(abs(v) < RAW_SUM for v in np.asarray(s, dtype=object).reshape(-1)):
            x = np.trunc(x * SCALE) / SCALE
    dim = -1
    if layout == "first":            # reduce over dim 0 of (m, batch)
        x, y, dim = x.T.copy(), y.T.copy(), 0
    hx = draw(st.sampled_from(["sh0", "sh1"]))
    if kind == "ss":
        args = (spec(x, hx), spec(y, draw(st.sampled_from(["sh0", "sh1"]))))
    elif kind == "sp":
        args = (spec(x, hx), ("pub", y))
    else:                            # public first argument, shared second
        args = (("pub", y), spec(x, hx))
    return {"op": "inner", "x": args[0], "y": args[1], "dim": dim, "kind": kind,
            "y_grid": y_grid}


def raw_sums(x: np.ndarray, y: np.ndarray, kind: str, e: int, dim: int) -> np.ndarray:
    """Exact ring sums S (python ints) of the encodings' products along ``dim``."""
    xe = enc(x).astype(object)
    if kind == "ss":
        ye = enc(y).astype(object)
    else:
        ye = np.round(np.asarray(y, dtype=np.float64) * 2.0 ** e).astype(np.int64).astype(object)
    prod = xe * np.broadcast_to(ye, np.broadcast_shapes(xe.shape, ye.shape))
    return prod.sum(axis=dim) if prod.size else np.zeros(prod.shape[:-1], dtype=object) \
        if dim == -1 else np.zeros(prod.shape[1:], dtype=object)


@given(cases=st.lists(inner_cases(), min_size=1, max_size=3))
def test_inner_matches_exact_sum_numpy_and_twin(pair, cases):
    got0, got1 = pair.call(mp.evaluate, cases)
    _same(got0, got1)
    twin = mp.evaluate_plain(cases)
    for case, res, tw in zip(cases, got0, twin):
        note(f"case: {case}")
        kind, dim = case["kind"], case["dim"]
        if kind == "ps":
            y, x = case["x"][1], case["y"][1]
        else:
            x, y = case["x"][1], case["y"][1]
        e = 16 if kind == "ss" else public_exponent(y)
        event(f"inner {kind}, e = {e}")
        S = np.asarray(raw_sums(x, y, kind, e, dim), dtype=object)
        floor = np.vectorize(lambda v: v >> e, otypes=[object])(S) if S.size else S
        got = ring(res["value"]).astype(object)
        assert res["value"][0] == "sh" and got.shape == S.shape
        diff = got - floor
        assert all(d in (0, 1) for d in np.asarray(diff).reshape(-1)), (diff, S)
        if kind == "ss" and S.size:   # Beaver product + one truncation (empty: skipped)
            assert res["cost"]["online_rounds"] == 2
        event(f"inner shape {np.shape(S)}")
        # against numpy on the reals (and the twin): one unit of truncation, the encodings'
        # errors (x truncated, y truncated or rounded to e bits) and float64's own rounding
        real = np.sum(np.broadcast_to(y, np.broadcast_shapes(x.shape, y.shape)) * x, axis=dim)
        bx = np.broadcast_to(x, np.broadcast_shapes(x.shape, y.shape))
        by = np.broadcast_to(y, bx.shape)
        y_err = 2.0 ** -e / 2 if kind != "ss" else LSB
        tol = (LSB + np.sum(np.abs(by) * LSB + np.abs(bx) * y_err, axis=dim)
               + 1e-15 * np.sum(np.abs(bx * by), axis=dim) * max(bx.shape[dim] if bx.size else 1, 1)
               + LSB * 1e-3)
        assert np.all(np.abs(got.astype(np.float64) / SCALE - real) <= tol)
        twin_val = np.asarray(tw["value"][1], dtype=np.float64)
        assert np.all(np.abs(got.astype(np.float64) / SCALE - twin_val) <= tol)


def test_inner_is_exact_up_to_2_pow_30(pair):
    """The top of the shared x shared range: sums within a few units of ``+-2**30``, 64 rows.
    (docs/protocols.md states ``2**31``: from ``2**30`` on the wrap-free truncation's input
    leaves its ``2**62`` range and about half of the sums near ``2**31`` come out wrong.)"""
    rng = np.random.default_rng(7)
    top = (1 << 30) * SCALE - 1                               # |<x, y>| < 2**30 in 2**-16 units
    want = top - rng.integers(0, 1 << 20, size=64)
    want[::2] *= -1
    # x_enc * y_enc = want * 2**16 with y = 2**15 (y_enc = 2**31): x_enc = want / 2**15 ...
    # keep it exact with two coordinates: x = (want >> 15, want & (2**15-1)), y = (2**15, 1)
    x = np.stack([(want >> 15) / SCALE, (want & ((1 << 15) - 1)) / SCALE], axis=-1)
    y = np.broadcast_to(np.array([2.0 ** 15, 1.0]), x.shape).copy()
    cases = [{"op": "inner", "x": ("sh", x, 0), "y": ("sh", y, 1), "dim": -1},
             {"op": "inner", "x": ("sh", x, 0), "y": ("pub", y), "dim": -1}]
    got = pair.call(mp.evaluate, cases)[0]
    S = (enc(x).astype(object) * enc(y).astype(object)).sum(axis=-1)
    assert all(abs(int(s)) < RAW_SUM for s in S)
    for res in got:
        diff = ring(res["value"]).astype(object) - np.vectorize(lambda v: v >> 16,
                                                                otypes=[object])(S)
        assert all(d in (0, 1) for d in diff), diff


def test_inner_of_empty_vectors_is_zero(pair):
    """m = 0: the empty sum, shared x shared and shared x public (the public exponent of an
    empty vector used to raise in ``max()``)."""
    cases = [{"op": "inner", "x": ("sh", np.zeros(0), 0), "y": ("sh", np.zeros(0), 1), "dim": -1},
             {"op": "inner", "x": ("sh", np.zeros(0), 0), "y": ("pub", np.zeros(0)), "dim": -1},
             {"op": "inner", "x": ("pub", np.zeros(0)), "y": ("sh", np.zeros(0), 1), "dim": -1}]
    got = pair.call(mp.evaluate, cases)[0]
    for res in got:
        assert res["value"][0] == "sh" and ring(res["value"]).tolist() == 0
    assert float(inner(torch.zeros(0), torch.zeros(0))) == 0.0


@pytest.mark.parametrize("what", ["max (0, 5)", "inner (3, 0)"])
def test_empty_batch(pair, what):
    if what.startswith("max"):
        assert pair.call(mp.max_empty_batch, (0, 5))[0] == (0,)
    else:
        assert pair.call(mp.inner_empty_batch, (3, 0))[0] == (3,)


@given(values=st.lists(st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.sampled_from([0.0, -0.0, 2**-40, -(2**-40)])),
                       max_size=40),
       rows=st.integers(1, 4))
def test_public_bits_is_the_exponent_of_the_largest_magnitude(values, rows):
    """``public_bits`` (one exponent for a whole public factor, shards included) equals
    ``clamp(16 - ceil(log2 max|y|), 16, 32)`` computed here with Python floats (16 for an
    all-zero or empty factor), whatever the factor's shape."""
    from protocols.inner_product import public_bits

    big = max((abs(v) for v in values), default=0.0)
    want = 16 if big == 0 else min(32, max(16, 16 - math.ceil(math.log2(big))))
    y = torch.tensor(values * rows, dtype=torch.float64).reshape(rows, -1) if values else torch.zeros(rows, 0)
    assert public_bits(y) == want
    assert public_bits(y.reshape(-1)) == want


@st.composite
def row_cases(draw):
    """x (T, m) on any part of the grid the sum allows; public rows Y of any magnitude (unit
    steps, tiny model steps, zero rows, a mixture): one exponent for all of Y."""
    T, m = draw(st.integers(0, 4)), draw(st.integers(1, 12))
    x = draw(fixed_arrays((T, m), 1 << 24))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scales = draw(st.lists(st.sampled_from([0.0, 1e-4, 0.3, 1.0, 37.0]), min_size=T, max_size=T))
    Y = np.stack([rng.standard_normal(m) * s for s in scales]) if T else np.zeros((0, m))
    return {"x": x, "Y": Y, "k": draw(st.integers(1, m))}


@given(case=row_cases())
def test_inner_rows_is_the_batched_inner_one_public_row_at_a_time(pair, case):
    """``inner_rows`` (round selection's keys with one model step held at a time) against the
    exact sums of the encodings, with Y encoded at the exponent of the *whole* Y (as the
    batched ``inner`` encodes it): floor(S / 2**e) or one unit more, per row; the same on k
    coordinate slices (the workers' path), which keep at most one public row at a time and
    nothing after; the plaintext twin equals numpy's row sums."""
    x, Y, k = case["x"], case["Y"], case["k"]
    got = pair.call(mp.inner_rows_ways, x, Y, k)[0]
    e = public_exponent(Y)
    ye = np.round(Y * 2.0 ** e).astype(np.int64).astype(object)
    S = (enc(x).astype(object) * ye).sum(axis=-1) if len(x) else np.zeros(0, dtype=object)
    floor = [int(s) >> e for s in S]
    event(f"inner_rows e = {e}")
    for way in ("whole", "sharded") if len(x) else ("whole",):
        assert len(got[way]) == len(floor)
        assert all(g - f in (0, 1) for g, f in zip(got[way], floor)), (way, got[way], floor)
    if len(x):
        assert got["public_rows_held"] <= 1 and got["held_after"] == 0
    from protocols.inner_product import inner_rows
    plain = inner_rows(torch.as_tensor(x), lambda r: torch.as_tensor(Y[r])).numpy()
    np.testing.assert_allclose(plain, (x * Y).sum(axis=-1), rtol=1e-12, atol=1e-300)

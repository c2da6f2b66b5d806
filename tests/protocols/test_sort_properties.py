"""Property: ``bitonic_sort`` and ``top_k`` in 2PC equal numpy / ``Fraction`` oracles and their
plaintext twin on the whole documented domain.

Domain (docs/protocols.md "Conventions and ranges", "Sorting, ties and top-k";
``protocols/sort.py``, ``protocols/compare.py``): a shared real is held as
``enc(x) = trunc(x * 2**16)`` and sorts are exact, so the oracle is the order of the encodings:

* default comparator, stable: ``|key| < 2**46 / n`` (``key_enc * n + rank`` must fit);
  unstable or a custom comparator (generic tie fallback): ``|key| < 2**46`` (``|a - b| < 2**47``);
* ``ratio_comparator`` on ``(u, v)``: ``v >= 2**-16`` (``v_enc >= 1``), ``|u v| < 2**30 / n``
  stable, ``< 2**30`` unstable; the order is that of the exact fractions ``u_enc / v_enc``;
* payloads (shared or public, float or int, |p| < 2**46) follow their keys bit for bit;
  public payloads become shared when the keys are shared, and so do public components of
  tuple keys next to a shared one; with public keys everything is local (0 rounds);
* ties: stable sorts order equal keys by original position (``numpy.argsort(kind="stable")``
  on the keys, or on their negation for descending); ``top_k`` returns the first ``k`` of that
  order, ``k = 0`` returns an empty result without communicating;
* rounds: ``num_layers(n)`` x (comparison + 1), ratio keys one more per layer;
* inputs: magnitudes from ``2**-16`` to the bound, zeros, negatives, ties drawn from a pool of
  1-3 values, one-unit gaps, fixed-point-exact values and off-grid ones (the 2PC result is the
  sort of the *encodings*; the twin is run on those encodings and must agree bit for bit;
  public keys are compared as the floats they are, in 2PC and in the twin);
  n = 0 .. 17 (odd, powers of two and one past), batch shapes (), (0,), (1,), (3,), (2, 2);
  keys shared by either party or public (with shared payloads), ``(u, v)`` in every mix.

Batches with zero rows, e.g. keys of shape ``(0, 5)``, are sorted and opened too
(``test_empty_batch_opening``: the transport once failed on tensors with a zero in a
multi-dimensional shape).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from protocols.compare import ge_ratio
from protocols.sort import num_layers, ratio_comparator, top_k
from tests.helpers import sort_programs as sp
from tests.helpers.fixed_point_strategies import (LSB, SCALE, dec, enc, enc_ints, fixed_arrays,
                                                  on_grid)

RING_KEYS = (1 << 62) - 1          # |key| < 2**46  <=>  |enc| < 2**62
RATIO_PRODUCT = 1 << 62            # |u v| < 2**30  <=>  |u_enc v_enc| < 2**62

SIZES = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17])
BATCHES = st.sampled_from([(), (0,), (1,), (3,), (2, 2)])
SHARING = st.sampled_from(["sh0", "sh1", "pub"])


def spec(arr: np.ndarray, how: str):
    return ("pub", arr) if how == "pub" else ("sh", arr, int(how[-1]))


def ring(out) -> np.ndarray:
    """Ring integers (16 fractional bits) of an opened result, shared or public."""
    kind, arr = out[0], out[1]
    if kind == "sh":
        assert out[2] == 16
        return arr.astype(np.int64)
    if np.issubdtype(arr.dtype, np.floating):
        return enc(arr)
    return arr.astype(np.int64) * SCALE


def ring_of_input(s) -> np.ndarray:
    """Ring integers of an input spec as the protocol holds them."""
    if s[0] == "sh" or np.issubdtype(s[1].dtype, np.floating):
        return enc(s[1])
    return s[1].astype(np.int64) * SCALE


def order_values(s) -> np.ndarray:
    """What the sort orders: public keys by their float value, shared ones by their encoding."""
    return s[1] if s[0] == "pub" else enc(s[1])


def key_bound(n: int, stable: bool, comparator: str) -> int:
    if stable and comparator in ("default", "ge") and n > 0:
        return -(-(1 << 62) // n) - 1        # |enc| < 2**62 / n
    return RING_KEYS


# ----------------------------------------------------------------------------- strategies
@st.composite
def payloads(draw, shape: tuple):
    """None, one payload or a tuple of 1-3, each shared float / public int / public float,
    ``|p| < 2**46``."""
    bound = RING_KEYS
    layout = draw(st.sampled_from(["none", "single", "tuple"]))
    if layout == "none":
        return None
    count = 1 if layout == "single" else draw(st.integers(1, 3))
    out = []
    for _ in range(count):
        kind = draw(st.sampled_from(["sh", "pub_int", "pub_float"]))
        if kind == "pub_int":
            lim = bound // SCALE
            vals = draw(st.lists(st.integers(-lim, lim), min_size=int(np.prod(shape)),
                                 max_size=int(np.prod(shape))))
            out.append(("pub", np.array(vals, dtype=np.int64).reshape(shape)))
        elif kind == "pub_float":
            out.append(("pub", draw(fixed_arrays(shape, bound))))
        else:
            out.append(("sh", draw(fixed_arrays(shape, bound)), draw(st.integers(0, 1))))
    return out[0] if layout == "single" else out


@st.composite
def sort_cases(draw) -> dict:
    n = draw(SIZES)
    shape = draw(BATCHES) + (n,)
    stable = draw(st.booleans())
    comparator = draw(st.sampled_from(["default", "default", "ge", "custom"]))
    how = draw(SHARING)
    keys = draw(fixed_arrays(shape, key_bound(n, stable, comparator)))
    key_spec = spec(keys, how)
    if comparator == "ge" or draw(st.integers(0, 4)) == 0:
        key_spec = [key_spec]                              # 1-tuple keys: tuple out
    return {"op": "sort", "keys": key_spec, "payloads": draw(payloads(shape)),
            "descending": draw(st.booleans()), "stable": stable, "comparator": comparator}


@st.composite
def ratio_arrays(draw, shape: tuple, bound: int, off_grid_u: bool = True,
                 off_grid_v: bool = True):
    """(u, v) with v_enc >= 1 and max|u_enc| * max|v_enc| < bound; equal ratios from different
    pairs, exact near-ties (u_a v_b - u_b v_a = +-1 on the encodings) and off-grid entries."""
    size = int(np.prod(shape))
    vbits = draw(st.integers(1, bound.bit_length() - 2))
    vmax = (1 << vbits) - 1
    umax = (bound - 1) // vmax
    mode = draw(st.sampled_from(["wide", "equal_ratios", "near_ties"]))
    if mode == "wide" or size == 0:
        u = draw(fixed_arrays((size,), umax, off_grid=off_grid_u))
        v = draw(fixed_arrays((size,), vmax, positive=True, off_grid=off_grid_v))
        return u.reshape(shape), v.reshape(shape)
    ue, ve = [], []
    if mode == "equal_ratios":
        pool = [(draw(enc_ints(umax)), draw(enc_ints(vmax, positive=True))) for _ in range(2)]
        for _ in range(size):
            a, b = draw(st.sampled_from(pool))
            s = draw(st.integers(1, 4))
            while abs(a * s) > umax or b * s > vmax:
                s -= 1
            ue.append(a * s)
            ve.append(b * s)
    else:
        a = draw(enc_ints(umax))
        b = draw(enc_ints(vmax, positive=True))
        while np.gcd(abs(a), b) != 1 and b > 1:
            b -= 1
        for _ in range(size):
            pick = draw(st.integers(0, 2))
            if pick == 0 or b == 1:
                ue.append(a)
                ve.append(b)
                continue
            # neighbour fraction a2/b2 with a b2 - a2 b = +-1 (smallest possible gap)
            sign = 1 if pick == 1 else -1
            b2 = pow(a % b, -1, b) * sign % b or b
            a2 = (a * b2 - sign) // b
            if abs(a2) > umax or b2 > vmax or b2 < 1:
                a2, b2 = a, b
            ue.append(a2)
            ve.append(b2)
    u = np.array([float(k) / SCALE for k in ue]).reshape(shape)
    v = np.array([float(k) / SCALE for k in ve]).reshape(shape)
    return u, v


@st.composite
def ratio_cases(draw) -> dict:
    n = draw(SIZES.filter(lambda m: m <= 12))
    shape = draw(BATCHES) + (n,)
    stable = draw(st.booleans())
    bound = RATIO_PRODUCT // max(n, 1) if stable else RATIO_PRODUCT
    hu, hv = draw(SHARING), draw(SHARING)
    u, v = draw(ratio_arrays(shape, bound))
    keys_shared = not hu == hv == "pub"
    pay = draw(payloads(shape))
    if not keys_shared and pay is None:
        pay = ("sh", draw(fixed_arrays(shape, RING_KEYS)), 1)
    return {"op": "sort", "keys": [spec(u, hu), spec(v, hv)], "payloads": pay,
            "descending": draw(st.booleans()), "stable": stable, "comparator": "ratio"}


# ----------------------------------------------------------------------------- oracles
def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(int(np.prod(a.shape[:-1], dtype=np.int64)), a.shape[-1])


def _spec_leaves(s) -> list:
    if s is None:
        return []
    return s if isinstance(s, list) else [s]


def _out_leaves(o) -> list:
    if o is None:
        return []
    return o if isinstance(o, list) else [o]


def _any_shared(specs) -> bool:
    return any(s[0] == "sh" for s in specs)


def stable_order(key_ring: np.ndarray, descending: bool) -> np.ndarray:
    return np.argsort(-key_ring if descending else key_ring, axis=-1, kind="stable")


def ratios(u: np.ndarray, v: np.ndarray) -> list:
    """Rows of exact fractions u/v (ring integers or floats alike: both convert exactly)."""
    ur, vr = _rows(np.asarray(u)), _rows(np.asarray(v))
    conv = (lambda a: Fraction(int(a))) if ur.dtype.kind == "i" else Fraction
    return [[conv(a) / conv(b) for a, b in zip(ur[r], vr[r])] for r in range(ur.shape[0])]


def ratio_order(u: np.ndarray, v: np.ndarray, descending: bool) -> np.ndarray:
    out = np.zeros(np.shape(u), dtype=np.int64)
    orow = _rows(out)
    for r, fr in enumerate(ratios(u, v)):
        orow[r] = sorted(range(len(fr)), key=lambda i: (-fr[i] if descending else fr[i], i))
    return out


def check_sharedness(case: dict, res: dict) -> None:
    keys = _spec_leaves(case["keys"])
    pays = _spec_leaves(case["payloads"])
    keys_shared = _any_shared(keys)
    for s, o in zip(keys, _out_leaves(res["keys"])):
        assert o[0] == ("sh" if keys_shared else s[0]), "key sharedness"
    for s, o in zip(pays, _out_leaves(res["payloads"])):
        assert o[0] == ("sh" if keys_shared or s[0] == "sh" else "pub"), "payload sharedness"
    assert res["keys_tuple"] == isinstance(case["keys"], list)
    assert res["pay_tuple"] == isinstance(case["payloads"], list)


def check_sort(case: dict, res: dict, order: np.ndarray | None) -> None:
    """``order`` given: outputs are the inputs permuted by it. None (unstable): sorted keys and
    every output row a permutation of its input row carrying all components together."""
    check_sharedness(case, res)
    keys = _spec_leaves(case["keys"])
    pays = _spec_leaves(case["payloads"])
    ins = [ring_of_input(s) for s in keys + pays]
    outs = [ring(o) for o in _out_leaves(res["keys"]) + _out_leaves(res["payloads"])]
    for a, b in zip(ins, outs):
        assert a.shape == b.shape
    if order is not None:
        for i, (a, b) in enumerate(zip(ins, outs)):
            assert np.array_equal(np.take_along_axis(a, order, axis=-1), b), f"component {i}"
        return
    n = ins[0].shape[-1]
    rows_in = [_rows(a) for a in ins]
    rows_out = [_rows(b) for b in outs]
    for r in range(rows_in[0].shape[0] if n else 0):
        tin = sorted(zip(*[x[r].tolist() for x in rows_in]))
        tout = sorted(zip(*[x[r].tolist() for x in rows_out]))
        assert tin == tout, f"row {r} is not a permutation carrying its payloads"


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ge_rounds(pair) -> int:
    return pair.call(sp.comparison_rounds)[0]


def check_rounds(case: dict, res: dict, ge_rounds: int) -> None:
    """A layer is one comparator call and one exchange round (ratio keys: one more round for
    the cross products); public keys: everything is local."""
    keys = _spec_leaves(case["keys"])
    n = keys[0][1].shape[-1]
    if not _any_shared(keys):
        want = 0
    elif case["comparator"] == "ratio":
        want = num_layers(n) * (ge_rounds + 2)
    elif case["comparator"] == "custom" and case["stable"]:
        return  # generic tie fallback: documented as extra products and a rank comparison
    else:
        want = num_layers(n) * (ge_rounds + 1)
    if keys[0][1].size:
        assert res["cost"]["online_rounds"] == want, (res["cost"], want)
    else:  # an empty batch skips its comparisons
        assert res["cost"]["online_rounds"] <= want, (res["cost"], want)


@given(cases=st.lists(sort_cases(), min_size=1, max_size=2))
def test_bitonic_sort_matches_numpy_and_twin(pair, ge_rounds, cases):
    got0, got1 = pair.call(sp.evaluate, cases)
    twin = sp.evaluate_plain(cases)
    for i, (case, res) in enumerate(zip(cases, got0)):
        note(f"case {i}: {case}")
        _assert_same(res, got1[i])
        check_rounds(case, res, ge_rounds)
        keys = _spec_leaves(case["keys"])[0]
        vals = order_values(keys)
        event(f"keys {keys[0]}, {'stable' if case['stable'] else 'unstable'}, "
              f"{case['comparator']}, {'on grid' if on_grid(keys[1]) else 'off grid'}")
        event(f"ties: {'yes' if len(np.unique(enc(keys[1]))) < keys[1].size else 'no'}")
        if case["stable"]:
            check_sort(case, res, stable_order(vals, case["descending"]))
        else:
            check_sort(case, res, None)
            sorted_keys = ring(_out_leaves(res["keys"])[0])
            want = np.sort(vals, axis=-1)
            want = want[..., ::-1] if case["descending"] else want
            assert np.array_equal(sorted_keys, enc(want) if keys[0] == "pub" else want)
        _assert_twin(res, twin[i])


@given(cases=st.lists(ratio_cases(), min_size=1, max_size=2))
def test_ratio_sort_matches_fractions_and_twin(pair, ge_rounds, cases):
    got0, got1 = pair.call(sp.evaluate, cases)
    twin = sp.evaluate_plain(cases)
    for i, (case, res) in enumerate(zip(cases, got0)):
        note(f"case {i}: {case}")
        _assert_same(res, got1[i])
        check_rounds(case, res, ge_rounds)
        us, vs = case["keys"]
        assert (ring_of_input(vs) >= 1).all()
        # shared keys (any component shared): the order of the encodings (public components
        # are shared, i.e. truncated, up front); all-public keys: exact on the floats
        mixed = not us[0] == vs[0] == "pub"
        u_key, v_key = (ring_of_input(us), ring_of_input(vs)) if mixed else (us[1], vs[1])
        event(f"u {us[0]}, v {vs[0]}; {'on grid' if on_grid(us[1]) and on_grid(vs[1]) else 'off grid'}")
        if case["stable"]:
            check_sort(case, res, ratio_order(u_key, v_key, case["descending"]))
        else:
            check_sort(case, res, None)
            su, sv = ((ring(o) if mixed else o[1]) for o in res["keys"])
            for r, fr in enumerate(ratios(su, sv)):
                assert fr == sorted(fr, reverse=case["descending"]), f"row {r} not sorted by u/v"
        # the twin holds public components as reals, the 2PC sort (mixed keys) their encodings
        if not mixed or all(on_grid(s[1]) for s in (us, vs) if s[0] == "pub"):
            _assert_twin(res, twin[i])


@st.composite
def top_k_cases(draw) -> dict:
    n = draw(SIZES)
    shape = draw(BATCHES) + (n,)
    stable = draw(st.integers(0, 3)) > 0
    how = draw(SHARING)
    keys = draw(fixed_arrays(shape, key_bound(n, stable, "default")))
    pay = None if not stable else draw(payloads(shape))
    if how == "pub" and not _any_shared(_spec_leaves(pay)):
        if stable:
            pay = ("sh", draw(fixed_arrays(shape, RING_KEYS)), 0)
        else:  # unstable: a shared index payload, so that the selection can be checked
            pay = ("sh", np.broadcast_to(np.arange(n, dtype=np.float64), shape).copy(), 1)
    case = {"keys": spec(keys, how), "payloads": pay, "descending": draw(st.booleans()),
            "stable": stable, "comparator": "default", "n": n}
    if n <= 9:
        case["op"] = "top_k_all"        # every k = 0..n on the same input
    else:
        case["op"] = "top_k"
        case["k"] = draw(st.integers(0, n))
    return case


def _check_top_k_value(case: dict, k: int, entry: dict, order: np.ndarray | None) -> None:
    pays = _spec_leaves(case["payloads"])
    outs = _out_leaves(entry["value"])
    batch = case["keys"][1].shape[:-1]
    assert entry["tuple"] == isinstance(case["payloads"], list)
    key_ring = order_values(case["keys"])
    if not pays or order is None:
        (kind, idx, dtype), = outs
        assert kind == "pub" and idx.shape == batch + (k,)
        assert dtype == ("torch.int64" if not pays else "torch.float64")
        idx = idx.astype(np.int64)
        if order is not None:
            assert np.array_equal(idx, order[..., :k]), f"k={k}"
        else:  # unstable: the k best keys (as a multiset), at distinct indices
            got = np.sort(np.take_along_axis(key_ring, idx, axis=-1), axis=-1)
            srt = np.sort(key_ring, axis=-1)
            best = srt[..., ::-1][..., :k] if case["descending"] else srt[..., :k]
            assert np.array_equal(got, np.sort(best, axis=-1)), f"k={k}"
            for row in _rows(idx) if k else []:
                assert len(set(row.tolist())) == k
        return
    keys_shared = case["keys"][0] == "sh"
    for s, (kind, val, dtype) in zip(pays, outs):
        assert kind == "pub" and val.shape == batch + (k,)
        src = s[1]
        if s[0] == "pub" and not np.issubdtype(src.dtype, np.floating):
            assert dtype == str(torch.from_numpy(src).dtype)
            want = np.take_along_axis(src, order, axis=-1)[..., :k]
            assert np.array_equal(val, want), f"k={k}"
        else:
            assert dtype == ("torch.float64" if keys_shared or s[0] == "sh" else str(
                torch.from_numpy(src).dtype))
            held = dec(enc(src)) if (keys_shared or s[0] == "sh") else src
            want = np.take_along_axis(held, order, axis=-1)[..., :k]
            assert np.array_equal(val, want), f"k={k}"


@settings(max_examples=max(5, settings.default.max_examples // 3))   # ~1 s a 2PC example
@given(case=top_k_cases())
def test_top_k_matches_stable_argsort_for_every_k(pair, case):
    """Indices / payloads of the k best, in rank order, ``k = 0..n`` (n <= 9: all of them in
    one call; larger n: a drawn k). ``k = 0`` costs nothing online."""
    got0, got1 = pair.call(sp.evaluate, [case])
    twin = sp.evaluate_plain([case])[0]
    res = got0[0]
    _assert_same(res, got1[0])
    order = stable_order(order_values(case["keys"]), case["descending"]) if case["stable"] \
        else None
    for k, entry in res.items():
        _check_top_k_value(case, k, entry, order)
        if k == 0:
            assert all(v == 0 for v in entry["cost"].values()), entry["cost"]
        elif _any_shared([case["keys"]] + _spec_leaves(case["payloads"])):
            # one sort plus exactly one opening of the heads
            assert entry["cost"]["online_rounds"] >= 1
        _assert_twin(entry["value"], twin[k]["value"])


def test_top_k_zero_is_empty_and_silent(pair):
    """Regression: ``top_k(shared_keys, None, 0)`` raised inside the communicator. ``k = 0``
    must return ``(..., 0)`` results of the payloads' result dtypes with no communication."""
    rng = np.random.default_rng(3)
    cases = []
    for shape in [(5,), (2, 3, 5), (0,), (1,), (3, 0)]:
        keys = np.round(rng.normal(size=shape) * 8) / 4
        for pay in [None, ("sh", np.ones(shape), 1), ("pub", np.arange(int(np.prod(shape)))
                                                       .reshape(shape)),
                    [("sh", np.ones(shape), 0), ("pub", np.zeros(shape))]]:
            cases.append({"op": "top_k", "k": 0, "keys": ("sh", keys, 0), "payloads": pay,
                          "n": shape[-1]})
    values, meters = pair.call_metered(sp.evaluate, cases)
    got = values[0]
    _assert_same(got, values[1])
    assert meters[0]["online_rounds"] == 0 and meters[0]["online_bytes_sent"] == 0
    for case, res in zip(cases, got):
        entry = res[0]
        assert all(v == 0 for v in entry["cost"].values())
        shape = case["keys"][1].shape
        outs = _out_leaves(entry["value"])
        assert entry["tuple"] == isinstance(case["payloads"], list)
        for o in outs:
            assert o[0] == "pub" and o[1].shape == shape[:-1] + (0,)
        if case["payloads"] is None:
            assert [o[2] for o in outs] == ["torch.int64"]
        else:  # shared keys: every payload opens as float64, public int ones keep their dtype
            want = [o_in[1].dtype for o_in in _spec_leaves(case["payloads"])]
            assert [o[2] for o in outs] == [
                "torch.int64" if (s_[0] == "pub" and not np.issubdtype(d, np.floating))
                else "torch.float64" for s_, d in zip(_spec_leaves(case["payloads"]), want)]
    twin = sp.evaluate_plain(cases)
    for res, tw in zip(got, twin):
        assert [o[1].shape for o in _out_leaves(res[0]["value"])] == \
            [o[1].shape for o in _out_leaves(tw[0]["value"])]


def test_top_k_returns_public_payloads_as_given(pair):
    """Regression: with public keys and a shared payload beside public ones, top_k opened the
    public heads too, so off-grid floats came back truncated to the grid and int64 payloads
    beyond 2**53 rounded through float64. Public payloads keep their dtype (also float32 under
    shared keys, where they are shared and opened on the grid)."""
    keys = np.array([[0.5, 2.0, -1.0, 2.0]])
    big = np.array([[2 ** 60 + 1, 2 ** 60 + 3, 5, -(2 ** 62) + 7]], dtype=np.int64)
    fine = np.array([[1e-7, 0.1, 1 / 3, -2.5e-6]])
    order = [1, 3, 0]
    cases = [{"op": "top_k", "k": 3, "keys": ("pub", keys),
              "payloads": [("pub", big), ("pub", fine), ("sh", fine, 1)]},
             {"op": "top_k", "k": 3, "keys": ("sh", keys, 0),
              "payloads": [("pub", fine.astype(np.float32)), ("pub", big >> 20)]}]
    got = pair.call(sp.evaluate, cases)[0]
    (_, v1, d1), (_, v2, d2), (_, v3, d3) = got[0][3]["value"]
    assert d1 == "torch.int64" and v1.tolist() == big[:, order].tolist()
    assert d2 == "torch.float64" and np.array_equal(v2, fine[:, order])
    assert d3 == "torch.float64" and np.array_equal(v3, dec(enc(fine))[:, order])
    (_, w1, e1), (_, w2, e2) = got[1][3]["value"]
    assert e1 == "torch.float32" and np.array_equal(
        w1, dec(enc(fine.astype(np.float32).astype(np.float64)))[:, order].astype(np.float32))
    assert e2 == "torch.int64" and w2.tolist() == (big >> 20)[:, order].tolist()
    twin = sp.evaluate_plain(cases[:1])[0]
    _assert_twin(got[0][3]["value"], twin[3]["value"])


def test_top_k_rejects_k_outside_0_n(pair):
    keys = np.array([[1.0, -2.0, 0.5]])
    cases = [{"op": "top_k_error", "k": k, "keys": ("sh", keys, 0), "payloads": None}
             for k in (-1, 4, 17)]
    cases.append({"op": "top_k_error", "k": 1, "keys": ("sh", np.zeros(0), 0), "payloads": None})
    got = pair.call(sp.evaluate, cases)[0]
    assert [r["error"] for r in got] == ["ValueError"] * 4
    assert [r["error"] for r in sp.evaluate_plain(cases)] == ["ValueError"] * 4


def test_mixed_ratio_keys_compare_one_encoding(pair):
    """Regression: public off-grid ``u`` with shared ``v`` was encoded round-to-nearest in the
    first layer (local products) and truncated after it (shared by the exchange), so the result
    was sorted by neither (e.g. [1 7 3 0 4 6 2 5]). Now the sort of the truncated encodings."""
    u = np.array([[1.87219547, 2.01851722, 0.70749557, 2.00119968, 1.50336397, 0.43666705,
                   1.20325284, 2.32494264]]) / SCALE
    v = np.ones_like(u)
    case = {"op": "sort", "keys": [("pub", u), ("sh", v, 1)],
            "payloads": ("pub", np.arange(8)[None, :]), "comparator": "ratio"}
    res = pair.call(sp.evaluate, [case])[0][0]
    assert np.array_equal(ring(res["payloads"]) // SCALE, [[1, 3, 7, 0, 4, 6, 2, 5]])
    check_sort(case, res, ratio_order(enc(u), enc(v), True))


def test_public_keys_move_shared_payloads_exactly_and_locally(pair):
    """Public keys: the exchange bit is public, so shared payloads move by a local product with
    the integer bit -- exact for any payload and no round. (Was a fixed-point product by a
    float 0./1. with a truncation per layer, wrong from payload differences of 2**30 on.)"""
    case = {"op": "sort", "keys": ("pub", np.array([2.0, 1.0, 3.0])), "descending": False,
            "payloads": ("sh", np.array([2.0 ** 40, -(2.0 ** 40), 7.0e12 + LSB]), 0)}
    res = pair.call(sp.evaluate, [case])[0][0]
    assert np.array_equal(ring(res["payloads"]), enc([-(2.0 ** 40), 2.0 ** 40, 7.0e12 + LSB]))
    assert res["cost"]["online_rounds"] == 0 and res["cost"]["online_bytes_sent"] == 0


def test_ratio_twin_is_exact_on_near_ties(pair):
    """u1/v1 < u2/v2 by the smallest possible margin (u1_enc v2_enc - u2_enc v1_enc = -1),
    cross products near 2**27 (inside ``|u v| < 2**30 / n``): 2PC and the plaintext twin both
    order them exactly (the twin once rounded both float64 products to the same value)."""
    u1, v1, u2, v2 = (t / SCALE for t in (1073741825, 1073741827, 536870913, 536870914))
    assert Fraction(u1) / Fraction(v1) < Fraction(u2) / Fraction(v2)
    T = lambda *a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    assert ge_ratio(T(u1), T(v1), T(u2), T(v2)).tolist() == [0.0]
    assert top_k((T(u1, u2), T(v1, v2)), None, 1, comparator=ratio_comparator).tolist() == [1]
    u, v = np.array([[u1, u2]]), np.array([[v1, v2]])
    cases = [{"op": "top_k", "k": 1, "keys": [("sh", u, 0), ("sh", v, 1)], "payloads": None,
              "comparator": "ratio"},
             {"op": "top_k", "k": 1, "keys": [("sh", u, 0), ("pub", v)], "payloads": None,
              "comparator": "ratio", "stable": False}]
    got = pair.call(sp.evaluate, cases)[0]
    assert got[0][1]["value"][1].tolist() == [[1]]
    assert got[1][1]["value"][1].tolist() == [[1]]


@pytest.mark.parametrize("what", ["open (3, 0)", "top_k (0, 5) k=2"])
def test_empty_batch_opening(pair, what):
    if what.startswith("open"):
        assert pair.call(sp.open_empty_batch, (3, 0))[0] == (3, 0)
    else:
        assert pair.call(sp.top_k_empty_batch, (0, 5), 2)[0] == (0, 2)


# ----------------------------------------------------------------------------- comparisons
def _assert_same(a, b) -> None:
    """Both parties returned identical results."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def _assert_twin(res, tw) -> None:
    """2PC result equals the plaintext twin's on the encodings: same values; shared results
    compare by their ring integers, public ones must also agree in dtype."""
    if isinstance(res, dict):
        for key in ("keys", "payloads"):  # (costs: the twin has none)
            _assert_twin(res[key], tw[key])
        return
    if res is None:
        assert tw is None
        return
    if isinstance(res, list):
        assert isinstance(tw, list) and len(res) == len(tw)
        for a, b in zip(res, tw):
            _assert_twin(a, b)
        return
    assert tw[0] == "pub"
    if res[0] == "pub" and not np.issubdtype(res[1].dtype, np.floating):
        assert res[2] == tw[2]
        assert np.array_equal(res[1], tw[1])
        return
    assert np.array_equal(ring(res), ring(tw))

"""Property: the range check of uploads (``protocols.upload_range``) opens the right bit per
client on *every* ring input, in 2PC and in the plaintext twin, for both methods.

Oracle: Python integers (no int64, no torch): a client passes iff every coordinate is in
[-2**b, 2**b), its delta in [0, 2**delta_bits), its norm in [0, 2**norm_bits) and, with the
consistency check, S_t <= R_t as the module docstring defines them. Inputs are drawn per client
from kinds that matter for an attacker: honest small values, each edge of the window, 2**62,
-2**63, uniform garbage, zero vectors, values whose two *shares* are each in range while their
sum is not (and shares whose sum wraps), lying norms and deltas; shares split uniformly or
with both halves small. One two-party session per module (fixture ``pair``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from protocols.upload_range import norm_plan, uploads_in_range
from common import sharing

LO, HI = -(2**63), 2**63 - 1
KINDS = ("honest", "honest", "zero", "edge", "big", "min", "garbage", "halves", "wrap")
DIMS = (1, 2, 63, 64, 65, 200, 1100)


# ----------------------------------------------------------------------------- party programs
def _mine(party, pair_of_shares):
    from mpc.crypten_compat import crypten
    s0, s1 = pair_of_shares
    return crypten.mpc.MPCTensor.from_shares(torch.from_numpy(np.ascontiguousarray(s0 if party.rank == 0 else s1)),
                                             precision=16)


def check_program(party, updates, norms, deltas, kwargs):
    """uploads_in_range on shares; also the online rounds and the verdict step's opening size."""
    args = [None if s is None else _mine(party, s) for s in (updates, norms, deltas)]
    with party.meter("check"):
        key = party.metering.open_steps()[-1]
        bits = uploads_in_range(party, *args, **kwargs)
    steps = party.meters()["steps"]
    return bits, {k[len(key) + 1:]: v["online_rounds"] for k, v in steps.items() if k.startswith(key + "/")}


def below_program(party, share0, share1, ks):
    from mpc.nonnegative import below_power_of_two
    x = _mine(party, (share0, share1))
    return [below_power_of_two(x, k).reveal().numpy().copy() for k in ks]


# ----------------------------------------------------------------------------- oracle, shares
def oracle(xs, norms, deltas, b, norm_bits, delta_bits, consistency, e=10, slack=16) -> list[bool]:
    out = []
    for i, row in enumerate(xs):
        ok = all(-(2**b) <= v < 2**b for v in row)
        if deltas is not None:
            ok = ok and 0 <= deltas[i] < 2**delta_bits
        if norms is not None:
            ok = ok and 0 <= norms[i] < 2**norm_bits
        if ok and consistency and norms is not None:
            length, _, t = norm_plan(len(row), b)
            s_t = sum(sum(v * v for v in row[j: j + length]) >> t for j in range(0, max(len(row), 1), length))
            m = norms[i] + (norms[i] >> e) + slack
            ok = s_t <= (m * m) >> t
        out.append(ok)
    return out


def split(x: np.ndarray, rng: np.random.Generator, halves: np.ndarray | None = None):
    """Uniform shares, except where ``halves`` holds a share0 to use (small halves)."""
    mask = rng.integers(LO, HI, size=x.shape, dtype=np.int64, endpoint=True)
    with np.errstate(over="ignore"):
        s0 = x - mask
        if halves is not None:
            s0 = np.where(halves != 0, halves, s0)
            mask = x - s0
    return s0, mask


def client(kind: str, d: int, b: int, rng: np.random.Generator):
    """(coordinates as python ints, share0 overrides or zeros)."""
    x = [int(v) for v in rng.integers(-(2 ** min(b, 20)), 2 ** min(b, 20), size=d)] if b else [0] * d
    halves = [0] * d
    j = int(rng.integers(0, d))
    if kind == "zero":
        x = [0] * d
    elif kind == "edge":
        x[j] = [2**b - 1, 2**b, -(2**b), -(2**b) - 1][int(rng.integers(0, 4))]
    elif kind == "big":
        x[j] = 2**62
    elif kind == "min":
        x[j] = LO
    elif kind == "garbage":
        x = [int(v) for v in rng.integers(LO, HI, size=d, endpoint=True)]
    elif kind == "halves":   # each share in range, their sum 2**(b+1) - 2 (or -2**(b+1)) is not
        h = 2**b - 1 if rng.integers(0, 2) else -(2**b)
        x[j], halves[j] = 2 * h, h
    elif kind == "wrap":     # shares 2**62 + 2**62: the sum wraps to -2**63
        x[j], halves[j] = LO, 2**62
    return x, halves


@st.composite
def batches(draw):
    b = draw(st.sampled_from([0, 1, 5, 16, 26, 26, 30, 40, 62]))
    consistency = b <= 30 and draw(st.booleans())
    norm_bits = draw(st.sampled_from([8, 30, 30])) if consistency else draw(st.sampled_from([8, 30, 63]))
    delta_bits = draw(st.sampled_from([None, 3, 63])) or b + 1
    n = draw(st.integers(1, 4))
    d = draw(st.sampled_from(DIMS))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    norm_kind = draw(st.lists(st.sampled_from(["true"] * 5 + ["low", "high", "edge", "garbage"]),
                              min_size=n, max_size=n))
    delta_kind = draw(st.lists(st.sampled_from(["ok"] * 5 + ["edge", "garbage"]), min_size=n, max_size=n))
    return dict(b=b, consistency=consistency, norm_bits=norm_bits, delta_bits=delta_bits, d=d, kinds=kinds,
                norm_kind=norm_kind, delta_kind=delta_kind, seed=draw(st.integers(0, 2**32 - 1)),
                method=draw(st.sampled_from(["top-bits", "top-bits", "sign-tests"])))


def build(spec):
    rng = np.random.default_rng(spec["seed"])
    b, d = spec["b"], spec["d"]
    xs, halves, norms, deltas = [], [], [], []
    for kind, nk, dk in zip(spec["kinds"], spec["norm_kind"], spec["delta_kind"]):
        x, h = client(kind, d, b, rng)
        xs.append(x)
        halves.append(h)
        true = math.isqrt(sum(v * v for v in x)) + 1 if abs(max(x, key=abs)) < 2**40 else 0
        nb, db = spec["norm_bits"], spec["delta_bits"]
        norms.append({"true": true, "low": true // 2, "high": 2**nb + true,
                      "edge": [2**nb - 1, 2**nb, -1][int(rng.integers(0, 3))],
                      "garbage": int(rng.integers(LO, HI, endpoint=True))}[nk])
        deltas.append({"ok": int(rng.integers(0, 2**min(db, 62))),
                       "edge": [2**db - 1, 2**db, -1][int(rng.integers(0, 3))],
                       "garbage": int(rng.integers(LO, HI, endpoint=True))}[dk])
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63   # noqa: E731 - norms/deltas edges at 2**63 wrap
    x = np.array(xs, dtype=np.int64).reshape(len(xs), d)
    nv = np.array([wrap(v) for v in norms], dtype=np.int64)
    dv = np.array([wrap(v) for v in deltas], dtype=np.int64)
    shares = (split(x, rng, np.array(halves, dtype=np.int64).reshape(x.shape)), split(nv, rng), split(dv, rng))
    want = oracle(x.tolist(), nv.tolist(), dv.tolist(), b, spec["norm_bits"], spec["delta_bits"],
                  spec["consistency"])
    return x, nv, dv, shares, want


# ----------------------------------------------------------------------------- properties
@given(spec=batches())
@example(spec=dict(b=26, consistency=True, norm_bits=30, delta_bits=27, d=65, seed=3, method="top-bits",
                   kinds=["honest", "edge", "halves", "big"], norm_kind=["true"] * 4, delta_kind=["ok"] * 4))
@example(spec=dict(b=26, consistency=False, norm_bits=30, delta_bits=27, d=1, seed=4, method="sign-tests",
                   kinds=["min", "wrap", "zero", "garbage"], norm_kind=["true"] * 4, delta_kind=["ok"] * 4))
def test_two_party_bits_equal_twin_and_oracle(pair, spec):
    x, nv, dv, shares, want = build(spec)
    kw = dict(bound_bits=spec["b"], norm_bits=spec["norm_bits"], delta_bits=spec["delta_bits"],
              consistency=spec["consistency"], method=spec["method"])
    twin = uploads_in_range(None, torch.from_numpy(x), torch.from_numpy(nv), torch.from_numpy(dv), **kw)
    assert twin == want
    (bits0, rounds), (bits1, _) = pair.call(check_program, *shares, kw)
    assert bits0 == bits1 == want
    # rounds: the verdict is one batched sign test, the AND of its two bits, one opening
    assert rounds["verdict"] == (10 if spec["consistency"] else 9)


@pytest.mark.parametrize("b", [0, 1, 26, 46, 62])
def test_edges_of_the_window_in_the_twin(b):
    edges = {2**b - 1: True, 2**b: False, -(2**b): True, -(2**b) - 1: False, 0: True,
             2**62 + 1: False, LO: False, HI: False}
    for v, ok in edges.items():
        if -(2**63) <= v <= HI:
            x = torch.tensor([[0, v, 0]], dtype=torch.int64)
            assert uploads_in_range(None, x, bound_bits=b) == [ok], (b, v)


def test_mixed_batch_only_the_bad_clients_fail(pair):
    rng = np.random.default_rng(11)
    g = rng.normal(0, 0.05, size=(5, 300)).astype(np.float32)
    g[4, 0] = -1023.99   # large but inside the default window (|g| < 1024)
    enc = np.stack([sharing.encode(row) for row in g])
    norms = np.array([sharing.encode(np.float64(torch.from_numpy(row).norm())) for row in g])
    deltas = np.array([sharing.encode(np.float64(np.quantile(np.abs(row), 0.6))) for row in g])
    norms[3] //= 2   # client 3 under-reports its norm
    enc[2, 17] = 2**62   # client 2 uploads shares of 2**62 (the attack of issue 14)
    want = [True, True, False, False, True]
    plain = uploads_in_range(None, torch.from_numpy(enc), torch.from_numpy(norms), torch.from_numpy(deltas))
    assert plain == want
    # float inputs (the lab) are encoded as CrypTen encodes: the same bits
    floats = torch.from_numpy(g.astype(np.float64))
    floats[2, 17] = 2.0**46   # encodes to 2**62
    assert uploads_in_range(None, floats, torch.from_numpy(norms) / 2**16, torch.from_numpy(deltas) / 2**16) == want
    shares = (split(enc, rng), split(norms, rng), split(deltas, rng))
    for method in ("top-bits", "sign-tests"):
        bits0, _ = pair.call(check_program, *shares, {"method": method})[0]
        assert bits0 == want


def test_empty_batch_and_updates_alone(pair):
    empty = np.zeros((0, 7), dtype=np.int64)
    assert uploads_in_range(None, torch.from_numpy(empty)) == []
    assert pair.call(check_program, (empty, empty), None, None, {})[0][0] == []
    x = np.array([[5], [2**26], [-(2**26)]], dtype=np.int64)
    rng = np.random.default_rng(2)
    bits, rounds = pair.call(check_program, split(x, rng), None, None, {})[0]
    assert bits == [True, False, True]
    assert set(rounds) == {"window", "verdict"} and rounds["window"] == 13 and rounds["verdict"] == 9


def test_twin_refuses_what_it_cannot_encode():
    x = torch.tensor([[0.5, float("nan")], [0.5, 1e300], [0.5, -0.25]], dtype=torch.float64)
    assert uploads_in_range(None, x) == [False, False, True]
    with pytest.raises(ValueError):
        uploads_in_range(None, x, method="bits")
    with pytest.raises(ValueError):
        uploads_in_range(None, x, torch.ones(3), bound_bits=31)   # squares would not fit
    with pytest.raises(ValueError):
        uploads_in_range(None, x, torch.ones(2))


def test_norm_plan_keeps_the_sums_below_2_61():
    for d, b in [(582_026, 26), (1, 30), (10**6, 21), (1100, 26), (2**35, 1)]:
        length, chunks, t = norm_plan(d, b)
        assert length * 4**b <= 2**61 and chunks * length >= d and 2**t >= chunks
        assert chunks * (2**61 >> t) <= 2**61
    assert norm_plan(582_026, 26) == (512, 1137, 11)


@given(share0=st.integers(LO, HI), seed=st.integers(0, 2**32 - 1))
@example(share0=0, seed=0)
def test_below_power_of_two_on_the_whole_ring(pair, share0, seed):
    rng = np.random.default_rng(seed)
    x = np.array([0, 1, -1, 2**62, LO, HI, LO + 1, 2**26, 2**26 - 1, 2**27, 2**27 - 1, 2**63 - 2**27]
                 + rng.integers(LO, HI, size=60, endpoint=True).tolist()
                 + [int(v) for v in rng.integers(0, 2**28, size=10)], dtype=np.int64)
    with np.errstate(over="ignore"):
        s0 = np.full_like(x, share0)
        s1 = x - s0
    ks = [1, 2, 27, 32, 62, 63]
    got = pair.call(below_program, s0, s1, ks)[0]
    for k, bits in zip(ks, got):
        assert bits.tolist() == [int(int(v) % 2**64 < 2**k) for v in x], k

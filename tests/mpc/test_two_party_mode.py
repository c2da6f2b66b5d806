"""The dealer-free two-party mode (``run_parties(..., offline="two-party")``) against numpy.

In this mode no dealer process exists: Beaver triples, squares, sign tests, window tests and
truncations are made between the two parties by the two-party engine (``mpc.spu_engine``,
SecretFlow SPU's CHEETAH). Checked here:

1. the ring-level primitives, exactly: ``nonnegative`` on every ring element, ``below_power_of_two``
   (x read unsigned), ``truncate_exact`` (floor for |x| < 2**62, 1 <= d <= 62), the wrap-free
   truncation installed into CrypTen (``x.div(2**d)``, per-element exponents, fixed-point
   products: "floor or one more"), and Beaver products (mul, matmul, square) at precision 0
   (exact mod 2**64 on the whole ring) and 16 (one truncation of the exact ring product);
2. the range check of uploads run by the dealer-mode test's party program
   (``tests/protocols/test_upload_range.py``) and held to the same oracle (the compare, sort,
   inverse and division programs run in both modes in ``tests/protocols/test_primitives_2pc.py``,
   parametrised over the offline mode);
3. a two-party job starts no dealer process and its parties hold no dealer link;
4. the engine's traffic is metered: the relays' counts against the kernel's (TCP_INFO, own
   sockets within 1% received / 3% sent, since tcpi_bytes_sent also counts retransmissions; the
   peer's received count within 0.1%), the party meter includes them, and the emulated link
   applies to them. One known defect is a non-strict xfail with its reason: engine bytes sent
   after a call returned are counted at the next call, so per-step attribution can shift
   (session totals are right).

A session costs several seconds (SPU link and OT set-up), so the primitives and protocols share
one long-lived two-party session (fixture ``tp``); each hypothesis example evaluates a whole
batch of cases in one call. Party programs are module-level (the party processes import them).
"""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mpc.launcher as launcher
from net.link import LinkProfile
from mpc.launcher import PartyError, run_parties
from mpc.crypten_compat import crypten
from tests.helpers.ring_shares import HI, LO, MASKS, recon, split
from tests.protocols import test_upload_range as dealer_upload

pytestmark = pytest.mark.timeout(300)

TRUNC_MAX = 2**62 - 1            # floor / truncate: |x| < 2**62
F = 16
EDGES = [0, 1, -1, 2, -2, 3, -3, 2**62 - 1, -(2**62) + 1, 2**62, -(2**62), 2**62 + 1, -(2**62) - 1,
         HI, LO, HI - 1, LO + 1, 2**31, -(2**31), 2**32 - 1, -(2**32), 2**47, -(2**47), 2**63 - 2**27]
# around the engine's and the bit-plane layouts' sizes; 0 = empty
LENGTHS = [0, 1, 2, 7, 64, 65, 130]


# ============================================================================ helpers (test side)
def as_int64(values) -> np.ndarray:
    return np.array([int(v) for v in values], dtype=np.int64).reshape(np.shape(values))


def py(arr) -> list:
    """int64 array -> nested python ints (exact oracles)."""
    return np.asarray(arr, dtype=np.int64).tolist()


def unsigned(v: int) -> int:
    return v % 2**64


def ring(v: int) -> int:
    """Python int -> signed 64-bit ring representative."""
    return (v + 2**63) % 2**64 - 2**63


# ============================================================================ strategies
@st.composite
def ring_int(draw, lo: int = LO, hi: int = HI) -> int:
    """Edges, log-uniform magnitudes (1 .. the bound), powers of two +-1, uniform."""
    kind = draw(st.sampled_from(["edge", "log", "log", "near", "uniform"]))
    if kind == "edge":
        v = draw(st.sampled_from([e for e in EDGES if lo <= e <= hi]))
    elif kind == "log":
        b = draw(st.integers(0, 64))
        v = 0 if b == 0 else draw(st.integers(2 ** (b - 1), 2**b - 1)) * (-1 if draw(st.booleans()) else 1)
    elif kind == "near":
        v = (2 ** draw(st.integers(0, 63)) + draw(st.sampled_from([-1, 0, 1]))) * (-1 if draw(st.booleans()) else 1)
    else:
        v = draw(st.integers(lo, hi))
    return min(max(v, lo), hi)


def ring_vector(lo: int = LO, hi: int = HI, lengths=LENGTHS):
    return st.sampled_from(lengths).flatmap(lambda n: st.lists(ring_int(lo, hi), min_size=n, max_size=n))


@st.composite
def bounded_pair(draw, bits: int = 62) -> tuple[int, int]:
    """Two integers with |a b| < 2**bits, log-uniform magnitudes from 1 (one fixed-point unit)."""
    ba = draw(st.integers(0, bits - 1))
    bb = draw(st.integers(0, bits - 1 - ba))

    def mag(b):
        return 0 if b == 0 else draw(st.integers(2 ** (b - 1), 2**b - 1))
    a, b = mag(ba), mag(bb)
    return a * (-1 if draw(st.booleans()) else 1), b * (-1 if draw(st.booleans()) else 1)


K_ALL = list(range(1, 63))       # k = 63 has its own test below
D_ALL = list(range(1, 63))


# ============================================================================ party programs
def _mine(party, s0, s1, precision=0):
    return party.wrap_share(np.asarray(s0 if party.rank == 0 else s1, dtype=np.int64), precision=precision)


def _share(x) -> np.ndarray:
    return x.share.numpy().copy()


def _attempt(fn):
    """Result of ``fn`` or the name of the error it raised. Only errors raised identically in
    both parties (before any exchange, or by the engine in both) may be caught, or the session
    desynchronises; the tests check that both parties report the same."""
    from mpc.spu_engine import EngineError
    from mpc.two_party_provider import NotInTwoPartyMode

    try:
        return fn()
    except (ValueError, OverflowError, TypeError, EngineError, NotInTwoPartyMode) as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def primitives_program(party, batch: dict) -> dict:
    """Every case of ``batch`` on this party's shares; returns this party's result shares."""
    from mpc.exact_truncation import truncate_exact
    from mpc.nonnegative import below_power_of_two, nonnegative

    out: dict = {"offline": party.offline, "dealer": party.dealer is None, "engine": party.engine is not None}
    out["sign"] = []
    for s0, s1, view in batch["sign"]:
        x = _mine(party, s0, s1)
        if view == "T":
            x = x.t()
        elif view == "stride":
            x = x[:, 1]
        bit = nonnegative(x)
        own = (x >= 0) if x.share.numel() else None    # CrypTen's comparison, routed to the engine
        out["sign"].append((_share(bit), int(bit.encoder.scale), None if own is None else _share(own)))
    out["below"] = [_attempt(lambda: _share(below_power_of_two(_mine(party, s0, s1), k)))
                    for s0, s1, k in batch["below"]]
    out["floor"] = []
    for s0, s1, d, precision in batch["floor"]:
        y = truncate_exact(_mine(party, s0, s1, precision), d)
        out["floor"].append((_share(y), int(y.encoder.scale)))
    out["div"] = [_share(_mine(party, s0, s1).div(2**d)) for s0, s1, d in batch["div"]]
    out["div_each"] = [_share(_mine(party, s0, s1).div(torch.pow(2, torch.from_numpy(e)).contiguous()))
                       for s0, s1, e in batch["div_each"]]
    # division by a public integer that is not a power of two (mpc.public_division, issue 31)
    out["div3"] = _share(_mine(party, *batch["div"][0][:2]).div(3)) if batch["div"] else None
    out["fx"] = []
    for (a0, a1), (b0, b1), pub in batch["fx"]:
        a, b = _mine(party, a0, a1, F), _mine(party, b0, b1, F)
        pb = torch.from_numpy(pub)
        out["fx"].append({"mul": _share(a * b), "mul_pub": _share(a * pb), "sq": _share(a.square()),
                          "self": _share(a * a)})
    out["fx_mm"] = []
    for (v0, v1), (m0, m1), pub in batch["fx_mm"]:
        v, m = _mine(party, v0, v1, F), _mine(party, m0, m1, F)
        out["fx_mm"].append({"vm": _share(v.matmul(m)), "vv": _share(v.matmul(v)),
                             "vm_pub": _share(v.matmul(torch.from_numpy(pub)))})
    out["ring"] = []
    for (a0, a1), (b0, b1), pub in batch["ring"]:
        a, b = _mine(party, a0, a1), _mine(party, b0, b1)
        out["ring"].append({"mul": _share(a * b), "mul_pub": _share(a * torch.from_numpy(pub)),
                            "sq": _share(a.square()), "self": _share(a * a)})
    rA, rB = crypten.mpc.get_default_provider().B2A_rng((batch["b2a"],))
    out["b2a"] = (_share(rA), rB.share.numpy().copy())
    out["ring_mm"] = []
    for (v0, v1), (m0, m1), (w0, w1) in batch["ring_mm"]:
        v, m, w = _mine(party, v0, v1), _mine(party, m0, m1), _mine(party, w0, w1)
        out["ring_mm"].append({"vm": _share(v.matmul(m)), "mm": _share(w.matmul(m)),
                               "vm_pub": _share(v.matmul(torch.from_numpy(np.where(m0 == m0, 3, 0))))})
    return out


# ============================================================================ fixture
@pytest.fixture(scope="module")
def tp(two_party_pair):
    """The worker's two-party (dealer-free) session (tests/conftest.py)."""
    return two_party_pair


def _fail_with_tracebacks(exc: PartyError):
    pytest.fail(f"{exc}\n" + "\n".join(f"--- party {r}:\n{msg}" for r, msg in sorted(exc.errors.items())))


def call_both(tp, fn, *args):
    """Both parties' values of one call on the long-lived session (full tracebacks on failure)."""
    try:
        v0, v1 = tp.call(fn, *args)
    except PartyError as exc:
        _fail_with_tracebacks(exc)
    return v0, v1


def run(*args, **kwargs):
    try:
        return run_parties(*args, **kwargs)
    except PartyError as exc:
        _fail_with_tracebacks(exc)


# ============================================================================ 1. primitives
@st.composite
def primitive_batches(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    how = draw(MASKS)
    xs = draw(ring_vector())
    ts = draw(ring_vector(-TRUNC_MAX, TRUNC_MAX))
    ks = draw(st.lists(st.sampled_from(K_ALL), min_size=2, max_size=4))
    ds = draw(st.lists(st.one_of(st.sampled_from([1, 2, 16, 32, 61, 62]), st.sampled_from(D_ALL)),
                       min_size=2, max_size=4))
    fx = draw(st.lists(bounded_pair(62), min_size=1, max_size=12))
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 5))
    mm_bits = draw(st.integers(1, 29))
    return dict(seed=seed, how=how, xs=xs, ts=ts, ks=ks, ds=ds, fx=fx, rows=rows, cols=cols, mm_bits=mm_bits)


def build_primitives(spec: dict):
    rng = np.random.default_rng(spec["seed"])
    how = spec["how"]
    x = as_int64(spec["xs"])
    t = as_int64(spec["ts"])
    batch: dict = {"sign": [], "below": [], "floor": [], "div": [], "div_each": [], "fx": [], "fx_mm": [],
                   "ring": [], "ring_mm": [], "b2a": 257}
    want: dict = {"sign": [], "below": [], "floor": [], "div": [], "div_each": []}
    # sign test: 1-D, a 2-D batch, a transposed and a strided view (shares not contiguous)
    n = x.size
    shapes = [(n,)] + ([(0, 3)] if n == 0 else [(2, n // 2)] if n % 2 == 0 and n > 1 else [])
    for shape in shapes:
        xv = x.reshape(shape)
        batch["sign"].append((*split(xv, how, rng), "plain"))
        want["sign"].append((xv >= 0).astype(np.int64))
    if n:
        batch["sign"].append((*split(x.reshape(1, n), how, rng), "T"))
        want["sign"].append((x.reshape(n, 1) >= 0).astype(np.int64))
        pair = np.stack([x[::-1], x], axis=1)          # (n, 2); column 1 is x
        batch["sign"].append((*split(pair, how, rng), "stride"))
        want["sign"].append((x >= 0).astype(np.int64))
    for k in spec["ks"]:
        batch["below"].append((*split(x, how, rng), k))
        want["below"].append(np.array([int(unsigned(v) < 2**k) for v in py(x)], dtype=np.int64))
    m = t.size
    for i, d in enumerate(spec["ds"]):
        shape = (m,) if i % 2 == 0 or m % 2 else (2, m // 2)
        batch["floor"].append((*split(t.reshape(shape), how, rng), d, (0, F)[i % 2]))
        want["floor"].append(as_int64([v >> d for v in py(t)]).reshape(shape))
        batch["div"].append((*split(t, how, rng), d))
        want["div"].append(as_int64([v >> d for v in py(t)]))
    e = rng.integers(0, 63, size=m).astype(np.int64)
    if m:
        e[0] = 0                                        # exponent 0: the element is kept
    batch["div_each"].append((*split(t, how, rng), e))
    want["div_each"].append(as_int64([v >> int(k) for v, k in zip(py(t), e.tolist())]))
    # fixed point: |a_enc b_enc| < 2**62 (shared x shared) and |a_enc p_enc| < 2**62 for a public
    # p on the grid (|p_enc| < 2**52, so CrypTen's encoding of the float is exact)
    a = as_int64([p[0] for p in spec["fx"]])
    b = as_int64([p[1] for p in spec["fx"]])
    pb = []
    for i, v in enumerate(py(a)):
        room = max(0, min(52, 61 - abs(v).bit_length()))
        pb.append([1, -1, 0][i] if i < 3 else int(rng.integers(-(2**room), 2**room)))
    pb = as_int64(pb)
    public = pb.astype(np.float64) / 2**F
    batch["fx"].append((split(a, how, rng), split(b, how, rng), public))
    want["fx"] = dict(a=py(a), b=py(b), pb=py(pb))
    # fixed-point matmul: |entries| < 2**mm_bits, row sums below 2**62
    rows, cols, bits = spec["rows"], spec["cols"], spec["mm_bits"]
    v = rng.integers(-(2**bits), 2**bits, size=rows, dtype=np.int64)
    mat = rng.integers(-(2 ** (59 - bits)), 2 ** (59 - bits), size=(rows, cols), dtype=np.int64)
    if rows > 0:
        v[0] = 1                                        # one fixed-point unit
    pbits = min(52, 59 - bits)                          # public entries exactly on the grid
    pmat = rng.integers(-(2**pbits), 2**pbits, size=(rows, cols), dtype=np.int64)
    batch["fx_mm"].append((split(v, how, rng), split(mat, how, rng), pmat.astype(np.float64) / 2**F))
    want["fx_mm"] = dict(v=py(v), m=py(mat), p=py(pmat))
    # precision 0: whole-ring Beaver products, exact mod 2**64
    ra = np.concatenate([x, t, as_int64(EDGES)])       # never empty: see the empty-product test
    rb = np.roll(ra, 1)
    rp = rng.integers(LO, HI, size=ra.shape, dtype=np.int64, endpoint=True)
    batch["ring"].append((split(ra, how, rng), split(rb, how, rng), rp))
    want["ring"] = dict(a=py(ra), b=py(rb), p=py(rp))
    rv = rng.integers(LO, HI, size=rows, dtype=np.int64, endpoint=True)
    rm = rng.integers(LO, HI, size=(rows, cols), dtype=np.int64, endpoint=True)
    rw = rng.integers(LO, HI, size=(3, rows), dtype=np.int64, endpoint=True)
    batch["ring_mm"].append((split(rv, how, rng), split(rm, how, rng), split(rw, how, rng)))
    want["ring_mm"] = dict(v=py(rv), m=py(rm), w=py(rw))
    return batch, want


def _floor_or_one_more(got: np.ndarray, exact: list, what: str) -> np.ndarray:
    """Assert got in {floor(P / 2**16), floor + 1} per element; returns the differences."""
    want = np.array([p >> F for p in exact], dtype=object)
    diff = np.array([int(g) - int(w) for g, w in zip(np.asarray(got).reshape(-1).tolist(), want.reshape(-1))],
                    dtype=object)
    bad = [i for i, dv in enumerate(diff) if dv not in (0, 1)]
    assert not bad, f"{what}: not floor or floor+1 at {bad[:5]}: exact {[exact[i] for i in bad[:5]]}, " \
                    f"got {[int(np.asarray(got).reshape(-1)[i]) for i in bad[:5]]}"
    return diff


def check_primitives(r0: dict, r1: dict, batch: dict, want: dict) -> None:
    assert r0["offline"] == r1["offline"] == "two-party"
    assert r0["dealer"] and r1["dealer"] and r0["engine"] and r1["engine"]
    # sign tests: our nonnegative and CrypTen's own >= (routed to the engine), scale 1
    for (b0, sc0, own0), (b1, sc1, own1), w, case in zip(r0["sign"], r1["sign"], want["sign"], batch["sign"]):
        got = recon(b0, b1)
        assert got.shape == w.shape, case[2]
        bad = np.nonzero(got != w)
        assert not bad[0].size, f"nonnegative wrong ({case[2]}) at {bad}: got {got[bad]}, want {w[bad]}"
        assert sc0 == sc1 == 1
        if own0 is not None:
            assert np.array_equal(recon(own0, own1), w), f"CrypTen's >= in two-party mode ({case[2]})"
    for g0, g1, w, (_, _, k) in zip(r0["below"], r1["below"], want["below"], batch["below"]):
        assert not isinstance(g0, str), f"below_power_of_two(x, {k}) raised {g0}"
        got = recon(g0, g1)
        bad = np.nonzero(got != w)
        assert not bad[0].size, f"below_power_of_two k={k} wrong at {bad}: got {got[bad]}, want {w[bad]}"
    for (f0, sc0), (f1, sc1), w, (_, _, d, prec) in zip(r0["floor"], r1["floor"], want["floor"], batch["floor"]):
        got = recon(f0, f1)
        assert got.shape == w.shape
        bad = np.nonzero(got != w)
        assert not bad[0].size, f"truncate_exact d={d} wrong at {bad}: got {got[bad]}, want {w[bad]}"
        assert sc0 == sc1 == 2**prec                     # the result keeps x's encoder
    # the truncation installed into CrypTen: floor or one more (mpc.truncation's contract, with
    # truncation pairs that the engine makes); by per-element exponents the engine's exact floor
    for g0, g1, w, (_, _, d) in zip(r0["div"], r1["div"], want["div"], batch["div"]):
        diff = recon(g0, g1).astype(object) - w.astype(object)
        assert all(dv in (0, 1) for dv in diff), f"x.div(2**{d}): {diff}"
    for g0, g1, w in zip(r0["div_each"], r1["div_each"], want["div_each"]):
        assert np.array_equal(recon(g0, g1), w), "x.div(per-element powers of two)"
    if batch["div"]:
        # within 1 + 2**-20 units of the exact quotient (docs/protocols.md, "Division by a public
        # integer"); the ring values here are integers (precision 0), so one unit is 1
        x = [int(v) for v in py(recon(batch["div"][0][0], batch["div"][0][1]))]
        got = [int(v) for v in py(recon(r0["div3"], r1["div3"]))]
        assert all(abs(Fraction(g) - Fraction(v, 3)) <= 1 + Fraction(1, 2**20) for g, v in zip(got, x)), \
            "x.div(3) is not within one unit of x / 3"
    # fixed-point products: one truncation of the exact ring product
    fx0, fx1, wf = r0["fx"][0], r1["fx"][0], want["fx"]
    a, b, pb = wf["a"], wf["b"], wf["pb"]
    _floor_or_one_more(recon(fx0["mul"], fx1["mul"]), [p * q for p, q in zip(a, b)], "a * b (shared)")
    _floor_or_one_more(recon(fx0["mul_pub"], fx1["mul_pub"]), [p * q for p, q in zip(a, pb)], "a * public")
    small = [i for i, v in enumerate(a) if abs(v) < 2**31]   # squares inside 2**62
    for key in ("sq", "self"):
        got = recon(fx0[key], fx1[key])[small]
        _floor_or_one_more(got, [a[i] * a[i] for i in small], f"a {key}")
    mm0, mm1, wm = r0["fx_mm"][0], r1["fx_mm"][0], want["fx_mm"]
    v, m = wm["v"], wm["m"]
    exact_vm = [sum(v[i] * m[i][j] for i in range(len(v))) for j in range(len(m[0]))]
    _floor_or_one_more(recon(mm0["vm"], mm1["vm"]), exact_vm, "vector @ matrix")
    pm = wm["p"]
    exact_pub = [sum(v[i] * pm[i][j] for i in range(len(v))) for j in range(len(pm[0]))]
    _floor_or_one_more(recon(mm0["vm_pub"], mm1["vm_pub"]), exact_pub, "vector @ public matrix")
    if max(abs(t) for t in v) < 2**29:
        _floor_or_one_more(recon(mm0["vv"], mm1["vv"]).reshape(1), [sum(t * t for t in v)], "vector @ vector")
    # precision 0: exact in the ring (mod 2**64) for whole-ring operands
    g0, g1, wr = r0["ring"][0], r1["ring"][0], want["ring"]
    ra, rb, rp = wr["a"], wr["b"], wr["p"]
    assert py(recon(g0["mul"], g1["mul"])) == [ring(p * q) for p, q in zip(ra, rb)]
    assert py(recon(g0["mul_pub"], g1["mul_pub"])) == [ring(p * q) for p, q in zip(ra, rp)]
    assert py(recon(g0["sq"], g1["sq"])) == [ring(p * p) for p in ra]
    assert py(recon(g0["self"], g1["self"])) == [ring(p * p) for p in ra]
    # CrypTen's random bits (B2A_rng): one bit shared additively and by XOR, the same bit
    (ra0, rb0), (ra1, rb1) = r0["b2a"], r1["b2a"]
    bits = recon(ra0, ra1)
    assert np.array_equal(bits, rb0 ^ rb1) and set(np.unique(bits).tolist()) == {0, 1}
    h0, h1, wm = r0["ring_mm"][0], r1["ring_mm"][0], want["ring_mm"]
    v, m, w = wm["v"], wm["m"], wm["w"]
    cols = len(m[0])
    assert py(recon(h0["vm"], h1["vm"])) == [ring(sum(v[i] * m[i][j] for i in range(len(v)))) for j in range(cols)]
    assert py(recon(h0["mm"], h1["mm"])) == [[ring(sum(r[i] * m[i][j] for i in range(len(v)))) for j in range(cols)]
                                             for r in w]
    assert py(recon(h0["vm_pub"], h1["vm_pub"])) == [ring(sum(v[i] * 3 for i in range(len(v))))] * cols


BOUNDARY_SPEC = dict(
    seed=0, how="uniform",
    xs=EDGES + [2**k + o for k in (1, 20, 26, 27, 31, 32, 47, 61, 62) for o in (-1, 0, 1)],
    ts=[e for e in EDGES if abs(e) <= TRUNC_MAX] + [2**k + o for k in (1, 16, 31, 61) for o in (-1, 0, 1)],
    ks=[1, 2, 26, 27, 31, 32, 47, 61, 62], ds=[1, 2, 3, 15, 16, 17, 31, 32, 33, 61, 62],
    fx=[(1, 1), (-1, 1), (1, -1), (-1, -1), (0, 5), (2**31 - 1, 2**31 - 1), (-(2**31) + 1, 2**31 - 1),
        (2**61 - 1, 1), (-(2**61), 1), (3, 2**59), (2**16, 2**16), (-(2**16) - 1, 2**16 + 1)],
    rows=4, cols=5, mm_bits=29)


@settings(max_examples=4, deadline=None)
@given(spec=primitive_batches())
@example(spec=BOUNDARY_SPEC)
@example(spec=dict(BOUNDARY_SPEC, how="min", seed=1, rows=1, cols=1, mm_bits=1))
def test_primitives_equal_numpy_exactly(tp, spec):
    batch, want = build_primitives(spec)
    r0, r1 = call_both(tp, primitives_program, batch)
    check_primitives(r0, r1, batch, want)


def below_63_program(party, s0, s1):
    from mpc.nonnegative import below_power_of_two
    return _attempt(lambda: _share(below_power_of_two(_mine(party, s0, s1), 63)))


def test_below_power_of_two_63_is_the_sign_bit(tp):
    rng = np.random.default_rng(63)
    x = np.array(EDGES + rng.integers(LO, HI, 40, dtype=np.int64, endpoint=True).tolist(), dtype=np.int64)
    s0, s1 = split(x, "uniform", rng)
    g0, g1 = call_both(tp, below_63_program, s0, s1)
    assert not isinstance(g0, str), f"below_power_of_two(x, 63) raised {g0}"
    assert np.array_equal(recon(g0, g1), (x >= 0).astype(np.int64))   # unsigned x < 2**63


def batch_boundary_program(party, s0, s1, t0, t1, batch):
    """The engine's elementwise batching (``_BATCH`` elements per SPU run) at a small size."""
    import mpc.spu_engine as se
    from mpc.exact_truncation import truncate_exact
    from mpc.nonnegative import nonnegative

    old = se._BATCH
    se._BATCH = batch
    try:
        sign = _share(nonnegative(_mine(party, s0, s1)))
        fl = _share(truncate_exact(_mine(party, t0, t1), 7))
    finally:
        se._BATCH = old
    return sign, fl


def test_engine_batches_split_long_inputs_exactly(tp):
    """Inputs longer than one engine batch (here 64 elements; 2**20 in production) are cut into
    batches and reassembled in order."""
    rng = np.random.default_rng(5)
    x = np.concatenate([np.array(EDGES, dtype=np.int64), rng.integers(LO, HI, 170, dtype=np.int64, endpoint=True)])
    t = rng.integers(-TRUNC_MAX, TRUNC_MAX, 131, dtype=np.int64, endpoint=True)
    (a0, f0), (a1, f1) = call_both(tp, batch_boundary_program, *split(x, "uniform", rng), *split(t, "uniform", rng), 64)
    assert np.array_equal(recon(a0, a1), (x >= 0).astype(np.int64))
    assert np.array_equal(recon(f0, f1), t >> 7)


def blocked_matmul_program(party, a0, a1, b0, b1, cap):
    """The engine's 2-D matmul with its left operand cut into blocks of rows (``_MATMUL_ELEMENTS``
    scalar entries per call; here small): a folded UE round's (m x nB) @ (nB x 1) product."""
    import mpc.spu_engine as se

    old = se._MATMUL_ELEMENTS, se._ELEMENTWISE_PRODUCTS
    se._MATMUL_ELEMENTS, se._ELEMENTWISE_PRODUCTS = cap, 0   # the library's matmul, not the small path
    try:
        mine = (a0, b0) if party.rank == 0 else (a1, b1)
        return party.engine.product("matmul", *mine, kind="online")
    finally:
        se._MATMUL_ELEMENTS, se._ELEMENTWISE_PRODUCTS = old


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 90), inner=st.integers(1, 6), cols=st.integers(1, 2), cap=st.integers(1, 400),
       seed=st.integers(0, 2**31 - 1))
def test_engine_matmul_in_blocks_of_rows_equals_the_ring_product(tp, rows, inner, cols, cap, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(LO, HI, (rows, inner), dtype=np.int64, endpoint=True)
    b = rng.integers(LO, HI, (inner, cols), dtype=np.int64, endpoint=True)
    (a0, a1), (b0, b1) = split(a, "uniform", rng), split(b, "uniform", rng)
    g0, g1 = call_both(tp, blocked_matmul_program, a0, a1, b0, b1, cap)
    want = (a.astype(object) @ b.astype(object)) % 2**64
    got = recon(g0, g1).astype(np.uint64).astype(object)
    assert (got == want).all()


def rows_exceed_program(party, x0, x1, d0, d1, drop, batch):
    """The engine's SecTC test with blocks of ``batch`` coordinates (``_EXCEED_BATCH``; here small,
    so that rows span several blocks and the blocks' bits are ORed on shares); and the same test
    as coordinate shards run it: ``rows_hits`` on three column slices (one empty), their 32-bit
    shares added, ``any_hits`` opened."""
    import mpc.spu_engine as se

    x = np.asarray(x0 if party.rank == 0 else x1, dtype=np.int64)
    d = np.asarray(d0 if party.rank == 0 else d1, dtype=np.int64)
    old = se._EXCEED_BATCH
    se._EXCEED_BATCH = batch
    try:
        flags = party.engine.rows_exceed(x, drop, d)
    finally:
        se._EXCEED_BATCH = old
    half = x.shape[1] // 2
    hits = [party.engine.rows_hits(x[:, lo:hi], drop, d, batch=batch) for lo, hi in ((0, half), (half, half),
                                                                                     (half, x.shape[1]))]
    with np.errstate(over="ignore"):
        total = np.sum(np.stack(hits).view(np.uint32), axis=0, dtype=np.uint32)
    return flags.tolist(), party.engine.any_hits(total.view(np.int32)).tolist()


def _exceed_case(rng, rows: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows (values |x|, |d| < 2**30) with a hit only at an edge (x = +-d, first or last column,
    inside a block or at a block border), misses by one unit (+-(d - 1)), d = 0 (always a hit)
    and d < 0 (|d| counts)."""
    d = rng.integers(1, 2**29, rows, dtype=np.int64)
    x = np.empty((rows, m), dtype=np.int64)
    for r in range(rows):
        x[r] = rng.integers(-(int(d[r]) - 1), int(d[r]), m, dtype=np.int64)   # all misses
        kind = r % 6
        if kind == 0:
            x[r, -1] = -d[r]                      # hit in the last column only
        elif kind == 1:
            x[r, 0] = d[r]                        # hit in the first column only
        elif kind == 2:
            x[r, rng.integers(0, m)] = d[r] - 1   # a near miss: no hit
        elif kind == 3:
            d[r] = 0                              # |y| >= 0 always
        elif kind == 4:
            x[r, m // 2] = d[r]
            d[r] = -d[r]                          # a negative threshold compares by |d|
        # kind 5: no hit at all
    return x, d


@pytest.mark.parametrize("batch", [7, 64, 10**6])
def test_rows_exceed_in_one_batched_pass_equals_numpy(tp, batch):
    """SecTC's engine test over all rows at once (blocks of rows x columns, the per-row OR inside
    each call and over blocks on shares) against numpy, on exact edges (drop 0) and on truncated
    values away from the threshold (drop 16: y is the floor or one less); the engine calls are
    ceil(rows m / batch) (+ 1 when a row spans several blocks), not one per row. The shards'
    form (per-slice shared counts, added, one opened comparison) gives the same flags."""
    rng = np.random.default_rng(batch)
    rows, m = 12, 23
    x, d = _exceed_case(rng, rows, m)
    want = (np.abs(x) >= np.abs(d)[:, None]).any(axis=1)
    assert want.tolist() == [r % 6 != 2 and r % 6 != 5 for r in range(rows)]
    x0, x1 = split(x, "uniform", rng)
    d0, d1 = split(d, "uniform", rng)
    f0, f1 = call_both(tp, rows_exceed_program, x0, x1, d0, d1, 0, batch)
    assert f0[0] == f1[0] == f0[1] == f1[1] == want.tolist()
    # drop 16: values at least 2 units (after truncation) from the threshold
    t = rng.integers(4, 2**13, rows, dtype=np.int64)
    y = rng.integers(-(t - 2)[:, None], (t - 1)[:, None], (rows, m), dtype=np.int64)
    y[::2, -1] = np.where(rng.random(rows) < 0.5, t + 2, -(t + 2))[::2]
    want16 = (np.abs(y) >= t[:, None]).any(axis=1)
    xs = (y << 16) + rng.integers(0, 1 << 16, (rows, m), dtype=np.int64)
    g0, g1 = call_both(tp, rows_exceed_program, *split(xs, "uniform", rng), *split(t, "uniform", rng),
                                 16, batch)
    assert g0[0] == g1[0] == g0[1] == g1[1] == want16.tolist()


# ============================================================================ 2. protocols
UPLOAD_SPECS = [   # the dealer test's explicit examples, plus top-bits/sign-tests on every kind
    dict(b=26, consistency=True, norm_bits=30, delta_bits=27, d=65, seed=3, method="top-bits",
         kinds=["honest", "edge", "halves", "big"], norm_kind=["true"] * 4, delta_kind=["ok"] * 4),
    dict(b=26, consistency=False, norm_bits=30, delta_bits=27, d=1, seed=4, method="sign-tests",
         kinds=["min", "wrap", "zero", "garbage"], norm_kind=["true"] * 4, delta_kind=["ok"] * 4),
    dict(b=16, consistency=True, norm_bits=30, delta_bits=3, d=200, seed=5, method="top-bits",
         kinds=["honest", "zero", "edge", "wrap"], norm_kind=["true", "low", "edge", "garbage"],
         delta_kind=["ok", "edge", "garbage", "ok"]),
    dict(b=62, consistency=False, norm_bits=8, delta_bits=3, d=2, seed=6, method="sign-tests",
         kinds=["big", "min", "honest", "garbage"], norm_kind=["true", "high", "edge", "true"],
         delta_kind=["ok", "ok", "edge", "garbage"]),
]
UPLOAD_SPECS_63 = [   # windows of 2**63: below_power_of_two(y, 63) in the engine
    dict(b=26, consistency=False, norm_bits=63, delta_bits=63, d=7, seed=7, method="top-bits",
         kinds=["honest", "edge", "min", "garbage"], norm_kind=["true", "garbage", "edge", "true"],
         delta_kind=["ok", "garbage", "edge", "ok"]),
]


def upload_program(party, cases):
    """dealer_upload.check_program per case; an error raised before any exchange is returned."""
    return [_attempt(lambda: dealer_upload.check_program(party, *shares, kw)[0]) for shares, kw in cases]


def _upload_cases(specs):
    cases, wants = [], []
    for spec in specs:
        x, nv, dv, shares, want = dealer_upload.build(spec)
        kw = dict(bound_bits=spec["b"], norm_bits=spec["norm_bits"], delta_bits=spec["delta_bits"],
                  consistency=spec["consistency"], method=spec["method"])
        from protocols.upload_range import uploads_in_range
        assert uploads_in_range(None, torch.from_numpy(x), torch.from_numpy(nv), torch.from_numpy(dv), **kw) == want
        cases.append((shares, kw))
        wants.append(want)
    return cases, wants


def test_upload_range_in_two_party_mode(tp):
    """uploads_in_range (both methods, with and without the norm check) and the window test
    ``below_power_of_two`` for k < 63 equal the plaintext twin and the Python-integer oracle."""
    cases, wants = _upload_cases(UPLOAD_SPECS)
    got0, got1 = call_both(tp, upload_program, cases)
    for g0, g1, want, (_, kw) in zip(got0, got1, wants, cases):
        assert not isinstance(g0, str), f"{kw}: {g0}"
        assert g0 == g1 == want, kw
    # the dealer test's mixed batch: only the bad clients fail
    rng = np.random.default_rng(11)
    from common import sharing
    g = rng.normal(0, 0.05, size=(5, 300)).astype(np.float32)
    g[4, 0] = -1023.99
    enc = np.stack([sharing.encode(row) for row in g])
    norms = np.array([sharing.encode(np.float64(torch.from_numpy(row).norm())) for row in g])
    deltas = np.array([sharing.encode(np.float64(np.quantile(np.abs(row), 0.6))) for row in g])
    norms[3] //= 2
    enc[2, 17] = 2**62
    shares = (dealer_upload.split(enc, rng), dealer_upload.split(norms, rng), dealer_upload.split(deltas, rng))
    got = call_both(tp, upload_program, [(shares, {"method": m}) for m in ("top-bits", "sign-tests")])[0]
    assert got == [[True, True, False, False, True]] * 2
    # below_power_of_two on the whole ring, the dealer test's values and ks below 63
    x = np.array([0, 1, -1, 2**62, LO, HI, LO + 1, 2**26, 2**26 - 1, 2**27, 2**27 - 1, 2**63 - 2**27]
                 + rng.integers(LO, HI, size=60, endpoint=True).tolist(), dtype=np.int64)
    with np.errstate(over="ignore"):
        s0 = np.full_like(x, -12345)
        s1 = x - s0
    ks = [1, 2, 27, 32, 62]
    bits = call_both(tp, dealer_upload.below_program, s0, s1, ks)[0]
    for k, b in zip(ks, bits):
        assert b.tolist() == [int(int(v) % 2**64 < 2**k) for v in x], k


def test_upload_range_with_63_bit_windows_in_two_party_mode(tp):
    cases, wants = _upload_cases(UPLOAD_SPECS_63)
    got0, got1 = call_both(tp, upload_program, cases)
    for g0, g1, want in zip(got0, got1, wants):
        assert not isinstance(g0, str), g0
        assert g0 == g1 == want


def rescale_program(party, values):
    """``protocols.backend.rescale`` of a raw product (32 fractional bits) to 16 bits: one
    truncation by 16 bits (used by protocols/starfish: round selection, SecTC)."""
    from protocols import backend as B

    x = crypten.cryptensor(torch.from_numpy(values), src=0)
    raw = B.relabel(B.raw_mul(x, x), 2 * F)
    return _attempt(lambda: (_share(B.rescale(raw)), B.bits_of(B.rescale(raw))))


def test_backend_rescale_in_two_party_mode(tp):
    values = np.array([1.5, -2.25, 2.0**-16, -(2.0**10) + 2.0**-16, 0.0])
    got0, got1 = call_both(tp, rescale_program, values)
    assert not isinstance(got0, str), got0
    (r0, bits0), (r1, bits1) = got0, got1
    assert bits0 == bits1 == F
    enc = [int(v * 2**F) for v in values]
    _floor_or_one_more(recon(r0, r1), [e * e for e in enc], "rescale(x_enc**2 at 32 bits)")


# ============================================================================ 3. no dealer
def who_am_i(party):
    import multiprocessing

    from mpc import session

    return {"children": sorted(p.name for p in multiprocessing.active_children()),
            "dealer_is_none": party.dealer is None, "offline": party.offline,
            "provider": crypten.mpc.get_default_provider().NAME,
            "engine": type(party.engine).__name__ if party.engine is not None else None,
            "engine_active": session._two_party.engine is party.engine}


def _recording_context(started: list):
    real = launcher.mp_context

    def ctx_factory():
        ctx = real()

        class Recording:
            def __getattr__(self, name):
                return getattr(ctx, name)

            def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
                started.append(kwargs.get("name"))
                return ctx.Process(*args, **kwargs)
        return Recording()
    return ctx_factory


def test_a_two_party_job_starts_no_dealer(monkeypatch):
    started: list = []
    monkeypatch.setattr(launcher, "mp_context", _recording_context(started))
    res = run(who_am_i, offline="two-party", timeout=120)
    assert sorted(started) == ["party0", "party1"], started      # no third process
    for rank, v in enumerate(res.values):
        assert v["dealer_is_none"], rank
        assert v["offline"] == "two-party"
        assert v["provider"] == "STARFISH_TWO_PARTY"
        assert v["engine"] == "SpuEngine"
        assert v["engine_active"]
        assert v["children"] == [f"engine{rank}"]     # the party's only child: its SPU engine
    # control: the recorder does see the dealer of a dealer-mode job
    started.clear()
    res = run(who_am_i, timeout=120)
    assert sorted(started) == ["dealer", "party0", "party1"], started
    assert res.values[0]["offline"] == "dealer" and not res.values[0]["dealer_is_none"]
    assert res.values[0]["children"] == res.values[1]["children"] == []
    # an unknown mode is refused before anything starts
    started.clear()
    with pytest.raises(ValueError):
        run_parties(who_am_i, offline="bogus")
    assert started == []


# ============================================================================ 4. metering, link
def _engine_work(eng, n, rank):
    rng = np.random.default_rng(1000 + rank)
    s = rng.integers(LO, HI, n, dtype=np.int64, endpoint=True)
    eng.nonnegative(s)
    eng.floor(s >> np.int64(2), 16)
    eng.below_power_of_two(s, 20)


def _settle(party):
    """Wait until the engine's link is quiet in both parties: everything either sent has been
    received (the library sends asynchronously, after its call returned)."""
    comm = crypten.communicator.get()
    comm.barrier()
    time.sleep(0.3)
    comm.barrier()
    return party.engine.socket_bytes, party.engine.kernel_bytes


def metering_program(party, n):
    eng = party.engine
    sock0, kern0 = _settle(party)
    with party.meter("engine-cmp"):
        _engine_work(eng, n, party.rank)
        _settle(party)    # inside the step: the engine's late bytes are accounted to it
    with party.meter("engine-product"):
        rng = np.random.default_rng(7 + party.rank)
        a = rng.integers(LO, HI, n, dtype=np.int64, endpoint=True)
        eng.product("mul", a, a)
        _settle(party)
    sock1, kern1 = _settle(party)
    meters = party.meters()
    key = party.metering.open_steps()[-1]
    steps = {k[len(key) + 1:]: v for k, v in meters["steps"].items() if k.startswith(key + "/")}
    return dict(sock0=sock0, kern0=kern0, sock1=sock1, kern1=kern1, total=meters["total"],
                wire=meters["wire"], steps=steps)


def step_attribution_program(party, n, reps):
    """Per rep: a step with one engine comparison, a step with one engine product (nothing
    else; each closed as soon as the call returns), and the socket counts once the link is
    quiet after each. Returns per step (name, the meter's online and offline bytes sent and
    received, the sockets' growth (sent, received))."""
    eng = party.engine
    key = party.metering.open_steps()[-1]
    rng = np.random.default_rng(70 + party.rank)
    before = _settle(party)[0]
    out = []
    for i in range(reps):
        a = rng.integers(LO, HI, n, dtype=np.int64, endpoint=True)
        for name in (f"cmp{i}", f"prod{i}"):
            with party.meter(name):
                if name.startswith("cmp"):
                    eng.nonnegative(a)
                else:
                    eng.product("mul", a, a)
            after = _settle(party)[0]
            row = party.meters()["steps"][f"{key}/{name}"]
            meter = {f"{k}_{d}": row[f"{k}_bytes_{d}"] for k in ("online", "offline") for d in ("sent", "received")}
            out.append((name, meter, (after[0] - before[0], after[1] - before[1])))
            before = after
    return out


def _within(a: int, b: int, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(a, b)


def test_engine_traffic_is_metered_at_its_sockets(tp):
    """The relays' byte counts (what the meter gets) against the kernel's TCP_INFO counts on the
    same sockets. Received: tcpi_bytes_received counts each byte once, so the two agree (1%,
    in practice exactly). Sent: tcpi_bytes_sent also counts TCP retransmissions, which happen
    on a busy loopback (``ss -ti`` showed bytes_retrans up to 1.2% of a call's bytes), so the
    kernel's figure may only exceed ours, by a few percent at most; the exact oracle for what
    this party sent is what the peer's kernel received."""
    res = call_both(tp, metering_program, 20000)
    for rank, r in enumerate(res):
        other = res[1 - rank]
        (s_sent, s_recv), (k_sent, k_recv) = r["sock1"], r["kern1"]
        assert s_sent > 1_000_000 and s_recv > 1_000_000, r["sock1"]   # OT set-up and the work above
        # cumulative: the relays' count against the kernel's on the same sockets
        assert _within(s_recv, k_recv), (rank, "received", s_recv, k_recv)
        assert s_sent <= k_sent * 1.001 and _within(s_sent, k_sent, 0.03), (rank, "sent", s_sent, k_sent)
        # what this party's relays sent is exactly what the peer's kernel took in
        assert _within(s_sent, other["kern1"][1], 0.001), (rank, s_sent, other["kern1"][1])
        # over this call's work alone
        d_sent, d_recv = s_sent - r["sock0"][0], s_recv - r["sock0"][1]
        dk_sent, dk_recv = k_sent - r["kern0"][0], k_recv - r["kern0"][1]
        assert d_sent > 100_000 and d_recv > 100_000
        assert _within(d_recv, dk_recv), (rank, "received in call", d_recv, dk_recv)
        assert d_sent <= dk_sent * 1.001 and _within(d_sent, dk_sent, 0.03), (rank, "sent in call", d_sent, dk_sent)
        peer_in = other["kern1"][1] - other["kern0"][1]
        assert _within(d_sent, peer_in, 0.001), (rank, "sent in call vs the peer's kernel", d_sent, peer_in)
        # the party's meter holds at least the engine's bytes (it also holds the channel's)
        tot = r["total"]
        assert tot["online_bytes_sent"] + tot["offline_bytes_sent"] >= s_sent
        assert tot["online_bytes_received"] + tot["offline_bytes_received"] >= s_recv
        wire = r["wire"]
        assert wire["online"]["sent"] + wire["offline"]["sent"] >= s_sent
        assert wire["online"]["received"] + wire["offline"]["received"] >= s_recv
        # the steps that hold only engine work (and a settling barrier on the channel) account
        # for it: comparisons online, products offline (bytes the library sends after a product
        # returned are counted online, see the next test: so no exact split here)
        cmp_, prod = r["steps"]["engine-cmp"], r["steps"]["engine-product"]
        step_sent = sum(s[f"{k}_bytes_sent"] for s in (cmp_, prod) for k in ("online", "offline"))
        step_recv = sum(s[f"{k}_bytes_received"] for s in (cmp_, prod) for k in ("online", "offline"))
        assert d_sent <= step_sent <= 1.01 * d_sent, (rank, step_sent, d_sent)
        assert d_recv <= step_recv <= 1.01 * d_recv, (rank, step_recv, d_recv)
        assert cmp_["offline_bytes_sent"] == 0 and cmp_["online_bytes_sent"] > 0
        assert prod["offline_bytes_sent"] > 0 and prod["offline_bytes_received"] > 0


@pytest.mark.xfail(strict=False, raises=AssertionError,
                   reason="library bug (intermittent): the engine's bytes reach the session meter only when "
                          "the engine process answers a call (SpuEngine._account); bytes the library sends "
                          "after its call returned are counted at the next call, in whatever step is open "
                          "then, and with the kind of traffic of that moment (a product's late bytes are "
                          "counted online). Measured: 1 to 3 of 16 steps short, by up to 25% of their sent "
                          "bytes; 377 kB of a product's 3.6 MB counted online")
def test_engine_bytes_are_counted_in_the_step_that_sent_them(tp):
    res = call_both(tp, step_attribution_program, 20000, 4)
    wrong = []
    for rank, rows in enumerate(res):
        for name, m, (sent, received) in rows:
            step_sent = m["online_sent"] + m["offline_sent"]
            step_recv = m["online_received"] + m["offline_received"]
            late = step_sent < 0.99 * sent or step_recv < 0.99 * received
            # a product is offline work (Beaver triples): its bytes must not be counted online
            misfiled = name.startswith("prod") and m["online_sent"] + m["online_received"] > 0.01 * (sent + received)
            if late or misfiled:
                wrong.append((rank, name, m, (sent, received)))
    assert not wrong, f"(rank, step, meter, sockets (sent, received)): {wrong}"


def timed_engine_program(party, n, reps):
    eng = party.engine
    comm = crypten.communicator.get()
    _engine_work(eng, n, party.rank)      # compile the programs and finish the OT set-up first
    for _ in range(3):
        comm.barrier()
    t0 = time.monotonic()
    for _ in range(reps):
        _engine_work(eng, n, party.rank)   # engine traffic only: nothing on the channel here
    return time.monotonic() - t0


def test_emulated_link_applies_to_engine_traffic(tp):
    latency, n, reps = 0.02, 300, 1
    base = max(call_both(tp, timed_engine_program, n, reps))
    res = run(timed_engine_program, n, reps, offline="two-party", link=LinkProfile(latency=latency),
                      timeout=120)
    slow = min(res.values)
    # a comparison in the engine is many rounds; 3 operations: far more than 10 latencies
    assert slow - base >= 10 * latency, (base, slow)


# ============================================================================ empty products
def empty_products_program(party):
    """Beaver products with an empty operand, and protocols on empty batches (all supported in
    dealer mode, tests/protocols/test_max_threshold_inner_properties.py ``test_empty_batch``)."""
    from protocols.inner_product import inner
    from protocols.maximum import max as secure_max

    def run(fn):
        try:
            return tuple(fn().share.shape)
        except Exception as exc:  # noqa: BLE001 - raised identically in both parties (checked)
            return f"{type(exc).__name__}: {str(exc)[:120]}"

    out = {}
    for prec in (0, F):
        x = party.wrap_share(np.zeros(0, np.int64), precision=prec)
        e = party.wrap_share(np.zeros((0, 3), np.int64), precision=prec)
        out[f"mul{prec}"] = run(lambda: x * x)
        out[f"square{prec}"] = run(lambda: x.square())
        out[f"matmul{prec}"] = run(lambda: x.matmul(e))
    z = crypten.cryptensor(torch.zeros((0, 5), dtype=torch.float64), src=0)
    out["max (0, 5)"] = run(lambda: secure_max(z))
    out["inner (0, 5)"] = run(lambda: inner(z, z))
    return out


def test_empty_products_and_empty_batches_in_two_party_mode(tp):
    r0, r1 = call_both(tp, empty_products_program)
    assert r0 == r1
    want = {"mul0": (0,), "square0": (0,), "matmul0": (3,), "mul16": (0,), "square16": (0,), "matmul16": (3,),
            "max (0, 5)": (0,), "inner (0, 5)": (0,)}
    assert r0 == want

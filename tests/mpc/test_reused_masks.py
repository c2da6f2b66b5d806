"""``mpc.reused_masks``: one opened Beaver mask per column serves many products.

Properties, against numpy's ring arithmetic (uint64, wrapping) as the oracle:
* every product sum_k x_{j,k} z_{j,k} is exact for any ring elements (edges, uniform), any number
  of rows (0 included), of columns K and of coordinates (0, 1, below and above 64), any split into
  shares, and stays exact when the same opened columns serve several fresh z's;
* the squared norm sum x*x of each opened column comes out exact with no further exchange;
* bytes: opening costs 8 bytes per coordinate each way, once; each product then exchanges only
  z - b (8 bytes per z entry each way), whatever the number of coordinates;
* what is opened, e = x - a, differs from x (it is masked) and from the e of the same values
  opened again (a fresh mask per opening);
* the dealer's correlation adds up (c = sum a_k b_k), and it refuses a product that names
  anything but an earlier mask of the same size.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mpc import correlations
from net.frames import HEADER_BYTES as FRAME_HEADER
from common.prg import new_seed
from tests.helpers import reused_mask_programs as rmp
from tests.helpers.ring_shares import HI, LO, MASKS, recon, split

EDGES = [0, 1, -1, HI, LO, 2**62, -(2**62), 2**32 - 1, 2**31, -(2**31), 65536, -65536]


def ring_matvec(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """sum_k x[j, k] * z[j, k] mod 2**64, x (rows, K, *size), z (rows, K)."""
    xu, zu = x.view(np.uint64), z.view(np.uint64)
    out = np.zeros((x.shape[0], *x.shape[2:]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(x.shape[1]):
            out += xu[:, k] * zu[:, k].reshape(-1, *([1] * (x.ndim - 2)))
    return out.view(np.int64)


def payload(nbytes: int, entries: int) -> bool:
    """Whether ``nbytes`` (both directions, as metered) is one exchange of ``entries`` ring
    elements: 8 bytes each way per entry, plus at most one frame header each way."""
    return 16 * entries <= nbytes <= 16 * entries + 2 * FRAME_HEADER


@st.composite
def cases(draw):
    rows = draw(st.sampled_from([0, 1, 2, 3]))
    k = draw(st.sampled_from([1, 2, 3]))
    m = draw(st.sampled_from([0, 1, 7, 64, 65]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(LO, HI, size=(rows, k, m), dtype=np.int64, endpoint=True)
    if x.size:
        picks = draw(st.lists(st.sampled_from(EDGES), min_size=1, max_size=8))
        flat = x.reshape(-1)
        flat[: len(picks)] = picks[: flat.size]
    nz = draw(st.integers(1, 3))
    zs = [rng.integers(LO, HI, size=(rows, k), dtype=np.int64, endpoint=True) for _ in range(nz)]
    if rows:
        zs[0][0, 0] = draw(st.sampled_from(EDGES))
    return x, zs, draw(MASKS), seed


@pytest.mark.timeout(600)
@given(batch=st.lists(cases(), min_size=1, max_size=4))
@example(batch=[(np.arange(2 * 2 * 65, dtype=np.int64).reshape(2, 2, 65) - 100,
                 [np.array([[3, -2], [HI, LO]], dtype=np.int64)] * 2, "uniform", 1)])
def test_products_with_reused_masks_are_exact(pair, batch):
    runs = []
    for x, zs, how, seed in batch:
        rng = np.random.default_rng(seed)
        runs.append(((split(x, how, rng), [split(z, "uniform", rng) for z in zs]), x, zs))
    for case, x, zs in runs:
        r0, r1 = pair.call(rmp.reuse, case)
        (p0, ob0, pb0, e0, q0), (p1, ob1, pb1, e1, q1) = r0, r1
        rows, k, m = x.shape
        for got0, got1, z in zip(p0, p1, zs):
            got, want = recon(got0, got1), ring_matvec(x, z)
            if rows:
                assert got.shape == want.shape
            assert got.size == want.size and np.array_equal(got.reshape(want.shape), want)
        xu = x.view(np.uint64)   # squared norms of the opened columns, with no further exchange
        with np.errstate(over="ignore"):
            want_norms = (xu * xu).sum(axis=-1, dtype=np.uint64).view(np.int64).reshape(-1)
        assert np.array_equal(recon(q0, q1), want_norms)
        # both open the same e; 8 bytes per coordinate each way once, then 8 per z entry
        for a, b in zip(e0, e1):
            assert np.array_equal(a, b)
        assert ob0 == ob1 and payload(ob0, rows * k * m)
        assert pb0 == pb1 and all(payload(b, rows * k) for b in pb0)
        if rows and m >= 7:   # masked: the opened e is not x (the chance of a match is 2**-64 per entry)
            opened = np.stack(e0).reshape(rows, k, m)
            assert not np.array_equal(opened, x)


def test_the_same_values_opened_twice_show_unrelated_masks(pair):
    x = np.arange(3 * 1 * 16, dtype=np.int64).reshape(3, 1, 16)
    z = np.ones((3, 1), dtype=np.int64)
    rng = np.random.default_rng(0)
    case = (split(x, "uniform", rng), [split(z, "uniform", rng)])
    first, first1 = pair.call(rmp.reuse, case)
    second, second1 = pair.call(rmp.reuse, case)
    assert not np.array_equal(np.stack(first[3]), np.stack(second[3]))
    want = ring_matvec(x, z)   # the products themselves agree
    assert np.array_equal(recon(first[0][0], first1[0][0]), want)
    assert np.array_equal(recon(second[0][0], second1[0][0]), want)


def test_the_dealer_correlation_adds_up():
    s0, s1 = new_seed(), new_seed()
    size = (5, 3)
    masks = [correlations.make_request("mask", size) for _ in range(2)]
    prod = correlations.make_request("mask_matvec", (0, 1), size)
    a = []
    for i, r in enumerate(masks):   # a from the seeds; the dealer sends only a share of sum(a * a)
        corr = correlations.correction(r, s0, s1, i)
        assert tuple(corr.shape) == correlations.correction_shape(r) == (1,)
        (a0, n0), (a1, n1) = correlations.party0_shares(r, s0, i), correlations.party1_shares(r, s1, i, corr)
        a.append(a0 + a1)
        assert int((n0 + n1)[0]) == int((a[-1] * a[-1]).sum())
    corr = correlations.correction(prod, s0, s1, 2)
    b0, c0 = correlations.party0_shares(prod, s0, 2)
    b1, c1 = correlations.party1_shares(prod, s1, 2, corr)
    b = b0 + b1
    assert tuple(corr.shape) == correlations.correction_shape(prod) == size
    assert np.array_equal((c0 + c1).numpy(), (a[0] * b[0] + a[1] * b[1]).numpy())


def test_the_dealer_refuses_products_that_name_no_earlier_mask_of_their_size():
    reg = correlations.MaskRegistry()
    reg.admit(correlations.make_request("mask", (4,)), 0)
    reg.admit(correlations.make_request("triple", (4,), (4,), "mul"), 1)
    reg.admit(correlations.make_request("mask_matvec", (0,), (4,)), 2)        # fine
    for bad in [((1,), (4,)), ((0,), (5,)), ((0, 3), (4,)), ((7,), (4,))]:
        with pytest.raises(correlations.RequestError):
            reg.admit(correlations.make_request("mask_matvec", *bad), 3 if bad[0] != (7,) else 8)
    with pytest.raises(correlations.RequestError):
        correlations.validate(("mask_matvec", "x", (4,)))
    with pytest.raises(correlations.RequestError):
        correlations.make_request("mask_matvec", (), (4,))


def test_material_fetched_ahead_serves_the_next_products(pair):
    rng = np.random.default_rng(4)
    x = rng.integers(LO, HI, size=(3, 2, 70), dtype=np.int64, endpoint=True)
    zs = [rng.integers(LO, HI, size=(3, 2), dtype=np.int64, endpoint=True) for _ in range(2)]
    case = (split(x, "uniform", rng), [split(z, "uniform", rng) for z in zs])
    r0, r1 = pair.call(rmp.reuse, case, True)
    for got0, got1, z in zip(r0[0], r1[0], zs):
        assert np.array_equal(recon(got0, got1), ring_matvec(x, z))


def test_supported_in_dealer_mode(pair):
    assert list(pair.call(rmp.supported)) == [True, True]

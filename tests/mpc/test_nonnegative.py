"""Bit planes, edabits and the sign test (mpc.nonnegative) against numpy oracles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import parties
from mpc import bitplanes, correlations
from mpc.launcher import run_parties
from common.prg import new_seed

RNG = np.random.default_rng(7)
EDGES = np.array([0, 1, -1, 2, -2, 2**62, -(2**62), 2**63 - 1, -(2**63), 2**31, -(2**31)], dtype=np.int64)


def _bit(words: np.ndarray, i: int) -> int:
    """Bit i of a little-endian array of int64 words (numpy's own bit unpacking)."""
    return int(np.unpackbits(words.view(np.uint8), bitorder="little")[i])


def test_planes_match_numpy_bit_unpacking():
    x = RNG.integers(-(2**63), 2**63 - 1, size=150, dtype=np.int64, endpoint=True)
    planes = bitplanes.to_planes(torch.from_numpy(x)).numpy()
    assert planes.shape == (64, 3)
    elem_bits = np.unpackbits(x.view(np.uint8), bitorder="little").reshape(150, 64)
    for i in (0, 1, 17, 31, 32, 62, 63):
        for e in (0, 1, 63, 64, 127, 149):
            assert _bit(planes[i], e) == elem_bits[e, i], (i, e)
    # padding elements (150..191) are zero in every plane
    assert all(_bit(planes[i], e) == 0 for i in (0, 63) for e in range(150, 192))


@pytest.mark.parametrize("bits", [1, 7, 63, 64])
def test_planes_round_trip_keeps_the_low_bits(bits):
    x = torch.from_numpy(np.concatenate([EDGES, RNG.integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)]))
    back = bitplanes.from_planes(bitplanes.to_planes(x, bits), x.numel())
    mask = -1 if bits == 64 else (1 << bits) - 1
    assert torch.equal(back, x & mask)


def test_planes_are_xor_linear():
    a = torch.from_numpy(RNG.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64))
    b = torch.from_numpy(RNG.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64))
    assert torch.equal(bitplanes.to_planes(a) ^ bitplanes.to_planes(b), bitplanes.to_planes(a ^ b))


@pytest.mark.parametrize("bits", [1, 64])
def test_edabit_shares_reconstruct_the_same_r_twice(bits):
    req = correlations.make_request("edabit", (5, 40), bits)
    assert correlations.validate(list(req)) == req
    seed0, seed1 = new_seed(), new_seed()
    r0, planes0 = correlations.party0_shares(req, seed0, 3)
    corr = correlations.correction(req, seed0, seed1, 3)
    r1, planes1 = correlations.party1_shares(req, seed1, 3, corr)
    assert planes0.shape == planes1.shape == (bits, bitplanes.words(200))
    r = (r0 + r1).reshape(-1)
    assert torch.equal(bitplanes.from_planes(planes0 ^ planes1, 200), r)
    if bits == 1:
        assert set(r.tolist()) == {0, 1}
    else:  # a uniform ring element: about half the values negative
        assert 60 < int((r < 0).sum()) < 140


def test_edabit_requests_are_validated():
    with pytest.raises(correlations.RequestError):
        correlations.make_request("edabit", (4,), 65)
    with pytest.raises(correlations.RequestError):
        correlations.validate(["edabit", [4]])


@pytest.mark.parametrize("provider,n", [("dealer", 4011), ("tfp", 4011), ("dealer", 11), ("dealer", 1)])
def test_sign_test_is_exact_on_the_whole_ring(provider, n):
    x = np.concatenate([EDGES, RNG.integers(-(2**63), 2**63 - 1, 4000, dtype=np.int64)])[:n].reshape(-1, 1)
    mask = RNG.integers(-(2**63), 2**63 - 1, x.shape, dtype=np.int64)
    with np.errstate(over="ignore"):
        share0 = x - mask  # wraps mod 2^64 like the ring
    res = run_parties(parties.sign_test_ring, share0, mask, insecure_tfp=provider == "tfp")
    (bit0, shape0), (bit1, shape1) = res.values
    assert shape0 == shape1 == list(x.shape)
    assert np.array_equal(bit0, bit1)
    assert np.array_equal(bit0, (x >= 0).astype(bit0.dtype))
    # communication as the protocol docstring states: per party 8 bytes per element for c,
    # 2 words per AND plane word (118 planes per element) and one word per plane for B2A;
    # below 64 elements only the used bits of those words, per round rounded up to a word
    w = bitplanes.words(n)
    step = res.meters[0]["steps"]["sign"]
    if n >= 64:
        payload = 8 * n + 8 * (2 * 118 * w + w)
    else:
        and_planes = (61, 31, 15, 7, 3, 1)
        payload = 8 * n + sum(8 * -(-2 * k * n // 64) for k in and_planes) + 8 * -(-n // 64)
    assert step["online_rounds"] == 8
    assert step["online_bytes_sent"] == payload + 8 * 9  # one 9-byte frame header per round

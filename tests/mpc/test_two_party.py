"""Real two-process sessions (TLS, dealer) checked against numpy."""

import numpy as np
import pytest

from tests.helpers import parties
from common import encoding, sharing
from mpc.launcher import run_parties

FIXED_POINT_ERR = 2.0**-15


def test_client_shares_reconstruct_inside_a_two_party_session():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=257) * 3e4, [-(2.0**29), 2.0**29, 0.0, -1e-5]])
    s = sharing.share(x, compress=True)
    res = run_parties(parties.reconstruct_client_shares, s.materialize_share0(), s.share1, 16)
    for ring in res.values:
        assert np.array_equal(ring, encoding.encode(x))  # exactly the client's encoding
        assert np.max(np.abs(encoding.decode(ring) - x)) <= FIXED_POINT_ERR


@pytest.mark.parametrize("provider", ["dealer", "tfp"])
def test_multiply_compare_open_match_numpy(provider):
    rng = np.random.default_rng(11)
    a = np.concatenate([rng.normal(size=101) * 100, [0.0, 0.0, -3.25, 1e-3, 300.0, 5000.0, -6000.0]]).astype(np.float32)
    b = np.concatenate([rng.normal(size=101) * 100, [0.0, -0.5, -3.25, 1e-3, -300.0, 5000.0, 6000.0]]).astype(np.float32)
    # products up to 3.6e7 (ring 2^57): CrypTen's local truncation would wrap with probability
    # about |ring| / 2^64 per element (~1% per run); the wrap-free truncation cannot
    m1 = rng.normal(size=(3, 5)).astype(np.float32)
    m2 = rng.normal(size=(5, 4)).astype(np.float32)
    res = run_parties(parties.arithmetic_suite, a, b, m1, m2, insecure_tfp=provider == "tfp")
    out0, out1 = res.values
    for k in out0:
        assert np.array_equal(out0[k], out1[k]), k  # both parties open the same value
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.allclose(out0["prod"], a64 * b64, atol=1e-3, rtol=1e-4)
    assert np.array_equal(out0["ge"], (a64 >= b64).astype(float))  # ties (0,0), (-3.25,-3.25) included
    assert np.array_equal(out0["lt"], (a64 < b64).astype(float))
    assert np.allclose(out0["mm"], m1.astype(np.float64) @ m2, atol=1e-3)
    assert np.allclose(out0["sq"], a64 * a64, rtol=1e-4, atol=1e-3)
    steps = res.meters[0]["steps"]
    # Beaver (epsilon and delta in one frame), then the wrap-free truncation (c in one frame)
    assert steps["mul"]["online_rounds"] == 2
    assert steps["mul"]["online_bytes_sent"] == 2 * 8 * a.size + 9 + 8 * a.size + 9
    if provider == "dealer":
        # party 0 never talks to the dealer after setup; party 1 receives exactly c1 and the
        # truncation pair's two corrections (msb(r), r >> 16)
        assert steps["mul"]["offline_bytes_received"] == 0
        assert res.meters[1]["steps"]["mul"]["offline_bytes_received"] == 8 * a.size + 9 + 2 * 8 * a.size + 9
        assert res.plans[0] == res.plans[1] and len(res.plans[0]) > 3


def test_recorded_plan_prefills_the_dealer_material_before_the_online_phase():
    first = run_parties(parties.multiply_batch, 1000)
    plan = first.plans[1]
    second = run_parties(parties.multiply_batch, 1000, plan=plan)
    assert np.allclose(second.values[0], first.values[0], atol=1e-3)
    p1 = second.meters[1]["steps"]
    assert p1["prefill"]["offline_bytes_received"] >= 8 * 1000
    assert p1["mul"]["offline_bytes_received"] == 0  # served from the cache: no dealer traffic online
    assert second.plans[1] == plan


def test_each_party_alone_sees_uniform_shares_of_a_zero_product():
    res = run_parties(parties.seeded_noise, 4096)
    s0, s1 = res.values
    assert np.array_equal(s0 + s1, np.zeros_like(s0))  # they reconstruct 0 ...
    for s in (s0, s1):  # ... while each share's bits are balanced
        assert abs(np.unpackbits(s.view(np.uint8)).mean() - 0.5) < 0.01

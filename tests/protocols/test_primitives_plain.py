"""Plaintext twins of the secure primitives against independent numpy / fractions oracles.

No processes here: these run the same calls the 2PC tests make, on torch tensors, so that the
network, tie rules and shape handling are checked exhaustively where that is cheap.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch

from protocols import backend
from protocols.compare import compare_exchange, ge, ge_ratio, select
from protocols.division import divide, reciprocal
from protocols.inner_product import inner
from protocols.inverse import inverse_masked, inverse_newton
from protocols.maximum import max as secure_max
from protocols.sort import bitonic_sort, network, num_layers, ratio_comparator, top_k
from protocols.threshold import any_exceeds


def t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float64))


@pytest.mark.parametrize("n", range(1, 13))
def test_network_sorts_every_zero_one_input(n):
    # 0-1 principle: a comparator network sorts everything iff it sorts all 0/1 inputs.
    keys = np.array(list(itertools.product([0.0, 1.0], repeat=n)))
    out, _ = bitonic_sort(t(keys), stable=False)
    assert np.array_equal(out.numpy(), np.sort(keys, axis=1))
    down, _ = bitonic_sort(t(keys), descending=True, stable=False)
    assert np.array_equal(down.numpy(), -np.sort(-keys, axis=1))


def test_network_shape_is_log_squared():
    for n in (2, 4, 8, 64, 1024):
        p = int(np.log2(n))
        assert num_layers(n) == p * (p + 1) // 2
        assert all(len(i) <= n // 2 for i, _ in network(n))
    # padding only removes comparators: never more layers than the power of two above
    assert num_layers(13) <= num_layers(16)
    for ii, jj in network(13):
        assert int(jj.max()) < 13 and bool((ii < jj).all())


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33])
def test_sort_is_stable_permutation_with_payloads(n, descending):
    rng = np.random.default_rng(n)
    keys = rng.integers(-3, 4, size=(4, n)).astype(np.float64)
    keys[0] = 0.0  # all ties
    keys[1, : n // 2] = 1e9  # large values mixed in
    vals = rng.normal(size=(4, n))
    idx = np.broadcast_to(np.arange(n), (4, n))
    sk, (sp_idx, sp_val) = bitonic_sort(t(keys), (torch.arange(n).expand(4, n), t(vals)),
                                        descending=descending)
    for r in range(4):
        order = np.argsort(-keys[r] if descending else keys[r], kind="stable")
        assert np.array_equal(sp_idx[r].numpy(), idx[r][order])
        assert np.array_equal(sk[r].numpy(), keys[r][order])
        assert np.array_equal(sp_val[r].numpy(), vals[r][order])
    assert sp_idx.dtype == torch.long  # integer payloads keep their dtype


def test_ratio_sort_orders_by_exact_fraction_and_breaks_ties_by_index():
    rng = np.random.default_rng(5)
    n = 11
    u = rng.integers(-6, 7, size=(3, n)).astype(np.float64)
    v = rng.integers(1, 5, size=(3, n)).astype(np.float64)
    u[2], v[2] = 2.0 * u[1], 2.0 * v[1]  # same ratios, different pairs
    u[0, :4], v[0, :4] = [1, 2, -3, -6], [2, 4, 0.5, 1]  # explicit equal ratios
    for desc in (True, False):
        (su, sv), perm = bitonic_sort((t(u), t(v)), torch.arange(n).expand(3, n),
                                      descending=desc, comparator=ratio_comparator)
        for r in range(3):
            frac = [Fraction(int(u[r, i])) / Fraction(v[r, i]) for i in range(n)]
            want = sorted(range(n), key=lambda i: (-frac[i] if desc else frac[i], i))
            assert perm[r].tolist() == want
            assert np.array_equal(su[r].numpy(), u[r][want])
            assert np.array_equal(sv[r].numpy(), v[r][want])


def test_custom_comparator_gets_the_same_tie_rule():
    keys = t([[3.0, -1.0, -3.0, 1.0, 0.0, 2.0, -2.0]])
    by_abs = lambda a, b: ge(a[0].abs(), b[0].abs())  # noqa: E731
    _, perm = bitonic_sort(keys, torch.arange(7).unsqueeze(0), descending=True, comparator=by_abs)
    assert perm[0].tolist() == [0, 2, 5, 6, 1, 3, 4]


def test_unstable_sort_still_sorts():
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 3, size=(2, 9)).astype(np.float64)
    sk, sp = bitonic_sort(t(keys), torch.arange(9).expand(2, 9), stable=False)
    for r in range(2):
        assert np.array_equal(sk[r].numpy(), np.sort(keys[r]))
        assert sorted(sp[r].tolist()) == list(range(9))
        assert np.array_equal(keys[r][sp[r].numpy()], sk[r].numpy())


def test_top_k_returns_first_indices_on_ties():
    keys = t([[5.0, 7.0, 7.0, -1.0, 7.0, 0.0]])
    assert top_k(keys, None, 3).tolist() == [[1, 2, 4]]
    assert top_k(keys, None, 2, descending=False).tolist() == [[3, 5]]
    ids = torch.tensor([[10, 20, 30, 40, 50, 60]])
    assert top_k(keys, ids, 1).tolist() == [[20]]
    with pytest.raises(ValueError):
        top_k(keys, None, 7)


def test_sort_rejects_mismatched_shapes_and_tuple_keys_without_comparator():
    with pytest.raises(ValueError):
        bitonic_sort(t([1.0, 2.0]), t([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError):
        bitonic_sort((t([1.0, 2.0]), t([1.0, 1.0])))


def test_compare_select_exchange_match_numpy():
    x = np.array([[1.5, -2.0, 0.0, 2.0**-16, 3e4], [0.0, 0.0, -1.0, 7.0, -7.0]])
    y = np.array([[1.5, -2.5, 0.0, -(2.0**-16), 3e4 - 1], [0.0, 2.0**-16, -1.0, 7.0, 7.0]])
    b = ge(t(x), t(y))
    assert np.array_equal(b.numpy(), (x >= y).astype(float))
    assert np.array_equal(select(b, t(x), t(y)).numpy(), np.maximum(x, y))
    na, nb = compare_exchange(1.0 - b, [t(x)], [t(y)])
    assert np.array_equal(na[0].numpy(), np.maximum(x, y))
    assert np.array_equal(nb[0].numpy(), np.minimum(x, y))
    u1, v1 = np.array([1.0, -2.0, 3.0, 0.5]), np.array([2.0, 4.0, 1.0, 0.25])
    u2, v2 = np.array([2.0, -1.0, 3.5, 1.0]), np.array([4.0, 2.0, 1.0, 0.5])
    assert ge_ratio(t(u1), t(v1), t(u2), t(v2)).tolist() == [1.0, 1.0, 0.0, 1.0]


def test_max_inner_threshold_match_numpy():
    rng = np.random.default_rng(9)
    for n in (1, 2, 7, 33):
        m = rng.normal(size=(3, n)) * 100
        assert np.array_equal(secure_max(t(m)).numpy(), m.max(axis=1))
        assert np.array_equal(secure_max(t(m), dim=0, keepdim=True).numpy(),
                              m.max(axis=0, keepdims=True))
    a, b = rng.normal(size=(4, 9)), rng.normal(size=9)
    assert np.allclose(inner(t(a), t(b)).numpy(), a @ b)
    x = np.array([[1.0, 2.0], [0.5, -3.0], [0.1, 0.2], [-0.25, 0.0]])
    d = np.array([2.0, 3.0, 0.25, -0.25])  # exact ties |x| == |d| count as exceeding
    assert any_exceeds(t(x), t(d)).tolist() == [True, True, False, True]


def test_inverses_and_division_plaintext():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(3, 4, 4)) + 3 * np.eye(4)
    inv = np.linalg.inv(a)
    assert np.allclose(inverse_masked(t(a)).numpy(), inv)
    assert np.allclose(inverse_newton(t(a)).numpy(), inv, atol=1e-9)
    # too few iterations visibly fail in the twin too: same algorithm, same iteration count
    assert not np.allclose(inverse_newton(t(a), iters=2).numpy(), inv, atol=1e-3)
    assert np.allclose(inverse_newton(t(a), scale=float((a**2).sum(axis=(1, 2)).max())).numpy(),
                       inv, atol=1e-9)
    x = np.array([0.001, -3.0, 250.0])
    assert np.allclose(reciprocal(t(x)).numpy(), 1 / x)
    assert np.allclose(divide(t(x), t(x + 1)).numpy(), x / (x + 1))


def test_backend_dispatch_on_plain_values():
    assert not backend.is_shared(torch.zeros(1))
    assert backend.reveal(torch.ones(2)).tolist() == [1.0, 1.0]
    # round to nearest (ties to even), unlike CrypTen's truncating encoder
    assert backend.encode_public(torch.tensor([-1.5, 3 * 2.0**-17, -0.7 * 2.0**-16])).tolist() == [-98304, 2, -1]

"""FedSECA and BRACE's sign vote: the plaintext twin against numpy oracles written from the
papers' equations, and the two-party protocol against the twin.

Oracles (independent of ``protocols.robust_aggregation``): FedSECA eq. 4-10 with exact rational
arithmetic for CRISE (omega and rho as Fractions, so a vote that balances gives sign 0), float64
for clipping/clamping (the paper's order: clip, clamp, sparsify at the raw gradients' quantile),
eq. 7 on the VRS gradients exactly as written (delta = I(s g_ddot > 0)); BRACE eq. 1; the
threshold check as "lambda is the floor(gamma (D-1))-th smallest |g| and non-negative".

Two-party tests run many random cases per call of one long-lived session (``pair`` fixture),
inputs on the 16-bit grid; bits and signs must be equal, values within the documented
fixed-point bound.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocols import robust_aggregation as ra
from protocols.secure_quantile import QUANTILE_STEP_BITS, quantile_step_bits, secure_quantile_thresholds
from protocols.robust_aggregation import (brace_sign, check_thresholds, fedseca, fedseca_checked,
                                          fedseca_elected_signs, fedseca_parts, median_network, momentum, partition_network,
                                          quantile_thresholds)
from tests.helpers import robust_aggregation_programs as rap
from tests.helpers.fixed_point_strategies import LSB, fixed_arrays

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ oracles
def oracle_crise(g: np.ndarray) -> tuple[list, np.ndarray]:
    """(rho_k as Fractions, elected signs s) by eq. 4-6."""
    K, D = g.shape
    if D == 0:
        return [], np.zeros(0)
    sg = np.sign(g).astype(np.int64)
    omega = [[Fraction(int(sg[k] @ sg[l]), D) for l in range(K)] for k in range(K)]
    sgn = lambda v: (v > 0) - (v < 0)  # noqa: E731
    rho = [max(Fraction(0), Fraction(sum(sgn(omega[k][l]) for l in range(K)), K)) for k in range(K)]
    s = np.array([sgn(sum(rho[k] * int(sg[k, j]) for k in range(K))) for j in range(D)], dtype=np.float64)
    return rho, s


def oracle_threshold(g: np.ndarray, gamma: float) -> np.ndarray:
    D = g.shape[1]
    return np.sort(np.abs(g), axis=1)[:, int(math.floor(gamma * (D - 1)))]


def oracle_fedseca(g: np.ndarray, gamma: float, lam=None) -> dict:
    K, D = g.shape
    if D == 0:
        return {"aggregate": np.zeros(0)}
    rho, s = oracle_crise(g)
    norms = np.sqrt((g ** 2).sum(1))
    tau = np.sort(norms)[(K - 1) // 2]
    factor = np.ones(K)
    big = norms > tau
    factor[big] = tau / norms[big]                       # min(1, tau / ||g||)
    g_hat = g * factor[:, None]                          # eq. 8
    mu = np.sort(np.abs(g_hat), axis=0)[(K - 1) // 2]    # lower median per coordinate
    g_bar = np.sign(g_hat) * np.minimum(mu, np.abs(g_hat))  # eq. 9
    lam = oracle_threshold(g, gamma) if lam is None else np.asarray(lam)
    keep = np.abs(g) > lam[:, None]
    g_ddot = g_bar * keep                                # eq. 10 (lambda from the raw g)
    delta = s * g_ddot > 0                               # eq. 7
    count = delta.sum(0)
    total = (delta * g_ddot).sum(0)
    agg = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    return {"aggregate": agg, "signs": s, "weights": np.array([float(r * K) for r in rho]),
            "keep": keep.astype(np.float64), "agree": delta.astype(np.float64), "clip": factor,
            "clamp": mu, "count": count, "thresholds": lam}


def oracle_brace(g: np.ndarray, lam: float) -> np.ndarray:
    return np.where(np.sign(g).sum(0) > lam, 1.0, -1.0)


def oracle_check(g: np.ndarray, lam: np.ndarray, gamma: float) -> np.ndarray:
    if g.shape[1] == 0:
        return np.ones(g.shape[0], dtype=bool)
    return (lam >= 0) & (lam == oracle_threshold(g, gamma))


# ----------------------------------------------------------------------------- strategies
@st.composite
def updates(draw, max_k: int = 9, max_d: int = 40, min_d: int = 0, max_enc: int = 1 << 30):
    """K x D updates on the 16-bit grid: wide magnitudes (2**-16 .. 2**14), ties, one-unit gaps,
    zeros; sometimes every client shares the signs, or rows repeat (tied norms)."""
    K = draw(st.integers(1, max_k))
    D = draw(st.integers(min_d, max_d))
    g = draw(fixed_arrays((K, D), max_enc, off_grid=False))
    shape = draw(st.sampled_from(["as drawn", "same signs", "repeated rows", "zero rows"]))
    if shape == "same signs" and D:
        col = np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=D, max_size=D)))
        g = np.abs(g) * col
    elif shape == "repeated rows" and K > 1:
        g[1:] = g[0] * np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=K - 1,
                                                  max_size=K - 1)))[:, None]
    elif shape == "zero rows":
        g[: draw(st.integers(0, K))] = 0.0
    return g


def _t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.float64))


# ----------------------------------------------------------------------- plaintext twin: by hand
def test_fedseca_by_hand():
    """K = 3, D = 4, gamma = 0.5 worked through on paper (see the comments)."""
    g = np.array([[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.2, 1.0], [1.5, -3.0, -0.4, 2.0]])
    p = fedseca_parts(_t(g), gamma=0.5)
    # every pair has positive sign concordance (4/4, 2/4, 2/4): rho = 1, weights K rho = 3
    assert p.weights.tolist() == [3.0, 3.0, 3.0]
    assert p.signs.tolist() == [1.0, -1.0, 1.0, 1.0]          # votes 3, -3, 1, 3
    # norms^2 14.25, 6.04, 15.41: tau = sqrt(14.25), only client 2 is clipped
    r = math.sqrt(14.25 / 15.41)
    np.testing.assert_allclose(p.clip.numpy(), [1.0, 1.0, r], rtol=1e-15)
    # f = floor(0.5 * 3) = 1: the second smallest |g| per row
    assert p.thresholds.tolist() == [1.0, 1.0, 1.5]
    assert p.keep.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 1]]
    # mu = medians of |g_hat|: (1, 2, 1.5r), (2, 1, 3r), (0.5, 0.2, 0.4r), (3, 1, 2r)
    np.testing.assert_allclose(p.clamp.numpy(), [1.5 * r, 2.0, 0.4 * r, 2.0 * r], rtol=1e-15)
    # column 0: only client 1 kept, clamped to 1.5r; column 1: -2 twice; column 2: nobody;
    # column 3: clients 0 and 2, both clamped to 2r
    np.testing.assert_allclose(p.aggregate.numpy(), [1.5 * r, -2.0, 0.0, 2.0 * r], rtol=1e-15)
    assert p.count.tolist() == [1, 2, 0, 2]


def test_crise_downweights_a_discordant_client():
    """Client 2 disagrees with both others on most coordinates: omega signs per row are
    (+, +, -), (+, +, -), (-, -, +), so K rho = (1, 1, max(0, -1) = 0) and client 2's votes count
    for nothing, even where they would break a tie."""
    g = _t([[1.0, 1.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 1.0]])
    p = fedseca_parts(g, gamma=0.0)
    assert p.weights.tolist() == [1.0, 1.0, 0.0]
    assert p.signs.tolist() == [1.0, 1.0, 1.0, 0.0]            # last column: 1 (-1) + 1 (+1) + 0 (+1) = 0
    assert fedseca_elected_signs(g).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert p.aggregate[3].item() == 0.0                       # no elected sign, nothing agrees


def test_brace_by_hand():
    g = _t([[1.0, -1.0, 2.0, 0.0], [1.0, 1.0, -2.0, 0.0], [1.0, -1.0, -3.0, 0.0]])  # votes 3, -1, -1, 0
    assert brace_sign(g, lam=0).tolist() == [1.0, -1.0, -1.0, -1.0]
    assert brace_sign(g, lam=-1).tolist() == [1.0, -1.0, -1.0, 1.0]   # 0 > -1
    assert brace_sign(g, lam=-1.5).tolist() == [1.0, 1.0, 1.0, 1.0]   # -1 > -1.5
    assert brace_sign(g, lam=3).tolist() == [-1.0, -1.0, -1.0, -1.0]  # 3 > 3 fails
    assert brace_sign(g).tolist() == [-1.0] * 4                       # paper default 5


def test_momentum_by_hand():
    a1, a2 = _t([2.0, -4.0]), _t([1.0, 1.0])
    d1 = momentum(None, a1)                       # first round: zero buffer
    assert d1.tolist() == [1.0, -2.0]
    assert momentum(d1, a2).tolist() == [1.0, -0.5]
    assert momentum(d1, a2, beta=0.0).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        momentum(d1, a2, beta=1.5)
    with pytest.raises(ValueError):
        momentum(_t([1.0]), a2)


def test_parameter_errors():
    g = _t([[1.0, 2.0]])
    with pytest.raises(ValueError, match="gamma"):
        fedseca(g, gamma=1.5)
    with pytest.raises(ValueError, match="K x D"):
        fedseca(_t([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least one client"):
        fedseca(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="shape"):
        fedseca(g, thresholds=_t([0.1, 0.2]))
    with pytest.raises(ValueError, match="non-negative"):
        fedseca(g, thresholds=_t([-0.5]))
    with pytest.raises(ValueError, match="finite"):
        brace_sign(g, lam=float("nan"))
    with pytest.raises(ValueError, match="shape"):
        check_thresholds(g, _t([0.1, 0.2]))


def test_quantile_lower_keeps_what_torch_quantile_keeps():
    """{|g| > v_(f)} equals {|g| > torch.quantile(|g|, gamma)} (linear interpolation, the
    authors' code), ties included."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        D = int(rng.integers(1, 30))
        a = np.abs(np.round(rng.normal(size=(2, D)) * 4) / 4)
        gamma = float(rng.choice([0.0, 0.3, 0.5, 0.9, 0.95, 1.0]))
        lam = quantile_thresholds(_t(a), gamma)
        lin = torch.quantile(_t(a), gamma, dim=1)
        assert torch.equal(_t(a) > lam[:, None], _t(a) > lin[:, None])


# ------------------------------------------------------------------------- networks (0-1 principle)
def _zero_one_columns(n: int) -> torch.Tensor:
    cols = torch.arange(1 << n, dtype=torch.long)
    return ((cols.unsqueeze(0) >> torch.arange(n).unsqueeze(1)) & 1).to(torch.float64)


@pytest.mark.parametrize("n", list(range(1, 17)) + [20])
def test_networks_on_every_zero_one_input(n):
    """A comparator network commutes with every monotone map, so checking all 0/1 inputs proves
    the median (and the partition around it) for every input."""
    x = _zero_one_columns(n)
    m = (n - 1) // 2
    med = torch.sort(x, dim=0).values[m]
    rows, _ = ra._run_network(partition_network(n), [x[i] for i in range(n)])
    y = torch.stack(rows)
    assert torch.equal(y[m], med)
    assert bool((y[:m] <= y[m]).all()) and bool((y[m + 1:] >= y[m]).all())
    rows, _ = ra._run_network(median_network(n), [x[i] for i in range(n)])
    assert torch.equal(rows[m], med)


def test_network_sizes():
    """Pruning pays: Batcher's sort of 20 has 103 comparators in 15 layers; the structural
    pruning leaves 84 (what n = 21 still gets: 91 there), the exhaustive one 71 in 14 layers."""
    assert sum(len(layer) for layer in ra._batcher_layers(20)) == 103
    assert sum(len(layer) for layer in partition_network(20)) == 71
    assert len(partition_network(20)) == 14
    assert sum(len(layer) for layer in partition_network(21)) == 91
    for n in range(1, 25):
        for layer in partition_network(n):
            wires = [w for c in layer for w in c]
            assert len(wires) == len(set(wires)) and all(0 <= w < n for w in wires)


def test_network_payloads_follow_their_keys():
    rng = np.random.default_rng(5)
    keys = _t(rng.integers(0, 4, size=(7, 50)))
    tags = _t(np.arange(7)[:, None] * 100 + np.arange(50)[None, :])
    ks, (ts,) = ra._run_network(partition_network(7), [keys[i] for i in range(7)], [[tags[i] for i in range(7)]])
    src = (torch.stack(ts) // 100).long()
    assert torch.equal(torch.stack(ks), keys.gather(0, src))


# ----------------------------------------------------------------- plaintext twin vs oracles
def _compare_with_oracle(g: np.ndarray, gamma: float, lam=None) -> None:
    want = oracle_fedseca(g, gamma, lam)
    got = fedseca_parts(_t(g), gamma=gamma, thresholds=None if lam is None else _t(lam))
    K, D = g.shape
    assert got.aggregate.shape == (D,)
    np.testing.assert_allclose(got.aggregate.numpy(), want["aggregate"], rtol=1e-12, atol=1e-300)
    if D == 0:
        return
    for name in ("signs", "weights", "keep", "thresholds"):
        np.testing.assert_array_equal(got._asdict()[name].numpy(), want[name], err_msg=name)
    np.testing.assert_allclose(got.clip.numpy(), want["clip"], rtol=1e-14)
    np.testing.assert_allclose(got.clamp.numpy(), want["clamp"], rtol=1e-14)
    # delta as computed equals eq. 7's wherever mu > 0 (where mu = 0 every g_ddot is 0)
    live = want["clamp"] > 0
    np.testing.assert_array_equal(got.agree.numpy()[:, live], want["agree"][:, live])
    np.testing.assert_array_equal(got.count.numpy()[live], want["count"][live])
    # structure: the aggregate has the elected sign (or is 0) and never exceeds mu
    a = got.aggregate.numpy()
    assert np.all((np.sign(a) == want["signs"]) | (a == 0))
    assert np.all(np.abs(a) <= want["clamp"] * (1 + 1e-12))


@given(updates(), st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))
@settings(max_examples=150)
@example(np.zeros((4, 5)), 0.9)
@example(np.ones((2, 3)), 0.5)
@example(np.zeros((3, 0)), 0.9)
@example(np.array([[LSB, -LSB, 2.0 ** 14 - LSB], [-LSB, LSB, -(2.0 ** 14 - LSB)]]), 0.5)
def test_fedseca_twin_matches_oracle(g, gamma):
    _compare_with_oracle(g, gamma)


@given(updates(min_d=1), st.data())
@settings(max_examples=60)
def test_fedseca_with_supplied_thresholds(g, data):
    """Any thresholds (not only the quantile) follow eq. 10 literally."""
    lam = np.abs(data.draw(fixed_arrays((g.shape[0],), 1 << 30, off_grid=False)))
    _compare_with_oracle(g, 0.9, lam)
    # supplying the quantile itself changes nothing
    own = quantile_thresholds(_t(g), 0.9)
    assert torch.equal(fedseca(_t(g), thresholds=own), fedseca(_t(g)))


@given(updates(), st.sampled_from([-3.5, -1.0, 0.0, 0.5, 1.0, 2.0, 5.0]))
@settings(max_examples=100)
def test_brace_sign_matches_oracle(g, lam):
    np.testing.assert_array_equal(brace_sign(_t(g), lam=lam).numpy(), oracle_brace(g, lam))


@given(updates())
@settings(max_examples=60)
def test_elected_signs_match_oracle(g):
    np.testing.assert_array_equal(fedseca_elected_signs(_t(g)).numpy(), oracle_crise(g)[1])


@st.composite
def threshold_claims(draw):
    g = draw(updates(min_d=0))
    gamma = draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]))
    K, D = g.shape
    if D == 0:
        return g, np.zeros(K), gamma
    srt = np.sort(np.abs(g), axis=1)
    f = int(math.floor(gamma * (D - 1)))
    lam = srt[:, f].copy()
    for k in range(K):
        how = draw(st.sampled_from(["true", "true", "next", "prev", "+lsb", "-lsb", "negated", "zero", "max+"]))
        if how == "next":
            lam[k] = srt[k, min(f + 1, D - 1)]          # equal to v_f when tied: still right
        elif how == "prev":
            lam[k] = srt[k, max(f - 1, 0)]
        elif how == "+lsb":
            lam[k] += LSB
        elif how == "-lsb":
            lam[k] -= LSB
        elif how == "negated":
            lam[k] = -lam[k] if lam[k] else -LSB
        elif how == "zero":
            lam[k] = 0.0
        elif how == "max+":
            lam[k] = srt[k, -1] + LSB
    return g, lam, gamma


@given(threshold_claims())
@settings(max_examples=150)
def test_check_thresholds_matches_oracle(claim):
    g, lam, gamma = claim
    np.testing.assert_array_equal(check_thresholds(_t(g), _t(lam), gamma).numpy(), oracle_check(g, lam, gamma))


@given(threshold_claims())
@settings(max_examples=60)
def test_fedseca_checked_is_the_check_then_fedseca_on_the_accepted(claim):
    """The servers' round on the twin: the oracle's verdict, then the oracle's FedSECA on the
    accepted rows with their claims (None when every claim fails)."""
    g, lam, gamma = claim
    ok, agg = fedseca_checked(_t(g), _t(lam), gamma=gamma)
    want = oracle_check(g, lam, gamma)
    np.testing.assert_array_equal(ok.numpy(), want)
    if not want.any():
        assert agg is None
        return
    ref = oracle_fedseca(g[want], gamma, lam[want])["aggregate"]
    np.testing.assert_allclose(agg.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_check_accepts_honest_clients_with_ties():
    """Ties at the quantile (common on the fixed-point grid) must not fail an honest client."""
    g = _t([[0.0] * 9 + [1.0], [0.5] * 10, [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0]])
    assert check_thresholds(g, quantile_thresholds(g, 0.9), 0.9).tolist() == [True, True, True]
    assert check_thresholds(g, quantile_thresholds(g, 0.5), 0.5).tolist() == [True, True, True]


# ---------------------------------------------------------------------------- 2PC vs the twin
#: |g_tilde_2pc - g_tilde_twin| <= 2 (2**-12 max_k |g_hat_k^j| + 2**-16) + 2**-16 (module docstring)
def _tolerance(g: np.ndarray) -> np.ndarray:
    return ra.fedseca_error_bound(torch.as_tensor(g)).numpy()


def test_the_documented_fedseca_bound_is_the_docstring_formula():
    g = np.array([[0.0, -3.0, 2.0 ** 13], [1.0, 0.5, -(2.0 ** 13)]])
    want = [2 * (2.0 ** -12 * m + LSB) + LSB for m in (1.0, 3.0, 2.0 ** 13)]
    np.testing.assert_array_equal(_tolerance(g), want)


def _random_cases(seed: int, n: int, max_k: int, max_d: int, max_enc: int) -> list:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        K = int(rng.integers(1, max_k + 1))
        D = int(rng.integers(1, max_d + 1))
        kind = i % 4
        if kind == 0:     # wide magnitudes, 2**-16 .. ~2**13
            e = rng.integers(0, 30, size=(K, D))
            g = rng.choice([-1, 1], size=(K, D)) * rng.integers(1, 4, size=(K, D)) * 2.0 ** e * LSB
        elif kind == 1:   # small integers: ties, zeros, balanced votes
            g = rng.integers(-2, 3, size=(K, D)).astype(np.float64)
        elif kind == 2:   # Gaussian updates with a scaled Byzantine client
            g = np.round(rng.normal(size=(K, D)) * 0.05 / LSB) * LSB
            g[0] *= 10.0
        else:             # one-unit values and exact zeros
            g = rng.integers(-3, 4, size=(K, D)) * LSB
        g = np.clip(g, -(2.0 ** 14 - LSB), 2.0 ** 14 - LSB)
        if kind != 2:
            norm_cap = 2.0 ** 14
            big = np.sqrt((g ** 2).sum(1)) >= norm_cap     # keep ||g||^2 < 2**28 inside the range
            g[big] = np.round(g[big] / 64 / LSB) * LSB
        gamma = float(rng.choice([0.0, 0.5, 0.9]))
        cases.append({"g": g, "gamma": gamma, "lam": oracle_threshold(g, gamma),
                      "brace_lam": float(rng.choice([-1.0, 0.0, 1.5, 5.0]))})
    return cases


def test_fedseca_2pc_matches_twin(pair):
    cases = _random_cases(11, 12, max_k=9, max_d=12, max_enc=1 << 30)
    cases.append({"g": np.array([[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.2, 1.0], [1.5, -3.0, -0.4, 2.0]]),
                  "gamma": 0.5, "lam": np.array([1.0, 1.0, 1.5]), "brace_lam": 0.0})
    cases.append({"g": np.zeros((4, 3)), "gamma": 0.9, "lam": np.zeros(4), "brace_lam": 0.0})
    cases.append({"g": np.array([[0.0, 0.0], [0.0, 0.0], [3.0, -2.0]]), "gamma": 0.0,
                  "lam": np.zeros(3), "brace_lam": 0.0})   # tau = 0: all clipped to 0
    _assert_fedseca_matches_twin(cases, *pair.call(rap.fedseca_cases, cases))


def test_fedseca_2pc_matches_twin_in_two_party_mode(two_party_pair):
    """The same program without a dealer (the engine's sign tests and products), on a few of the
    same kinds of cases (wide magnitudes, ties and zeros, a scaled client, one-unit values)."""
    cases = _random_cases(11, 4, max_k=5, max_d=6, max_enc=1 << 30)
    _assert_fedseca_matches_twin(cases, *two_party_pair.call(rap.fedseca_cases, cases))


def _assert_fedseca_matches_twin(cases: list, out0: list, out1: list) -> None:
    assert len(out0) == len(out1) == len(cases)
    for case, got, got1 in zip(cases, out0, out1):
        for name in got:
            np.testing.assert_array_equal(got[name], got1[name])   # both parties open the same
        g = case["g"]
        twin = fedseca_parts(_t(g), gamma=case["gamma"], thresholds=_t(case["lam"]))
        for name in ("signs", "weights", "keep", "agree", "count"):
            np.testing.assert_array_equal(got[name], twin._asdict()[name].numpy(), err_msg=name)
        np.testing.assert_array_equal(got["elected"], twin.signs.numpy())
        np.testing.assert_array_equal(got["brace"], brace_sign(_t(g), lam=case["brace_lam"]).numpy())
        # clip factors: relative 2**-12 (c = 1 exactly for the unclipped)
        np.testing.assert_allclose(got["clip"], twin.clip.numpy(), rtol=2.0 ** -12, atol=2.0 ** -30)
        unclipped = twin.clip.numpy() == 1.0
        assert np.all(got["clip"][unclipped] == 1.0)
        tol = _tolerance(g)
        assert np.all(np.abs(got["aggregate"] - twin.aggregate.numpy()) <= tol), (g, got["aggregate"], twin.aggregate)
        assert np.all(np.abs(got["clamp"] - twin.clamp.numpy()) <= tol)
        if unclipped.all():   # nothing clipped: x = |g| exactly, so mu is exact
            np.testing.assert_array_equal(got["clamp"], twin.clamp.numpy())


def test_fedseca_2pc_in_small_batches(pair):
    """Comparison calls split into pieces of 7 elements (as full-size calls are split) give the
    same bits and an aggregate within the bound."""
    cases = _random_cases(17, 2, max_k=6, max_d=9, max_enc=1 << 30)
    small, _ = pair.call(rap.fedseca_cases, cases, 7)
    pair.call(rap.fedseca_cases, [], 1 << 22)   # back to the default for later calls
    for case, got in zip(cases, small):
        g = case["g"]
        twin = fedseca_parts(_t(g), gamma=case["gamma"], thresholds=_t(case["lam"]))
        for name in ("signs", "weights", "keep", "agree", "count"):
            np.testing.assert_array_equal(got[name], twin._asdict()[name].numpy(), err_msg=name)
        np.testing.assert_array_equal(got["brace"], brace_sign(_t(g), lam=case["brace_lam"]).numpy())
        assert np.all(np.abs(got["aggregate"] - twin.aggregate.numpy()) <= _tolerance(g))


def _claimed_cases(seed: int, n: int, max_k: int, max_d: int) -> list:
    """Random cases whose claimed thresholds are honest, one unit off, or negative (the last row)."""
    rng = np.random.default_rng(seed)
    cases = []
    for case in _random_cases(seed + 6, n, max_k=max_k, max_d=max_d, max_enc=1 << 30):
        g, lam = case["g"], case["lam"].copy()
        lam[rng.random(len(lam)) < 0.5] += LSB * rng.choice([-1, 1])
        if len(lam) > 1:
            lam[-1] = -lam[-1] if lam[-1] else -LSB
        cases.append({"g": g, "lam": lam, "gamma": case["gamma"]})
    cases.append({"g": cases[0]["g"], "lam": -np.ones(len(cases[0]["lam"])), "gamma": 0.5})  # none right
    return cases


def _assert_checked_round(cases: list, checked0: list, checked1: list) -> list:
    """``fedseca_checked`` against the oracles: the verdict, then the accepted rows' aggregate
    within the fixed-point bound of the twin's (None when none is accepted). Returns the verdicts."""
    verdicts = []
    for case, (ok, agg), (ok1, agg1) in zip(cases, checked0, checked1):
        want = oracle_check(case["g"], case["lam"], case["gamma"])
        np.testing.assert_array_equal(ok, want)
        np.testing.assert_array_equal(ok1, want)
        verdicts.append(want)
        if not want.any():
            assert agg is None and agg1 is None
            continue
        np.testing.assert_array_equal(agg, agg1)
        g = case["g"][want]
        twin = fedseca(_t(g), gamma=case["gamma"], thresholds=_t(case["lam"][want])).numpy()
        assert np.all(np.abs(agg - twin) <= _tolerance(g)), (case, agg, twin)
    return verdicts


def test_check_thresholds_2pc_matches_twin(pair):
    cases = _claimed_cases(7, 12, max_k=6, max_d=15)
    out0, out1 = pair.call(rap.check_cases, cases)
    for case, got, got1 in zip(cases, out0, out1):
        np.testing.assert_array_equal(got, got1)
        want = check_thresholds(_t(case["g"]), _t(case["lam"]), case["gamma"]).numpy()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, oracle_check(case["g"], case["lam"], case["gamma"]))
    # the servers' round: the same verdict from the shared sign call, then the rule on the accepted
    verdicts = _assert_checked_round(cases, *pair.call(rap.checked_cases, cases))
    assert any(0 < w.sum() < len(w) for w in verdicts)    # rows were dropped in some case


def test_fedseca_checked_in_two_party_mode(two_party_pair):
    """The servers' round without a dealer (the engine's sign tests and products): the daemon
    runs it so in two-party mode, the service's default."""
    cases = _claimed_cases(29, 3, max_k=4, max_d=5)
    verdicts = _assert_checked_round(cases, *two_party_pair.call(rap.checked_cases, cases))
    assert any(0 < w.sum() < len(w) for w in verdicts) and not verdicts[-1].any()


def test_check_thresholds_2pc_rejects_thresholds_outside_the_bounded_range(pair):
    """The check's coordinate tests are 32-bit sign tests, exact for 0 <= lambda < 2**14; outside,
    the range test must fail the client. lambda = 2**16 (ring integer 2**32) and 2**31 read as 0
    mod 2**32, where lambda = 0 is the true quantile (gamma = 0, a zero coordinate): the counts
    alone would pass them."""
    top = 2.0 ** 14 - LSB
    g = np.array([[0.0, top, -1.0, 2.0], [0.0, -top, 3.0, LSB]])
    cases = [{"g": g, "lam": np.array([0.0, 0.0]), "gamma": 0.0},           # honest: v_(0) = 0
             {"g": g, "lam": np.array([2.0 ** 16, 2.0 ** 31]), "gamma": 0.0},
             {"g": g, "lam": np.array([top, top]), "gamma": 1.0},           # honest: the edge
             {"g": g, "lam": np.array([2.0 ** 14, -LSB]), "gamma": 1.0}]
    out0, out1 = pair.call(rap.check_cases, cases)
    assert [o.tolist() for o in out0] == [[True, True], [False, False], [True, True], [False, False]]
    for case, got, got1 in zip(cases, out0, out1):
        np.testing.assert_array_equal(got, got1)
        np.testing.assert_array_equal(got, oracle_check(case["g"], case["lam"], case["gamma"]))


def test_2pc_rounds_do_not_grow_with_d(pair):
    """All K x D comparisons go in one call (below MAX_BATCH elements): the rounds of an
    aggregation depend on K only, and nothing is opened on the way (no extra round)."""
    rng = np.random.default_rng(2)
    rounds = []
    for D in (3, 60):
        g = np.round(rng.normal(size=(6, D)) / LSB) * LSB
        _, meters = pair.call_metered(rap.fedseca_once, g, oracle_threshold(g, 0.9))
        rounds.append(meters[0]["online_rounds"])
    assert rounds[0] == rounds[1]


def test_2pc_refuses_missing_thresholds(pair):
    msg0, msg1 = pair.call(rap.missing_thresholds)
    assert "thresholds" in msg0 and "thresholds" in msg1


def test_secure_quantile_2pc_is_the_order_statistic(pair):
    """Stage II's estimates come with no reported lambda_k: the servers find the order
    statistic on shares, exactly (ties, zeros, one column, magnitudes up to 2**14)."""
    cases = _random_cases(23, 3, max_k=5, max_d=17, max_enc=1 << 30)   # wide, ties, Gaussian (~5 s a case)
    cases.append({"g": np.zeros((2, 5)), "gamma": 0.9})
    cases.append({"g": np.full((1, 3), 2.0 ** 14 - LSB), "gamma": 0.5})
    got, got1 = pair.call(rap.quantile_cases, cases)
    for case, lam, lam1 in zip(cases, got, got1):
        np.testing.assert_array_equal(lam, lam1)
        np.testing.assert_array_equal(lam, oracle_threshold(case["g"], case["gamma"]))
        np.testing.assert_array_equal(lam, secure_quantile_thresholds(_t(case["g"]), case["gamma"]).numpy())
    # one bit a step (what matrices of 2**20 entries and more get): the same order statistic
    few = [cases[0]] + cases[-2:]
    got, _ = pair.call(rap.quantile_cases, few, 1)
    for case, lam in zip(few, got):
        np.testing.assert_array_equal(lam, oracle_threshold(case["g"], case["gamma"]))


def test_the_quantile_search_takes_one_bit_a_step_on_large_matrices():
    assert quantile_step_bits(19, 582026) == 1 and quantile_step_bits(4, 1 << 18) == 1
    assert quantile_step_bits(5, 10000) == QUANTILE_STEP_BITS == 2
    assert quantile_step_bits(1, (1 << 20) - 1) == 2


@pytest.mark.parametrize("mode", ["dealer", "two-party"])
def test_fedseca_checked_on_coordinate_shards_equals_the_whole(mode, request):
    """``protocols.fedseca_shards``: the round's coordinate-wise work on K = 1..4 slices, the
    counts, omega~ and the norms added over them, the verdict, weights and clip factors at the
    coordinators: the same verdicts as the oracle and an aggregate within the fixed-point bound of
    the twin's (``_assert_checked_round``, the unsharded round's oracles), nothing left on a slice."""
    n = 6 if mode == "dealer" else 3
    cases = _claimed_cases(41 if mode == "dealer" else 43, n, max_k=6, max_d=15)
    ks = [1 + i % 4 for i in range(len(cases))]
    chosen = request.getfixturevalue("pair" if mode == "dealer" else "two_party_pair")
    (out0, held0), (out1, held1) = chosen.call(rap.checked_cases_on_shards, cases, ks)
    verdicts = _assert_checked_round(cases, out0, out1)
    assert held0 == held1 == 0
    assert any(0 < w.sum() < len(w) for w in verdicts) and not verdicts[-1].any()

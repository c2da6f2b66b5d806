"""Starfish sub-protocols: plaintext against direct oracles, and 2PC against plaintext."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.starfish import (check_thresholds, combine_targets, determine_thresholds,
                                estimate_updates, num_selected, select_rounds, selection_keys)
from protocols.starfish.round_selection import unit_rows

torch.set_num_threads(1)


def cosine_oracle(g: torch.Tensor, dm: torch.Tensor, k: int) -> list[int]:
    cos = F.cosine_similarity(g.double(), dm.double(), dim=-1)
    order = sorted(range(len(cos)), key=lambda i: (-float(cos[i]), i))
    return sorted(i + 1 for i in order[:k])


def test_num_selected_is_ceil():
    assert num_selected(40, 0.6) == 24
    assert num_selected(10, 0.55) == 6
    assert num_selected(3, 0.01) == 1
    with pytest.raises(ValueError):
        num_selected(10, 0.0)


@pytest.mark.parametrize("method", ["ratio", "divide"])
def test_round_selection_matches_cosine_ranking(method):
    gen = torch.Generator().manual_seed(11)
    T, m = 13, 30
    g = torch.randn(T, m, generator=gen, dtype=torch.float64)
    dm = torch.randn(T, m, generator=gen, dtype=torch.float64)
    dm[4] = 0.3 * g[4]          # strongly aligned round
    dm[7] = -g[7]               # anti-aligned round
    u, v = selection_keys(g, dm, g.norm(dim=-1))
    k = num_selected(T, 0.6)
    chosen = select_rounds(u, v, k, method=method)
    assert chosen == cosine_oracle(g, dm, k)
    assert 5 in chosen and 8 not in chosen and chosen == sorted(chosen)


def test_multi_target_squared_keys_match_cosine_of_weighted_sum():
    gen = torch.Generator().manual_seed(12)
    T, m = 9, 16
    g1 = torch.randn(T, m, generator=gen, dtype=torch.float64)
    g2 = torch.randn(T, m, generator=gen, dtype=torch.float64)
    dm = torch.randn(T, m, generator=gen, dtype=torch.float64)
    combined = combine_targets([g1, g2], [0.25, 0.75])
    assert torch.allclose(combined, 0.25 * g1 + 0.75 * g2)
    u, v = selection_keys(combined, dm, None)
    for method in ("ratio", "divide"):
        assert select_rounds(u, v, 4, method=method) == cosine_oracle(combined, dm, 4)


def test_thresholds_and_check_against_loops():
    gen = torch.Generator().manual_seed(13)
    deltas = torch.rand(5, 7, generator=gen, dtype=torch.float64)
    thr = determine_thresholds(deltas)
    assert torch.equal(thr, torch.tensor([max(r) for r in deltas.tolist()], dtype=torch.float64))
    est = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.5
    est[2, 3] = -thr[2]          # equality counts (>=), and the sign does not matter
    flags = check_thresholds(est, thr)
    expected = [int(any(abs(x) >= float(thr[r]) for x in est[r].tolist())) for r in range(5)]
    assert flags.tolist() == expected and flags[2] == 1


# ------------------------------------------------------------------ two-party run
def lab_2pc_program(party, inp: dict) -> dict:
    """The sub-protocols on shares, through exactly the calls the plaintext lab makes."""
    from mpc.crypten_compat import crypten
    from protocols import backend

    def sh(name, src):
        return crypten.cryptensor(torch.from_numpy(inp[name]), src=src)

    out = {}
    u, v = selection_keys(sh("g", 0), torch.from_numpy(inp["dm"]), sh("norms", 1))
    out["selected"] = select_rounds(u, v, 4, method="ratio")
    out["selected_div"] = select_rounds(u, v, 4, method="divide")
    out["thr"] = backend.reveal(determine_thresholds(sh("deltas", 1))).numpy()
    est = estimate_updates(sh("stored", 0), torch.from_numpy(inp["diff"]),
                           torch.from_numpy(inp["S"]), sh("Y", 1))
    out["est"] = backend.reveal(est).numpy()
    out["flags"] = check_thresholds(est, sh("thr_in", 0)).numpy()
    return out


def test_sub_protocols_two_party_match_plaintext():
    from mpc.launcher import run_parties

    rng = np.random.default_rng(5)
    lsb = 2.0**-16
    q = lambda a: np.round(np.asarray(a, dtype=np.float64) / lsb) * lsb  # noqa: E731
    T, m, n, b = 8, 12, 3, 2
    g = q(rng.normal(size=(T, m)))
    dm = q(rng.normal(size=(T, m)) * 0.5 + 0.3 * g)
    A = rng.normal(size=(m, m))
    A = A @ A.T / m + np.eye(m)
    S = q(rng.normal(size=(n, m, b)) * 0.5)
    Y = q(np.einsum("ij,njb->nib", A, S))
    inp = {"g": g, "dm": dm, "norms": q(np.linalg.norm(g, axis=1)),
           "deltas": q(rng.random((n, T))), "stored": q(rng.normal(size=(n, m)) * 0.3),
           "diff": q(rng.normal(size=m) * 0.2), "S": S, "Y": Y, "thr_in": q([0.1, 5.0, 0.5])}
    res = run_parties(lab_2pc_program, inp, insecure_tfp=True)
    out = res.values[0]
    t = {k: torch.from_numpy(v) for k, v in inp.items()}
    u, v = selection_keys(t["g"], t["dm"], t["norms"])
    assert out["selected"] == select_rounds(u, v, 4, method="ratio")
    assert out["selected_div"] == select_rounds(u, v, 4, method="divide")
    assert np.allclose(out["thr"], inp["deltas"].max(1), atol=1e-9)
    plain = estimate_updates(t["stored"], t["diff"], t["S"], t["Y"]).numpy()
    assert np.allclose(out["est"], plain, atol=5e-3, rtol=1e-2)
    assert out["flags"].tolist() == check_thresholds(torch.from_numpy(plain),
                                                     t["thr_in"]).tolist()


class _Models:
    """The public part of a history round selection reads: its global models."""

    def __init__(self, models: np.ndarray) -> None:
        self.models = torch.from_numpy(models)

    def model_delta(self, i: int) -> torch.Tensor:
        return self.models[i] - self.models[i - 1]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), T=st.integers(1, 6), m=st.integers(1, 40))
def test_unit_rows_are_the_normalised_global_steps_and_give_the_same_keys(data, T, m):
    """``unit_rows``: row k is (M_{i-1} - M_i) / ||M_{i-1} - M_i|| of the k-th round asked for, a
    zero step stays zero (numpy oracle); the keys from them equal those from the raw steps."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    models = np.cumsum(rng.normal(size=(T + 1, m)) * 10.0 ** rng.integers(-6, 3, size=(T + 1, 1)), axis=0)
    repeat = data.draw(st.sets(st.integers(1, T)))      # rounds whose model did not move
    for i in sorted(repeat):
        models[i] = models[i - 1]
    rounds = data.draw(st.lists(st.integers(1, T), min_size=1, max_size=T, unique=True))
    got = unit_rows(_Models(models), rounds).numpy()
    steps = np.stack([models[i - 1] - models[i] for i in rounds])
    norms = np.linalg.norm(steps, axis=1, keepdims=True)
    want = np.divide(steps, norms, out=np.zeros_like(steps), where=norms > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    assert np.all(got[norms[:, 0] == 0] == 0)
    g = torch.from_numpy(rng.normal(size=(len(rounds), m)))
    u, v = selection_keys(g, torch.from_numpy(steps), g.norm(dim=-1))
    u1, v1 = selection_keys(g, torch.from_numpy(got), g.norm(dim=-1), unit_steps=True)
    torch.testing.assert_close(u1, u, rtol=1e-12, atol=1e-15)
    assert torch.equal(v1, v)

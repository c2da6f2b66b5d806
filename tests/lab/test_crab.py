"""Crab's storage policy and recovery against hand computations on tiny problems."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.datasets import load_digits_dataset
from clients.models import build_model, flatten_params, load_params
from clients.partition import iid_split
from clients.training import LocalClient
from protocols.starfish.ports import RoundRecord, candidate_rounds
from lab.crab_storage import (
    CrabStorageParams,
    NotStored,
    RoundSignals,
    ScoredData,
    loss_windows,
    measure_signals,
    select_storage,
)
from lab.fl import run_federated
from lab.history import InMemoryHistory
from lab.metrics import arp
from lab.recovery import METHODS, Crab, Starfish
from lab.recovery.crab import client_reported_signals, crab_rollback
from tests.helpers.toy_clients import ToyUpdate

torch.set_num_threads(1)


@dataclass
class ToyClient:
    """Client whose update on M is grad f_j(M) for a closed-form f_j; logs its requests."""

    client_id: int
    grad: object
    num_samples: int = 1
    log: list | None = None

    def train(self, model_vec, round_idx, epochs=None):
        if self.log is not None:
            self.log.append((round_idx, self.client_id))
        g = self.grad(model_vec.to(torch.float64)).to(torch.float32)
        return ToyUpdate(g, float(g.norm()), float(g.abs().max()), self.num_samples)


def quad_client(j, center, a=1.0, num_samples=1, log=None):
    c = torch.as_tensor(center, dtype=torch.float64)
    return ToyClient(j, lambda m: a * (m - c), num_samples, log)


def hand_history(rounds, weights, lr, m0):
    """A history whose round t has exactly the updates ``rounds[t-1]`` (client -> vector)."""
    model = torch.tensor(m0, dtype=torch.float32)
    hist = InMemoryHistory(model, lr)
    for ups in rounds:
        g = {j: torch.tensor(v, dtype=torch.float32) for j, v in ups.items()}
        agg = sum(weights[j] * g[j].double() for j in g)
        model = (model.double() - lr * agg).float()
        parts = tuple(sorted(g))
        hist.append_round(RoundRecord(model, parts, {j: weights[j] for j in parts}, g,
                                      {j: g[j].norm().double() for j in parts},
                                      {j: g[j].abs().max().double() for j in parts}))
    return hist


def fixed(losses, divergences):
    """A signal source returning the given per-round scalars."""
    return lambda _history, _participants: RoundSignals(tuple(losses), tuple(divergences))


# ------------------------------------------------------------------ loss windows (alpha)
def test_loss_windows_close_at_and_not_above_the_threshold():
    # alpha = 0.1: thresholds 0.9 * 1.0 = 0.9, then 0.9 * 0.9 = 0.81, then 0.9 * 0.5 = 0.45
    losses = [1.0, 0.95, 0.9, 0.85, 0.5, 0.46, 0.44]
    assert loss_windows(losses, 0.1) == ([[1, 2], [3, 4], [5, 6]], [])
    # just above 0.9: round 2 does not close; round 3 (0.85 <= 0.9) does, then 0.5 <= 0.765
    above = [1.0, 0.95, 0.9 + 1e-9, 0.85, 0.5, 0.46, 0.44]
    assert loss_windows(above, 0.1) == ([[1, 2, 3], [4], [5, 6]], [])
    # the last loss just above 0.45: rounds 5, 6 stay in the open window
    open_tail = [1.0, 0.95, 0.9, 0.85, 0.5, 0.46, 0.45 + 1e-9]
    assert loss_windows(open_tail, 0.1) == ([[1, 2], [3, 4]], [5, 6])


def _two_client_history(T=8):
    clients = [quad_client(0, [1.0, 2.0]), quad_client(1, [-1.0, 0.5])]
    return run_federated(clients, torch.zeros(2), T, server_lr=0.5), clients


# windows [1], [2, 3, 4], [5, 6, 7, 8]: 0.5 <= 0.9; 0.4 <= 0.45; 0.3 <= 0.36
KL_LOSSES = [1.0, 0.5, 0.49, 0.48, 0.4, 0.39, 0.38, 0.37, 0.3]
KL_DIVS = [0.1, 0.3, 0.2, 0.3, 0.5, 0.1, 0.5, 0.1]


@pytest.mark.parametrize("lam, kept", [
    (0.6, [1, 2, 4, 5, 6, 7]),     # ceil(1.8) = 2 of [2,3,4]; ceil(2.4) = 3 of [5..8], 6 before 8
    (0.5, [1, 2, 4, 5, 7]),        # ceil(1.5) = 2, ceil(2.0) = 2
    (2 / 3, [1, 2, 4, 5, 6, 7]),   # 2/3 * 3 = 2 exactly: 2 (not 3); ceil(8/3) = 3
    (2 / 3 + 0.01, [1, 2, 3, 4, 5, 6, 7]),  # just above: 3 of 3
    (0.2, [1, 2, 5]),              # every window keeps at least one round (ties: earlier first)
    (1.0, list(range(1, 9))),
])
def test_kl_rule_keeps_the_most_changing_rounds_of_each_window(lam, kept):
    hist, _ = _two_client_history()
    storage = select_storage(hist, RoundSignals(KL_LOSSES, KL_DIVS),
                             CrabStorageParams(alpha=0.1, lam=lam, delta=1.0))
    assert storage.windows == ((1,), (2, 3, 4), (5, 6, 7, 8)) and storage.open_window == ()
    assert list(storage.kept_rounds) == kept


def test_open_window_is_selected_or_dropped():
    hist, _ = _two_client_history(T=5)
    signals = RoundSignals([1.0, 0.5, 0.49, 0.48, 0.47, 0.46], [0.1, 0.4, 0.3, 0.2, 0.5])
    kept = select_storage(hist, signals, CrabStorageParams(lam=0.5, delta=1.0))
    assert kept.windows == ((1,),) and kept.open_window == (2, 3, 4, 5)
    assert kept.kept_rounds == (1, 2, 5)          # ceil(0.5 * 4) = 2: D = 0.5 and 0.4
    dropped = select_storage(hist, signals, CrabStorageParams(lam=0.5, delta=1.0,
                                                              keep_open_window=False))
    assert dropped.kept_rounds == (1,)


# ------------------------------------------------------------------ cosine rule (delta)
FIVE = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [1.0, 1.0], 3: [-1.0, 0.0], 4: [2.0, 1.0]}


def _five_client_storage(delta):
    hist = hand_history([FIVE], {j: 0.2 for j in FIVE}, 1.0, [0.0, 0.0])
    return hist, select_storage(hist, RoundSignals([1.0, 0.5], [0.1]),
                                CrabStorageParams(delta=delta))


@pytest.mark.parametrize("delta, kept", [
    # G = (0.6, 0.6); cosines 1/sqrt2, 1/sqrt2, 1, -1/sqrt2, 3/sqrt10: order 2, 4, 0, 1, 3
    (0.6, (0, 2, 4)),         # 0.6 * 5 = 3 exactly: the tie 0/1 goes to the smaller id
    (0.59, (0, 2, 4)),        # ceil(2.95) = 3
    (0.61, (0, 1, 2, 4)),     # ceil(3.05) = 4
    (0.4, (2, 4)),
    (0.01, (2,)),             # at least one client
    (1.0, (0, 1, 2, 3, 4)),
])
def test_cosine_rule_keeps_the_clients_most_aligned_with_the_global_update(delta, kept):
    _, storage = _five_client_storage(delta)
    assert storage.kept_clients[1] == kept
    s2 = 1 / math.sqrt(2)
    expected = {0: s2, 1: s2, 2: 1.0, 3: -s2, 4: 3 / math.sqrt(10)}
    for j, c in expected.items():
        assert storage.cosines[1][j] == pytest.approx(c, abs=1e-6)


def test_stored_bytes_count_kept_updates_and_models_once():
    _, storage = _five_client_storage(0.6)
    # m = 2: models M_0, M_1 and 3 updates, 4 bytes each coordinate
    assert storage.stored_models == (0, 1)
    assert storage.stored_bytes == 4 * 2 * (2 + 3)
    assert storage.full_history_bytes == 4 * 2 * (2 + 5)
    hist, _ = _two_client_history()
    storage = select_storage(hist, RoundSignals(KL_LOSSES, KL_DIVS),
                             CrabStorageParams(lam=0.2, delta=0.5))
    # kept rounds 1, 2, 5 -> models {0,1} | {1,2} | {4,5}; one of two clients per round
    assert storage.kept_rounds == (1, 2, 5) and storage.stored_models == (0, 1, 2, 4, 5)
    assert storage.stored_updates == 3
    assert storage.stored_bytes == 4 * 2 * (5 + 3)
    assert storage.full_history_bytes == 4 * 2 * (9 + 16)
    assert storage.peak_buffer_bytes == 4 * 2 * (4 + 8)       # window [5..8], both clients


# ------------------------------------------------------------------ the reduced history
def test_reduced_history_exposes_only_what_was_kept():
    hist, _ = _two_client_history()
    storage = select_storage(hist, RoundSignals(KL_LOSSES, KL_DIVS),
                             CrabStorageParams(lam=0.2, delta=0.5))
    view = storage.view(hist)
    assert view.num_rounds == 8 and view.server_lr == hist.server_lr
    kept = {t: storage.kept_clients[t] for t in (1, 2, 5)}
    for t in range(1, 9):
        assert view.participants(t) == kept.get(t, ())
        assert dict(view.weights(t)) == {j: hist.weights(t)[j] for j in kept.get(t, ())}
    (j1,) = kept[1]
    assert torch.equal(view.update(1, j1), hist.update(1, j1))
    assert float(view.norm(1, j1)) == float(hist.norm(1, j1))
    assert torch.equal(view.model(4), hist.model(4))
    assert torch.equal(view.model_delta(5), hist.model_delta(5))
    with pytest.raises(NotStored, match="round 3 was not stored"):
        view.update(3, 0)
    with pytest.raises(NotStored, match=f"client {1 - j1}'s update of round 1 was not stored"):
        view.delta(1, 1 - j1)
    with pytest.raises(NotStored, match="model M_3 was not stored"):
        view.model(3)
    with pytest.raises(IndexError):
        view.participants(9)
    with pytest.raises(TypeError, match="read-only"):
        view.append_round(RoundRecord(hist.model(1), (), {}, {}, {}, {}))
    with pytest.raises(ValueError, match="not on this one"):
        storage.view(_two_client_history(T=7)[0])


def test_stage2_refuses_a_target_without_any_kept_update():
    hist, storage = _five_client_storage(0.4)            # keeps clients 2 and 4 only
    clients = [quad_client(j, [0.0, 0.0]) for j in FIVE]
    with pytest.raises(ValueError, match="never took part"):
        Starfish().unlearn(storage.view(hist), [3], clients)


# ------------------------------------------------------------------ rollback (beta)
# weights 1/2 (target 0), 1/4, 1/4; g1 = g2 in every round, so Gbar^- = g1
ROLL = [{0: [4, 0], 1: [4, 0], 2: [4, 0]},
        {0: [6, 3], 1: [4, 3], 2: [4, 3]},
        {0: [10, 3], 1: [4, 3], 2: [4, 3]},
        {0: [8, 3], 1: [4, 3], 2: [4, 3]}]
ROLL_W = {0: 0.5, 1: 0.25, 2: 0.25}
ROLL_SIGNALS = ([1.0, 0.5, 0.25, 0.125, 0.0625], [0.1, 0.1, 0.1, 0.1])
# remaining clients for the replay: ghat = M - c
C1, C2 = [-8.0, -6.0], [-12.0, -3.0]


def _roll_setup():
    hist = hand_history(ROLL, ROLL_W, 0.5, [0.0, 0.0])
    # FL by hand: Gbar = (4,0), (5,3), (7,3), (6,3); M = (-2,0), (-4.5,-1.5), (-8,-3), (-11,-4.5)
    assert torch.equal(hist.model(3), torch.tensor([-8.0, -3.0]))
    assert torch.equal(hist.model(4), torch.tensor([-11.0, -4.5]))
    clients = [quad_client(0, [0.0, 0.0], num_samples=2), quad_client(1, C1), quad_client(2, C2)]
    return hist, clients


def test_rollback_sensitivity_and_threshold_by_hand():
    hist, _ = _roll_setup()
    storage = select_storage(hist, RoundSignals(*ROLL_SIGNALS), CrabStorageParams(lam=1.0, delta=1.0))
    view = storage.view(hist)
    r = crab_rollback(view, storage.kept_rounds, [0], beta=0.3)
    # I(C) = Gbar_t - Gbar_{t-1}, I(C^-) = g1_t - Gbar_{t-1} (Gbar_0 = 0):
    #   t=1: (4,0),(4,0)   t=2: (1,3),(0,3)   t=3: (2,0),(-1,0)   t=4: (-1,0),(-3,0)
    assert r.gaps == (0.0, 1.0, 3.0, 2.0) and r.influences == (4.0, 3.0, 1.0, 3.0)
    assert r.sensitivity == (0.0, 0.0, 1.0, 4.0, 6.0)
    assert r.threshold == pytest.approx((0.0, 1.2, 2.1, 2.4, 3.3))
    assert (r.index, r.model_round, r.replay) == (3, 2, (3, 4))


@pytest.mark.parametrize("beta, index, model_round, replay", [
    (0.3, 3, 2, (3, 4)),
    (0.49, 3, 2, (3, 4)),     # candidate 4: S = 4 > 0.49 * 8
    (0.5, 4, 3, (4,)),        # candidate 4 at equality, S = 4 = 0.5 * 8; candidate 5: 6 > 5.5
    (0.55, 5, 4, ()),         # candidate 5: 6 <= 6.05: after the last kept round, no replay
    (0.0, 2, 1, (2, 3, 4)),   # beta = 0: the last candidate with S = 0
])
def test_rollback_round_at_and_around_beta(beta, index, model_round, replay):
    hist, _ = _roll_setup()
    storage = select_storage(hist, RoundSignals(*ROLL_SIGNALS), CrabStorageParams(lam=1.0, delta=1.0))
    r = crab_rollback(storage.view(hist), storage.kept_rounds, [0], beta=beta)
    assert (r.index, r.model_round, r.replay) == (index, model_round, replay)


def test_crab_calibrated_replay_by_hand():
    hist, clients = _roll_setup()
    crab = Crab(lam=1.0, delta=1.0, beta=0.5, signals=fixed(*ROLL_SIGNALS))
    model, cost = crab.unlearn(hist, [0], clients)
    # from M_3 = (-8,-3), round 4 only: ghat1 = (0,3), ghat2 = (4,0), stored norms ||(4,3)|| = 5
    # -> (0,5), (5,0); weights 1/4, 1/4 renormalised: (2.5, 2.5); M = M_3 - 0.5 (2.5, 2.5)
    assert torch.equal(model, torch.tensor([-9.25, -4.25]))
    assert cost.client_computations == {1: 1, 2: 1} and cost.rounds_used == 1
    assert cost.selected_rounds == [4] and arp(cost) == pytest.approx(75.0)
    extra = cost.extra
    assert extra["rollback_round"] == 3 and extra["stored_rounds"] == 4
    assert extra["stored_updates"] == 12 and extra["stored_bytes"] == 4 * 2 * (5 + 12)
    assert extra["full_history_bytes"] == extra["stored_bytes"]
    assert (extra["alpha"], extra["lambda"], extra["delta"], extra["beta"]) == (0.1, 1.0, 1.0, 0.5)


def test_crab_replay_of_two_rounds_matches_numpy():
    hist, clients = _roll_setup()
    model, cost = Crab(lam=1.0, delta=1.0, beta=0.3, signals=fixed(*ROLL_SIGNALS)).unlearn(
        hist, [0], clients)
    m = np.array([-4.5, -1.5])
    for _ in (3, 4):                       # stored norms of clients 1, 2 in rounds 3, 4: 5
        steps = [5.0 * (m - np.array(c)) / np.linalg.norm(m - np.array(c)) for c in (C1, C2)]
        m = m - 0.5 * (0.5 * steps[0] + 0.5 * steps[1])
    assert np.allclose(model.double().numpy(), m, atol=1e-5)
    assert cost.extra["rollback_round"] == 2 and cost.client_computations == {1: 2, 2: 2}


def test_crab_without_rollback_returns_the_last_kept_model():
    hist, clients = _roll_setup()
    model, cost = Crab(lam=1.0, delta=1.0, beta=0.55, signals=fixed(*ROLL_SIGNALS)).unlearn(
        hist, [0], clients)
    assert torch.equal(model, hist.model(4)) and cost.rounds_used == 0 and arp(cost) == 100.0


def _random_run(seed, n=5, m=3, T=6):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(n, m, generator=gen, dtype=torch.float64) * 2
    scales = (0.5 + torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
    log: list = []
    clients = [ToyClient(j, (lambda mm, c=centers[j], a=scales[j]: a * (mm - c)), j + 1, log)
               for j in range(n)]
    return run_federated(clients, torch.zeros(m), T, server_lr=0.3), clients, centers, scales, log


def test_crab_pipeline_with_partial_storage_matches_numpy():
    hist, clients, centers, scales, log = _random_run(3)
    losses = [1.0, 0.95, 0.85, 0.8, 0.7, 0.68, 0.6]    # windows [1,2], [3,4], [5,6]
    divs = [0.3, 0.1, 0.2, 0.4, 0.1, 0.2]
    crab = Crab(lam=0.5, delta=0.6, beta=0.3, signals=fixed(losses, divs))
    model, cost = crab.unlearn(hist, [0], clients)

    # storage, independently: one round per window (max D), ceil(0.6 * 5) = 3 clients by cosine
    U = {(t, j): hist.update(t, j).double().numpy() for t in range(1, 7) for j in range(5)}
    kept_rounds = [1, 4, 6]
    kept = {}
    for t in kept_rounds:
        d = (hist.model(t - 1) - hist.model(t)).double().numpy()
        cos = {j: U[t, j] @ d / (np.linalg.norm(U[t, j]) * np.linalg.norm(d)) for j in range(5)}
        kept[t] = sorted(sorted(range(5), key=lambda j: (-cos[j], j))[:3])
    assert cost.extra["kept_rounds"] == kept_rounds
    w = {j: (j + 1) / 15 for j in range(5)}

    def agg(t, ids):
        tot = sum(w[j] for j in ids)
        return sum(w[j] / tot * U[t, j] for j in ids)

    prev, gaps, infl = np.zeros(3), [], []
    for t in kept_rounds:
        benign = [j for j in kept[t] if j != 0]
        i_all = agg(t, kept[t]) - prev
        i_ben = agg(t, benign) - prev if benign else np.zeros(3)
        gaps.append(np.linalg.norm(i_all - i_ben))
        infl.append(np.linalg.norm(i_ben))
        prev = agg(t, kept[t])
    S = np.concatenate([[0.0], np.cumsum(gaps)])
    Phi = 0.3 * np.concatenate([[0.0], np.cumsum(infl)])
    j_star = max(j for j in range(1, 5) if S[j - 1] <= Phi[j - 1])
    start = kept_rounds[j_star - 1] - 1 if j_star <= 3 else kept_rounds[-1]
    assert cost.extra["rollback_round"] == start
    assert cost.extra["sensitivity"] == pytest.approx(S.tolist())

    m = hist.model(start).double().numpy()
    asked = []
    for t in kept_rounds[j_star - 1:]:
        rest = [j for j in kept[t] if j != 0]
        tot = sum(w[j] for j in rest)
        step = np.zeros(3)
        for j in rest:
            fresh = scales[j] * (m - centers[j].numpy())
            step += w[j] / tot * np.linalg.norm(U[t, j]) * fresh / np.linalg.norm(fresh)
            asked.append((t, j))
        m = m - 0.3 * step
    assert np.allclose(model.double().numpy(), m, atol=1e-5)
    assert log[6 * 5:] == asked                     # after the 6 FL rounds: only kept pairs
    assert cost.total_client_computations() == len(asked)


# ------------------------------------------------------------------ Starfish on the reduced history
def test_starfish_runs_on_the_reduced_history_with_the_kept_clients_only():
    """Isotropic quadratics make Starfish's estimates exact, so Stage II on the reduced history
    is exact FedAvg of the *kept* remaining clients on the selected (kept) rounds."""
    hist, clients, centers, scales, log = _random_run(5, n=6, m=4, T=10)
    losses = [1.0, 0.8, 0.75, 0.7, 0.6, 0.58, 0.5, 0.49, 0.48, 0.47, 0.4]
    divs = [0.3, 0.1, 0.2, 0.4, 0.1, 0.2, 0.1, 0.3, 0.2, 0.1]
    storage = select_storage(hist, RoundSignals(losses, divs), CrabStorageParams(lam=0.6, delta=0.5))
    view = storage.view(hist)
    assert any(0 in storage.kept_clients[t] for t in storage.kept_rounds)   # the target was kept
    del log[:]
    model, cost = Starfish(sigma=0.6, beta=0.1, buffer=2).unlearn(view, [0], clients)

    rest = [j for j in view.clients() if j != 0]
    cands = candidate_rounds(view, rest)
    assert set(cands) <= set(storage.kept_rounds)
    assert set(cost.selected_rounds) <= set(cands)
    assert len(cost.selected_rounds) == math.ceil(0.6 * len(cands))
    kept_pairs = set(storage.kept_pairs)
    assert log and all(pair in kept_pairs for pair in log)
    # this case exercises both gaps: a remaining client kept in some selected rounds only, and
    # remaining clients never kept at all (Stage II does not know them: not asked, no ARP entry)
    present = {t: {j for j in storage.kept_clients[t] if j != 0} for t in cost.selected_rounds}
    assert len({frozenset(p) for p in present.values()}) > 1
    never = set(range(1, 6)) - set(rest)
    assert never and not never & set(cost.client_computations)
    m_hat = np.zeros(4)
    for t in cost.selected_rounds:
        present = [j for j in storage.kept_clients[t] if j != 0]
        tot = sum(j + 1 for j in present)
        m_hat = m_hat - 0.3 * sum((j + 1) / tot * scales[j] * (m_hat - centers[j].numpy())
                                  for j in present)
    assert np.allclose(model.double().numpy(), m_hat, atol=1e-4)


# ------------------------------------------------------------------ signals
def test_measure_signals_by_hand():
    # one parameter a = M[0]: data set A predicts (a, 1-a), label 0; B predicts (1-a, a), label 0
    hist = hand_history([{0: [-0.6]}, {0: [-0.2]}], {0: 1.0}, 0.5, [0.5])   # a = 0.5, 0.8, 0.9

    def lp(flip):
        return lambda v: torch.log(torch.stack([1 - v[0], v[0]] if flip else [v[0], 1 - v[0]])
                                   .reshape(1, 2).double())

    sig = measure_signals(hist, [ScoredData(1.0, lp(False), torch.tensor([0])),
                                 ScoredData(3.0, lp(True), torch.tensor([0]))])
    a = [0.5, 0.8, 0.9]
    for t in range(3):
        assert sig.losses[t] == pytest.approx(0.25 * -math.log(a[t]) + 0.75 * -math.log(1 - a[t]),
                                              rel=1e-6)
    for t in (1, 2):
        p, q = a[t - 1], a[t]
        kl = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))   # same for A and B
        assert sig.divergences[t - 1] == pytest.approx(kl, rel=1e-5)


def test_client_reports_equal_the_loss_and_kl_on_the_union_of_the_data():
    ds = load_digits_dataset().subset_train(120)
    fac = build_model("logreg", ds.input_shape)
    parts = iid_split(ds.y_train, 3, seed=0)
    clients = [LocalClient(j, ds.x_train[torch.as_tensor(p)], ds.y_train[torch.as_tensor(p)], fac,
                           epochs=1, lr=0.2, batch_size=16) for j, p in enumerate(parts)]
    torch.manual_seed(0)
    hist = run_federated(clients, flatten_params(fac()), 3, server_lr=0.2)
    per_client = client_reported_signals(hist, clients)
    x = torch.cat([c.x for c in clients])
    y = torch.cat([c.y for c in clients])
    net = fac()

    def union_log_probs(v):
        load_params(net, v)
        with torch.no_grad():
            return torch.log_softmax(net(x), dim=-1)

    union = measure_signals(hist, [ScoredData(1.0, union_log_probs, y)])
    assert per_client.losses == pytest.approx(union.losses, rel=1e-5)
    assert per_client.divergences == pytest.approx(union.divergences, rel=1e-4)
    assert per_client.losses[3] < per_client.losses[0]
    with pytest.raises(ValueError, match="client 2's reported loss"):
        client_reported_signals(hist, clients[:2])


# ------------------------------------------------------------------ properties and errors
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), lam=st.floats(0.05, 1.0), delta=st.floats(0.05, 1.0))
def test_every_kept_item_outranks_every_discarded_one(seed, lam, delta):
    gen = torch.Generator().manual_seed(seed)
    n, m, T = 4, 3, 7
    ups = [{j: torch.randn(m, generator=gen).tolist() for j in range(n)} for _ in range(T)]
    hist = hand_history(ups, {j: 0.25 for j in range(n)}, 0.5, [0.0] * m)
    losses = [1.0] + sorted(torch.rand(T, generator=gen).tolist(), reverse=True)
    divs = torch.rand(T, generator=gen).tolist()
    storage = select_storage(hist, RoundSignals(losses, divs), CrabStorageParams(lam=lam, delta=delta))
    windows = [list(w) for w in storage.windows] + ([list(storage.open_window)]
                                                    if storage.open_window else [])
    assert sorted(t for w in windows for t in w) == list(range(1, T + 1))
    for w in windows:
        kept = [t for t in w if t in storage.kept_rounds]
        assert len(kept) == max(1, math.ceil(round(lam * len(w), 9)))
        assert min(divs[t - 1] for t in kept) >= max((divs[t - 1] for t in w if t not in kept),
                                                       default=-1.0)
    for t in storage.kept_rounds:
        cos = storage.cosines[t]
        kept = storage.kept_clients[t]
        assert len(kept) == max(1, math.ceil(round(delta * n, 9)))
        assert min(cos[j] for j in kept) >= max((cos[j] for j in range(n) if j not in kept),
                                                default=-2.0)
    models = {0} | {i for t in storage.kept_rounds for i in (t - 1, t)}
    assert storage.stored_bytes == 4 * m * (len(models) + storage.stored_updates)


def test_bad_parameters_are_refused():
    for kwargs, what in [({"alpha": 0.0}, "alpha"), ({"alpha": 1.0}, "alpha"),
                         ({"lam": 0.0}, "lambda"), ({"delta": 1.5}, "delta"),
                         ({"beta": -0.1}, "beta")]:
        with pytest.raises(ValueError, match=what):
            Crab(**kwargs)
    with pytest.raises(ValueError, match="T \\+ 1 losses"):
        RoundSignals((1.0, 0.5), (0.1, 0.2))
    with pytest.raises(ValueError, match="finite"):
        RoundSignals((1.0, float("nan")), (0.1,))
    hist, _ = _two_client_history(T=3)
    with pytest.raises(ValueError, match="signals cover 2 rounds"):
        select_storage(hist, RoundSignals((1.0, 0.5, 0.2), (0.1, 0.1)))


# ------------------------------------------------------------------ the lab
def test_lab_runs_crab_on_the_digits(tmp_path):
    from bench.lab import main as lab_main   # noqa: PLC0415 (only this test needs the CLI)

    assert "crab" in METHODS
    out = tmp_path / "out"
    rc = lab_main(["--dataset", "digits", "--clients", "4", "--rounds", "6", "--epochs", "1",
                   "--train-limit", "160", "--test-limit", "60", "--targets", "0",
                   "--method", "retrain,crab", "--out", str(out), "--quiet"])
    assert rc == 0
    result = json.loads((out / "lab.json").read_text())
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == {"original (with target)", "retrain", "crab"}
    assert 0.0 <= rows["crab"]["ter"] <= 1.0 and rows["crab"]["l2_to_retrain"] is not None
    extra = result["costs"]["crab"]["extra"]
    m = result["config"]["num_params"]
    assert extra["stored_bytes"] == 4 * m * (extra["stored_models"] + extra["stored_updates"])
    assert extra["full_history_bytes"] == 4 * m * (7 + 6 * 4)
    assert extra["stored_updates"] == 3 * extra["stored_rounds"]      # ceil(0.7 * 4) = 3
    assert 0 <= extra["rollback_round"] <= 6
    assert (extra["alpha"], extra["lambda"], extra["delta"], extra["beta"]) == (0.1, 0.6, 0.7, 0.3)
